"""The executor for `build_engine --backend trtllm` engines: TensorRT-LLM's LLM API behind our API.

`TrtllmExecutor` has the public surface of `runtime.executors.native.Executor` (`submit`, `cancel`,
`stats`, `shutdown`, `tokenizer`, context manager) and returns the same `RequestHandle`,
`RequestOutput`, `RequestStats` and `ExecutorStats`, so `Session` and the Triton model can take
either. Underneath it opens the engine directory (engine.json with backend "trtllm", the HF
layout under `hf/`, `extra_llm_api_options.yaml`), builds
`tensorrt_llm.LLM(model=<engine>/hf, backend="pytorch", **<the YAML>)` and streams each request
through `LLM.generate_async(..., streaming=True)` on an asyncio loop in a background thread.

What stays ours, so that text handling is identical to the native executor: the text (our
`IncrementalDetokenizer` over the token ids TensorRT-LLM streams; its own detokenizer is switched
off), stop strings (matched on that text with the native hold-back rule, then the upstream request
is aborted), and the truncation at stop token ids, eos and max_tokens (re-applied to the streamed
ids). TensorRT-LLM is still told max_tokens, end_id and stop_token_ids so that it stops computing.

`tensorrt_llm` is imported only when an executor is constructed (`import_tensorrt_llm`); this
module imports without it. Nothing here has run against the real package: the tests inject a test
double module (a contract test of the names and arguments we use; see docs/trtllm-backend.md).
The translation to and from TensorRT-LLM's names (requests, LLM-API options, results) is
runtime.executors.trtllm_api's, with the list of the upstream names used and where they come from.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from runtime.io.engine_format import (ENGINE_JSON, GUIDED_DECODING_BACKENDS, LLM_API_OPTIONS, BuildConfig, EngineError,
                                     EngineManifest)
from runtime.executors.base import ExecutorConfig, ExecutorStats
from runtime.executors.trtllm_api import (adapt_llm_kwargs, adapt_to_upstream_fields,
                                          chosen_options, draft_len_of, import_tensorrt_llm, kv_cache_counts, llm_kwargs_for,
                                          logprobs_from_upstream, model_fields, read_llm_api_options,
                                          speculative_counts, to_trtllm_sampling_kwargs, upstream_sampling_params)
from runtime.executors.handles import RequestHandle, check_callback
from runtime.executors.outputs import RequestOutput
from runtime.executors.requests import RequestIds, RequestTracker
from runtime.core.guide_check import check_guide
from runtime.core.sampling import TokenLogprob
from runtime.core.sampling_params import SamplingParams, fresh_seed, validate_request
from runtime.core.scheduler import ServingLimits
from runtime.io.tokenizer import Tokenizer

log = logging.getLogger("runtime.executors.trtllm")

_UPSTREAM_REASONS = {"stop": "stop", "length": "length", "cancelled": "cancelled", "timeout": "error", None: "stop"}


# ---- engine directory -------------------------------------------------------------------------
@dataclass(frozen=True)
class TrtllmEngine:
    """A `--backend trtllm` engine directory, read and checked (no TensorRT-LLM needed)."""

    path: Path
    manifest: EngineManifest
    model_dir: Path  # the HF layout TensorRT-LLM loads (`hf/`)
    options: dict[str, Any]  # extra_llm_api_options.yaml

    @classmethod
    def open(cls, path: str | Path, verify_weights: bool = False,
             manifest: EngineManifest | None = None) -> "TrtllmEngine":
        """Read engine.json (`manifest`, where the caller read it; refusing a native engine), check that every listed
        file is there, hash the small ones (options, config, tokenizer) and, with verify_weights, the weights too."""
        path = Path(path)
        if not (path / ENGINE_JSON).is_file():
            raise EngineError(f"{path}: no {ENGINE_JSON}; expected an engine directory built with "
                              "build_engine --backend trtllm")
        manifest = manifest or EngineManifest.read(path)
        if manifest.build.backend != "trtllm":
            raise EngineError(f"{path}: built with --backend {manifest.build.backend}; run it with "
                              "runtime.executors.native.Executor, or rebuild with --backend trtllm")
        manifest.verify_files(path, hash_weights=verify_weights)
        parents = {Path(w).parent for w in manifest.weights}
        if len(parents) != 1:
            raise EngineError(f"{path / ENGINE_JSON}: weights {list(manifest.weights)} are not in one directory")
        model_dir = path / parents.pop()
        return cls(path, manifest, model_dir, read_llm_api_options(path))

    @property
    def build(self) -> BuildConfig:
        return self.manifest.build


# ---- the executor -----------------------------------------------------------------------------
@dataclass(eq=False)
class _Request(RequestTracker):
    """The shared output side plus the upstream request it streams from."""

    prompt: list[int] = field(default_factory=list)
    seen: int = 0  # upstream output tokens consumed
    upstream: Any = None  # tensorrt_llm's RequestOutput once submitted (on the group's first)
    upstream_done: bool = False
    # the trackers of the request's n outputs (SamplingParams.n), one list shared by all; the first streams upstream
    group: list["_Request"] = field(default_factory=list)

    @classmethod
    def create_group(cls, *args: Any, **kwargs: Any) -> list["_Request"]:
        """RequestTracker.create_group's, each knowing the group."""
        group = super().create_group(*args, **kwargs)
        for t in group:
            t.group = group
        return group

    @property
    def done(self) -> bool:
        """Every output of the request has finished."""
        return all(t.finished for t in self.group)


