"""The OpenAI API's request bodies read into what the executor takes, and its response objects.

Request values are checked as JSON gives them (a bool is not an integer, NaN is no number), before any
text is tokenized; every refusal is an `APIError` naming the parameter, answered as OpenAI answers
one: HTTP 400 with `{"error": {"message", "type": "invalid_request_error", "param", "code"}}`. Keys
this server does not know are refused, as OpenAI refuses them ("Unrecognized request argument
supplied"), so a misspelt `max_token` is not silently ignored. Parameters of the API this server does
not implement are accepted at their neutral value and refused otherwise, naming what it takes.
"""

from __future__ import annotations

import codecs
import math
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from runtime.core.guide_check import check_guide
from runtime.core.sampling import TokenLogprob
from runtime.core.sampling_params import (MAX_LOGPROBS, PENALTY_LIMIT, REPETITION_PENALTY_RANGE, GuidedDecodingParams,
                                          SamplingParams, seed_from_client)
from runtime.executors.outputs import RequestStats
from runtime.io.tokenizer import Tokenizer, utf8_size
from serving.openai_server.chat import RESERVED_NAMES, ChatTemplateFault, render_chat, template_uses_tools
from serving.openai_server.tool_calls import ToolSyntax, tool_call_grammar
from serving.request_validation import (CONTEXT_BYTES, INT32_MAX, RequestError, bounds_text, refused_parameter,
                                       shown_keys)

MAX_N = 128  # choices per request, as OpenAI allows
MAX_SEQUENCES = 2048  # prompts x (best_of or n) a completions request runs: one small body could queue 10^5
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Log-probabilities of prompt tokens a response carries (prompt_logprobs, or echo with logprobs; each alternative
# one): they cost the server no generation, so a small body of many prompts could ask a response of gigabytes
MAX_PROMPT_LOGPROBS = 2**18

# Structured output besides OpenAI's response_format: vLLM's guided_* extras (also SGLang's and TGI clients' habit)
# and vLLM's current structured_outputs object, by GuidedDecodingParams field
GUIDE_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS_KEYS = {"json", "regex", "grammar", "json_object"}

# Parameters taken at their neutral value only: name -> (is it neutral?, what this server takes). A parameter sent
# as null is absent (OpenAI's clients and vLLM's send nulls for what they leave unset).
NEUTRAL: dict[str, tuple[Any, str]] = {
    "suffix": (lambda v: False, "null"),
    # the deprecated function calling: tools and tool_choice do it
    "functions": (lambda v: v == [], "null or [] (send tools)"),
    "function_call": (lambda v: v == "none", "null or \"none\" (send tool_choice)"),
    "store": (lambda v: v is False, "null or false (nothing is stored)"),
    "modalities": (lambda v: v == ["text"], "null or [\"text\"]"),
    **dict.fromkeys(("audio", "reasoning_effort", "verbosity", "web_search_options"), (lambda v: False, "null")),
    # vLLM's extras at their defaults
    "skip_special_tokens": (lambda v: v is True, "null or true (special tokens are never in the text)"),
    "spaces_between_special_tokens": (lambda v: v is True, "null or true"),
    "continue_final_message": (lambda v: v is False, "null or false"),
    "priority": (lambda v: v == 0 and not isinstance(v, bool), "null or 0 (requests are served first come, "
                 "first served)"),
    "use_beam_search": (lambda v: v is False, "null or false"),
}
# Parameters that do not change what is generated, accepted and not used: OpenAI's bookkeeping and routing hints,
# `prediction` (a latency hint), vLLM's choice of structured-output backend (this server has one)
IGNORED = {"user", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "prediction", "request_id",
           "guided_decoding_backend"}
CHAT_ONLY_NEUTRAL = {"functions", "function_call", "store", "modalities", "audio",
                     "reasoning_effort", "verbosity", "web_search_options", "continue_final_message"}
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop",
          "stop_token_ids", "seed", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "min_tokens", "min_p", "bad_words", "num_draft_tokens", "logit_bias", "response_format", "structured_outputs",
          "prompt_logprobs", "return_tokens_as_token_ids", "return_token_ids", "include_stop_str_in_output",
          *GUIDE_KEYS, *IGNORED, *(set(NEUTRAL) - CHAT_ONLY_NEUTRAL)}
COMPLETION_KEYS = COMMON | {"prompt", "echo", "logprobs", "suffix", "best_of"}
CHAT_KEYS = COMMON | CHAT_ONLY_NEUTRAL | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                          "tool_choice", "parallel_tool_calls", "add_generation_prompt",
                                          "chat_template_kwargs"}
# vLLM's /tokenize (a text, or messages as chat renders them) and /detokenize
TOKENIZE_KEYS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
TOKENIZE_CHAT_KEYS = {"model", "messages", "tools", "add_generation_prompt", "chat_template_kwargs",
                      "return_token_strs", "add_special_tokens", "continue_final_message"}
