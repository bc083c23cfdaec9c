"""What the `tensorrt_llm_bls` model does, without Triton's API: its settings, the checks of a client's request, the
request it sends `tensorrt_llm` (checked as tensorrt_llm would check it), the stitching of accumulated tokens and the
engine's `stop` request. Its model file only moves tensors between these and Triton. No torch: the BLS's stub stays
light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from serving.request_validation import check_response_count, no_unknown_parameters
from serving.triton.contract import ENGINE_INPUTS, PREPROCESSED, PREPROCESSING_INPUTS
from serving.triton.engine_limits import EngineLimits
from serving.triton.legacy_request import Inputs, bls_values, check_engine_request, engine_request
from serving.triton.parameters import boolean, parameter, sibling_config
from serving.triton.perf_metrics import PERF_OUTPUTS
from serving.triton.text_processing import Postprocessor, Preprocessor

# tensorrt_llm's optional outputs, passed on when it sends them (return_perf_metrics, return_num_*_tokens,
# return_log_probs, num_return_sequences above 1)
STATS = (*(name for name, *_ in PERF_OUTPUTS["legacy"]), "num_input_tokens", "num_output_tokens", "cum_log_probs",
         "output_log_probs", "sequence_index")


@dataclass(frozen=True)
class BlsSettings:
    """What the BLS reads from its parameters: its text models, the engine model it calls, accumulate_tokens."""

    preprocess: Preprocessor
    postprocess: Postprocessor
    engine_model: str
    accumulate: bool


def bls_settings(config: dict, model_dir: str) -> BlsSettings:
    """The BLS's settings, read by the BLS when it loads and by make_model_repo; filled by upstream's commands, which
    give the BLS no tokenizer, it takes its siblings' text settings."""
    if parameter(config, "tokenizer_dir") is not None:
        text = Preprocessor.from_config(config, model_dir), Postprocessor.from_config(config, model_dir)
    else:
        text = (Preprocessor.from_config(*sibling_config(model_dir, "preprocessing")),
                Postprocessor.from_config(*sibling_config(model_dir, "postprocessing")))
    return BlsSettings(*text, parameter(config, "tensorrt_llm_model_name", default="tensorrt_llm"),
                       parameter(config, "accumulate_tokens", boolean, default=False))


def check_client_request(parameters_json: str, inputs: Inputs, decoupled: bool) -> dict[str, Any]:
    """Refuse parameters the BLS does not take, its inputs' values under the client's names (`bls_values`), and
    what needs more than one response from a BLS deployed non-decoupled. The scalar values read, by tensorrt_llm's
    names."""
    no_unknown_parameters(parameters_json, "tensorrt_llm_bls")
    values = bls_values(inputs)
    check_response_count(decoupled, values.get("streaming", False), values.get("num_return_sequences", 1), "stream")
    return values


def engine_inputs(preprocess: Preprocessor, inputs: Inputs, limits: EngineLimits | None) -> Inputs:
    """tensorrt_llm's inputs for the client's `inputs`: preprocessing's outputs and the inputs passed straight on,
    under tensorrt_llm's names. With the engine's limits known, refused as tensorrt_llm and its executor would refuse
    them, by the BLS itself (`bls_values` says why)."""
    preprocessed = preprocess(lambda name: inputs.get(PREPROCESSING_INPUTS[name]) if name in PREPROCESSING_INPUTS
                              else None)
    out = {PREPROCESSED[k]: v for k, v in preprocessed.items() if k in PREPROCESSED} | {
        engine: inputs[client] for client, engine in ENGINE_INPUTS.items() if client in inputs}
    if limits is not None:
        check_engine_request(engine_request(out, preprocess.tokenizer, limits.vocab_size, False), preprocess.tokenizer,
                             limits)
    return out


def accumulated(out: Inputs, so_far: dict[int, list[int]]) -> Inputs:
    """accumulate_tokens: a tensorrt_llm response's outputs `out` with output_ids / sequence_length the whole output
    so far of its sequence (`so_far`, by sequence_index, holds them and grows)."""
    ids = so_far.setdefault(int(out.get("sequence_index", np.zeros(1)).reshape(-1)[0]), [])
    ids += out["output_ids"].reshape(-1)[: int(out["sequence_length"].reshape(-1)[0])].tolist()
    return out | {"output_ids": np.array(ids, np.int32).reshape(1, 1, -1),
                  "sequence_length": np.array([[len(ids)]], np.int32)}


def stop_inputs() -> Inputs:
    """TensorRT-LLM's `stop` request (sent with the id of the request to stop): its required inputs, empty."""
    return {"input_ids": np.zeros((1, 1), np.int32), "input_lengths": np.zeros((1, 1), np.int32),
            "request_output_len": np.zeros((1, 1), np.int32), "stop": np.ones((1, 1), bool)}
