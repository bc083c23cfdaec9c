"""Triton `preprocessing`: text -> token ids with runtime.tokenizer, in TensorRT-LLM's tensor layout.

Stop and bad words become TensorRT-LLM's word lists ([2, W] per item: the words' ids
concatenated, then their end offsets padded with -1), which tensorrt_llm turns back into words.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime.tokenizer import Tokenizer
from runtime.triton_parameters import boolean, parameter


def utf8(values: np.ndarray, name: str) -> list[str]:
    """Decode a TYPE_STRING tensor's items; invalid UTF-8 is the client's error, named as such."""
    out = []
    for v in values.reshape(-1):
        try:
            out.append(v.decode("utf-8") if isinstance(v, bytes) else str(v))
        except UnicodeDecodeError as e:
            raise ValueError(f"{name} must be valid UTF-8 text: {e}") from None
    return out


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
        config = json.loads(args["model_config"])
        tokenizer_dir = parameter(config, "tokenizer_dir")
        if tokenizer_dir is None:
            raise pb_utils.TritonModelException("preprocessing: parameter tokenizer_dir is not set")
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir)
        self.add_bos = parameter(config, "add_special_tokens", boolean)
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        self.end_id = -1 if eos is None else eos  # TensorRT-LLM's "no end id"
        self.pad_id = next((i for i in (pad, eos) if i is not None), 0)

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(self._process(request)))
            except ValueError as e:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
        return responses

    def _process(self, request) -> list:
        def get(name: str) -> np.ndarray | None:
            t = pb_utils.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        queries = utf8(get("QUERY"), "text_input")
        batch = len(queries)
        ids = [self.tokenizer.encode(q, add_bos=self.add_bos) for q in queries]
        lengths = np.array([[len(x)] for x in ids], np.int32)
        input_ids = np.full((batch, max(1, int(lengths.max()))), self.pad_id, np.int32)
        for i, x in enumerate(ids):
            input_ids[i, : len(x)] = x

        def words(tensor_name: str, client_name: str) -> np.ndarray:
            t = get(tensor_name)
            items = [[]] * batch if t is None else [utf8(row, client_name) for row in t.reshape(batch, -1)]
            return word_lists(self.tokenizer, items)

        def id_or_default(tensor_name: str, default: int) -> np.ndarray:
            t = get(tensor_name)
            return np.full((batch, 1), default, np.int32) if t is None else t.reshape(batch, 1).astype(np.int32)

        return [
            pb_utils.Tensor("INPUT_ID", input_ids),
            pb_utils.Tensor("REQUEST_INPUT_LEN", lengths),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", get("REQUEST_OUTPUT_LEN").reshape(batch, 1).astype(np.int32)),
            pb_utils.Tensor("BAD_WORDS_IDS", words("BAD_WORDS_DICT", "bad_words")),
            pb_utils.Tensor("STOP_WORDS_IDS", words("STOP_WORDS_DICT", "stop_words")),
            pb_utils.Tensor("OUT_END_ID", id_or_default("END_ID", self.end_id)),
            pb_utils.Tensor("OUT_PAD_ID", id_or_default("PAD_ID", self.pad_id)),
        ]