DETOKENIZE_KEYS = {"model", "tokens"}
# What an assistant message OpenAI's client returned carries, sent back in the next turn: taken when null or empty
MESSAGE_EXTRAS = {"refusal": (None,), "function_call": (None,), "audio": (None,), "annotations": (None, [])}
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", *MESSAGE_EXTRAS}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
TOOL_CHOICES = ("none", "auto", "required")


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Generation:
    """One API request as the executor runs it: n choices for each prompt, choice i of prompt p at index
    p * n + i (OpenAI's order)."""

    prompts: list[list[int]]
    params: SamplingParams  # n choices per prompt (the executor's n / best_of); logprobs set: return them
    stream: bool = False
    include_usage: bool = False
    echo_texts: list[str] | None = None  # completions with echo: each prompt's text, put before its output
    guide_field: str | None = None  # where its structured output came from, as the client wrote it (errors name it)
    echo_logprobs: bool = False  # echo with logprobs: the prompt's tokens' logprobs before the output's
    echo_only: bool = False  # max_tokens 0 with echo (scoring a text): one token is generated and not returned
    continuous_usage: bool = False  # streamed: usage so far in every chunk (vLLM's continuous_usage_stats)
    prompt_logprobs: int | None = None  # vLLM's extra: the prompt's logprobs with this many alternatives, returned
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids, streamed or not
    role: str = "assistant"  # chat's answer: without a generation prompt, the last message's role (vLLM's rule)
    tool_syntax: ToolSyntax | None = None  # chat with tools (tool_choice not "none"): read tool calls in this format
    parallel_tool_calls: bool = True  # false: the first tool call only
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def guide_parameter(self) -> str | None:
        return None if self.guide_field is None else self.guide_field.split(".")[0]

    def guide_message(self, message: str) -> str:
        """An executor's message about the guide (`guided_decoding.json: ...`) in the client's words."""
        return message if self.guide_field is None else guide_message(message, self.guide_field)


