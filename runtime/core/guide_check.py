"""A guide's grammar, checked: llguidance's grammar text for a guided_decoding guide, and the refusal of an invalid
one naming the field and where in the guide the problem lies. No torch: the Triton text models check guides before
the engine model sees them (runtime.core.grammar compiles and runs the grammars)."""

from __future__ import annotations

import ast
import json
import re
import threading
from collections import OrderedDict
from typing import Any, Callable, TypeVar

import llguidance

from runtime.core.sampling_params import GuidedDecodingParams

# JSON as json.dumps writes it: no free whitespace, which a weak or distracted model fills with newlines up to
# max_tokens (llguidance's default allows any); a schema's "x-guidance" object overrides these
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
LOCATION_BUDGET = 4  # an invalid schema's error is located compiling at most ~4 schemas' bytes of its subschemas
LOCATION_FLOOR = 4096  # bytes any schema may compile locating it: a small schema is always located exactly
_SUBSCHEMA_DICTS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
# llguidance compiles a guide recursively, a few KB of stack a level of a $ref or rule chain: a chain of a few
# thousand (about 100 KB of request) overflows a default 8 MB thread stack, which kills the process (SIGSEGV).
# Compiling runs on a thread of this stack (reserved, touched only as deep as it goes), past any guide a server's
# request bodies can carry.
COMPILE_STACK_BYTES = 512 * 2**20
# GBNF reaches llguidance as Lark through a conversion whose time grows with the square of the rules, so a grammar
# of more rules than any real one is refused first
MAX_GBNF_RULES = 1000
# llguidance reads a schema with serde_json, whose recursion limit (128) stops a schema nested ~124 levels deep with
# "recursion limit exceeded"; a deeper one is refused first, with the bound
MAX_SCHEMA_DEPTH = 120
CACHED_GUIDE_BYTES = 65536  # valid guides kept checked for the executor's compile, at most this long
CACHED_GUIDES = 16  # and at most this many, the latest
COMPILE_THREAD = "guide-compile"
T = TypeVar("T")
_stack_size_lock = threading.Lock()
_checked: OrderedDict[tuple[str, str], str] = OrderedDict()  # (kind, text) -> grammar of the latest valid guides
_checked_lock = threading.Lock()  # servers check guides on several threads


def on_compile_stack(compile_: Callable[[], T]) -> T:
    """compile_() on a thread of its own with COMPILE_STACK_BYTES of stack (directly on one already); its exception is
    raised here."""
    if threading.current_thread().name == COMPILE_THREAD:
        return compile_()
    result: list[Any] = []

    def run() -> None:
        try:
            result.append((True, compile_()))
        except BaseException as e:  # re-raised in the caller
            result.append((False, e))

    with _stack_size_lock:  # the size applies to threads started while it is set
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name=COMPILE_THREAD, daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if result[0][0]:
        return result.pop()[1]
    # raised straight from the list, which it leaves: bound to a name here (or left in the list run's frame holds),
    # the exception's traceback, which holds this frame, would make a reference cycle
    raise result.pop()[1]


def _grammar_text(kind: str, text: str) -> str:
    """llguidance's grammar for a guide's kind and text (parsed, not yet validated); the grammar field takes GBNF/EBNF
    (`root ::= ...`, as xgrammar and TensorRT-LLM) or Lark."""
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    return llguidance.grammar_from("grammar", text)


def _line_col(text: str, offset: int) -> str:
    line, line_start = text.count("\n", 0, offset) + 1, text.rfind("\n", 0, offset) + 1
    return f"line {line}, column {offset - line_start + 1}"


def _schema_children(node: dict) -> list[tuple[str, Any]]:
    """(JSON pointer step, subschema) pairs of a schema node."""
    out = []
    for key in _SUBSCHEMA_DICTS:
        if isinstance(node.get(key), dict):
            out += [(f"{key}/{name}", sub) for name, sub in node[key].items()]
    for key in _SUBSCHEMA_ONE:
        if isinstance(node.get(key), dict):
            out.append((key, node[key]))
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out += [(f"{key}/{i}", sub) for i, sub in enumerate(node[key])]
    return [(step, sub) for step, sub in out if isinstance(sub, dict)]


def _schema_error(schema: dict) -> str:
    return llguidance.LLMatcher.validate_grammar(_grammar_text("json", json.dumps(schema)))


def _schema_location(schema: dict, error: str, budget: int) -> str:
    """The JSON pointer of the deepest subschema that fails alone with the same error: where it lies (the engine's
    schema errors name no position). The search compiles subschemas of at most `budget` bytes in all, then names
    the deepest found so far: compiling each level's subschemas costs time quadratic in a deep schema's size."""
    path, node = "", schema
    while isinstance(node, dict):
        for step, sub in _schema_children(node):
            budget -= len(json.dumps(sub))
            if budget < 0:
                return f"{path or '/'} (or below it)"
            try:
                same = _schema_error(sub) == error
            except ValueError:
                same = False
            if same:
                path, node = f"{path}/{step}", sub
                break
        else:
            break
    return path or "/"


