"""Triton `tensorrt_llm`, the `llmapi` flavour: TensorRT-LLM's current Triton model (text in, text out, sampling as
the LLM API's `SamplingParams`) over this project's executor, configured by `1/model.yaml` (LLM-API keys plus
`triton_config`, read by serving.llmapi_config). The executor, sender thread, cancellation, watchdog and metrics are
serving.triton_engine's, shared with the legacy `tensorrt_llm` model.

Decoupled (streaming allowed) or not (unary: one response), as model.yaml's triton_config says. text_output is the
generated text (the LLM API's `CompletionOutput.text`: never the prompt, nor a stop string that ended it); streamed,
each response carries the new text, cut on whole characters.

Structured output: upstream's llmapi model has no input for it; this one takes the legacy model's
guided_decoding_guide_type / guided_decoding_guide (json, json_schema, regex, ebnf_grammar), the names TensorRT-LLM's
Triton clients already send.
"""

from __future__ import annotations

import faulthandler
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime.core.sampling_params import PENALTY_LIMIT, SamplingParams, seed_from_client
from runtime.executors.requests import RequestOutput
from serving.llmapi_config import MODEL_YAML, read_model_yaml
from serving.request_validation import (GUIDED_INPUTS, INT32_MAX, RequestError, Scalar, guided_decoding,
                                        named_for_client, no_unknown_parameters, refuse_unsupported, texts)
from serving.triton_engine import Chunk, EngineModel, Stream, given

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
}
DEFAULT_MAX_TOKENS = 32  # the LLM API's SamplingParams.max_tokens


def llm_api_sampling(temperature: float | None, top_k: int | None, top_p: float | None) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) as the LLM API reads them (SamplingParams.params_imply_greedy_decoding): greedy when
    none is given, or top_k 1, top_p 0 or temperature 0; otherwise sampling, an unset one taking its neutral value."""
    if (temperature is None and top_k is None and top_p is None) or top_k == 1 or top_p == 0.0 or temperature == 0:
        return 0.0, 0, 1.0
    return 1.0 if temperature is None else temperature, top_k or 0, 1.0 if top_p is None else top_p


class TritonPythonModel(EngineModel):
    label = "tensorrt_llm (llmapi)"
    input_names = {"prompt": "text_input", "stop": "sampling_param_stop",
                   **{name.removeprefix("sampling_param_"): name for name in SCALARS
                      if name.startswith("sampling_param_")}}

    def initialize(self, args: dict) -> None:
        faulthandler.enable()  # a crash of this stub is logged with its Python stacks, not lost
        config = json.loads(args["model_config"])
        model_dir = Path(args["model_repository"])
        yaml_path = model_dir / args["model_version"] / os.environ.get("LLM_CONFIG_PATH", MODEL_YAML)  # as upstream
        llm = read_model_yaml(yaml_path, model_dir)
        for warning in llm.warnings:
            pb_utils.Logger.log_warn(f"{self.label}: {yaml_path}: {warning}")
        decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        max_batch_size = int(config.get("max_batch_size", 0))
        self.batched = max_batch_size > 0
        if (decoupled, max_batch_size) != (llm.triton.decoupled, llm.triton.max_batch_size):
            raise pb_utils.TritonModelException(
                f"{yaml_path}: triton_config says decoupled {llm.triton.decoupled} and max_batch_size "
                f"{llm.triton.max_batch_size}, config.pbtxt {decoupled} and {config.get('max_batch_size', 0)}; "
                "make them agree (make_model_repo --flavour llmapi writes both)")
        self.start(llm.model, llm.executor, llm.triton, model_name=args["model_name"],
                   model_version=args["model_version"])
        self.max_input_bytes = self.executor.limits.max_seq_len * self.tokenizer.max_token_bytes

    def _scalar(self, inputs: dict[str, np.ndarray], name: str) -> Any:
        return SCALARS[name].read(inputs[name], name) if name in inputs else None

    def convert(self, request: Any, sender: Any) -> tuple[Stream, list[int]] | None:
        no_unknown_parameters(request.parameters(), "tensorrt_llm")
        inputs = given(request, {"text_input", "sampling_param_stop", *SCALARS, *UNSUPPORTED, *GUIDED_INPUTS})
        if self._scalar(inputs, "stop"):
            self.stop(request.request_id(), sender)
            return None
        refuse_unsupported(inputs, UNSUPPORTED)
        if "text_input" not in inputs:
            raise RequestError("text_input is required")
        prompts = texts(inputs["text_input"], "text_input", self.max_input_bytes)
        if len(prompts) != 1:
            raise RequestError(f"text_input: one prompt per request expected, got {len(prompts)} (requests are "
                               "batched in flight; send them separately)")
        stop = tuple(s for s in texts(inputs.get("sampling_param_stop", np.array([], object)), "sampling_param_stop",
                                      self.max_input_bytes) if s)
        temperature, top_k, top_p = llm_api_sampling(*(self._scalar(inputs, f"sampling_param_{n}")
                                                       for n in ("temperature", "top_k", "top_p")))
        max_tokens = self._scalar(inputs, "sampling_param_max_tokens")
        outputs = frozenset(name for name in ("finish_reason", "stop_reason", "cumulative_logprob")
                            if self._scalar(inputs, f"return_{name}"))
        params = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                                temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=seed_from_client(self._scalar(inputs, "sampling_param_seed")), stop=stop,
                                frequency_penalty=self._scalar(inputs, "sampling_param_frequency_penalty") or 0.0,
                                presence_penalty=self._scalar(inputs, "sampling_param_presence_penalty") or 0.0,
                                logprobs=0 if "cumulative_logprob" in outputs else None,
                                guided_decoding=guided_decoding(inputs),
                                # as upstream's model: n 1, the most likely of best_of sampled candidates
                                best_of=self._scalar(inputs, "sampling_param_best_of"))
        try:  # the rules of SamplingParams alone (n / best_of), refused under this model's input names
            params.validate()
        except ValueError as e:
            raise RequestError(named_for_client(str(e), self.input_names)) from None
        prompt = self.tokenizer.encode(prompts[0])
        return Stream(sender, request.request_id(), bool(self._scalar(inputs, "streaming")), [],
                      bool(self._scalar(inputs, "sampling_param_return_perf_metrics")), outputs, params), prompt

    def response(self, stream: Stream, chunk: Chunk, out: RequestOutput) -> Any:
        """text_output, finish_reason / stop_reason as the LLM API's str() of them ("None" while unfinished),
        cumulative_logprob, and the perf metrics, shaped [1] (with max_batch_size > 0: [1, 1])."""
        def tensor(name: str, value: Any, dtype: Any) -> Any:
            return pb_utils.Tensor(name, np.array([value], dtype).reshape((1, 1) if self.batched else (1,)))

        tensors = [tensor("text_output", chunk.text.encode("utf-8"), object)]
        if "finish_reason" in stream.outputs:
            tensors.append(tensor("finish_reason", str(out.finish_reason).encode(), object))
        if "stop_reason" in stream.outputs:
            tensors.append(tensor("stop_reason", str(out.stop_reason).encode(), object))
        if "cumulative_logprob" in stream.outputs:  # of the output so far, under the target model (raw logprobs)
            tensors.append(tensor("cumulative_logprob", out.cumulative_logprob or 0.0, np.float32))
        if stream.perf_metrics:
            tensors += self.perf_metric_tensors(stream, out.stats, "llmapi", (1, 1) if self.batched else (1,))
        return pb_utils.InferenceResponse(tensors)
