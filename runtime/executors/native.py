"""In-flight batching executor: a request queue and a step loop on its own thread.

Requests join the running batch at any step and leave when done. A step: the scheduler plans it, the model runner
runs it, the output processor (runtime.executors.requests) applies each request's stop conditions to the emitted
tokens, the scheduler applies what they keep to its sequences, and the output processor streams text deltas (valid
UTF-8) to callbacks and iterators. The executor owns time and threads, and frees a cancelled request's blocks at once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import torch

from runtime.core.cuda_graphs import CudaGraphRunner
from runtime.executors.lifetime import forget_at_exit, rss_bytes, stop_at_exit
from runtime.executors.ranks import RankFailure, RankGroup, RankOptions, drive
from runtime.io.engine_format import BuildConfig, EngineManifest, read_limits, read_manifest
from runtime.io.loading import LoadedEngine, load_engine
from runtime.core.kv_cache import KVCache, free_memory_bytes
from runtime.core.sampling_params import SEED_MODULUS, SamplingParams, fresh_seed, validate_request
from runtime.core.cost_profile import profile_step_costs
from runtime.core.draft_policy import DraftPolicy
from runtime.core.grammar import GrammarCompiler
from runtime.core.prefix_cache import PrefixCache
from runtime.core.scheduler import Scheduler
from runtime.executors.base import ExecutorConfig, ExecutorStats, ServingPlan
from runtime.executors.errors import QueueFull
from runtime.executors.handles import RequestHandle, check_callback
from runtime.executors.outputs import RequestOutput, RequestStats
from runtime.executors.requests import OutputProcessor, RequestIds, RequestTracker
from runtime.core.sequence import LogitBias, PenaltyState, Sequence
from runtime.io.tokenizer import Tokenizer
from runtime.core.model_runner import ModelRunner

__all__ = ["Executor", "ExecutorStats", "RequestHandle", "RequestOutput", "RequestStats"]

log = logging.getLogger("runtime.executors.native")


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """This thread's torch threads at `n` inside the block (None: as they are); the setting before comes back after."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n is not None:
            torch.set_num_threads(before)


