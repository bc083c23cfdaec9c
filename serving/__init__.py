"""Serving: the Triton deployment (launcher, model-repository writer with fill_template, client, quick start,
TensorRT-LLM check, and what the Triton models share: request validation, model parameters, liveness) and the
OpenAI-compatible server (`serving.openai_server`)."""
