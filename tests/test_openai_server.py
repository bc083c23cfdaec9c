"""dsv3-serve, the OpenAI-compatible server, run as users run it (the console script, on 127.0.0.1) on the shipped
model with MTP drafting, and called through the official `openai` client: output equal to plain decoding in a
Session, streaming equal to unary, concurrency, n, usage with the MTP stats, errors in OpenAI's shape, and
cancellation when a client disconnects (KV blocks back in the pool)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import socket
import threading
import time
import types
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from runtime.core.sampling_params import SamplingParams  # noqa: E402
from runtime.executors.session import Session  # noqa: E402
from runtime.io.tokenizer import Tokenizer  # noqa: E402
from serving.openai_server.chat import RESERVED_NAMES, ChatTemplateFault, render_chat  # noqa: E402
from serving.openai_server.cli import parse_args  # noqa: E402
from serving.openai_server.process import start_dsv3_serve  # noqa: E402
from serving.request_validation import RequestError  # noqa: E402

PROMPTS = ["In the beginning God created", "And the LORD spake unto Moses, saying,", "def fibonacci(n):"]
TOKENS = 24


class Server:
    def __init__(self, model: Path, log: Path, *args: str):
        self.log = log
        self.serve = start_dsv3_serve(model, "--torch_threads", "1", *args, log=log)
        self.port, self.base = self.serve.port, self.serve.base_url
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.base + "/metrics", timeout=10).read().decode()
        return {line.split("{")[0].removeprefix("dsv3_"): float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}

    def post(self, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, headers={"Content-Type": "application/json",
                                                                           **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self) -> int:
        return self.serve.stop()


@pytest.fixture(scope="module")
def server(shipped_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # the executor in its own process (the default on CUDA devices; one process, on CPU, is the other tests')
    srv = Server(shipped_model_dir, tmp_path_factory.mktemp("openai") / "server.log",
                 "--num_draft_tokens", "3", "--speculation", "fixed", "--engine_process")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def plain(shipped_model_dir: Path) -> Iterator[Session]:
    with Session(shipped_model_dir, num_draft_tokens=0) as s:
        yield s


def _plain_text(session: Session, ids: list[int], max_tokens: int = TOKENS) -> str:
    out = session.executor.submit(ids, SamplingParams(max_tokens=max_tokens)).result()
    return out.text


def test_models_lists_the_served_model(server: Server) -> None:
    [card] = server.client.models.list().data
    assert card.id == "deepseek-v3-mini" and card.object == "model"
    assert server.client.models.retrieve("deepseek-v3-mini").id == "deepseek-v3-mini"
    with pytest.raises(openai.NotFoundError) as e:
        server.client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.body == {"message": "The model `gpt-4` does not exist. This server serves `deepseek-v3-mini`.",
                            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


def test_completions_with_mtp_equal_plain_decoding(server: Server, plain: Session) -> None:
    """Greedy through the server (k = 3 drafts every step) is token for token the Session's plain decoding."""
    tok = plain.tokenizer
    for prompt in PROMPTS:
        r = server.client.completions.create(model="deepseek-v3-mini", prompt=prompt, max_tokens=TOKENS, temperature=0)
        [c] = r.choices
        expected = plain.executor.submit(tok.encode(prompt), SamplingParams(max_tokens=TOKENS)).result()
        assert c.text == expected.text and r.object == "text_completion"
        assert c.finish_reason == expected.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode(prompt)), len(expected.token_ids))
        spec = r.usage.model_extra["speculative_decoding"]
        assert spec["total_draft_tokens"] > 0 and 0 <= spec["total_accepted_draft_tokens"] <= spec["total_draft_tokens"]
        assert spec["decode_steps"] < r.usage.completion_tokens  # drafts were accepted: fewer steps than tokens


