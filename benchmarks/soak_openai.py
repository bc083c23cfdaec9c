"""Bounded soak test of the OpenAI-compatible server: dsv3-serve on 127.0.0.1 under a mixed closed-loop load that
must leave it as it found it (no unexpected error, the same probe answers under load, every KV block free,
resident memory grown by at most 10% after warm-up, healthy at the end, a clean shutdown with no child left).

  python -m benchmarks.soak_openai                      # 10 minutes at concurrency 16, executor in-process
  python -m benchmarks.soak_openai --engine_process     # the executor in a process of its own
  python -m benchmarks.soak_openai --quick              # smoke run: 2 minutes at concurrency 8

Starts `dsv3-serve` on the shipped model with the tool-rendering chat template
(serving/openai_server/templates/deepseek_v3_tools.jinja, --tool_call_parser deepseek_v3). Each client picks a kind
of request by fixed weights (KINDS): /v1/completions and /v1/chat/completions, streamed and not, greedy and seeded
sampled, n and best_of, logprobs and prompt_logprobs, stop strings, guided JSON (response_format) and regex, tool
calls (tool_choice required or a named function), prompts near max_seq_len, /tokenize and /detokenize; about a
quarter of the requests that can go through the `openai` client do, the others are read as raw SSE or JSON.
Clients also go away: a stream closed after its first event, and a request closed before the first byte of its
answer; each must reach the server ("client disconnected" in its log, one per such request). Bad requests (BAD)
must each get their exact refusal (status, `param` and message). Probes (greedy, seeded, n=2, tools, guided JSON,
a long prompt), answered once on the idle server, must come back identical under load.

Memory, priming and the plateau-vs-leak checks are the Triton soak's (benchmarks/soak_common.py): VmRSS of the
server and of every process under it, sampled idle, after priming, after --warmup_s of load ("start"), every
--sample_every_s and after the load drains ("end"). Writes <out>.json and <out>.md; exits 1 on any failed check.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import re
import socket
import struct
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import openai

from benchmarks import ROOT
from benchmarks.common import DEFAULT_MODEL, fmt, machine_info, write_results
from benchmarks.soak_common import (CANCEL_TOKENS, PROBE_TOKENS, Kinds, Record, Result, Unexpected, Watched,
                                    add_soak_args, check_soak_args, errors_by_kind, latency_stats, make_prompts,
                                    metric, read_metrics, report_md, rss_checks, rss_kb, rss_results, rss_table,
                                    run_load, summarize_kinds, wait_drained)
from runtime.executors.lifetime import live_descendants, module_run_by, running
from runtime.io.tokenizer import Tokenizer
from serving.openai_server.process import ServeProcess, start_dsv3_serve

TOOLS_TEMPLATE = ROOT / "serving" / "openai_server" / "templates" / "deepseek_v3_tools.jinja"
MAX_BATCH_SIZE = 8  # dsv3-serve --max_batch_size: n past it is a bad request
DRAIN_S = 90.0
SDK_SHARE = 0.25  # of the requests the openai client can send; its per-chunk objects cost the clients' CPU
QUICK = dict(minutes=2.0, concurrency=8)
FFFD = "U+FFFD in the text"

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "maxLength": 8}}}
# tools with flat schemas that schema_problem checks (tests/test_openai_tools.py calls them too; a description with
# characters a template must write as they are)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone (<tz> & 'dst')",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# a tool request's max_tokens: the shipped model spells the tool-call markers byte by byte, and its shortest whole call
# takes 108 tokens (96 cut every call before its end marker, so the calls were never checked)
TOOL_TOKENS = 160
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
REGEX = r"(yes|no), [0-9]{1,3} [a-z]{2,8}\."
STOPS = [" the", ".", "\n", " and", "("]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# the request fields the openai client takes as arguments; others go in extra_body
SDK_FIELDS = {COMPLETIONS: {"best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
                            "presence_penalty", "prompt", "seed", "stop", "stream_options", "suffix", "temperature",
                            "top_p", "user"},
              CHAT: {"frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "messages",
                     "n", "parallel_tool_calls", "presence_penalty", "response_format", "seed", "stop",
                     "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user"}}


@dataclass
class Ctx:
    """What every request needs: the server, the tokenizer, the limits, the prompts, the recorded probe answers."""

    port: int
    model: str
    tok: Tokenizer
    max_seq_len: int
    prompts: list[str]
    prompt_ids: dict[str, list[int]]
    long_prompts: list[tuple[str, int]]  # (text, its token count)
    sdk: openai.OpenAI
    timeout: float
    probes: dict[str, tuple[str, dict[str, Any], Any]] = field(default_factory=dict)  # name -> (path, body, answer)
    sdk_requests: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def via(self, rng: random.Random) -> openai.OpenAI | None:
        """The openai client for SDK_SHARE of the requests, None (raw HTTP) for the others."""
        return self.sdk if rng.random() < SDK_SHARE else None


@dataclass
class Reply:
    status: int
    data: Any = None  # the JSON answer; a stream's events assembled into a whole answer's shape
    first_at: float | None = None  # a stream's first event with output


# ---- transports ---------------------------------------------------------------------------------------------
def has_output(event: dict[str, Any]) -> bool:
    return any(c.get("text") or (c.get("delta") or {}).get("content") or (c.get("delta") or {}).get("tool_calls")
               for c in event.get("choices") or [])


def raw_call(ctx: Ctx, path: str, body: Any, stream: bool = False) -> tuple[Reply, list[dict[str, Any]] | None]:
    """POST as a load generator sends it: JSON, or SSE read line by line (strict UTF-8, to its [DONE])."""
    conn = http.client.HTTPConnection("127.0.0.1", ctx.port, timeout=ctx.timeout)
    try:
        conn.request("POST", path, body if isinstance(body, bytes) else json.dumps(body),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        if not stream or r.status != 200:
            raw = r.read()
            try:
                return Reply(r.status, json.loads(raw)), None
            except ValueError:
                raise Unexpected(f"HTTP {r.status}, not JSON: {raw[:200]!r}") from None
        if "text/event-stream" not in r.getheader("content-type", ""):
            raise Unexpected(f"a stream of content-type {r.getheader('content-type')!r}")
        events: list[dict[str, Any]] = []
        first_at = None
        for line in iter(r.readline, b""):
            if not line.startswith(b"data: "):
                continue
            if line[6:].strip() == b"[DONE]":
                return Reply(200, None, first_at), events
            events.append(json.loads(line[6:].decode("utf-8")))
            if first_at is None and has_output(events[-1]):
                first_at = time.perf_counter()
        raise Unexpected(f"the stream ended without [DONE] after {len(events)} events")
    finally:
        conn.close()


def sdk_call(ctx: Ctx, path: str, body: dict[str, Any], stream: bool) -> tuple[Reply, list[dict[str, Any]] | None]:
    """The same request through the openai client (its own parsing of each chunk)."""
    kwargs = {k: v for k, v in body.items() if k in SDK_FIELDS[path]}
    extra = {k: v for k, v in body.items() if k not in SDK_FIELDS[path] and k not in ("model", "stream")}
    endpoint = ctx.sdk.chat.completions if path == CHAT else ctx.sdk.completions
    with ctx.lock:
        ctx.sdk_requests[path] += 1
    try:
        if not stream:
            return Reply(200, endpoint.create(model=ctx.model, **kwargs, extra_body=extra or None).model_dump(
                exclude_unset=True)), None
        events: list[dict[str, Any]] = []
        first_at = None
        for chunk in endpoint.create(model=ctx.model, **kwargs, stream=True, extra_body=extra or None):
            events.append(chunk.model_dump(exclude_unset=True))
            if first_at is None and has_output(events[-1]):
                first_at = time.perf_counter()
        return Reply(200, None, first_at), events
    except openai.APIStatusError as e:
        return Reply(e.status_code, e.body), None


def call(ctx: Ctx, via: openai.OpenAI | None, path: str, body: dict[str, Any], stream: bool = False) -> Reply:
    """A request that must be served: raw (via None) or through the openai client; a stream comes back assembled."""
    body = {"model": ctx.model, **body, **({"stream": True} if stream else {})}
    r, events = raw_call(ctx, path, body, stream) if via is None else sdk_call(ctx, path, body, stream)
    if r.status != 200:
        raise Unexpected(f"HTTP {r.status}: {json.dumps(r.data)[:400]}")
    if events is not None:
        errors = [e for e in events if "error" in e]
        if errors:
            raise Unexpected(f"an error event in the stream: {json.dumps(errors[0])[:400]}")
        r.data = assemble(events, path == CHAT)
    return r


def assemble(events: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    """A streamed answer in the shape of a whole one: choices by index (text or message with tool calls, logprobs,
    finish and stop reasons), usage where a chunk carried it."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for ev in events:
        usage = ev.get("usage") or usage
        for c in ev.get("choices") or []:
            ch = choices.setdefault(c["index"], {"index": c["index"], "text": "", "calls": {}, "finish_reason": None,
                                                 "stop_reason": None, "logprobs": None})
            lp = c.get("logprobs")
            if chat:
                d = c.get("delta") or {}
                ch["text"] += d.get("content") or ""
                for tc in d.get("tool_calls") or []:
                    t = ch["calls"].setdefault(tc["index"], {"id": None, "type": None, "name": "", "arguments": ""})
                    t["id"], t["type"] = tc.get("id") or t["id"], tc.get("type") or t["type"]
                    t["name"] += (tc.get("function") or {}).get("name") or ""
                    t["arguments"] += (tc.get("function") or {}).get("arguments") or ""
                if lp:
                    before = (ch["logprobs"] or {"content": []})["content"]
                    ch["logprobs"] = {"content": before + (lp.get("content") or [])}
            else:
                ch["text"] += c.get("text") or ""
                if lp:
                    ch["logprobs"] = ch["logprobs"] or {k: [] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                       "text_offset")}
                    for k in ch["logprobs"]:
                        ch["logprobs"][k] += lp.get(k) or []
            if c.get("finish_reason"):
                ch["finish_reason"], ch["stop_reason"] = c["finish_reason"], c.get("stop_reason")
    out = []
    for _, ch in sorted(choices.items()):
        whole = {"index": ch["index"], "finish_reason": ch["finish_reason"], "stop_reason": ch["stop_reason"],
                 "logprobs": ch["logprobs"]}
        if chat:
            calls = [{"id": t["id"], "type": t["type"], "function": {"name": t["name"], "arguments": t["arguments"]}}
                     for _, t in sorted(ch["calls"].items())] or None
            whole["message"] = {"role": "assistant", "content": ch["text"] or None, "tool_calls": calls}
        else:
            whole["text"] = ch["text"]
        out.append(whole)
    return {"choices": out, "usage": usage}