def _position(kind: str, text: str, error: str) -> str:
    """Where in the guide the engine's error lies, in the guide's own terms."""
    if kind == "regex":  # "regex parse error:\n    <regex>\n    <carets>\nerror: ..."
        m = re.search(r"regex parse error:\n {4}[^\n]*\n( *)\^", error)
        return f"position {len(m.group(1)) - 4}" if m else "an unknown position"
    if kind == "json":
        return f"{_schema_location(json.loads(text), error, LOCATION_BUDGET * len(text) + LOCATION_FLOOR)} of the schema"
    m = re.search(r"Rule '([^']+)' not found", error) or re.search(r'unknown name: "([^"]+)"', error)
    if m:  # the first use of the undefined name
        found = re.search(rf"(?<![\w-]){re.escape(m.group(1))}(?![\w-])", text)
        return _line_col(text, found.start()) if found else "an unknown position"
    m = re.search(r"at line \d+, ('(?:[^'\\]|\\.)*') \^", error)  # GBNF: 'the text before the problem' ^ '...'
    if m and (before := ast.literal_eval(m.group(1))) and text.find(before) >= 0:
        return _line_col(text, text.find(before) + len(before))
    m = re.search(r"at line (\d+)", error) or re.match(r"(?:at )?(\d+)\((\d+)\)", error)  # Lark: line(column)
    if m:
        return f"line {m.group(1)}" + (f", column {m.group(2)}" if m.lastindex == 2 else "")
    return "an unknown position"


def _problem(error: str) -> str:
    """The engine's message without its echo of the guide, and without Rust's Some(x) / None in number ranges."""
    m = re.search(r"\nerror: ([^\n]*)", error)
    if m:
        return m.group(1)
    first = error.strip().split("\n")[0]
    first = re.sub(r"^(?:at )?\d+\(\d+\): ", "", first)
    first = re.sub(r" at line \d+, '.*$", "", first)
    first = re.sub(r"^Failed to convert the grammar from GBNF to Lark: ", "", first)
    m = re.fullmatch(r"Failed to generate regex for (\w+) range: min=(?:Some\((.*)\)|None), max=(?:Some\((.*)\)|None)",
                     first)
    if m:
        kind, low, high = m.groups()
        bounds = ", ".join(f"{name} {value}" for name, value in (("minimum", low), ("maximum", high)) if value)
        return f"the grammar engine cannot express these {'number' if kind == 'float' else kind} bounds ({bounds})"
    return first


def _json_depth(value: Any) -> int:
    """How deep objects and arrays nest in a JSON value (iterative: a value Python's reader took may nest past the
    recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def check_guide(guide: GuidedDecodingParams, field: str = "guided_decoding") -> str:
    """The guide's grammar; ValueError naming `field` and the position of the problem when the guide is invalid. A
    valid guide checked lately is looked up first, with no compile thread (a server checks a request's guide, then
    its executor compiles the same one)."""
    key = (guide.kind, guide.text)
    with _checked_lock:
        if key in _checked:
            _checked.move_to_end(key)
            return _checked[key]
    grammar = on_compile_stack(lambda: _check_guide(guide, field))
    if len(guide.text) <= CACHED_GUIDE_BYTES:
        with _checked_lock:
            _checked[key] = grammar
            while len(_checked) > CACHED_GUIDES:
                _checked.popitem(last=False)
    return grammar


def _check_guide(guide: GuidedDecodingParams, field: str) -> str:
    name = f"{field}.{guide.kind}" if field == "guided_decoding" else field
    if guide.kind == "json":
        try:
            schema = json.loads(guide.text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e.msg.removesuffix(' at')} at line {e.lineno}, column "
                             f"{e.colno}") from None
        except RecursionError:
            raise ValueError(f"{name} is nested deeper than Python's JSON reader goes") from None
        if (depth := _json_depth(schema)) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{name} is nested {depth} levels deep (objects and arrays); at most {MAX_SCHEMA_DEPTH} "
                             "are taken")
    if guide.kind == "grammar" and "::=" in guide.text and guide.text.count("::=") > MAX_GBNF_RULES:
        raise ValueError(f"{name} has {guide.text.count('::=')} rules; at most {MAX_GBNF_RULES} are taken")
    try:
        grammar = _grammar_text(guide.kind, guide.text)
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except ValueError as e:  # the GBNF-to-Lark conversion raises
        error = str(e)
    if error:
        raise ValueError(f"{name} is invalid at {_position(guide.kind, guide.text, error)}: {_problem(error)}")
    return grammar