# ---- JSON values -------------------------------------------------------------------------------------------------
def _integer(body: dict, name: str, low: int, high: int, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise APIError(f"{name} must be an integer, got {value!r}", name)
    if not low <= value <= high:
        raise APIError(f"{name} must be an integer in [{low}, {high}], got {value}", name)
    return value


def _number(body: dict, name: str, low: float, high: float, default: float, above: bool = False) -> float:
    """A finite number in [low, high] ((low, high] when `above`)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise APIError(f"{name} must be a finite number, got {value!r}", name)
    if not ((low < value) if above else (low <= value)) or value > high:
        raise APIError(f"{name} must be{bounds_text(low, high, above)}, got {value}", name)
    return float(value)


def _flag(body: dict, name: str, default: bool = False, within: str = "") -> bool:
    """body[name] as a boolean; `within` names the object body is in ("stream_options.")."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(f"{within}{name} must be true or false, got {value!r}", within + name)
    return value


def _utf8_size(text: str, name: str, param: str) -> int:
    """`utf8_size`, its refusal an APIError naming `param`."""
    try:
        return utf8_size(text, name)
    except ValueError as e:
        raise APIError(str(e), param) from None


def _text(value: Any, name: str, max_bytes: int) -> str:
    """A string bounded in bytes before anything tokenizes it."""
    if not isinstance(value, str):
        raise APIError(f"{name} must be a string, got {type(value).__name__}", name)
    # at least one byte a character: a longer string is refused before it is encoded
    size = len(value) if len(value) > max_bytes else _utf8_size(value, name, name)
    if size > max_bytes:
        raise APIError(f"{name} is longer than the {max_bytes} bytes {CONTEXT_BYTES}", name)
    return value


def _bad_words(body: dict, tokenizer: Tokenizer) -> tuple[int, ...]:
    """vLLM's bad_words, read as vLLM reads them: each word as it starts the text, and after a space where that is as
    many tokens and another first token; a word of several tokens is refused (this runtime bans single tokens)."""
    words = body.get("bad_words", [])
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise APIError(f"bad_words must be a list of non-blank strings, got {str(words)[:120]}", "bad_words")
    banned = []
    for word in words:
        ids = tokenizer.encode(word.lstrip(), add_bos=False)
        if len(ids) != 1:
            raise APIError(f"bad_words: {word.lstrip()[:120]!r} is {len(ids)} tokens; this server bans single-token "
                           "words only", "bad_words")
        spaced = tokenizer.encode(" " + word.lstrip(), add_bos=False)
        banned += ids + (spaced if len(spaced) == 1 and spaced != ids else [])
    return tuple(dict.fromkeys(banned))


def _logit_bias(body: dict) -> dict[int, Any] | None:
    """OpenAI's logit_bias with its keys, which JSON makes strings, as token ids (SamplingParams checks the rest)."""
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError(f"logit_bias must be an object mapping token ids to numbers, got {str(value)[:120]}",
                       "logit_bias")
    bad = [key for key in value if not re.fullmatch(r"[0-9]{1,10}", key)]
    if bad:
        raise APIError(f"logit_bias keys must be token ids (non-negative integers), got {bad[0][:40]!r}", "logit_bias")
    return {int(key): v for key, v in value.items()}


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(f"stop must be a non-empty string or a list of them, got {value!r}", "stop")
    for i, stop in enumerate(stops):  # text that can never appear in the output would never stop it
        _utf8_size(stop, f"stop[{i}]", "stop")
    return tuple(stops)


def _token_list(value: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise APIError(f"{name} must be a list of integer token ids", name)
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise APIError(f"{name} must hold token ids in [0, {vocab_size}), got {bad[:5]}", name)
    return value


def _check_keys(body: Any, known: set[str]) -> dict:
    """The body without its null parameters (absent, as OpenAI reads them); unknown ones and non-neutral values of
    what this server does not implement refused."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    body = {k: v for k, v in body.items() if v is not None}
    unknown = sorted(set(body) - known)
    if unknown:
        raise APIError(f"Unrecognized request argument supplied: {shown_keys(unknown)}", shown_keys(unknown[:1]))
    for name, (neutral, takes) in NEUTRAL.items():
        if name in body and not neutral(body[name]):
            raise APIError(f"{name} {body[name]!r} is not supported by this server; it takes {takes}", name)
    return body


# ---- requests ----------------------------------------------------------------------------------------------------
def _response_format(value: Any) -> tuple[GuidedDecodingParams | None, str]:
    """OpenAI's response_format: text, json_object, or json_schema with its schema (name and strict are accepted;
    the schema is always enforced)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return None, ""
    if kind == "json_object" and set(value) == {"type"}:
        return GuidedDecodingParams(json_object=True), "response_format"
    spec = value.get("json_schema") if kind == "json_schema" and set(value) == {"type", "json_schema"} else None
    if not isinstance(spec, dict) or set(spec) - {"name", "description", "schema", "strict"} or \
            not isinstance(spec.get("schema"), dict):
        raise APIError("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                       "\"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}, got "
                       f"{str(value)[:120]}", "response_format")
    return GuidedDecodingParams(json=spec["schema"]), "response_format.json_schema.schema"


def _guide_parameters(body: dict) -> list[str]:
    """The request's parameters that constrain its output (one is allowed)."""
    return [k for k in ("response_format", *GUIDE_KEYS, "structured_outputs") if body.get(k) is not None]


def guide_message(message: str, field: str) -> str:
    """A refusal of the executor's guided_decoding.<kind> said of the request's field."""
    return re.sub(r"^guided_decoding\.\w+", field, message)


def _guide(body: dict) -> tuple[GuidedDecodingParams | None, str | None]:
    """The request's structured output: response_format, a guided_* extra or structured_outputs (one of them), its
    grammar checked here so a refusal names the field as the client wrote it, and where the problem lies."""
    given = _guide_parameters(body)
    if len(given) > 1:
        raise APIError(f"{' and '.join(given)} both constrain the output; send one", given[1])
    if not given:
        return None, None
    name, value = given[0], body[given[0]]
    if name == "response_format":
        guide, field = _response_format(value)
    elif name == "structured_outputs":
        if not isinstance(value, dict) or len(value) != 1 or not set(value) <= STRUCTURED_OUTPUTS_KEYS:
            raise APIError(f"structured_outputs must hold one of {', '.join(sorted(STRUCTURED_OUTPUTS_KEYS))}, got "
                           f"{str(value)[:120]}", name)
        [(key, v)] = value.items()
        guide, field = GuidedDecodingParams(**{key: v}), f"structured_outputs.{key}"
    else:
        guide, field = GuidedDecodingParams(**{GUIDE_KEYS[name]: value}), name
    if guide is None:
        return None, None
    try:
        guide.validate()
        check_guide(guide, field)
    except ValueError as e:
        raise APIError(guide_message(str(e), field), name) from None
    return guide, field


def _sampling(body: dict, tokenizer: Tokenizer, max_tokens: int | None, logprobs: int | None, stream: bool,
              guide: tuple[GuidedDecodingParams, str] | None = None) -> tuple[SamplingParams, str | None]:
    """The request's sampling parameters: its n choices (of best_of candidates) run as one executor request each
    prompt, choice i seeded with seed + i (the executor's rule), so they repeat across calls. `guide`: the grammar
    and its parameter where the request's tool_choice makes one (else its structured-output parameter's)."""
    n = _integer(body, "n", 1, MAX_N, 1)
    best_of = _integer(body, "best_of", 1, MAX_N, None)
    if best_of is not None and best_of > n and stream:  # OpenAI's rule: they are chosen once all have finished
        raise APIError(f"best_of {best_of} > n {n} cannot be streamed: the best are known once all have finished; "
                       "send stream: false or best_of = n", "best_of")
    top_k = _integer(body, "top_k", -1, INT32_MAX, 0)
    seed = _integer(body, "seed", -(2**63), 2**63 - 1, None)
    guide, guide_field = guide or _guide(body)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, math.inf, 1.0),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0, above=True),
        min_p=_number(body, "min_p", 0.0, 1.0, 0.0),
        top_k=0 if top_k == -1 else top_k,  # vLLM's -1 and OpenAI-style 0 both mean all tokens
        seed=seed_from_client(seed),
        stop=_stop(body),
        stop_token_ids=tuple(_token_list(body.get("stop_token_ids") or [], "stop_token_ids", tokenizer.vocab_size)),
        bad_token_ids=_bad_words(body, tokenizer),
        num_draft_tokens=_integer(body, "num_draft_tokens", 0, INT32_MAX, None),
        ignore_eos=_flag(body, "ignore_eos"),
        logprobs=logprobs,
        presence_penalty=_number(body, "presence_penalty", -PENALTY_LIMIT, PENALTY_LIMIT, 0.0),
        frequency_penalty=_number(body, "frequency_penalty", -PENALTY_LIMIT, PENALTY_LIMIT, 0.0),
        repetition_penalty=_number(body, "repetition_penalty", *REPETITION_PENALTY_RANGE, 1.0),
        min_tokens=_integer(body, "min_tokens", 0, INT32_MAX, 0),
        guided_decoding=guide,
        n=n,
        best_of=best_of,
        logit_bias=_logit_bias(body),
        include_stop_str_in_output=_flag(body, "include_stop_str_in_output"))
    return params, guide_field


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise APIError("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise APIError(f"stream_options takes include_usage (and continuous_usage_stats), got {options!r}",
                       "stream_options")
    include = _flag(options, "include_usage", within="stream_options.")  # continuous_usage_stats adds to it (vLLM)
    return include, include and _flag(options, "continuous_usage_stats", within="stream_options.")