# ---- checks of a served answer -----------------------------------------------------------------------------
def text_of(choice: dict[str, Any], chat: bool) -> str:
    return (choice["message"].get("content") or "") if chat else choice["text"]


def served(r: Reply, chat: bool, n: int, max_tokens: int, usage: bool = True) -> list[dict[str, Any]]:
    """n choices, each finished; usage (where sent) within n * max_tokens. A U+FFFD in the text is not judged: the
    model can sample byte tokens that are no UTF-8 in sequence (141 of the shipped model's 4096 tokens decode to
    U+FFFD alone); streaming's detokenization is judged by the probes (streamed answers equal to whole ones)."""
    choices = r.data.get("choices")
    if not isinstance(choices, list) or sorted(c["index"] for c in choices) != list(range(n)):
        raise Unexpected(f"expected {n} choices, got {json.dumps(choices)[:300]}")
    for c in choices:
        if c.get("finish_reason") not in ("stop", "length", "tool_calls"):
            raise Unexpected(f"finish_reason {c.get('finish_reason')!r}")
    u = r.data.get("usage")
    if usage and (not u or u["completion_tokens"] > n * max_tokens or u["prompt_tokens"] <= 0
                  or u["total_tokens"] != u["prompt_tokens"] + u["completion_tokens"]):
        raise Unexpected(f"usage {u} for n {n}, max_tokens {max_tokens}")
    return choices


