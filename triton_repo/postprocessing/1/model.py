"""Triton `postprocessing`: output ids -> text with runtime.io.tokenizer.

Streamed chunks decode on their own: tensorrt_llm cuts the stream only where a character ends,
so every chunk's text is whole UTF-8 and the chunks concatenate to the full text. Reached directly
(`/infer`), ids outside the vocabulary and lengths outside the ids are refused, naming the input.
"""

from __future__ import annotations

import faulthandler
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime.io.tokenizer import Tokenizer
from serving.request_validation import RequestError, no_unknown_parameters, token_ids
from serving.triton_parameters import boolean, integer, model_path, parameter


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        faulthandler.enable()  # a crash of this stub is logged with its Python stacks, not lost
        config = json.loads(args["model_config"])
        self.tokenizer = Tokenizer.from_dir(model_path(config, "tokenizer_dir", args["model_repository"]))
        self.skip_special_tokens = parameter(config, "skip_special_tokens", boolean, default=True)
        # the model's vocabulary may be padded past the tokenizer's (ids the tokenizer decodes to nothing)
        self.vocab_size = max(self.tokenizer.vocab_size, parameter(config, "vocab_size", integer, default=0))

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", self._texts(request))]))
            except RequestError as e:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)))
        return responses

    def _texts(self, request) -> np.ndarray:
        no_unknown_parameters(request.parameters(), "postprocessing")
        tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()  # [B, beams, T]
        lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()  # [B, beams]
        if tokens.ndim != 3 or lengths.shape != tokens.shape[:2]:
            raise RequestError(f"TOKENS_BATCH [batch, beams, tokens] and SEQUENCE_LENGTH [batch, beams] do not match: "
                               f"{list(tokens.shape)} and {list(lengths.shape)}")
        texts = []
        for item, item_lengths in zip(tokens, lengths):
            row = []
            for beam, n in zip(item, item_lengths):
                if not 0 <= n <= len(beam):
                    raise RequestError(f"SEQUENCE_LENGTH must be in [0, {len(beam)}] (the tokens given), got {n}")
                ids = token_ids(beam[:n], "TOKENS_BATCH", self.vocab_size)
                row.append(self.tokenizer.decode(ids, self.skip_special_tokens).encode("utf-8"))
            texts.append(row)
        return np.array(texts, dtype=object)
