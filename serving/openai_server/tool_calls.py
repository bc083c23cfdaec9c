"""Tool calls in DeepSeek's formats: read from generated text (whole or streamed), and the grammar that makes a model
write them (tool_choice "required" or a named function).

vLLM's `--tool-call-parser` names: `deepseek_v3` reads

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
    \\n<｜tool▁call▁begin｜>...<｜tool▁calls▁end｜>

and `deepseek_v31`

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

The text before the calls is the message's content. One reader serves both the whole output and a stream, fed the
text in any pieces: it decides only what no later text can change (it holds back a suffix that may still become a
marker), so a stream's pieces put together are the whole output's reading. Output that does not follow the format
(no complete call after the opening marker, or a marker where none belongs) is content, as written.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from runtime.core.guide_check import JSON_OPTIONS

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
MAX_NAME_CHARS = 256  # a header whose name runs longer is not a call (the reader would hold the text back for good)
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: no parameters given
_WORD = {"type": re.compile(r"[A-Za-z_]*"), "name": re.compile(r"[\w.:-]*")}


@dataclass(frozen=True)
class ToolSyntax:
    """One model family's tool-call format: what opens a call's arguments (its header: the parts after CALL_BEGIN,
    literals and the words `type` and `name`), what closes them, and what the chat template writes between calls."""

    header: tuple[str, ...]
    args_end: str
    separator: str

    def call_prefix(self, name: str) -> str:
        """A call's text before its arguments."""
        words = {"type": "function", "name": name}
        return CALL_BEGIN + "".join(words.get(part, part) for part in self.header)

    def match_header(self, text: str) -> tuple[str, str | None, int]:
        """("done", name, end) when text starts with a whole header, ("partial", None, 0) while it may still become
        one, ("no", None, 0) when it cannot."""
        pos, name = 0, None
        for part in self.header:
            if part in _WORD:
                end = _WORD[part].match(text, pos).end()
                if end == len(text) and end - pos <= MAX_NAME_CHARS:
                    return "partial", None, 0
                if end == pos or end - pos > MAX_NAME_CHARS:
                    return "no", None, 0
                name = text[pos:end] if part == "name" else name
                pos = end
            else:
                got = text[pos:pos + len(part)]
                if not part.startswith(got):
                    return "no", None, 0
                if len(got) < len(part):
                    return "partial", None, 0
                pos += len(part)
        return "done", name, pos


TOOL_CALL_PARSERS = {
    "deepseek_v3": ToolSyntax(("type", SEP, "name", "\n```json\n"), "\n```" + CALL_END, "\n"),
    "deepseek_v31": ToolSyntax(("name", SEP), CALL_END, ""),
}


