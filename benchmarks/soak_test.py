"""Bounded soak test of the Triton deployment: a mixed closed-loop load on 127.0.0.1 that must leave the
server as it found it (no unexpected error, the same greedy text under load, every KV block free, resident
memory grown by at most 10% after warm-up, ready and serving at the end).

  python -m benchmarks.soak_test                 # 30 minutes at concurrency 32
  python -m benchmarks.soak_test --quick         # smoke run: 2 minutes at concurrency 8
  python -m benchmarks.soak_test --flavour llmapi [--quick]   # the llmapi repository instead of the legacy one

Builds an engine of the shipped model (or serves --engine_dir), makes a model repository of it with
make_model_repo's defaults (adaptive MTP speculation) in the --flavour asked for and starts the real tritonserver.
Each client picks a kind of request by the flavour's fixed weights (Flavour.kinds).

legacy (the default; KINDS): streaming and not, over gRPC and HTTP (generate, generate_stream SSE), to `ensemble`,
`tensorrt_llm_bls`, `tensorrt_llm` (token ids) and `postprocessing`; cancels (a gRPC stream stopped after its
first response, on the BLS and on tensorrt_llm: the surfaces that forward cancellation, triton_repo/README.md);
disconnects (a raw HTTP SSE socket closed after the first event); bad requests, each with the refusal it must
get; prompts near max_seq_len; and probes, greedy prompts whose text recorded on the idle server must come back
identical.

llmapi (LLMAPI_KINDS): the one model `make_model_repo --flavour llmapi` makes, a decoupled `tensorrt_llm` taking
text (`text_input`, `streaming`, `sampling_param_*`, no batch dimension), each streamed `text_output` the whole
text so far (checked to extend the previous one): gRPC streams, streaming and not, greedy and sampled, HTTP generate
and generate_stream; cancels (a gRPC stream stopped after its first response) and `stop` requests naming a running
stream's id (the stop answered "Request cancelled by client", the stream ending with finish_reason cancelled);
disconnects (an SSE socket closed after the first event); bad requests, each with its exact refusal (LLMAPI_BAD: an
unknown input over gRPC and HTTP, sampling_param values out of range, an oversized text_input, unary ModelInfer on
the decoupled model, which Triton refuses: the repository has no unary model); prompts near max_seq_len; and probes
over every surface, and with drafting off (sampling_param_num_draft_tokens 0). The model has no input that ignores
eos, so its cancels, stops and disconnects decode greedily a prompt whose greedy continuation ran CANCEL_TOKENS
tokens on the idle server (recorded at the start): such a request is still running when it is cancelled, and each
must be counted cancelled by the executor, as in the legacy flavour.

Every request is bounded by --request_timeout_s; clients stop by themselves at the end.

Resident memory (VmRSS) of every process of the server (tritonserver, each Python backend stub, and an executor
process a stub runs its engine in where the model is so configured) is sampled
idle, after priming, after --warmup_s of the timed load ("start"), every --sample_every_s and after the load
drains ("end"), with the shared memory within it at the start and the end (RssShmem, reported, not judged).
Priming sends every kind --prime_rounds times from all clients at once before the timed load: a
process's memory keeps the high-water mark of what it held at once (2 MB request bodies refused 32 at a time), so
a baseline taken before every kind has hit its peak concurrency reads a plateau reached later as growth. Two
checks then separate a plateau from a leak: growth from start to end within 10% (the issue's bound), and the
growth rate fitted over the second half of the timed load, over the whole start-to-end window, within 10% too (a
process still climbing at the end fails it even when its start-to-end growth is small). Writes <out>.json and
<out>.md (default docs/benchmarks/soak, soak_llmapi with --flavour llmapi, _quick after it with --quick); exits 1 on
any failed check.
"""

from __future__ import annotations

import argparse
import http.client
import json
import queue
import random
import re
import shutil
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from benchmarks import ROOT
from benchmarks.common import DEFAULT_MODEL, fmt, machine_info, run_tool, write_results
from benchmarks.soak_common import (CANCEL_TOKENS, PROBE_TOKENS, Kinds, Record, Result, Unexpected, Watched,
                                    add_soak_args, check_soak_args, errors_by_kind, latency_stats, make_prompts,
                                    metric, read_metrics, report_md, rss_checks, rss_kb, rss_results, rss_table,
                                    run_load, summarize_kinds, wait_drained)
from serving.triton.launcher import STUB_CRASH, TritonServer, python_stubs, start_server
from serving.triton.llmapi_config import MODEL_YAML
from serving.triton.model_repo import add_llmapi_model, default_values, fill_model_repo

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException
import yaml

from runtime.executors.lifetime import live_descendants, module_run_by
from runtime.io.engine_format import read_limits
from runtime.io.tokenizer import Tokenizer

EXECUTOR_MODULES = ("runtime.executors.process", "runtime.executors.ranks")  # an engine's processes under a stub
CANCEL_PROMPTS = 8  # prompts tried for the llmapi flavour's cancels (record_cancel_prompts)
DRAIN_S = 60.0  # after the load, how long the server may take to report no active request and no used KV block
QUICK = dict(minutes=2.0, concurrency=8, sample_every_s=30.0)
GRPC_TYPES = {"i": ("INT32", np.int32), "u": ("UINT64", np.uint64), "f": ("FP32", np.float32), "b": ("BOOL", bool),
              "O": ("BYTES", object)}


# ---- repository flavours ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Flavour:
    """What the clients of one repository flavour need (FLAVOURS): its request kinds, the surfaces its probes go
    over (name -> (transport, model, more request values)), and how its text requests are written."""

    name: str
    kinds: Kinds
    probe_surfaces: dict[str, tuple[str, str, dict[str, Any]]]
    names: dict[str, str] = field(default_factory=dict)  # a text request's legacy input names -> this flavour's
    batched: bool = True  # inputs carry a batch dimension (the llmapi model's max_batch_size is 0: none)
    cumulative: bool = False  # each streamed text_output is the whole text so far (llmapi), not the new text
    no_eos: dict[str, Any] = field(default_factory=dict)  # what makes a text request ignore eos (llmapi: nothing)

    def named(self, values: dict[str, Any]) -> dict[str, Any]:
        return {self.names.get(k, k): v for k, v in values.items()}


