"""The executor contract (base), the native and TensorRT-LLM executors, the engine in a process of its own,
tensor- and expert-parallel ranks, child-process lifetime, a request's outputs (outputs), its handle (handles) and
its life in an executor (requests), Session."""
