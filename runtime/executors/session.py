"""The Python entry point: open a checkpoint or an engine, generate text, with MTP drafting.

    from runtime import Session, SamplingParams
    with Session("models/deepseek-v3-mini", num_draft_tokens=3) as s:
        [out] = s.generate(["def fib(n):"], SamplingParams(max_tokens=64))
        print(out.text, out.stats.acceptance_rate)

A session runs on the in-flight batching executor: the prompts of one `generate` call share steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from runtime.core.sampling import TokenLogprob
from runtime.core.sampling_params import SamplingParams
from runtime.executors.backends import create_executor
from runtime.executors.base import ExecutorConfig, submit_all
from runtime.executors.outputs import RequestStats
from runtime.io.tokenizer import utf8_size


@dataclass
class CompletionOutput:
    """One output of a prompt (vLLM's and TensorRT-LLM's name); SamplingParams.n gives a prompt n of them."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids (SamplingParams.logprobs)
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: eos or another end)
    error: str | None = None  # what went wrong, when finish_reason is "error" (an executor or rank that failed)


@dataclass
class GenerationResult:
    """A prompt's outputs; `text`, `token_ids` and the rest are its first output's (its only one unless n > 1;
    the best one with best_of)."""

    prompt: str
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, the first None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stats(self) -> RequestStats:
        return self.outputs[0].stats

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def cumulative_logprob(self) -> float | None:
        return self.outputs[0].cumulative_logprob

    @property
    def error(self) -> str | None:
        return self.outputs[0].error


class GenerationFailed(RuntimeError):
    """A streamed request that ended without running to its end: cancelled (the session closed) or an error."""


class Session:
    def __init__(self, path: str | Path, speculation: str = "fixed", **config: Any):
        """`config` is ExecutorConfig's fields (num_draft_tokens, device, dtype, enable_block_reuse, max_batch_size,
        kv_cache_tokens, ...) with their defaults, but for `speculation`: 'fixed' drafts num_draft_tokens every step;
        'adaptive' (the servers' default, for load) picks up to that many per step from the batch size and measured
        acceptance, after profiling the step costs at start; a script's few requests at a time draft best at a fixed
        k, so 'fixed' is the default here. num_draft_tokens=0 is plain decoding, None (the default) drafts 3 where the
        model has an MTP layer (at most the engine's max_draft_len) and none where not.
        An engine built with --backend trtllm runs on TensorRT-LLM (runtime.executors.trtllm)."""
        self.executor = create_executor(path, ExecutorConfig(speculation=speculation, **config))
        self.tokenizer = self.executor.tokenizer

    def _encode(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt must be a non-empty string")
        utf8_size(prompt, "prompt")
        return self.tokenizer.encode(prompt)

    def generate(self, prompts: str | list[str], params: SamplingParams | None = None) -> list[GenerationResult]:
        """One result per prompt, in order; all prompts run together in the in-flight batch."""
        if not isinstance(prompts, (str, list, tuple)):
            raise ValueError(f"prompts must be a string or a list of strings, got {type(prompts).__name__}")
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = params or SamplingParams()
        handles = submit_all(self.executor, [self._encode(p) for p in prompts], params)
        results = []
        try:
            for prompt, handle in zip(prompts, handles):
                outs = handle.results()
                results.append(GenerationResult(prompt, [CompletionOutput(o.index, o.text, o.token_ids, o.finish_reason,
                                                                          o.stats, o.logprobs, o.cumulative_logprob,
                                                                          o.stop_reason, o.error)
                                                         for o in outs], outs[0].prompt_logprobs))
        finally:  # interrupted (Ctrl-C): nobody will read the rest, so they stop and free their blocks
            for handle in handles:
                if not handle.finished:
                    handle.cancel()
        return results

    def stream(self, prompt: str, params: SamplingParams | None = None) -> Iterator[str]:
        """Text deltas as they are decoded; each is valid UTF-8 on its own. Invalid parameters raise
        here; the request starts at the first next(). One output only (n = 1). A request that ends without running
        to its end (the executor failed or was shut down) raises `GenerationFailed` after its last delta, so a
        cut-off text never reads as finished."""
        ids, params = self._encode(prompt), params or SamplingParams()
        self.executor.validate(ids, params)
        if params.num_sequences != 1:
            raise ValueError("stream() yields one output's text; n and best_of must be 1 (use generate)")
        return self._deltas(ids, params)

    def _deltas(self, ids: list[int], params: SamplingParams) -> Iterator[str]:
        handle = self.executor.submit(ids, params)
        try:
            for out in handle:
                if out.text_delta:
                    yield out.text_delta
                if out.failed:
                    raise GenerationFailed(f"the request ended {out.finish_reason}"
                                           + (f": {out.error}" if out.error else ""))
        finally:
            if not handle.finished:
                handle.cancel()

    def close(self) -> None:
        """Stop the executor (requests in flight end "cancelled"); a second call does nothing. A native
        executor left open is stopped at interpreter exit (runtime.executors.lifetime.stop_at_exit)."""
        self.executor.shutdown()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