class TrtllmExecutor:
    """Runs a `--backend trtllm` engine with TensorRT-LLM, with `Executor`'s public API.

    `config` None serves the engine as built (the YAML as is); an `ExecutorConfig` applies its
    serving settings (see `llm_kwargs_for`). `llm_overrides` are merged into the LLM arguments
    last. `verify_weights` hashes the weight files too (slow for a full model; off by default,
    their presence is always checked). Statistics: num_draft_tokens / num_accepted_draft_tokens
    are TensorRT-LLM's per-request speculative-decoding metrics where it reports them and 0
    otherwise (`reports_draft_stats` says which); num_steps is its `decoding_iter`, else the
    number of streamed responses with tokens; ttft/tpot are measured here as in the native
    executor. ExecutorStats' KV-block counts are 0: TensorRT-LLM's iteration stats are not read.
    """

    kv_block_size = 0  # its blocks are TensorRT-LLM's own; their counts read 0 here
    request_draft_len = None  # a per-request num_draft_tokens other than its own draft length is refused (validate)

    def __init__(self, engine: str | Path | TrtllmEngine, config: ExecutorConfig | None = None, *,
                 llm_overrides: Mapping[str, Any] | None = None, verify_weights: bool = False):
        self.engine = engine if isinstance(engine, TrtllmEngine) else TrtllmEngine.open(engine, verify_weights)
        self.model_config = self.engine.manifest.model_config
        self.config = config
        source = str(self.engine.path / LLM_API_OPTIONS)
        self.llm_kwargs = llm_kwargs_for(chosen_options(self.engine.options, config), self.engine.manifest, config,
                                         llm_overrides, source=source)
        self.num_draft_tokens = draft_len_of(self.llm_kwargs.get("speculative_config"), source)
        build = self.engine.build
        self.limits = ServingLimits(
            max_batch_size=int(self.llm_kwargs.get("max_batch_size", build.max_batch_size)),
            max_num_tokens=int(self.llm_kwargs.get("max_num_tokens", build.max_num_tokens)),
            max_seq_len=int(self.llm_kwargs.get("max_seq_len", build.max_seq_len)))
        self.tokenizer = Tokenizer.from_dir(self.engine.model_dir)
        if note := self.tokenizer.adopt_eos(self.model_config.eos_token_id):
            log.warning(note)
        self.reports_draft_stats: bool | None = None  # unknown until a request has finished

        self._trtllm = import_tensorrt_llm()
        # fail now, not on the first request, when this TensorRT-LLM lacks a field we need
        adapt_to_upstream_fields(to_trtllm_sampling_kwargs(
            SamplingParams(temperature=1.0, top_k=1, seed=0, stop_token_ids=(0,), bad_token_ids=(0,)), self.tokenizer),
            self._trtllm.SamplingParams)
        # tensorrt_llm/llmapi/llm.py: LLM(model, ..., **kwargs); backend "pytorch" (the default in 1.x)
        llmapi = getattr(self._trtllm, "llmapi", None)
        kwargs = adapt_llm_kwargs(self.llm_kwargs, model_fields(getattr(llmapi, "KvCacheConfig", None)),
                                  model_fields(getattr(llmapi, "MTPDecodingConfig", None)))
        self.llm = self._trtllm.LLM(model=str(self.engine.model_dir), backend="pytorch", **kwargs)

        self._requests: dict[str, _Request] = {}  # in flight; touched on the loop thread only
        self._tasks: set[asyncio.Task] = set()
        self._counts = dict(generated=0, drafted=0, accepted=0)
        self._ids = RequestIds()
        self._stopping = False
        self._submit_lock = threading.Lock()  # a submit is queued to the loop before a shutdown begins, or refused
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="trtllm-executor", daemon=True)
        self._thread.start()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def health(self, timeout_s: float) -> str | None:
        """None while requests are served; else why not (a server's watchdog polls this). TensorRT-LLM's own
        loop is not watched here: only this adapter's event loop thread."""
        if self._closed or not self._thread.is_alive():
            return "the TensorRT-LLM executor has shut down"
        return None

    # ---- public API ---------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the parameter when this request cannot run here."""
        validate_request(prompt_token_ids, params, self.model_config.vocab_size, self.limits.max_seq_len,
                         self.limits.max_batch_size, self.tokenizer.eos_token_id)
        # tensorrt_llm/llmapi/llm.py, _check_arguments: without chunked prefill the whole prompt must
        # fit one step's max_num_tokens (generate_async raises otherwise)
        if not self.llm_kwargs.get("enable_chunked_prefill") and len(prompt_token_ids) > self.limits.max_num_tokens:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; max_num_tokens is {self.limits.max_num_tokens} "
                             "(TensorRT-LLM without chunked prefill takes a prompt in one step)")
        if params.num_draft_tokens not in (None, self.num_draft_tokens):
            raise ValueError(f"num_draft_tokens {params.num_draft_tokens} per request is not available with TensorRT-LLM, "
                             f"whose MTP drafts {self.num_draft_tokens} for every request; leave it unset")
        if params.guided_decoding is not None:
            check_guide(params.guided_decoding)  # the native executor's refusal: the field and the position
            if self.llm_kwargs.get("guided_decoding_backend") not in GUIDED_DECODING_BACKENDS:
                raise ValueError("guided_decoding needs TensorRT-LLM's guided_decoding_backend (xgrammar or llguidance) "
                                 f"in the engine's {LLM_API_OPTIONS}")
        # a field this release lacks for what the request asks (logprobs_mode) is refused here, not mid-stream
        adapt_to_upstream_fields(to_trtllm_sampling_kwargs(params, self.tokenizer), self._trtllm.SamplingParams)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None] | None = None, request_id: str | None = None,
               bounded: bool = True) -> RequestHandle:
        """Queue a request; invalid parameters raise ValueError naming the parameter. (`bounded`: there is no queue
        bound here, max_queued_requests is refused.)"""
        self.validate(prompt_token_ids, params)
        check_callback(on_output)
        with self._ids.claimed(request_id) as rid:
            return self._enqueue(rid, prompt_token_ids, params, on_output)

    def _enqueue(self, rid: str, prompt_token_ids: list[int], params: SamplingParams,
                 on_output: Callable[[RequestOutput], None] | None) -> RequestHandle:
        """The request's trackers, its start handed to the loop."""
        if not params.greedy and params.seed is None:  # as native: unseeded means a fresh random seed
            params = dataclasses.replace(params, seed=fresh_seed())
        handle = RequestHandle(rid, self, params.n, delivered_by=self._thread)
        # upstream returns n outputs of one request (the best of best_of); its prompt logprobs, read once (by the
        # first), are every output's
        req = _Request.create_group(rid, len(prompt_token_ids), params, params.n, self.tokenizer, handle, on_output,
                                    prompt=list(prompt_token_ids))[0]
        with self._submit_lock:  # queued after shutdown's stop of the loop, _start would never run
            if self._stopping:
                raise RuntimeError("executor is shut down")
            self._loop.call_soon_threadsafe(self._start, req)
        return handle

    def cancel(self, request_id: str, handle: RequestHandle | None = None) -> None:
        """Finish the request as "cancelled" and abort it in TensorRT-LLM; unknown ids are ignored, and with
        `handle` a request that is not the handle's (a later one reusing the id)."""
        try:
            self._loop.call_soon_threadsafe(self._cancel_now, request_id, handle)
        except RuntimeError:  # shut down: nothing is in flight
            pass

    def stats(self) -> ExecutorStats:
        reqs = list(self._requests.values())
        c = self._counts
        return ExecutorStats(
            running=sum(1 for r in reqs if r.upstream is not None), queued=sum(1 for r in reqs if r.upstream is None),
            kv_blocks_used=0, kv_blocks_free=0, requests_finished=self._ids.finished, generated_tokens=c["generated"],
            draft_tokens=c["drafted"], accepted_draft_tokens=c["accepted"], current_draft_len=self.num_draft_tokens,
            acceptance_estimate=c["accepted"] / c["drafted"] if c["drafted"] else 0.0)

    def shutdown(self, timeout: float | None = 30) -> None:
        """Cancel what is in flight (finish reason "cancelled"), shut TensorRT-LLM down, stop the loop; `timeout`
        bounds each wait for our loop (the cancels, its end)."""
        if self._closed:
            return
        with self._submit_lock:
            self._stopping = True
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown_on_loop(), self._loop).result(timeout=timeout)
        except Exception:
            log.exception("cancelling requests at shutdown failed")
        self._closed = True
        try:  # while our loop still runs: TensorRT-LLM may still hand results to it while stopping
            self.llm.shutdown()
        except Exception:
            log.exception("tensorrt_llm.LLM.shutdown failed")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=timeout)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> "TrtllmExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- on the loop thread -------------------------------------------------------------------
    def _start(self, req: _Request) -> None:
        if self._stopping:
            self._finish_all(req, "cancelled")
            return
        self._requests[req.request_id] = req
        task = self._loop.create_task(self._stream(req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stream(self, req: _Request) -> None:
        if req.done:  # cancelled before it started
            return
        try:
            kwargs = adapt_to_upstream_fields(to_trtllm_sampling_kwargs(req.params, self.tokenizer),
                                              self._trtllm.SamplingParams)
            sampling_params = upstream_sampling_params(self._trtllm, kwargs, self.model_config.vocab_size)
            req.upstream = self.llm.generate_async({"prompt_token_ids": req.prompt},
                                                   sampling_params=sampling_params, streaming=True)
        except Exception as e:
            log.exception("submitting %s to TensorRT-LLM failed", req.request_id)
            self._finish_all(req, "error", error=f"{type(e).__name__}: {e}")
            return
        try:
            async for out in req.upstream:
                if req.done:
                    break  # cancelled here, or finished by our own stop rules; abort already sent
                self._on_response(req, out)
                if req.done:
                    break
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not req.done:
                log.exception("TensorRT-LLM request %s failed", req.request_id)
                self._finish_all(req, "error", error=f"{type(e).__name__}: {e}")
            return
        if not req.done:
            self._finish_all(req, "error", error="TensorRT-LLM's stream ended without a finished output")

    def _on_response(self, req: _Request, out: Any) -> None:
        """One upstream response: the request's statistics, then each output's new tokens (output i is upstream's
        outputs[i]; with best_of > n only the final response's, once upstream has chosen the n best)."""
        now = time.perf_counter()
        req.upstream_done = bool(out.finished)
        steps = getattr(out, "decoding_iter", None)
        if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0:
            req.num_steps = steps
        elif any(len(c.token_ids or []) > t.seen for t, c in zip(req.group, out.outputs)):
            req.num_steps += 1
        blocks = kv_cache_counts(out)
        if blocks is not None:
            req.num_reused_blocks, req.num_missed_blocks = blocks
        counts = speculative_counts(out)
        if counts is not None:
            drafted, accepted = counts
            self._counts["drafted"] += max(drafted - req.num_draft_tokens, 0)
            self._counts["accepted"] += max(accepted - req.num_accepted_draft_tokens, 0)
            req.num_draft_tokens, req.num_accepted_draft_tokens = drafted, accepted
            self.reports_draft_stats = True
        if out.finished or req.params.num_sequences == req.params.n:
            for t, completion in zip(req.group, out.outputs):
                if t is not req:  # the request's steps and cache hits are every output's; its drafts the first's
                    t.num_steps = req.num_steps  # (upstream counts them per request: summed over outputs, n times)
                    t.num_reused_blocks, t.num_missed_blocks = req.num_reused_blocks, req.num_missed_blocks
                if not t.finished:
                    self._on_output(t, completion, now, bool(out.finished))
        if req.done and not req.upstream_done:
            self._abort_upstream(req)

    def _on_output(self, req: _Request, completion: Any, now: float, finished: bool) -> None:
        """One output's new tokens, through the shared stop rules."""
        ids = completion.token_ids or []
        new = list(ids[req.seen:])
        logprobs = self._new_logprobs(req, completion, new)
        req.seen = max(req.seen, len(ids))
        if new or finished:
            upstream_reason = _UPSTREAM_REASONS.get(completion.finish_reason, "error") if finished else None
            if finished and completion.finish_reason not in _UPSTREAM_REASONS:
                log.error("request %s: unknown TensorRT-LLM finish reason %r", req.request_id, completion.finish_reason)
            self._process(req, new, now, upstream_reason, logprobs)

    @staticmethod
    def _new_logprobs(req: _Request, completion: Any, new: list[int]) -> list[TokenLogprob] | None:
        """The logprobs of the newly streamed ids (None unless asked for; none new for a final response without a
        token); the prompt's, once, into `req`.
        Upstream's prompt logprobs are taken as those of prompt tokens 1.. (the last len(prompt) - 1)."""
        params = req.params
        if params.prompt_logprobs is not None and req.prompt_logprobs == [None] and len(req.prompt) > 1:
            entries = (getattr(completion, "prompt_logprobs", None) or [])[1 - len(req.prompt):]
            if entries:
                req.prompt_logprobs += logprobs_from_upstream(entries, req.prompt[1:], params.prompt_logprobs)
        if params.logprobs is None:
            return None
        if not new:
            return []
        entries = (getattr(completion, "logprobs", None) or [])[req.seen : req.seen + len(new)]
        if len(entries) < len(new):
            raise RuntimeError(f"TensorRT-LLM returned {len(entries)} logprobs for {len(new)} new tokens")
        return logprobs_from_upstream(entries, new, params.logprobs)

    def _process(self, req: _Request, new: list[int], now: float, upstream_reason: str | None,
                 logprobs: list[TokenLogprob] | None = None) -> None:
        """The shared stop rules over the newly streamed ids (TensorRT-LLM's own finish reason is
        used when none of ours fires), then report the delta."""
        new, delta, reason = req.consume(new, now, logprobs)
        self._counts["generated"] += len(new)
        reason = reason or upstream_reason
        if reason is not None:
            self._finish(req, reason, new, delta)
        else:
            req.report(new, delta, None)

    def _finish(self, req: _Request, reason: str, new: list[int] | None = None, delta: str = "",
                error: str | None = None) -> None:
        """End one output; the request's id is free once its last output has ended."""
        if req.finished:
            return
        req.finished = True
        if req.done:
            self._requests.pop(req.request_id, None)
        first = req.group[0]
        if first.upstream_done and self.reports_draft_stats is None and speculative_counts(first.upstream) is None:
            self.reports_draft_stats = False
            log.warning("TensorRT-LLM reported no speculative-decoding metrics (request_perf_metrics); "
                        "draft and accepted token counts are reported as 0")
        self._ids.end(req, req.done, reason, new, delta, error)

    def _finish_all(self, req: _Request, reason: str, error: str | None = None) -> None:
        for t in req.group:
            self._finish(t, reason, error=error)

    def _cancel_now(self, request_id: str, handle: RequestHandle | None = None) -> None:
        req = self._requests.get(request_id)
        if req is None or req.done or (handle is not None and req.handle is not handle):
            return
        self._finish_all(req, "cancelled")
        if req.upstream is not None and not req.upstream_done:
            self._abort_upstream(req)

    @staticmethod
    def _abort_upstream(req: _Request) -> None:
        try:
            req.upstream.abort()  # tensorrt_llm/executor/result.py: GenerationResult.abort()
        except Exception:
            log.exception("aborting %s in TensorRT-LLM failed", req.request_id)

    async def _shutdown_on_loop(self) -> None:
        for req in list(self._requests.values()):
            self._cancel_now(req.request_id)
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
