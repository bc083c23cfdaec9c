"""Triton `tensorrt_llm`: TensorRT-LLM's engine model (the legacy `inflight_batcher_llm` contract: token ids in and
out) over runtime's executor (the native `Executor`, or `TrtllmExecutor` for a --backend trtllm engine:
`create_executor` picks). The executor, sender thread, cancellation, watchdog and metrics are
serving.triton.engine_model's, shared with the llmapi model; serving.triton.legacy_request reads TensorRT-LLM's
tensors (shared with the BLS, which checks requests with it before calling this model); this file writes its outputs.
Decoupled (streaming) or not (unary ModelInfer), one instance; stop words stay in the output, as upstream's do.
"""

from __future__ import annotations

import faulthandler
import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime.executors.outputs import RequestOutput
from serving.request_validation import no_unknown_parameters
from serving.triton.contract import client_named
from serving.triton.engine_limits import EngineLimits, publish, withdraw
from serving.triton.engine_model import Chunk, EngineModel, Stream
from serving.triton.engine_parameters import SETTING_NAMES, engine_parameters
from serving.triton.legacy_request import INPUT_NAMES, engine_request, scalar
from serving.triton.parameters import check_one_instance, model_path
from serving.triton.responses import FINAL


class TritonPythonModel(EngineModel):
    streaming_input = client_named("streaming")
    input_names = INPUT_NAMES
    setting_names = SETTING_NAMES

    def initialize(self, args: dict) -> None:
        faulthandler.enable()  # a crash of this stub is logged with its Python stacks, not lost
        config = json.loads(args["model_config"])
        check_one_instance(config)
        settings = engine_parameters(config, pb_utils.using_decoupled_model_transaction_policy(config))
        self.exclude_input_default = settings.exclude_input_in_output
        self.start(model_path(config, "gpt_model_path", args["model_repository"]), settings.executor, settings.triton,
                   model_name=args["model_name"], model_version=args["model_version"])
        stats = self.executor.stats()  # nothing runs yet: every block is free
        limits = EngineLimits(self.vocab_size, self.executor.limits.max_seq_len, self.executor.limits.max_batch_size,
                              self.kv_block_size, stats.kv_blocks_used + stats.kv_blocks_free,
                              self.executor.request_draft_len)
        self.model_name = args["model_name"]
        try:  # for the BLS, which checks requests against them before it calls this model
            publish(self.model_name, limits)
        except OSError as e:  # the BLS then leaves the checks that need them to this model
            pb_utils.Logger.log_warn(f"{self.label}: the engine's limits are not published for the BLS: {e}")

    def finalize(self) -> None:
        withdraw(self.model_name)
        super().finalize()

    def read(self, request: Any, sender: Any) -> dict[str, np.ndarray] | None:
        no_unknown_parameters(request.parameters(), "tensorrt_llm")
        inputs = {t.name(): t.as_numpy() for t in request.inputs()}
        if scalar(inputs, "stop", False):
            self.stop(request.request_id())
            sender.send(pb_utils.InferenceResponse([]), flags=FINAL)  # the C++ backend's empty final response
            return None
        return inputs

    def build(self, inputs: dict[str, np.ndarray], request_id: str, sender: Any) -> tuple[Stream, list[int]]:
        converted = engine_request(inputs, self.tokenizer, self.vocab_size, self.exclude_input_default)
        outputs = frozenset(name for name in ("num_input_tokens", "num_output_tokens", "log_probs")
                            if scalar(inputs, f"return_{name}", False))
        return Stream(sender, request_id, converted.streaming,
                      [] if converted.exclude_input else converted.prompt,
                      bool(scalar(inputs, "return_perf_metrics", False)), outputs, converted.params), converted.prompt

    def response(self, stream: Stream, chunk: Chunk, out: RequestOutput) -> Any:
        """output_ids [1, 1, N] and sequence_length [1, 1], plus what the request asked for: as upstream's, perf
        metrics only with return_perf_metrics, token counts only with return_num_*_tokens and cum_log_probs [1, 1] /
        output_log_probs [1, 1, generated tokens of output_ids] only with return_log_probs, for each tensor costs
        every streamed token its trip through the server, the ensemble and the client."""
        def one_value(name: str, value: Any, dtype: Any) -> Any:
            return pb_utils.Tensor(name, np.array([[value]], dtype))

        ids = chunk.ids
        tensors = [pb_utils.Tensor("output_ids", np.array(ids, np.int32).reshape(1, 1, -1)),
                   pb_utils.Tensor("sequence_length", np.array([[len(ids)]], np.int32))]
        if stream.perf_metrics:
            tensors += self.perf_metric_tensors(stream, out.stats, "legacy", (1, 1))
        if "log_probs" in stream.outputs:  # of the generated tokens in output_ids, under the target model
            chosen = out.logprobs[len(out.logprobs) - len(ids):] if stream.streaming else out.logprobs
            logprobs = [lp.logprob for lp in chosen]
            tensors += [one_value("cum_log_probs", out.cumulative_logprob, np.float32),
                        pb_utils.Tensor("output_log_probs", np.array(logprobs, np.float32).reshape(1, 1, -1))]
        if stream.params.n > 1:  # which of num_return_sequences, as upstream's (absent for one)
            tensors.append(one_value("sequence_index", out.index, np.int32))
        if "num_input_tokens" in stream.outputs:
            tensors.append(one_value("num_input_tokens", out.stats.prompt_tokens, np.int32))
        if "num_output_tokens" in stream.outputs:
            tensors.append(one_value("num_output_tokens", out.stats.output_tokens, np.int32))
        return pb_utils.InferenceResponse(tensors)