def test_a_repeated_prompt_reports_its_cached_tokens(server: Server, plain: Session) -> None:
    """usage.prompt_tokens_details.cached_tokens (OpenAI's field): the prompt tokens found in the prefix cache,
    whole KV blocks of them; the same text as without them; the server's prefix-cache counters move."""
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)
    n_prompt = len(plain.tokenizer.encode(prompt))
    before = server.metrics()
    first, second = (server.client.completions.create(model="deepseek-v3-mini", prompt=prompt, max_tokens=8,
                                                      temperature=0) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # a prompt this test alone sends
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached <= n_prompt - 1  # whole blocks; the last token is computed
    assert second.choices[0].text == first.choices[0].text
    after = server.metrics()
    assert after["prefix_cache_reused_blocks_total"] - before["prefix_cache_reused_blocks_total"] == cached // 16
    assert after["prefix_cache_missed_blocks_total"] > before["prefix_cache_missed_blocks_total"]


def test_token_id_prompts_and_batches_of_prompts(server: Server, plain: Session) -> None:
    ids = [plain.tokenizer.encode(p) for p in PROMPTS]
    r = server.client.completions.create(model="deepseek-v3-mini", prompt=ids, max_tokens=TOKENS, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [_plain_text(plain, i) for i in ids]
    assert r.usage.prompt_tokens == sum(map(len, ids))


def test_streaming_equals_unary_and_ends_with_usage(server: Server) -> None:
    kw = dict(model="deepseek-v3-mini", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0)
    unary = server.client.completions.create(**kw)
    chunks = list(server.client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == unary.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == unary.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # with k = 3, a step emits several tokens and they arrive in one chunk: fewer chunks than tokens
    assert len(chunks) - 1 < unary.usage.completion_tokens


# ---- a stream's chunks are the executor's steps ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafting(shipped_model_dir: Path) -> Iterator[Session]:
    """The server's drafting (k = 3 every step) in a Session, whose output callback sees each step's output."""
    with Session(shipped_model_dir, num_draft_tokens=3, speculation="fixed") as s:
        yield s


def _step_outputs(session: Session, ids: list[int], params: SamplingParams) -> list:
    """A request's outputs as the executor reports them, one per decoding step (the callback's: never merged)."""
    outs: list = []
    session.executor.submit(ids, params, on_output=outs.append).result()
    return outs


def _steps_of(session: Session, ids: list[int], k: int | None) -> tuple[list[list[int]], list[str]]:
    """The token ids and the text of each step of a greedy, fixed-length request drafting k a step (None: the
    executor's 3): each step's tokens 1..k+1 and its text its own (no character split over steps, no stop string
    holding text back), so no stream's chunk waits for the text of a later step."""
    steps = _step_outputs(session, ids, SamplingParams(max_tokens=TOKENS, ignore_eos=True, num_draft_tokens=k))
    k_max = 3 if k is None else k
    assert all(o.text_delta and not o.mid_character for o in steps)
    want_ids, want_texts = [list(o.new_token_ids) for o in steps], [o.text_delta for o in steps]
    assert all(1 <= len(ids) <= k_max + 1 for ids in want_ids) and sum(map(len, want_ids)) == TOKENS
    assert max(map(len, want_ids)) == 1 if k_max == 0 else max(map(len, want_ids)) > 1  # steps of several tokens
    return want_ids, want_texts


def _sse_events(server: Server, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(server.base + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    lines = urllib.request.urlopen(req, timeout=60).read().decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


class _Gated:
    """An executor whose step loop hands a request its next output only once the stream has taken the one before: a
    stream that keeps up with the steps, however loaded the machine (a stream that falls behind is handed the steps
    it missed merged into one output, as vLLM merges them: RequestHandle)."""

    def __init__(self, executor: object):
        self._executor = executor

    def __getattr__(self, name: str) -> object:
        return getattr(self._executor, name)

    def submit(self, ids: list[int], params: SamplingParams, on_output: object = None, request_id: str | None = None,
               bounded: bool = True) -> object:
        assert on_output is None  # the server reads its handles

        def gate(out: object) -> None:  # on the step loop, before the output reaches the handle
            deadline = time.monotonic() + 30
            while handle is not None and handle._pending and time.monotonic() < deadline:
                time.sleep(0.0005)

        handle = None
        handle = self._executor.submit(ids, params, on_output=gate, request_id=request_id, bounded=bounded)
        assert isinstance(handle._pending, dict)  # what the gate reads: the outputs not taken yet
        return handle


def _gated_stream(session: Session, path: str, body: dict) -> list[dict]:
    """The events the server's stream of `body` sends (OpenAIServer._stream, what the route responds with), on the
    session's executor gated (_Gated)."""
    from serving.openai_server import protocol
    from serving.openai_server.app import OpenAIServer

    srv = OpenAIServer(_Gated(session.executor), "deepseek-v3-mini")
    chat = path.endswith("/chat/completions")
    g = (srv.chat_request if chat else protocol.completion_request)({**body, "stream": True}, srv.tokenizer,
                                                                       srv.max_text_bytes)

    async def read() -> list[str]:
        return [s async for s in srv._stream(g, srv._submit(g, chat), chat, time.perf_counter())]

    sent = asyncio.run(read())
    assert all(s.count("data: ") == 1 for s in sent)  # an event each
    return [json.loads(s[6:]) for s in sent if s.startswith("data: {")]


def _ids(c: dict) -> list[int] | None:
    return c.get("token_ids")


def _logprob_ids(c: dict) -> list[int] | None:  # with return_tokens_as_token_ids
    return [int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] if c.get("logprobs") else None


def _text(c: dict) -> str | None:
    return (c["delta"].get("content") if "delta" in c else c["text"]) or None


def _pieces(events: list[dict], read) -> list:
    return [p for e in events for c in e["choices"] if (p := read(c)) is not None]


def _ends(pieces: list) -> set[int]:
    """Where each piece ends in the pieces joined (tokens or characters)."""
    ends, n = set(), 0
    for p in pieces:
        n += len(p)
        ends.add(n)
    return ends


def _joined(pieces: list) -> list | str:
    return "".join(pieces) if pieces and isinstance(pieces[0], str) else [t for p in pieces for t in p]


STEP_CHUNKS = [({"return_token_ids": True}, _ids), ({"logprobs": 0, "return_tokens_as_token_ids": True}, _logprob_ids),
               ({}, _text)]  # what a stream is asked for, and how a chunk's tokens or text are read


@pytest.mark.parametrize("k", [None, 1, 0], ids=["k3", "k1", "k0"])
def test_a_stream_sends_each_decoding_step_as_one_chunk(drafting: Session, k: int | None) -> None:
    """With MTP a step emits 1..k+1 tokens; streamed, they come in one chunk, and each step in its own chunk, as
    TensorRT-LLM and vLLM stream a step's accepted tokens: the chunks' token ids (vLLM's return_token_ids), their
    logprobs' tokens, and (without either) their text are each step's, in order, as many chunks as the usage's
    decode_steps; k = 0 (the request's own draft length) is a chunk per token. The server's stream over the executor
    of a Session, gated so that the stream keeps up with the step loop (test_a_served_stream_never_splits_a_step
    has the real server)."""
    prompt = PROMPTS[2]
    want_ids, want_texts = _steps_of(drafting, drafting.tokenizer.encode(prompt), k)
    body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **({} if k is None else {"num_draft_tokens": k})}
    for asked, read in STEP_CHUNKS:
        events = _gated_stream(drafting, "/v1/completions", {**body, **asked})
        assert _pieces(events, read) == (want_texts if read is _text else want_ids), asked
        assert len(events) == len(want_ids) + 1  # a chunk per step, then the usage
        assert events[-1]["usage"]["speculative_decoding"]["decode_steps"] == len(want_ids)
    chat = {"messages": [{"role": "user", "content": "Who made the light?"}], "max_tokens": TOKENS,
            "temperature": 0, "ignore_eos": True, **({} if k is None else {"num_draft_tokens": k})}
    events = _gated_stream(drafting, "/v1/chat/completions", {**chat, "return_token_ids": True})
    want_ids, want_texts = _steps_of(drafting, events[0]["prompt_token_ids"], k)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and "token_ids" not in events[0]["choices"][0]
    assert _pieces(events[1:], _ids) == want_ids and len(events) == len(want_ids) + 1  # the role's chunk first
    events = _gated_stream(drafting, "/v1/chat/completions", chat)
    assert _pieces(events, _text) == want_texts and len(events) == len(want_ids) + 1


@pytest.mark.parametrize("k", [None, 1], ids=["k3", "k1"])
def test_a_served_stream_never_splits_a_step(server: Server, drafting: Session, k: int | None) -> None:
    """Through dsv3-serve itself (the engine process, HTTP): every chunk holds whole steps, in order, never part of
    one; the usage counts the steps. A stream that falls behind the step loop is sent the steps it missed in one chunk
    (RequestHandle merges them, as vLLM does), so how many chunks a stream gets depends on the machine's load: on a
    busy 2-core machine, steps a few milliseconds apart often come two or more to a chunk (plain decoding's, 1-2 ms
    apart, several to a chunk nearly always); test_a_stream_sends_each_decoding_step_as_one_chunk has the chunk per
    step of a stream that keeps up."""
    prompt = PROMPTS[2]
    want_ids, want_texts = _steps_of(drafting, drafting.tokenizer.encode(prompt), k)
    body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            **({} if k is None else {"num_draft_tokens": k})}
    status, unary = server.post("/v1/completions", body)
    assert status == 200 and unary["choices"][0]["text"] == "".join(want_texts), unary
    for asked, read in STEP_CHUNKS:
        want = want_texts if read is _text else want_ids
        events = _sse_events(server, "/v1/completions", {**body, **asked, "stream_options": {"include_usage": True}})
        got = _pieces(events, read)
        assert _joined(got) == _joined(want), asked
        assert _ends(got) <= _ends(want), f"{asked}: a chunk holds part of a step: {got} for the steps {want}"
        assert len(events) - 1 == len(got) <= len(want_ids)  # no chunk without tokens; the usage's last
        assert events[-1]["usage"]["speculative_decoding"]["decode_steps"] == len(want_ids)


def test_chat_uses_the_models_template(server: Server, plain: Session) -> None:
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Who made the light?"}]
    r = server.client.chat.completions.create(model="deepseek-v3-mini", messages=messages, max_tokens=TOKENS,
                                              temperature=0)
    tok: Tokenizer = plain.tokenizer
    text = render_chat(tok.chat_template, messages, tok)
    assert text == "<｜begin▁of▁sentence｜>Answer briefly.<｜User｜>Who made the light?<｜Assistant｜>"
    ids = tok.encode(text, add_bos=False)
    assert r.choices[0].message.content == _plain_text(plain, ids) and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.object == "chat.completion"
    chunks = list(server.client.chat.completions.create(model="deepseek-v3-mini", messages=messages,
                                                        max_tokens=TOKENS, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_stop_strings_and_echo(server: Server, plain: Session) -> None:
    full = _plain_text(plain, plain.tokenizer.encode(PROMPTS[0]))
    stop = full[5:8]
    assert stop.strip()
    r = server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[0], max_tokens=TOKENS,
                                         temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop  # vLLM's: what ended it
    for stream in (False, True):  # vLLM's include_stop_str_in_output: the text ends with it
        r = server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[0], max_tokens=TOKENS,
                                             temperature=0, stop=[stop], stream=stream,
                                             extra_body={"include_stop_str_in_output": True})
        text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert text == full[: full.index(stop) + len(stop)], stream
    r = server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[0], max_tokens=TOKENS,
                                         temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[0] + full and r.choices[0].model_extra["stop_reason"] is None
    chunks = list(server.client.chat.completions.create(  # every token stops it: the first one
        model="deepseek-v3-mini", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=TOKENS, temperature=0,
        stream=True, extra_body={"stop_token_ids": list(range(plain.tokenizer.vocab_size))}))
    ends = [(c.choices[0].finish_reason, c.choices[0].model_extra.get("stop_reason", "absent")) for c in chunks]
    assert ends[-1][0] == "stop" and isinstance(ends[-1][1], int) and all(e == (None, "absent") for e in ends[:-1])


def test_n_choices_with_a_seed_repeat_and_differ(server: Server, plain: Session) -> None:
    kw = dict(model="deepseek-v3-mini", prompt=PROMPTS[1], max_tokens=TOKENS, temperature=1.0, n=3, seed=7)
    a, b = server.client.completions.create(**kw), server.client.completions.create(**kw)
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices] and [c.index for c in a.choices] == [0, 1, 2]
    assert len(set(texts)) > 1  # choice i samples with seed + i
    # one executor request with n = 3 (the prompt computed once): choice i is the request seeded 7 + i, and what
    # plain decoding (k = 0) samples with that seed, the server drafting 3
    assert texts == [_plain_text_of(plain, PROMPTS[1], 7 + i) for i in range(3)]
    assert a.usage.completion_tokens == 3 * TOKENS and a.usage.prompt_tokens == len(plain.tokenizer.encode(PROMPTS[1]))


def _plain_text_of(session: Session, prompt: str, seed: int) -> str:
    """A seeded sampled request decoded plainly: what one choice of the server's gives at any draft length."""
    params = SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=seed)
    return session.executor.submit(session.tokenizer.encode(prompt), params).result().text


def test_best_of_returns_the_n_most_likely_candidates(server: Server, plain: Session) -> None:
    r = server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[2], max_tokens=TOKENS,
                                         temperature=1.0, n=2, best_of=4, seed=3)
    ids = plain.tokenizer.encode(PROMPTS[2])
    candidates = [plain.executor.submit(ids, SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=3 + i,
                                                            logprobs=0)).result() for i in range(4)]
    best = sorted(candidates, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.text for c in r.choices] == [c.text for c in best] and [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].logprobs is None and r.usage.completion_tokens == 2 * TOKENS


def test_concurrent_requests_equal_sequential(server: Server, plain: Session) -> None:
    prompts = [p + suffix for p in PROMPTS for suffix in ("", " and", " the")]
    expected = [_plain_text(plain, plain.tokenizer.encode(p)) for p in prompts]

    def one(p: str) -> str:
        return server.client.completions.create(model="deepseek-v3-mini", prompt=p, max_tokens=TOKENS,
                                                temperature=0).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(one, prompts)) == expected


def test_penalties_with_mtp_equal_plain_decoding(server: Server, plain: Session) -> None:
    """Penalties and min_tokens through the server (k = 3) give the Session's plain (k = 0) output token for token."""
    kw = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3, min_tokens=TOKENS)
    for prompt in PROMPTS:
        r = server.client.completions.create(model="deepseek-v3-mini", prompt=prompt, max_tokens=TOKENS, temperature=0,
                                             extra_body={"repetition_penalty": kw["repetition_penalty"],
                                                         "min_tokens": kw["min_tokens"]},
                                             presence_penalty=kw["presence_penalty"],
                                             frequency_penalty=kw["frequency_penalty"])
        expected = plain.executor.submit(plain.tokenizer.encode(prompt), SamplingParams(max_tokens=TOKENS, **kw)).result()
        assert r.choices[0].text == expected.text and r.usage.completion_tokens == TOKENS
        assert expected.text != _plain_text(plain, plain.tokenizer.encode(prompt))  # the penalties changed the text


