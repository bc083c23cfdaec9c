"""The legacy Triton flavour's contract, TensorRT-LLM's `tensorrt_llm` / ensemble / BLS models': each input's names
along the pipeline, how its scalars are read, the inputs taken at their neutral value only or not at all (each with
why), its guided-decoding inputs (which the llmapi flavour takes too), and the ids of the requests the BLS makes.
The checks themselves are serving.request_validation's."""

from __future__ import annotations

import re
import uuid
from typing import Any

import numpy as np

from runtime.core.sampling_params import PENALTY_LIMIT, REPETITION_PENALTY_RANGE, GuidedDecodingParams
from serving.request_validation import INT32_MAX, RequestError, Scalar, is_empty, one_value, texts

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
    "beam_width", "num_return_sequences", "guided_decoding_guide_type", "guided_decoding_guide",
    "num_draft_tokens")} | {
    "top_k": "runtime_top_k", "top_p": "runtime_top_p", "length_penalty": "len_penalty", "stream": "streaming"}
# tensorrt_llm's inputs by the client's name where it differs: a refusal from tensorrt_llm names both, since behind
# the ensemble the client only knows its own name
CLIENT_NAMES = {engine: client for client, engine in ENGINE_INPUTS.items() if client != engine} | {
    PREPROCESSED[name]: client for name, client in PREPROCESSING_INPUTS.items() if name in PREPROCESSED} | {
    "embedding_bias": "embedding_bias_words, embedding_bias_weights"}


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
    # the BLS's draft-model speculation (its num_draft_tokens caps the request's MTP drafts here)
    "use_draft_logits": (lambda v: not v, "false"),
}

# TensorRT-LLM's Triton guided decoding (the legacy model's names, taken by the llmapi flavour too): guide type ->
# GuidedDecodingParams field ("json": any JSON object, as json_object)
GUIDED_INPUTS = ("guided_decoding_guide_type", "guided_decoding_guide")
GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}
MAX_GUIDE_BYTES = 1 << 20  # a guide is not bounded by the context: by this
# the BLS calls tensorrt_llm with the client's request id, this, and 32 hex digits: a stop naming the client's id
# reaches that request too (`made_for`), the BLS's own stop its request alone
ENGINE_ID_SEPARATOR = "#"
_ENGINE_ID_SUFFIX = re.compile(r"[0-9a-f]{32}")


def engine_request_id(client_request_id: str) -> str:
    """The id of the tensorrt_llm request the BLS makes for a client's: unique, so that the BLS's own stop ends this
    request only, and recognisable (`made_for`), so that a client's stop by its id ends it too."""
    return f"{client_request_id}{ENGINE_ID_SEPARATOR}{uuid.uuid4().hex}"


def made_for(request_id: str, client_id: str) -> bool:
    """Whether a tensorrt_llm request is the client's own or the one the BLS made for it (`engine_request_id`)."""
    if request_id == client_id:
        return True
    head, sep, suffix = request_id.rpartition(ENGINE_ID_SEPARATOR)
    return bool(sep) and head == client_id and _ENGINE_ID_SUFFIX.fullmatch(suffix) is not None


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
    guide = ""
    if guide_values is not None and not is_empty(guide_values):
        value = np.array([one_value(guide_values, "guided_decoding_guide")], object)
        [guide] = texts(value, "guided_decoding_guide", MAX_GUIDE_BYTES, "a guide may be")
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
                     "retention_decode_duration_ms"),
                    "KV cache retention priorities: its prefix cache evicts the least recently used blocks"),
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
