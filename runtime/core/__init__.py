"""One step: sequences, KV cache, plan, scheduler, draft policy, model runner, sampling, CUDA graphs."""
