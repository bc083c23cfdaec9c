"""Request validation shared by every server surface (the Triton models, the OpenAI server).

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

from runtime.core.sampling_params import PENALTY_LIMIT, REPETITION_PENALTY_RANGE, GuidedDecodingParams

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
    """One finite real in [low, high] (NaN and infinities are refused: NaN compares false with every bound)."""
    value = one_value(values, name)
    if not (np.issubdtype(values.dtype, np.floating) or np.issubdtype(values.dtype, np.integer)):
        raise RequestError(f"{name}: expected a number, got {values.dtype} {value!r}")
    value = float(value)
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


def texts(values: np.ndarray, name: str, max_bytes: int | None = None) -> list[str]:
    """Each item of a string input as text: at most max_bytes bytes (checked before decoding, so an oversized
    request costs nothing more), valid UTF-8."""
    out = []
    for v in values.reshape(-1):
        raw = v if isinstance(v, bytes) else str(v).encode("utf-8")
        if max_bytes is not None and len(raw) > max_bytes:
            raise RequestError(f"{name} is {len(raw)} bytes, more than the {max_bytes} that can fit the model's "
                               f"context (max_seq_len tokens of at most the tokenizer's longest token)")
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


def no_unknown_parameters(parameters_json: str, surface: str) -> None:
    """Refuse request parameters a surface does not take. Triton's HTTP generate endpoint turns every JSON key
    that is not an input name into such a parameter, so a misspelt input (`max_token`) arrives here rather than
    being dropped."""
    unknown = sorted(json.loads(parameters_json or "{}"))
    if unknown:
        raise RequestError(f"unknown parameter(s) {', '.join(unknown)}: {surface} takes inputs only (a generate "
                           "endpoint's JSON keys must be input names)")


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


# The legacy flavour's names for one input along the pipeline, as the ensemble's config.pbtxt maps them (and the
# BLS, which runs the same pipeline, with these maps): preprocessing's inputs by the client's (ensemble / BLS) name
PREPROCESSING_INPUTS = {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "BAD_WORDS_DICT": "bad_words",
                        "STOP_WORDS_DICT": "stop_words", "END_ID": "end_id", "PAD_ID": "pad_id",
                        "DECODER_QUERY": "decoder_text_input", "EMBEDDING_BIAS_WORDS": "embedding_bias_words",
                        "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights",
                        "PROMPT_TABLE_EXTRA_ID": "prompt_table_extra_id"}
# preprocessing's outputs -> the tensorrt_llm inputs they feed
PREPROCESSED = {"INPUT_ID": "input_ids", "REQUEST_INPUT_LEN": "input_lengths",
                "REQUEST_OUTPUT_LEN": "request_output_len", "BAD_WORDS_IDS": "bad_words_list",
                "STOP_WORDS_IDS": "stop_words_list", "OUT_END_ID": "end_id", "OUT_PAD_ID": "pad_id",
                "EMBEDDING_BIAS": "embedding_bias"}
# the client's inputs passed straight to tensorrt_llm -> its names for them
ENGINE_INPUTS = {name: name for name in (
    "exclude_input_in_output", "temperature", "repetition_penalty", "min_tokens", "presence_penalty",
    "frequency_penalty", "seed", "random_seed", "min_length", "return_log_probs", "return_context_logits",
    "return_generation_logits", "return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens",
    "beam_width", "num_return_sequences", "guided_decoding_guide_type", "guided_decoding_guide")} | {
    "top_k": "runtime_top_k", "top_p": "runtime_top_p", "length_penalty": "len_penalty", "stream": "streaming"}
# tensorrt_llm's inputs by the client's name where it differs: a refusal from tensorrt_llm names both, since behind
# the ensemble the client only knows its own name
CLIENT_NAMES = {engine: client for client, engine in ENGINE_INPUTS.items() if client != engine} | {
    PREPROCESSED[name]: client for name, client in PREPROCESSING_INPUTS.items() if name in PREPROCESSED} | {
    "embedding_bias": "embedding_bias_words, embedding_bias_weights"}


def refused_parameter(message: str) -> str:
    """The parameter an executor's refusal starts with, as SamplingParams and the executor name it ("max_tokens 5000
    with ...", "stop[3] is ...", "prompt has ...", "guided_decoding.regex ..."); "" if none."""
    return re.match(r"[a-z_]*", message).group()


