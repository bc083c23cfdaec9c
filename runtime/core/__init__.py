"""One step: sequences, KV cache, plan, scheduler, draft policy, model runner, MTP proposer, step inputs, sampling,
CUDA graphs."""