def _vllm_extras(body: dict, stream: bool) -> dict[str, Any]:
    """Generation's fields from vLLM's prompt_logprobs (not streamed: they come with the whole response),
    return_tokens_as_token_ids and return_token_ids."""
    prompt = body.get("prompt_logprobs")
    if prompt == -1:  # vLLM's whole vocabulary, past its default --max-logprobs too
        raise APIError(f"prompt_logprobs -1 (every token of the vocabulary) is not served; at most {MAX_LOGPROBS}",
                       "prompt_logprobs")
    prompt = _integer(body, "prompt_logprobs", 0, MAX_LOGPROBS, None)
    if prompt is not None and stream:  # vLLM takes 0 streamed, and streams none
        if prompt:
            raise APIError("prompt_logprobs are not streamed (they come with the whole response); send stream: "
                           "false", "prompt_logprobs")
        prompt = None
    return {"prompt_logprobs": prompt, "tokens_as_ids": _flag(body, "return_tokens_as_token_ids"),
            "return_token_ids": _flag(body, "return_token_ids")}


def _check_prompt_logprobs(prompts: list[list[int]], copies: int, alternatives: dict[str, int]) -> None:
    """Refuse a response of more than MAX_PROMPT_LOGPROBS prompt log-probabilities: `copies` of each prompt's (one a
    choice), each token's with its alternatives, for each parameter asking them (`alternatives`: parameter -> how
    many; prompt_logprobs and echo's logprobs each carry their own)."""
    tokens = sum(map(len, prompts))
    asked = tokens * copies * sum(1 + n for n in alternatives.values())
    if asked > MAX_PROMPT_LOGPROBS:
        per = f" x {copies} choices each" if copies > 1 else ""
        what = " and ".join(f"{name} {n}" for name, n in alternatives.items())
        raise APIError(f"{what} over {tokens} prompt tokens{per} asks {asked} log-probabilities (each token's and "
                       f"its alternatives'); at most {MAX_PROMPT_LOGPROBS} a request: send fewer or shorter prompts a "
                       "request, or fewer alternatives", next(iter(alternatives)))


def completion_request(body: Any, tokenizer: Tokenizer, max_text_bytes: int) -> Generation:
    """POST /v1/completions: prompt is a string, a list of strings, a list of token ids or a list of those."""
    body = _check_keys(body, COMPLETION_KEYS)
    logprobs = _integer(body, "logprobs", 0, MAX_LOGPROBS, None)
    echo = _flag(body, "echo")
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError("prompt is required", "prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise APIError("prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                       "prompt")
    if len(prompt) > MAX_SEQUENCES:  # before any is tokenized
        raise APIError(f"prompt holds {len(prompt)} prompts; at most {MAX_SEQUENCES} a request", "prompt")
    prompts, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            texts.append(_text(p, "prompt", max_text_bytes))
            prompts.append(tokenizer.encode(p))  # "" is the beginning-of-text token alone, as OpenAI takes it
            if not prompts[-1]:
                raise APIError("prompt must not be empty (this tokenizer adds no beginning-of-text token)", "prompt")
        else:
            ids = _token_list(p, "prompt", tokenizer.vocab_size)
            if not ids:
                raise APIError("prompt must not be empty", "prompt")
            texts.append(tokenizer.decode(ids))
            prompts.append(ids)
    stream = _flag(body, "stream")
    max_tokens = _integer(body, "max_tokens", 0, INT32_MAX, COMPLETIONS_DEFAULT_MAX_TOKENS)
    if max_tokens == 0 and not echo:
        raise APIError("max_tokens must be at least 1 (0 returns the prompt alone: it needs echo: true)", "max_tokens")
    if max_tokens == 0 and stream:
        raise APIError("max_tokens 0 (the prompt alone, as for scoring it) is not streamed; send stream: false",
                       "max_tokens")
    if max_tokens == 0 and (min_tokens := _integer(body, "min_tokens", 0, INT32_MAX, 0)):  # said of the 0 sent,
        raise APIError(f"min_tokens must be an integer in [0, max_tokens (0)], got {min_tokens}", "min_tokens")
    params, guide_field = _sampling(body, tokenizer, max_tokens or 1, logprobs, stream)  # not the 1 run
    extras = _vllm_extras(body, stream)
    if echo and logprobs is not None or extras["prompt_logprobs"] is not None:  # echo's: the prompt's too (scoring)
        asked = [n for n in (logprobs if echo else None, extras["prompt_logprobs"]) if n is not None]
        params = replace(params, prompt_logprobs=max(asked))
        _check_prompt_logprobs(prompts, params.n, {name: n for name, n in (
            ("prompt_logprobs", extras["prompt_logprobs"]), ("logprobs", logprobs if echo else None)) if n is not None})
    if len(prompts) * params.num_sequences > MAX_SEQUENCES:
        name = params.num_sequences_name
        raise APIError(f"{len(prompts)} prompts x {name} {params.num_sequences} = "
                       f"{len(prompts) * params.num_sequences} sequences; at most {MAX_SEQUENCES} a request", name)
    include_usage, continuous = _stream_options(body, stream)
    return Generation(prompts, params, stream, include_usage, texts if echo else None, guide_field,
                      echo_logprobs=echo and logprobs is not None, echo_only=max_tokens == 0,
                      continuous_usage=continuous, **extras)


