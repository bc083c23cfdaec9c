"""Serving with Triton: the tools (launcher, model-repository writer with fill_template, client, quick
start, TensorRT-LLM check) and what the Triton models share (request validation, model parameters,
liveness)."""
