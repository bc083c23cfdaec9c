"""What the two Triton engine models share: the legacy `tensorrt_llm` (TensorRT-LLM's token tensors,
triton_repo/) and the `llmapi` `tensorrt_llm` (text, triton_repo_llmapi/). Imported by those models' stubs only
(it needs `triton_python_backend_utils`).

One executor per model: execute() only turns requests into `executor.submit` calls and returns, so every request
in flight shares the executor's batch. The executor's output callback queues outputs; one sender thread turns
them into responses (keeping Triton IPC off the step loop), notices cancelled requests and cancels them in the
executor, which frees their KV blocks. Non-decoupled models answer the same way: Triton (2.51 included) takes a
non-decoupled request's one final response from its response sender after execute() has returned, so unary
clients share the batch with streaming ones rather than waiting for execute() to finish a whole batch. A metrics
thread publishes the executor's stats as Triton custom metrics; a watchdog takes the server down when the step
loop or the sender stops making progress.

Streamed chunks end on whole characters: ids whose text ends inside a character wait for the next output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import signal
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from runtime.executors.base import ExecutorConfig, ExecutorProtocol, create_executor
from runtime.executors.process import ProcessExecutor, use_engine_process
from runtime.executors.requests import RequestOutput, RequestStats
from runtime.core.sampling_params import SamplingParams
from serving.launcher import WORLD_SIZE_ENV
from serving.perf_metrics import PERF_OUTPUTS, PerfMetrics
from serving.request_validation import RequestError
from serving.triton_parameters import TritonConfig
from serving.watchdog import Progress, Watchdog

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@dataclass(eq=False)
class Stream:
    """One Triton request in flight."""

    sender: Any  # pb_utils.InferenceResponseSender
    triton_id: str  # the client's request id (TensorRT-LLM's `stop` input names it)
    streaming: bool
    prefix: list[int]  # prompt ids put before a non-streamed output (empty when excluded)
    perf_metrics: bool  # each response carries the request's perf metrics
    outputs: frozenset[str] = frozenset()  # the optional outputs the request asked for (model specific)
    params: SamplingParams | None = None
    executor_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    pending: dict[int, list[int]] = field(default_factory=dict)  # streamed ids not sent yet, per output index
    pending_text: dict[int, str] = field(default_factory=dict)  # their text
    # perf_counter_ns (CLOCK_MONOTONIC, the clock of upstream's std::chrono::steady_clock times)
    arrival_ns: int = field(default_factory=time.perf_counter_ns)
    first_token_ns: int = 0  # when the executor reported the first / latest new tokens (0: none yet)
    last_token_ns: int = 0
    unfinished: int = field(init=False)  # outputs (SamplingParams.n) whose final output is still to come
    closed: bool = False  # its final response is sent

    def __post_init__(self) -> None:
        self.unfinished = 1 if self.params is None else self.params.n


@dataclass(frozen=True)
class Chunk:
    """What one response carries: token ids and their text (a streamed delta, or the whole output)."""

    ids: list[int]
    text: str


class EngineModel:
    """The Triton python model over one executor; subclasses read requests (`convert`) and shape responses
    (`response`)."""

    label = "tensorrt_llm"  # how the model names itself in the server log

    # ---- set-up ---------------------------------------------------------------------------------
    def start(self, engine_dir: Path, executor_config: ExecutorConfig, triton: TritonConfig, *, model_name: str,
              model_version: str) -> None:
        """Load the executor (in a process of its own where `use_engine_process` says: the responder then never
        holds the GIL its step loop needs) and start the sender, metrics and watchdog threads."""
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
        if rank:
            raise pb_utils.TritonModelException(
                f"rank {rank}: one tritonserver serves every rank of an engine (its engine model starts them); "
                "run one, with launch_triton_server --world_size N, not one per rank under mpirun")
        if os.environ.get(WORLD_SIZE_ENV):
            executor_config = dataclasses.replace(executor_config, world_size=int(os.environ[WORLD_SIZE_ENV]))
        pb_utils.Logger.log_info(f"{self.label}: loading {engine_dir}")
        if use_engine_process(triton.engine_process, executor_config.device):
            self.executor: ExecutorProtocol = ProcessExecutor(engine_dir, executor_config,
                                                              torch_threads=triton.torch_threads)
        else:
            if triton.torch_threads:  # small decode steps on a busy CPU run faster on fewer threads
                torch.set_num_threads(triton.torch_threads)
            self.executor = create_executor(engine_dir, executor_config)
        self.tokenizer = self.executor.tokenizer
        self.vocab_size = self.executor.model_config.vocab_size
        self.decoupled = triton.decoupled
        self.cancel_period_s = triton.cancellation_check_period_ms / 1000
        self.stats_period_s = triton.stats_check_period_ms / 1000
        self.watchdog_timeout_s = triton.watchdog_timeout_s
        # KV block size of the native executor; a TensorRT-LLM executor's block counts read 0 (as its metrics)
        self.kv_block_size = self.executor.kv_block_size
        self._create_metrics(model_name, model_version)
        self._outbox: queue.Queue[tuple[Stream, RequestOutput, int] | None] = queue.Queue()
        self._active: set[Stream] = set()
        self._lock = threading.Lock()
        self._running = True
        self._sender = Progress()
        self._threads = [threading.Thread(target=self._send_loop, name="responder", daemon=True),
                         threading.Thread(target=self._metrics_loop, name="metrics", daemon=True)]
        for t in self._threads:
            t.start()
        self.watchdog = Watchdog({"executor": lambda: self.executor.health(self.watchdog_timeout_s),
                                  "responder": self._sender_health}, self._fail,
                                 period_s=min(1.0, self.watchdog_timeout_s / 4))
        pb_utils.Logger.log_info(f"{self.label}: serving {engine_dir} ({'decoupled' if self.decoupled else 'unary'})")

    # ---- requests -------------------------------------------------------------------------------
    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                if self.watchdog.failure:
                    raise RuntimeError(f"{self.label} is not serving: {self.watchdog.failure}")
                converted = self.convert(request, sender)
                if converted is None:  # answered already (a stop request)
                    continue
                stream, prompt = converted
                if stream.streaming and not self.decoupled:
                    raise RequestError(f"{self.streaming_input} true needs a decoupled model (this one is deployed "
                                       "with decoupled false: one response per request)")
                self._submit(stream, prompt)
            except Exception as e:
                sender.send(pb_utils.InferenceResponse(error=self.client_error(e)), flags=FINAL)
        return None

    streaming_input = "streaming"  # the request input that asks for streaming, for the refusal above

    def convert(self, request: Any, sender: Any) -> tuple[Stream, list[int]] | None:
        """The request as a Stream and its prompt ids; None when it has been answered here."""
        raise NotImplementedError

    def response(self, stream: Stream, chunk: Chunk, out: RequestOutput) -> Any:
        """The pb_utils.InferenceResponse carrying `chunk`."""
        raise NotImplementedError

    def _submit(self, stream: Stream, prompt: list[int]) -> None:
        with self._lock:
            self._active.add(stream)
        try:
            # read through on_output alone: the handle keeps nothing for an iteration that never comes
            self.executor.submit(prompt, stream.params, request_id=stream.executor_id,
                                 on_output=lambda out, s=stream: self._outbox.put((s, out, time.perf_counter_ns()))
                                 ).callback_only()
        except BaseException:
            with self._lock:
                self._active.discard(stream)
            raise

    def stop(self, triton_id: str, sender: Any) -> None:
        """TensorRT-LLM's `stop` input: cancel the requests in flight with this request id."""
        if not triton_id:
            raise RequestError("stop: a request id is needed to say which request to stop")
        with self._lock:
            ids = [s.executor_id for s in self._active if s.triton_id == triton_id]
        for i in ids:
            self.executor.cancel(i)
        sender.send(pb_utils.InferenceResponse([]), flags=FINAL)

    # ---- responses ------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        next_check = time.monotonic() + self.cancel_period_s
        while True:
            self._sender.beat()
            try:
                item = self._outbox.get(timeout=self.cancel_period_s)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                try:
                    self._deliver(*item)
                except Exception:  # never lose the thread: other requests depend on it
                    pb_utils.Logger.log_error(f"{self.label}: delivering a response failed: {traceback.format_exc()}")
            if time.monotonic() >= next_check:
                self._cancel_abandoned()
                next_check = time.monotonic() + self.cancel_period_s

    def _deliver(self, stream: Stream, out: RequestOutput, at_ns: int) -> None:
        if out.new_token_ids:
            stream.first_token_ns = stream.first_token_ns or at_ns
            stream.last_token_ns = at_ns
        if stream.closed:
            return  # another of the request's outputs failed: its error was the final response
        if out.finish_reason == "error":
            self._close(stream, out, pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"generation failed for request {out.request_id}: {out.error or 'see the server log'}")))
            return
        if stream.streaming:  # a response per chunk of each output
            ids = stream.pending.setdefault(out.index, [])
            ids += out.new_token_ids
            stream.pending_text[out.index] = stream.pending_text.get(out.index, "") + out.text_delta
            if not out.finished and (not ids or out.mid_character):
                return  # the chunk would end inside a character
            chunk = Chunk(ids, stream.pending_text[out.index])
            stream.pending[out.index], stream.pending_text[out.index] = [], ""
        elif out.finished:  # a response per output
            chunk = Chunk(stream.prefix + out.token_ids, out.text)
        else:
            return
        response = self.response(stream, chunk, out)
        stream.unfinished -= out.finished
        if not stream.unfinished:  # the last output's last response ends the request
            self._close(stream, out, response)
        else:
            try:
                stream.sender.send(response)
            except Exception:  # the client is gone: stop generating for it
                self.executor.cancel(stream.executor_id)

    def _close(self, stream: Stream, out: RequestOutput, response: Any) -> None:
        stream.closed = True
        with self._lock:
            self._active.discard(stream)
        with contextlib.suppress(Exception):  # a client that cancelled is not there to tell
            stream.sender.send(response, flags=FINAL)
        if out.finish_reason in self.metrics["requests"]:
            self.metrics["requests"][out.finish_reason].increment(1)
        self.metrics["input_tokens"].observe(out.stats.prompt_tokens)
        self.metrics["output_tokens"].observe(out.stats.output_tokens)

    def perf_metrics(self, stream: Stream, stats: RequestStats) -> PerfMetrics:
        scheduled = stream.arrival_ns + round(stats.queue_s * 1e9) if stats.queue_s is not None else 0
        blocks = -(-(stats.prompt_tokens + stats.output_tokens) // self.kv_block_size) if self.kv_block_size else 0
        return PerfMetrics(stats.acceptance_rate, stats.num_accepted_draft_tokens, stats.num_draft_tokens, blocks,
                           max(blocks - stats.num_reused_blocks, 0), stats.num_reused_blocks, stats.num_missed_blocks,
                           stats.kv_cache_hit_rate, stream.arrival_ns, scheduled, stream.first_token_ns,
                           stream.last_token_ns)

    def perf_metric_tensors(self, stream: Stream, stats: RequestStats, flavour: str, shape: tuple[int, ...]) -> list:
        """The request's perf metrics as the outputs of `flavour` ("legacy" or "llmapi"), each shaped `shape`."""
        m = self.perf_metrics(stream, stats)
        return [pb_utils.Tensor(name, np.array([getattr(m, field)], dtype).reshape(shape))
                for name, field, dtype in PERF_OUTPUTS[flavour]]

    def _sender_health(self) -> str | None:
        stalled = self._sender.stalled_for()
        if stalled > self.watchdog_timeout_s and not self._outbox.empty():
            return f"the response sender has been stuck for {stalled:.1f} s with {self._outbox.qsize()} responses waiting"
        return None

    def _fail(self, reason: str) -> None:
        """The watchdog found requests no longer served: take the server down, so that readiness fails and a
        supervisor restarts it, rather than answer health checks while every request hangs."""
        pb_utils.Logger.log_error(f"{self.label}: {reason}; stopping tritonserver (pid {os.getppid()})")
        os.kill(os.getppid(), signal.SIGTERM)

    def _cancel_abandoned(self) -> None:
        """Cancel requests whose client cancelled or disconnected (frees their KV blocks now).

        Asked under the lock, of streams still active: a stream leaves `_active` under it before its final
        response is sent, by this thread or by `execute` (a refused submit). Triton 2.51 frees a request's
        response factory with its final response, and asking `is_cancelled` of it after that crashed
        tritonserver (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled) under a stream of refused requests."""
        with self._lock:
            cancelled = [s.executor_id for s in self._active if s.sender.is_cancelled()]
        for executor_id in cancelled:
            self.executor.cancel(executor_id)

    # ---- metrics --------------------------------------------------------------------------------
    def _create_metrics(self, model: str, version: str) -> None:
        """Upstream's families where upstream has one (dashboards keep working), plus counters
        and speculative-decoding gauges."""
        labels = {"model": model, "version": version}
        family = pb_utils.MetricFamily
        # Metric objects die with their family: keep the families for the model's lifetime.
        self._families = request, kv, spec, finished, tokens, drafts, input_len, output_len = (
            family("nv_trt_llm_request_metrics", "TRT LLM request metrics", family.GAUGE),
            family("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics", family.GAUGE),
            family("nv_trt_llm_spec_decode_metrics", "Speculative (MTP) decoding metrics", family.GAUGE),
            family("nv_trt_llm_requests_total", "Requests finished, by finish reason", family.COUNTER),
            family("nv_trt_llm_generated_tokens_total", "Tokens generated", family.COUNTER),
            family("nv_trt_llm_draft_tokens_total", "MTP draft tokens proposed and accepted", family.COUNTER),
            family("nv_llm_input_token_len", "TRT LLM response metrics", family.HISTOGRAM),
            family("nv_llm_output_token_len", "TRT LLM response metrics", family.HISTOGRAM))
        buckets = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]
        self.metrics = {
            "active": request.Metric(labels={"request_type": "active", **labels}),
            "scheduled": request.Metric(labels={"request_type": "scheduled", **labels}),
            "waiting": request.Metric(labels={"request_type": "waiting", **labels}),
            "max": request.Metric(labels={"request_type": "max", **labels}),
            "kv_used": kv.Metric(labels={"kv_cache_block_type": "used", **labels}),
            "kv_free": kv.Metric(labels={"kv_cache_block_type": "free", **labels}),
            "kv_max": kv.Metric(labels={"kv_cache_block_type": "max", **labels}),
            "kv_fraction": kv.Metric(labels={"kv_cache_block_type": "fraction", **labels}),
            "kv_tokens_per": kv.Metric(labels={"kv_cache_block_type": "tokens_per", **labels}),
            "kv_reused": kv.Metric(labels={"kv_cache_block_type": "reused", **labels}),  # prompt blocks, since start
            "acceptance_rate": spec.Metric(labels={"spec_decode_type": "acceptance_rate", **labels}),
            "acceptance_estimate": spec.Metric(labels={"spec_decode_type": "acceptance_estimate", **labels}),
            "draft_len": spec.Metric(labels={"spec_decode_type": "draft_len", **labels}),
            "requests": {reason: finished.Metric(labels={"finish_reason": reason, **labels})
                         for reason in ("stop", "length", "cancelled", "error")},
            "generated": tokens.Metric(labels=labels),
            "drafted": drafts.Metric(labels={"draft_token_type": "proposed", **labels}),
            "accepted": drafts.Metric(labels={"draft_token_type": "accepted", **labels}),
            "input_tokens": input_len.Metric(
                labels={"response_metric_type": "total_input_tokens", **labels}, buckets=buckets),
            "output_tokens": output_len.Metric(
                labels={"response_metric_type": "total_output_tokens", **labels}, buckets=buckets),
        }
        self.metrics["max"].set(self.executor.limits.max_batch_size)
        self.metrics["kv_tokens_per"].set(self.kv_block_size)

    def _metrics_loop(self) -> None:
        m, last = self.metrics, {"generated": 0, "drafted": 0, "accepted": 0}
        while self._running:
            time.sleep(self.stats_period_s)
            s = self.executor.stats()
            blocks = s.kv_blocks_used + s.kv_blocks_free
            m["active"].set(s.running + s.queued)
            m["scheduled"].set(s.running)
            m["waiting"].set(s.queued)
            m["kv_used"].set(s.kv_blocks_used)
            m["kv_free"].set(s.kv_blocks_free)
            m["kv_max"].set(blocks)
            m["kv_fraction"].set(s.kv_blocks_used / blocks if blocks else 0.0)
            m["kv_reused"].set(s.kv_reused_blocks)
            m["acceptance_rate"].set(s.acceptance_rate)
            m["acceptance_estimate"].set(s.acceptance_estimate)
            m["draft_len"].set(s.current_draft_len)
            for key, total in (("generated", s.generated_tokens), ("drafted", s.draft_tokens),
                               ("accepted", s.accepted_draft_tokens)):
                if total > last[key]:
                    m[key].increment(total - last[key])
                    last[key] = total

    def finalize(self) -> None:
        """Stop the executor (it finishes what is in flight as cancelled), send those last
        responses, then stop the threads."""
        self.watchdog.stop()
        self._running = False
        self.executor.shutdown()
        self._outbox.put(None)
        for t in self._threads:
            t.join(timeout=10)
        # Metrics before their families, while the stub still talks to the server: left to the interpreter's exit,
        # deleting them crashed the stub.
        self.metrics.clear()
        self._families = ()

    def client_error(self, error: Exception) -> Any:
        """What a client is told of a failed request: a refusal (ValueError: its message names the input) is
        INVALID_ARG, a server that stopped serving (RuntimeError) UNAVAILABLE; anything else is logged here in full
        and reported as INTERNAL without its traceback or a server path."""
        if isinstance(error, ValueError):
            return pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG)
        if isinstance(error, RuntimeError):
            return pb_utils.TritonError(str(error), pb_utils.TritonError.UNAVAILABLE)
        pb_utils.Logger.log_error(f"{self.label}: request failed: {''.join(traceback.format_exception(error))}")
        return pb_utils.TritonError(f"internal error ({type(error).__name__}); see the server log")


def given(request: Any, names: Any) -> dict[str, Any]:
    """The request's inputs among `names`, as numpy arrays (one pass over its inputs)."""
    return {t.name(): t.as_numpy() for t in request.inputs() if t.name() in names}