def _text_bytes(value: Any) -> int:
    """The UTF-8 bytes of the strings in a message (_text refused lone surrogates)."""
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    if isinstance(value, (dict, list)):
        return sum(map(_text_bytes, value.values() if isinstance(value, dict) else value))
    return 0


def _message_tool_calls(value: Any, where: str, max_text_bytes: int) -> list[dict[str, Any]]:
    """An assistant message's tool calls as OpenAI's client returns them, for the template as transformers passes them:
    `arguments` the JSON text the call carried (DeepSeek's templates write it as it is; vLLM parses it into an object
    first)."""
    calls = []
    for j, call in enumerate(value if isinstance(value, list) else [value]):
        at = f"{where}.tool_calls[{j}]"
        f = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(value, list) or not isinstance(f, dict) or set(f) != {"name", "arguments"}
                or not {"id", "function"} <= set(call) <= {"id", "type", "function"}
                or call.get("type", "function") != "function"):
            raise APIError(f"{where}.tool_calls must be a list of {{\"id\", \"type\": \"function\", \"function\": "
                           f"{{\"name\", \"arguments\"}}}}, got {str(call)[:120]}", "messages")
        calls.append({"id": _text(call["id"], f"{at}.id", 256), "type": "function",
                      "function": {"name": _text(f["name"], f"{at}.function.name", 256),
                                   "arguments": _text(f["arguments"], f"{at}.function.arguments", max_text_bytes)}})
    return calls


def _messages(body: dict, max_text_bytes: int) -> list[dict[str, Any]]:
    """The messages as the chat template gets them: role, content and name; an assistant's tool calls; a tool
    message's tool_call_id."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list of {role, content}", "messages")
    out, total = [], 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or set(m) - MESSAGE_KEYS or "role" not in m:
            raise APIError(f"{where} must be an object with role and content (and name, tool_calls, tool_call_id), "
                           f"got {str(m)[:80]}", "messages")
        if m["role"] == "function":
            raise APIError(f"{where}.role 'function' (the deprecated function calling) is not supported; send tool "
                           "messages", "messages")
        if not isinstance(m["role"], str) or m["role"] not in ROLES:
            raise APIError(f"{where}.role must be one of {', '.join(ROLES)}, got {m['role']!r}", "messages")
        for key, empty in MESSAGE_EXTRAS.items():  # what the client's last answer carried, sent back
            if m.get(key) not in empty:
                raise APIError(f"{where}.{key} must be null or empty: this server does no audio, annotations or "
                               "deprecated function calling", "messages")
        tool_calls = m.get("tool_calls") or None  # null and [] are none, as vLLM drops an empty list
        if tool_calls is not None and m["role"] != "assistant":
            raise APIError(f"{where}.tool_calls: only assistant messages make tool calls", "messages")
        if (m["role"] == "tool") != (m.get("tool_call_id") is not None):
            raise APIError(f"{where}.tool_call_id (the id of the call it answers) is required on a tool message, and "
                           "only there", "messages")
        content = m.get("content")
        if content is None and m["role"] == "assistant":  # OpenAI's assistant turns may have no content
            content = None if tool_calls else ""  # beside tool calls, as sent: DeepSeek's templates test for none
        elif content is None:  # a template would write it as the text "None"
            raise APIError(f"{where}.content is required on a {m['role']} message", "messages")
        if isinstance(content, list):  # content parts: text only, joined by lines as vLLM and trtllm-serve join them
            if not all(isinstance(p, dict) and p.get("type") == "text" and set(p) == {"type", "text"} and
                       isinstance(p["text"], str) for p in content):
                raise APIError(f"{where}.content parts must be {{\"type\": \"text\", \"text\": ...}}; this server "
                               "takes text only", "messages")
            content = "\n".join(p["text"] for p in content)
        message = {"role": ROLES[m["role"]],
                   "content": None if content is None else _text(content, f"{where}.content", max_text_bytes)}
        if m.get("name") is not None:  # the template may use it, as vLLM passes it on
            message["name"] = _text(m["name"], f"{where}.name", 256)
        if tool_calls is not None:
            message["tool_calls"] = _message_tool_calls(tool_calls, where, max_text_bytes)
        if m["role"] == "tool":
            message["tool_call_id"] = _text(m["tool_call_id"], f"{where}.tool_call_id", 256)
        total += _text_bytes(message)
        if total > max_text_bytes:
            raise APIError(f"messages are longer than the {max_text_bytes} bytes that can fit the model's context",
                           "messages")
        out.append(message)
    return out


def _tools(body: dict) -> list[dict[str, Any]] | None:
    """OpenAI's tools (functions), checked, for the chat template as sent; None for none (null or [])."""
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise APIError(f"tools must be a list of {{\"type\": \"function\", \"function\": {{...}}}}, got "
                       f"{str(tools)[:120]}", "tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) != {"type", "function"}:
            raise APIError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", \"description\", "
                           f"\"parameters\"}}}} (function tools only), got {str(tool)[:120]}", where)
        f = tool["function"]
        if not isinstance(f, dict) or set(f) - {"name", "description", "parameters", "strict"}:
            raise APIError(f"{where}.function must be an object of name, description, parameters and strict, got "
                           f"{str(f)[:120]}", f"{where}.function")
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise APIError(f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes, got "
                           f"{str(name)[:80]!r}", f"{where}.function.name")
        if name in names:
            raise APIError(f"{where}.function.name {name!r} is given twice; the functions' names must differ",
                           f"{where}.function.name")
        names.add(name)
        for key, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema (an object)"),
                                ("strict", bool, "true or false")):
            if f.get(key) is not None and not isinstance(f[key], kind):
                raise APIError(f"{where}.function.{key} must be {what}, got {str(f[key])[:80]}",
                               f"{where}.function.{key}")
        parameters = f.get("parameters") or {}
        if parameters.get("type", "object") != "object":  # a call's arguments are a JSON object (OpenAI's rule)
            raise APIError(f"{where}.function.parameters must be a JSON schema of \"type\": \"object\" (a call's "
                           f"arguments are an object), got type {str(parameters.get('type'))[:40]}",
                           f"{where}.function.parameters")
        if "x-guidance" in parameters:  # the tool-call grammar sets how the arguments are written
            raise APIError(f"{where}.function.parameters: x-guidance is not taken in a tool's schema",
                           f"{where}.function.parameters")
    return tools


