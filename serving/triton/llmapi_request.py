"""The llmapi `tensorrt_llm` model's request as the executor takes it: `text_input` and the `sampling_param_*` inputs
read and checked in their declared types, then converted to a prompt text and SamplingParams as TensorRT-LLM's LLM
API reads them (`llmapi_request`). No torch, as the legacy flavour's (serving.triton.legacy_request)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.core.sampling_params import PENALTY_LIMIT, SamplingParams, seed_from_client
from serving.request_validation import (INT32_MAX, RequestError, Scalar, named_for_client, refused_parameter,
                                        refuse_unsupported, texts)
from serving.triton.contract import GUIDED_INPUTS, guided_decoding

Inputs = dict[str, np.ndarray]  # a request's input tensors by name

UNSUPPORTED = {"image_url": "multimodal input; this is a text model",
               **dict.fromkeys(("lora_id", "lora_name", "lora_path", "lora_ckpt_source"), "LoRA adapters")}
FLAG = Scalar("flag")
SCALARS: dict[str, Scalar] = {
    **dict.fromkeys(("streaming", "stop", "sampling_param_exclude_input_from_output",
                     "sampling_param_return_perf_metrics", "return_finish_reason", "return_stop_reason",
                     "return_cumulative_logprob"), FLAG),
    "sampling_param_temperature": Scalar("real", 0.0),
    **dict.fromkeys(("sampling_param_frequency_penalty", "sampling_param_presence_penalty"),
                    Scalar("real", -PENALTY_LIMIT, PENALTY_LIMIT)),
    "sampling_param_top_p": Scalar("real", 0.0, 1.0),
    "sampling_param_top_k": Scalar("integer", 0, INT32_MAX),
    "sampling_param_best_of": Scalar("integer", 1, INT32_MAX),
    "sampling_param_max_tokens": Scalar("integer", 1, INT32_MAX),
    "sampling_param_seed": Scalar("integer", 0, 2**64 - 1),
    # this runtime's own: SamplingParams.num_draft_tokens (at most this many MTP drafts a step; 0: plain decoding)
    "sampling_param_num_draft_tokens": Scalar("integer", 0, INT32_MAX),
}
INPUTS = frozenset({"text_input", "sampling_param_stop", *SCALARS, *UNSUPPORTED, *GUIDED_INPUTS})  # all it reads
DEFAULT_MAX_TOKENS = 32  # the LLM API's SamplingParams.max_tokens
# the executor's parameters by this model's input names, for its refusals
INPUT_NAMES = {"prompt": "text_input", "stop": "sampling_param_stop",
               **{name.removeprefix("sampling_param_"): name for name in SCALARS if name.startswith("sampling_param_")}}
OUTPUTS = ("finish_reason", "stop_reason", "cumulative_logprob")  # the optional outputs a request asks for


@dataclass(frozen=True)
class LlmApiRequest:
    """A request, converted: what the executor is given (once the text is tokenized) and how its output is sent."""

    text: str
    params: SamplingParams
    streaming: bool
    perf_metrics: bool
    outputs: frozenset[str]  # of OUTPUTS


def scalar(inputs: Inputs, name: str) -> Any:
    """One value of a scalar input, checked in its declared type; None when not given."""
    return SCALARS[name].read(inputs[name], name) if name in inputs else None


def greedy_because(temperature: float | None, top_k: int | None, top_p: float | None) -> str | None:
    """What makes the LLM API decode greedily (SamplingParams.params_imply_greedy_decoding), under this model's input
    names: none of them given, or top_k 1, top_p 0 or temperature 0; None where it samples."""
    if temperature is None and top_k is None and top_p is None:
        return "no sampling_param_temperature, top_k or top_p given"
    for name, value, greedy in (("top_k", top_k, 1), ("top_p", top_p, 0.0), ("temperature", temperature, 0)):
        if value == greedy:
            return f"sampling_param_{name} {value:g}"
    return None


def llm_api_sampling(temperature: float | None, top_k: int | None, top_p: float | None) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) as the LLM API reads them: greedy (`greedy_because`), otherwise sampling, an unset
    one taking its neutral value."""
    if greedy_because(temperature, top_k, top_p) is not None:
        return 0.0, 0, 1.0
    return 1.0 if temperature is None else temperature, top_k or 0, 1.0 if top_p is None else top_p


def llmapi_request(inputs: Inputs, max_input_bytes: int) -> LlmApiRequest:
    """The request's tensors (not a `stop` request's) as the executor's; RequestError naming the input where they
    cannot be read, or where SamplingParams' own rules (n / best_of) refuse them."""
    refuse_unsupported(inputs, UNSUPPORTED)
    if "text_input" not in inputs:
        raise RequestError("text_input is required")
    prompts = texts(inputs["text_input"], "text_input", max_input_bytes)
    if len(prompts) != 1:
        raise RequestError(f"text_input: one prompt per request expected, got {len(prompts)} (requests are "
                           "batched in flight; send them separately)")
    stop = tuple(s for s in texts(inputs.get("sampling_param_stop", np.array([], object)), "sampling_param_stop",
                                  max_input_bytes) if s)
    sampling = [scalar(inputs, f"sampling_param_{n}") for n in ("temperature", "top_k", "top_p")]
    temperature, top_k, top_p = llm_api_sampling(*sampling)
    best_of = scalar(inputs, "sampling_param_best_of")
    max_tokens = scalar(inputs, "sampling_param_max_tokens")
    outputs = frozenset(name for name in OUTPUTS if scalar(inputs, f"return_{name}"))
    params = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                            temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed_from_client(scalar(inputs, "sampling_param_seed")), stop=stop,
                            frequency_penalty=scalar(inputs, "sampling_param_frequency_penalty") or 0.0,
                            presence_penalty=scalar(inputs, "sampling_param_presence_penalty") or 0.0,
                            logprobs=0 if "cumulative_logprob" in outputs else None,
                            guided_decoding=guided_decoding(inputs),
                            num_draft_tokens=scalar(inputs, "sampling_param_num_draft_tokens"),
                            # as upstream's model: n 1, the most likely of best_of sampled candidates
                            best_of=best_of)
    try:  # the rules of SamplingParams alone (n / best_of), refused under this model's input names
        params.validate()
    except ValueError as e:
        message = str(e)
        # best_of > 1 greedy (n is 1, best_of >= 1 as read): SamplingParams names a temperature 0 the client may not
        # have sent; the client hears what made the request greedy
        if params.greedy and refused_parameter(message) == "best_of":
            message = f"best_of must be 1 when decoding greedily ({greedy_because(*sampling)}), got {best_of}"
        raise RequestError(named_for_client(message, INPUT_NAMES)) from None
    return LlmApiRequest(prompts[0], params, bool(scalar(inputs, "streaming")),
                         bool(scalar(inputs, "sampling_param_return_perf_metrics")), outputs)
