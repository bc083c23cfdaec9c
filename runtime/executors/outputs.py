"""What a request's outputs carry: its tokens, text and logprobs as they grow (a view, not a copy, of the lists
while they grow), why it finished, and its statistics; the same for every backend's executor."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence, TypeVar, overload

from runtime.core.sampling import TokenLogprob

FAILED_REASONS = ("cancelled", "error")  # finish reasons of a request that did not run to its end

T = TypeVar("T")


class Prefix(Sequence[T]):
    """The first `length` items of a list that only grows: a streamed output's token_ids and logprobs so far,
    without copying every one so far into every output (O(n^2) over a long stream). Reads like a list
    (equality with lists, slices and `+` give lists); list() it to keep it as one (json, mutation)."""

    __slots__ = ("_items", "_length")

    def __init__(self, items: list[T]):
        self._items = items
        self._length = len(items)

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> list[T]: ...

    def __getitem__(self, i: int | slice) -> T | list[T]:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._length)
            return self._items[start:stop] if step == 1 else [self._items[j] for j in range(start, stop, step)]
        if not -self._length <= i < self._length:
            raise IndexError("Prefix index out of range")
        return self._items[i % self._length]

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(self._items, self._length)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, Prefix)):
            return len(other) == self._length and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __add__(self, other: Sequence[T]) -> list[T]:
        return self[:] + list(other)

    def __radd__(self, other: Sequence[T]) -> list[T]:
        return list(other) + self[:]

    def __repr__(self) -> str:
        return repr(self[:])

    def __reduce__(self) -> tuple:  # pickled (the engine process's pipe) as the list it shows
        return list, (self[:],)


@dataclass
class RequestStats:
    prompt_tokens: int
    output_tokens: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    num_steps: int
    ttft_s: float | None  # submit -> the first step that emitted tokens
    tpot_s: float | None  # (last token - first token) / (output tokens - 1), as vLLM and trtllm-bench compute it
    queue_s: float | None = None  # submit -> the first step that scheduled it (None: the backend does not say)
    # prompt KV blocks found in the prefix cache at its first admission, and the others (TensorRT-LLM's
    # kv_cache_metrics names; 0 and 0 where the backend does not say)
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def kv_cache_hit_rate(self) -> float:
        """Reused prompt blocks over all prompt blocks."""
        blocks = self.num_reused_blocks + self.num_missed_blocks
        return self.num_reused_blocks / blocks if blocks else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.output_tokens / self.num_steps if self.num_steps else 0.0


@dataclass
class RequestOutput:
    """One output of a request. `token_ids` and `logprobs` (all so far) of an output before the final one are
    `Prefix` views of the request's growing lists, not copies; the final output's are the lists themselves."""

    request_id: str
    new_token_ids: list[int]
    token_ids: Sequence[int]
    text_delta: str
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "cancelled" | "error" (FAILED_REASONS: it did not run to its end)
    stats: RequestStats
    error: str | None = None  # what went wrong when finish_reason is "error"
    mid_character: bool = False  # the tokens so far end inside a character: their text comes with later tokens
    # with SamplingParams.logprobs: one per token of new_token_ids / token_ids, and the sum over token_ids
    new_logprobs: list[TokenLogprob] | None = None
    logprobs: Sequence[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    # with SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0  # which of the request's n outputs (SamplingParams.n) this is
    # what ended it with finish_reason "stop", as the LLM API's stop_reason: the stop string, or the stop token id of
    # SamplingParams.stop_token_ids; None for eos and every other ending
    stop_reason: str | int | None = None

    @property
    def failed(self) -> bool:
        """It ended without running to its end (cancelled, or an error)."""
        return self.finish_reason in FAILED_REASONS


def so_far(items: list[T], final: bool) -> Sequence[T]:
    """An output's view of a list that grows with its request: the list itself once it no longer grows (the final
    output), else a Prefix of what it holds now."""
    return items if final else Prefix(items)