def _tool_choice(body: dict, tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    """"none", "auto", "required", or the named function (its object in tools); by default "auto" with tools and
    "none" without, as OpenAI."""
    value = body.get("tool_choice", "auto" if tools else "none")
    named = value.get("function") if isinstance(value, dict) else None
    if value not in TOOL_CHOICES and not (
            isinstance(named, dict) and set(value) == {"type", "function"} and value["type"] == "function"
            and set(named) == {"name"} and isinstance(named["name"], str)):
        raise APIError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                       f"\"function\": {{\"name\": ...}}}}, got {str(value)[:120]}", "tool_choice")
    if value in ("none", "auto"):
        return value
    if not tools:
        raise APIError(f"tool_choice {str(value)[:120]} needs tools to call", "tool_choice")
    if value == "required":
        return value
    function = next((t["function"] for t in tools if t["function"]["name"] == named["name"]), None)
    if function is None:
        raise APIError(f"tool_choice names the function {named['name'][:80]!r}, which is not among tools ("
                       f"{', '.join(t['function']['name'] for t in tools)})", "tool_choice")
    return function


def _tool_guide(syntax: ToolSyntax, tools: list[dict[str, Any]], choice: dict[str, Any] | str, parallel: bool
                ) -> tuple[GuidedDecodingParams, str]:
    """The grammar of tool_choice "required" (one call or more, to any of the tools; one without parallel tool
    calls) or of a named function (one call to it), each call's arguments valid under its parameters schema."""
    functions = [t["function"] for t in tools] if choice == "required" else [choice]
    for f in functions:  # each schema checked alone: a refusal names its function and where in its schema
        if f.get("parameters") is not None:
            field = f"tools[{next(i for i, t in enumerate(tools) if t['function'] is f)}].function.parameters"
            try:
                check_guide(GuidedDecodingParams(json=f["parameters"]), field)
            except ValueError as e:
                raise APIError(str(e).replace("guided_decoding.json", field), field) from None
    guide = GuidedDecodingParams(grammar=tool_call_grammar(syntax, functions, parallel and choice == "required"))
    try:
        check_guide(guide, "tool_choice")
    except ValueError as e:
        raise APIError(str(e), "tool_choice") from None
    return guide, "tool_choice"


def _chat_prompt(body: dict, tokenizer: Tokenizer, max_text_bytes: int, tools: list[dict[str, Any]] | None,
                 template: str | None) -> list[int]:
    """A chat request's messages and tools rendered with the server's chat template (its generation prompt unless
    add_generation_prompt is false), as token ids."""
    messages = _messages(body, max_text_bytes)
    if template is None:
        raise APIError("this model has no chat template (chat_template in tokenizer_config.json or a "
                       "chat_template.jinja file); use /v1/completions", "messages")
    try:
        dropped = tools is not None and not template_uses_tools(template)
    except ChatTemplateFault as e:
        raise APIError(str(e), status=500, type="server_error") from None
    if dropped:
        raise APIError("tools cannot reach this model: its chat template does not use them (it would drop them "
                       "without a word); give dsv3-serve a --chat_template that renders `tools`", "tools")
    extra = body.get("chat_template_kwargs", {})
    if not isinstance(extra, dict) or set(extra) & RESERVED_NAMES:
        raise APIError("chat_template_kwargs must be an object of the template's own variables (not "
                       f"{', '.join(sorted(RESERVED_NAMES))}), got {str(extra)[:120]}", "chat_template_kwargs")
    try:
        text = render_chat(template, messages, tokenizer,
                           add_generation_prompt=_flag(body, "add_generation_prompt", True), variables=extra,
                           tools=tools)
    except RequestError as e:
        raise APIError(str(e), "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages") \
            from None
    except ChatTemplateFault as e:
        raise APIError(str(e), status=500, type="server_error") from None
    return tokenizer.encode(_text(text, "messages", max_text_bytes), add_bos=False)  # the template places bos


def tokenize_request(body: Any, tokenizer: Tokenizer, max_text_bytes: int, chat_template: str | None
                     ) -> tuple[list[int], bool]:
    """POST /tokenize (vLLM's): a prompt's token ids (with the special tokens the tokenizer adds, its
    beginning-of-text token, unless add_special_tokens is false), or chat messages' as /v1/chat/completions renders
    them with `chat_template`; and whether the token strings are asked for."""
    chat = isinstance(body, dict) and "messages" in body
    body = _check_keys(body, TOKENIZE_CHAT_KEYS if chat else TOKENIZE_KEYS)
    if chat:
        if _flag(body, "add_special_tokens"):  # the template places them
            raise APIError("add_special_tokens true is not supported with messages; it takes null or false (the chat "
                           "template places the special tokens)", "add_special_tokens")
        return (_chat_prompt(body, tokenizer, max_text_bytes, _tools(body), chat_template),
                _flag(body, "return_token_strs"))
    if body.get("prompt") is None:
        raise APIError("prompt (or messages) is required", "prompt")
    prompt = _text(body["prompt"], "prompt", max_text_bytes)
    add_bos = None if _flag(body, "add_special_tokens", True) else False  # True: as the tokenizer adds them
    return tokenizer.encode(prompt, add_bos=add_bos), _flag(body, "return_token_strs")


