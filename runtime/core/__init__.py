"""One step: sequences and their sampling parameters, the KV cache and its prefix reuse (prefix_cache), the plan, the
scheduler, the draft policy and its step-cost profile (cost_profile), the model runner (verify and accept), the MTP
proposer, the inputs both build (step_inputs), sampling and acceptance rules, guided decoding's grammars (grammar,
guide_check), CUDA graphs."""