def named_for_client(message: str, input_names: Mapping[str, str]) -> str:
    """An executor's refusal under the name the client sent its parameter by."""
    head = refused_parameter(message)
    return input_names[head] + message[len(head):] if head in input_names else message


def client_named(name: str) -> str:
    """An engine input's name, with the ensemble's name for it where that differs."""
    return f"{name} ({CLIENT_NAMES[name]})" if name in CLIENT_NAMES else name


_FLAG, _REAL = Scalar("flag"), Scalar("real")
# The scalar inputs of TensorRT-LLM's `tensorrt_llm` model (the legacy Triton contract), by its names; the
# ensemble and BLS inputs that feed them are read with the same rules under the client's names.
TENSORRT_LLM_SCALARS: dict[str, Scalar] = {
    **dict.fromkeys(("streaming", "exclude_input_in_output", "stop", "return_log_probs", "return_context_logits",
                     "return_generation_logits", "return_perf_metrics", "return_num_input_tokens",
                     "return_num_output_tokens", "use_draft_logits"), _FLAG),
    **dict.fromkeys(("temperature", "len_penalty"), _REAL),
    "repetition_penalty": Scalar("real", *REPETITION_PENALTY_RANGE),
    **dict.fromkeys(("presence_penalty", "frequency_penalty"), Scalar("real", -PENALTY_LIMIT, PENALTY_LIMIT)),
    "runtime_top_p": Scalar("real", 0.0, 1.0),
    "input_lengths": Scalar("integer", 0, INT32_MAX),
    "request_output_len": Scalar("integer", 1, INT32_MAX),
    "runtime_top_k": Scalar("integer", 0, INT32_MAX),
    "beam_width": Scalar("integer", 1, INT32_MAX),
    "num_return_sequences": Scalar("integer", 1, INT32_MAX),
    "min_tokens": Scalar("integer", 0, INT32_MAX),
    "num_draft_tokens": Scalar("integer", 0, INT32_MAX),
    "min_length": Scalar("integer", 0, INT32_MAX),
    "seed": Scalar("integer", 0, 2**64 - 1),
    "random_seed": Scalar("integer", 0, 2**64 - 1),
}


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


def refuse_non_neutral(values: dict[str, Any]) -> None:
    """Inputs this runtime implements only at their neutral value (NEUTRAL), read already, by the engine's names."""
    for name, value in values.items():
        if name in NEUTRAL and value is not None and not NEUTRAL[name][0](value):
            raise RequestError(f"{client_named(name)}={value} is not supported by this runtime "
                               f"(supported: {NEUTRAL[name][1]})")


# Inputs TensorRT-LLM clients send that this runtime implements only at their neutral value, by tensorrt_llm's names.
NEUTRAL: dict[str, tuple[Any, str]] = {
    "beam_width": (lambda v: v == 1, "1 (no beam search)"),
    "return_context_logits": (lambda v: not v, "false"),
    "return_generation_logits": (lambda v: not v, "false"),
    # the BLS's draft-model speculation
    "num_draft_tokens": (lambda v: v == 0, "0; MTP drafting is configured on the server (num_draft_tokens parameter)"),
    "use_draft_logits": (lambda v: not v, "false"),
}

# TensorRT-LLM's Triton guided decoding (the legacy model's names, taken by the llmapi flavour too): guide type ->
# GuidedDecodingParams field ("json": any JSON object, as json_object)
GUIDED_INPUTS = ("guided_decoding_guide_type", "guided_decoding_guide")
GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}
MAX_GUIDE_BYTES = 1 << 20  # a guide is not bounded by the context: by this