# ---- clients --------------------------------------------------------------------------------------
@dataclass
class Ctx:
    """What every request needs: the server and its repository's flavour, the tokenizer, the engine's limits, the
    prompts."""

    server: TritonServer
    flavour: Flavour
    tok: Tokenizer
    max_seq_len: int
    prompts: list[str]
    long_prompts: list[str]
    ids: dict[str, list[int]]  # token ids of `prompts` and GOOD's text, encoded once (not in every client)
    probes: dict[str, str] = field(default_factory=dict)  # prompt -> greedy text on the idle server
    # prompts a request that must still be running when cancelled may use (record_cancel_prompts)
    cancel_prompts: list[str] = field(default_factory=list)
    timeout: float = 120.0

    @property
    def vocab(self) -> int:
        return self.tok.vocab_size


@dataclass
class Reply:
    """One request as the client saw it; `first_at` (perf_counter) is the first response carrying output."""

    text: bytes = b""
    ids: list[int] = field(default_factory=list)
    first_at: float | None = None
    responses: int = 0
    error: str | None = None
    status: int | None = None
    finish_reason: str | None = None  # the last one sent (the llmapi model's, asked for with return_finish_reason)

    def add_text(self, text: bytes, cumulative: bool) -> None:
        """One response's text_output: the new text (legacy), or the whole text so far (llmapi), which must then
        extend the previous response's."""
        if not cumulative:
            self.text += text
        elif text.startswith(self.text):
            self.text = text
        else:
            raise Unexpected(f"streamed text_output {text[:80]!r} does not extend the previous response's "
                             f"{self.text[:80]!r}")


def grpc_arrays(values: dict[str, Any], batched: bool = True) -> dict[str, np.ndarray]:
    """Python / numpy values as the arrays a client sends (typed as GRPC_TYPES), each with a leading batch dimension
    of 1 (`batched`), or shaped as given, a scalar as [1] (the llmapi model: max_batch_size 0)."""
    arrays = {}
    for name, value in values.items():
        arr = np.asarray(value)
        if arr.dtype.kind in "US":
            arr = np.vectorize(lambda s: s.encode() if isinstance(s, str) else s, otypes=[object])(arr)
        if batched:
            arr = arr.reshape(1, -1) if arr.ndim < 2 else arr
        else:
            arr = arr.reshape(1) if arr.ndim == 0 else arr
        arrays[name] = arr.astype(GRPC_TYPES[arr.dtype.kind][1])
    return arrays


def grpc_inputs(values: dict[str, Any], batched: bool = True) -> list[grpcclient.InferInput]:
    """tritonclient inputs from Python / numpy values (grpc_arrays)."""
    inputs = []
    for name, arr in grpc_arrays(values, batched).items():
        inputs.append(grpcclient.InferInput(name, list(arr.shape), GRPC_TYPES[arr.dtype.kind][0]))
        inputs[-1].set_data_from_numpy(arr)
    return inputs


def grpc_stream(ctx: Ctx, model: str, values: dict[str, Any], cancel_after_first: bool = False,
                request_id: str = "", on_first: Callable[[], None] | None = None) -> Reply:
    """One request over gRPC streaming, read to its final response (or, with cancel_after_first, cancelled by
    the client after its first output; `on_first()` runs once the first output came). Bounded: no response within
    the timeout raises Unexpected."""
    client = grpcclient.InferenceServerClient(ctx.server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error, time.perf_counter())),
                        stream_timeout=ctx.timeout)
    out, done = Reply(), False
    try:
        client.async_stream_infer(model, grpc_inputs(values, ctx.flavour.batched), request_id=request_id,
                                  enable_empty_final_response=True)
        deadline = time.monotonic() + ctx.timeout
        while True:
            try:
                result, error, at = responses.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise Unexpected(f"no response from {model} within {ctx.timeout:.0f} s") from None
            if error is not None:
                out.error, done = error.message(), True
                return out
            out.responses += 1
            text, ids = result.as_numpy("text_output"), result.as_numpy("output_ids")
            first = out.first_at is None
            if text is not None or ids is not None:
                out.first_at = out.first_at or at
                out.add_text(b"" if text is None else b"".join(text.reshape(-1)), ctx.flavour.cumulative)
                out.ids += [] if ids is None else ids.reshape(-1).tolist()
            reason = result.as_numpy("finish_reason")
            out.finish_reason = out.finish_reason if reason is None else reason.reshape(-1)[0].decode()
            if result.get_response().parameters["triton_final_response"].bool_param:
                done = True
                return out
            if first and out.first_at is not None and on_first is not None:
                on_first()
            if cancel_after_first and out.first_at is not None:
                return out
    finally:
        client.stop_stream(cancel_requests=not done)
        client.close()
def http_post(ctx: Ctx, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{ctx.server.http_url}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=ctx.timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_generate(ctx: Ctx, model: str, body: dict[str, Any]) -> Reply:
    status, raw = http_post(ctx, f"/v2/models/{model}/generate", body)
    out = Reply(status=status)
    try:
        data = json.loads(raw)
    except ValueError:
        raise Unexpected(f"HTTP {status}: not JSON: {raw[:200]!r}") from None
    if status != 200 or "error" in data:  # Triton 2.51 answers some errors with 200 (docs/reliability.md)
        out.error = data.get("error", raw.decode(errors="replace"))
    else:
        out.text, out.responses = data["text_output"].encode(), 1
        out.finish_reason = data.get("finish_reason")
    return out


def http_sse(ctx: Ctx, model: str, body: dict[str, Any]) -> Reply:
    """generate_stream, each `data:` event read as it arrives (strict UTF-8 JSON)."""
    host, port = ctx.server.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=ctx.timeout)
    try:
        conn.request("POST", f"/v2/models/{model}/generate_stream", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out = Reply(status=resp.status)
        for line in iter(resp.readline, b""):
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[len(b"data: "):].decode("utf-8"))
            if "error" in event:
                out.error = event["error"]
                break
            out.responses += 1
            out.first_at = out.first_at or time.perf_counter()
            out.add_text(event["text_output"].encode(), ctx.flavour.cumulative)
        return out
    finally:
        conn.close()


