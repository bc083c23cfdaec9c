"""A request's life in an executor, shared by every backend's: its id, its stop conditions (stop token ids and eos,
max_tokens, stop strings), UTF-8-safe text deltas and statistics (RequestTracker), and the ranking of best_of's
candidates, so the native executor and the TensorRT-LLM adapter answer the same request the same way; and what the
native executor's requests make of each step (OutputProcessor).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, TypeVar

from runtime.core.plan import Scheduled, StepResult
from runtime.core.sampling import TokenLogprob
from runtime.core.sampling_params import SamplingParams
from runtime.core.sequence import Sequence
from runtime.executors.handles import RequestHandle
from runtime.executors.outputs import FAILED_REASONS, RequestOutput, RequestStats, so_far
from runtime.io.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("runtime.executors.requests")


class RequestIds:
    """Ids of the requests in flight, and how many have finished. Ids are claimed and released on callers' threads
    (submit) and on the executor's loop thread, so the set of ids is locked; `finished` is written by the loop thread
    alone (`end`) and read as it stands by stats()."""

    def __init__(self) -> None:
        self._live: set[str] = set()
        self._lock = threading.Lock()
        self._counter = itertools.count()
        self.finished = 0  # requests whose last output has ended (ExecutorStats.requests_finished)

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

    @contextlib.contextmanager
    def claimed(self, request_id: str | None) -> Iterator[str]:
        """`claim`, released again if submitting the request fails in the block (refused, shut down, a failure
        making its state): a leaked id stays "already in flight" for good."""
        rid = self.claim(request_id)
        try:
            yield rid
        except BaseException:
            self.release(rid)
            raise

    def end(self, tracker: "RequestTracker", last: bool, reason: str, new: list[int] | None = None, delta: str = "",
            error: str | None = None) -> None:
        """End one output of a request (finished by its stop rules, cancelled or failed), the same way in every
        backend: the request's last output frees its id and counts it finished before the final output goes out, so a
        callback's stats() sees it finished."""
        if last:
            self.release(tracker.request_id)
            self.finished += 1
        if error:
            log.error("request %s[%d] failed: %s", tracker.request_id, tracker.index, error)
        tracker.report(new or [], delta, reason, error)


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
        shown = (lambda lps: lps) if self.show_logprobs else (lambda lps: None)  # computed to rank, not asked for
        return [replace(o, index=i, new_token_ids=o.token_ids, text_delta=o.text, mid_character=False,
                        new_logprobs=shown(o.logprobs), logprobs=shown(o.logprobs),
                        cumulative_logprob=shown(o.cumulative_logprob))
                for i, o in enumerate(finals[: self.n])]


T = TypeVar("T", bound="RequestTracker")


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
    index: int = 0  # which of the request's outputs (n / best_of) it follows
    best_of: BestOf | None = None  # best_of > n: where its outputs wait for the ranking
    stop_reason: str | int | None = None  # RequestOutput.stop_reason, once consume() finds it

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @classmethod
    def create(cls: type[T], request_id: str, num_prompt_tokens: int, params: SamplingParams, tokenizer: Tokenizer,
               handle: RequestHandle, callback: Callable[[RequestOutput], None] | None = None, **fields: Any) -> T:
        return cls(request_id, num_prompt_tokens, params, handle, IncrementalDetokenizer(tokenizer),
                   params.stop_ids(tokenizer.eos_token_id), callback, **fields)

    @classmethod
    def create_group(cls: type[T], request_id: str, num_prompt_tokens: int, params: SamplingParams, size: int,
                     tokenizer: Tokenizer, handle: RequestHandle,
                     callback: Callable[[RequestOutput], None] | None = None, **fields: Any) -> list[T]:
        """The trackers of a request's `size` outputs, output i at `index` i: its n outputs, or (size > n) best_of's
        candidates, whose outputs wait for their ranking (`BestOf`; each computes logprobs to be ranked by). The
        prompt logprobs, computed once, are every output's: the first's list is theirs. `fields`: a subclass's own,
        the same for every output. The trackers hold no reference to each other: a request's are freed as its
        sequences end, not left to the cycle collector (which may run where what their callbacks hold is gone)."""
        best_of = BestOf(params.n, size, params.logprobs is not None) if size > params.n else None
        if best_of is not None and params.logprobs is None:
            params = replace(params, logprobs=0)
        group: list[T] = []
        for i in range(size):
            group.append(cls.create(request_id, num_prompt_tokens, params, tokenizer, handle, callback, index=i,
                                    best_of=best_of,
                                    prompt_logprobs=group[0].prompt_logprobs if i else None, **fields))
        return group

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


