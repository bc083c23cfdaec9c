"""Chat messages -> prompt text with the model's own chat template (Jinja, as transformers renders it).

The template is the checkpoint's (tokenizer_config.json's `chat_template` or chat_template.jinja), run in
Jinja's immutable sandbox with transformers' conventions (trim_blocks, lstrip_blocks, `raise_exception`,
`strftime_now`, its `tojson`; `tools` beside the messages), so a template written for `apply_chat_template`
renders the same text here.
"""

from __future__ import annotations

import functools
import json
import threading
from datetime import datetime
from typing import Any, Mapping

from jinja2 import TemplateError, TemplateSyntaxError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from runtime.io.tokenizer import Tokenizer
from serving.request_validation import RequestError


class ChatTemplateFault(RuntimeError):
    """The model's chat template cannot be rendered (its syntax, or a loop or recursion past Jinja's limits): the
    model's fault, not the request's."""


def _raise_exception(message: str) -> None:
    raise RequestError(message)


MAX_RANGE_ITEMS = 1_000_000  # range() items a render may make in all: Jinja's sandbox bounds each range, not nests
MAX_PRODUCT_ITEMS = 1_000_000  # characters or items a template's `*` may make ('x' * 10**9 takes gigabytes)
MAX_EXPONENT = 1024  # `**`'s: 10 ** 10 ** 8 computes for minutes
MAX_INDENT = 64  # tojson's: each line of the JSON carries it once a level
_render = threading.local()  # the budget of the render running on this thread (renders run on worker threads)


def _over_budget(what: str) -> ChatTemplateFault:
    return ChatTemplateFault(f"the model's chat template cannot be rendered: it {what}, past this server's bound")


def _bounded_range(*args: int) -> range:
    items = safe_range(*args)
    _render.range_items_left -= len(items)
    if _render.range_items_left < 0:
        raise _over_budget(f"loops over more than {MAX_RANGE_ITEMS} range() items")
    return items


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with the work one render may do bounded, so a model's template cannot hold a
    server's worker thread (a server stops only once its threads have): range() items in all, and the size of
    what `*` and `**` make."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if (isinstance(seq, (str, list, tuple)) and isinstance(times, int)
                        and len(seq) * times > MAX_PRODUCT_ITEMS):
                    raise _over_budget(f"makes a sequence of more than {MAX_PRODUCT_ITEMS} items with *")
        if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise _over_budget(f"raises to a power above {MAX_EXPONENT} with **")
        return super().call_binop(context, operator, left, right)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' tojson: JSON as json.dumps writes it (Jinja's own escapes <, >, & and ' and sorts the keys, so a
    template's tools would reach the model in other text than transformers renders)."""
    width = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
    if width > MAX_INDENT:
        raise _over_budget(f"indents JSON by more than {MAX_INDENT} with tojson")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> _BoundedSandbox:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       range=_bounded_range)
    return env


@functools.lru_cache(maxsize=4)
def _compile(template: str):
    return _environment().from_string(template)


def check_template(template: str) -> None:
    """ChatTemplateFault when the template does not compile: a template given to the server is checked at start."""
    try:
        _compile(template)
    except TemplateSyntaxError as e:
        raise ChatTemplateFault(f"{type(e).__name__}: {e}") from None


# what a render defines: render_chat's variables and the environment's functions (range, namespace, raise_exception,
# ...), which a request's chat_template_kwargs may not replace
RESERVED_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "self",
                            *_environment().globals})


@functools.lru_cache(maxsize=4)
def template_uses_tools(template: str) -> bool:
    """Whether the template reads the `tools` variable: one that does not would drop a request's tools without a
    word, and the model would never see them."""
    try:
        return "tools" in meta.find_undeclared_variables(_environment().parse(template))
    except TemplateSyntaxError as e:
        raise ChatTemplateFault(f"the model's chat template cannot be rendered: {type(e).__name__}: {e}") from None


def render_chat(template: str, messages: list[dict[str, Any]], tokenizer: Tokenizer,
                add_generation_prompt: bool = True, variables: Mapping[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text of `messages` and `tools` (OpenAI's tool objects, or None, as transformers'
    apply_chat_template passes them), with the template's own `variables` (a request's chat_template_kwargs, e.g. a
    thinking switch) beside RESERVED_NAMES; RequestError when the template refuses them (its raise_exception or an
    error in rendering them), ChatTemplateFault when it cannot be rendered at all."""
    special = {name: tokenizer.decode([i], skip_special_tokens=False) if i is not None else ""
               for name, i in (("bos_token", tokenizer.bos_token_id), ("eos_token", tokenizer.eos_token_id))}

    def render(extra: Mapping[str, Any]) -> str:
        _render.range_items_left = MAX_RANGE_ITEMS
        return _compile(template).render(**extra, messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **special)

    try:
        return render(variables or {})
    except RequestError:
        raise
    except (TemplateSyntaxError, ArithmeticError, RecursionError, MemoryError) as e:
        raise ChatTemplateFault(f"the model's chat template cannot be rendered: {type(e).__name__}: {e}") from None
    except TemplateError as e:
        raise RequestError(f"the model's chat template failed on these messages: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        # Python's errors in the template's code: the request's chat_template_kwargs (a value of a kind the template
        # does not expect) when it renders without them, else the template's own fault (the messages are text)
        fault = f"{type(e).__name__}: {e}"
    if variables:
        try:
            render({})
        except Exception:
            pass
        else:
            raise RequestError(f"chat_template_kwargs: the model's chat template fails on them: {fault}")
    raise ChatTemplateFault(f"the model's chat template cannot be rendered: {fault}")
