"""Triton `tensorrt_llm`: TensorRT-LLM's engine model over runtime's executor (the native
`Executor`, or `TrtllmExecutor` for a --backend trtllm engine: `create_executor` picks).

Decoupled, one instance: execute() only translates tensors into Executor.submit calls and
returns, so every request in flight shares the executor's batch. The executor's output callback
queues outputs; one sender thread turns them into responses (keeping Triton IPC off the step
loop), notices cancelled requests and cancels them in the executor, which frees their KV blocks.
A metrics thread publishes the executor's stats as Triton custom metrics.

Streaming chunks end on whole characters: ids whose text ends inside a character (U+FFFD) wait
for the next output. Stop words stay in the output, as upstream's do.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import queue
import signal
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from runtime.executors.base import ExecutorConfig
from runtime.executors.requests import RequestOutput, RequestStats
from runtime.core.sampling import SamplingParams
from runtime.executors.base import create_executor
from serving.request_validation import (TENSORRT_LLM_SCALARS, RequestError, client_named, integer,
                                        no_unknown_parameters, token_ids)
from serving.triton_parameters import boolean, integer as integer_parameter, model_path, number, parameter
from serving.watchdog import Progress, Watchdog

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

# Inputs TensorRT-LLM clients send that this runtime implements only at their neutral value.
NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "beam_width": (lambda v: v == 1, "1 (no beam search)"),
    "num_return_sequences": (lambda v: v == 1, "1"),
    "repetition_penalty": (lambda v: v == 1, "1.0"),
    "presence_penalty": (lambda v: v == 0, "0.0"),
    "frequency_penalty": (lambda v: v == 0, "0.0"),
    "return_log_probs": (lambda v: not v, "false"),
    "return_context_logits": (lambda v: not v, "false"),
    "return_generation_logits": (lambda v: not v, "false"),
}
WATCHDOG_TIMEOUT_S = 120.0  # default: no step of a deployment here comes near it; a wedged loop waits forever


@dataclass(eq=False)
class Stream:
    """One Triton request in flight."""

    sender: Any  # pb_utils.InferenceResponseSender
    triton_id: str  # the client's request id (TensorRT-LLM's `stop` input names it)
    streaming: bool
    prefix: list[int]  # prompt ids put before a non-streamed output (empty when excluded)
    perf_metrics: bool  # return_perf_metrics: each response carries the request's perf metrics
    token_counts: tuple[bool, bool]  # return_num_input_tokens, return_num_output_tokens
    executor_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    pending: list[int] = field(default_factory=list)  # streamed ids not sent yet
    # perf_counter_ns (CLOCK_MONOTONIC, the clock of upstream's std::chrono::steady_clock times)
    arrival_ns: int = field(default_factory=time.perf_counter_ns)
    first_token_ns: int = 0  # when the executor reported the first / latest new tokens (0: none yet)
    last_token_ns: int = 0


def word_list(request: Any, name: str, vocab_size: int) -> list[list[int]]:
    """TensorRT-LLM's [1, 2, W] word list (ids, end offsets padded with -1) -> words as id lists."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return []
    arr = t.as_numpy()
    if arr.ndim == 3:
        if arr.shape[0] != 1:
            raise RequestError(f"{name}: one request per batch item expected, got batch {arr.shape[0]}")
        arr = arr[0]
    if arr.ndim != 2 or arr.shape[0] != 2:
        raise RequestError(f"{name} must have shape [2, W] (ids, offsets), got {list(t.as_numpy().shape)}")
    ids, offsets = arr[0].tolist(), [o for o in arr[1].tolist() if o >= 0]
    if offsets != sorted(offsets) or (offsets and offsets[-1] > len(ids)):
        raise RequestError(f"{name}: offsets {offsets} are not increasing ends within {len(ids)} ids")
    words = [ids[a:b] for a, b in zip([0] + offsets, offsets) if b > a]
    token_ids((t for word in words for t in word), name, vocab_size)
    return words


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        faulthandler.enable()  # a crash of this stub is logged with its Python stacks, not lost
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                "tensorrt_llm must be decoupled (model_transaction_policy { decoupled: true }): it answers "
                "from the executor's thread so that concurrent requests share one batch")
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
        if rank:
            raise pb_utils.TritonModelException(
                f"rank {rank}: the native runtime runs in one process (ranks are merged at load); use world_size 1")
        engine_dir = model_path(config, "gpt_model_path", args["model_repository"])
        threads = parameter(config, "torch_threads", integer_parameter)
        if threads:  # small decode steps on a busy CPU run faster on fewer threads
            torch.set_num_threads(threads)
        executor_config = ExecutorConfig(
            num_draft_tokens=parameter(config, "num_draft_tokens", integer_parameter),
            speculation=parameter(config, "speculation") or "adaptive",
            max_batch_size=parameter(config, "executor_max_batch_size", integer_parameter),
            max_seq_len=parameter(config, "executor_max_seq_len", integer_parameter),
            kv_cache_tokens=parameter(config, "max_tokens_in_paged_kv_cache", integer_parameter),
            free_memory_fraction=parameter(config, "kv_cache_free_gpu_mem_fraction", number, default=0.9),
            device=parameter(config, "device") or "cpu")
        pb_utils.Logger.log_info(f"tensorrt_llm: loading {engine_dir}")
        self.executor = create_executor(engine_dir, executor_config)
        self.tokenizer = self.executor.tokenizer
        self.vocab_size = self.executor.engine.model_config.vocab_size
        self.exclude_input_default = parameter(config, "exclude_input_in_output", boolean, default=False)
        self.cancel_period_s = parameter(config, "cancellation_check_period_ms", integer_parameter, default=100) / 1000
        self.stats_period_s = parameter(config, "stats_check_period_ms", integer_parameter, default=100) / 1000
        self.watchdog_timeout_s = parameter(config, "watchdog_timeout_s", number, default=WATCHDOG_TIMEOUT_S)
        self._create_metrics(args["model_name"], args["model_version"])

        self._outbox: queue.Queue[tuple[Stream, RequestOutput, int] | None] = queue.Queue()
        # KV block size of the native executor; a TensorRT-LLM executor's block counts read 0 (as its metrics)
        self.kv_block_size = getattr(getattr(self.executor, "cache", None), "block_size", 0)
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
        pb_utils.Logger.log_info(f"tensorrt_llm: serving {engine_dir}")

    # ---- requests -------------------------------------------------------------------------------
    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                if self.watchdog.failure:
                    raise RuntimeError(f"tensorrt_llm is not serving: {self.watchdog.failure}")
                no_unknown_parameters(request.parameters(), "tensorrt_llm")
                if self._scalar(request, "stop", False):
                    self._stop(request.request_id(), sender)
                    continue
                prompt, params, streaming, exclude = self._convert(request)
                stream = Stream(sender, request.request_id(), streaming, [] if exclude else prompt,
                                bool(self._scalar(request, "return_perf_metrics", False)),
                                (bool(self._scalar(request, "return_num_input_tokens", False)),
                                 bool(self._scalar(request, "return_num_output_tokens", False))))
                with self._lock:
                    self._active.add(stream)
                try:
                    self.executor.submit(prompt, params, request_id=stream.executor_id,
                                         on_output=lambda out, s=stream: self._outbox.put(
                                             (s, out, time.perf_counter_ns())))
                except BaseException:
                    with self._lock:
                        self._active.discard(stream)
                    raise
            except Exception as e:
                sender.send(pb_utils.InferenceResponse(error=client_error(e)), flags=FINAL)
        return None

    @staticmethod
    def _scalar(request: Any, name: str, default: Any = None) -> Any:
        """One value of a scalar input, checked in its declared type before anything converts it."""
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            return default
        return TENSORRT_LLM_SCALARS[name].read(t.as_numpy(), client_named(name))

    def _convert(self, request: Any) -> tuple[list[int], SamplingParams, bool, bool]:
        """Triton tensors -> (prompt ids, SamplingParams, streaming, exclude_input_in_output)."""
        for name, (is_neutral, supported) in NEUTRAL.items():
            value = self._scalar(request, name)
            if value is not None and not is_neutral(value):
                raise ValueError(f"{name}={value} is not supported by this runtime (supported: {supported})")
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if ids is None:
            raise ValueError("input_ids is required")
        ids = ids.as_numpy()
        if ids.ndim == 2 and ids.shape[0] != 1:
            raise RequestError(f"input_ids: one prompt per request expected, got batch {ids.shape[0]} "
                               "(requests are batched in flight; send them separately)")
        ids = ids.reshape(-1)
        length = self._scalar(request, "input_lengths", len(ids))
        if not 0 <= length <= len(ids):
            raise RequestError(f"input_lengths {length} is outside [0, {len(ids)}] (the input_ids given)")
        ids = token_ids(ids[:length], "input_ids", self.vocab_size)
        max_tokens = self._scalar(request, "request_output_len")
        if max_tokens is None:
            raise RequestError("request_output_len (max_tokens) is required")

        stop, stop_ids = [], []
        for word in word_list(request, "stop_words_list", self.vocab_size):
            if len(word) == 1 and word[0] in self.tokenizer.special_ids:
                stop_ids.append(word[0])  # special tokens never show in the text a stop string is matched in
            else:
                stop.append(self.tokenizer.decode(word, skip_special_tokens=False))
        bad_ids = []
        for word in word_list(request, "bad_words_list", self.vocab_size):
            if len(word) != 1:
                raise RequestError(f"bad_words: {self.tokenizer.decode(word, skip_special_tokens=False)!r} is "
                                 f"{len(word)} tokens; only single-token bad words are supported")
            bad_ids.append(word[0])
        seed = self._alias(request, "seed", "random_seed")
        min_tokens = self._alias(request, "min_tokens", "min_length")
        ignore_stops = False
        if min_tokens is not None and min_tokens > 1:
            if min_tokens < max_tokens:
                name = "min_tokens" if self._scalar(request, "min_tokens") is not None else "min_length"
                raise RequestError(f"{name}={min_tokens} is not supported by this runtime (supported: <= 1, or >= "
                                 f"max_tokens ({max_tokens}), which ignores the end id and stop ids)")
            ignore_stops = True  # genai-perf's fixed output length: min_length = max_tokens
        temperature, top_k, top_p = self._sampling(request)
        end_id = self._end_id(request)
        ignore_eos = end_id is not None and end_id != self.tokenizer.eos_token_id
        if ignore_eos and end_id >= 0:  # a custom end id replaces eos; -1 means none
            stop_ids.append(end_id)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=tuple(stop),
            stop_token_ids=() if ignore_stops else tuple(stop_ids),
            bad_token_ids=tuple(bad_ids),
            ignore_eos=ignore_eos or ignore_stops)
        streaming = bool(self._scalar(request, "streaming", False))
        exclude = bool(self._scalar(request, "exclude_input_in_output", self.exclude_input_default))
        return ids, params, streaming, exclude

    def _end_id(self, request: Any) -> int | None:
        """end_id: a token id, or -1 for none (TensorRT-LLM's); any other value, a wrapped INT32 among them, is
        refused rather than read as "no end id"."""
        t = pb_utils.get_input_tensor_by_name(request, "end_id")
        return None if t is None else integer(t.as_numpy(), "end_id", -1, self.vocab_size - 1)

    def _alias(self, request: Any, name: str, old_name: str) -> Any:
        """An input that upstream's older templates name differently (random_seed, min_length)."""
        value, old = self._scalar(request, name), self._scalar(request, old_name)
        if value is not None and old is not None and value != old:
            raise RequestError(f"{name}={value} and {old_name}={old} differ ({old_name} is the older name of "
                               f"{name}); give one of them")
        return old if value is None else value

    def _sampling(self, request: Any) -> tuple[float, int, float]:
        """(temperature, top_k, top_p) as TensorRT-LLM reads its inputs: runtime_top_k 0 or unset with
        runtime_top_p unset or <= 0 decodes greedily whatever the temperature (its top-k kernel then takes
        k = 1); otherwise it samples, at temperature 1.0 when none is given (upstream's default)."""
        temperature = self._scalar(request, "temperature")
        top_k = self._scalar(request, "runtime_top_k", 0)
        top_p = self._scalar(request, "runtime_top_p")
        top_p_set = top_p is not None and top_p > 0  # upstream reads top_p <= 0 as "not set"
        sampling = top_k != 0 or top_p_set
        if temperature is None:
            temperature = 1.0 if sampling else 0.0
        elif not sampling and temperature >= 0:
            temperature = 0.0  # greedy; an invalid temperature still gets its error
        return temperature, top_k, top_p if top_p_set else 1.0

    def _stop(self, triton_id: str, sender: Any) -> None:
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
                    pb_utils.Logger.log_error(f"tensorrt_llm: delivering a response failed: {traceback.format_exc()}")
            if time.monotonic() >= next_check:
                self._cancel_abandoned()
                next_check = time.monotonic() + self.cancel_period_s

    def _deliver(self, stream: Stream, out: RequestOutput, at_ns: int) -> None:
        if out.new_token_ids:
            stream.first_token_ns = stream.first_token_ns or at_ns
            stream.last_token_ns = at_ns
        if out.finish_reason == "error":
            self._close(stream, out, pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"generation failed for request {out.request_id}: {out.error or 'see the server log'}")))
            return
        if stream.streaming:
            stream.pending += out.new_token_ids
            if not out.finished and (not stream.pending or out.mid_character):
                return  # the chunk would end inside a character
            ids, stream.pending = stream.pending, []
        elif out.finished:
            ids = stream.prefix + out.token_ids
        else:
            return
        response = self._response(ids, stream, out.stats)
        if out.finished:
            self._close(stream, out, response)
        else:
            try:
                stream.sender.send(response)
            except Exception:  # the client is gone: stop generating for it
                self.executor.cancel(stream.executor_id)

    def _close(self, stream: Stream, out: RequestOutput, response: Any) -> None:
        with self._lock:
            self._active.discard(stream)
        with contextlib.suppress(Exception):  # a client that cancelled is not there to tell
            stream.sender.send(response, flags=FINAL)
        if out.finish_reason in self.metrics["requests"]:
            self.metrics["requests"][out.finish_reason].increment(1)
        self.metrics["input_tokens"].observe(out.stats.prompt_tokens)
        self.metrics["output_tokens"].observe(out.stats.output_tokens)

    def _response(self, ids: list[int], stream: Stream, stats: RequestStats) -> Any:
        """output_ids and sequence_length, plus what the request asked for: as upstream's, perf metrics
        only with return_perf_metrics and token counts only with return_num_*_tokens, for each tensor
        costs every streamed token its trip through the server, the ensemble and the client."""
        def scalar(name: str, value: Any, dtype: Any) -> Any:
            return pb_utils.Tensor(name, np.array([[value]], dtype))

        tensors = [pb_utils.Tensor("output_ids", np.array(ids, np.int32).reshape(1, 1, -1)),
                   pb_utils.Tensor("sequence_length", np.array([[len(ids)]], np.int32))]
        if stream.perf_metrics:
            # No prefix reuse here: every block a request holds is new. Counted as the blocks its
            # tokens so far occupy. First scheduled: arrival plus the executor's queueing time (0 when
            # the backend does not report it, as upstream's unset times).
            scheduled = stream.arrival_ns + round(stats.queue_s * 1e9) if stats.queue_s is not None else 0
            blocks = -(-(stats.prompt_tokens + stats.output_tokens) // self.kv_block_size) if self.kv_block_size else 0
            tensors += [
                scalar("acceptance_rate", stats.acceptance_rate, np.float32),
                scalar("total_accepted_draft_tokens", stats.num_accepted_draft_tokens, np.int32),
                scalar("total_draft_tokens", stats.num_draft_tokens, np.int32),
                scalar("kv_cache_alloc_new_blocks", blocks, np.int32),
                scalar("kv_cache_reused_blocks", 0, np.int32),
                scalar("kv_cache_alloc_total_blocks", blocks, np.int32),
                scalar("arrival_time_ns", stream.arrival_ns, np.int64),
                scalar("first_scheduled_time_ns", scheduled, np.int64),
                scalar("first_token_time_ns", stream.first_token_ns, np.int64),
                scalar("last_token_time_ns", stream.last_token_ns, np.int64)]
        if stream.token_counts[0]:
            tensors.append(scalar("num_input_tokens", stats.prompt_tokens, np.int32))
        if stream.token_counts[1]:
            tensors.append(scalar("num_output_tokens", stats.output_tokens, np.int32))
        return pb_utils.InferenceResponse(tensors)

    def _sender_health(self) -> str | None:
        stalled = self._sender.stalled_for()
        if stalled > self.watchdog_timeout_s and not self._outbox.empty():
            return f"the response sender has been stuck for {stalled:.1f} s with {self._outbox.qsize()} responses waiting"
        return None

    def _fail(self, reason: str) -> None:
        """The watchdog found requests no longer served: take the server down, so that readiness fails and a
        supervisor restarts it, rather than answer health checks while every request hangs."""
        pb_utils.Logger.log_error(f"tensorrt_llm: {reason}; stopping tritonserver (pid {os.getppid()})")
        os.kill(os.getppid(), signal.SIGTERM)

    def _cancel_abandoned(self) -> None:
        """Cancel requests whose client cancelled or disconnected (frees their KV blocks now)."""
        with self._lock:
            streams = list(self._active)
        for s in streams:
            if s.sender.is_cancelled():
                self.executor.cancel(s.executor_id)

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


def client_error(error: Exception) -> Any:
    """What a client is told of a failed request: a refusal (ValueError: its message names the input) is
    INVALID_ARG, a server that stopped serving (RuntimeError) UNAVAILABLE; anything else is logged here in full and
    reported as INTERNAL without its traceback or a server path."""
    if isinstance(error, ValueError):
        return pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG)
    if isinstance(error, RuntimeError):
        return pb_utils.TritonError(str(error), pb_utils.TritonError.UNAVAILABLE)
    pb_utils.Logger.log_error(f"tensorrt_llm: request failed: {''.join(traceback.format_exception(error))}")
    return pb_utils.TritonError(f"internal error ({type(error).__name__}); see the server log")