def ok(r: Reply, sent: float) -> Result:
    """Served; its message notes a U+FFFD in a choice's text (counted in the report)."""
    fffd = any("\ufffd" in (c.get("text") or (c.get("message") or {}).get("content") or "") for c in r.data["choices"])
    return Result("ok", None if r.first_at is None else r.first_at - sent, FFFD if fffd else None)


def schema_problem(text: str, schema: dict[str, Any]) -> str | None:
    """What breaks this module's flat object schemas (keys, enum, maxLength, integer bounds); None if nothing."""
    try:
        v = json.loads(text)
    except ValueError as e:
        return f"not JSON ({e}): {text[:120]!r}"
    if not isinstance(v, dict) or set(v) - set(schema["properties"]) or set(schema["required"]) - set(v):
        return f"keys {list(v) if isinstance(v, dict) else type(v).__name__} against the schema: {text[:120]!r}"
    for k, s in schema["properties"].items():
        x = v.get(k)
        if s["type"] == "string" and (not isinstance(x, str) or len(x) > s.get("maxLength", math.inf)
                                      or x not in s.get("enum", [x])):
            return f"{k}={x!r} breaks {s}"
        if s["type"] == "integer" and (not isinstance(x, int) or isinstance(x, bool)
                                       or not s.get("minimum", -math.inf) <= x <= s.get("maximum", math.inf)):
            return f"{k}={x!r} breaks {s}"
    return None


# ---- request kinds --------------------------------------------------------------------------------------------
def user(ctx: Ctx, rng: random.Random) -> list[dict[str, str]]:
    return [{"role": "user", "content": rng.choice(ctx.prompts)[:200]}]


def either(ctx: Ctx, rng: random.Random, chat_share: float) -> tuple[str, dict[str, Any]]:
    """Chat (a user message) or completions (a prompt)."""
    if rng.random() < chat_share:
        return CHAT, {"messages": user(ctx, rng)}
    return COMPLETIONS, {"prompt": rng.choice(ctx.prompts)}


def plain(chat: bool, stream: bool) -> Callable[[Ctx, random.Random], Result]:
    def send(ctx: Ctx, rng: random.Random) -> Result:
        path, body = either(ctx, rng, 1.0 if chat else 0.0)
        mt = rng.randint(8, 64)
        body |= {"max_tokens": mt, **({"temperature": 0} if rng.random() < 0.5 else {"temperature": 0.8, "top_p": 0.9})}
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        sent = time.perf_counter()
        r = call(ctx, ctx.via(rng), path, body, stream)
        served(r, chat, 1, mt, usage=not stream or "stream_options" in body)
        return ok(r, sent)
    return send


