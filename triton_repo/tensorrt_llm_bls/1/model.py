"""Triton `tensorrt_llm_bls`: the ensemble's pipeline as business-logic scripting.

Tokenize (serving.text_processing, as preprocessing does) -> tensorrt_llm (decoupled, a BLS call) ->
detokenize each response (as postprocessing does), with the ensemble's inputs and outputs. Text is processed
in this process: a BLS call per streamed chunk cost a round trip through the server. Each instance serves one
request at a time inside `execute`, as upstream's BLS does, and concurrent requests take one instance each
(`bls_instance_count`): Triton 2.51's Python backend stub crashes when one stub streams several decoupled BLS
requests at once from threads. Between responses the request's cancellation is checked and turned into
TensorRT-LLM's `stop` request.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import traceback
import uuid
from typing import Any, Iterator

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime.executors.errors import QueueFull
from serving.engine_limits import PublishedLimits
from serving.legacy_request import bls_values, check_engine_request, engine_request
from serving.perf_metrics import PERF_OUTPUTS
from serving.request_validation import RequestError, no_unknown_parameters
from serving.triton_contract import ENGINE_INPUTS, PREPROCESSED, PREPROCESSING_INPUTS
from serving.text_processing import bls_settings

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# tensorrt_llm's optional outputs, passed on when it sends them (return_perf_metrics, return_num_*_tokens,
# return_log_probs, num_return_sequences above 1)
STATS = (*(name for name, *_ in PERF_OUTPUTS["legacy"]), "num_input_tokens", "num_output_tokens", "cum_log_probs",
         "output_log_probs", "sequence_index")


class BLSError(Exception):
    """An error response from a composing model, passed on to the client as it is, its code too: Triton 2.51 hands
    it over as INTERNAL, so a full queue is made UNAVAILABLE again (the code a client retries on)."""

    def __init__(self, error: Any) -> None:
        super().__init__(error.message())
        self.code = pb_utils.TritonError.UNAVAILABLE if QueueFull.is_worded(error.message()) else error.code()


def renamed(request: Any, names: dict[str, str]) -> dict[str, np.ndarray]:
    """The request's tensors among `names`, under their new names."""
    out = {}
    for old, new in names.items():
        t = pb_utils.get_input_tensor_by_name(request, old)
        if t is not None:
            out[new] = t.as_numpy()
    return out


def outputs(response: Any) -> dict[str, np.ndarray]:
    if response.has_error():
        raise BLSError(response.error())
    return {t.name(): t.as_numpy() for t in response.output_tensors()}


def check_inputs(request: Any) -> dict[str, Any]:
    """Parameters this model does not take refused, then the client's inputs (`bls_values`)."""
    no_unknown_parameters(request.parameters(), "tensorrt_llm_bls")
    return bls_values({t.name(): t.as_numpy() for t in request.inputs()})