def detokenize_request(body: Any, tokenizer: Tokenizer) -> list[int]:
    """POST /detokenize (vLLM's): token ids, whose text the server returns."""
    body = _check_keys(body, DETOKENIZE_KEYS)
    if body.get("tokens") is None:
        raise APIError("tokens is required", "tokens")
    return _token_list(body["tokens"], "tokens", tokenizer.vocab_size)


def chat_request(body: Any, tokenizer: Tokenizer, max_text_bytes: int, *, max_seq_len: int,
                 chat_template: str | None, tool_syntax: ToolSyntax | None = None) -> Generation:
    """POST /v1/chat/completions: messages (and tools) rendered with `chat_template` (the checkpoint's, or the
    server's --chat_template); tool calls read from the output in `tool_syntax` (the server's --tool_call_parser),
    which tools need unless tool_choice is "none"."""
    body = _check_keys(body, CHAT_KEYS)
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS, None)
    if top is not None and not _flag(body, "logprobs"):
        raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if _flag(body, "logprobs") else None
    tools = _tools(body)
    tool_choice = _tool_choice(body, tools)
    parallel = _flag(body, "parallel_tool_calls", True)
    ids = _chat_prompt(body, tokenizer, max_text_bytes, tools, chat_template)
    calls = tools is not None and tool_choice != "none"  # "none": the tools are rendered, the output is not read
    if calls and tool_syntax is None:
        raise APIError("tools need a tool-call parser to read the calls in the output: start dsv3-serve with "
                       "--tool_call_parser deepseek_v3 or deepseek_v31 (vLLM's --tool-call-parser), or send "
                       "tool_choice \"none\"", "tools")
    guide = _tool_guide(tool_syntax, tools, tool_choice, parallel) if calls and tool_choice != "auto" else None
    if guide is not None and (given := _guide_parameters(body)):
        raise APIError(f"tool_choice and {given[0]} both constrain the output; send one",
                       "tool_choice")
    generation_prompt = _flag(body, "add_generation_prompt", True)
    if len(ids) >= max_seq_len:  # said of the messages: the client never saw the rendered prompt
        raise APIError(f"messages{' and tools' if tools else ''} come to {len(ids)} tokens with the chat template; "
                       f"max_seq_len is {max_seq_len}", "messages")
    stream = _flag(body, "stream")
    asked = {k: _integer(body, k, 1, INT32_MAX, None) for k in ("max_completion_tokens", "max_tokens")
             if body.get(k) is not None}  # each checked as an integer before they are compared
    if len(set(asked.values())) > 1:
        raise APIError("max_completion_tokens and max_tokens differ; send one", "max_completion_tokens")
    max_tokens = next(iter(asked.values()), max(max_seq_len - len(ids), 1))  # default: the rest of the context
    if asked and len(ids) + max_tokens > max_seq_len:  # said of the messages, as above
        name = next(iter(asked))
        raise APIError(f"{name} {max_tokens} with messages of {len(ids)} tokens with the chat template exceeds "
                       f"max_seq_len {max_seq_len}; at most {max_seq_len - len(ids)}", name)
    params, guide_field = _sampling(body, tokenizer, max_tokens, logprobs, stream, guide)
    extras = _vllm_extras(body, stream)
    if extras["prompt_logprobs"] is not None:
        params = replace(params, prompt_logprobs=extras["prompt_logprobs"])
        _check_prompt_logprobs([ids], 1, {"prompt_logprobs": params.prompt_logprobs})
    include_usage, continuous = _stream_options(body, stream)
    role = "assistant" if generation_prompt else body["messages"][-1]["role"]
    return Generation([ids], params, stream, include_usage, guide_field=guide_field, continuous_usage=continuous,
                      role=role, tool_syntax=tool_syntax if calls else None, parallel_tool_calls=parallel, **extras)


def parameter_of(message: str, request_names: Mapping[str, str]) -> str | None:
    """The request parameter an executor refusal names first (its messages start with the parameter), under this
    request's name for it where that differs (request_names: executor name -> request parameter)."""
    word = refused_parameter(message)
    word = request_names.get(word, word)
    return word if word in COMPLETION_KEYS | CHAT_KEYS else None


# ---- responses ---------------------------------------------------------------------------------------------------
def usage(prompts: list[list[int]], stats: list[RequestStats], kv_block_size: int, echo_only: bool = False
          ) -> dict[str, Any]:
    """OpenAI's token counts (each prompt once, every choice's output; the prompt tokens found in the prefix cache
    as `prompt_tokens_details.cached_tokens`: what each prompt's request found, which its every output reports), and
    the requests' MTP drafting."""
    prompt_tokens = sum(map(len, prompts))
    n = len(stats) // len(prompts)  # choice i of prompt p at p * n + i
    cached = sum(stats[p * n].num_reused_blocks for p in range(len(prompts)))
    completion = 0 if echo_only else sum(s.output_tokens for s in stats)  # echo_only: its one token not returned
    drafted = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_draft_tokens for s in stats)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached * kv_block_size},
            "speculative_decoding": {"total_draft_tokens": drafted, "total_accepted_draft_tokens": accepted,
                                     "acceptance_rate": accepted / drafted if drafted else 0.0,
                                     "decode_steps": sum(s.num_steps for s in stats)}}


