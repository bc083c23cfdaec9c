"""Triton `preprocessing`: text -> token ids with runtime.io.tokenizer, in TensorRT-LLM's tensor layout.

Stop and bad words become TensorRT-LLM's word lists ([2, W] per item: the words' ids
concatenated, then their end offsets padded with -1), which tensorrt_llm turns back into words.
Text longer than the context could hold is refused before it is tokenized (serving.request_validation).
"""

from __future__ import annotations

import faulthandler
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime.io.tokenizer import Tokenizer
from serving.request_validation import INT32_MAX, RequestError, integer, no_unknown_parameters, texts
from serving.triton_parameters import boolean, integer as integer_parameter, model_path, parameter

DEFAULT_MAX_INPUT_BYTES = 1 << 20  # when max_input_tokens is not set


def word_lists(tokenizer: Tokenizer, batch: list[list[str]]) -> np.ndarray:
    """[B, 2, W] int32: per item, the ids of its words back to back and their end offsets
    (-1 padded); W >= 1 so the tensor is never empty."""
    rows = []
    for words in batch:
        ids: list[int] = []
        offsets: list[int] = []
        for word in words:
            if word:
                ids += tokenizer.encode(word, add_bos=False)
                offsets.append(len(ids))
        rows.append((ids, offsets))
    width = max([1] + [len(ids) for ids, _ in rows])
    out = np.zeros((len(rows), 2, width), np.int32)
    out[:, 1, :] = -1
    for i, (ids, offsets) in enumerate(rows):
        out[i, 0, : len(ids)] = ids
        out[i, 1, : len(offsets)] = offsets
    return out


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        faulthandler.enable()  # a crash of this stub is logged with its Python stacks, not lost
        config = json.loads(args["model_config"])
        tokenizer_dir = model_path(config, "tokenizer_dir", args["model_repository"])
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir)
        self.add_bos = parameter(config, "add_special_tokens", boolean)
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        self.end_id = -1 if eos is None else eos  # TensorRT-LLM's "no end id"
        self.pad_id = next((i for i in (pad, eos) if i is not None), 0)
        max_tokens = parameter(config, "max_input_tokens", integer_parameter)
        self.max_input_bytes = DEFAULT_MAX_INPUT_BYTES if max_tokens is None else max_tokens * self.tokenizer.max_token_bytes
        if max_tokens is None:
            pb_utils.Logger.log_warn(f"preprocessing: parameter max_input_tokens is not set; text_input is capped at "
                                     f"{DEFAULT_MAX_INPUT_BYTES} bytes")

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(self._process(request)))
            except RequestError as e:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)))
        return responses

    def _process(self, request) -> list:
        no_unknown_parameters(request.parameters(), "preprocessing")

        def get(name: str) -> np.ndarray | None:
            t = pb_utils.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        if get("QUERY") is None:
            raise RequestError("text_input is required")
        queries = texts(get("QUERY"), "text_input", self.max_input_bytes)
        batch = len(queries)
        ids = [self.tokenizer.encode(q, add_bos=self.add_bos) for q in queries]
        lengths = np.array([[len(x)] for x in ids], np.int32)
        input_ids = np.full((batch, max(1, int(lengths.max()))), self.pad_id, np.int32)
        for i, x in enumerate(ids):
            input_ids[i, : len(x)] = x

        def words(tensor_name: str, client_name: str) -> np.ndarray:
            t = get(tensor_name)
            items = [[]] * batch if t is None else [texts(row, client_name, self.max_input_bytes)
                                                    for row in t.reshape(batch, -1)]
            return word_lists(self.tokenizer, items)

        def per_item(tensor_name: str, client_name: str, low: int, default: int | None = None) -> np.ndarray:
            t = get(tensor_name)
            if t is None:
                if default is None:
                    raise RequestError(f"{client_name} is required")
                return np.full((batch, 1), default, np.int32)
            return np.array([[integer(v, client_name, low, INT32_MAX)] for v in t.reshape(batch, 1)], np.int32)

        return [
            pb_utils.Tensor("INPUT_ID", input_ids),
            pb_utils.Tensor("REQUEST_INPUT_LEN", lengths),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", per_item("REQUEST_OUTPUT_LEN", "max_tokens", 1)),
            pb_utils.Tensor("BAD_WORDS_IDS", words("BAD_WORDS_DICT", "bad_words")),
            pb_utils.Tensor("STOP_WORDS_IDS", words("STOP_WORDS_DICT", "stop_words")),
            pb_utils.Tensor("OUT_END_ID", per_item("END_ID", "end_id", -1, self.end_id)),
            pb_utils.Tensor("OUT_PAD_ID", per_item("PAD_ID", "pad_id", 0, self.pad_id)),
        ]
