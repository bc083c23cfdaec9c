"""The executor contract, the native and TensorRT-LLM executors, request lifecycle, Session."""
