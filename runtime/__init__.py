"""Native runtime for DeepSeek-V3/R1 with MTP speculative decoding."""

from runtime.sampling import SamplingParams
from runtime.session import GenerationResult, Session

__all__ = ["GenerationResult", "SamplingParams", "Session"]
