"""The legacy `tensorrt_llm` model's request as the executor takes it: TensorRT-LLM's input tensors (input_ids,
request_output_len, runtime_top_k, stop_words_list, ...) read and checked, then converted to prompt ids and
SamplingParams (`engine_request`); the executor's checks of such a request (`check_engine_request`); and the BLS's
reading of its client's inputs (`bls_values`).

Shared by `tensorrt_llm` and `tensorrt_llm_bls`, which runs it on the tensors it is about to send, so that a request
tensorrt_llm would refuse is refused by the BLS itself, with the same message: Triton 2.51's BLS API reports a
composing model's error code differently under another allocator (500 for a refusal under jemalloc). No torch: the
BLS's stub stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.core.sampling_params import LOGIT_BIAS_LIMIT, SamplingParams, seed_from_client, validate_request
from runtime.io.tokenizer import Tokenizer
from serving.request_validation import (RequestError, integer, max_stop_words, named_for_client, refuse_unsupported,
                                        token_ids)
from serving.triton.contract import (ENGINE_INPUTS, GUIDED_INPUTS, NEUTRAL, TENSORRT_LLM_SCALARS,
                                     UNSUPPORTED_BLS_INPUTS, UNSUPPORTED_ENGINE_INPUTS, client_named, guided_decoding,
                                     refuse_non_neutral)
from serving.triton.engine_limits import EngineLimits

Inputs = dict[str, np.ndarray]  # a request's input tensors by tensorrt_llm's names


@dataclass(frozen=True)
class EngineRequest:
    """A legacy request, converted: what the executor is given and how its output is sent."""

    prompt: list[int]
    params: SamplingParams
    streaming: bool
    exclude_input: bool


def scalar(inputs: Inputs, name: str, default: Any = None) -> Any:
    """One value of a scalar input, checked in its declared type before anything converts it."""
    values = inputs.get(name)
    return default if values is None else TENSORRT_LLM_SCALARS[name].read(values, client_named(name))


def word_list(inputs: Inputs, name: str, vocab_size: int, max_words: int) -> list[list[int]]:
    """TensorRT-LLM's [1, 2, W] word list (ids, end offsets padded with -1) -> words as id lists; more than
    `max_words` are refused before any is converted."""
    arr = inputs.get(name)
    if arr is None:
        return []
    given = arr
    if arr.ndim == 3:
        if arr.shape[0] != 1:
            raise RequestError(f"{name}: one request per batch item expected, got batch {arr.shape[0]}")
        arr = arr[0]
    if arr.ndim != 2 or arr.shape[0] != 2:
        raise RequestError(f"{name} must have shape [2, W] (ids, offsets), got {list(given.shape)}")
    words = int(np.count_nonzero(arr[1] >= 0))
    if words > max_words:
        raise RequestError(f"{name} holds {words} words; at most {max_words}")
    ids, offsets = arr[0].tolist(), [o for o in arr[1].tolist() if o >= 0]
    if offsets != sorted(offsets) or (offsets and offsets[-1] > len(ids)):
        raise RequestError(f"{name}: offsets {offsets} are not increasing ends within {len(ids)} ids")
    words = [ids[a:b] for a, b in zip([0] + offsets, offsets) if b > a]
    token_ids((t for word in words for t in word), name, vocab_size)
    return words


def logit_bias(inputs: Inputs, vocab_size: int) -> dict[int, float] | None:
    """TensorRT-LLM's embedding_bias (a float per vocabulary token, added to its logit; [V] or [1, V], empty for none)
    as logit_bias: its nonzero entries."""
    arr = inputs.get("embedding_bias")
    if arr is None or arr.size == 0:
        return None
    name = client_named("embedding_bias")
    values = arr.reshape(-1) if arr.ndim == 1 or (arr.ndim == 2 and arr.shape[0] == 1) else None
    if values is None or values.size > vocab_size:
        raise RequestError(f"{name} must hold one bias per vocabulary token, at most {vocab_size}; got shape "
                           f"{list(arr.shape)}")
    tokens = np.flatnonzero(values)
    far = tokens[~(np.abs(values[tokens]) <= LOGIT_BIAS_LIMIT)]  # NaN too
    if far.size:
        raise RequestError(f"{name}: token {far[0]}'s bias is {values[far[0]]}; this runtime takes biases in "
                           f"[{-LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
    return dict(zip(tokens.tolist(), values[tokens].astype(float).tolist()))


def engine_request(inputs: Inputs, tokenizer: Tokenizer, vocab_size: int,
                   exclude_input_default: bool) -> EngineRequest:
    """The request's tensors as the executor's prompt and SamplingParams; RequestError naming the input where they
    cannot be read. What the executor then checks is `check_engine_request`'s."""
    refuse_unsupported(inputs, UNSUPPORTED_ENGINE_INPUTS)
    refuse_non_neutral({name: scalar(inputs, name) for name in NEUTRAL})
    ids = inputs.get("input_ids")
    if ids is None:
        raise RequestError("input_ids is required")
    if ids.ndim == 2 and ids.shape[0] != 1:
        raise RequestError(f"input_ids: one prompt per request expected, got batch {ids.shape[0]} "
                           "(requests are batched in flight; send them separately)")
    ids = ids.reshape(-1)
    length = scalar(inputs, "input_lengths", len(ids))
    if not 0 <= length <= len(ids):
        raise RequestError(f"input_lengths {length} is outside [0, {len(ids)}] (the input_ids given)")
    prompt = token_ids(ids[:length], "input_ids", vocab_size)
    max_tokens = scalar(inputs, "request_output_len")
    if max_tokens is None:
        raise RequestError("request_output_len (max_tokens) is required")

    stop, stop_ids = [], []
    for word in word_list(inputs, "stop_words_list", vocab_size, max_stop_words(tokenizer)):
        if len(word) == 1 and word[0] in tokenizer.special_ids:
            stop_ids.append(word[0])  # special tokens never show in the text a stop string is matched in
        else:
            stop.append(tokenizer.decode(word, skip_special_tokens=False))
    bad_ids = []
    for word in word_list(inputs, "bad_words_list", vocab_size, vocab_size):
        if len(word) != 1:
            raise RequestError(f"bad_words: {tokenizer.decode(word, skip_special_tokens=False)!r} is "
                               f"{len(word)} tokens; only single-token bad words are supported")
        bad_ids.append(word[0])
    scalar(inputs, "len_penalty")  # checked as declared (finite), then unused: it weighs beams, and a request has one
    seed = _alias(inputs, "seed", "random_seed", seed_from_client)
    # more than max_tokens means all of them (genai-perf's fixed output length sends min_length = max_tokens)
    min_tokens = min(_alias(inputs, "min_tokens", "min_length") or 0, max_tokens)
    temperature, top_k, top_p = _sampling(inputs)
    n = scalar(inputs, "num_return_sequences", 1)
    if n > 1 and temperature == 0:  # the executor's rule, said in this surface's terms: its greedy needs no temperature 0
        raise RequestError(f"num_return_sequences must be 1 when decoding greedily, got {n}: every sequence would be "
                           f"the same (greedy unless {client_named('runtime_top_k')} or {client_named('runtime_top_p')}"
                           " is above 0, as TensorRT-LLM reads them, and temperature above 0)")
    end_id = None if "end_id" not in inputs else integer(inputs["end_id"], "end_id", -1, vocab_size - 1)
    ignore_eos = end_id is not None and end_id != tokenizer.eos_token_id
    if ignore_eos and end_id >= 0:  # a custom end id replaces eos; -1 means none
        stop_ids.append(end_id)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        bad_token_ids=tuple(bad_ids),
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        logprobs=0 if scalar(inputs, "return_log_probs", False) else None,
        repetition_penalty=scalar(inputs, "repetition_penalty", 1.0),
        presence_penalty=scalar(inputs, "presence_penalty", 0.0),
        frequency_penalty=scalar(inputs, "frequency_penalty", 0.0),
        guided_decoding=guided_decoding({name: inputs[name] for name in GUIDED_INPUTS if name in inputs}),
        n=n,
        logit_bias=logit_bias(inputs, vocab_size),
        num_draft_tokens=scalar(inputs, "num_draft_tokens"))
    return EngineRequest(prompt, params, bool(scalar(inputs, "streaming", False)),
                         bool(scalar(inputs, "exclude_input_in_output", exclude_input_default)))


