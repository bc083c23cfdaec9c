"""Native runtime for DeepSeek-V3/R1 with MTP speculative decoding.

`Session`, `SamplingParams` and `GuidedDecodingParams` are imported lazily, so that light users of the package (the
Triton tokenizer models) do not load the model code and torch.
"""

__all__ = ["CompletionOutput", "GenerationFailed", "GenerationResult", "GuidedDecodingParams", "SamplingParams",
           "Session"]


def __getattr__(name: str):
    if name in ("SamplingParams", "GuidedDecodingParams"):
        from runtime.core import sampling_params

        return getattr(sampling_params, name)
    if name in ("Session", "GenerationResult", "CompletionOutput", "GenerationFailed"):
        from runtime.executors import session

        return getattr(session, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
