"""Text <-> TensorRT-LLM's tensors: what the `preprocessing` and `postprocessing` models do, and what the BLS
does in its own process (a call to them per streamed chunk would cost a round trip through the server; see
docs/reliability.md, "The BLS serves one request per instance").

Stop and bad words become TensorRT-LLM's word lists ([2, W] per item: the words' ids concatenated, then their
end offsets padded with -1), which tensorrt_llm turns back into words; embedding bias words and weights its
embedding_bias (a float per vocabulary token). Text longer than the context could hold is refused before it is
tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from runtime.io.tokenizer import Tokenizer
from serving.request_validation import (INT32_MAX, RequestError, integer, max_stop_words, refuse_unsupported, texts,
                                        token_ids)
from serving.triton.contract import PREPROCESSING_INPUTS, UNSUPPORTED_TEXT_INPUTS
from serving.triton.parameters import boolean, integer as integer_parameter, model_path, parameter

DEFAULT_MAX_INPUT_BYTES = 1 << 20  # when max_input_tokens is not set
Inputs = Callable[[str], "np.ndarray | None"]  # an input tensor by name, None when the request has none


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


@dataclass(frozen=True)
class Preprocessor:
    """preprocessing's inputs (QUERY, REQUEST_OUTPUT_LEN, BAD_WORDS_DICT, ...) -> its outputs (INPUT_ID,
    REQUEST_INPUT_LEN, ...), refusing bad values under the client's names (text_input, max_tokens, ...). The
    decoder inputs of encoder-decoder models come out padded, as upstream's for a decoder-only model (a pad id,
    length 1), and tensorrt_llm ignores them."""

    tokenizer: Tokenizer
    add_bos: bool | None
    max_input_bytes: int

    @classmethod
    def from_config(cls, config: dict, model_dir: str) -> Preprocessor:
        """From a Triton model's parameters tokenizer_dir, add_special_tokens and max_input_tokens."""
        tokenizer = Tokenizer.from_dir(model_path(config, "tokenizer_dir", model_dir))
        max_tokens = parameter(config, "max_input_tokens", integer_parameter)
        max_bytes = DEFAULT_MAX_INPUT_BYTES if max_tokens is None else tokenizer.max_text_bytes(max_tokens)
        return cls(tokenizer, parameter(config, "add_special_tokens", boolean), max_bytes)

    @property
    def end_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return -1 if eos is None else eos  # TensorRT-LLM's "no end id"

    @property
    def pad_id(self) -> int:
        return next((i for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id) if i is not None), 0)

    def __call__(self, get: Inputs) -> dict[str, np.ndarray]:
        client = PREPROCESSING_INPUTS  # refusals name the client's input
        if get("QUERY") is None:
            raise RequestError(f"{client['QUERY']} is required")
        refuse_unsupported({n: v for n in UNSUPPORTED_TEXT_INPUTS if (v := get(n)) is not None},
                           UNSUPPORTED_TEXT_INPUTS, client)
        queries = texts(get("QUERY"), client["QUERY"], self.max_input_bytes)
        batch = len(queries)
        ids = [self.tokenizer.encode(q, add_bos=self.add_bos) for q in queries]
        lengths = np.array([[len(x)] for x in ids], np.int32)
        input_ids = np.full((batch, max(1, int(lengths.max()))), self.pad_id, np.int32)
        for i, x in enumerate(ids):
            input_ids[i, : len(x)] = x

        def words(tensor_name: str, max_words: int) -> np.ndarray:
            t = get(tensor_name)
            if t is not None and t.size > batch * max_words:  # counted before any is tokenized
                raise RequestError(f"{client[tensor_name]} holds {t.size // batch} words; at most {max_words}")
            items = [[]] * batch if t is None else [texts(row, client[tensor_name], self.max_input_bytes)
                                                    for row in t.reshape(batch, -1)]
            return word_lists(self.tokenizer, items)

        def per_item(tensor_name: str, low: int, default: int | None = None) -> np.ndarray:
            t = get(tensor_name)
            if t is None:
                if default is None:
                    raise RequestError(f"{client[tensor_name]} is required")
                return np.full((batch, 1), default, np.int32)
            return np.array([[integer(v, client[tensor_name], low, INT32_MAX)] for v in t.reshape(batch, 1)],
                            np.int32)

        return {
            "INPUT_ID": input_ids,
            "REQUEST_INPUT_LEN": lengths,
            "REQUEST_OUTPUT_LEN": per_item("REQUEST_OUTPUT_LEN", 1),
            "BAD_WORDS_IDS": words("BAD_WORDS_DICT", self.tokenizer.vocab_size),
            "STOP_WORDS_IDS": words("STOP_WORDS_DICT", max_stop_words(self.tokenizer)),
            "OUT_END_ID": per_item("END_ID", -1, self.end_id),
            "OUT_PAD_ID": per_item("PAD_ID", 0, self.pad_id),
            "DECODER_INPUT_ID": np.full((batch, 1), self.pad_id, np.int32),
            "REQUEST_DECODER_INPUT_LEN": np.ones((batch, 1), np.int32),
            "EMBEDDING_BIAS": self.embedding_bias(get, batch),
        }

    def embedding_bias(self, get: Inputs, batch: int) -> np.ndarray:
        """EMBEDDING_BIAS_WORDS and EMBEDDING_BIAS_WEIGHTS ([batch, words] each) as upstream's preprocessing makes
        them tensorrt_llm's embedding_bias: [batch, vocab] float32, each word's weight added to every token of the
        word (tokenized without special tokens, which upstream's adds: its bos would be biased too); [batch, 0] when
        no word is given."""
        client = PREPROCESSING_INPUTS
        words_in, weights_in = get("EMBEDDING_BIAS_WORDS"), get("EMBEDDING_BIAS_WEIGHTS")
        if (words_in is None or words_in.size == 0) and (weights_in is None or weights_in.size == 0):
            return np.zeros((batch, 0), np.float32)
        words_name, weights_name = client["EMBEDDING_BIAS_WORDS"], client["EMBEDDING_BIAS_WEIGHTS"]
        if words_in is None or weights_in is None or words_in.size != weights_in.size:
            shapes = [None if t is None else list(t.shape) for t in (words_in, weights_in)]
            raise RequestError(f"{words_name} and {weights_name} go together, one weight per word; got shapes "
                               f"{shapes[0]} and {shapes[1]}")
        weights = weights_in.reshape(batch, -1).astype(np.float32)
        if not np.isfinite(weights).all():
            raise RequestError(f"{weights_name} must be finite numbers, got {weights.reshape(-1)[:8].tolist()}")
        bias = np.zeros((batch, self.tokenizer.vocab_size), np.float32)
        for item, (row, row_weights) in enumerate(zip(words_in.reshape(batch, -1), weights)):
            for word, weight in zip(texts(row, words_name, self.max_input_bytes), row_weights):
                np.add.at(bias[item], self.tokenizer.encode(word, add_bos=False), weight)
        return bias