def seeded(ctx: Ctx, rng: random.Random) -> Result:
    path, body = either(ctx, rng, 0.5)
    mt = rng.randint(8, 48)
    body |= {"max_tokens": mt, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": rng.randrange(2**31)}
    stream = rng.random() < 0.5
    sent = time.perf_counter()
    r = call(ctx, ctx.via(rng), path, body, stream)
    served(r, path == CHAT, 1, mt, usage=not stream)
    return ok(r, sent)


def n2(ctx: Ctx, rng: random.Random) -> Result:
    path, body = either(ctx, rng, 0.3)
    mt = rng.randint(8, 40)
    body |= {"max_tokens": mt, "n": 2, "temperature": 0.8, "seed": rng.randrange(2**31),
             "stream_options": {"include_usage": True}}
    stream = rng.random() < 0.5
    sent = time.perf_counter()
    r = call(ctx, ctx.via(rng), path, body if stream else {k: v for k, v in body.items() if k != "stream_options"},
             stream)
    served(r, path == CHAT, 2, mt)
    return ok(r, sent)


def best_of(ctx: Ctx, rng: random.Random) -> Result:
    mt = rng.randint(8, 40)
    body = {"prompt": rng.choice(ctx.prompts), "max_tokens": mt, "n": 1, "best_of": 3, "temperature": 0.8,
            "seed": rng.randrange(2**31)}
    sent = time.perf_counter()
    r = call(ctx, ctx.via(rng), COMPLETIONS, body)
    served(r, False, 1, mt * 3)
    return ok(r, sent)


def logprobs(ctx: Ctx, rng: random.Random) -> Result:
    """Sampled tokens' logprobs: one entry per token, each <= 0, at most k alternatives (k + 1 for completions)."""
    path, body = either(ctx, rng, 0.5)
    mt, k, stream = rng.randint(8, 40), rng.randint(0, 5), rng.random() < 0.5
    body |= {"max_tokens": mt, "temperature": rng.choice([0, 0.8])}
    body |= {"logprobs": True, "top_logprobs": k} if path == CHAT else {"logprobs": k}
    if stream:
        body["stream_options"] = {"include_usage": True}
    sent = time.perf_counter()
    r = call(ctx, ctx.via(rng), path, body, stream)
    [c] = served(r, path == CHAT, 1, mt)
    ntok, lp = r.data["usage"]["completion_tokens"], c.get("logprobs")
    if lp is None:
        raise Unexpected("no logprobs")
    if path == CHAT:
        content = lp.get("content") or []
        if len(content) != ntok or any(not e["logprob"] <= 0 or len(e.get("top_logprobs") or []) > k
                                       or any(not t["logprob"] <= 0 for t in e.get("top_logprobs") or [])
                                       for e in content):
            raise Unexpected(f"{len(content)} logprob entries for {ntok} tokens (top_logprobs {k}): {content[:2]}")
    else:
        lens = {key: len(lp.get(key) or []) for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        if set(lens.values()) != {ntok} or any(not t <= 0 or top is None or len(top) > k + 1
                                               or any(not v <= 0 for v in top.values())
                                               for t, top in zip(lp["token_logprobs"], lp["top_logprobs"])):
            raise Unexpected(f"logprobs lengths {lens} for {ntok} tokens (logprobs {k}): {lp['top_logprobs'][:2]}")
        if lp["text_offset"] != sorted(lp["text_offset"]) or lp["text_offset"][-1:] > [len(c["text"])]:
            raise Unexpected(f"text_offset not rising within the text: {lp['text_offset'][:10]}")
    return ok(r, sent)


def prompt_logprobs(ctx: Ctx, rng: random.Random) -> Result:
    path, body = either(ctx, rng, 0.3)
    k, mt = rng.randint(0, 3), rng.randint(4, 16)
    body |= {"max_tokens": mt, "temperature": 0, "prompt_logprobs": k}
    sent = time.perf_counter()
    r = call(ctx, ctx.via(rng), path, body)
    [c] = served(r, path == CHAT, 1, mt)
    pl = r.data.get("prompt_logprobs") if path == CHAT else c.get("prompt_logprobs")
    n = r.data["usage"]["prompt_tokens"]
    if not isinstance(pl, list) or len(pl) != n or pl[0] is not None or any(
            not isinstance(e, dict) or not 1 <= len(e) <= k + 1 or any(not v["logprob"] <= 0 for v in e.values())
            for e in pl[1:]):
        raise Unexpected(f"prompt_logprobs {str(pl)[:200]} for {n} prompt tokens (k {k})")
    return ok(r, sent)


def stop_strings(ctx: Ctx, rng: random.Random) -> Result:
    path, body = either(ctx, rng, 0.4)
    stops, mt = rng.sample(STOPS, rng.randint(1, 3)), rng.randint(16, 64)
    body |= {"max_tokens": mt, "temperature": rng.choice([0, 0.8]), "stop": stops, "seed": rng.randrange(2**31)}
    stream = rng.random() < 0.5
    sent = time.perf_counter()
    r = call(ctx, ctx.via(rng), path, body, stream)
    [c] = served(r, path == CHAT, 1, mt, usage=not stream)
    text = text_of(c, path == CHAT)
    if any(s in text for s in stops):
        raise Unexpected(f"a stop string of {stops} in the output {text[-80:]!r}")
    if c.get("stop_reason") is not None and (c["finish_reason"] != "stop" or c["stop_reason"] not in stops + [1]):
        raise Unexpected(f"stop_reason {c['stop_reason']!r}, finish_reason {c['finish_reason']}, stop {stops}")
    return ok(r, sent)


def guided_json(ctx: Ctx, rng: random.Random) -> Result:
    path, body = either(ctx, rng, 0.6)
    body |= {"max_tokens": 64, "temperature": rng.choice([0, 0.7]), "seed": rng.randrange(2**31),
             "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    stream = rng.random() < 0.4
    sent = time.perf_counter()
    r = call(ctx, ctx.via(rng), path, body, stream)
    [c] = served(r, path == CHAT, 1, 64, usage=not stream)
    problem = c["finish_reason"] == "stop" and schema_problem(text_of(c, path == CHAT), PERSON)
    if problem:
        raise Unexpected(f"guided JSON: {problem}")
    return ok(r, sent)


def guided_regex(ctx: Ctx, rng: random.Random) -> Result:
    body = {"prompt": rng.choice(ctx.prompts), "max_tokens": 32, "guided_regex": REGEX,
            "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(2**31)}
    stream = rng.random() < 0.4
    sent = time.perf_counter()
    r = call(ctx, ctx.via(rng), COMPLETIONS, body, stream)
    [c] = served(r, False, 1, 32, usage=not stream)
    if c["finish_reason"] == "stop" and not re.fullmatch(REGEX, c["text"]):
        raise Unexpected(f"guided regex output {c['text']!r}")
    return ok(r, sent)


def tool_calls(ctx: Ctx, rng: random.Random) -> Result:
    """tool_choice required or a named function: calls (unless cut by max_tokens) to known functions, with ids,
    and arguments following each function's schema; one call at most with parallel_tool_calls false."""
    named = "get_time" if rng.random() < 0.3 else None
    body = {"messages": [{"role": "user", "content": rng.choice(["What is the weather in Paris this week?",
                                                                 "Time in UTC?", rng.choice(ctx.prompts)[:120]])}],
            "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": named}} if named else "required",
            "max_tokens": TOOL_TOKENS, "temperature": rng.choice([0, 0.7]), "seed": rng.randrange(2**31)}
    if rng.random() < 0.3:
        body["parallel_tool_calls"] = False
    stream = rng.random() < 0.4
    sent = time.perf_counter()
    r = call(ctx, ctx.via(rng), CHAT, body, stream)
    [c] = served(r, True, 1, TOOL_TOKENS, usage=not stream)
    calls = c["message"].get("tool_calls") or []
    if c["finish_reason"] == "length":
        return ok(r, sent)
    if c["finish_reason"] != "tool_calls" or not calls or (body.get("parallel_tool_calls") is False and len(calls) > 1):
        raise Unexpected(f"tool_choice {body['tool_choice']}: finish_reason {c['finish_reason']}, calls {calls}, "
                         f"content {c['message'].get('content')!r}")
    for tc in calls:
        name = tc["function"]["name"]
        if name not in SCHEMAS or name != (named or name) or tc.get("type") != "function" \
                or not (tc.get("id") or "").startswith("chatcmpl-tool-"):
            raise Unexpected(f"a call {tc}")
        problem = schema_problem(tc["function"]["arguments"], SCHEMAS[name])
        if problem:
            raise Unexpected(f"{name}'s arguments: {problem}")
    return ok(r, sent)


def long_prompt(ctx: Ctx, rng: random.Random) -> Result:
    """A prompt near max_seq_len; a quarter of them generate to the context's last position (eos ignored)."""
    prompt, n = rng.choice(ctx.long_prompts)
    room = ctx.max_seq_len - n
    exact = rng.random() < 0.25
    mt = room if exact else rng.randint(8, min(48, room))
    body = {"prompt": prompt, "max_tokens": mt, "temperature": 0, **({"ignore_eos": True} if exact else {})}
    stream = rng.random() < 0.5
    sent = time.perf_counter()
    r = call(ctx, ctx.via(rng), COMPLETIONS, body, stream)
    served(r, False, 1, mt, usage=not stream)
    u = r.data["usage"]
    if not stream and (u["prompt_tokens"] != n or (exact and u["completion_tokens"] != mt)):
        raise Unexpected(f"usage {u}: expected {n} prompt tokens" + (f" and {mt} completion tokens" if exact else ""))
    return ok(r, sent)


def raw_request(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), len(data), data))