def test_tokenize_and_detokenize_as_vllm(server: Server, plain: Session) -> None:
    """vLLM's /tokenize (a prompt, with or without the special tokens the tokenizer adds, or chat messages as
    /v1/chat/completions renders them: its usage counts the same tokens) and /detokenize."""
    tok = plain.tokenizer
    status, body = server.post("/tokenize", {"prompt": PROMPTS[0], "return_token_strs": True})
    ids = tok.encode(PROMPTS[0])
    assert status == 200 and body == {"count": len(ids), "max_model_len": 2048, "tokens": ids,
                                      "token_strs": tok.token_strings(ids)}
    status, body = server.post("/tokenize", {"model": "deepseek-v3-mini", "prompt": PROMPTS[0],
                                             "add_special_tokens": False})
    assert body["tokens"] == tok.encode(PROMPTS[0], add_bos=False) != ids and body["token_strs"] is None
    messages = [{"role": "user", "content": PROMPTS[0]}]
    status, body = server.post("/tokenize", {"messages": messages})
    chat = server.client.chat.completions.create(model="deepseek-v3-mini", messages=messages, max_tokens=1)
    assert status == 200 and body["count"] == chat.usage.prompt_tokens
    assert body["tokens"] == tok.encode(render_chat(tok.chat_template, messages, tok), add_bos=False)
    status, body = server.post("/detokenize", {"tokens": ids})
    assert (status, body) == (200, {"prompt": tok.decode(ids, skip_special_tokens=False)})
    for path, request, param, message in (
            ("/detokenize", {"tokens": [5000]}, "tokens", "tokens must hold token ids in [0, 4096), got [5000]"),
            ("/detokenize", {}, "tokens", "tokens is required"),
            ("/tokenize", {"prompt": "x", "max_tokens": 3}, "max_tokens",
             "Unrecognized request argument supplied: max_tokens"),
            ("/tokenize", {"messages": messages, "add_special_tokens": True}, "add_special_tokens",
             "add_special_tokens true is not supported with messages; it takes null or false (the chat template places "
             "the special tokens)"),
            ("/tokenize", {"prompt": 5}, "prompt", "prompt must be a string, got int")):
        status, body = server.post(path, request)
        assert (status, body["error"]["param"], body["error"]["message"]) == (400, param, message)
    status, body = server.post("/tokenize", {"model": "other", "prompt": "x"})
    assert (status, body["error"]["code"]) == (404, "model_not_found")


def test_logit_bias_with_mtp_equals_plain_decoding(server: Server, plain: Session) -> None:
    """OpenAI's logit_bias (string keys) through completions and chat (k = 3) gives the Session's plain (k = 0) output
    with the same biases, which differs from the output without them; {} is no bias."""
    ids = plain.tokenizer.encode(PROMPTS[1])
    free = plain.executor.submit(ids, SamplingParams(max_tokens=TOKENS)).result()
    bias = {free.token_ids[0]: -100.0, free.token_ids[2]: -3.5, 77: 2.0}
    want = plain.executor.submit(ids, SamplingParams(max_tokens=TOKENS, logit_bias=bias)).result()
    assert want.token_ids != free.token_ids and free.token_ids[0] not in want.token_ids
    r = server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[1], max_tokens=TOKENS, temperature=0,
                                         logit_bias={str(t): v for t, v in bias.items()})
    assert r.choices[0].text == want.text
    r = server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[1], max_tokens=TOKENS, temperature=0,
                                         logit_bias={})
    assert r.choices[0].text == free.text
    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat_ids = plain.tokenizer.encode(render_chat(plain.tokenizer.chat_template, messages, plain.tokenizer), add_bos=False)
    chat_bias = {plain.executor.submit(chat_ids, SamplingParams(max_tokens=1)).result().token_ids[0]: -100}
    want = plain.executor.submit(chat_ids, SamplingParams(max_tokens=TOKENS, logit_bias=chat_bias)).result()
    r = server.client.chat.completions.create(model="deepseek-v3-mini", messages=messages, max_tokens=TOKENS,
                                              temperature=0, logit_bias={str(t): v for t, v in chat_bias.items()})
    assert r.choices[0].message.content == want.text