@dataclass(frozen=True)
class Postprocessor:
    """Output ids -> text. Streamed chunks decode on their own: tensorrt_llm cuts the stream only where a
    character ends, so every chunk's text is whole UTF-8 and the chunks concatenate to the full text."""

    tokenizer: Tokenizer
    skip_special_tokens: bool
    vocab_size: int  # the model's vocabulary may be padded past the tokenizer's (ids that decode to nothing)

    @classmethod
    def from_config(cls, config: dict, model_dir: str) -> Postprocessor:
        """From a Triton model's parameters tokenizer_dir, skip_special_tokens and vocab_size."""
        tokenizer = Tokenizer.from_dir(model_path(config, "tokenizer_dir", model_dir))
        return cls(tokenizer, parameter(config, "skip_special_tokens", boolean, default=True),
                   max(tokenizer.vocab_size, parameter(config, "vocab_size", integer_parameter, default=0)))

    def __call__(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """TOKENS_BATCH [batch, beams, tokens] and SEQUENCE_LENGTH [batch, beams] -> texts [batch * beams], flat as
        upstream's (its clients read `text_output[0]`)."""
        if tokens.ndim != 3 or lengths.shape != tokens.shape[:2]:
            raise RequestError(f"TOKENS_BATCH [batch, beams, tokens] and SEQUENCE_LENGTH [batch, beams] do not match: "
                               f"{list(tokens.shape)} and {list(lengths.shape)}")
        out = []
        for item, item_lengths in zip(tokens, lengths):
            for beam, n in zip(item, item_lengths):
                if not 0 <= n <= len(beam):
                    raise RequestError(f"SEQUENCE_LENGTH must be in [0, {len(beam)}] (the tokens given), got {n}")
                ids = token_ids(beam[:n], "TOKENS_BATCH", self.vocab_size)
                out.append(self.tokenizer.decode(ids, self.skip_special_tokens).encode("utf-8"))
        return np.array(out, dtype=object)