def close(sock: socket.socket, rng: random.Random) -> None:
    """Half the time a reset (RST) rather than an orderly close (FIN)."""
    if rng.random() < 0.5:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def disconnect(ctx: Ctx, rng: random.Random) -> Result:
    """A streaming client that goes away after its first SSE event."""
    path, body = either(ctx, rng, 0.5)
    body |= {"max_tokens": CANCEL_TOKENS, "ignore_eos": True, "stream": True, "temperature": rng.choice([0, 0.8])}
    sent = time.perf_counter()
    sock = socket.create_connection(("127.0.0.1", ctx.port), timeout=ctx.timeout)
    try:
        sock.sendall(raw_request(path, body))
        got = b""
        while b"data: " not in got:  # the headers may come in a segment of their own
            chunk = sock.recv(4096)
            if not chunk:
                raise Unexpected(f"closed before the first event: {got[:300]!r}")
            got += chunk
        if not got.startswith(b"HTTP/1.1 200") or b'"error"' in got:
            raise Unexpected(f"refused: {got[:300]!r}")
        first = time.perf_counter()
    finally:
        close(sock, rng)
    return Result("disconnected", first - sent)


def cancel_early(ctx: Ctx, rng: random.Random) -> Result:
    """The whole request sent, the connection closed before the answer's first byte is read."""
    path, body = either(ctx, rng, 0.5)
    body |= {"max_tokens": CANCEL_TOKENS, "ignore_eos": True, "temperature": 0.8,
             **({"stream": True} if rng.random() < 0.5 else {})}
    sock = socket.create_connection(("127.0.0.1", ctx.port), timeout=ctx.timeout)
    try:
        sock.sendall(raw_request(path, body))
        time.sleep(rng.uniform(0, 0.02) if body.get("stream") else rng.uniform(0, 0.5))
    finally:
        close(sock, rng)
    return Result("cancelled")


def probe_answer(r: Reply, path: str) -> Any:
    """What a probe compares: each choice's text (and tool calls) and finish reason."""
    if path == CHAT:
        return [[c["message"].get("content") or "", [[t["function"]["name"], t["function"]["arguments"]]
                                                     for t in c["message"].get("tool_calls") or []], c["finish_reason"]]
                for c in r.data["choices"]]
    return [[c["text"], c["finish_reason"]] for c in r.data["choices"]]