def test_logprobs_equal_plain_decodings(server: Server, plain: Session) -> None:
    """Completions' and chat's logprobs (k = 3, from the verification forward) are plain decoding's, within 1e-5,
    in OpenAI's shapes; streamed chunks carry the same values as the whole response."""
    ids = plain.tokenizer.encode(PROMPTS[0])
    expected = plain.executor.submit(ids, SamplingParams(max_tokens=TOKENS, logprobs=3)).result()
    r = server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0,
                                         logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(expected.token_ids) == len(lp.tokens) == len(lp.top_logprobs)
    assert all(abs(a - b.logprob) < 1e-5 for a, b in zip(lp.token_logprobs, expected.logprobs))
    assert all(len(top) == 3 and abs(max(top.values()) - b.top[0][1]) < 1e-5
               for top, b in zip(lp.top_logprobs, expected.logprobs))
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]

    messages = [{"role": "user", "content": "Who made the light?"}]
    r = server.client.chat.completions.create(model="deepseek-v3-mini", messages=messages, max_tokens=TOKENS,
                                              temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert b"".join(bytes(c.bytes) for c in content).decode() == r.choices[0].message.content
    chunks = list(server.client.chat.completions.create(model="deepseek-v3-mini", messages=messages, max_tokens=TOKENS,
                                                        temperature=0, logprobs=True, top_logprobs=2, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_echo_with_logprobs_scores_the_prompt(server: Server, plain: Session) -> None:
    """echo with logprobs (lm-eval's log-likelihood request) gives the prompt's tokens' logprobs (None for the first)
    before the output's; max_tokens 0 with echo returns the prompt alone, with no completion tokens."""
    ids = plain.tokenizer.encode(PROMPTS[1])
    want = plain.executor.submit(ids, SamplingParams(max_tokens=4, logprobs=2, prompt_logprobs=2)).result()
    r = server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[1], max_tokens=4, temperature=0,
                                         echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPTS[1] + want.text
    assert len(lp.tokens) == len(ids) + len(want.token_ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    expected = [x.logprob for x in want.prompt_logprobs[1:]] + [x.logprob for x in want.logprobs]
    assert all(abs(a - b) < 1e-5 for a, b in zip(lp.token_logprobs[1:], expected, strict=True))
    scored = server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[1], max_tokens=0, echo=True,
                                              logprobs=0)
    assert scored.choices[0].text == PROMPTS[1] and scored.choices[0].finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]
    streamed = list(server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[1], max_tokens=4,
                                                     temperature=0, echo=True, logprobs=2, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert [x for c in streamed if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs] == \
        lp.token_logprobs


def test_prompt_logprobs_a_request_may_ask_are_bounded(server: Server) -> None:
    """40 prompts of 1000 ids with prompt_logprobs 20 (a 165 KB body) made a 57 MB response and took the server from
    476 to 1267 MB resident: the prompt's log-probabilities cost no generation, so they are bounded per request."""
    from serving.openai_server.protocol import MAX_PROMPT_LOGPROBS

    prompts = [[5 + i % 50] * 1000 for i in range(13)]  # 13000 tokens
    for extra, field, per, asked in (({"prompt_logprobs": 20}, "prompt_logprobs", "", 273000),
                                     ({"echo": True, "logprobs": 9, "n": 3}, "logprobs", " x 3 choices each", 390000),
                                     ({"prompt_logprobs": 2, "n": 7}, "prompt_logprobs", " x 7 choices each", 273000),
                                     # each choice carries both: counted once, the response held twice the bound
                                     ({"prompt_logprobs": 4, "echo": True, "logprobs": 4, "n": 3},
                                      "prompt_logprobs 4 and logprobs", " x 3 choices each", 390000)):
        assert asked > MAX_PROMPT_LOGPROBS
        status, answer = server.post("/v1/completions", {"prompt": prompts, "max_tokens": 1, **extra})
        alternatives = extra["logprobs"] if "echo" in extra else extra["prompt_logprobs"]
        assert (status, answer["error"]["param"], answer["error"]["message"]) == (400, field.split()[0], (
            f"{field} {alternatives} over 13000 prompt tokens{per} asks {asked} log-probabilities (each token's and "
            f"its alternatives'); at most {MAX_PROMPT_LOGPROBS} a request: send fewer or shorter prompts a request, "
            "or fewer alternatives")), answer


def test_vllms_prompt_logprobs_and_tokens_as_ids(server: Server, plain: Session) -> None:
    """vLLM's prompt_logprobs extra: each prompt token's logprob (None for the first) under the target model, with
    its rank and the N most likely, by token id, on each completions choice and once on a chat response; with echo,
    the echoed top_logprobs keep their own N. return_tokens_as_token_ids names logprobs' tokens "token_id:<id>"."""
    ids = plain.tokenizer.encode(PROMPTS[1])
    want = plain.executor.submit(ids, SamplingParams(max_tokens=4, logprobs=2, prompt_logprobs=3)).result()
    r = server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[1], max_tokens=4, temperature=1.0,
                                         seed=1, n=2, logprobs=2, echo=True, extra_body={"prompt_logprobs": 3})
    for c in r.choices:
        got = c.model_extra["prompt_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        for position, (token, entries, lp) in enumerate(zip(ids[1:], got[1:], want.prompt_logprobs[1:]), 1):
            own = entries[str(token)]
            assert abs(own["logprob"] - lp.logprob) < 1e-5 and own["rank"] == lp.rank, position
            assert own["decoded_token"] == plain.tokenizer.decode([token]) or "\ufffd" in own["decoded_token"]
            top = [i for i, _ in lp.top]
            assert len(top) == 3 and len(entries) == 3 + (token not in top) and next(iter(entries)) == str(token)
            assert all(entries[str(i)]["rank"] == rank and abs(entries[str(i)]["logprob"] - v) < 1e-5
                       for rank, (i, v) in enumerate(lp.top, 1))
        echoed = c.logprobs.top_logprobs[1:len(ids)]
        assert all(len(top) <= 3 for top in echoed) and any(len(top) == 3 for top in echoed)  # logprobs 2 (+ own)
    messages = [{"role": "user", "content": "Who made the light?"}]
    chat = server.client.chat.completions.create(model="deepseek-v3-mini", messages=messages, max_tokens=4,
                                                 temperature=0, extra_body={"prompt_logprobs": 0,
                                                                            "return_tokens_as_token_ids": True})
    got = chat.model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == chat.usage.prompt_tokens and all(len(e) == 1 for e in got[1:])
    assert not any(e["decoded_token"].startswith("token_id:") for entries in got[1:] for e in entries.values())
    assert "prompt_logprobs" not in chat.choices[0].model_extra

    r = server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[1], max_tokens=4, temperature=0,
                                         logprobs=1, extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in want.token_ids]
    assert all(tok in top and all(k.startswith("token_id:") for k in top) for tok, top in zip(lp.tokens,
                                                                                             lp.top_logprobs))
    assert lp.text_offset == server.client.completions.create(
        model="deepseek-v3-mini", prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=1).choices[0].logprobs.text_offset
    chunks = list(server.client.chat.completions.create(
        model="deepseek-v3-mini", messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=1,
        stream=True, extra_body={"return_tokens_as_token_ids": True}))
    content = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert len(content) == 4 and all(c.token.startswith("token_id:") and c.top_logprobs[0].token.startswith("token_id:")
                                     for c in content)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert b"".join(bytes(c.bytes) for c in content).decode() == text  # bytes stay the token's own


def test_vllms_return_token_ids(server: Server, plain: Session) -> None:
    """vLLM's return_token_ids: the prompt's ids (each completions choice's, the chat response's) and each choice's
    output ids; streamed, the prompt's with a choice's first chunk (chat: the first chunk) and each chunk's new ids."""
    ids = plain.tokenizer.encode(PROMPTS[0])
    want = plain.executor.submit(ids, SamplingParams(max_tokens=TOKENS)).result().token_ids
    extra = {"return_token_ids": True}
    r = server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0,
                                         extra_body=extra)
    assert (r.choices[0].model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]) == (ids, want)
    chunks = [c.model_dump() for c in server.client.completions.create(
        model="deepseek-v3-mini", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0, stream=True, extra_body=extra)]
    assert [c["choices"][0].get("prompt_token_ids") for c in chunks] == [ids] + [None] * (len(chunks) - 1)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want
    echoed = [c.model_dump() for c in server.client.completions.create(
        model="deepseek-v3-mini", prompt=PROMPTS[0], max_tokens=4, temperature=0, stream=True, echo=True,
        extra_body={**extra, "prompt_logprobs": 0})]  # 0 streamed: taken, as vLLM takes it, and none sent
    assert echoed[0]["choices"][0]["text"] == PROMPTS[0] and echoed[0]["choices"][0]["token_ids"] == []
    assert all("token_ids" in c["choices"][0] and "prompt_logprobs" not in c["choices"][0] for c in echoed)
    scored = server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[0], max_tokens=0, echo=True,
                                              extra_body=extra)
    assert (scored.choices[0].model_extra["prompt_token_ids"], scored.choices[0].model_extra["token_ids"]) == (ids, [])

    messages = [{"role": "user", "content": "Who made the light?"}]
    chat = server.client.chat.completions.create(model="deepseek-v3-mini", messages=messages, max_tokens=TOKENS,
                                                 temperature=0, extra_body=extra)
    prompt = chat.model_extra["prompt_token_ids"]
    assert len(prompt) == chat.usage.prompt_tokens and "prompt_token_ids" not in chat.choices[0].model_extra
    answer = chat.choices[0].model_extra["token_ids"]
    assert plain.tokenizer.decode(answer) == chat.choices[0].message.content and len(answer) == \
        chat.usage.completion_tokens
    chunks = [c.model_dump() for c in server.client.chat.completions.create(
        model="deepseek-v3-mini", messages=messages, max_tokens=TOKENS, temperature=0, stream=True, extra_body=extra)]
    assert chunks[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in chunks[1:])
    assert "token_ids" not in chunks[0]["choices"][0]  # the role chunk, as vLLM's
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == answer


@pytest.mark.parametrize("body, message", [
    ({"prompt_logprobs": 1, "stream": True},
     "prompt_logprobs are not streamed (they come with the whole response); send stream: false"),
    ({"prompt_logprobs": -1}, "prompt_logprobs -1 (every token of the vocabulary) is not served; at most 20"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be an integer in [0, 20], got 21"),
    ({"prompt_logprobs": True}, "prompt_logprobs must be an integer, got True"),
    ({"return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids must be true or false, got 'yes'"),
    ({"return_token_ids": 1}, "return_token_ids must be true or false, got 1")])
def test_vllm_logprob_extras_refused_naming_them(server: Server, body: dict, message: str) -> None:
    for path, request in (("/v1/completions", {"prompt": "hi"}),
                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        status, answer = server.post(path, {"model": "deepseek-v3-mini", "max_tokens": 2, **request, **body})
        param = next(iter(body))
        assert (status, answer["error"]["message"], answer["error"]["param"]) == (400, message, param), answer


def test_completions_top_logprobs_always_hold_the_chosen_token(server: Server) -> None:
    """As OpenAI documents (up to logprobs + 1 entries): a sampled token outside the top alternatives is there too;
    logprobs 0 gives the chosen token's entry."""
    r = server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=1.5,
                                         seed=3, logprobs=1)
    lp = r.choices[0].logprobs
    assert all(tok in top and top[tok] == v for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert any(len(top) == 2 for top in lp.top_logprobs)  # temperature 1.5 picks outside the most likely sometimes
    r = server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                         logprobs=0)
    lp = r.choices[0].logprobs
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]


def test_what_openais_and_vllms_clients_send_is_taken(server: Server, plain: Session) -> None:
    """An assistant message as the openai client returns it (null refusal, tool_calls, audio ...) sent back in the
    next turn, parameters sent as null, OpenAI's bookkeeping parameters and vLLM's extras at their defaults: all
    taken, the output unchanged. Content parts are joined by lines, as vLLM joins them; a message's name reaches the
    template."""
    base = [{"role": "user", "content": "Who made the light?"}]
    first = server.client.chat.completions.create(model="deepseek-v3-mini", messages=base, max_tokens=4,
                                                  temperature=0)
    turn = [*base, first.choices[0].message.model_dump(), {"role": "user", "content": "And then?"}]
    assert turn[1]["refusal"] is None and "tool_calls" in turn[1]
    plain_turn = [*base, {"role": "assistant", "content": first.choices[0].message.content}, turn[2]]
    kw = dict(model="deepseek-v3-mini", max_tokens=TOKENS, temperature=0)
    want = server.client.chat.completions.create(messages=plain_turn, **kw).choices[0].message.content
    extras = {"store": None, "metadata": {"run": "1"}, "min_p": 0, "skip_special_tokens": True, "user": "u",
              "include_stop_str_in_output": False, "chat_template_kwargs": {}, "service_tier": "auto",
              "reasoning_effort": None, "max_completion_tokens": None, "guided_decoding_backend": "xgrammar"}
    got = server.client.chat.completions.create(messages=turn, extra_body=extras, **kw)
    assert got.choices[0].message.content == want
    parts = [{"role": "user", "content": [{"type": "text", "text": "Who made"}, {"type": "text", "text": "the light?"}]}]
    joined = [{"role": "user", "content": "Who made\nthe light?"}]
    assert server.client.chat.completions.create(messages=parts, **kw).choices[0].message.content == \
        server.client.chat.completions.create(messages=joined, **kw).choices[0].message.content
    tok = plain.tokenizer
    named = "{% for m in messages %}{{ m.name }}:{{ m.content }}{% endfor %}{{ greeting }}"
    assert render_chat(named, [{"role": "user", "content": "hi", "name": "ann"}], tok,
                       variables={"greeting": "!"}) == "ann:hi!"
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(RequestError, match=r"^chat_template_kwargs: the model's chat template fails on them: "
                                           r"TypeError: "):  # a value of the wrong kind is the request's fault
        render_chat("{% if greeting is defined %}{{ greeting + 1 }}{% endif %}", hi, tok, variables={"greeting": "!"})
    with pytest.raises(ChatTemplateFault, match=r"^the model's chat template cannot be rendered: TypeError: "):
        render_chat("{{ 1 + 'a' }}", hi, tok, variables={"greeting": "!"})  # the template's own: the model's (500)


def test_bad_words_and_a_requests_own_draft_length(server: Server, plain: Session) -> None:
    """vLLM's bad_words (each word's single token at the start of the text and after a space, banned) and the
    request's num_draft_tokens (at most that many drafts a step; 0: plain decoding) keep the output plain decoding's
    with those bans."""
    tok = plain.tokenizer
    ids = tok.encode(PROMPTS[2])
    banned = tuple(t for w in ("of", "the") for t in (tok.encode(w, add_bos=False) + tok.encode(" " + w, add_bos=False)))
    want = plain.executor.submit(ids, SamplingParams(max_tokens=TOKENS, bad_token_ids=banned)).result()
    free = plain.executor.submit(ids, SamplingParams(max_tokens=TOKENS)).result()
    assert set(free.token_ids) & set(banned)  # the bans change this output
    for k in (None, 0, 1):
        r = server.client.completions.create(model="deepseek-v3-mini", prompt=PROMPTS[2], max_tokens=TOKENS,
                                             temperature=0, extra_body={"bad_words": ["of", "the"],
                                                                        **({} if k is None else {"num_draft_tokens": k})})
        assert r.choices[0].text == want.text, k
        spec = r.usage.model_extra["speculative_decoding"]
        if k is not None:
            assert spec["total_draft_tokens"] <= k * spec["decode_steps"], (k, spec)
    status, body = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "bad_words": ["light"]})
    assert status == 200, body  # one token bare, two after a space: vLLM bans the bare one alone, so does this
    status, body = server.post("/v1/completions", {"prompt": "x", "bad_words": ["fibonacci"]})
    assert (status, body["error"]["param"]) == (400, "bad_words") and "tokens; this server bans single-token words" \
        in body["error"]["message"]
    status, body = server.post("/v1/completions", {"prompt": "x", "num_draft_tokens": 9})
    assert (status, body["error"]["param"]) == (400, "num_draft_tokens"), body


