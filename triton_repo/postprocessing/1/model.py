"""Triton `postprocessing`: output ids -> text with runtime.tokenizer.

Streamed chunks decode on their own: tensorrt_llm cuts the stream only where a character ends,
so every chunk's text is whole UTF-8 and the chunks concatenate to the full text.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime.tokenizer import Tokenizer
from runtime.triton_parameters import boolean, parameter


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        tokenizer_dir = parameter(config, "tokenizer_dir")
        if tokenizer_dir is None:
            raise pb_utils.TritonModelException("postprocessing: parameter tokenizer_dir is not set")
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir)
        self.skip_special_tokens = parameter(config, "skip_special_tokens", boolean, default=True)

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()  # [B, beams, T]
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()  # [B, beams]
            texts = [[self.tokenizer.decode(beam[:n].tolist(), self.skip_special_tokens).encode("utf-8")
                      for beam, n in zip(item, item_lengths)] for item, item_lengths in zip(tokens, lengths)]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", np.array(texts, dtype=object))]))
        return responses
