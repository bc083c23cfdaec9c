"""Chat messages -> prompt text with the model's own chat template (Jinja, as transformers renders it).

The template is the checkpoint's (tokenizer_config.json's `chat_template` or chat_template.jinja), run in
Jinja's immutable sandbox with transformers' conventions (trim_blocks, lstrip_blocks, `raise_exception`,
`strftime_now`), so a template written for `apply_chat_template` renders the same text here.
"""

from __future__ import annotations

import functools
from datetime import datetime

from jinja2 import TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime.io.tokenizer import Tokenizer
from serving.request_validation import RequestError


class ChatTemplateFault(RuntimeError):
    """The model's chat template cannot be rendered (its syntax, or a loop or recursion past Jinja's limits): the
    model's fault, not the request's."""


def _raise_exception(message: str) -> None:
    raise RequestError(message)


@functools.lru_cache(maxsize=4)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env.from_string(template)


def render_chat(template: str, messages: list[dict[str, str]], tokenizer: Tokenizer,
                add_generation_prompt: bool = True) -> str:
    """The prompt text of `messages`; RequestError when the template refuses them (its raise_exception or an error
    in rendering them), ChatTemplateFault when it cannot be rendered at all."""
    special = {name: tokenizer.decode([i], skip_special_tokens=False) if i is not None else ""
               for name, i in (("bos_token", tokenizer.bos_token_id), ("eos_token", tokenizer.eos_token_id))}
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **special)
    except RequestError:
        raise
    except (TemplateSyntaxError, ArithmeticError, RecursionError, MemoryError) as e:
        raise ChatTemplateFault(f"the model's chat template cannot be rendered: {type(e).__name__}: {e}") from None
    except TemplateError as e:
        raise RequestError(f"the model's chat template failed on these messages: {e}") from None