# tensorrt_llm's inputs, with the ensemble's names (preprocessing makes the first from text), for the executor's
# parameters its refusals start with
INPUT_NAMES = {"prompt": "input_ids (text_input)", "stop": "stop_words_list (stop_words)",
               "stop_token_ids": "stop_words_list (stop_words)", "bad_token_ids": "bad_words_list (bad_words)",
               "logit_bias": client_named("embedding_bias"),
               **{param: client_named(name) for param, name in (
                   ("max_tokens", "request_output_len"), ("n", "num_return_sequences"), ("top_k", "runtime_top_k"),
                   ("top_p", "runtime_top_p"))}}


def bls_values(inputs: Inputs) -> dict[str, Any]:
    """The BLS's inputs by the client's names (ensemble / BLS): refuse its values under those names rather than the
    engine's (top_k, not runtime_top_k) and inputs of upstream's BLS this runtime does not implement. What the
    request means (max_tokens against the context, ...) is checked next, on the tensors for tensorrt_llm, by
    tensorrt_llm's own conversion (`engine_request`): Triton 2.51's BLS API reports a composing model's error code
    differently by allocator (a refusal of tensorrt_llm's came back as HTTP 500 under jemalloc), so nothing the
    client did wrong is left for tensorrt_llm to refuse. Returns the scalar values read, by tensorrt_llm's names."""
    refuse_unsupported(inputs, UNSUPPORTED_BLS_INPUTS)
    values = {}
    for client, engine in {**ENGINE_INPUTS, "use_draft_logits": "use_draft_logits"}.items():
        if client in inputs and engine in TENSORRT_LLM_SCALARS:
            values[engine] = TENSORRT_LLM_SCALARS[engine].read(inputs[client], client)
    refuse_non_neutral(values)
    return values