Report = tuple[str, list[int], str, "str | None"]  # a sequence's id, the tokens it keeps, their text, why it ends


class OutputProcessor:
    """What the native executor's requests make of each step, the one writer of their RequestTrackers in the step
    loop (when each was first scheduled, what it found in the prefix cache, prompt logprobs, the stop rules and a
    grammar's cut of its tokens, its speculation counts) and of the executor's totals (`counts`), as vLLM v1's output
    processor: the scheduler plans, the runner computes, `process` decides what each request keeps and how it ends,
    the scheduler applies that to its sequences, `deliver` reports it."""

    def __init__(self, requests: dict[str, tuple[Sequence, RequestTracker]], blocks_for: Callable[[int], int]):
        self.requests = requests  # the executor's requests in flight, by Sequence.request_id (read here)
        self.blocks_for = blocks_for  # KV blocks that hold a number of tokens
        # ExecutorStats' totals: output tokens, drafts run and kept, prompt blocks found in the prefix cache and not
        self.counts = dict(generated=0, drafted=0, accepted=0, reused_blocks=0, missed_blocks=0)

    def scheduled(self, plan: list[Scheduled], now: float) -> None:
        """A step's sequences scheduled at `now` (before it runs: a step that fails reports them too): when each request
        was first scheduled, and what its prompt found in the prefix cache."""
        for item in plan:
            tracker = self.requests[item.seq.request_id][1]
            if tracker.first_scheduled_time is None:
                tracker.first_scheduled_time = now
                prompt_blocks = self.blocks_for(tracker.num_prompt_tokens)
                self.counts["reused_blocks"] += item.seq.num_reused_blocks
                self.counts["missed_blocks"] += prompt_blocks - item.seq.num_reused_blocks
                # an output of n / best_of reports what its request found in the prefix cache: what the first
                # sequence found (the others share the blocks it computed)
                first = item.seq.leader or item.seq
                tracker.num_reused_blocks = first.num_reused_blocks
                tracker.num_missed_blocks = prompt_blocks - first.num_reused_blocks

    def process(self, results: list[StepResult], now: float) -> tuple[dict[Sequence, int], set[Sequence], list[Report]]:
        """A step's results at `now`, through each request's stop rules: how many emitted tokens each sequence keeps
        (for `Scheduler.update_from_output`), those that end, and what to report once the scheduler has applied the
        step (`deliver`)."""
        reports, failed, kept, finished = [], [], {}, set()
        for r in results:
            tracker = self.requests[r.seq.request_id][1]
            if r.prompt_logprobs:
                tracker.prompt_logprobs += r.prompt_logprobs
            if r.grammar_error is not None:
                # a grammar that failed while this step's masks were computed: the rows it masked are not its guide's,
                # so the request keeps none of this step's tokens and ends (its grammar, not the engine: the others
                # go on)
                kept[r.seq] = 0
                finished.add(r.seq)
                failed.append((r.seq.request_id, [], "", None))
            elif r.new_token_ids:
                tokens, logprobs = r.new_token_ids, r.logprobs
                if r.seq.grammar is not None:
                    keep = r.seq.grammar.num_keepable(tokens)
                    tokens, logprobs = tokens[:keep], logprobs[:keep] if logprobs is not None else None
                new, delta, reason = tracker.consume(tokens, now, logprobs)
                accepted = min(r.num_accepted, len(new))  # drafts the output keeps (a stop can cut the rest)
                tracker.num_steps += 1
                tracker.num_draft_tokens += r.num_drafts
                tracker.num_accepted_draft_tokens += accepted
                self.counts["drafted"] += r.num_drafts
                self.counts["accepted"] += accepted
                self.counts["generated"] += len(new)
                kept[r.seq] = len(new)
                if reason is not None:
                    finished.add(r.seq)
                reports.append((r.seq.request_id, new, delta, reason))
        return kept, finished, reports + failed

    def deliver(self, reports: list[Report], finish: Callable[..., None]) -> None:
        """Report a step's outputs, in order, once the scheduler has applied it: a request whose grammar failed
        (computing this step's masks, or consuming the tokens it kept, drawn under its masks: it ends with them)
        ends with that error, a finished one with its reason, through `finish` (the executor's end of a sequence:
        its id, reason, new tokens, delta, error=...; passed, not kept, so that no cycle holds the executor)."""
        for rid, new, delta, reason in reports:
            seq, tracker = self.requests[rid]
            if seq.grammar is not None and seq.grammar.error is not None:
                error = f"guided_decoding.{seq.params.guided_decoding.kind}: {seq.grammar.error}"
                finish(rid, "error", new, delta, error=error)
            elif reason is None:
                tracker.report(new, delta, None)
            else:
                finish(rid, reason, new, delta)
