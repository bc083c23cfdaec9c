"""How a Triton model's request values are checked (the legacy flavour's contract is serving.triton.contract; the
OpenAI server reads JSON its own way and shares the refusal's form: `RequestError`, `refused_parameter`, bounds).

A request's values are checked where they arrive, in the type they were declared with and before they
are converted, cast or tokenized: one value where one is expected, integers within their range, reals
finite, text bounded in bytes before it is decoded and tokenized, token ids inside the vocabulary,
no parameter the surface does not know. Every refusal is a `RequestError` whose message names the
client's parameter and what was expected; the server answers it as a client error and stays up.
What a request means once its values are sound (max_tokens against the context, top_p in (0, 1], ...)
is `SamplingParams.validate` and the executor's, for every surface alike.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from runtime.core.sampling_params import MAX_STOP_STRINGS
from runtime.io.tokenizer import Tokenizer

INT32_MAX = 2**31 - 1


class RequestError(ValueError):
    """A client's request that cannot be served as sent; the message names the parameter."""


def one_value(values: np.ndarray, name: str) -> Any:
    """The single element of an input that holds one value per request."""
    if values.size != 1:
        raise RequestError(f"{name}: expected one value (one prompt per request), got {values.size}")
    return values.reshape(-1)[0]


def integer(values: np.ndarray, name: str, low: int, high: int) -> int:
    """One integer in [low, high], read as its declared integer type (never through a float or a narrower
    type, so nothing wraps or rounds on the way)."""
    value = one_value(values, name)
    if not np.issubdtype(values.dtype, np.integer):
        raise RequestError(f"{name}: expected an integer, got {values.dtype} {value!r}")
    value = int(value)
    if not low <= value <= high:
        raise RequestError(f"{name} must be an integer in [{low}, {high}], got {value}")
    return value


def real(values: np.ndarray, name: str, low: float = -math.inf, high: float = math.inf) -> float:
    """One finite real in [low, high] (NaN and infinities are refused: NaN compares false with every bound). A FP32
    value is read as the shortest decimal that is that float32 (0.01, not 0.009999999776482582): the number the client
    wrote, so a bound it meets in decimal is met here too."""
    value = one_value(values, name)
    if not (np.issubdtype(values.dtype, np.floating) or np.issubdtype(values.dtype, np.integer)):
        raise RequestError(f"{name}: expected a number, got {values.dtype} {value!r}")
    value = float(str(value)) if values.dtype in (np.float32, np.float16) else float(value)
    if not (math.isfinite(value) and low <= value <= high):
        raise RequestError(f"{name} must be a finite number{bounds_text(low, high)}, got {value}")
    return value


def bounds_text(low: float, high: float, above: bool = False) -> str:
    """' in [low, high]', ' >= low', ' <= high' or '' (no bound), as a refusal states a range (with `above`, low
    itself excluded: ' > low', ' in (low, high]')."""
    if math.isinf(low) and math.isinf(high):
        return ""
    if math.isinf(high):
        return f" > {low}" if above else f" >= {low}"
    return f" <= {high}" if math.isinf(low) else f" in {'(' if above else '['}{low}, {high}]"


def flag(values: np.ndarray, name: str) -> bool:
    value = one_value(values, name)
    if values.dtype != np.bool_:
        raise RequestError(f"{name}: expected true or false, got {values.dtype} {value!r}")
    return bool(value)


CONTEXT_BYTES = "that can fit the model's context (max_seq_len tokens of at most the tokenizer's longest token)"


def texts(values: np.ndarray, name: str, max_bytes: int | None = None, bound: str = CONTEXT_BYTES) -> list[str]:
    """Each item of a string input as text: at most max_bytes bytes (checked before decoding, so an oversized
    request costs nothing more; `bound` says what the bound is), valid UTF-8."""
    out = []
    for v in values.reshape(-1):
        raw = v if isinstance(v, bytes) else str(v).encode("utf-8")
        if max_bytes is not None and len(raw) > max_bytes:
            raise RequestError(f"{name} is {len(raw)} bytes, more than the {max_bytes} {bound}")
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise RequestError(f"{name} must be valid UTF-8 text: {e}") from None
    return out


