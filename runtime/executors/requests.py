"""The output side of a request, shared by every backend's executor.

Stop conditions (stop token ids and eos, max_tokens, stop strings),
UTF-8-safe text deltas, per-request statistics and delivery to callbacks and iterators live here
once, so the native executor and the TensorRT-LLM adapter answer the same request the same way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable, Iterator, Protocol, Sequence, TypeVar, overload

from runtime.core.sampling import TokenLogprob
from runtime.core.sampling_params import SamplingParams
from runtime.io.tokenizer import IncrementalDetokenizer, Tokenizer



class Canceller(Protocol):
    """What a request handle needs of its executor."""

    def cancel(self, request_id: str, handle: "RequestHandle | None" = None) -> None: ...

log = logging.getLogger("runtime.executors.requests")

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


@dataclass
class ExecutorStats:
    running: int
    queued: int
    kv_blocks_used: int
    kv_blocks_free: int  # cached blocks no request holds included (evicted when new content needs them)
    requests_finished: int
    generated_tokens: int
    draft_tokens: int
    accepted_draft_tokens: int
    current_draft_len: int
    acceptance_estimate: float
    kv_blocks_cached: int = 0  # blocks holding reusable prefix content, held by a request or free
    world_size: int = 1  # processes running the model (tensor/expert-parallel ranks)
    rank_memory_bytes: list[int] = field(default_factory=list)  # resident memory of each, rank 0 first
    kv_reused_blocks: int = 0  # prompt blocks found in the prefix cache, over every sequence admitted (n / best_of's
    # outputs count the blocks they share with their first; each output's stats count what its request found)
    kv_missed_blocks: int = 0  # and those not found

    @property
    def kv_cache_hit_rate(self) -> float:
        blocks = self.kv_reused_blocks + self.kv_missed_blocks
        return self.kv_reused_blocks / blocks if blocks else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


class RequestHandle:
    """Outputs of one request: iterate (blocking or async) over deltas, or wait for the result.

    The handle keeps the newest output of each of the request's outputs (`RequestOutput.index`; one unless
    SamplingParams.n > 1) and what iteration has not handed out yet. An output that arrives before a consumer has
    taken the one of the same index waiting is merged into it (tokens and text deltas joined, the rest from the
    newer), as vLLM merges the outputs a slow consumer has not collected: a consumer that falls behind, or only
    waits for the result, holds one output per index rather than one per step. An output leaves only when a consumer takes it, under the lock, so an async wait cancelled by a timeout
    loses nothing and the same iterator carries on. Async consumers wait on a future of their own event loop,
    woken by the executor's thread, not on a worker thread each (a pool's threads would run out with many
    streams). Waiting for the result wakes when the request finishes, not at every output (a batch's waiters
    would take turns at the GIL with the executor's thread). Waiting on the thread that delivers the outputs (an
    output callback's) is refused: what it waits for would never come.
    """

    def __init__(self, request_id: str, executor: Canceller, num_outputs: int = 1,
                 delivered_by: threading.Thread | None = None):
        self.request_id = request_id
        self.num_outputs = num_outputs
        self._executor = executor
        self._delivered_by = delivered_by  # the thread that pushes the outputs (and runs output callbacks)
        self._last: dict[int, RequestOutput] = {}  # the newest output of each index
        self._pending: dict[int, _Unread] = {}  # not taken yet, per index: every output since
        self._finals_taken = 0
        self._buffered = True  # False after callback_only(): outputs go to on_output alone
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        lock = threading.Lock()
        self._arrived = threading.Condition(lock)  # any output
        self._finished = threading.Condition(lock)  # the final one of every index

    def _push(self, out: RequestOutput) -> None:
        with self._arrived:
            self._last[out.index] = out
            if self._buffered:
                held = self._pending.get(out.index)
                if held is None:
                    self._pending[out.index] = _Unread(out)
                else:
                    held.add(out)
            self._arrived.notify_all()
            if self.finished:
                self._finished.notify_all()
            waiters, self._async_waiters = self._async_waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # that consumer's event loop is closed: nobody waits there any more
                pass

    def _take(self) -> RequestOutput:
        """The oldest output not handed out yet; call with the lock held and something pending."""
        out = self._pending.pop(next(iter(self._pending))).output()
        self._finals_taken += out.finished
        if self._delivered_final:  # another thread iterating the handle waits for what will now never come
            self._arrived.notify_all()
        return out

    def callback_only(self) -> None:
        """Keep no outputs for iteration from now on, for a caller that reads them through on_output alone (the
        engine process's child, a Triton model): each output merged into an unread one copies every token so
        far, O(n^2) over a long stream. result() and finished still answer; iterating raises."""
        with self._arrived:
            self._buffered, self._pending = False, {}

    def _check_can_wait(self, name: str) -> None:
        """Refuse a wait on the thread that would end it: an output callback waiting on a handle stalled every
        request of the executor."""
        if threading.current_thread() is self._delivered_by:
            raise RuntimeError(f"{name} of request {self.request_id} cannot wait on the thread that delivers "
                               "outputs (an output callback): it would wait forever; wait from another thread")

    def _check_buffered(self) -> None:
        if not self._buffered:
            raise RuntimeError(f"request {self.request_id}'s outputs go to its on_output callback only "
                               "(callback_only() was called); it cannot be iterated")

    @property
    def finished(self) -> bool:
        """Every output of the request has its final one."""
        return len(self._last) == self.num_outputs and all(o.finished for o in self._last.values())

    @property
    def _delivered_final(self) -> bool:
        return self._finals_taken == self.num_outputs

    def cancel(self) -> None:
        """Cancel this request; a no-op once it has finished, even if a later request reuses its id."""
        self._executor.cancel(self.request_id, handle=self)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The final output of a request with one output (`results` gives each of several)."""
        if self.num_outputs != 1:
            raise ValueError(f"request {self.request_id} has {self.num_outputs} outputs (n); use results()")
        return self.results(timeout)[0]

    def results(self, timeout: float | None = None) -> list[RequestOutput]:
        """The final output of each of the request's outputs, by index."""
        with self._finished:
            if not self.finished:
                self._check_can_wait("results()")
            if not self._finished.wait_for(lambda: self.finished, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            return [self._last[i] for i in range(self.num_outputs)]

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            with self._arrived:
                self._check_buffered()
                if self._delivered_final:
                    return
                if not self._pending:
                    self._check_can_wait("iterating the outputs")
                self._arrived.wait_for(lambda: bool(self._pending) or self._delivered_final)
                if not self._pending:
                    return
                out = self._take()
            yield out

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            with self._arrived:
                self._check_buffered()
                if self._delivered_final:
                    raise StopAsyncIteration
                if self._pending:
                    return self._take()
                loop = asyncio.get_running_loop()
                future = loop.create_future()
                self._async_waiters.append((loop, future))
            await future


@dataclass(eq=False)
class _Unread:
    """What no consumer has taken yet of one of a request's outputs: the newest output and, once a second has
    arrived, the new tokens, text deltas and logprobs of all of them gathered in lists of its own, each appended
    once (joining them at every arrival would copy everything unread each time: O(n^2) for a consumer that only
    waits for the result)."""

    newest: RequestOutput
    gathered: tuple[list[int], list[str], list[TokenLogprob] | None] | None = None

    def add(self, out: RequestOutput) -> None:
        if self.gathered is None:
            first = self.newest
            self.gathered = (list(first.new_token_ids), [first.text_delta],
                             None if first.new_logprobs is None else list(first.new_logprobs))
        ids, texts, logprobs = self.gathered
        ids += out.new_token_ids
        texts.append(out.text_delta)
        if logprobs is not None and out.new_logprobs is not None:
            logprobs += out.new_logprobs
        self.newest = out

    def output(self) -> RequestOutput:
        """The newest output, carrying what every one of them brought."""
        if self.gathered is None:
            return self.newest
        ids, texts, logprobs = self.gathered
        return replace(self.newest, new_token_ids=ids, text_delta="".join(texts),
                       new_logprobs=None if self.newest.new_logprobs is None else logprobs)


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class RequestIds:
    """Ids of the requests in flight; submit runs on callers' threads, so access is locked."""

    def __init__(self) -> None:
        self._live: set[str] = set()
        self._lock = threading.Lock()
        self._counter = itertools.count()

    def claim(self, request_id: str | None) -> str:
        """A fresh id when None; a given one must not be in flight already."""
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        rid = request_id or f"req-{next(self._counter)}-{uuid.uuid4().hex[:8]}"
        with self._lock:
            if rid in self._live:
                raise ValueError(f"request_id {rid!r} is already in flight")
            self._live.add(rid)
        return rid

    def release(self, request_id: str) -> None:
        with self._lock:
            self._live.discard(request_id)


@dataclass(eq=False)
class BestOf:
    """best_of > n: the candidates' outputs wait until every candidate has finished; then the n with the highest
    cumulative logprob (vLLM's ranking; ties keep index order) go out, best first, each whole (its text as one
    delta), re-indexed 0..n-1. A request cancelled or failed is not ranked: its first n candidates go out as they
    ended. Candidates compute logprobs for the ranking; they are returned only where the request asked for them."""

    n: int
    best_of: int
    show_logprobs: bool
    finals: dict[int, RequestOutput] = field(default_factory=dict)

    def rank(self, out: RequestOutput) -> list[RequestOutput]:
        """What to deliver once `out` has arrived: nothing until the last candidate's final output."""
        if not out.finished:
            return []
        self.finals[out.index] = out
        if len(self.finals) < self.best_of:
            return []
        finals = [self.finals[i] for i in range(self.best_of)]
        if not any(o.failed for o in finals):
            finals.sort(key=lambda o: o.cumulative_logprob, reverse=True)
        shown = (lambda lps: lps) if self.show_logprobs else (lambda lps: None)
        return [replace(o, index=i, new_token_ids=o.token_ids, text_delta=o.text, mid_character=False,
                        new_logprobs=shown(o.logprobs), logprobs=shown(o.logprobs))
                for i, o in enumerate(finals[: self.n])]


@dataclass(eq=False)
class RequestTracker:
    """What a request has reported so far, and the rules for what it reports next."""

    request_id: str
    num_prompt_tokens: int
    params: SamplingParams
    handle: RequestHandle
    detok: IncrementalDetokenizer
    stop_ids: frozenset[int]
    callback: Callable[[RequestOutput], None] | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    token_ids: list[int] = field(default_factory=list)  # output tokens reported
    text: str = ""  # reported so far
    held: str = ""  # decoded but not reported yet (could start a stop string)
    stop_after: int = 0  # a stop string must end past this many characters of `held` (min_tokens)
    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    finished: bool = False
    logprobs: list[TokenLogprob] | None = None  # of the output tokens reported, when asked for
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled by the prefill steps, when asked for
    index: int = 0  # which of the request's sequences (n / best_of) it follows
    best_of: BestOf | None = None  # best_of > n: where its outputs wait for the ranking
    stop_reason: str | int | None = None  # RequestOutput.stop_reason, once consume() finds it

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @classmethod
    def create(cls, request_id: str, num_prompt_tokens: int, params: SamplingParams, tokenizer: Tokenizer,
               handle: RequestHandle,
               callback: Callable[[RequestOutput], None] | None = None) -> "RequestTracker":
        return cls(request_id, num_prompt_tokens, params, handle, IncrementalDetokenizer(tokenizer),
                   params.stop_ids(tokenizer.eos_token_id), callback)

    def consume(self, new: list[int], now: float, logprobs: list[TokenLogprob] | None = None
                ) -> tuple[list[int], str, str | None]:
        """Apply the stop rules to newly generated ids (and keep the logprobs of those kept): returns (ids kept,
        text delta, finish reason).

        Ids are taken one at a time, so a step that emitted several (speculation) ends exactly where
        plain decoding would: before a stop id, at the token that reaches max_tokens,
        or at the token that completes a stop string (the text cut before it, or after it with
        include_stop_str_in_output). With stop strings, the last (longest stop - 1) characters are held back until
        they can no longer start one, so a client never sees part of a stop string that ends the text before it.
        Before min_tokens no stop string ends a request (as vLLM): one counts only when it ends in the text of a
        later token.
        """
        p = self.params
        if new:
            self.first_token_time = self.first_token_time or now
            self.last_token_time = now
        kept: list[int] = []
        reason, hit = None, -1
        for t in new:
            if t in self.stop_ids:
                reason = "stop"
                self.stop_reason = t if t in p.stop_token_ids else None
            else:
                kept.append(t)
                self.held += self.detok.push([t])
                emitted = len(self.token_ids) + len(kept)
                if emitted >= p.max_tokens:  # validation keeps prompt + max_tokens within max_seq_len
                    reason = "length"
            if reason:
                self.held += self.detok.flush()
            if p.stop and len(self.token_ids) + len(kept) < p.min_tokens:
                self.stop_after = len(self.held)
            elif p.stop:
                found = [(i, s) for s in p.stop if (i := self.held.find(s, max(self.stop_after - len(s) + 1, 0))) >= 0]
                if found:  # the earliest in the text (the first listed of those starting there)
                    hit, self.stop_reason = min(found, key=lambda f: f[0])
            if reason or hit >= 0:
                break
        self.token_ids += kept
        if self.logprobs is not None:
            for lp in logprobs[: len(kept)]:
                self.logprobs.append(lp)
                self.cumulative_logprob += lp.logprob
        if hit >= 0:
            delta, reason = self.held[: hit + (len(self.stop_reason) if p.include_stop_str_in_output else 0)], "stop"
        elif reason is None and p.stop:
            delta = self.held[: max(len(self.held) - (max(map(len, p.stop)) - 1), 0)]
        else:
            delta = self.held
        self.held = self.held[len(delta):]
        self.stop_after = max(self.stop_after - len(delta), 0)
        self.text += delta
        return kept, delta, reason

    def stats(self) -> RequestStats:
        n_out = len(self.token_ids)
        ttft = self.first_token_time - self.arrival_time if self.first_token_time else None
        tpot = (self.last_token_time - self.first_token_time) / (n_out - 1) if n_out > 1 else None
        queue = self.first_scheduled_time - self.arrival_time if self.first_scheduled_time else None
        return RequestStats(self.num_prompt_tokens, n_out, self.num_draft_tokens, self.num_accepted_draft_tokens,
                            self.num_steps, ttft, tpot, queue, self.num_reused_blocks, self.num_missed_blocks)

    def report(self, new: list[int], delta: str, reason: str | None, error: str | None = None) -> None:
        """Deliver one output (final when reason is set) to the callback and the handle. A request that
        ends without consume() deciding it (cancelled, failed) also delivers the text held back for a
        possible stop string: it belongs to tokens already reported."""
        if reason in FAILED_REASONS:
            held, self.held = self.held + self.detok.flush(), ""
            self.text += held
            delta += held
        self.finished = reason is not None
        lps = self.logprobs
        out = RequestOutput(self.request_id, new, so_far(self.token_ids, self.finished), delta, self.text,
                            self.finished, reason, self.stats(), error, self.detok.holding,
                            None if lps is None else lps[len(lps) - len(new):],
                            None if lps is None else so_far(lps, self.finished),
                            None if lps is None else self.cumulative_logprob, self.prompt_logprobs,
                            stop_reason=self.stop_reason if reason == "stop" else None, index=self.index)
        for o in [out] if self.best_of is None else self.best_of.rank(out):
            if self.callback is not None:
                try:
                    self.callback(o)
                except BaseException:  # user code on the executor's thread (even sys.exit) must not stop serving
                    log.exception("output callback of %s failed", self.request_id)
            self.handle._push(o)
        if self.finished:
            s = out.stats
            log.info("request %s[%d] finished (%s): %d prompt + %d output tokens, %d/%d drafts accepted",
                     self.request_id, self.index, reason, s.prompt_tokens, s.output_tokens, s.num_accepted_draft_tokens,
                     s.num_draft_tokens)


def check_callback(on_output: object) -> None:
    """An output callback is a callable or None (else it failed at every output, on the executor's thread)."""
    if on_output is not None and not callable(on_output):
        raise ValueError(f"on_output must be a callable taking a RequestOutput, or None; got {on_output!r:.80}")


def so_far(items: list[T], final: bool) -> Sequence[T]:
    """An output's view of a list that grows with its request: the list itself once it no longer grows (the final
    output), else a Prefix of what it holds now."""
    return items if final else Prefix(items)
