"""The executor contract, the native and TensorRT-LLM executors, the engine in a process of its own, tensor- and
expert-parallel ranks, child-process lifetime, request lifecycle, Session."""