def token_ids(values: Iterable[int], name: str, vocab_size: int) -> list[int]:
    """Ids that are tokens of the vocabulary, as Python integers."""
    ids = [int(t) for t in values]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{name} must hold token ids in [0, {vocab_size}), got {bad[:5]}")
    return ids


def check_response_count(decoupled: bool, streaming: bool, n: int, streaming_input: str) -> None:
    """Refuse what needs more than one response (a stream, several sequences) on a model deployed non-decoupled,
    which sends exactly one per request."""
    if decoupled:
        return
    if n > 1:
        raise RequestError(f"num_return_sequences {n} needs a decoupled model (a response per sequence; this one is "
                           "deployed with decoupled false)")
    if streaming:
        raise RequestError(f"{streaming_input} true needs a decoupled model (this one is deployed with decoupled "
                           "false: one response per request)")


SHOWN_KEYS, SHOWN_KEY_CHARS = 8, 64  # of a refused request's unknown keys, in its error


def no_unknown_parameters(parameters_json: str, surface: str) -> None:
    """Refuse request parameters a surface does not take. Triton's HTTP generate endpoint turns every JSON key
    that is not an input name into such a parameter, so a misspelt input (`max_token`) arrives here rather than
    being dropped."""
    unknown = sorted(json.loads(parameters_json or "{}"))
    if unknown:
        raise RequestError(f"unknown parameter(s) {shown_keys(unknown)}: {surface} takes inputs only (a generate "
                           "endpoint's JSON keys must be input names)")


def shown_keys(keys: list[str]) -> str:
    """A client's keys as an error shows them: a few, each cut short, however many and long it sent (every key was
    joined in: 100,000 keys made an error as long as the body)."""
    more = f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else ""
    return ", ".join(f"{k:.{SHOWN_KEY_CHARS}}" for k in keys[:SHOWN_KEYS]) + more


@dataclass(frozen=True)
class Scalar:
    """How one scalar input is read: a flag, a real or an integer, within [low, high]."""

    kind: str  # "flag" | "real" | "integer"
    low: float = -math.inf
    high: float = math.inf

    def read(self, values: np.ndarray, name: str) -> Any:
        if self.kind == "flag":
            return flag(values, name)
        if self.kind == "real":
            return real(values, name, self.low, self.high)
        return integer(values, name, int(self.low), int(self.high))


def refused_parameter(message: str) -> str:
    """The parameter an executor's refusal starts with, as SamplingParams and the executor name it ("max_tokens 5000
    with ...", "stop[3] is ...", "prompt has ...", "guided_decoding.regex ..."); "" if none."""
    return re.match(r"[a-z_]*", message).group()


def named_for_client(message: str, input_names: Mapping[str, str]) -> str:
    """An executor's refusal under the name the client sent its parameter by."""
    head = refused_parameter(message)
    return input_names[head] + message[len(head):] if head in input_names else message


def is_empty(values: np.ndarray) -> bool:
    """No value at all, or only empty strings: what TensorRT-LLM's clients send for a feature that is off."""
    return values.size == 0 or (values.dtype == object and all(not v for v in values.reshape(-1)))


def refuse_unsupported(present: dict[str, np.ndarray], unsupported: dict[str, str],
                       client_names: dict[str, str] | None = None) -> None:
    """Inputs of TensorRT-LLM's contract that this runtime does not implement are declared, so that a client sending
    one hears why from us, naming it, rather than Triton's "unexpected inference input"; absent or empty they are
    accepted (`is_empty`)."""
    for name, feature in unsupported.items():
        values = present.get(name)
        if values is not None and not is_empty(values):
            shown = f"{client_names[name]} ({name})" if client_names and name in client_names else name
            raise RequestError(f"{shown} is not supported by this runtime ({feature}); supported: not given")


def max_stop_words(tokenizer: Tokenizer) -> int:
    """A stop word list's bound: each word becomes a stop string (at most MAX_STOP_STRINGS) or a special token's stop."""
    return MAX_STOP_STRINGS + len(tokenizer.special_ids)
