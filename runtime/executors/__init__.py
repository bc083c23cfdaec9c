"""The executor contract (base), which executor serves a path (backends), the native executor and the TensorRT-LLM
one (trtllm, over trtllm_api's mapping to upstream's LLM API), the engine in a process of its own (process),
tensor- and expert-parallel ranks, child-process lifetime, a request's outputs (outputs), its handle (handles), its
life in an executor (requests), the errors a caller acts on (errors), and Session."""
