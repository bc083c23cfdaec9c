"""Triton `tensorrt_llm_bls`: the ensemble's pipeline as business-logic scripting.

Tokenize -> tensorrt_llm (decoupled, a BLS call) -> detokenize each response, with the ensemble's inputs and
outputs; the pipeline's logic is serving.triton.bls's, this file moves tensors between it and Triton. Each instance
serves one request at a time inside `execute`, as upstream's BLS does, and concurrent requests take one instance each
(`bls_instance_count`: Triton's Python backend stub crashes streaming several at once from threads,
docs/reliability.md). Between responses the request's cancellation is checked and turned into TensorRT-LLM's `stop`
request.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
from typing import Any, Iterator

import numpy as np
import triton_python_backend_utils as pb_utils

from serving.triton.bls import STATS, accumulated, bls_settings, check_client_request, engine_inputs, stop_inputs
from serving.triton.contract import engine_request_id
from serving.triton.engine_limits import PublishedLimits
from serving.triton.responses import FINAL, RelayedError, error_response

LABEL = "tensorrt_llm_bls"  # how the model names itself in the server log


def outputs(response: Any) -> dict[str, np.ndarray]:
    if response.has_error():
        raise RelayedError(response.error())
    return {t.name(): t.as_numpy() for t in response.output_tensors()}


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        faulthandler.enable()  # a crash of this stub is logged with its Python stacks, not lost
        config = json.loads(args["model_config"])
        self.settings = bls_settings(config, args["model_repository"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.engine_limits = PublishedLimits(self.settings.engine_model)

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
            last = error_response(e, LABEL)
        with contextlib.suppress(Exception):
            sender.send(last, flags=FINAL)

    def _respond_once(self, request: Any) -> Any:
        """Non-decoupled mode: one response per request."""
        try:
            *_, last = self._generate(request)
            return last
        except Exception as e:
            return error_response(e, LABEL)

    def _generate(self, request: Any) -> Iterator[Any]:
        inputs = {t.name(): t.as_numpy() for t in request.inputs()}
        values = check_client_request(request.parameters(), inputs, self.decoupled)
        engine_id = engine_request_id(request.request_id())
        engine_call = pb_utils.InferenceRequest(
            model_name=self.settings.engine_model, request_id=engine_id,
            inputs=[pb_utils.Tensor(name, v) for name, v in
                    engine_inputs(self.settings.preprocess, inputs, self.engine_limits.get()).items()],
            requested_output_names=["output_ids", "sequence_length", *STATS])
        accumulate = self.settings.accumulate and values.get("streaming", False)
        so_far: dict[int, list[int]] = {}
        engine_responses = engine_call.exec(decoupled=True)
        finished = False
        try:
            for response in engine_responses:
                out = outputs(response)
                if "output_ids" not in out:
                    continue  # a flags-only final response
                if accumulate:
                    out = accumulated(out, so_far)
                text = self.settings.postprocess(out["output_ids"], out["sequence_length"])
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
        stop = pb_utils.InferenceRequest(
            model_name=self.settings.engine_model, request_id=engine_id, requested_output_names=[],
            inputs=[pb_utils.Tensor(name, v) for name, v in stop_inputs().items()])
        for response in stop.exec(decoupled=True):
            if response.has_error():
                pb_utils.Logger.log_warn(f"{LABEL}: stopping {engine_id}: {response.error().message()}")