def test_continuous_usage_stats_and_http_errors_in_openais_shape(server: Server) -> None:
    chunks = list(server.client.completions.create(
        model="deepseek-v3-mini", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and counts[-1] == TOKENS
    assert counts[0] > 0 and len(set(counts)) > 1
    chat = list(server.client.chat.completions.create(
        model="deepseek-v3-mini", messages=[{"role": "user", "content": "Who made the light?"}], max_tokens=8,
        temperature=0, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chat[0].usage.completion_tokens == 0 and all(c.usage is not None for c in chat)  # the role chunk too
    # as vLLM counts: each chunk its own choice's prompt and tokens so far (the sums over the request before)
    prompts = [server.client.completions.create(model="deepseek-v3-mini", prompt=p, max_tokens=1,
                                                extra_body={"return_token_ids": True})
               .choices[0].model_extra["prompt_token_ids"] for p in PROMPTS[:2]]
    chunks = list(server.client.completions.create(
        model="deepseek-v3-mini", prompt=PROMPTS[:2], max_tokens=6, temperature=1.0, seed=2, n=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    by_choice: dict[int, list] = {}
    for c in chunks[:-1]:
        by_choice.setdefault(c.choices[0].index, []).append(c.usage)
    assert sorted(by_choice) == [0, 1, 2, 3] and len(prompts[0]) != len(prompts[1])
    for index, usages in by_choice.items():
        assert {u.prompt_tokens for u in usages} == {len(prompts[index // 2])}
        counts = [u.completion_tokens for u in usages]
        assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    chat = list(server.client.chat.completions.create(
        model="deepseek-v3-mini", messages=[{"role": "user", "content": "Who made the light?"}], max_tokens=4,
        temperature=1.0, n=2, stream=True))
    roles = [(c.choices[0].index, c.choices[0].delta.role) for c in chat if c.choices[0].delta.role]
    assert roles == [(0, "assistant"), (1, "assistant")]  # a first chunk per choice, as vLLM and OpenAI send
    status, body = server.post("/v1/nowhere", {})
    assert (status, body) == (404, {"error": {"message": "Not Found", "type": "invalid_request_error", "param": None,
                                              "code": "404"}})
    req = urllib.request.Request(server.base + "/health", method="HEAD")
    assert urllib.request.urlopen(req, timeout=10).status == 200


def test_without_a_generation_prompt_the_answer_carries_the_last_role(server: Server) -> None:
    """As vLLM's: with add_generation_prompt false the answer follows the last message and carries its role."""
    turns = [{"role": "user", "content": "Who made the light?"}, {"role": "assistant", "content": "In the"}]
    answer = server.client.chat.completions.create(model="deepseek-v3-mini", messages=turns, max_tokens=2,
                                                   extra_body={"add_generation_prompt": False})
    assert answer.choices[0].message.role == "assistant"
    turns[-1] = {"role": "user", "content": "And the"}
    for stream in (False, True):
        answer = server.client.chat.completions.create(model="deepseek-v3-mini", messages=turns, max_tokens=2,
                                                       stream=stream, extra_body={"add_generation_prompt": False})
        first = next(iter(answer)).choices[0].delta if stream else answer.choices[0].message
        assert first.role == "user"


BAD = [
    ("/v1/completions", {"model": "deepseek-v3-mini", "prompt": "x", "max_tokens": 0}, "max_tokens",
     "max_tokens must be at least 1 (0 returns the prompt alone: it needs echo: true)"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "echo": True, "stream": True}, "max_tokens",
     "max_tokens 0 (the prompt alone, as for scoring it) is not streamed; send stream: false"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "echo": True, "min_tokens": 2}, "min_tokens",
     "min_tokens must be an integer in [0, max_tokens (0)], got 2"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens",
     "max_tokens must be an integer in [0, 2147483647], got -1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens", "max_tokens must be an integer, got True"),
    ("/v1/completions", {"prompt": "x", "max_token": 3}, "max_token", "Unrecognized request argument supplied: max_token"),
    ("/v1/completions", {"prompt": "x", **{f"k{i:02d}" + "x" * 100: 1 for i in range(20)}}, "k00" + "x" * 61,
     "Unrecognized request argument supplied: " + ", ".join(f"k{i:02d}" + "x" * 61 for i in range(8)) + " and 12 more"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", "temperature must be >= 0.0, got -1"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", "top_p must be in (0.0, 1.0], got 0"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", "n must be an integer in [1, 128], got 0"),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 1}, "best_of",
     "best_of must be None or an integer >= n (2), got 1"),
    ("/v1/completions", {"prompt": "x", "n": 2, "temperature": 0}, "n",
     "n must be 1 when using greedy sampling (temperature 0), got 2"),
    ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, "best_of",
     "best_of 2 > n 1 cannot be streamed: the best are known once all have finished; send stream: false or "
     "best_of = n"),
    ("/v1/completions", {"prompt": "x", "n": 100}, "n", "n 100 exceeds this executor's max_batch_size 8: the "
     "request's sequences run in one batch"),
    ("/v1/completions", {"prompt": [[]]}, "prompt", "prompt must not be empty"),
    ("/v1/completions", {"max_tokens": 3}, "prompt", "prompt is required"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt", "prompt must hold token ids in [0, 4096), got [99999]"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens",
     "max_tokens 5000 with a 2-token prompt exceeds max_seq_len 2048; at most 2046"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop", "stop must be a non-empty string or a list of them, got ['']"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty",
     "presence_penalty must be in [-2.0, 2.0], got 3"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty",
     "repetition_penalty must be in [0.01, 100.0], got 0"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens",
     "min_tokens must be an integer in [0, max_tokens (4)], got 5"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "logprobs must be an integer in [0, 20], got 21"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p", "min_p must be in [0.0, 1.0], got 1.5"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "store": True}, "store",
     "store True is not supported by this server; it takes null or false (nothing is stored)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {
        "namespace": 1}}, "chat_template_kwargs", "chat_template_kwargs must be an object of the template's own "
     f"variables (not {', '.join(sorted(RESERVED_NAMES))}), got {{'namespace': 1}}"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
     "messages", "messages[0].tool_calls must be a list of {\"id\", \"type\": \"function\", \"function\": {\"name\", "
     "\"arguments\"}}, got {'id': '1'}"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x", "audio": {"id": "1"}}]},
     "messages", "messages[0].audio must be null or empty: this server does no audio, annotations or deprecated "
     "function calling"),
    ("/v1/chat/completions", {"model": 5, "messages": [{"role": "user", "content": "x"}]}, "model",
     "model must be a string, got int"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias",
     "logit_bias keys must be token ids (non-negative integers), got 'x'"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1, "4096": 1}}, "logit_bias",
     "logit_bias keys must be integer token ids in [0, 4096), got [4096]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": -100.5}},
     "logit_bias", "logit_bias[5] must be a number in [-100, 100], got -100.5"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": True}}, "logit_bias",
     "logit_bias[5] must be a number in [-100, 100], got True"),
    ("/v1/completions", {"prompt": "x", "logit_bias": [[5, 1]]}, "logit_bias",
     "logit_bias must be an object mapping token ids to numbers, got [[5, 1]]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "top_logprobs needs logprobs: true"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
     "stream_options is only allowed when stream is true"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage", "stream_options.include_usage must be true or false, got 'yes'"),
    ("/v1/chat/completions", {"messages": []}, "messages", "messages must be a non-empty list of {role, content}"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages",
     "messages[0].tool_call_id (the id of the call it answers) is required on a tool message, and only there"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}]}, "tools",  # the shipped model's template has no tools
     "tools cannot reach this model: its chat template does not use them (it would drop them without a word); "
     "give dsv3-serve a --chat_template that renders `tools`"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                              "max_completion_tokens": 4}, "max_completion_tokens",
     "max_completion_tokens and max_tokens differ; send one"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": True,
                              "max_completion_tokens": 1}, "max_tokens", "max_tokens must be an integer, got True"),
    ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": "x"}]}, "messages",
     "messages[0].role must be one of system, developer, user, assistant, tool, got ['user']"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     "messages", "messages[0].content parts must be {\"type\": \"text\", \"text\": ...}; this server takes text only"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello world " * 1100}]}, "messages",
     "messages come to 4423 tokens with the chat template; max_seq_len is 2048"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2047},
     "max_completion_tokens",
     "max_completion_tokens 2047 with messages of 24 tokens with the chat template exceeds max_seq_len 2048; "
     "at most 2024"),
    ("/v1/completions", {"prompt": ["x"] * 2049, "max_tokens": 1}, "prompt",
     "prompt holds 2049 prompts; at most 2048 a request"),
    ("/v1/completions", {"prompt": [[7]] * 300, "max_tokens": 1, "n": 8, "temperature": 1}, "n",
     "300 prompts x n 8 = 2400 sequences; at most 2048 a request"),
    ("/v1/completions", {"prompt": [[7]] * 300, "max_tokens": 1, "n": 2, "best_of": 7, "temperature": 1}, "best_of",
     "300 prompts x best_of 7 = 2100 sequences; at most 2048 a request"),
    ("/v1/completions", {"prompt": "x", "stop": [str(i) for i in range(65)]}, "stop", "stop holds 65 strings; at most 64"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b" * 1025]}, "stop", "stop[1] is 1025 characters; at most 1024"),
    ("/v1/completions", {"prompt": "ab\ud800"}, "prompt",
     "prompt must be Unicode text; it has a lone surrogate at character 2"),
    ("/v1/completions", {"prompt": "x", "stop": ["ok", "a\ud800"]}, "stop",
     "stop[1] must be Unicode text; it has a lone surrogate at character 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages[0].content",
     "messages[0].content must be Unicode text; it has a lone surrogate at character 0"),
]