def completion_object(g: Generation, model: str, choices: list[dict[str, Any]], chat: bool,
                      usage_: dict[str, Any] | None = None, chunk: bool = False) -> dict[str, Any]:
    """A whole response (chunk=False) or one streamed chunk of /v1/completions or /v1/chat/completions."""
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    out = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{g.id}", "object": kind, "created": g.created, "model": model,
           "choices": choices}
    if not chunk or g.include_usage:
        out["usage"] = usage_  # streamed with include_usage: null in every chunk but the last, as OpenAI sends
    return out


def choice(index: int, text: str | None, finish_reason: str | None, chat: bool, chunk: bool,
           role: str | None = None, logprobs: dict[str, Any] | None = None,
           stop_reason: str | int | None = None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A choice of a response or chunk; chat's names `role` (a chunk only where given: the first of a choice) and
    its tool calls (a message's content is null beside them when empty, as OpenAI's; a chunk's are deltas).
    vLLM's stop_reason (the stop string or stop token id that ended it; null for eos and every other ending) is on
    a whole choice and on a choice's last chunk."""
    ending = {"finish_reason": finish_reason, **({"stop_reason": stop_reason} if finish_reason or not chunk else {})}
    if not chat:
        return {"index": index, "text": text or "", "logprobs": logprobs, **ending}
    calls = {"tool_calls": tool_calls} if tool_calls else {}
    if not chunk:
        message = {"role": role, "content": (text or None) if tool_calls else text or "", **calls}
        return {"index": index, "message": message, "logprobs": logprobs, **ending}
    delta: dict[str, Any] = {"role": role, "content": ""} if role else {}
    if text:
        delta["content"] = text
    return {"index": index, "delta": {**delta, **calls}, "logprobs": logprobs, **ending}


class TextOffsets:
    """Where each token of a choice starts in its text (completions' `text_offset`), from the tokens alone, so that
    streamed chunks (whose text may wait for a stop string or the rest of a character) give the same offsets as
    the whole output: the characters the tokens before it complete (a character split over tokens belongs to the
    token that completes it; special tokens add none, as the text skips them)."""

    def __init__(self, fmt: LogprobsFormat):
        self.fmt, self.chars = fmt, 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # bytes that never complete: U+FFFD

    def take(self, token_ids: list[int]) -> list[int]:
        starts = []
        for i in token_ids:
            starts.append(self.chars)
            if i not in self.fmt.tokenizer.special_ids:
                self.chars += len(self._utf8.decode(self.fmt.token_bytes(i)))
        return starts


class LogprobsFormat:
    """Token logprobs in OpenAI's shapes: completions' parallel lists (tokens, token_logprobs, top_logprobs,
    text_offset) or chat's content entries (token, logprob, bytes, top_logprobs)."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool = False):
        self.tokenizer, self.as_ids = tokenizer, as_ids  # as_ids: tokens named "token_id:<id>" (vLLM's option)

    def token_bytes(self, token_id: int) -> bytes:
        tok = self.tokenizer
        return tok.byte_table[token_id] if tok.is_byte_level else tok.decode([token_id], False).encode("utf-8")

    def token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.token_bytes(token_id).decode("utf-8", "replace")

    def top(self, lp: TokenLogprob, n: int | None = None) -> dict[str, float]:
        """Completions' top_logprobs entry: the n (default: all) alternatives by their text, most likely first (two
        tokens of one text, as partial characters' U+FFFD, keep the likelier), and the chosen token, always (OpenAI:
        up to logprobs + 1)."""
        out: dict[str, float] = {}
        for i, v in (*lp.top[:n], (lp.token_id, lp.logprob)):
            out.setdefault(self.token(i), v)
        return out

    def completion(self, lps: list[TokenLogprob], offsets: TextOffsets) -> dict[str, Any]:
        """`offsets`: the choice's, fed every token before these."""
        return {"tokens": [self.token(lp.token_id) for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [self.top(lp) for lp in lps], "text_offset": offsets.take([lp.token_id for lp in lps])}

    def prompt_completion(self, prompt: list[int], lps: list[TokenLogprob | None], offsets: TextOffsets, n: int
                          ) -> dict[str, Any]:
        """An echoed prompt's logprobs in completions' shape, n alternatives each: None for its first token, which
        nothing predicts."""
        return {"tokens": [self.token(i) for i in prompt],
                "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
                "top_logprobs": [None if lp is None else self.top(lp, n) for lp in lps],
                "text_offset": offsets.take(prompt)}

    def prompt(self, lps: list[TokenLogprob | None], n: int) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's prompt_logprobs: for each prompt token (None for the first) its entry and its n most likely
        alternatives', by token id: logprob, rank (1: the most likely) and decoded_token."""
        def entry(token_id: int, logprob: float, rank: int | None) -> tuple[str, dict[str, Any]]:
            return str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": self.token(token_id)}

        return [None if lp is None else dict([entry(lp.token_id, lp.logprob, lp.rank),
                                              *(entry(i, v, r) for r, (i, v) in enumerate(lp.top[:n], 1))])
                for lp in lps]

    def chat(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            return {"token": self.token(token_id), "logprob": logprob, "bytes": list(self.token_bytes(token_id))}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for lp in lps]}
