"""Tool calling in dsv3-serve's /v1/chat/completions, as vLLM serves DeepSeek models (`--tool-call-parser
deepseek_v3` / `deepseek_v31`): DeepSeek's formats read from hand-written outputs (whole and streamed in any pieces,
the same), tool_choice "required" and a named function constraining the shipped model to calls whose arguments follow
their schemas (exact under MTP: the same tokens as plain decoding), streamed deltas that add up to the whole answer,
tool messages through the chat template as transformers renders them, and bad tools refused naming the parameter.

The shipped model's template has no tools; the server runs a copy of it with a DeepSeek-V3-style template that
renders them (V3_TOOLS_TEMPLATE)."""

from __future__ import annotations

import json
import random
import shutil
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from benchmarks.soak_openai import SCHEMAS, TOOLS, schema_problem  # noqa: E402
from runtime.core.sampling_params import GuidedDecodingParams, SamplingParams  # noqa: E402
from runtime.executors.session import Session  # noqa: E402
from runtime.io.tokenizer import Tokenizer  # noqa: E402
from serving.openai_server.chat import render_chat, template_uses_tools  # noqa: E402
from serving.openai_server.process import start_dsv3_serve  # noqa: E402
from serving.openai_server.protocol import APIError, chat_request  # noqa: E402
from serving.openai_server.tool_calls import (TOOL_CALL_PARSERS, ToolCallReader, read_tool_calls,  # noqa: E402
                                              tool_call_grammar)

V3, V31 = TOOL_CALL_PARSERS["deepseek_v3"], TOOL_CALL_PARSERS["deepseek_v31"]

# the shipped template: DeepSeek-V3's conversation format (its own template's turns, tool calls and tool outputs) with
# the tools written into the system prompt, as vLLM's examples/tool_chat_template_deepseekv3.jinja writes them
V3_TOOLS_TEMPLATE = (Path(__file__).resolve().parents[1] / "serving" / "openai_server" / "templates" /
                     "deepseek_v3_tools.jinja").read_text(encoding="utf-8")

ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]


