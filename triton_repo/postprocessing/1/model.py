"""Triton `postprocessing`: output ids -> text (serving.triton.text_processing). Reached directly (`/infer`), ids
outside the vocabulary and lengths outside the ids are refused, naming the input."""

from __future__ import annotations

import faulthandler
import json

import triton_python_backend_utils as pb_utils

from serving.request_validation import no_unknown_parameters
from serving.triton.responses import error_response
from serving.triton.text_processing import Postprocessor


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        faulthandler.enable()  # a crash of this stub is logged with its Python stacks, not lost
        self.postprocess = Postprocessor.from_config(json.loads(args["model_config"]), args["model_repository"])

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                no_unknown_parameters(request.parameters(), "postprocessing")
                text = self.postprocess(pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy(),
                                        pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy())
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", text)]))
            except Exception as e:
                responses.append(error_response(e, "postprocessing"))
        return responses