def http_disconnect(ctx: Ctx, model: str, body: dict[str, Any]) -> None:
    """A generate_stream client that goes away after the first SSE event."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", ctx.server.http_port), timeout=ctx.timeout) as sock:
        sock.sendall(b"POST /v2/models/%s/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (model.encode(), len(data), data))
        received = b""
        while b"data: " not in received:  # the headers may come in a segment of their own
            chunk = sock.recv(4096)
            if not chunk:
                raise Unexpected(f"connection closed before the first event: {received[:300]!r}")
            received += chunk
        if b'"error"' in received:
            raise Unexpected(f"refused: {received[-300:]!r}")


def http_infer(ctx: Ctx, model: str, values: dict[str, np.ndarray]) -> str | None:
    """Unary HTTP infer, each input shaped as given; the refusal's message (Triton's or the model's), None if it
    was served."""
    client = httpclient.InferenceServerClient(ctx.server.http_url, network_timeout=ctx.timeout)
    try:
        inputs = []
        for name, arr in values.items():
            inputs.append(httpclient.InferInput(name, list(arr.shape), GRPC_TYPES[arr.dtype.kind][0]))
            inputs[-1].set_data_from_numpy(arr)
        client.infer(model, inputs)
    except InferenceServerException as e:
        return str(e)
    finally:
        client.close()
    return None


# ---- request kinds ---------------------------------------------------------------------------------


def served(reply: Reply, sent: float, what: str) -> Result:
    """A normal request: no error, whole UTF-8 (it may be empty: eos can come first)."""
    if reply.error is not None:
        raise Unexpected(reply.error)
    try:
        reply.text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Unexpected(f"{what}: output is not UTF-8 ({e})") from None
    return Result("ok", None if reply.first_at is None else reply.first_at - sent)


def text_request(ctx: Ctx, rng: random.Random | None, prompt: str, sampled: bool = False,
                 max_tokens: int | None = None, stream: bool | None = None, **more: Any) -> dict[str, Any]:
    """A text request in the flavour's input names (Flavour.named): greedy, or sampled with a seed; max_tokens
    drawn when not given; `stream` left out when None."""
    values: dict[str, Any] = {"text_input": prompt, "max_tokens": max_tokens or rng.randint(8, 128),
                              "exclude_input_in_output": True, **more}
    if sampled:
        values |= {"top_p": 0.9, "temperature": 0.8, "seed": np.uint64(rng.randrange(2**32))}
    if stream is not None:
        values["stream"] = stream
    return ctx.flavour.named(values)


def grpc_text(model: str, sampled: bool = False, stream: bool = True) -> Callable[[Ctx, random.Random], Result]:
    def send(ctx: Ctx, rng: random.Random) -> Result:
        sent = time.perf_counter()
        reply = grpc_stream(ctx, model, text_request(ctx, rng, rng.choice(ctx.prompts), sampled, stream=stream))
        if not stream and reply.responses != 1:
            raise Unexpected(f"stream false: {reply.responses} responses, expected 1")
        return served(reply, sent, model)
    return send


def http_text(model: str, sse: bool) -> Callable[[Ctx, random.Random], Result]:
    def send(ctx: Ctx, rng: random.Random) -> Result:
        body = text_request(ctx, rng, rng.choice(ctx.prompts), sampled=rng.random() < 0.5, stream=True if sse else None)
        body = {k: int(v) if isinstance(v, np.integer) else v for k, v in body.items()}
        sent = time.perf_counter()
        reply = http_sse(ctx, model, body) if sse else http_generate(ctx, model, body)
        return served(reply, sent, model)
    return send


def engine_request(ctx: Ctx, prompt: str, max_tokens: int, end_id: int | None = None) -> dict[str, Any]:
    ids = ctx.ids[prompt]
    values = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[max_tokens]], np.int32), "streaming": np.array([[True]])}
    return values if end_id is None else {**values, "end_id": np.array([[end_id]], np.int32)}


def tensorrt_llm_stream(ctx: Ctx, rng: random.Random) -> Result:
    max_tokens = rng.randint(8, 128)
    sent = time.perf_counter()
    reply = grpc_stream(ctx, "tensorrt_llm", engine_request(ctx, rng.choice(ctx.prompts), max_tokens))
    result = served(reply, sent, "tensorrt_llm")
    if len(reply.ids) > max_tokens or not all(0 <= t < ctx.vocab for t in reply.ids):
        raise Unexpected(f"tensorrt_llm: {len(reply.ids)} ids for max_tokens {max_tokens}, or ids outside the "
                         f"vocabulary: {reply.ids[:8]}")
    return result


def running_request(ctx: Ctx, rng: random.Random) -> dict[str, Any]:
    """A streamed text request still running when its client cancels it after the first output: CANCEL_TOKENS
    greedy tokens, eos ignored (legacy: end_id -1) or, where the model has no input for that (llmapi), of a prompt
    whose greedy continuation ran CANCEL_TOKENS tokens on the idle server (record_cancel_prompts)."""
    return {**text_request(ctx, rng, rng.choice(ctx.cancel_prompts), max_tokens=CANCEL_TOKENS, stream=True),
            **ctx.flavour.no_eos}


def engine_running_request(ctx: Ctx, rng: random.Random) -> dict[str, Any]:
    """running_request for the legacy tensorrt_llm (token ids)."""
    return engine_request(ctx, rng.choice(ctx.prompts), CANCEL_TOKENS, end_id=-1)


def cancel(model: str, request: Callable[[Ctx, random.Random], dict[str, Any]] = running_request
           ) -> Callable[[Ctx, random.Random], Result]:
    def send(ctx: Ctx, rng: random.Random) -> Result:
        values = request(ctx, rng)
        sent = time.perf_counter()
        reply = grpc_stream(ctx, model, values, cancel_after_first=True)
        if reply.error is not None:
            raise Unexpected(reply.error)
        if reply.first_at is None:
            raise Unexpected(f"{model}: the request ended before its first output")
        return Result("cancelled", reply.first_at - sent)
    return send


STOP_ANSWER = "Request cancelled by client"  # the llmapi model's answer to a `stop` request, as upstream's


def stop_by_id(model: str) -> Callable[[Ctx, random.Random], Result]:
    """A stream stopped, once its first output came, by a `stop` request naming its id (on a stream of its own):
    the stop is answered STOP_ANSWER, the stream ends with finish_reason cancelled."""
    def send(ctx: Ctx, rng: random.Random) -> Result:
        request_id = f"soak-{rng.getrandbits(64):016x}"
        stops: list[Reply] = []

        def stop() -> None:
            stops.append(grpc_stream(ctx, model, {"text_input": "", "stop": True}, request_id=request_id))

        sent = time.perf_counter()
        reply = grpc_stream(ctx, model, {**running_request(ctx, rng), "return_finish_reason": True},
                            request_id=request_id, on_first=stop)
        if reply.error is not None:
            raise Unexpected(reply.error)
        if not stops:
            raise Unexpected(f"{model}: the request ended before its first output")
        if stops[0].error != STOP_ANSWER:
            raise Unexpected(f"the stop request was answered {stops[0].error!r}, expected {STOP_ANSWER!r}")
        if reply.finish_reason != "cancelled":
            raise Unexpected(f"the stopped request ended with finish_reason {reply.finish_reason!r}, expected "
                             "cancelled")
        return Result("cancelled", reply.first_at - sent)
    return send


def disconnect(model: str) -> Callable[[Ctx, random.Random], Result]:
    def send(ctx: Ctx, rng: random.Random) -> Result:
        http_disconnect(ctx, model, running_request(ctx, rng))
        return Result("disconnected")
    return send


def long_prompt(models: tuple[str, ...]) -> Callable[[Ctx, random.Random], Result]:
    def send(ctx: Ctx, rng: random.Random) -> Result:
        model = rng.choice(models)
        sent = time.perf_counter()
        reply = grpc_stream(ctx, model, text_request(ctx, rng, rng.choice(ctx.long_prompts),
                                                     max_tokens=rng.randint(8, 64), stream=True))
        return served(reply, sent, f"{model}, long prompt")
    return send


def probe_reply(ctx: Ctx, prompt: str, surface: str) -> Reply:
    """A probe's greedy request over one of the flavour's probe surfaces (Flavour.probe_surfaces)."""
    transport, model, more = ctx.flavour.probe_surfaces[surface]
    stream = {"grpc": True, "grpc_not_streamed": False, "sse": True, "generate": None}[transport]
    values = text_request(ctx, None, prompt, max_tokens=PROBE_TOKENS, stream=stream, **more)
    if transport == "generate":
        return http_generate(ctx, model, values)
    if transport == "sse":
        return http_sse(ctx, model, values)
    return grpc_stream(ctx, model, values)


def probe(ctx: Ctx, rng: random.Random) -> Result:
    """Greedy text must not depend on the load (batch composition, adaptive draft length) nor on the surface."""
    prompt, surface = rng.choice(list(ctx.probes)), rng.choice(list(ctx.flavour.probe_surfaces))
    sent = time.perf_counter()
    reply = probe_reply(ctx, prompt, surface)
    result = served(reply, sent, f"probe over {surface}")
    got, want = reply.text.decode(), ctx.probes[prompt]
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        return Result("mismatch", result.ttft_s, f"probe {list(ctx.probes).index(prompt)} over {surface}: differs "
                      f"at character {at}: got {got[at:at + 40]!r}, recorded {want[at:at + 40]!r}")
    return result


# Bad requests: how each is sent (returning the refusal's message, None if it was served) and the substrings
# the refusal must hold (formatted with vocab, max_seq_len, max_bytes); tests/test_triton.py's messages (legacy) and
# tests/test_triton_contract.py's (llmapi).
Refusal = Callable[[Ctx, random.Random], "str | None"]
GOOD = {"text_input": "hello", "max_tokens": 8}
TEXT_MODELS = ("ensemble", "tensorrt_llm_bls")


def refusal_grpc(values: dict[str, Any], models: tuple[str, ...] = TEXT_MODELS) -> Refusal:
    def send(ctx: Ctx, rng: random.Random) -> str | None:
        return grpc_stream(ctx, rng.choice(models), values).error
    return send


def refusal_http(values: dict[str, Any], models: tuple[str, ...] = TEXT_MODELS) -> Refusal:
    """Over HTTP generate or generate_stream; it must say 400."""
    def send(ctx: Ctx, rng: random.Random) -> str | None:
        model, sse = rng.choice(models), rng.random() < 0.5
        reply = http_sse(ctx, model, {**values, **ctx.flavour.named({"stream": True})}) if sse else \
            http_generate(ctx, model, values)
        if reply.error is not None and reply.status != 400:
            raise Unexpected(f"HTTP {reply.status}, expected 400: {reply.error}")
        return reply.error
    return send


def refusal_any(values: dict[str, Any], models: tuple[str, ...] = TEXT_MODELS) -> Refusal:
    """Over gRPC streaming, HTTP generate or generate_stream (one in three each), to one of `models`."""
    grpc, http = refusal_grpc(values, models), refusal_http(values, models)
    return lambda ctx, rng: grpc(ctx, rng) if rng.random() < 1 / 3 else http(ctx, rng)


def engine_stop_word(ctx: Ctx, rng: random.Random) -> str | None:
    values = engine_request(ctx, GOOD["text_input"], 4)
    return grpc_stream(ctx, "tensorrt_llm", {**values, "stop_words_list": np.array([[[-4], [1]]], np.int32)}).error


Bad = dict[str, tuple[Refusal, tuple[str, ...]]]
BAD: Bad = {
    "max_tokens_zero": (refusal_any({**GOOD, "max_tokens": 0}), ("max_tokens", "got 0")),
    "max_tokens_past_context": (refusal_any({**GOOD, "max_tokens": 100_000}), ("max_tokens", "100000")),
    "temperature_negative": (refusal_any({**GOOD, "temperature": -0.5}), ("temperature", "-0.5")),
    "top_k_negative": (refusal_any({**GOOD, "top_k": -1}), ("top_k", "must be an integer in [0, 2147483647], got -1")),
    "min_tokens_negative": (refusal_any({**GOOD, "min_tokens": -1}),
                            ("min_tokens", "must be an integer in [0, 2147483647], got -1")),
    "unknown_json_key": (lambda ctx, rng: http_generate(ctx, rng.choice(TEXT_MODELS), {**GOOD, "max_token": 3}).error,
                         ("unknown parameter(s) max_token: ",
                          "takes inputs only (a generate endpoint's JSON keys must be input names)")),
    "top_p_nan": (refusal_grpc({**GOOD, "top_p": np.float32("nan")}),
                  ("top_p", "must be a finite number in [0.0, 1.0], got nan")),
    "end_id_wrapped": (refusal_grpc({**GOOD, "end_id": np.int32(-2**31)}),
                       ("end_id must be an integer in [-1, 2147483647], got -2147483648",)),
    "text_input_too_long": (refusal_grpc({**GOOD, "text_input": "x" * 2_000_000}),
                            ("text_input is 2000000 bytes, more than the {max_bytes} that can fit the model's "
                             "context",)),
    "text_input_not_utf8": (refusal_grpc({**GOOD, "text_input": [[b"\xff\xfe bad"]]}),
                            ("text_input must be valid UTF-8 text",)),
    "prompt_over_max_seq_len": (lambda ctx, rng: refusal_any({**GOOD, "text_input": "hello world " * ctx.max_seq_len})(
        ctx, rng), ("input_ids (text_input) has ", " tokens; max_seq_len is {max_seq_len}")),
    "stop_word_id_negative": (engine_stop_word, ("stop_words_list must hold token ids in [0, {vocab}), got [-4]",)),
    "postprocessing_token_negative": (
        lambda ctx, rng: http_infer(ctx, "postprocessing", {"TOKENS_BATCH": np.array([[[-1]]], np.int32),
                                                            "SEQUENCE_LENGTH": np.array([[1]], np.int32)}),
        ("TOKENS_BATCH must hold token ids in [0, {vocab}), got [-1]",)),
    # refused by the BLS itself before it calls tensorrt_llm (by tensorrt_llm for the ensemble)
    "end_id_past_vocab": (refusal_any({**GOOD, "end_id": 10**7}), ("end_id must be an integer in [-1, ",
                                                                   "got 10000000")),
    "bad_word_of_several_tokens": (refusal_any({**GOOD, "bad_words": [["hello world"]]}),
                                   ("bad_words: 'hello world' is ", "only single-token bad words are supported")),
    "guide_invalid": (refusal_any({**GOOD, "guided_decoding_guide_type": "regex", "guided_decoding_guide": "a{2"}),
                      ("guided_decoding_guide is invalid at position 1: unclosed counted repetition",)),
    "guided_with_min_tokens": (refusal_any({**GOOD, "min_tokens": 2, "guided_decoding_guide_type": "json"}),
                               ("guided_decoding cannot be combined with ignore_eos or min_tokens",)),
}

LLMAPI_MODELS = ("tensorrt_llm",)
LLMAPI_GOOD = {"text_input": "hello", "sampling_param_max_tokens": 8}


def llmapi_refusal(over: Callable[..., Refusal] = refusal_any, good: dict[str, Any] = LLMAPI_GOOD,
                   **values: Any) -> Refusal:
    """LLMAPI_GOOD with `values`, sent to the llmapi tensorrt_llm `over` gRPC, HTTP or either."""
    return over({**good, **values}, LLMAPI_MODELS)


# serving/triton/llmapi_request.py's refusals (and Triton's own, where it refuses before the model sees the request)
LLMAPI_BAD: Bad = {
    "unknown_json_key": (llmapi_refusal(refusal_http, max_token=3),
                         ("unknown parameter(s) max_token: tensorrt_llm takes inputs only (a generate endpoint's JSON "
                          "keys must be input names)",)),
    "unknown_grpc_input": (llmapi_refusal(refusal_grpc, max_token=np.int32(3)),
                           ("unexpected inference input 'max_token' for model 'tensorrt_llm'",)),
    "max_tokens_zero": (llmapi_refusal(sampling_param_max_tokens=0),
                        ("sampling_param_max_tokens must be an integer in [1, 2147483647], got 0",)),
    "max_tokens_past_context": (llmapi_refusal(sampling_param_max_tokens=100_000),
                                ("sampling_param_max_tokens 100000 with a ",
                                 "-token prompt exceeds max_seq_len {max_seq_len}; at most ")),
    "temperature_negative": (llmapi_refusal(sampling_param_temperature=-0.5),
                             ("sampling_param_temperature must be a finite number >= 0.0, got -0.5",)),
    "top_k_negative": (llmapi_refusal(sampling_param_top_k=-1),
                       ("sampling_param_top_k must be an integer in [0, 2147483647], got -1",)),
    "top_p_above_one": (llmapi_refusal(sampling_param_top_p=1.5),
                        ("sampling_param_top_p must be a finite number in [0.0, 1.0], got 1.5",)),
    "top_p_nan": (llmapi_refusal(refusal_grpc, sampling_param_top_p=np.float32("nan")),
                  ("sampling_param_top_p must be a finite number in [0.0, 1.0], got nan",)),
    "frequency_penalty_past_limit": (llmapi_refusal(sampling_param_frequency_penalty=5.0),
                                     ("sampling_param_frequency_penalty must be a finite number in [-2.0, 2.0], got "
                                      "5.0",)),
    "best_of_greedy": (llmapi_refusal(sampling_param_best_of=2),
                       ("sampling_param_best_of must be 1 when decoding greedily (no sampling_param_temperature, "
                        "top_k or top_p given), got 2",)),
    "num_draft_tokens_past_draft_len": (llmapi_refusal(sampling_param_num_draft_tokens=99),
                                        ("sampling_param_num_draft_tokens 99 exceeds this executor's draft length ",)),
    "text_input_too_long": (llmapi_refusal(refusal_grpc, text_input="x" * 2_000_000),
                            ("text_input is 2000000 bytes, more than the {max_bytes} that can fit the model's "
                             "context",)),
    "text_input_not_utf8": (llmapi_refusal(refusal_grpc, text_input=[b"\xff\xfe bad"]),
                            ("text_input must be valid UTF-8 text",)),
    "text_input_missing": (llmapi_refusal(good={}, sampling_param_max_tokens=8), ("text_input is required",)),
    "two_prompts": (llmapi_refusal(text_input=["hello", "world"]),
                    ("text_input: one prompt per request expected, got 2",)),
    "prompt_over_max_seq_len": (lambda ctx, rng: llmapi_refusal(text_input="hello world " * ctx.max_seq_len)(ctx, rng),
                                ("text_input has ", " tokens; max_seq_len is {max_seq_len}")),
    "too_many_stops": (llmapi_refusal(sampling_param_stop=[f"w{i}" for i in range(65)]),
                       ("sampling_param_stop holds 65 strings; at most 64",)),
    "image_url": (llmapi_refusal(image_url="http://127.0.0.1/cat.png"),
                  ("image_url is not supported by this runtime (multimodal input; this is a text model)",)),
    "stop_without_id": (llmapi_refusal(good={}, text_input="", stop=True),
                        ("stop: a request id is needed to say which request to stop",)),
    "guide_invalid": (llmapi_refusal(guided_decoding_guide_type="regex", guided_decoding_guide="a{2"),
                      ("guided_decoding_guide is invalid at position 1: unclosed counted repetition",)),
    "unary_infer_on_decoupled": (lambda ctx, rng: http_infer(ctx, "tensorrt_llm",
                                                             {"text_input": np.array([b"hello"], object)}),
                                 ("HTTP end point doesn't support models with decoupled transaction policy",)),
}


def bad(table: Bad, case: str) -> Callable[[Ctx, random.Random], Result]:
    send, expected = table[case]

    def run(ctx: Ctx, rng: random.Random) -> Result:
        message = send(ctx, rng)
        want = [e.format(vocab=ctx.vocab, max_seq_len=ctx.max_seq_len,
                         max_bytes=ctx.tok.max_text_bytes(ctx.max_seq_len)) for e in expected]
        if message is None:
            raise Unexpected(f"served; expected a refusal with {want}")
        if not all(w in message for w in want) or "Traceback" in message:
            raise Unexpected(f"refusal {message!r}; expected one with {want}")
        return Result("expected_refusal")
    return run


KINDS: Kinds = {
    "grpc_stream_ensemble_greedy": (7, grpc_text("ensemble")),
    "grpc_stream_ensemble_sampled": (5, grpc_text("ensemble", sampled=True)),
    "grpc_stream_bls_greedy": (7, grpc_text("tensorrt_llm_bls")),
    "grpc_stream_bls_sampled": (5, grpc_text("tensorrt_llm_bls", sampled=True)),
    "grpc_unary_ensemble": (5, grpc_text("ensemble", stream=False)),
    "grpc_stream_tensorrt_llm": (6, tensorrt_llm_stream),
    "http_generate_ensemble": (4, http_text("ensemble", sse=False)),
    "http_generate_bls": (4, http_text("tensorrt_llm_bls", sse=False)),
    "http_sse_ensemble": (4, http_text("ensemble", sse=True)),
    "http_sse_bls": (4, http_text("tensorrt_llm_bls", sse=True)),
    "cancel_grpc_bls": (4, cancel("tensorrt_llm_bls")),
    "cancel_grpc_tensorrt_llm": (4, cancel("tensorrt_llm", engine_running_request)),
    "disconnect_http_sse_bls": (4, disconnect("tensorrt_llm_bls")),
    "long_prompt": (5, long_prompt(TEXT_MODELS)),
    "probe_greedy": (8, probe),
    **{f"bad_{case}": (1, bad(BAD, case)) for case in BAD},
}

# the llmapi flavour's one model, decoupled (the repository has no unary model: unary infer is a bad request)
LLMAPI_KINDS: Kinds = {
    "grpc_stream_greedy": (10, grpc_text("tensorrt_llm")),
    "grpc_stream_sampled": (8, grpc_text("tensorrt_llm", sampled=True)),
    "grpc_streaming_false": (6, grpc_text("tensorrt_llm", stream=False)),
    "http_generate": (6, http_text("tensorrt_llm", sse=False)),
    "http_sse": (6, http_text("tensorrt_llm", sse=True)),
    "cancel_grpc": (5, cancel("tensorrt_llm")),
    "stop_by_id": (5, stop_by_id("tensorrt_llm")),
    "disconnect_http_sse": (5, disconnect("tensorrt_llm")),
    "long_prompt": (5, long_prompt(LLMAPI_MODELS)),
    "probe_greedy": (8, probe),
    **{f"bad_{case}": (1, bad(LLMAPI_BAD, case)) for case in LLMAPI_BAD},
}

FLAVOURS = {
    "legacy": Flavour("legacy", KINDS, {"grpc_ensemble": ("grpc", "ensemble", {}),
                                        "grpc_bls": ("grpc", "tensorrt_llm_bls", {}),
                                        "http_bls": ("generate", "tensorrt_llm_bls", {}),
                                        "sse_ensemble": ("sse", "ensemble", {})}, no_eos={"end_id": -1}),
    "llmapi": Flavour("llmapi", LLMAPI_KINDS, {"grpc": ("grpc", "tensorrt_llm", {}),
                                               "grpc_not_streamed": ("grpc_not_streamed", "tensorrt_llm", {}),
                                               "http_generate": ("generate", "tensorrt_llm", {}),
                                               "sse": ("sse", "tensorrt_llm", {}),
                                               "grpc_no_drafts": ("grpc", "tensorrt_llm", {"num_draft_tokens": 0})},
                      names={"max_tokens": "sampling_param_max_tokens", "temperature": "sampling_param_temperature",
                             "top_p": "sampling_param_top_p", "seed": "sampling_param_seed",
                             "num_draft_tokens": "sampling_param_num_draft_tokens",
                             "exclude_input_in_output": "sampling_param_exclude_input_from_output",
                             "stream": "streaming"},
                      batched=False, cumulative=True),
}


# ---- server side: processes, memory, metrics --------------------------------------------------------
def server_processes(server: TritonServer) -> dict[int, str]:
    """pid -> name of tritonserver, each Python backend stub (named by its model instance) and each executor process
    under a stub (its engine in a process of its own, triton_config.engine_process: the default on CUDA devices)."""
    stubs = python_stubs(server.process.pid)
    executors = {pid: f"under stub {name}: {module}"
                 for stub, name in stubs.items() for pid, argv in live_descendants(stub).items()
                 if (module := module_run_by(argv)) is not None and module.startswith(EXECUTOR_MODULES)}
    return {server.process.pid: "tritonserver", **{pid: f"stub {name}" for pid, name in stubs.items()}, **executors}


def kv_blocks(values: dict[str, float]) -> dict[str, float]:
    return {t: metric(values, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type=t)
            for t in ("used", "free", "max")}


def gauges(server: TritonServer) -> dict[str, float]:
    m = read_metrics(server.metrics_url)
    return {"kv_used": kv_blocks(m)["used"], "active": metric(m, "nv_trt_llm_request_metrics", request_type="active")}


def cancelled_total(server: TritonServer) -> float:
    return metric(read_metrics(server.metrics_url), "nv_trt_llm_requests_total", finish_reason="cancelled")


def record_probes(ctx: Ctx, prompts: list[str]) -> None:
    """Each probe's greedy text on the idle server, over the flavour's first probe surface."""
    surface = next(iter(ctx.flavour.probe_surfaces))
    for p in prompts:
        reply = probe_reply(ctx, p, surface)
        if reply.error is not None or not reply.text:
            raise SystemExit(f"probe on the idle server failed: {reply.error or 'no text'}")
        ctx.probes[p] = reply.text.decode()


def record_cancel_prompts(ctx: Ctx) -> None:
    """The prompts of the requests that must still be running when cancelled (running_request): any, where eos can
    be ignored (legacy); otherwise (llmapi) those of the first CANCEL_PROMPTS whose greedy continuation on the idle
    server ran CANCEL_TOKENS tokens without eos: greedy text does not depend on the load (the probes check it)."""
    if ctx.flavour.no_eos:
        ctx.cancel_prompts = list(ctx.prompts)
        return
    for p in ctx.prompts[:CANCEL_PROMPTS]:
        reply = grpc_stream(ctx, LLMAPI_MODELS[0], {**text_request(ctx, None, p, max_tokens=CANCEL_TOKENS, stream=False),
                                                    "return_finish_reason": True})
        if reply.error is not None:
            raise SystemExit(f"a request on the idle server failed: {reply.error}")
        if reply.finish_reason == "length":
            ctx.cancel_prompts.append(p)
    if not ctx.cancel_prompts:
        raise SystemExit(f"no prompt among the first {CANCEL_PROMPTS} runs {CANCEL_TOKENS} greedy tokens without eos: "
                         "the cancels would race eos")


def end_checks(ctx: Ctx) -> dict[str, Any]:
    """After the load: drained, KV blocks all free, ready, and a probe still gives its recorded text."""
    drain_ok = wait_drained(lambda: gauges(ctx.server), DRAIN_S)
    kv = kv_blocks(read_metrics(ctx.server.metrics_url))
    prompt = next(iter(ctx.probes))
    try:
        reply = probe_reply(ctx, prompt, next(iter(ctx.flavour.probe_surfaces)))
        request = "ok" if reply.error is None and reply.text.decode() == ctx.probes[prompt] else \
            f"{reply.error or 'text differs from the recorded one'}"
    except Exception as e:  # the server is gone or hangs
        request = f"{type(e).__name__}: {e}"
    return {"drained": drain_ok, "kv_blocks": kv, "kv_all_free": kv["used"] == 0 and kv["free"] == kv["max"] > 0,
            "ready": ctx.server.is_ready(), "server_alive": ctx.server.process.poll() is None, "request": request}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF checkpoint the engine is built from (and prompts)")
    p.add_argument("--engine_dir", type=Path, help="serve this engine (or HF directory) instead of building one")
    p.add_argument("--flavour", choices=list(FLAVOURS), default="legacy",
                   help="the model repository make_model_repo makes: legacy (triton_repo/: ensemble, BLS, tensorrt_llm "
                        "on token ids, pre- and postprocessing) or llmapi (triton_repo_llmapi/: one decoupled "
                        "tensorrt_llm, text in and out); each has its own request kinds")
    p.add_argument("--out", type=Path, help="results go to <out>.json and <out>.md (default docs/benchmarks/soak, "
                   "soak_llmapi with --flavour llmapi, and _quick after it with --quick)")
    add_soak_args(p, minutes=30.0, concurrency=32, sample_every_s=60.0)
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}; explicit flags still win")
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    if args.out is None:
        args.out = ROOT / "docs" / "benchmarks" / "".join(["soak", "_llmapi" * (args.flavour == "llmapi"),
                                                           "_quick" * args.quick])
    check_soak_args(p, args, FLAVOURS[args.flavour].kinds)
    return args


def make_repo(dst: Path, engine: Path, flavour: str, threads: int) -> dict[str, Any]:
    """The repository make_model_repo makes of `engine` in `flavour` (with torch_threads where given); returns what
    it was filled with: the template values (legacy, paths left out) or tensorrt_llm's model.yaml (llmapi)."""
    if flavour == "legacy":
        values = default_values(engine, **({"torch_threads": str(threads)} if threads else {}))
        fill_model_repo(dst, values)
        return {k: v for k, v in values.items() if k not in ("engine_dir", "tokenizer_dir")}
    dst.mkdir()
    path = add_llmapi_model(dst, engine) / "1" / MODEL_YAML
    doc = yaml.safe_load(path.read_text())
    if threads:
        doc["triton_config"]["torch_threads"] = threads
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flavour = FLAVOURS[args.flavour]
    info = machine_info()
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    engine = args.engine_dir
    if engine is None:
        engine = work / "engine"
        run_tool([Path(sys.executable).with_name("build_engine"), "--model_dir", args.model, "--output_dir", engine,
                  "--max_batch_size", str(max(8, args.concurrency)), "--max_draft_len", "3",
                  "--max_seq_len", "1024"])  # the recorded soaks' engine (its long prompts follow it)
    _, build = read_limits(engine)
    repo, kinds = work / "repo", flavour.kinds
    repo_settings = make_repo(repo, engine.resolve(), args.flavour, args.threads)
    tok = Tokenizer.from_dir(engine)
    short, probe_prompts, long = make_prompts(args.model, tok, build.max_seq_len)
    log = work / "server.log"
    t_start = time.perf_counter()
    server = start_server(repo, log_file=log, host="127.0.0.1")
    print(f"tritonserver ready in {time.perf_counter() - t_start:.0f} s (log {log}; the {args.flavour} repository); "
          f"{args.concurrency} clients for {args.minutes:g} min", flush=True)
    try:
        ids = {p: tok.encode(p) for p in [*short, GOOD["text_input"]]}
        ctx = Ctx(server, flavour, tok, build.max_seq_len, short, long, ids, timeout=args.request_timeout_s)
        record_probes(ctx, probe_prompts)
        record_cancel_prompts(ctx)
        cancelled_before = cancelled_total(server)
        watched = Watched("tritonserver", server_processes(server), lambda: server.process.poll() is None,
                          lambda: gauges(server))
        load = run_load(kinds, ctx, args, watched)
        end = end_checks(ctx)
        end_rss, end_shmem = rss_kb(load["pids"]), rss_kb(load["pids"], "RssShmem")
        cancelled = cancelled_total(server) - cancelled_before
    finally:
        t_stop = time.perf_counter()
        exit_status = server.stop()  # SIGINT: tritonserver waits for in-flight requests, then unloads the models
        stop_s = time.perf_counter() - t_stop

    records: list[Record] = load["records"]
    samples = load["samples"]
    rss = rss_table(load["pids"], samples, load["start_index"], end_rss, end_shmem, args.minutes * 60)
    by_outcome = Counter(r.outcome for r in records)
    unexpected = errors_by_kind(load["primed"] + records, "unexpected_error")
    mismatches = errors_by_kind(load["primed"] + records, "mismatch")
    primed = Counter(r.outcome for r in load["primed"])
    cancels_sent = sum(c["cancelled"] + c["disconnected"] for c in (by_outcome, primed))
    log_text = log.read_text(errors="replace") if log.is_file() else ""
    checks = {
        "no_unexpected_errors": not unexpected,
        "no_probe_mismatches": not mismatches,
        "clients_stopped": load["hung_clients"] == 0,
        "server_processes_alive": all(r["alive"] for r in rss),  # a crashed stub is left <defunct>, no VmRSS
        **rss_checks(rss),
        "kv_blocks_all_free": end["kv_all_free"],
        "cancels_reached_the_executor": int(cancelled) == cancels_sent,
        "healthy_at_end": end["ready"] and end["server_alive"] and end["request"] == "ok",
        "no_stub_crash_in_log": STUB_CRASH not in log_text,  # each stub logs a crash (faulthandler)
        "clean_shutdown": exit_status == 0,  # 1: a model still held requests after --exit-timeout-secs
    }
    failures = [c for c, ok in checks.items() if ok is False]
    results = {
        "benchmark": "soak", "flavour": args.flavour, "quick": args.quick, "passed": not failures, "failures": failures, "checks": checks,
        "settings": {"minutes": args.minutes, "concurrency": args.concurrency, "warmup_s": args.warmup_s,
                     "sample_every_s": args.sample_every_s, "prime_rounds": args.prime_rounds, "request_timeout_s": args.request_timeout_s,
                     "seed": args.seed, "weights": {k: kinds[k][0] for k in args.kinds or kinds},
                     "engine": str(args.engine_dir or f"build_engine --model_dir {args.model} --max_draft_len 3"),
                     "engine_build": build.to_dict(),
                     "model_yaml" if args.flavour == "llmapi" else "repo_values": repo_settings,
                     "long_prompt_tokens": len(tok.encode(long[0])), "probe_tokens": PROBE_TOKENS,
                     "cancel_tokens": CANCEL_TOKENS, "cancel_prompts": len(ctx.cancel_prompts),
                     "host": server.client_host},
        "priming": {"requests": len(load["primed"]), "wall_s": load["prime_s"], "by_outcome": dict(primed),
                    "kinds_sent": dict(Counter(r.kind for r in load["primed"]))},
        "load_wall_s": load["wall_s"], "hung_clients": load["hung_clients"],
        "requests": {"total": len(records), "served": by_outcome["ok"], "by_outcome": dict(by_outcome),
                     "per_s": len(records) / load["wall_s"]},
        "latency": {"all": latency_stats(records), "served": latency_stats([r for r in records if r.outcome == "ok"])},
        "kinds": summarize_kinds(kinds, records),
        "unexpected_errors": unexpected, "mismatches": mismatches,
        "cancellation": {"cancels_and_disconnects": cancels_sent, "executor_cancelled": cancelled},
        "rss": rss_results(load, rss),
        "kv_used_peak_sampled": max(s["kv_used"] for s in samples),
        "end": end, "server_exit_status": exit_status, "server_stop_s": stop_s,
        "server_log": {"tracebacks": log_text.count("Traceback"), "lines": len(log_text.splitlines()),
                       "crash_frames": server.crash_frames(),
                       "models_not_unloaded": sorted(set(re.findall(r"successfully loaded '(\w+)'", log_text))
                                                     - set(re.findall(r"successfully unloaded '(\w+)'", log_text)))},
        "machine": info,
    }
    md = markdown(results)
    js, mdp = write_results(args.out.parent, args.out.name, results, md)
    print(md)
    if failures:  # keep the server log, drop the engine and repository
        for d in (work / "engine", work / "repo"):
            shutil.rmtree(d, ignore_errors=True)
        print(f"FAILED: {', '.join(failures)} (server log: {log})", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {js} and {mdp}")
    return 1 if failures else 0


def markdown(r: dict[str, Any]) -> str:
    end, crash = r["end"], r["server_log"]["crash_frames"]
    end_md = (
        f"## End\n\nKV blocks {end['kv_blocks']} (all free: {fmt(end['kv_all_free'])}; peak used in samples "
        f"{r['kv_used_peak_sampled']:.0f}); ready {fmt(end['ready'])}; a probe after the load: {end['request']}; "
        f"cancels and disconnects {r['cancellation']['cancels_and_disconnects']}, cancelled in the executor "
        f"{r['cancellation']['executor_cancelled']:.0f}; server exit status {r['server_exit_status']} after "
        f"{r['server_stop_s']:.1f} s; tracebacks in the server log {r['server_log']['tracebacks']}; models that did "
        f"not unload at shutdown: {', '.join(r['server_log']['models_not_unloaded']) or 'none'}.")
    crash_md = ["tritonserver crashed; its backtrace, its own frames named:\n\n```\n" + "\n".join(crash) + "\n```"]
    title = "Soak test" + (", llmapi flavour" if r.get("flavour") == "llmapi" else "")
    return report_md(r, title, max_seq_len=f"Engine max_seq_len {r['settings']['engine_build']['max_seq_len']}",
                     end=[end_md, *(crash_md if crash else [])])


if __name__ == "__main__":
    sys.exit(main())