@pytest.mark.parametrize("path, body, param, message", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_name_the_parameter(server: Server, path: str, body: dict, param: str, message: str) -> None:
    status, answer = server.post(path, body)
    assert (status, answer) == (400, {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                                "code": None}})


def test_malformed_and_oversized_bodies_are_refused(server: Server) -> None:
    status, answer = server.post("/v1/completions", b"{not json")
    assert status == 400 and answer["error"]["message"].startswith("the request body must be JSON: ")
    nested = b'{"prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}"  # deeper than the parser recurses
    status, answer = server.post("/v1/completions", nested)
    assert status == 400 and answer["error"]["message"].startswith("the request body must be JSON: ")
    status, answer = server.post("/v1/completions", b"[1, 2]")
    assert (status, answer["error"]["message"]) == (400, "the request body must be a JSON object, got list")
    huge = {"prompt": "a" * (2048 * 64 + 10)}  # more bytes than 2048 tokens can hold
    status, answer = server.post("/v1/completions", huge)
    assert status == 400 and answer["error"]["param"] == "prompt"
    assert answer["error"]["message"].startswith("prompt is longer than the ")
    # a body declared larger than any request can be is refused before it is read
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 50000000\r\n\r\n{")
    response = http.client.HTTPResponse(sock)
    response.begin()
    assert response.status == 413
    assert json.loads(response.read())["error"]["message"] == "the request body is larger than 401408 bytes"
    sock.close()
    assert urllib.request.urlopen(server.base + "/health", timeout=10).status == 200


def test_a_client_that_leaves_mid_body_costs_one_log_line(server: Server) -> None:
    """A client that closes its connection halfway through a body logged two full tracebacks (~120 lines, free to
    send again and again); now one line, and the server serves on."""
    before = server.log.read_text().count("\n")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(0.2)
    assert urllib.request.urlopen(server.base + "/health", timeout=10).status == 200
    new = server.log.read_text().splitlines()[before:]
    assert "Traceback" not in "\n".join(new), new
    assert sum("the client disconnected before sending the whole body" in line for line in new) == 3, new


def test_a_deep_guide_is_served_not_a_crash(server: Server) -> None:
    """A JSON schema nested 3000 objects deep (about 100 KB of request) overflowed the thread stack llguidance compiled
    it on: the engine and the server died (SIGSEGV), nothing logged. Compiled on a deep stack, it is served; a GBNF
    grammar of more rules than are taken is refused (its conversion's time grows with their square)."""
    depth = 3000
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"]}
            for i in range(depth)} | {f"d{depth}": {"type": "string"}}
    schema = {"name": "deep", "schema": {"$defs": defs, "$ref": "#/$defs/d0"}}
    status, answer = server.post("/v1/completions", {"prompt": "x", "max_tokens": 12, "temperature": 0,
                                                     "response_format": {"type": "json_schema", "json_schema": schema}})
    assert status == 200 and answer["choices"][0]["text"] == '{"a": {"a": {"a":', answer
    rules = "root ::= r0\n" + "".join(f"r{i} ::= \"x\" r{i + 1} | \"y\"\n" for i in range(1001)) + "r1001 ::= \"z\"\n"
    status, answer = server.post("/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_grammar": rules})
    assert (status, answer["error"]["message"]) == (400, "guided_grammar has 1003 rules; at most 1000 are taken")
    assert urllib.request.urlopen(server.base + "/health", timeout=10).status == 200


