"""Triton `tensorrt_llm`, the `llmapi` flavour: TensorRT-LLM's current Triton model (text in, text out, sampling as
the LLM API's `SamplingParams`) over this project's executor, configured by `1/model.yaml` (LLM-API keys plus
`triton_config`, read by serving.triton.llmapi_config). The executor, sender thread, cancellation, watchdog and
metrics are serving.triton.engine_model's, shared with the legacy `tensorrt_llm` model.

Decoupled (streaming allowed) or not (unary: one response), as model.yaml's triton_config says. text_output is the
generated text (the LLM API's `CompletionOutput.text`: never the prompt, nor a stop string that ended it); streamed,
each response carries the whole text so far, cut on whole characters, as upstream's model sends it.

Structured output: upstream's llmapi model has no input for it; this one takes the legacy model's
guided_decoding_guide_type / guided_decoding_guide (json, json_schema, regex, ebnf_grammar), the names TensorRT-LLM's
Triton clients already send. Per-request speculation, which upstream's model has no input for either:
sampling_param_num_draft_tokens, SamplingParams.num_draft_tokens under upstream's sampling_param_* naming.
"""

from __future__ import annotations

import faulthandler
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime.executors.outputs import RequestOutput
from serving.request_validation import no_unknown_parameters
from serving.triton.engine_model import Chunk, EngineModel, Stream, given
from serving.triton.llmapi_config import MODEL_YAML, SETTING_NAMES, read_model_yaml
from serving.triton.llmapi_request import INPUT_NAMES, INPUTS, llmapi_request, scalar
from serving.triton.parameters import check_one_instance
from serving.triton.responses import FINAL



class TritonPythonModel(EngineModel):
    label = "tensorrt_llm (llmapi)"
    input_names = INPUT_NAMES
    setting_names = SETTING_NAMES

    def initialize(self, args: dict) -> None:
        faulthandler.enable()  # a crash of this stub is logged with its Python stacks, not lost
        config = json.loads(args["model_config"])
        check_one_instance(config)
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
        self.max_input_bytes = self.tokenizer.max_text_bytes(self.executor.limits.max_seq_len)

    def read(self, request: Any, sender: Any) -> dict[str, np.ndarray] | None:
        no_unknown_parameters(request.parameters(), "tensorrt_llm")
        inputs = given(request, INPUTS)
        if scalar(inputs, "stop"):
            self.stop(request.request_id())
            # upstream's llmapi model answers a stop request with its CANCELLED error
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                "Request cancelled by client", pb_utils.TritonError.CANCELLED)), flags=FINAL)
            return None
        return inputs

    def build(self, inputs: dict[str, np.ndarray], request_id: str, sender: Any) -> tuple[Stream, list[int]]:
        req = llmapi_request(inputs, self.max_input_bytes)
        return (Stream(sender, request_id, req.streaming, [], req.perf_metrics, req.outputs, req.params),
                self.tokenizer.encode(req.text))

    def response(self, stream: Stream, chunk: Chunk, out: RequestOutput) -> Any:
        """text_output (the whole text so far, streamed or not: upstream's model sends the LLM API's
        CompletionOutput.text, which grows, in every response), finish_reason / stop_reason as the LLM API's str() of
        them ("None" while unfinished), cumulative_logprob, and the perf metrics, shaped [1] (with max_batch_size > 0:
        [1, 1])."""
        def tensor(name: str, value: Any, dtype: Any) -> Any:
            return pb_utils.Tensor(name, np.array([value], dtype).reshape((1, 1) if self.batched else (1,)))

        tensors = [tensor("text_output", out.text.encode("utf-8"), object)]
        if "finish_reason" in stream.outputs:
            tensors.append(tensor("finish_reason", str(out.finish_reason).encode(), object))
        if "stop_reason" in stream.outputs:
            tensors.append(tensor("stop_reason", str(out.stop_reason).encode(), object))
        if "cumulative_logprob" in stream.outputs:  # of the output so far, under the target model (raw logprobs)
            tensors.append(tensor("cumulative_logprob", out.cumulative_logprob or 0.0, np.float32))
        if stream.perf_metrics:
            tensors += self.perf_metric_tensors(stream, out.stats, "llmapi", (1, 1) if self.batched else (1,))
        return pb_utils.InferenceResponse(tensors)