def check_engine_request(request: EngineRequest, tokenizer: Tokenizer, limits: EngineLimits) -> None:
    """The executor's checks of a request (RequestError naming the input, as tensorrt_llm's refusal of it does),
    for the BLS, which has no executor: tensorrt_llm leaves them to its executor's submit, not to run them twice
    on its execute thread."""
    try:
        validate_request(request.prompt, request.params, limits.vocab_size, limits.max_seq_len, limits.max_batch_size,
                         tokenizer.eos_token_id,
                         (limits.kv_block_size, limits.kv_blocks) if limits.kv_block_size else None,
                         limits.request_draft_len)
    except ValueError as e:
        raise RequestError(named_for_client(str(e), INPUT_NAMES)) from None


def _alias(inputs: Inputs, name: str, old_name: str, read: Any = lambda v: v) -> Any:
    """An input that upstream's older templates name differently (random_seed, min_length), as `read` takes it."""
    value, old = scalar(inputs, name), scalar(inputs, old_name)
    if value is not None and old is not None and read(value) != read(old):
        raise RequestError(f"{name}={value} and {old_name}={old} differ ({old_name} is the older name of "
                           f"{name}); give one of them")
    return None if value is None and old is None else read(old if value is None else value)


def _sampling(inputs: Inputs) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) as TensorRT-LLM reads its inputs: runtime_top_k 0 or unset with
    runtime_top_p unset or <= 0 decodes greedily whatever the temperature (its top-k kernel then takes
    k = 1); otherwise it samples, at temperature 1.0 when none is given (upstream's default)."""
    temperature = scalar(inputs, "temperature")
    top_k = scalar(inputs, "runtime_top_k", 0)
    top_p = scalar(inputs, "runtime_top_p")
    top_p_set = top_p is not None and top_p > 0  # upstream reads top_p <= 0 as "not set"
    sampling = top_k != 0 or top_p_set
    if temperature is None:
        temperature = 1.0 if sampling else 0.0
    elif not sampling and temperature >= 0:
        temperature = 0.0  # greedy; an invalid temperature still gets its error
    return temperature, top_k, top_p if top_p_set else 1.0