def test_a_request_head_is_bounded(server: Server) -> None:
    """A header line that never ended grew without bound (httptools), the event loop parsing it again and again:
    every other client waited tens of seconds. h11 refuses a head past its bound."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 200_000)
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 400
    assert urllib.request.urlopen(server.base + "/health", timeout=10).status == 200


def test_a_body_that_never_arrives_times_out(monkeypatch) -> None:
    """A body trickled in for ever held its connection (and what it had sent) for ever."""
    import serving.openai_server.app as app
    from serving.openai_server.protocol import APIError

    class Trickle:
        headers = {"content-length": "100"}

        async def stream(self):
            yield b"{"
            await asyncio.sleep(3600)

    monkeypatch.setattr(app, "BODY_TIMEOUT_S", 0.2)
    with pytest.raises(APIError) as e:
        asyncio.run(app.OpenAIServer._body(types.SimpleNamespace(max_body_bytes=1000), Trickle()))
    assert (e.value.status, e.value.message) == (408, "the request body did not arrive within 0.2 s")


def test_a_guided_request_is_submitted_off_the_event_loop() -> None:
    """Submitting a guided request compiles its grammar (seconds of a large schema), which held every other request
    on the event loop; a request without a guide is submitted on it (no thread hand-off)."""
    import serving.openai_server.app as app
    from runtime.core.sampling_params import GuidedDecodingParams

    class Handle:
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    class Submits:
        threads: list[threading.Thread] = []
        guided_submitter = ThreadPoolExecutor(max_workers=1)
        handles = [Handle(), Handle()]
        slow = threading.Event()

        def _submit(self, g, chat):
            self.threads.append(threading.current_thread())
            self.slow.wait(10)
            return self.handles

    guided = types.SimpleNamespace(params=SamplingParams(guided_decoding=GuidedDecodingParams(regex="a+")))

    async def submit(g) -> threading.Thread:
        await app.OpenAIServer._submitted(Submits(), g, False)
        return threading.current_thread()

    Submits.slow.set()
    loop_thread = asyncio.run(submit(guided))
    assert Submits.threads[-1] is not loop_thread
    loop_thread = asyncio.run(submit(types.SimpleNamespace(params=SamplingParams())))
    assert Submits.threads[-1] is loop_thread

    async def client_leaves_while_compiling() -> None:  # its requests are cancelled once submitted
        Submits.slow.clear()
        task = asyncio.ensure_future(submit(guided))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not any(h.cancelled for h in Submits.handles)
        Submits.slow.set()
        await asyncio.sleep(0.2)

    asyncio.run(client_leaves_while_compiling())
    assert all(h.cancelled for h in Submits.handles)


def _streamed_events(server: Server, body: dict) -> list[dict]:
    req = urllib.request.Request(server.base + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    lines = urllib.request.urlopen(req, timeout=60).read().decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


@pytest.mark.parametrize("body", [
    {"prompt": PROMPTS[2], "max_tokens": 12, "stop": ["graph"]},  # text held back while a stop string may begin
    {"prompt": "x", "max_tokens": 20, "guided_regex": "😀🎉a"},  # characters split over byte tokens
], ids=["stop", "multibyte"])
def test_text_offsets_are_where_tokens_start_streamed_or_not(server: Server, body: dict) -> None:
    """`text_offset` counts the characters the tokens before each one complete: rising, within the text, and the same
    whether streamed (whose text may wait for a stop string or a character's last byte) or not."""
    body = {**body, "temperature": 0, "logprobs": 0}
    status, whole = server.post("/v1/completions", body)
    assert status == 200, whole
    text, offsets = whole["choices"][0]["text"], whole["choices"][0]["logprobs"]["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
    streamed = [o for e in _streamed_events(server, body) for c in e["choices"] if c.get("logprobs")
                for o in c["logprobs"]["text_offset"]]
    assert streamed == offsets
    if "guided_regex" in body:  # 😀 and 🎉 each start at the token that completes them: "a" starts at 2
        assert text == "😀🎉a" and offsets[-1] == 2 and offsets.count(0) > 1


def test_request_readers_take_what_they_read(shipped_model_dir: Path) -> None:
    """Both readers take the tokenizer and the bound on text; only chat_request takes max_seq_len (it refuses
    messages whose rendered prompt does not fit), bound by name as the server binds its template."""
    from serving.openai_server import protocol

    tokenizer = Tokenizer.from_dir(shipped_model_dir)
    assert protocol.completion_request({"prompt": "hi"}, tokenizer, 1 << 20).prompts == [tokenizer.encode("hi")]
    with pytest.raises(protocol.APIError) as e:
        protocol.chat_request({"messages": [{"role": "user", "content": "hi " * 20}]}, tokenizer, 1 << 20,
                              max_seq_len=8, chat_template=tokenizer.chat_template)
    assert e.value.param == "messages" and e.value.message.endswith("with the chat template; max_seq_len is 8")


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_text_chunk_is_the_whole_chunk_encoded(chat: bool, include_usage: bool) -> None:
    """A stream's chunks of new text alone are encoded from a template made once per choice: byte for byte what
    encoding the whole chunk gives, whatever the text (escapes, non-ASCII, the template's own mark) or the model's
    name (which comes before the text in the chunk)."""
    from serving.openai_server import protocol
    from serving.openai_server.app import _sse, _TextChunks

    g = protocol.Generation([[1, 2]], SamplingParams(n=2), stream=True, include_usage=include_usage)
    for model in ("deepseek-v3-mini", "m\0text\0", 'a "quoted" é model'):
        chunks = _TextChunks(g, model, chat)
        for index in (1, 0):
            for text in (" the", 'é\n"\\\u2028😀', "\0text\0", "\0"):
                whole = protocol.completion_object(g, model, [protocol.choice(index, text, None, chat, chunk=True)],
                                                   chat, chunk=True)
                assert chunks(index, text) == _sse(whole)


def test_a_grammar_that_fails_while_generating_is_a_400_naming_its_parameter() -> None:
    """The executor ends a request whose grammar fails while generating (tests/test_structured_output.py); the server
    answers that as the request's fault, naming the parameter its guide came from (and the field in the message, as
    the client wrote it: not the executor's guided_decoding.<kind>), and any other failure as 500."""
    from types import SimpleNamespace

    from serving.openai_server.app import _failure
    from serving.openai_server.protocol import Generation

    grammar = SimpleNamespace(error="guided_decoding.regex: the grammar failed while generating: lexer error",
                              finish_reason="error")
    for field in ("guided_regex", "response_format.json_schema.schema"):
        g = Generation([[1]], SamplingParams(), guide_field=field)
        e = _failure(g, grammar)
        assert (e.status, e.param, e.type, e.message) == (
            400, field.split(".")[0], "invalid_request_error",
            f"generation failed: {field}: the grammar failed while generating: lexer error")
    e = _failure(g, SimpleNamespace(error="executor stopped: KeyError", finish_reason="error"))
    assert (e.status, e.param, e.type) == (500, None, "server_error")


def test_a_multi_prompt_request_refused_midway_leaves_nothing_running(shipped_engine) -> None:
    """A completions request of several prompts submits one executor request per prompt; when a later one fails
    (here the third: the executor stopped, 503), those already submitted are cancelled, so neither the refused client
    nor its retry pays for them."""
    import threading

    from executor_util import assert_all_free, hold_inbox_until
    from runtime.executors.base import ExecutorConfig
    from runtime.executors.native import Executor
    from serving.openai_server.app import OpenAIServer
    from serving.openai_server.protocol import APIError, Generation

    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=0, speculation="off")) as ex:
        go = threading.Event()
        hold_inbox_until(ex, go)
        outputs: list[str | None] = []
        submit = ex.submit

        def third_refused(*args, **kw):
            if len(outputs) == 2:  # two submitted
                raise RuntimeError("executor is shut down")
            outputs.append(None)
            return submit(*args, on_output=lambda o: outputs.append(o.finish_reason), **kw)

        ex.submit = third_refused
        g = Generation([[1, 2, 3]] * 3, SamplingParams(max_tokens=50, ignore_eos=True))
        with pytest.raises(APIError) as e:
            OpenAIServer(ex, "m")._submit(g, chat=False)
        assert e.value.status == 503 and "executor is shut down" in e.value.message
        go.set()
        deadline = time.monotonic() + 30
        while len(outputs) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert outputs[2:] == ["cancelled", "cancelled"]
        assert_all_free(ex)


@pytest.mark.parametrize("template, error", [
    ("{% for i in range(10**9) %}{% endfor %}", "OverflowError"),  # past the sandbox's range limit
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{% for m in messages %}", "TemplateSyntaxError"),
])
def test_a_chat_template_that_cannot_render_is_the_models_fault(shipped_model_dir: Path, template: str,
                                                                 error: str) -> None:
    """Errors of the template itself (not its raise_exception on the messages) are the model's: ChatTemplateFault,
    which the server answers 500 (they escaped as raw exceptions, or were blamed on the request)."""
    tok = Tokenizer.from_dir(shipped_model_dir)
    with pytest.raises(ChatTemplateFault) as e:
        render_chat(template, [{"role": "user", "content": "hi"}], tok)
    assert str(e.value).startswith(f"the model's chat template cannot be rendered: {error}: ")


@pytest.mark.parametrize("template, what", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "loops over more than 1000000 range() items"),
    ("{{ 'x' * 1000000000 }}", "makes a sequence of more than 1000000 items with *"),
    ("{{ 2 ** 100000000 }}", "raises to a power above 1024 with **"),
    ("{{ messages | tojson(indent=100000000) }}", "indents JSON by more than 64 with tojson"),
])
def test_a_chat_templates_work_is_bounded(shipped_model_dir: Path, template: str, what: str) -> None:
    """Jinja's sandbox bounds each range() but not loops in loops, nor what `*` and `**` make: a model's template
    held a worker thread for good (eight such requests wedged dsv3-serve, and it no longer stopped on SIGINT), or
    took 3 GB. Past the bounds, the template is the model's fault, at once; ordinary templates render as before."""
    tok = Tokenizer.from_dir(shipped_model_dir)
    started = time.monotonic()
    with pytest.raises(ChatTemplateFault) as e:
        render_chat(template, [{"role": "user", "content": "hi"}], tok)
    assert str(e.value) == f"the model's chat template cannot be rendered: it {what}, past this server's bound"
    assert time.monotonic() - started < 10
    loops = "{% for i in range(1000) %}{% for j in range(900) %}{% endfor %}{% endfor %}{{ 'ab' * 3 }}{{ 2 ** 10 }}"
    assert render_chat(loops, [{"role": "user", "content": "hi"}], tok) == "ababab1024"


def test_slow_chat_templates_do_not_hold_health(shipped_model_dir: Path, tmp_path: Path) -> None:
    """Templates render on worker threads, and /health has a thread of its own: while slow ones render, as many as
    there are workers, /health is answered at once (a template's loops ran on the event loop and froze the whole
    server; then /health waited in the workers' queue behind the renders)."""
    model = tmp_path / "model"
    shutil.copytree(shipped_model_dir, model)
    (model / "chat_template.jinja").write_text(  # slow within the render bounds: ~1.5 s of string work
        "{% for i in range(240) %}{% set n = ('x' * 900000) | replace('x', 'yy') | length %}{% endfor %}"
        "{{ messages[0].content }}")
    server = Server(model, tmp_path / "serve.log")
    renders = min(32, (os.cpu_count() or 1) + 4) + 1  # one more than asyncio's default worker threads
    try:
        done: list[float] = []

        def chat(i: int) -> None:  # chat completions, and /tokenize, which renders messages the same way
            messages = [{"role": "user", "content": "hi"}]
            server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2}) if i % 2 else \
                server.post("/tokenize", {"messages": messages})
            done.append(time.monotonic())

        with ThreadPoolExecutor(renders) as pool:
            submitted = time.monotonic()
            pending = [pool.submit(chat, i) for i in range(renders)]
            time.sleep(0.5)
            asked = time.monotonic()
            assert urllib.request.urlopen(server.base + "/health", timeout=120).status == 200
            health = time.monotonic() - asked
            for p in pending:
                p.result(timeout=300)
        # with the renders on the event loop, or /health in their queue, /health came back only once the first
        # renders had finished: its wait was most of theirs. Compared with the renders' own time, not a clock
        first_render = min(done) - submitted
        assert first_render > 1.0 and health < first_render / 4, (health, first_render)
    finally:
        server.stop()