def guided_decoding(inputs: dict[str, np.ndarray]) -> GuidedDecodingParams | None:
    """guided_decoding_guide_type and guided_decoding_guide as GuidedDecodingParams (None when the type is absent or
    empty), the guide's grammar checked: a refusal names the input and where in the guide the problem lies."""
    from runtime.core.guide_check import check_guide  # llguidance: loaded where a guide is read

    kind_values = inputs.get("guided_decoding_guide_type")
    if kind_values is None or is_empty(kind_values):
        if "guided_decoding_guide" in inputs and not is_empty(inputs["guided_decoding_guide"]):
            raise RequestError("guided_decoding_guide needs guided_decoding_guide_type (json_schema, regex, "
                               "ebnf_grammar)")
        return None
    [kind] = texts(np.array([one_value(kind_values, "guided_decoding_guide_type")], object),
                   "guided_decoding_guide_type", 64)
    if kind not in GUIDE_TYPES:
        raise RequestError(f"guided_decoding_guide_type must be one of {', '.join(GUIDE_TYPES)}, got {kind!r}")
    guide_values = inputs.get("guided_decoding_guide")
    guide = "" if guide_values is None or is_empty(guide_values) else \
        texts(np.array([one_value(guide_values, "guided_decoding_guide")], object), "guided_decoding_guide", MAX_GUIDE_BYTES)[0]
    if kind == "json":
        return GuidedDecodingParams(json_object=True)
    if not guide:
        raise RequestError(f"guided_decoding_guide is required with guided_decoding_guide_type {kind}")
    params = GuidedDecodingParams(**{GUIDE_TYPES[kind]: guide})
    try:
        check_guide(params, "guided_decoding_guide")
    except ValueError as e:
        raise RequestError(str(e)) from None
    return params


_ENCODER = "encoder-decoder models; this one is decoder-only"
_DRAFTS = "drafts from a separate model; this runtime drafts with the model's own MTP layer"
_PROMPT_TABLE = "prompt tuning"
_LORA = "LoRA adapters"
_MULTIMODAL = "multimodal input; this is a text model"
# The legacy `tensorrt_llm` model's inputs this runtime does not implement (decoder_input_ids and
# decoder_input_lengths are not among them: preprocessing pads them for every request and they are ignored).
UNSUPPORTED_ENGINE_INPUTS: dict[str, str] = {
    **dict.fromkeys(("encoder_input_features", "encoder_output_lengths", "cross_attention_mask",
                     "skip_cross_attn_blocks"), _ENCODER),
    **dict.fromkeys(("draft_input_ids", "draft_logits", "draft_acceptance_threshold"), _DRAFTS),
    **dict.fromkeys(("runtime_top_p_min", "runtime_top_p_decay", "runtime_top_p_reset_ids"), "top-p decay"),
    **dict.fromkeys(("prompt_embedding_table", "prompt_table_extra_ids", "prompt_vocab_size"), _PROMPT_TABLE),
    **dict.fromkeys(("mrope_rotary_cos_sin", "mrope_position_deltas"), "multimodal RoPE"),
    **dict.fromkeys(("lora_task_id", "lora_weights", "lora_config"), _LORA),
    "context_phase_params": "disaggregated serving",
    **dict.fromkeys(("retention_token_range_starts", "retention_token_range_ends", "retention_token_range_priorities",
                     "retention_token_range_durations_ms", "retention_decode_priority",
                     "retention_decode_duration_ms"), "KV cache retention priorities: its prefix cache evicts the least "
                    "recently used blocks"),
    **dict.fromkeys(("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size"),
                    "lookahead decoding"),
}
# preprocessing's (named with the ensemble's input that feeds them, where there is one)
UNSUPPORTED_TEXT_INPUTS: dict[str, str] = {
    "DECODER_QUERY": _ENCODER,
    **dict.fromkeys(("IMAGE_BYTES", "IMAGE_URL", "VIDEO_BYTES"), _MULTIMODAL),
    "PROMPT_TABLE_EXTRA_ID": _PROMPT_TABLE,
}
# the BLS's (those it does not pass on to tensorrt_llm, which refuses the others itself)
UNSUPPORTED_BLS_INPUTS: dict[str, str] = {
    "decoder_text_input": _ENCODER,
    **dict.fromkeys(("image_input", "image_bytes_input", "image_url_input", "video_bytes_input"), _MULTIMODAL),
    **dict.fromkeys(("prompt_embedding_table", "prompt_vocab_size", "prompt_table_extra_id"), _PROMPT_TABLE),
    **dict.fromkeys(("lora_task_id", "lora_weights", "lora_config"), _LORA),
}