def _marker_start(text: str, marker: str) -> int:
    """The length of text's longest suffix that begins `marker` (text that may still become it)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolCallReader:
    """One choice's output read into content and tool calls as it grows. `read` returns what the new text decided:
    content, and tool-call deltas in OpenAI's streamed shape (a call's first: index, id, type, function name and
    arguments so far; later ones: index and the arguments' next piece), one per call per read. Without
    `parallel`, calls after the first are dropped (vLLM's rule for parallel_tool_calls false)."""

    def __init__(self, syntax: ToolSyntax, parallel: bool = True):
        self.syntax, self.parallel = syntax, parallel
        self.state = "text"  # text | open (between calls) | header | args | rest (all content)
        self.pending = ""  # text not decided yet
        self.held = ""  # markers read since the last call began: content if no call follows after all
        self.calls = 0  # calls begun
        self.in_string = self.escaped = False  # where the arguments read so far leave a JSON string
        self._content: list[str] = []
        self._deltas: list[dict[str, Any]] = []

    def read(self, text: str, finished: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """The content and tool-call deltas that `text` (the output's next piece) decides; at the end (`finished`)
        the rest: a call's unfinished arguments stay its arguments (cut by max_tokens, as OpenAI returns them), an
        unfinished marker or call header after a call is dropped, and one before any call is content."""
        self.pending += text
        while self._step():
            pass
        if finished:
            rest = self.held + self.pending
            if self.state in ("args", "open", "header") and self.calls:
                pass  # the calls' markup, cut short (in the arguments: the start of their end marker, held back)
            else:
                self._content.append(rest)
            self.held = self.pending = ""
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas

    def _step(self) -> bool:
        """Decide what the pending text can; whether it did (and may decide more)."""
        s, text = self.syntax, self.pending
        if self.state == "text":
            at = text.find(CALLS_BEGIN)
            if at < 0:
                keep = _marker_start(text, CALLS_BEGIN)
                self._content.append(text[:len(text) - keep])
                self.pending = text[len(text) - keep:]
                return False
            self._content.append(text[:at])
            self.held, self.pending, self.state = CALLS_BEGIN, text[at + len(CALLS_BEGIN):], "open"
            return True
        if self.state == "open":
            rest = text.lstrip()
            skipped = text[:len(text) - len(rest)]
            for marker, state in ((CALL_BEGIN, "header"), (CALLS_END, "text")):
                if rest.startswith(marker):
                    self.held += skipped + marker
                    self.pending, self.state = rest[len(marker):], state
                    if state == "text":  # the calls' end: its markers are no content, unless no call came
                        self._content.append("" if self.calls else self.held)
                        self.held = ""
                    return True
            begun = rest.rstrip("\ufffd")  # the last character, cut by max_tokens mid-way, decodes as U+FFFD
            if CALL_BEGIN.startswith(begun) or CALLS_END.startswith(begun):
                return False
            return self._malformed()
        if self.state == "header":
            found, name, end = s.match_header(text)
            if found == "partial":
                return False
            if found == "no":
                return self._malformed()
            index = self.calls
            self.calls += 1
            if self.parallel or index == 0:
                self._deltas.append({"index": index, "id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                                     "function": {"name": name, "arguments": ""}})
            self.held, self.pending, self.state = "", text[end:], "args"
            return True
        if self.state == "args":
            at, keep = self._arguments_end(text)
            if at < 0:
                self._arguments(text[:len(text) - keep])
                self.pending = text[len(text) - keep:]
                return False
            self._arguments(text[:at])
            self.pending, self.state = text[at + len(s.args_end):], "open"
            return True
        self._content.append(text)  # rest
        self.pending = ""
        return False

    def _arguments_end(self, text: str) -> tuple[int, int]:
        """Where the arguments' end marker starts in text (-1: not there), and how much of text's end may still
        begin it (held back); a marker inside a JSON string is the arguments' text (a string may hold anything, the
        markers too, where a tokenizer does not make them special tokens). Keeps the string state at what it
        decides."""
        end, in_string, escaped = self.syntax.args_end, self.in_string, self.escaped
        for i, ch in enumerate(text):
            if not in_string:
                # the last character, cut by max_tokens mid-way, decodes as U+FFFD: it may still begin the marker
                if text.startswith(end, i) or end.startswith(text[i:].rstrip("\ufffd")):
                    self.in_string, self.escaped = False, False
                    return (i, 0) if text.startswith(end, i) else (-1, len(text) - i)
                in_string = ch == '"'
            elif escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch in '"\n':  # a raw newline ends no JSON string: the output is not JSON, its markers count
                in_string = False
        self.in_string, self.escaped = in_string, escaped
        return -1, 0

    def _malformed(self) -> bool:
        """Text that breaks the format: it and everything after it are content."""
        self._content.append(self.held)
        self.held, self.state = "", "rest"
        return True

    def _arguments(self, text: str) -> None:
        index = self.calls - 1
        if not text or not (self.parallel or index == 0):
            return
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last["index"] == index:
            last["function"]["arguments"] += text
        else:
            self._deltas.append({"index": index, "function": {"arguments": text}})

    def finish_reason(self, reason: str | None, stop_reason: int | str | None) -> str | None:
        """OpenAI's "tool_calls" for an output that made calls, each whole, and ended by itself (not at a stop
        string or stop token id, which may cut a call short)."""
        whole = self.state not in ("header", "args")
        return "tool_calls" if self.calls and whole and reason == "stop" and stop_reason is None else reason


def read_tool_calls(syntax: ToolSyntax, text: str, parallel: bool = True, reason: str | None = "stop",
                    stop_reason: int | str | None = None) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """A whole output's content (None when empty, as OpenAI answers beside tool calls), tool calls in a message's
    shape ({id, type, function: {name, arguments}}) and finish reason (`ToolCallReader.finish_reason`)."""
    reader = ToolCallReader(syntax, parallel)
    content, deltas = reader.read(text, finished=True)
    calls = [{key: d[key] for key in ("id", "type", "function")} for d in deltas]
    return content or None, calls, reader.finish_reason(reason, stop_reason)


def tool_call_grammar(syntax: ToolSyntax, functions: list[dict[str, Any]], parallel: bool) -> str:
    """llguidance's Lark grammar of tool calls in `syntax` to these functions (OpenAI's `function` objects), their
    arguments valid under each one's `parameters` schema written as json.dumps writes JSON: one call, or several
    when `parallel`. Nothing comes before or after the calls."""
    def literal(text: str) -> str:
        return json.dumps(text, ensure_ascii=False)

    more = f" ({literal(syntax.separator)} call)*" if parallel and syntax.separator else " call*" if parallel else ""
    lines = [f"start: {literal(CALLS_BEGIN)} call{more} {literal(CALLS_END)}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, f in enumerate(functions):
        # arguments are an object, written as json.dumps writes it (a tool's own x-guidance is refused)
        schema = {"type": "object", **(f.get("parameters") or EMPTY_PARAMETERS), "x-guidance": JSON_OPTIONS}
        lines += [f"call_{i}: {literal(syntax.call_prefix(f['name']))} args_{i} {literal(syntax.args_end)}",
                  f"args_{i}: %json {json.dumps(schema)}"]
    return "\n".join(lines) + "\n"