def probe_requests(ctx: Ctx, probe_prompts: list[str]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Requests whose answer must not depend on the load (batch composition, adaptive draft length, the order
    seeded sequences sample in): greedy, seeded, n=2 seeded, tool calls, guided JSON, a long prompt."""
    p = ctx.prompts
    probes = {f"completion_greedy_{i}": (COMPLETIONS, {"prompt": x, "max_tokens": PROBE_TOKENS, "temperature": 0})
              for i, x in enumerate(probe_prompts)}
    probes |= {f"chat_greedy_{i}": (CHAT, {"messages": [{"role": "user", "content": x[:200]}],
                                           "max_tokens": PROBE_TOKENS, "temperature": 0})
               for i, x in enumerate(p[4:6])}
    probes |= {f"completion_seeded_{i}": (COMPLETIONS, {"prompt": x, "max_tokens": PROBE_TOKENS, "temperature": 0.9,
                                                        "top_p": 0.95, "seed": 1234 + i}) for i, x in enumerate(p[6:8])}
    probes["completion_seeded_n2"] = (COMPLETIONS, {"prompt": p[8], "max_tokens": 32, "temperature": 0.9, "n": 2,
                                                    "seed": 77})
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    probes["tools_required_greedy"] = (CHAT, {"messages": ask,
                                              "tools": TOOLS, "tool_choice": "required", "max_tokens": TOOL_TOKENS,
                                              "temperature": 0})
    probes["guided_json_greedy"] = (CHAT, {"messages": [{"role": "user", "content": p[9][:200]}], "max_tokens": 64,
                                           "temperature": 0, "response_format": {
                                               "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    probes["long_prompt_greedy"] = (COMPLETIONS, {"prompt": ctx.long_prompts[0][0], "max_tokens": 32,
                                                  "temperature": 0})
    return probes


def record_probes(ctx: Ctx, probe_prompts: list[str]) -> None:
    for name, (path, body) in probe_requests(ctx, probe_prompts).items():
        try:
            ctx.probes[name] = (path, body, probe_answer(call(ctx, None, path, body), path))
        except Unexpected as e:
            raise SystemExit(f"probe {name} on the idle server failed: {e}") from None


def probe(ctx: Ctx, rng: random.Random) -> Result:
    name = rng.choice(list(ctx.probes))
    path, body, want = ctx.probes[name]
    stream, via = rng.random() < 0.5, ctx.via(rng)
    sent = time.perf_counter()
    r = call(ctx, via, path, body, stream)
    got = probe_answer(r, path)
    if got != want:
        return Result("mismatch", None, f"probe {name} ({'openai client' if via else 'raw'}, "
                      f"{'streamed' if stream else 'whole'}): got {json.dumps(got)[:200]}, recorded "
                      f"{json.dumps(want)[:200]}")
    return ok(r, sent)


def tokenize(ctx: Ctx, rng: random.Random) -> Result:
    """/tokenize gives the tokenizer's ids, /detokenize gives them back as text; a chat with tools is counted."""
    p = rng.choice(ctx.prompts)
    r, _ = raw_call(ctx, "/tokenize", {"model": ctx.model, "prompt": p})
    if r.status != 200 or r.data["tokens"] != ctx.prompt_ids[p] or r.data["max_model_len"] != ctx.max_seq_len:
        raise Unexpected(f"tokenize: HTTP {r.status} {str(r.data)[:200]}")
    d, _ = raw_call(ctx, "/detokenize", {"model": ctx.model, "tokens": r.data["tokens"]})
    if d.status != 200 or d.data["prompt"] != ctx.tok.decode(ctx.prompt_ids[p], skip_special_tokens=False):
        raise Unexpected(f"detokenize: HTTP {d.status} {str(d.data)[:200]}")
    c, _ = raw_call(ctx, "/tokenize", {"model": ctx.model, "messages": user(ctx, rng), "tools": TOOLS})
    if c.status != 200 or not c.data["count"]:
        raise Unexpected(f"tokenize a chat with tools: HTTP {c.status} {str(c.data)[:200]}")
    return Result("ok")


# Bad requests: path, body, and the refusal each must get: status, `param`, and the message (formatted with
# max_seq_len, vocab, max_batch_size and over_tokens, the token count of the over-long prompt);
# tests/test_openai_server.py's and tests/test_openai_tools.py's messages.
MSG = [{"role": "user", "content": "x"}]
OVER_LONG = "hello world "  # repeated max_seq_len // 2 + 100 times
BAD: dict[str, tuple[str, Any, int, str | None, str]] = {
    "temperature_negative": (COMPLETIONS, {"prompt": "x", "temperature": -1}, 400, "temperature",
                             "temperature must be >= 0.0, got -1"),
    "max_tokens_past_context": (COMPLETIONS, {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens",
                                "max_tokens 5000 with a 2-token prompt exceeds max_seq_len {max_seq_len}; at most "
                                "{room_after_2}"),
    "max_tokens_negative": (CHAT, {"messages": MSG, "max_tokens": -1}, 400, "max_tokens",
                            "max_tokens must be an integer in [1, 2147483647], got -1"),
    "unknown_field": (COMPLETIONS, {"prompt": "x", "max_token": 3}, 400, "max_token",
                      "Unrecognized request argument supplied: max_token"),
    "n_past_batch": (COMPLETIONS, {"prompt": "x", "n": MAX_BATCH_SIZE + 1, "temperature": 1}, 400, "n",
                     "n {n_past} exceeds this executor's max_batch_size {max_batch_size}: the request's sequences run "
                     "in one batch"),
    "logprobs_21": (COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, "logprobs",
                    "logprobs must be an integer in [0, 20], got 21"),
    "top_p_over_1": (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, 400, "top_p", "top_p must be in (0.0, 1.0], got 1.5"),
    "regex_invalid": (COMPLETIONS, {"prompt": "x", "guided_regex": "a{2"}, 400, "guided_regex",
                      "guided_regex is invalid at position 1: unclosed counted repetition"),
    "json_schema_invalid": (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, 400, "response_format",
        "response_format.json_schema.schema is invalid at /properties/a of the schema: Invalid type: nonsense"),
    "tools_with_response_format": (CHAT, {"messages": MSG, "tools": TOOLS, "tool_choice": "required",
                                          "response_format": {"type": "json_object"}}, 400, "tool_choice",
                                   "tool_choice and response_format both constrain the output; send one"),
    "tool_choice_unknown_function": (CHAT, {"messages": MSG, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, 400, "tool_choice",
        "tool_choice names the function 'nope', which is not among tools (get_weather, get_time)"),
    "tool_parameters_not_object": (CHAT, {"messages": MSG, "tool_choice": "required", "tools": [{
        "type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, 400,
        "tools[0].function.parameters", 'tools[0].function.parameters must be a JSON schema of "type": "object" '
        "(a call's arguments are an object), got type string"),
    "stop_65": (COMPLETIONS, {"prompt": "x", "stop": [str(i) for i in range(65)]}, 400, "stop",
                "stop holds 65 strings; at most 64"),
    "messages_empty": (CHAT, {"messages": []}, 400, "messages",
                       "messages must be a non-empty list of {{role, content}}"),
    "model_unknown": (COMPLETIONS, {"model": "gpt-4", "prompt": "x"}, 404, "model",
                      "The model `gpt-4` does not exist. This server serves `{model}`."),
    "best_of_below_n": (COMPLETIONS, {"prompt": "x", "n": 3, "best_of": 2, "temperature": 1}, 400, "best_of",
                        "best_of must be None or an integer >= n (3), got 2"),
    "prompt_logprobs_streamed": (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400,
                                 "prompt_logprobs", "prompt_logprobs are not streamed (they come with the whole "
                                 "response); send stream: false"),
    "top_logprobs_without_logprobs": (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs",
                                      "top_logprobs needs logprobs: true"),
    "prompt_over_max_seq_len": (COMPLETIONS, None, 400, "prompt",
                                "prompt has {over_tokens} tokens; max_seq_len is {max_seq_len}"),
    "body_not_json": (COMPLETIONS, b"{not json", 400, None, "the request body must be JSON: Expecting property name "
                      "enclosed in double quotes: line 1 column 2 (char 1)"),
    "detokenize_out_of_vocab": ("/detokenize", {"tokens": [99999]}, 400, "tokens",
                                "tokens must hold token ids in [0, {vocab}), got [99999]"),
    "seed_not_integer": (COMPLETIONS, {"prompt": "x", "seed": "abc"}, 400, "seed",
                         "seed must be an integer, got 'abc'"),
}


def bad(case: str) -> Callable[[Ctx, random.Random], Result]:
    path, body, status, param, message = BAD[case]

    def send(ctx: Ctx, rng: random.Random) -> Result:
        over_long = OVER_LONG * (ctx.max_seq_len // 2 + 100)
        r, _ = raw_call(ctx, path, {"prompt": over_long} if body is None else body)
        want = message.format(max_seq_len=ctx.max_seq_len, room_after_2=ctx.max_seq_len - 2, vocab=ctx.tok.vocab_size,
                              n_past=MAX_BATCH_SIZE + 1, max_batch_size=MAX_BATCH_SIZE, model=ctx.model,
                              over_tokens=len(ctx.tok.encode(over_long)))
        error = r.data.get("error") if isinstance(r.data, dict) else None
        got = (r.status, error.get("param"), error.get("message")) if isinstance(error, dict) else (r.status, r.data)
        if got != (status, param, want):
            raise Unexpected(f"refusal {got}; expected {(status, param, want)}")
        return Result("expected_refusal")
    return send


KINDS: Kinds = {
    "completion": (6, plain(chat=False, stream=False)),
    "completion_stream": (6, plain(chat=False, stream=True)),
    "chat": (5, plain(chat=True, stream=False)),
    "chat_stream": (5, plain(chat=True, stream=True)),
    "seeded_sampled": (4, seeded),
    "n2": (3, n2),
    "best_of3": (3, best_of),
    "logprobs": (4, logprobs),
    "prompt_logprobs": (2, prompt_logprobs),
    "stop_strings": (4, stop_strings),
    "guided_json": (4, guided_json),
    "guided_regex": (3, guided_regex),
    "tool_calls": (4, tool_calls),
    "long_prompt": (4, long_prompt),
    "disconnect_midstream": (4, disconnect),
    "cancel_before_first_byte": (4, cancel_early),
    "probe": (8, probe),
    "tokenize_detokenize": (2, tokenize),
    **{f"bad_{case}": (1, bad(case)) for case in BAD},
}


# ---- server side ------------------------------------------------------------------------------------------------
def server_processes(server: ServeProcess) -> dict[int, str]:
    """pid -> name of dsv3-serve and each process under it (the engine process with --engine_process)."""
    pid = server.process.pid
    return {pid: "dsv3-serve", **{child: "under dsv3-serve: " + (module_run_by(argv) or " ".join(
        a.decode(errors="replace") for a in argv[1:] if a)) for child, argv in live_descendants(pid).items()}}


def gauges(server: ServeProcess) -> dict[str, float]:
    m = read_metrics(server.base_url + "/metrics")
    return {"kv_used": metric(m, "dsv3_kv_blocks_used"), "kv_free": metric(m, "dsv3_kv_blocks_free"),
            "active": metric(m, "dsv3_requests_running") + metric(m, "dsv3_requests_waiting")} if m else {}


def end_checks(ctx: Ctx, server: ServeProcess) -> dict[str, Any]:
    """After the load: drained, KV blocks all free, healthy, and every probe still gives its recorded answer."""
    drain_ok = wait_drained(lambda: gauges(server), DRAIN_S)
    g = gauges(server)
    probes = {}
    for name, (path, body, want) in ctx.probes.items():
        try:
            probes[name] = "ok" if probe_answer(call(ctx, None, path, body), path) == want else "differs"
        except Exception as e:  # the server is gone or hangs
            probes[name] = f"{type(e).__name__}: {e}"
    try:
        health = urllib.request.urlopen(server.base_url + "/health", timeout=10).status
    except OSError as e:
        health = f"{type(e).__name__}: {e}"
    return {"drained": drain_ok, "gauges": g, "kv_all_free": g.get("kv_used") == 0 and g.get("kv_free", 0) > 0,
            "health": health, "server_alive": server.process.poll() is None, "probes": probes}


def stop(server: ServeProcess, children: list[int]) -> dict[str, Any]:
    """SIGTERM, the exit status, and the processes that were under the server and still run (not zombies)."""
    t0 = time.perf_counter()
    try:
        status: int | str = server.stop(timeout_s=90)
    except Exception as e:  # it did not exit: killed
        server.process.kill()
        server.process.wait()
        status = f"{type(e).__name__}: {e}"
    stop_s = time.perf_counter() - t0
    time.sleep(1.0)
    left = [pid for pid in children if running(pid)]
    return {"exit_status": status, "stop_s": stop_s, "children_left": left}


# ---- the soak -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint or engine directory dsv3-serve serves "
                   "(and the held-out prompts)")
    p.add_argument("--engine_process", action="store_true", help="dsv3-serve --engine_process: the executor in a "
                   "process of its own")
    p.add_argument("--out", type=Path, help="results go to <out>.json and <out>.md (default docs/benchmarks/"
                   "soak_openai, soak_openai_engine_process with --engine_process, and _quick after it with --quick)")
    add_soak_args(p, minutes=10.0, concurrency=16, sample_every_s=15.0)
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}; explicit flags still win")
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    if args.out is None:
        args.out = ROOT / "docs" / "benchmarks" / ("soak_openai" + "_engine_process" * args.engine_process
                                                   + "_quick" * args.quick)
    check_soak_args(p, args, KINDS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = machine_info()
    log = Path(tempfile.mkdtemp(prefix="soak-openai-")) / "server.log"
    flags = ["--chat_template", str(TOOLS_TEMPLATE), "--tool_call_parser", "deepseek_v3",
             "--max_batch_size", str(MAX_BATCH_SIZE), *(["--engine_process"] if args.engine_process else []),
             *(["--torch_threads", str(args.threads)] if args.threads else [])]
    t_start = time.perf_counter()
    server = start_dsv3_serve(args.model, *flags, log=log)
    print(f"dsv3-serve ready in {time.perf_counter() - t_start:.0f} s on port {server.port} (log {log}); "
          f"{args.concurrency} clients for {args.minutes:g} min", flush=True)
    pids = server_processes(server)
    try:
        card = json.loads(urllib.request.urlopen(server.base_url + "/v1/models", timeout=30).read())["data"][0]
        tok = Tokenizer.from_dir(args.model)
        short, probe_prompts, long = make_prompts(args.model, tok, card["max_model_len"])
        sdk = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                            timeout=args.request_timeout_s)
        ctx = Ctx(server.port, card["id"], tok, card["max_model_len"], short, {p: tok.encode(p) for p in short},
                  [(x, len(tok.encode(x))) for x in long], sdk, args.request_timeout_s)
        record_probes(ctx, probe_prompts)
        watched = Watched("dsv3-serve", pids, lambda: server.process.poll() is None, lambda: gauges(server))
        load = run_load(KINDS, ctx, args, watched)
        end = end_checks(ctx, server)
        end_rss, end_shmem = rss_kb(pids), rss_kb(pids, "RssShmem")
    finally:
        shutdown = stop(server, [pid for pid in pids if pid != server.process.pid])

    records: list[Record] = load["records"]
    everything = load["primed"] + records
    rss = rss_table(pids, load["samples"], load["start_index"], end_rss, end_shmem, args.minutes * 60)
    by_outcome = Counter(r.outcome for r in records)
    primed = Counter(r.outcome for r in load["primed"])
    unexpected, mismatches = errors_by_kind(everything, "unexpected_error"), errors_by_kind(everything, "mismatch")
    cancels_sent = sum(c["cancelled"] + c["disconnected"] for c in (by_outcome, primed))
    log_text = log.read_text(errors="replace")
    # a request line's outcome: "..., client disconnected, streamed in 0.011 s" or "..., client disconnected in 0.1 s"
    disconnects_logged = len(re.findall(r" completion tokens, client disconnected\b", log_text))
    log_errors = [x for x in log_text.splitlines() if re.search(r"^(\S+ \S+ )?(ERROR|CRITICAL)\b", x)]
    checks = {
        "no_unexpected_errors": not unexpected,
        "no_probe_mismatches": not mismatches,
        "clients_stopped": load["hung_clients"] == 0,
        "server_processes_alive": all(r["alive"] for r in rss),
        **rss_checks(rss),
        "kv_blocks_all_free": end["kv_all_free"],
        "disconnects_reached_the_server": disconnects_logged == cancels_sent,
        "healthy_at_end": end["health"] == 200 and end["server_alive"] and set(end["probes"].values()) == {"ok"},
        "no_error_in_log": not log_errors and "Traceback" not in log_text,
        "clean_shutdown": shutdown["exit_status"] == 0 and not shutdown["children_left"],
    }
    failures = [c for c, passed in checks.items() if passed is False]
    results = {
        "benchmark": "soak_openai", "quick": args.quick, "passed": not failures, "failures": failures,
        "checks": checks,
        "settings": {"minutes": args.minutes, "concurrency": args.concurrency, "warmup_s": args.warmup_s,
                     "sample_every_s": args.sample_every_s, "prime_rounds": args.prime_rounds,
                     "request_timeout_s": args.request_timeout_s, "seed": args.seed,
                     "weights": {k: KINDS[k][0] for k in args.kinds or KINDS}, "model": str(args.model),
                     "engine_process": args.engine_process, "server_flags": flags, "max_seq_len": ctx.max_seq_len,
                     "long_prompt_tokens": [n for _, n in ctx.long_prompts], "probe_tokens": PROBE_TOKENS,
                     "cancel_tokens": CANCEL_TOKENS, "openai_client_share": SDK_SHARE, "host": "127.0.0.1"},
        "priming": {"requests": len(load["primed"]), "wall_s": load["prime_s"], "by_outcome": dict(primed),
                    "kinds_sent": dict(Counter(r.kind for r in load["primed"]))},
        "load_wall_s": load["wall_s"], "hung_clients": load["hung_clients"],
        "requests": {"total": len(records), "served": by_outcome["ok"], "by_outcome": dict(by_outcome),
                     "per_s": len(records) / load["wall_s"], "openai_client": dict(ctx.sdk_requests),
                     "served_with_u_fffd": sum(r.message == FFFD for r in everything)},
        "latency": {"all": latency_stats(records), "served": latency_stats([r for r in records if r.outcome == "ok"])},
        "kinds": summarize_kinds(KINDS, records),
        "unexpected_errors": unexpected, "mismatches": mismatches,
        "probes": {name: path for name, (path, _, _) in ctx.probes.items()},
        "cancellation": {"cancels_and_disconnects": cancels_sent,
                         "logged_client_disconnected": disconnects_logged},
        "rss": rss_results(load, rss),
        "kv_used_peak_sampled": max((s["kv_used"] or 0) for s in load["samples"]),
        "end": end, "shutdown": shutdown,
        "server_log": {"lines": len(log_text.splitlines()), "tracebacks": log_text.count("Traceback"),
                       "errors": log_errors[:20],
                       "warnings": len(re.findall(r"^(?:\S+ \S+ )?WARNING\b", log_text, re.M))},
        "machine": info,
    }
    md = markdown(results)
    js, mdp = write_results(args.out.parent, args.out.name, results, md)
    print(md)
    if failures:
        print(f"FAILED: {', '.join(failures)} (server log: {log})", file=sys.stderr)
    else:
        log.unlink()
        log.parent.rmdir()
    print(f"wrote {js} and {mdp}")
    return 1 if failures else 0


def markdown(r: dict[str, Any]) -> str:
    s, req, end, sd = r["settings"], r["requests"], r["end"], r["shutdown"]
    end_md = (
        f"## End\n\nGauges {end['gauges']} (KV blocks all free: {fmt(end['kv_all_free'])}; peak used in samples "
        f"{r['kv_used_peak_sampled']:.0f}); /health {end['health']}; probes after the load "
        f"{dict(Counter(end['probes'].values()))}; cancels and disconnects "
        f"{r['cancellation']['cancels_and_disconnects']}, "
        f"logged as client disconnected {r['cancellation']['logged_client_disconnected']}; server exit status "
        f"{sd['exit_status']} after {sd['stop_s']:.1f} s (SIGTERM), processes left {sd['children_left'] or 'none'}; "
        f"server log: {r['server_log']['tracebacks']} tracebacks, {len(r['server_log']['errors'])} errors, "
        f"{r['server_log']['warnings']} warnings.")
    return report_md(r, "OpenAI server soak test", title_more=", engine process" if s["engine_process"] else "",
                     served_by=f"dsv3-serve {' '.join(s['server_flags'])}; ",
                     requests_more=f"; through the openai client {req['openai_client']}; served with a U+FFFD in the "
                     f"text (not judged) {req['served_with_u_fffd']}", max_seq_len=f"max_seq_len {s['max_seq_len']}",
                     end=[end_md])


if __name__ == "__main__":
    sys.exit(main())