def error_response(e: Exception) -> Any:
    """A composing model's error or our own refusal as it is; any other failure without its traceback."""
    if isinstance(e, BLSError):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), e.code))
    if isinstance(e, ValueError):  # a refusal (RequestError, or the request checks of tensorrt_llm: engine_request)
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG))
    pb_utils.Logger.log_error(f"tensorrt_llm_bls: request failed: {''.join(traceback.format_exception(e))}")
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(
        f"internal error ({type(e).__name__}); see the server log"))


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        faulthandler.enable()  # a crash of this stub is logged with its Python stacks, not lost
        config = json.loads(args["model_config"])
        settings = bls_settings(config, args["model_repository"])
        self.preprocess, self.postprocess = settings.preprocess, settings.postprocess
        self.engine_model, self.accumulate = settings.engine_model, settings.accumulate
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.engine_limits = PublishedLimits(self.engine_model)

    def execute(self, requests: list) -> list | None:
        if self.decoupled:
            for request in requests:
                self._serve(request)
            return None
        return [self._respond_once(request) for request in requests]

    def _serve(self, request: Any) -> None:
        sender = request.get_response_sender()
        last = None
        try:
            with contextlib.closing(self._generate(request)) as responses:  # closed, it ends the engine's request
                for response in responses:
                    sender.send(response)
        except Exception as e:  # an invalid request, or the client went away
            last = error_response(e)
        with contextlib.suppress(Exception):
            sender.send(last, flags=FINAL)

    def _respond_once(self, request: Any) -> Any:
        """Non-decoupled mode: one response per request, so no streaming."""
        try:
            stream = pb_utils.get_input_tensor_by_name(request, "stream")
            if stream is not None and stream.as_numpy().any():
                raise RequestError("stream=true needs tensorrt_llm_bls to be decoupled (decoupled_mode:true)")
            *_, last = self._generate(request)
            return last
        except Exception as e:
            return error_response(e)

    def _generate(self, request: Any) -> Iterator[Any]:
        n = check_inputs(request).get("num_return_sequences", 1)
        if n > 1 and not self.decoupled:
            raise RequestError(f"num_return_sequences {n} needs tensorrt_llm_bls to be decoupled "
                               "(decoupled_mode:true): a response per sequence")

        def client_input(name: str) -> np.ndarray | None:  # preprocessing's input `name`, from the client's
            t = pb_utils.get_input_tensor_by_name(request, PREPROCESSING_INPUTS[name]) \
                if name in PREPROCESSING_INPUTS else None
            return None if t is None else t.as_numpy()

        pre = self.preprocess(client_input)
        engine_inputs = {PREPROCESSED[k]: v for k, v in pre.items() if k in PREPROCESSED} | \
            renamed(request, ENGINE_INPUTS)
        limits = self.engine_limits.get()
        if limits is not None:  # refuse what tensorrt_llm and its executor would, as they would (see check_inputs)
            check_engine_request(engine_request(engine_inputs, self.preprocess.tokenizer, limits.vocab_size, False),
                                 self.preprocess.tokenizer, limits)
        engine_id = f"{request.request_id()}#{uuid.uuid4().hex}"  # unique: a stop for it ends this request only
        engine_call = pb_utils.InferenceRequest(
            model_name=self.engine_model, request_id=engine_id,
            inputs=[pb_utils.Tensor(name, v) for name, v in engine_inputs.items()],
            requested_output_names=["output_ids", "sequence_length", *STATS])
        stream = pb_utils.get_input_tensor_by_name(request, "stream")
        # accumulate_tokens: the whole text so far of each sequence (by sequence_index) in each of its responses
        accumulate = self.accumulate and stream is not None and stream.as_numpy().any()
        accumulated: dict[int, list[int]] = {}
        engine_responses = engine_call.exec(decoupled=True)
        finished = False
        try:
            for response in engine_responses:
                out = outputs(response)
                if "output_ids" not in out:
                    continue  # a flags-only final response
                if accumulate:
                    ids = accumulated.setdefault(int(out.get("sequence_index", np.zeros(1)).reshape(-1)[0]), [])
                    ids += out["output_ids"].reshape(-1)[: int(out["sequence_length"].reshape(-1)[0])].tolist()
                    out["output_ids"] = np.array(ids, np.int32).reshape(1, 1, -1)
                    out["sequence_length"] = np.array([[len(ids)]], np.int32)
                text = self.postprocess(out["output_ids"], out["sequence_length"])
                yield pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text),
                                                  *(pb_utils.Tensor(k, out[k]) for k in STATS if k in out)])
                if request.is_cancelled():  # the client cancelled or went away: stop the engine's work
                    return
            finished = True
        finally:
            if not finished:  # cancelled, closed early or failed: stop the engine's request and read it to its
                self._stop_engine_request(engine_id)  # end here rather than whenever the iterator is collected
                for _ in engine_responses:
                    pass

    def _stop_engine_request(self, engine_id: str) -> None:
        """TensorRT-LLM's `stop` request for one engine request id."""
        stop = pb_utils.InferenceRequest(
            model_name=self.engine_model, request_id=engine_id, requested_output_names=[],
            inputs=[pb_utils.Tensor("input_ids", np.zeros((1, 1), np.int32)),
                    pb_utils.Tensor("input_lengths", np.zeros((1, 1), np.int32)),
                    pb_utils.Tensor("request_output_len", np.zeros((1, 1), np.int32)),
                    pb_utils.Tensor("stop", np.ones((1, 1), bool))])
        for response in stop.exec(decoupled=True):
            if response.has_error():
                pb_utils.Logger.log_warn(f"tensorrt_llm_bls: stopping {engine_id}: {response.error().message()}")

