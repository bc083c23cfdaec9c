"""The OpenAI-compatible HTTP server: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (SSE
streaming), vLLM's `/tokenize` and `/detokenize`, `/health` and `/metrics`, on the executor directly, as `trtllm-serve`
and `vllm serve` run.

Handlers only translate: each prompt of a request is submitted to the executor with its n choices (one
executor request, the prompt computed once), whose thread runs every request in flight in one batch, and the handler waits on each `RequestHandle` asynchronously. A
streamed chunk carries what one executor output brought (every token of one MTP step together; a stream that falls
behind the step loop is handed the steps it missed merged, RequestHandle, as vLLM merges them). A client that
disconnects, streaming or not, has its requests cancelled, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.executors.base import ExecutorProtocol, submit_all
from runtime.executors.handles import RequestHandle
from runtime.executors.outputs import RequestOutput
from serving.openai_server import protocol
from serving.openai_server.chat import ChatTemplateFault, template_uses_tools
from serving.openai_server.protocol import APIError, Generation
from serving.openai_server.tool_calls import TOOL_CALL_PARSERS, ToolCallReader, read_tool_calls
from serving.watchdog import STALL_TIMEOUT_S

log = logging.getLogger("serving.openai_server")
BODY_TIMEOUT_S = 60  # for a request's whole body (nginx's client_body_timeout is 60 s between reads)
_JSON = json.JSONEncoder(ensure_ascii=False)  # json.dumps(ensure_ascii=False)'s, made once rather than per call


def _sse(obj: Any) -> str:
    return f"data: {_JSON.encode(obj)}\n\n"


class _TextChunks:
    """A stream's chunks that carry one choice's new text and nothing else (nearly all of them), exactly as `_sse`
    encodes them, at less CPU per token than encoding the chunk whole (the CPU a forward on a small machine shares):
    each choice's chunk is encoded once with a mark for its text, and each chunk then encodes its text alone."""

    _MARK = "\0text\0"

    def __init__(self, g: Generation, model: str, chat: bool):
        self.g, self.model, self.chat = g, model, chat
        self.around: dict[int, tuple[str, str]] = {}  # by choice index: the encoded chunk before and after the text

    def __call__(self, index: int, text: str) -> str:
        around = self.around.get(index)
        if around is None:
            c = protocol.choice(index, self._MARK, None, self.chat, chunk=True)
            encoded = _sse(protocol.completion_object(self.g, self.model, [c], self.chat, chunk=True))
            before, _, after = encoded.rpartition(_JSON.encode(self._MARK))  # the last: the model's name comes first
            around = self.around[index] = before, after
        return around[0] + _JSON.encode(text) + around[1]


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(handle index, output) as the handles' outputs arrive; one handle is read directly (no task, no queue)."""
    if len(handles) == 1:
        async for out in handles[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def pump(index: int, h: RequestHandle) -> None:
        async for out in h:
            await queue.put((index, out))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    remaining = sum(h.num_outputs for h in handles)  # each output of each handle ends with one final output
    try:
        while remaining:
            index, out = await queue.get()
            remaining -= out.finished
            yield index, out
    finally:
        for t in tasks:
            t.cancel()


def _failure(g: Generation, out: RequestOutput) -> APIError:
    """A generation that failed: 400 naming the structured-output parameter when its grammar failed (the request's
    guide, not the server), else 500."""
    if g.guide_parameter is not None and (out.error or "").startswith("guided_decoding."):
        return APIError(f"generation failed: {g.guide_message(out.error)}", g.guide_parameter)
    return APIError(f"generation failed: {out.error or out.finish_reason}", status=500, type="server_error")


class OpenAIServer:
    """The routes over one executor."""

    def __init__(self, executor: ExecutorProtocol, model_name: str, tool_call_parser: str | None = None,
                 chat_template: str | None = None):
        self.executor = executor
        self.model = model_name
        self.tokenizer = executor.tokenizer
        self.chat_template = chat_template if chat_template is not None else self.tokenizer.chat_template
        if tool_call_parser is not None and not self._template_reads_tools():
            log.warning("--tool_call_parser %s: the chat template does not render tools, so requests with tools are "
                        "refused; give one that does with --chat_template", tool_call_parser)
        self.max_seq_len = executor.limits.max_seq_len
        # chat requests read with the model's context, the server's template and tool-call format
        self.chat_request = functools.partial(
            protocol.chat_request, max_seq_len=self.max_seq_len, chat_template=self.chat_template,
            tool_syntax=TOOL_CALL_PARSERS[tool_call_parser] if tool_call_parser else None)
        self.max_text_bytes = self.tokenizer.max_text_bytes(self.max_seq_len)
        self.max_body_bytes = 4 * self.max_text_bytes + 65536  # room for JSON escapes and the other fields
        self.created = int(time.time())
        self.formats = {as_ids: protocol.LogprobsFormat(self.tokenizer, as_ids) for as_ids in (False, True)}
        # guided requests are submitted here, one at a time (the executor compiles one grammar at a time): they never
        # take the threads every request parses and renders on
        self.guided_submitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guided-submit")

    def _template_reads_tools(self) -> bool:
        try:
            return self.chat_template is not None and template_uses_tools(self.chat_template)
        except ChatTemplateFault:  # said to each chat request
            return False

    # ---- request plumbing --------------------------------------------------------------------------------------
    async def _body(self, request: Request) -> Any:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:  # refused before a byte of it is read
            raise APIError(f"the request body is larger than {self.max_body_bytes} bytes", status=413)
        chunks: list[bytes] = []

        async def read() -> None:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise APIError(f"the request body is larger than {self.max_body_bytes} bytes", status=413)
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), BODY_TIMEOUT_S)
        except ClientDisconnect:  # one log line, not two tracebacks: a client can send half bodies for free
            raise APIError("the client disconnected before sending the whole body") from None
        except asyncio.TimeoutError:  # a body trickled in for ever held its connection and its memory
            raise APIError(f"the request body did not arrive within {BODY_TIMEOUT_S} s", status=408) from None
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested too deep to parse
            raise APIError(f"the request body must be JSON: {e}") from None

    def _check_model(self, body: Any) -> None:
        name = body.get("model") if isinstance(body, dict) else None
        if name is not None and not isinstance(name, str):
            raise APIError(f"model must be a string, got {type(name).__name__}", "model")
        if name is not None and name != self.model:
            raise APIError(f"The model `{name}` does not exist. This server serves `{self.model}`.", "model",
                           status=404, code="model_not_found")

    def _submit(self, g: Generation, chat: bool) -> list[RequestHandle]:
        """One executor request per prompt, with its n choices (the executor shares the prompt between them), all
        or none (`submit_all`)."""
        try:
            return submit_all(self.executor, g.prompts, g.params, [f"{g.id}-{p}" for p in range(len(g.prompts))])
        except ValueError as e:  # a chat's prompt is its messages; the grammar engine's refusals name the guide
            names = {"prompt": "messages" if chat else "prompt", "guided_decoding": g.guide_parameter or ""}
            raise APIError(g.guide_message(str(e)), protocol.parameter_of(str(e), names)) from None
        except RuntimeError as e:  # the executor stopped serving (its error says why); /health says 503 too
            raise APIError(str(e), status=503, type="server_error") from None

    async def _submitted(self, g: Generation, chat: bool) -> list[RequestHandle]:
        """`_submit`; a guided request's on the guided submitter's thread: submitting compiles its grammar, which for
        a large schema takes long enough to stall every request the event loop serves. A client gone meanwhile has its
        requests cancelled once submitted."""
        if g.params.guided_decoding is None:
            return self._submit(g, chat)
        submitting = asyncio.get_running_loop().run_in_executor(self.guided_submitter, self._submit, g, chat)
        try:
            return await asyncio.shield(submitting)
        except asyncio.CancelledError:
            submitting.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() else [h.cancel() for h in f.result()])
            raise

    async def generate(self, request: Request, parse: Callable[..., Generation], chat: bool) -> Any:
        t0 = time.perf_counter()
        body = await self._body(request)
        self._check_model(body)
        # on a worker thread: rendering the model's chat template and tokenizing must not hold the event loop
        g = await asyncio.to_thread(parse, body, self.tokenizer, self.max_text_bytes)
        handles = await self._submitted(g, chat)
        if g.stream:
            return StreamingResponse(self._stream(g, handles, chat, t0), media_type="text/event-stream")
        try:
            outs = await self._results(request, handles)
        finally:
            for h in handles:
                if not h.finished:
                    h.cancel()
        if outs is None:  # the client went away; nobody reads an answer
            self._log(g, None, "client disconnected", t0)
            return JSONResponse({}, status_code=499)
        failed = next((o for o in outs if o.failed), None)
        if failed is not None:
            self._log(g, outs, f"failed: {failed.error or failed.finish_reason}", t0)
            raise _failure(g, failed)
        # on a worker thread: a response with logprobs of many prompts is megabytes of objects and JSON
        return await asyncio.to_thread(self._response, g, outs, chat, t0)

    def _response(self, g: Generation, outs: list[RequestOutput], chat: bool, t0: float) -> JSONResponse:
        """The finished request's response, rendered."""
        texts = ["" if g.echo_only else o.text for o in outs]
        if g.echo_texts is not None:
            texts = [g.echo_texts[i // g.n] + t for i, t in enumerate(texts)]
        finishes = ["length" if g.echo_only else o.finish_reason for o in outs]
        calls: list[list[dict[str, Any]] | None] = [None] * len(outs)
        if g.tool_syntax is not None:  # the text before the calls is the content
            for i, (t, o) in enumerate(zip(texts, outs)):
                texts[i], calls[i], finishes[i] = read_tool_calls(g.tool_syntax, t, g.parallel_tool_calls,
                                                                  finishes[i], o.stop_reason)
        choices = [protocol.choice(i, t, f, chat, chunk=False, role=g.role, stop_reason=o.stop_reason, tool_calls=c,
                                   logprobs=self._choice_logprobs(g, i, o, chat))
                   for i, (t, f, c, o) in enumerate(zip(texts, finishes, calls, outs))]
        # vLLM's extras about the prompt: on each completions choice, once on a chat response
        prompt_extras: list[dict[str, Any]] = [{} for _ in g.prompts]
        for p, extra in enumerate(prompt_extras):
            if g.prompt_logprobs is not None:  # decoded_token their text, as vLLM's (not token ids)
                extra["prompt_logprobs"] = self.formats[False].prompt(outs[p * g.n].prompt_logprobs, g.prompt_logprobs)
            if g.return_token_ids:
                extra["prompt_token_ids"] = g.prompts[p]
        for i, (c, o) in enumerate(zip(choices, outs)):
            if g.return_token_ids:
                c["token_ids"] = [] if g.echo_only else list(o.token_ids)
            if not chat:
                c.update(prompt_extras[i // g.n])
        usage = protocol.usage(g.prompts, [o.stats for o in outs], self.executor.kv_block_size, g.echo_only)
        self._log(g, outs, "ok", t0)
        response = protocol.completion_object(g, self.model, choices, chat, usage)
        return JSONResponse({**response, **prompt_extras[0]} if chat else response)

    async def _results(self, request: Request, handles: list[RequestHandle]) -> list[RequestOutput] | None:
        """The final output of each choice, or None if the client disconnects first."""

        async def final(h: RequestHandle) -> list[RequestOutput]:
            async for _ in h:
                pass
            return h.results(0)

        results = asyncio.gather(*(final(h) for h in handles))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([results, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if results.done():
            return [out for outs in results.result() for out in outs]  # choice i of prompt p at p * n + i
        results.cancel()
        results.add_done_callback(lambda f: f.cancelled() or f.exception())  # read: asyncio logs an unread one
        return None

    async def _stream(self, g: Generation, handles: list[RequestHandle], chat: bool, t0: float) -> AsyncIterator[str]:
        """SSE events: one chunk per executor output of any choice, the usage chunk if asked, then [DONE]. The
        generator is closed when the client disconnects; its handles are cancelled then."""
        finals: dict[int, RequestOutput] = {}
        outcome = "client disconnected"
        outputs = _merged(handles)
        choices = len(g.prompts) * g.n
        try:
            produced: dict[int, int] = {}  # completion tokens so far, by choice (continuous usage)
            announced: set[int] = set()  # return_token_ids: the choices whose prompt's ids were sent (their first)

            def chunk(c: dict[str, Any], token_ids: list[int] | None = None) -> str:
                """One choice's chunk, with vLLM's extras its request asked for (the prompt's ids with the first)."""
                index = c["index"]
                extra = {}
                if g.return_token_ids:
                    if not (chat and token_ids is None):  # not on chat's role chunks, as vLLM
                        c["token_ids"] = token_ids or []
                    if index not in announced:
                        announced.add(index)
                        extra = {"prompt_token_ids": g.prompts[index // g.n]}
                if not chat:
                    c.update(extra)
                body = protocol.completion_object(g, self.model, [c], chat, chunk=True,
                                                  usage_=self._usage_so_far(g, index, produced))
                return _sse({**body, **extra} if chat else body)

            for i in range(choices):  # as vLLM: the first chunk of each choice names the role (chat), or echoes
                if chat:
                    yield chunk(protocol.choice(i, None, None, chat, True, role=g.role))
                elif g.echo_texts is not None and not g.echo_logprobs:
                    yield chunk(protocol.choice(i, g.echo_texts[i // g.n], None, chat, True))
            fmt = self._format(g)
            text_chunk = _TextChunks(g, self.model, chat)
            offsets = [protocol.TextOffsets(fmt) for _ in range(choices)]  # completions' text_offset
            readers = [ToolCallReader(g.tool_syntax, g.parallel_tool_calls) for _ in range(choices)] \
                if g.tool_syntax is not None else None
            async for prompt, out in outputs:
                index = prompt * g.n + out.index
                if out.failed:
                    outcome = f"failed: {out.error or out.finish_reason}"
                    yield _sse(_failure(g, out).body())
                    break
                if g.echo_logprobs and index not in produced:  # the prompt's logprobs come with its first output
                    lps = fmt.prompt_completion(g.prompts[prompt], out.prompt_logprobs, offsets[index],
                                                g.params.logprobs)
                    yield chunk(protocol.choice(index, g.echo_texts[prompt], None, chat, chunk=True, logprobs=lps))
                produced[index] = out.stats.output_tokens
                if out.finished:
                    finals[index] = out
                text, calls, finish = out.text_delta, None, out.finish_reason
                if readers is not None:  # what the new text decides: content, tool-call deltas
                    text, calls = readers[index].read(text, out.finished)
                    finish = readers[index].finish_reason(finish, out.stop_reason)
                if text and not (calls or finish or out.new_logprobs is not None or g.return_token_ids
                                 or g.continuous_usage):
                    yield text_chunk(index, text)
                elif text or calls or out.finished or out.new_logprobs or g.return_token_ids and out.new_token_ids:
                    c = protocol.choice(index, text, finish, chat, chunk=True,
                                        logprobs=self._logprobs(g, out.new_logprobs, chat, offsets[index]),
                                        stop_reason=out.stop_reason, tool_calls=calls)
                    yield chunk(c, list(out.new_token_ids))
            else:
                outcome = "ok"
                if g.include_usage:
                    usage = protocol.usage(g.prompts, [finals[i].stats for i in sorted(finals)],
                                           self.executor.kv_block_size)
                    yield _sse(protocol.completion_object(g, self.model, [], chat, usage, chunk=True))
            yield "data: [DONE]\n\n"
        finally:
            await outputs.aclose()
            for h in handles:
                if not h.finished:
                    h.cancel()
            self._log(g, [finals[i] for i in sorted(finals)], outcome, t0)

    def _format(self, g: Generation) -> protocol.LogprobsFormat:
        """The request's logprobs format: tokens by their text, or by id (return_tokens_as_token_ids)."""
        return self.formats[g.tokens_as_ids]

    def _usage_so_far(self, g: Generation, index: int, produced: dict[int, int]) -> dict[str, int] | None:
        """A streamed chunk's usage with continuous_usage_stats, as vLLM counts it: its choice's prompt and the
        choice's tokens so far."""
        if not g.continuous_usage:
            return None
        prompt, completion = len(g.prompts[index // g.n]), produced.get(index, 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _choice_logprobs(self, g: Generation, index: int, out: RequestOutput, chat: bool) -> dict[str, Any] | None:
        """A whole choice's logprobs; with echo, its prompt's before its output's (none of an echo_only output's)."""
        if not g.echo_logprobs:
            return self._logprobs(g, out.logprobs, chat)
        fmt = self._format(g)
        offsets = protocol.TextOffsets(fmt)
        echoed = fmt.prompt_completion(g.prompts[index // g.n], out.prompt_logprobs, offsets, g.params.logprobs)
        if g.echo_only:
            return echoed
        generated = fmt.completion(list(out.logprobs), offsets)
        return {key: echoed[key] + generated[key] for key in echoed}

    def _logprobs(self, g: Generation, lps: list | None, chat: bool, offsets: protocol.TextOffsets | None = None
                  ) -> dict[str, Any] | None:
        """`offsets`: the choice's so far (streaming); a whole output starts its own."""
        if lps is None:
            return None
        fmt = self._format(g)
        return fmt.chat(lps) if chat else fmt.completion(lps, offsets or protocol.TextOffsets(fmt))

    def _log(self, g: Generation, outs: list[RequestOutput] | None, outcome: str, t0: float) -> None:
        prompt = sum(map(len, g.prompts))
        completion = sum(o.stats.output_tokens for o in outs or [])
        log.info("request %s: %d choice(s), %d prompt + %d completion tokens, %s%s in %.3f s", g.id,
                 len(g.prompts) * g.n, prompt, completion, outcome, ", streamed" if g.stream else "",
                 time.perf_counter() - t0)

    # ---- other endpoints ---------------------------------------------------------------------------------------
    async def tokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /tokenize response: the ids, their count, the context length, and the tokens' strings if asked."""
        body = await self._body(request)
        self._check_model(body)
        answer = await asyncio.to_thread(self._tokenized, body)  # templates and tokenizing: off the event loop
        log.info("tokenize: %d tokens", answer["count"])
        return answer

    def _tokenized(self, body: Any) -> dict[str, Any]:
        ids, strings = protocol.tokenize_request(body, self.tokenizer, self.max_text_bytes, self.chat_template)
        return {"count": len(ids), "max_model_len": self.max_seq_len, "tokens": ids,
                "token_strs": self.tokenizer.token_strings(ids) if strings else None}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /detokenize response: the ids' text, special tokens included."""
        body = await self._body(request)
        self._check_model(body)
        ids = protocol.detokenize_request(body, self.tokenizer)
        log.info("detokenize: %d tokens", len(ids))
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, ids, skip_special_tokens=False)}

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "dsv3-mtp",
                "max_model_len": self.max_seq_len}

    def metrics(self) -> str:
        """Prometheus text format: the executor's load, KV cache and speculation counters."""
        s = self.executor.stats()
        rows = [("requests_running", "gauge", s.running), ("requests_waiting", "gauge", s.queued),
                ("kv_blocks_used", "gauge", s.kv_blocks_used), ("kv_blocks_free", "gauge", s.kv_blocks_free),
                ("requests_finished_total", "counter", s.requests_finished),
                ("generated_tokens_total", "counter", s.generated_tokens),
                ("draft_tokens_total", "counter", s.draft_tokens),
                ("accepted_draft_tokens_total", "counter", s.accepted_draft_tokens),
                ("draft_len", "gauge", s.current_draft_len),
                ("kv_blocks_cached", "gauge", s.kv_blocks_cached),
                ("prefix_cache_reused_blocks_total", "counter", s.kv_reused_blocks),
                ("prefix_cache_missed_blocks_total", "counter", s.kv_missed_blocks)]
        lines = []
        for name, kind, value in rows:
            lines += [f"# TYPE dsv3_{name} {kind}", f'dsv3_{name}{{model="{self.model}"}} {value}']
        return "\n".join(lines) + "\n"


def api_key_problem(api_key: str) -> str | None:
    """What is wrong with a key for `Authorization: Bearer <key>` (None: nothing): an empty one would guard nothing,
    and a header carries printable ASCII without spaces."""
    if not api_key or not api_key.isascii() or not api_key.isprintable() or " " in api_key:
        return "--api_key (or DSV3_API_KEY) must be a non-empty string of printable ASCII without spaces"
    return None


GUARDED_PATHS = ("/v1", "/tokenize", "/detokenize")  # with an API key; /health and /metrics stay open, as vLLM's


class KeyCheck:
    """ASGI middleware refusing requests to GUARDED_PATHS (and any path under them) without `Authorization: Bearer
    <api_key>` with OpenAI's 401, as `vllm serve --api-key` guards /v1: before routing, so a path that does not
    exist is refused alike, not a 404 telling which do. Pure ASGI, so streamed responses pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and any(scope["path"] == p or scope["path"].startswith(p + "/")
                                           for p in GUARDED_PATHS):
            sent = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not hmac.compare_digest(sent, self.expected):
                error = APIError("Incorrect or missing API key: send the header `Authorization: Bearer <key>` with "
                                 "the key the server was started with", status=401, code="invalid_api_key")
                await refusal(scope["method"], scope["path"], error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def refusal(method: str, path: str, e: APIError) -> JSONResponse:
    """An APIError's response in OpenAI's shape, logged: one line per request."""
    if e.status == 503:  # load shed, or an executor that stopped (the watchdog says that once, at ERROR)
        log.warning("%s %s refused (503): %s", method, path, e.message)
    elif e.status >= 500:
        log.error("%s %s: %s", method, path, e.message)
    else:
        log.info("%s %s refused (%d): %s", method, path, e.status, e.message)
    return JSONResponse(e.body(), status_code=e.status)


def create_app(executor: ExecutorProtocol, model_name: str, api_key: str | None = None,
               tool_call_parser: str | None = None, chat_template: str | None = None) -> FastAPI:
    """The app; with `api_key` the /v1 routes, /tokenize and /detokenize need it (/health and /metrics stay open, as
    vLLM's); `tool_call_parser` (a TOOL_CALL_PARSERS name) reads tool calls from chat output; `chat_template`
    replaces the checkpoint's."""
    server = OpenAIServer(executor, model_name, tool_call_parser, chat_template)
    app = FastAPI(title="dsv3-serve", docs_url=None, redoc_url=None, openapi_url=None)
    if api_key:
        app.add_middleware(KeyCheck, api_key=api_key)
    v1 = APIRouter(prefix="/v1")

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return refusal(request.method, request.url.path, e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:  # unknown route, method
        return JSONResponse(APIError(str(e.detail), status=e.status_code, code=str(e.status_code)).body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(APIError(f"internal error ({type(e).__name__}); see the server log", status=500,
                                     type="server_error").body(), status_code=500)

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [server.model_card()]}

    @v1.get("/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        server._check_model({"model": name})
        return server.model_card()

    @v1.post("/completions")
    async def completions(request: Request) -> Any:
        return await server.generate(request, protocol.completion_request, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await server.generate(request, server.chat_request, chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        return await server.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        return await server.detokenize(request)

    health_thread = ThreadPoolExecutor(1, thread_name_prefix="health")  # not queued behind requests being parsed

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> PlainTextResponse:
        problem = await asyncio.get_running_loop().run_in_executor(  # a call to the engine process
            health_thread, executor.health, STALL_TIMEOUT_S)
        return PlainTextResponse(problem or "ok", status_code=503 if problem else 200)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(await asyncio.to_thread(server.metrics), media_type="text/plain; version=0.0.4")

    app.include_router(v1)
    return app