def _v3_call(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


def _v31_call(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"


BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
OUTPUTS = [  # (syntax, model output, content, [(name, arguments)])
    (V3, BEGIN + _v3_call("get_weather", '{"city": "Paris", "days": 3}') + "\n"
     + _v3_call("get_time", '{"zone": "CET"}') + END,
     None, [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"zone": "CET"}')]),
    (V3, "Let me look that up." + BEGIN + _v3_call("get_time", '{\n  "zone": "UTC"\n}') + END,
     "Let me look that up.", [("get_time", '{\n  "zone": "UTC"\n}')]),
    (V31, BEGIN + _v31_call("get_weather", '{"city": "Nice", "days": 1}') + _v31_call("get_time", "{}") + END,
     None, [("get_weather", '{"city": "Nice", "days": 1}'), ("get_time", "{}")]),
    (V31, "Sure. " + BEGIN + _v31_call("get_time", '{"zone": "PST"}') + END, "Sure. ",
     [("get_time", '{"zone": "PST"}')]),
    # malformed: no complete call after the opening marker, a call header that breaks the format, no calls at all
    (V3, "I would call " + BEGIN + " a tool", "I would call " + BEGIN + " a tool", []),
    (V31, BEGIN + "<｜tool▁call▁begin｜>get time<｜tool▁sep｜>{}<｜tool▁call▁end｜>" + END,
     BEGIN + "<｜tool▁call▁begin｜>get time<｜tool▁sep｜>{}<｜tool▁call▁end｜>" + END, []),
    (V3, "No tools <｜here｜>, `json`", "No tools <｜here｜>, `json`", []),
    (V3, BEGIN + END + " nothing", BEGIN + END + " nothing", []),
    # cut by max_tokens inside the arguments: the call with what was written (as OpenAI answers "length")
    (V3, BEGIN + _v3_call("get_weather", '{"city": "Pa')[:-len("\n```<｜tool▁call▁end｜>")],
     None, [("get_weather", '{"city": "Pa')]),
    # cut in a second call's header, or in the closing marker: the calls before it (the cut markup is no content)
    (V31, BEGIN + _v31_call("get_time", "{}") + "<｜tool▁call▁begin｜>get_wea", None, [("get_time", "{}")]),
    (V3, BEGIN + _v3_call("get_time", "{}") + "\n<｜tool▁call", None, [("get_time", "{}")]),
    # text after the calls is content; calls after it are calls (vLLM reads every call block)
    (V31, BEGIN + _v31_call("get_time", "{}") + END + " Done.", " Done.", [("get_time", "{}")]),
    (V3, BEGIN + _v3_call("get_time", "{}") + END + " and " + BEGIN + _v3_call("get_time", '{"zone": "PST"}') + END,
     " and ", [("get_time", "{}"), ("get_time", '{"zone": "PST"}')]),
    # a marker inside a JSON string is the arguments' text (V3.1's end marker cut them short)
    (V31, BEGIN + _v31_call("echo", '{"text": "see <｜tool▁call▁end｜> \\"here\\""}') + END, None,
     [("echo", '{"text": "see <｜tool▁call▁end｜> \\"here\\""}')]),
    # cut inside the closing marker, or inside the next marker's last character (decoded as U+FFFD): no markup kept
    (V3, BEGIN + _v3_call("get_time", '{"zone": "--in-"}')[:-len("call▁end｜>")], None,
     [("get_time", '{"zone": "--in-"}')]),
    (V3, BEGIN + _v3_call("get_time", "{}") + "\n<｜tool\ufffd", None, [("get_time", "{}")]),
    (V3, BEGIN + _v3_call("get_time", '{"zone": "-"}')[:-len("call▁end｜>")] + "\ufffd", None,
     [("get_time", '{"zone": "-"}')]),
    (V31, BEGIN + _v31_call("get_time", "{}")[:-len("call▁end｜>")] + "\ufffd", None, [("get_time", "{}")]),
]


def _calls(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("syntax, text, content, calls", OUTPUTS)
def test_deepseek_outputs_are_read_as_vllm_reads_them(syntax, text: str, content: str | None,
                                                       calls: list[tuple[str, str]]) -> None:
    """The text before the calls is the content (None when empty), each call's name and arguments as written, with
    vLLM's ids; what breaks the format stays content, as written."""
    got_content, got_calls, _ = read_tool_calls(syntax, text)
    assert (got_content, _calls(got_calls)) == (content, calls)
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)
    assert read_tool_calls(syntax, text, reason="length")[2] == "length"


@pytest.mark.parametrize("text, reason, stop_reason, finish", [
    (BEGIN + _v3_call("get_time", "{}") + END, "stop", None, "tool_calls"),  # whole calls, ended by itself (eos)
    (BEGIN + _v3_call("get_time", "{}"), "stop", None, "tool_calls"),  # the calls' end marker not written: whole
    (BEGIN + _v3_call("get_time", '{"zone": "C')[:-20], "stop", None, "stop"),  # eos inside the arguments
    (BEGIN + _v3_call("get_time", '{"zone": "C')[:-20], "stop", '"days"', "stop"),  # a stop string cut the call
    (BEGIN + _v3_call("get_time", "{}") + END, "stop", 7, "stop"),  # a stop token id ended it
    (BEGIN + _v3_call("get_time", "{}") + END, "length", None, "length"),
    ("no calls", "stop", None, "stop"),
])
def test_tool_calls_is_the_finish_of_whole_calls_ended_by_the_model(text: str, reason: str,
                                                                     stop_reason: str | int | None, finish: str) -> None:
    """OpenAI never answers "tool_calls" with a call cut short: a stop string inside the arguments gave it, and the
    openai client's parse() failed on the arguments."""
    assert read_tool_calls(V3, text, reason=reason, stop_reason=stop_reason)[2] == finish


def _assemble(pieces: list[tuple[str, list[dict[str, Any]]]]) -> tuple[str, list[tuple[str, str]]]:
    """Streamed (content, tool-call deltas) put together as a client does; checks each call's first delta carries its
    id, type and name, and later ones its arguments only."""
    content, calls = "", {}
    for text, deltas in pieces:
        content += text
        for d in deltas:
            if d["index"] not in calls:
                assert d["type"] == "function" and d["id"].startswith("chatcmpl-tool-") and d["function"]["name"]
                calls[d["index"]] = [d["function"]["name"], ""]
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]][1] += d["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("syntax, text, content, calls", OUTPUTS)
def test_streamed_reading_in_any_pieces_equals_the_whole(syntax, text: str, content: str | None,
                                                         calls: list[tuple[str, str]]) -> None:
    rng = random.Random(0)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(12, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        reader = ToolCallReader(syntax)
        read = [reader.read(p, finished=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert _assemble(read) == (content or "", calls), pieces


def test_without_parallel_tool_calls_only_the_first_call_is_kept() -> None:
    """vLLM's reading of parallel_tool_calls false; the first call's markers and the dropped calls are no content."""
    content, calls, _ = read_tool_calls(V3, OUTPUTS[0][1], parallel=False)
    assert (content, _calls(calls)) == (None, [("get_weather", '{"city": "Paris", "days": 3}')])


@pytest.fixture(scope="module")
def session(shipped_model_dir: Path) -> Iterator[Session]:
    with Session(shipped_model_dir, num_draft_tokens=3) as s:
        yield s


@pytest.mark.parametrize("syntax", [V3, V31], ids=["deepseek_v3", "deepseek_v31"])
@pytest.mark.parametrize("parallel", [False, True])
def test_the_grammar_writes_calls_the_reader_reads(session: Session, syntax, parallel: bool) -> None:
    """What tool_choice "required" constrains the tiny shipped model to: DeepSeek's format, nothing around it, each
    call's arguments valid under its schema; greedy, the same tokens at k = 3 and k = 0."""
    grammar = tool_call_grammar(syntax, [t["function"] for t in TOOLS], parallel)
    ids = session.tokenizer.encode("<｜User｜>What is the weather in Paris?<｜Assistant｜>")
    outs = {k: session.executor.submit(ids, SamplingParams(max_tokens=160, num_draft_tokens=k,
                                                           guided_decoding=GuidedDecodingParams(grammar=grammar))
                                       ).result() for k in (3, 0)}
    assert outs[3].token_ids == outs[0].token_ids
    content, calls, _ = read_tool_calls(syntax, outs[3].text)
    assert content is None and calls and (parallel or len(calls) == 1)
    cut = outs[3].finish_reason == "length"  # parallel calls: the tiny model may call on until max_tokens
    assert outs[3].finish_reason == "stop" or (cut and parallel)
    assert all(schema_problem(c["function"]["arguments"], SCHEMAS[c["function"]["name"]]) is None
               for c in calls[:-1 if cut else None])


# ---- through dsv3-serve ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tool_model(shipped_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("tools") / "model"
    shutil.copytree(shipped_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": V3_TOOLS_TEMPLATE},
                                                            ensure_ascii=False, indent=2))
    return model


class Server:
    def __init__(self, model: Path, log: Path, *args: str):
        self.log = log
        self.serve = start_dsv3_serve(model, "--torch_threads", "1", *args, log=log)
        self.client = openai.OpenAI(base_url=self.serve.base_url + "/v1", api_key="unused", max_retries=0,
                                    timeout=120)

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(self.serve.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(tool_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tool_model, tmp_path_factory.mktemp("tools-serve") / "server.log", "--num_draft_tokens", "3",
                 "--speculation", "fixed", "--tool_call_parser", "deepseek_v3")
    yield srv
    assert srv.serve.stop() == 0, srv.log.read_text()[-3000:]


KW = dict(model="model", tools=TOOLS, temperature=0, max_tokens=120)
CHOICES = [("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")]


@pytest.mark.parametrize("tool_choice, name", CHOICES, ids=["required", "named"])
def test_required_and_named_tool_choice_make_valid_calls(server: Server, tool_choice: Any, name: str | None) -> None:
    r = server.client.chat.completions.create(messages=ASK, tool_choice=tool_choice, parallel_tool_calls=False, **KW)
    [c] = r.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    [call] = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == (name or call.function.name) and call.function.name in SCHEMAS
    assert schema_problem(call.function.arguments, SCHEMAS[call.function.name]) is None


def _streamed(server: Server, **kw: Any) -> tuple[str | None, list[tuple[str, str]], str, list[int]]:
    """A streamed answer put together as a client does (checking the deltas' shapes on the way): content, calls,
    finish_reason, token ids."""
    pieces, finish, ids = [], None, []
    for chunk in server.client.chat.completions.create(stream=True, **kw):
        [c] = chunk.choices
        deltas = [d.model_dump(exclude_none=True) for d in c.delta.tool_calls or []]
        for d in deltas:
            d["function"].setdefault("arguments", "")
        pieces.append((c.delta.content or "", deltas))
        ids += c.model_extra.get("token_ids") or []
        finish = c.finish_reason or finish
    content, calls = _assemble(pieces)
    return content or None, calls, finish, ids


# "auto" reads what the model writes; with vLLM's guided_grammar the tiny model writes text before two calls
WRITTEN = {"guided_grammar": f'start: "Checking. " {json.dumps(BEGIN, ensure_ascii=False)} call "\\n" call '
                             f'{json.dumps(END, ensure_ascii=False)}\n'
                             + tool_call_grammar(V3, [t["function"] for t in TOOLS], False).split("\n", 1)[1]}


@pytest.mark.parametrize("tool_choice, extra", [
    ("required", {}), ({"type": "function", "function": {"name": "get_weather"}}, {}), ("auto", {}), ("none", {}),
    ("auto", WRITTEN)], ids=["required", "named", "auto", "none", "auto-calls"])
def test_streaming_equals_whole_and_mtp_equals_plain(server: Server, tool_choice: Any, extra: dict) -> None:
    """Streamed deltas put together are the whole answer (content, calls, finish_reason); greedy output with tools
    is plain decoding's token for token (num_draft_tokens 0 against the server's 3), streamed or not."""
    kw = dict(messages=ASK, tool_choice=tool_choice, parallel_tool_calls=False, **{**KW, "max_tokens": 400})
    answers = []
    for k in (3, 0):
        extra = {**extra, "return_token_ids": True, "num_draft_tokens": k}
        [c] = server.client.chat.completions.create(**{**kw, "extra_body": extra}).choices
        whole = (c.message.content, _calls(c.message.model_dump()["tool_calls"] or []), c.finish_reason,
                 c.model_extra["token_ids"])
        assert _streamed(server, **{**kw, "extra_body": extra}) == whole
        answers.append(whole)
    assert answers[0] == answers[1]
    content, calls, finish, _ = answers[0]
    if "guided_grammar" in extra:  # two calls written; without parallel_tool_calls the first is kept
        assert content == "Checking. " and len(calls) == 1 and finish == "tool_calls"
    elif tool_choice in ("auto", "none"):  # the tiny model writes no calls: its text is the content
        assert not calls and content and finish in ("stop", "length")
    else:
        assert calls and finish == "tool_calls" and content is None
    assert all(schema_problem(a, SCHEMAS[n]) is None for n, a in calls)


def test_parallel_required_calls_all_follow_their_schemas(server: Server) -> None:
    [c] = server.client.chat.completions.create(messages=ASK, tool_choice="required", **{**KW, "max_tokens": 400}
                                                ).choices
    calls = c.message.tool_calls
    assert calls and all(schema_problem(t.function.arguments, SCHEMAS[t.function.name]) is None for t in calls[:-1])
    assert c.finish_reason == "length" or schema_problem(calls[-1].function.arguments,
                                                        SCHEMAS[calls[-1].function.name]) is None


CONVERSATION = [
    {"role": "system", "content": "Be brief."}, *ASK,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 3}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"}]


def test_tool_messages_render_as_transformers_renders_them(server: Server, tool_model: Path) -> None:
    """An assistant's tool calls (as the openai client returns them) and the tool messages answering them reach the
    template as transformers' apply_chat_template passes them, and the tools too: the same prompt."""
    transformers = pytest.importorskip("transformers")
    want = transformers.AutoTokenizer.from_pretrained(tool_model).apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    tok = Tokenizer.from_dir(tool_model)
    assert render_chat(V3_TOOLS_TEMPLATE, CONVERSATION, tok, tools=TOOLS) == want
    assert "<｜tool▁output▁begin｜>Sunny, 24C<｜tool▁output▁end｜>" in want and '"name": "get_time"' in want
    status, answer = server.post("/tokenize", {"messages": CONVERSATION, "tools": TOOLS})
    assert (status, answer["tokens"]) == (200, tok.encode(want, add_bos=False))
    r = server.client.chat.completions.create(messages=CONVERSATION, tool_choice="none", **KW)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    prompt = tok.encode(render_chat(V3_TOOLS_TEMPLATE, CONVERSATION, tok, tools=TOOLS), add_bos=False)
    assert r.usage.prompt_tokens == len(prompt)  # "none": the tools are rendered all the same


MESSAGE = [{"role": "user", "content": "x"}]
BAD = [  # (body beside messages, param, message)
    ({"tools": {"type": "function"}}, "tools",
     "tools must be a list of {\"type\": \"function\", \"function\": {...}}, got {'type': 'function'}"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]",
     "tools[0] must be {\"type\": \"function\", \"function\": {\"name\", \"description\", \"parameters\"}} (function "
     "tools only), got {'type': 'code_interpreter'}"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name",
     "tools[0].function.name must be 1 to 64 letters, digits, underscores or dashes, got 'get weather'"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "get_weather"}}]}, "tools[1].function.name",
     "tools[1].function.name 'get_weather' is given twice; the functions' names must differ"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters",
     "tools[0].function.parameters must be a JSON schema (an object), got {}"),
    ({"tools": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}, "tools[0].function",
     "tools[0].function must be an object of name, description, parameters and strict, got {'name': 'f', "
     "'arguments': {}}"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "foo"}}}}}], "tool_choice": "required"}, "tools[0].function.parameters",
     "tools[0].function.parameters is invalid at /properties/a of the schema: Invalid type: foo"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice",
     "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}, "
     "got any"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_date"}}}, "tool_choice",
     "tool_choice names the function 'get_date', which is not among tools (get_weather, get_time)"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice required needs tools to call"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "tool_choice and response_format both constrain the output; send one"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls",
     "parallel_tool_calls must be true or false, got 1"),
    ({"functions": [{"name": "f"}]}, "functions",
     "functions [{'name': 'f'}] is not supported by this server; it takes null or [] (send tools)"),
    # a call's arguments are an object (a string schema gave '"--example"'); the grammar's JSON options are its own
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "tools[0].function.parameters must be a JSON schema of \"type\": \"object\" "
     "(a call's arguments are an object), got type string"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x-guidance": None}}}],
      "tool_choice": "required"}, "tools[0].function.parameters",
     "tools[0].function.parameters: x-guidance is not taken in a tool's schema"),  # was a 500
]
BAD_MESSAGES = [  # (messages, message)
    ([*MESSAGE, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
     "messages[1].tool_calls must be a list of {\"id\", \"type\": \"function\", \"function\": {\"name\", "
     "\"arguments\"}}, got {'id': '1'}"),
    ([*MESSAGE, {"role": "tool", "content": "18C"}],
     "messages[1].tool_call_id (the id of the call it answers) is required on a tool message, and only there"),
    ([{"role": "user", "content": "x", "tool_calls": CONVERSATION[2]["tool_calls"]}],
     "messages[0].tool_calls: only assistant messages make tool calls"),
    ([*MESSAGE, {"role": "function", "name": "f", "content": "1"}],
     "messages[1].role 'function' (the deprecated function calling) is not supported; send tool messages"),
    # a null content was rendered as the text "None"
    ([{"role": "user", "content": None}], "messages[0].content is required on a user message"),
    ([*CONVERSATION[:3], {"role": "tool", "tool_call_id": "call_1", "content": None}],
     "messages[3].content is required on a tool message"),
]


@pytest.mark.parametrize("body, param, message", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_tools_and_tool_choice_are_refused_naming_them(server: Server, body: dict, param: str,
                                                           message: str) -> None:
    assert server.post("/v1/chat/completions", {"messages": MESSAGE, **body}) == (400, {"error": {
        "message": message, "type": "invalid_request_error", "param": param, "code": None}})


@pytest.mark.parametrize("messages, message", BAD_MESSAGES)
def test_bad_tool_messages_are_refused_naming_them(server: Server, messages: list, message: str) -> None:
    assert server.post("/v1/chat/completions", {"messages": messages, "tools": TOOLS}) == (400, {"error": {
        "message": message, "type": "invalid_request_error", "param": "messages", "code": None}})
    assert urllib.request.urlopen(server.serve.base_url + "/health", timeout=10).status == 200  # still serving
    r = server.client.chat.completions.create(messages=ASK, tool_choice="required", parallel_tool_calls=False, **KW)
    assert r.choices[0].finish_reason == "tool_calls"


def test_tools_a_template_would_drop_or_no_parser_reads_are_refused(shipped_model_dir: Path, tool_model: Path) -> None:
    """The shipped model's template does not use tools (they would never reach the model): refused naming tools, as
    are tools a server without --tool_call_parser could not read (tool_choice "none" needs no parser)."""
    body = {"messages": MESSAGE, "tools": TOOLS}
    plain = Tokenizer.from_dir(shipped_model_dir)
    assert not template_uses_tools(plain.chat_template)
    for tokenizer, syntax, message in (
            (plain, V3, "tools cannot reach this model: its chat template does not use them (it would drop them "
                        "without a word); give dsv3-serve a --chat_template that renders `tools`"),
            (Tokenizer.from_dir(tool_model), None,
             "tools need a tool-call parser to read the calls in the output: start dsv3-serve with --tool_call_parser "
             "deepseek_v3 or deepseek_v31 (vLLM's --tool-call-parser), or send tool_choice \"none\"")):
        with pytest.raises(APIError) as e:
            chat_request(body, tokenizer, 1 << 20, max_seq_len=2048, chat_template=tokenizer.chat_template,
                         tool_syntax=syntax)
        assert (e.value.status, e.value.param, e.value.message) == (400, "tools", message)
    tools_tokenizer = Tokenizer.from_dir(tool_model)
    g = chat_request({**body, "tool_choice": "none"}, tools_tokenizer, 1 << 20, max_seq_len=2048,
                     chat_template=tools_tokenizer.chat_template)
    assert g.tool_syntax is None and g.params.guided_decoding is None
    assert chat_request({"messages": MESSAGE, "tools": []}, plain, 1 << 20, max_seq_len=2048,
                        chat_template=plain.chat_template).tool_syntax is None


def test_a_chat_template_given_at_start_replaces_the_checkpoints(shipped_model_dir: Path, tmp_path: Path) -> None:
    """`--chat_template FILE` (vLLM's --chat-template): the shipped model's own template does not read tools, so a
    request with tools is refused; with a template that does, given at start, it is served. A file that is missing or
    does not compile stops the server before the model loads, naming the flag."""
    import subprocess
    import sys

    template = tmp_path / "tools.jinja"
    template.write_text(V3_TOOLS_TEMPLATE, encoding="utf-8")
    srv = Server(shipped_model_dir, tmp_path / "server.log", "--num_draft_tokens", "0", "--chat_template",
                 str(template), "--tool_call_parser", "deepseek_v3")
    try:
        r = srv.client.chat.completions.create(messages=ASK, tool_choice="required", parallel_tool_calls=False,
                                               **{**KW, "model": shipped_model_dir.name})
        [call] = r.choices[0].message.tool_calls
        assert schema_problem(call.function.arguments, SCHEMAS[call.function.name]) is None
    finally:
        assert srv.serve.stop() == 0
    dsv3_serve = str(Path(sys.executable).with_name("dsv3-serve"))
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}", encoding="utf-8")
    for path, message in [(tmp_path / "none.jinja", "No such file or directory"),
                          (tmp_path / "bad.jinja", "TemplateSyntaxError: Unexpected end of template.")]:
        run = subprocess.run([dsv3_serve, str(shipped_model_dir), "--chat_template", str(path)], capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 2 and run.stderr.startswith(f"dsv3-serve: --chat_template {path}: "), run.stderr
        assert message in run.stderr and "Traceback" not in run.stderr


def test_the_servers_template_is_its_own_and_a_parser_without_tools_in_it_is_warned_about(
        shipped_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """--chat_template is the server's: the executor's tokenizer keeps the checkpoint's (a second app on the same
    executor got the first one's template). A parser beside a template that never renders tools is said at start."""
    import logging
    from types import SimpleNamespace

    from serving.openai_server.app import OpenAIServer

    tokenizer = Tokenizer.from_dir(shipped_model_dir)
    own = tokenizer.chat_template
    executor = SimpleNamespace(tokenizer=tokenizer, limits=SimpleNamespace(max_seq_len=256))
    with caplog.at_level(logging.WARNING, logger="serving.openai_server"):
        given = OpenAIServer(executor, "m", "deepseek_v3", V3_TOOLS_TEMPLATE)
        plain = OpenAIServer(executor, "m", "deepseek_v3")
    assert (given.chat_template, plain.chat_template, tokenizer.chat_template) == (V3_TOOLS_TEMPLATE, own, own)
    assert [r.getMessage() for r in caplog.records] == [
        "--tool_call_parser deepseek_v3: the chat template does not render tools, so requests with tools are refused; "
        "give one that does with --chat_template"]


def test_arguments_are_an_object_even_where_the_schema_leaves_its_type_out() -> None:
    """OpenAI's parameters are an object schema; one that leaves "type" out is taken as an object's (JSON Schema
    would let a string or a number through), and another type is refused (test_bad_tools_and_tool_choice_...)."""
    grammar = tool_call_grammar(V3, [{"name": "f", "parameters": {"properties": {"a": {"type": "integer"}}}}], False)
    [schema] = [json.loads(line.split("%json ", 1)[1]) for line in grammar.splitlines() if "%json" in line]
    assert schema["type"] == "object" and schema["properties"] == {"a": {"type": "integer"}}