def _wait_idle(server: Server, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["requests_running"] == 0 and m["requests_waiting"] == 0 and m["kv_blocks_used"] == 0:
            return m
        time.sleep(0.2)
    raise AssertionError(f"requests still running or KV blocks held: {server.metrics()}")


def _raw_post(server: Server, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "unary"])
def test_a_client_that_disconnects_is_cancelled(server: Server, stream: bool) -> None:
    """Closing the connection mid-generation ends the request in the executor and frees its KV blocks."""
    before = _wait_idle(server)
    sock = _raw_post(server, {"prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                              "stream": stream})
    deadline = time.monotonic() + 30
    while server.metrics()["requests_running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    if stream:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    sock.close()
    after = _wait_idle(server)
    assert after["requests_finished_total"] == before["requests_finished_total"] + 1
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < 1500  # stopped early
    time.sleep(0.5)  # asyncio reports an unread exception when the future is collected
    assert "exception was never retrieved" not in server.log.read_text()


def test_health_metrics_and_loopback_default(server: Server) -> None:
    assert urllib.request.urlopen(server.base + "/health", timeout=10).read() == b"ok"
    m = server.metrics()
    assert m["kv_blocks_free"] > 0 and 0 <= m["draft_len"] <= 3  # the last step's (0 after a prefill-only step)
    assert parse_args(["models/x"]).host == "127.0.0.1"
    assert "request " in server.log.read_text()  # one info line per request


def test_an_api_key_guards_the_v1_routes(shipped_model_dir: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With --api_key every /v1 route answers OpenAI's 401 unless the request carries `Authorization: Bearer <key>`
    (which the openai client sends) and serves as usual with it; /health and /metrics stay open, as vLLM's.
    $DSV3_API_KEY is the flag's default, so the key need not be on the process list."""
    server = Server(shipped_model_dir, tmp_path / "serve.log", "--api_key", "s3cret", "--num_draft_tokens", "1")
    try:
        body = {"prompt": "In the beginning", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Bearer s3cret2"}):
            status, answer = server.post("/v1/completions", body, headers)
            assert (status, answer["error"]["code"], answer["error"]["type"]) == \
                (401, "invalid_api_key", "invalid_request_error"), (headers, answer)
        with pytest.raises(openai.AuthenticationError):
            server.client.models.list()  # api_key "unused"
        keyed = openai.OpenAI(base_url=server.base + "/v1", api_key="s3cret", max_retries=0, timeout=120)
        name = keyed.models.list().data[0].id
        out = keyed.completions.create(model=name, prompt="In the beginning", max_tokens=2)
        assert out.usage.completion_tokens == 2
        assert server.post("/tokenize", {"prompt": "x"})[0] == 401  # vLLM leaves it open; the key guards it here
        assert server.post("/tokenize", {"prompt": "x"}, {"Authorization": "Bearer s3cret"})[0] == 200
        # a path that does not exist answered 404 without the key, telling which do
        for headers, status in (({}, 401), ({"Authorization": "Bearer s3cret"}, 404)):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(urllib.request.Request(server.base + "/v1/nothing", headers=headers), timeout=10)
            assert e.value.code == status
        with pytest.raises(urllib.error.HTTPError) as e:  # a route's other methods: 405 with the key, as without one
            urllib.request.urlopen(urllib.request.Request(server.base + "/v1/completions",
                                                          headers={"Authorization": "Bearer s3cret"}), timeout=10)
        assert e.value.code == 405
        assert urllib.request.urlopen(server.base + "/health", timeout=10).read() == b"ok"
        assert server.metrics()["requests_finished_total"] == 1  # the refused ones never reached the executor
        assert "refused (401)" in server.log.read_text()
    finally:
        assert server.stop() == 0
    monkeypatch.setenv("DSV3_API_KEY", "from-env")
    assert parse_args(["models/x"]).api_key == "from-env"
    monkeypatch.delenv("DSV3_API_KEY")
    assert parse_args(["models/x"]).api_key is None


def test_bad_flags_are_refused_at_start_naming_them(shipped_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """Each was a traceback (10^9 torch threads: OpenMP aborted the process allocating their stacks)."""
    from serving.openai_server.cli import main

    for threads in ("0", "1000000000"):
        assert main(["models/none", "--torch_threads", threads]) == 2
        assert capsys.readouterr().err == f"dsv3-serve: --torch_threads must be in [1, 1024], got {threads}\n"
    for flags, message in ((["--device", "tpu"], "device must be cpu or cuda[:index], got 'tpu'"),
                           (["--device", "meta"], "device must be cpu or cuda[:index], got 'meta'"),
                           (["--max_batch_size", "0"], "max_batch_size must be an integer >= 1, got 0"),
                           (["--free_memory_fraction", "nan"], "free_memory_fraction must be in (0, 1], got nan")):
        assert main([str(shipped_model_dir), *flags]) == 2
        assert capsys.readouterr().err == f"dsv3-serve: {message}\n"
    with pytest.raises(SystemExit):
        main([str(shipped_model_dir), "--port", "70000"])
    assert "argument --port: expected a port in [0, 65535], got 70000" in capsys.readouterr().err
    with socket.create_server(("127.0.0.1", 0)) as taken:  # a busy port: said before the model loads (it loaded,
        port = taken.getsockname()[1]                        # logged 'serving at', then exited 3)
        assert main([str(shipped_model_dir), "--port", str(port)]) == 2
        assert capsys.readouterr().err == (f"dsv3-serve: --host 127.0.0.1 --port {port}: cannot listen there: "
                                           "Address already in use\n")


@pytest.mark.parametrize("key", ["", "two words", "cl\u00e9", "tab\tkey"])
def test_an_api_key_a_header_cannot_carry_is_refused_at_start(key: str, capsys: pytest.CaptureFixture) -> None:
    """An empty key (`--api_key "$KEY"` with KEY unset) guarded nothing; one with spaces, control or non-ASCII
    characters could never match a header: refused before anything loads."""
    from serving.openai_server.cli import main

    assert main(["models/none", "--api_key", key]) == 2
    assert capsys.readouterr().err == ("dsv3-serve: --api_key (or DSV3_API_KEY) must be a non-empty string of "
                                       "printable ASCII without spaces\n")


def test_load_shedding_is_a_503_logged_as_a_warning(shipped_model_dir: Path, tmp_path: Path) -> None:
    """--max_queued_requests: a request past the bound is a 503 the client may retry; normal overload, so the server
    logs it as a warning (each one was an ERROR line: 48 in one second in a burst, tripping alerts on errors)."""
    srv = Server(shipped_model_dir, tmp_path / "server.log", "--num_draft_tokens", "0", "--max_batch_size", "1",
                 "--max_queued_requests", "1")
    try:
        running = srv.client.completions.create(model=shipped_model_dir.name, prompt="def f(x):", max_tokens=400,
                                                stream=True, extra_body={"ignore_eos": True})
        next(iter(running))  # generating: the one batch slot is taken
        waiting = threading.Thread(target=srv.post, args=("/v1/completions", {
            "prompt": "def g(y):", "max_tokens": 2}))
        waiting.start()
        deadline = time.monotonic() + 30
        while srv.metrics()["requests_waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, body = srv.post("/v1/completions", {"prompt": "def h(z):", "max_tokens": 2})
        running.close()
        waiting.join(60)
    finally:
        assert srv.stop() == 0
    assert status == 503 and body["error"]["message"].startswith("the queue is full: 1 requests wait to be scheduled")
    log = srv.log.read_text()
    assert "WARNING serving.openai_server: POST /v1/completions refused (503): the queue is full" in log
    assert " ERROR " not in log


def test_a_rank_that_cannot_load_is_one_line(shipped_model_dir: Path, monkeypatch, capsys) -> None:
    """A tp > 1 engine whose rank 1 could not load its file printed a traceback (rank 0's own bad file: one line)."""
    import serving.openai_server.cli as cli
    from runtime.executors.ranks import RankFailure

    def failing(*args, **kwargs):
        raise RankFailure("rank 1 could not load engines/tp2: rank1.safetensors is truncated")

    monkeypatch.setattr(cli, "open_server_executor", failing)
    monkeypatch.setattr(cli, "interrupt_on_sigterm", lambda: None)
    assert cli.main([str(shipped_model_dir), "--port", "0"]) == 2
    assert capsys.readouterr().err == "dsv3-serve: rank 1 could not load engines/tp2: rank1.safetensors is truncated\n"


def test_the_watchdog_stops_the_server_whatever_the_executors_shutdown_does(monkeypatch) -> None:
    import serving.openai_server.cli as cli

    class Failing:
        def shutdown(self, timeout: float | None = 30) -> None:
            raise RuntimeError("its shutdown broke")

    stopped = []
    monkeypatch.setattr(cli, "stop_server", lambda pid, reason: stopped.append(reason))
    with pytest.raises(RuntimeError, match="its shutdown broke"):
        cli.stop_after_executor(Failing(), "engine: stalled")
    assert stopped == ["engine: stalled"]


def test_interrupted_while_loading_is_one_line(shipped_model_dir: Path, monkeypatch, capsys) -> None:
    """Ctrl-C (or SIGTERM, routed the same way until the server takes the signals over) while the model loads printed
    a traceback; one line and exit 130 now."""
    import serving.openai_server.cli as cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "open_server_executor", interrupted)
    monkeypatch.setattr(cli, "interrupt_on_sigterm", lambda: None)  # this process's own handler stays
    assert cli.main([str(shipped_model_dir), "--port", "0"]) == 130
    assert capsys.readouterr().err == "dsv3-serve: interrupted while loading the model\n"
