"""In-flight batching executor: a request queue and a step loop on its own thread.

Requests join the running batch at any step and leave when done; each step is planned by the
scheduler and run by the model runner. The executor owns time and threads: it turns emitted
tokens into text deltas (valid UTF-8), applies stop conditions, streams outputs to callbacks and
iterators, and frees a cancelled request's blocks at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator

import torch

from runtime.engine import LoadedEngine, load_engine
from runtime.kv_cache import KVCache
from runtime.sampling import RelaxedAcceptance, SamplingParams
from runtime.scheduler import DraftPolicy, Scheduler, SchedulerConfig, StepCosts
from runtime.sequence import Sequence, Status
from runtime.tokenizer import IncrementalDetokenizer, Tokenizer
from runtime.worker import ModelRunner, Scheduled

log = logging.getLogger("runtime.executor")


@dataclass(frozen=True)
class ExecutorConfig:
    """Serving settings; limits left as None come from the engine and may not exceed it."""

    num_draft_tokens: int = 3
    speculation: str = "adaptive"  # "off" | "fixed" | "adaptive"
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_seq_len: int | None = None
    kv_cache_tokens: int | None = None  # cache capacity in tokens (default: max_batch_size x max_seq_len)
    device: str = "cpu"
    dtype: str | None = None
    relaxed_acceptance: RelaxedAcceptance | None = None


@dataclass
class RequestStats:
    prompt_tokens: int
    output_tokens: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    num_steps: int
    ttft_s: float | None
    tpot_s: float | None

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.output_tokens / self.num_steps if self.num_steps else 0.0


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    text_delta: str
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "cancelled" | "error"
    stats: RequestStats


@dataclass
class ExecutorStats:
    running: int
    queued: int
    kv_blocks_used: int
    kv_blocks_free: int
    requests_finished: int
    generated_tokens: int
    draft_tokens: int
    accepted_draft_tokens: int
    current_draft_len: int
    acceptance_estimate: float

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


class RequestHandle:
    """Outputs of one request: iterate (blocking or async) over deltas, or wait for the result."""

    def __init__(self, request_id: str, executor: "Executor"):
        self.request_id = request_id
        self._executor = executor
        self._outputs: queue.Queue[RequestOutput] = queue.Queue()
        self._final: RequestOutput | None = None
        self._done = threading.Event()

    def _push(self, out: RequestOutput) -> None:
        if out.finished:
            self._final = out
            self._done.set()
        self._outputs.put(out)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        self._executor.cancel(self.request_id)

    def result(self, timeout: float | None = None) -> RequestOutput:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return self._final

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self._outputs.get()
            yield out
            if out.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            out = await asyncio.to_thread(self._outputs.get)
            yield out
            if out.finished:
                return


@dataclass(eq=False)
class _Request:
    seq: Sequence
    handle: RequestHandle
    detok: IncrementalDetokenizer
    stop_ids: frozenset[int]
    callback: Callable[[RequestOutput], None] | None
    text: str = ""  # reported so far
    held: str = ""  # decoded but not reported yet (could start a stop string)
    emitted: int = 0  # output tokens already reported


class Executor:
    def __init__(self, engine: str | Path | LoadedEngine, config: ExecutorConfig = ExecutorConfig()):
        self.engine = engine if isinstance(engine, LoadedEngine) else load_engine(
            engine, device=config.device, dtype=config.dtype)
        build, cfg = self.engine.build, self.engine.model_config
        self.config = config
        self.limits = SchedulerConfig(
            max_batch_size=self._limit("max_batch_size", config.max_batch_size, build.max_batch_size),
            max_num_tokens=self._limit("max_num_tokens", config.max_num_tokens, build.max_num_tokens),
            max_seq_len=self._limit("max_seq_len", config.max_seq_len, build.max_seq_len))
        k = config.num_draft_tokens if config.speculation != "off" else 0
        if k > build.max_draft_len:
            raise ValueError(f"num_draft_tokens {k} exceeds the engine's max_draft_len {build.max_draft_len} "
                             f"({self.engine.path})")
        if k and cfg.num_nextn_predict_layers == 0:
            raise ValueError(f"{self.engine.path}: the model has no MTP layer; use num_draft_tokens=0")
        self.tokenizer = Tokenizer.from_dir(self.engine.tokenizer_dir)
        block = build.kv_block_size
        capacity = config.kv_cache_tokens or self.limits.max_batch_size * (self.limits.max_seq_len + k + block)
        self.cache = KVCache(cfg, num_blocks=-(-capacity // block) + 1, block_size=block,
                             dtype=next(self.engine.model.parameters()).dtype, device=config.device)
        self.runner = ModelRunner(self.engine.model, self.cache, config.relaxed_acceptance,
                                  keep_mtp_inputs=k > 0)
        costs = self.profile(k) if config.speculation == "adaptive" and k else None
        self.policy = DraftPolicy(config.speculation if k else "off", k, costs)
        self.scheduler = Scheduler(self.limits, self.cache, self.policy)
        self._requests: dict[str, _Request] = {}
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._wake = threading.Event()
        self._counts = dict(finished=0, generated=0, drafted=0, accepted=0)
        self._ids = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="executor", daemon=True)
        self._thread.start()

    def _limit(self, name: str, asked: int | None, built: int) -> int:
        if asked is None:
            return built
        if asked > built:
            raise ValueError(f"{name} {asked} exceeds the engine's {name} {built} ({self.engine.path}); "
                             f"rebuild the engine with --{name} {asked}")
        return asked

    # ---- public API ---------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None] | None = None, request_id: str | None = None) -> RequestHandle:
        """Queue a request; invalid parameters raise ValueError naming the parameter."""
        params.validate(self.engine.model_config.vocab_size)
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        vocab = self.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if n >= self.limits.max_seq_len:
            raise ValueError(f"prompt has {n} tokens; max_seq_len is {self.limits.max_seq_len}")
        if n + params.max_tokens > self.limits.max_seq_len:
            raise ValueError(f"max_tokens {params.max_tokens} with a {n}-token prompt exceeds max_seq_len "
                             f"{self.limits.max_seq_len}; at most {self.limits.max_seq_len - n}")
        if self._stopping:
            raise RuntimeError("executor is shut down")
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(6), "little")
        seq = Sequence(rid, list(prompt_token_ids), n, params, seed)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)
        handle = RequestHandle(rid, self)
        req = _Request(seq, handle, IncrementalDetokenizer(self.tokenizer), frozenset(stop_ids), on_output)
        self._inbox.put(("add", req))
        self._wake.set()
        return handle

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))
        self._wake.set()

    def stats(self) -> ExecutorStats:
        c = self._counts
        return ExecutorStats(
            running=len(self.scheduler.running), queued=len(self.scheduler.waiting) + self._inbox.qsize(),
            kv_blocks_used=self.cache.allocator.num_used, kv_blocks_free=self.cache.allocator.num_free,
            requests_finished=c["finished"], generated_tokens=c["generated"], draft_tokens=c["drafted"],
            accepted_draft_tokens=c["accepted"], current_draft_len=self.scheduler.last_k,
            acceptance_estimate=self.policy.acceptance)

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- profiling for adaptive speculation ---------------------------------------------------
    @torch.inference_mode()
    def profile(self, max_k: int, context: int = 64, repeats: int = 3) -> StepCosts:
        """Time target forwards (q tokens per sequence) and MTP forwards at a few batch sizes."""
        model, cache = self.engine.model, self.cache
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= self.limits.max_batch_size]
        if sizes[-1] != self.limits.max_batch_size:
            sizes.append(self.limits.max_batch_size)
        tables = [cache.allocator.allocate(cache.blocks_for(context + max_k + 1)) for _ in range(sizes[-1])]
        try:
            def timed(fn) -> float:
                fn()
                t0 = time.perf_counter()
                for _ in range(repeats):
                    fn()
                return (time.perf_counter() - t0) / repeats

            target = {q: [] for q in range(1, max_k + 2)}
            mtp = []
            for b in sizes:
                seqs = tables[:b]
                for q in target:
                    ids = torch.zeros(b * q, dtype=torch.long, device=self.config.device)
                    batch = self.runner._paged_batch(
                        [Sequence("p", [], 0, SamplingParams(), 0, block_table=t) for t in seqs], [context] * b, [q] * b)
                    target[q].append(timed(lambda: model.logits(model(ids, batch=batch, kv_cache=cache.tensor))))
                ids = torch.zeros(b, dtype=torch.long, device=self.config.device)
                hidden = torch.zeros(b, model.cfg.hidden_size, dtype=model.lm_head.weight.dtype, device=self.config.device)
                batch = self.runner._paged_batch(
                    [Sequence("p", [], 0, SamplingParams(), 0, block_table=t) for t in seqs], [context] * b, [1] * b)
                mtp.append(timed(lambda: model.mtp_forward(0, ids, hidden, batch=batch, kv_cache=cache.tensor)))
        finally:
            for t in tables:
                cache.allocator.free(t)
        return StepCosts(sizes, target, mtp)

    # ---- the step loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            if not self.scheduler.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            plan = self.scheduler.schedule()
            if not plan:
                continue
            try:
                results = self.runner.step(plan)
            except Exception as e:  # a broken step fails its requests, never the executor
                log.exception("step failed")
                for item in plan:
                    self._finish(self._requests[item.seq.request_id], "error", error=str(e))
                continue
            self.scheduler.after_step(results)
            now = time.perf_counter()
            for r in results:
                if r.new_token_ids:
                    self._process(self._requests[r.seq.request_id], r.num_drafts, r.num_accepted, now)
        for req in list(self._requests.values()):
            self._finish(req, "cancelled")

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._requests[item.seq.request_id] = item
                self.scheduler.add(item.seq)
            elif item in self._requests:
                self._finish(self._requests[item], "cancelled")

    def _process(self, req: _Request, num_drafts: int, num_accepted: int, now: float) -> None:
        """Apply stop conditions to the tokens a step emitted, then report the delta.

        With stop strings, the last (longest stop - 1) characters are held back until they can no
        longer start a stop string, so a client never sees part of one.
        """
        seq, p = req.seq, req.seq.params
        seq.first_token_time = seq.first_token_time or now
        seq.last_token_time = now
        self._counts["drafted"] += num_drafts
        self._counts["accepted"] += num_accepted
        start = seq.num_prompt_tokens + req.emitted
        new, reason = seq.token_ids[start:], None
        for i, t in enumerate(new):
            if t in req.stop_ids:
                new, reason = new[:i], "stop"
                break
            if req.emitted + i + 1 >= p.max_tokens or start + i + 1 >= self.limits.max_seq_len:
                new, reason = new[: i + 1], "length"
                break
        del seq.token_ids[start + len(new):]
        req.emitted += len(new)
        self._counts["generated"] += len(new)
        req.held += req.detok.push(new) + (req.detok.flush() if reason else "")
        hits = [i for i in (req.held.find(s) for s in p.stop) if i >= 0]
        if hits:
            delta, reason = req.held[: min(hits)], "stop"
        elif reason is None and p.stop:
            keep = max(map(len, p.stop)) - 1
            delta = req.held[: max(len(req.held) - keep, 0)]
        else:
            delta = req.held
        req.held = req.held[len(delta):]
        req.text += delta
        if reason is not None:
            self._finish(req, reason, new, delta)
        else:
            self._report(req, new, delta, False, None)

    def _report(self, req: _Request, new: list[int], delta: str, finished: bool, reason: str | None) -> None:
        seq = req.seq
        n_out = seq.num_output_tokens
        ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time else None
        tpot = ((seq.last_token_time - seq.first_token_time) / (n_out - 1)) if n_out > 1 else None
        stats = RequestStats(seq.num_prompt_tokens, n_out, seq.num_draft_tokens, seq.num_accepted_draft_tokens,
                             seq.num_steps, ttft, tpot)
        out = RequestOutput(seq.request_id, new, seq.token_ids[seq.num_prompt_tokens :], delta, req.text, finished,
                            reason, stats)
        if req.callback is not None:
            try:
                req.callback(out)
            except Exception:
                log.exception("output callback of %s failed", seq.request_id)
        req.handle._push(out)

    def _finish(self, req: _Request, reason: str, new: list[int] | None = None, delta: str = "",
                error: str | None = None) -> None:
        self.scheduler.remove(req.seq)
        self._requests.pop(req.seq.request_id, None)
        req.seq.finish_reason = reason
        self._counts["finished"] += 1
        if error:
            log.error("request %s failed: %s", req.seq.request_id, error)
        self._report(req, new or [], delta, True, reason)
        log.info("request %s finished (%s): %d prompt + %d output tokens, acceptance %.2f",
                 req.seq.request_id, reason, req.seq.num_prompt_tokens, req.seq.num_output_tokens,
                 req.seq.num_accepted_draft_tokens / max(req.seq.num_draft_tokens, 1))