class Executor:
    def __init__(self, engine: str | Path | LoadedEngine, config: ExecutorConfig = ExecutorConfig(),
                 manifest: EngineManifest | None = None):
        """`manifest`: the engine directory's engine.json as the caller read it (read here when None)."""
        self.config = config
        self.ranks: RankGroup | None = None  # ranks 1.. of a tensor-parallel engine, in processes of their own
        self.tokenizer: Tokenizer | None = None
        plan = None
        if not isinstance(engine, LoadedEngine):
            path = Path(engine)
            manifest = manifest or read_manifest(path)
            plan = self._check_settings(path, manifest)
        try:
            self.engine = engine if isinstance(engine, LoadedEngine) else self._load(path, manifest, plan)
            if plan is None:  # a loaded engine given: it runs in this process
                e = self.engine
                plan = config.resolve(e.build, e.model_config, str(e.path), e.built, loaded=True)
            share = self.ranks.threads if self.ranks is not None else None
            with torch_threads(share):  # the step costs profiled as the steps will run
                self._setup(plan)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close(graceful=False)
            raise
        own = torch.get_num_threads()
        self._threads_set = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="executor", daemon=True)
        self._thread.start()
        if share is not None:  # torch keeps one setting for threads started later: the caller's again, not the share
            self._threads_set.wait()
            torch.set_num_threads(own)
        stop_at_exit(self, lambda: self.shutdown(timeout=None))  # left open: stopped before the interpreter ends

    def _check_settings(self, path: Path, manifest: EngineManifest | None) -> ServingPlan | None:
        """The settings resolved against engine.json / config.json, so what they refuse is refused before a weight
        loads (or a rank starts), and the tokenizer read (a bad one is said before the weights load, not after); a
        directory without either is left to the loader to refuse (None)."""
        if manifest is None and not (path / "config.json").is_file():
            return None
        cfg, build = read_limits(path, manifest)
        plan = self.config.resolve(build, cfg, str(path), built=manifest is not None)
        self.tokenizer = Tokenizer.from_dir(path)
        return plan

    def _load(self, path: Path, manifest: EngineManifest | None, plan: ServingPlan | None) -> LoadedEngine:
        """The engine in this process, or its rank 0 with the other ranks started alongside (runtime.executors.ranks)."""
        config = self.config
        device = torch.device(config.device)
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device {config.device}: torch here sees {torch.cuda.device_count()} CUDA device(s)"
                             + ("; use device cpu" if not torch.cuda.device_count() else ""))
        options = dict(device=config.device, dtype=config.dtype, cpu_kernels=config.cpu_kernels,
                       fp8_weights=config.fp8_weights, manifest=manifest)
        if plan is None:  # no model here: load_engine says so (after a world_size that no model can take)
            config.world_size_for(BuildConfig(), str(path))
            return load_engine(path, **options)
        if plan.world_size == 1:
            return load_engine(path, **options)
        self.ranks = RankGroup.open(path, manifest.build, RankOptions(config.dtype, config.cpu_kernels,
                                                                      fp8_weights=config.fp8_weights))
        engine = load_engine(path, **options, par=self.ranks.par)
        self.ranks.connect()
        engine.model = drive(engine.model, self.ranks)
        return engine

    @property
    def world_size(self) -> int:
        return 1 if self.ranks is None else self.ranks.world_size

    def _setup(self, plan: ServingPlan) -> None:
        build, cfg, config = self.engine.build, self.engine.model_config, self.config
        self.limits, k = plan.limits, plan.draft_len
        self.model_config = cfg
        if self.tokenizer is None:  # a loaded engine given
            self.tokenizer = Tokenizer.from_dir(self.engine.path)
        if note := self.tokenizer.adopt_eos(cfg.eos_token_id):
            log.warning(note)
        self._grammars: GrammarCompiler | None = None  # built at the first guided request
        block = build.kv_block_size
        dtype = next(self.engine.model.parameters()).dtype
        # every rank on this host keeps a whole latent cache (runtime.model.deepseek_v3)
        capacity = self._kv_capacity(cfg.kv_bytes_per_token(dtype.itemsize) * self.world_size, k, block)
        self.cache = KVCache(cfg, num_blocks=-(-capacity // block) + 1, block_size=block, dtype=dtype,
                             device=config.device)
        if self.ranks is not None:
            self.ranks.attach_cache(self.cache.tensor)
        graphs = CudaGraphRunner(self.engine.model, self.cache) if config.cuda_graphs and self.cache.tensor.is_cuda else None
        if graphs is not None:
            graphs.capture_decodes(self.limits.max_batch_size, k + 1, self.limits.max_seq_len, mtp=k > 0)
        self.runner = ModelRunner(self.engine.model, self.cache, config.relaxed_acceptance,
                                  keep_mtp_inputs=k > 0, graphs=graphs)
        costs = (profile_step_costs(self.runner, self.limits.max_batch_size, k)
                 if config.speculation == "adaptive" and k else None)
        self.policy = DraftPolicy(config.speculation if k else "off", k, costs)
        prefix_cache = PrefixCache(self.cache.allocator, block, mtp=k > 0) if config.enable_block_reuse else None
        self.scheduler = Scheduler(self.limits, self.cache, self.policy, prefix_cache)
        self._requests: dict[str, tuple[Sequence, RequestTracker]] = {}  # by Sequence.request_id
        self._groups: dict[str, list[str]] = {}  # request id -> its sequences' ids in flight (several: n / best_of)
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._wake = threading.Event()
        self.outputs = OutputProcessor(self._requests, self.cache.blocks_for)
        self._ids = RequestIds()
        self._stopping = False
        self._error: str | None = None  # why the step loop stopped, if it failed
        self._progress = time.monotonic()  # when the step loop last began a step (or an idle wait)
        self._submit_lock = threading.Lock()  # a submit either lands before shutdown or is refused
        # What max_queued_requests bounds: requests with sequences the scheduler left waiting (an n > 1 request is
        # one) and the batch places it left free (none while any waits: blocks or the token budget hold them), as the
        # step loop counted them after its last schedule; requests submitted since take free places (each its n
        # sequences) or else count as waiting (overflow). A burst is admitted as far as the batch takes it, plus the
        # bound. The step loop gives back what it takes out of the inbox at its next count.
        self._waiting_requests, self._free_places = 0, self.limits.max_batch_size
        self._inbox_places, self._overflow = 0, 0
        self._drained_places, self._drained_overflow = 0, 0

    def _kv_capacity(self, bytes_per_token: int, k: int, block: int) -> int:
        """KV cache tokens: kv_cache_tokens, or room for max_batch_size sequences of max_seq_len, within
        free_memory_fraction of the memory free now (the weights loaded). A cache the memory cannot hold, or (sized
        here) one that cannot hold a single max_seq_len sequence, is refused naming the setting, before anything is
        allocated: an allocator error or the OOM killer names nothing. A kv_cache_tokens given may hold less than
        max_seq_len: a request that cannot fit it alone is refused at submit, with the cache's size. Where the free
        memory is unknown, the cache is what the settings ask."""
        config, limits = self.config, self.limits
        free = free_memory_bytes(torch.device(config.device))
        budget = None if free is None else int(free * config.free_memory_fraction) // bytes_per_token
        where = "" if free is None else (f"{budget} tokens of {bytes_per_token} bytes fit in free_memory_fraction "
                                         f"{config.free_memory_fraction} of the {free / 2**30:.1f} GiB free on "
                                         f"{config.device}")
        one = limits.max_seq_len + k + block
        if config.kv_cache_tokens is not None:
            if budget is not None and config.kv_cache_tokens > budget:
                raise ValueError(f"kv_cache_tokens {config.kv_cache_tokens} does not fit: {where}")
            if config.kv_cache_tokens < one:
                # said by size, not setting: each deployment's file names the setting its own way
                log.warning("a KV cache of %d tokens holds less than one sequence of the %d-token context served (%d "
                            "tokens with the drafts and a block): a request that needs more is refused",
                            config.kv_cache_tokens, limits.max_seq_len, one)
            return config.kv_cache_tokens
        if budget is not None and budget < one:
            raise ValueError(f"max_seq_len {limits.max_seq_len} does not fit: one sequence needs {one} tokens of KV "
                             f"cache and {where}; lower max_seq_len (or rebuild with a smaller --max_seq_len)")
        wanted = limits.max_batch_size * one
        if budget is not None and wanted > budget:
            log.info("KV cache: %d tokens, not the %d of max_batch_size %d x max_seq_len %d: %s", budget, wanted,
                     limits.max_batch_size, limits.max_seq_len, where)
            return budget
        return wanted

    # ---- public API ---------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the parameter when this request cannot run here."""
        validate_request(prompt_token_ids, params, self.model_config.vocab_size, self.limits.max_seq_len,
                         self.limits.max_batch_size, self.tokenizer.eos_token_id,
                         (self.cache.block_size, self.cache.allocator.num_blocks), self.request_draft_len)
        if params.guided_decoding is not None:
            self.grammars.check(params.guided_decoding)

    @property
    def request_draft_len(self) -> int:
        """The most drafts a request's num_draft_tokens may ask for: the draft length it serves with."""
        return self.policy.max_k

    @property
    def grammars(self) -> GrammarCompiler:
        """Guides compiled for this tokenizer (ValueError when it has no eos to end a guided output with)."""
        if self._grammars is None:
            eos = self.tokenizer.eos_token_id
            if eos is None:
                raise ValueError("guided_decoding needs an eos token; this model's tokenizer has none")
            self._grammars = GrammarCompiler(self.tokenizer.backend.to_str(), self.model_config.vocab_size, eos)
        return self._grammars

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None] | None = None, request_id: str | None = None,
               bounded: bool = True) -> RequestHandle:
        """Queue a request; invalid parameters raise ValueError naming the parameter. With n / best_of > 1 it runs
        one sequence per candidate, candidate i seeded with seed + i (mod 2^63), sharing the prompt's blocks.
        bounded False: taken whatever max_queued_requests says (a client request's later prompts, `submit_all`)."""
        self.validate(prompt_token_ids, params)
        check_callback(on_output)
        with self._ids.claimed(request_id) as rid:
            return self._enqueue(rid, prompt_token_ids, params, on_output, bounded)

    def _enqueue(self, rid: str, prompt_token_ids: list[int], params: SamplingParams,
                 on_output: Callable[[RequestOutput], None] | None, bounded: bool) -> RequestHandle:
        """The request's sequences and trackers, handed to the step loop's inbox (or QueueFull)."""
        seed = int(params.seed) if params.seed is not None else fresh_seed()  # numpy ints too
        handle = RequestHandle(rid, self, params.n, delivered_by=self._thread)
        size = params.num_sequences
        trackers = RequestTracker.create_group(rid, len(prompt_token_ids), params, size, self.tokenizer, handle,
                                               on_output)
        group: list[tuple[Sequence, RequestTracker]] = []
        bias = LogitBias.create(params.logit_bias, self.cache.tensor.device) if params.logit_bias else None
        for i, tracker in enumerate(trackers):
            # the leader alone computes prompt logprobs, which all report
            p = replace(tracker.params, prompt_logprobs=None) if i else tracker.params
            penalty = PenaltyState.create(list(prompt_token_ids), self.model_config.vocab_size,
                                          self.cache.tensor.device) if params.penalized else None
            seq = Sequence(rid if size == 1 else f"{rid}#{i}", list(prompt_token_ids), len(prompt_token_ids), p,
                           (seed + i) % SEED_MODULUS, in_thinking=self._thinking_after(prompt_token_ids),
                           stop_ids=tracker.stop_ids, penalty=penalty, logit_bias=bias,
                           # never drafts (a single token comes from the prefill): keeps no MTP inputs, and reuses
                           # cached prompt blocks without their MTP rows (it recomputed the prompt for them)
                           mtp_dropped=params.num_draft_tokens == 0 or params.max_tokens == 1,
                           grammar=self.grammars.matcher(params.guided_decoding) if params.guided_decoding else None,
                           leader=group[0][0] if i else None)
            group.append((seq, tracker))
        with self._submit_lock:
            if self._stopping:
                raise RuntimeError(f"executor is shut down{f' ({self._error})' if self._error else ''}")
            places, overflow = 0, 0  # what this request adds to load shedding's count (nothing without a bound)
            bound = self.config.max_queued_requests
            if bound is not None:
                places = params.num_sequences
                if self._inbox_places + places > self._free_places:
                    if bounded and self._waiting_requests + self._overflow >= bound:
                        raise QueueFull(bound)
                    places, overflow = 0, 1
                self._inbox_places += places
                self._overflow += overflow
            self._inbox.put(("add", (group, places, overflow)))
        self._wake.set()
        return handle

    def _thinking_after(self, tokens: list[int]) -> bool:
        """Whether a relaxed-acceptance thinking span is open after these tokens (R1's chat template
        opens it at the end of the prompt)."""
        r = self.config.relaxed_acceptance
        return r is not None and functools.reduce(r.advance, tokens, False)

    def cancel(self, request_id: str, handle: RequestHandle | None = None) -> None:
        """Cancel the request in flight with this id (unknown ids are ignored); with `handle`, only if that
        request is the handle's, so a handle kept past its request's end cannot cancel a later one that
        reuses the id."""
        self._inbox.put(("cancel", (request_id, handle)))
        self._wake.set()

    @property
    def kv_block_size(self) -> int:
        return self.cache.block_size

    def stats(self) -> ExecutorStats:
        c = self.outputs.counts
        return ExecutorStats(
            running=len(self.scheduler.running), queued=self._queued(),
            kv_blocks_used=self.cache.allocator.num_used, kv_blocks_free=self.cache.allocator.num_free,
            kv_blocks_cached=self.cache.allocator.num_cached, kv_reused_blocks=c["reused_blocks"],
            kv_missed_blocks=c["missed_blocks"],
            requests_finished=self._ids.finished, generated_tokens=c["generated"], draft_tokens=c["drafted"],
            accepted_draft_tokens=c["accepted"], current_draft_len=self.scheduler.last_k,
            acceptance_estimate=self.policy.acceptance, world_size=self.world_size,
            rank_memory_bytes=self.ranks.memory() if self.ranks is not None else [rss_bytes(os.getpid())])

    def health(self, timeout_s: float) -> str | None:
        """None while the step loop serves; else why not: it stopped, or it has been inside one step for longer
        than timeout_s (a stuck kernel or callback). A server's watchdog polls this (serving.watchdog)."""
        if self._error is not None or not self._thread.is_alive():
            return self._error or "the executor has shut down"
        if self.ranks is not None:
            try:
                self.ranks.check()
            except RankFailure as e:
                return str(e)
        stalled = time.monotonic() - self._progress
        if stalled > timeout_s and (self.scheduler.has_work() or self._submitted_not_seen()):
            waiting = len(self.scheduler.waiting) + self._submitted_not_seen()
            return (f"the executor's step loop has made no progress for {stalled:.1f} s "
                    f"({len(self.scheduler.running)} requests running, {waiting} waiting)")
        return None

    def _queued(self) -> int:
        """Sequences waiting to be scheduled (preempted ones included) and requests the step loop has not taken yet."""
        return len(self.scheduler.waiting) + self._submitted_not_seen()

    def _submitted_not_seen(self) -> int:
        """Requests in the inbox (not its cancels), which the step loop has not taken yet."""
        with self._inbox.mutex:
            return sum(kind == "add" for kind, _ in self._inbox.queue)

    def shutdown(self, timeout: float | None = 30) -> None:
        """End what is in flight ("cancelled") and stop the step loop, waiting up to `timeout` seconds for
        the step under way (None: until it ends). Calling it again does nothing more. From an output callback
        (the loop's own thread) it returns at once, and the loop stops once the callback returns."""
        with self._submit_lock:
            self._stopping = True
        self._wake.set()
        if threading.current_thread() is self._thread:
            return
        self._thread.join(timeout)
        if self.ranks is not None:  # a stop message only when no step is under way, else signals
            self.ranks.close(graceful=not self._thread.is_alive())
        if not self._thread.is_alive():
            forget_at_exit(self)

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- the step loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.ranks is not None and self.ranks.threads is not None:  # rank 0's share of the cores, on this thread
            torch.get_num_threads()  # torch sets a thread's count from its process-wide one at its first use: first
            torch.set_num_threads(self.ranks.threads)
        self._threads_set.set()
        error = None
        try:
            while not self._stopping:
                self._progress = time.monotonic()
                self._step()
        except Exception as e:
            if self._stopping and isinstance(e, RankFailure):
                pass  # shutdown stopped the ranks under this step: its requests end cancelled, as in one process
            else:  # a bug of ours outside a model step: end every request, never leave one hanging
                log.exception("executor loop failed; no new requests are accepted")
                error = self._error = f"executor stopped: {type(e).__name__}: {e}"
                with self._submit_lock:
                    self._stopping = True
                if self.ranks is not None:
                    self.ranks.close(graceful=False)
        self._drain_inbox()  # submitted but never scheduled: ended too, never lost
        for rid in list(self._requests):
            self._finish(rid, "error" if error else "cancelled", error=error)
        if self.ranks is not None:  # no call in flight now (shutdown closes them too, if the loop is slow to stop)
            self.ranks.close()
        forget_at_exit(self)  # nothing left to stop at exit (also when shutdown() came from a callback)

    def _step(self) -> None:
        if self.ranks is not None:
            self.ranks.check()  # a rank that exited ends the loop (RankFailure), idle or not
        self._drain_inbox()
        if not self.scheduler.has_work():
            self._count_waiting()  # none: cancels may have emptied the queue since the last schedule
            self._wake.wait(0.05)
            self._wake.clear()
            return
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        self._count_waiting()
        if not plan:  # everything waits for blocks that running requests will free
            self._wake.wait(0.01)
            self._wake.clear()
            return
        self.outputs.scheduled(plan, t0)
        try:
            results = self.runner.step(plan)
        except RankFailure:  # the ranks are gone or out of step: nothing can run any more
            raise
        except Exception as e:  # a broken step fails its requests, never the executor
            log.exception("step failed")
            for item in plan:
                self._finish(item.seq.request_id, "error", error=str(e))
            return
        kept, finished, reports = self.outputs.process(results, time.perf_counter())
        self.scheduler.update_from_output(plan, results, kept, finished, time.perf_counter() - t0)
        self.outputs.deliver(reports, self._finish)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                group, places, overflow = item
                self._drained_places += places
                self._drained_overflow += overflow
                self._groups[group[0][1].request_id] = [seq.request_id for seq, _ in group]
                for seq, tracker in group:
                    self._requests[seq.request_id] = (seq, tracker)
                    self.scheduler.add(seq)
            else:
                rid, handle = item
                for key in list(self._groups.get(rid, ())):
                    if handle is None or self._requests[key][1].handle is handle:
                        self._finish(key, "cancelled")

    def _count_waiting(self) -> None:
        """What load shedding reads (max_queued_requests), as the last schedule left it."""
        if self.config.max_queued_requests is None:  # no bound: nothing reads it, a step need not count
            return
        waiting = len({id(seq.leader or seq) for seq in self.scheduler.waiting})
        free = 0 if waiting else max(0, self.limits.max_batch_size - len(self.scheduler.running))
        with self._submit_lock:
            self._waiting_requests, self._free_places = waiting, free
            self._inbox_places -= self._drained_places
            self._overflow -= self._drained_overflow
            self._drained_places = self._drained_overflow = 0

    def _finish(self, request_id: str, reason: str, new: list[int] | None = None, delta: str = "",
                error: str | None = None) -> None:
        """End a sequence (`request_id` is its Sequence.request_id; finished by its step, cancelled or failed): its
        blocks go back and its last output out, and the request's id is free once its last sequence has ended; one
        at a time, so a callback's stats() sees every request running, queued or finished."""
        if request_id not in self._requests:
            return
        seq, tracker = self._requests.pop(request_id)
        group = self._groups[tracker.request_id]
        group.remove(request_id)
        if not group:  # its last sequence
            del self._groups[tracker.request_id]
        self.scheduler.remove(seq)
        self._ids.end(tracker, not group, reason, new, delta, error)
