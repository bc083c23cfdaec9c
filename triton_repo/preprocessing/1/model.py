"""Triton `preprocessing`: text -> token ids in TensorRT-LLM's tensor layout (serving.triton.text_processing)."""

from __future__ import annotations

import faulthandler
import json

import triton_python_backend_utils as pb_utils

from serving.request_validation import no_unknown_parameters
from serving.triton.parameters import parameter
from serving.triton.responses import error_response
from serving.triton.text_processing import DEFAULT_MAX_INPUT_BYTES, Preprocessor


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        faulthandler.enable()  # a crash of this stub is logged with its Python stacks, not lost
        config = json.loads(args["model_config"])
        self.preprocess = Preprocessor.from_config(config, args["model_repository"])
        if parameter(config, "max_input_tokens") is None:
            pb_utils.Logger.log_warn(f"preprocessing: parameter max_input_tokens is not set; text_input is capped at "
                                     f"{DEFAULT_MAX_INPUT_BYTES} bytes")

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                no_unknown_parameters(request.parameters(), "preprocessing")

                def get(name: str, request=request):
                    t = pb_utils.get_input_tensor_by_name(request, name)
                    return None if t is None else t.as_numpy()

                responses.append(pb_utils.InferenceResponse(
                    [pb_utils.Tensor(name, value) for name, value in self.preprocess(get).items()]))
            except Exception as e:
                responses.append(error_response(e, "preprocessing"))
        return responses
