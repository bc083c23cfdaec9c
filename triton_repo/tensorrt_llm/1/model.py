"""Triton `tensorrt_llm`: TensorRT-LLM's engine model (the legacy `inflight_batcher_llm` contract: token ids in and
out) over runtime's executor (the native `Executor`, or `TrtllmExecutor` for a --backend trtllm engine:
`create_executor` picks). The executor, sender thread, cancellation, watchdog and metrics are
serving.triton_engine's, shared with the llmapi model; this file reads TensorRT-LLM's tensors and writes its
outputs. Decoupled (streaming) or not (unary ModelInfer), one instance; stop words stay in the output, as
upstream's do.
"""

from __future__ import annotations

import faulthandler
import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime.core.sampling_params import SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.requests import RequestOutput
from serving.request_validation import (GUIDED_INPUTS, NEUTRAL, TENSORRT_LLM_SCALARS, UNSUPPORTED_ENGINE_INPUTS,
                                        RequestError, client_named, guided_decoding, integer, no_unknown_parameters,
                                        refuse_non_neutral, refuse_unsupported, token_ids)
from serving.triton_engine import Chunk, EngineModel, Stream, given
from serving.triton_parameters import (TritonConfig, boolean, integer as integer_parameter, model_path, number,
                                       parameter, settings)


def word_list(request: Any, name: str, vocab_size: int) -> list[list[int]]:
    """TensorRT-LLM's [1, 2, W] word list (ids, end offsets padded with -1) -> words as id lists."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return []
    arr = t.as_numpy()
    if arr.ndim == 3:
        if arr.shape[0] != 1:
            raise RequestError(f"{name}: one request per batch item expected, got batch {arr.shape[0]}")
        arr = arr[0]
    if arr.ndim != 2 or arr.shape[0] != 2:
        raise RequestError(f"{name} must have shape [2, W] (ids, offsets), got {list(t.as_numpy().shape)}")
    ids, offsets = arr[0].tolist(), [o for o in arr[1].tolist() if o >= 0]
    if offsets != sorted(offsets) or (offsets and offsets[-1] > len(ids)):
        raise RequestError(f"{name}: offsets {offsets} are not increasing ends within {len(ids)} ids")
    words = [ids[a:b] for a, b in zip([0] + offsets, offsets) if b > a]
    token_ids((t for word in words for t in word), name, vocab_size)
    return words


class TritonPythonModel(EngineModel):
    streaming_input = client_named("streaming")

    def initialize(self, args: dict) -> None:
        faulthandler.enable()  # a crash of this stub is logged with its Python stacks, not lost
        config = json.loads(args["model_config"])
        executor_config = settings(
            ExecutorConfig, num_draft_tokens=parameter(config, "num_draft_tokens", integer_parameter),
            speculation=parameter(config, "speculation"),
            max_batch_size=parameter(config, "executor_max_batch_size", integer_parameter),
            max_seq_len=parameter(config, "executor_max_seq_len", integer_parameter),
            kv_cache_tokens=parameter(config, "max_tokens_in_paged_kv_cache", integer_parameter),
            free_memory_fraction=parameter(config, "kv_cache_free_gpu_mem_fraction", number),
            enable_block_reuse=parameter(config, "enable_kv_cache_reuse", boolean),  # TensorRT-LLM's legacy name
            device=parameter(config, "device"))
        triton = settings(
            TritonConfig, decoupled=pb_utils.using_decoupled_model_transaction_policy(config),
            torch_threads=parameter(config, "torch_threads", integer_parameter),
            engine_process=parameter(config, "engine_process", boolean),
            cancellation_check_period_ms=parameter(config, "cancellation_check_period_ms", integer_parameter),
            stats_check_period_ms=parameter(config, "stats_check_period_ms", integer_parameter),
            watchdog_timeout_s=parameter(config, "watchdog_timeout_s", number))
        self.exclude_input_default = parameter(config, "exclude_input_in_output", boolean, default=False)
        self.start(model_path(config, "gpt_model_path", args["model_repository"]), executor_config, triton,
                   model_name=args["model_name"], model_version=args["model_version"])

    def convert(self, request: Any, sender: Any) -> tuple[Stream, list[int]] | None:
        no_unknown_parameters(request.parameters(), "tensorrt_llm")
        if self._scalar(request, "stop", False):
            self.stop(request.request_id(), sender)
            return None
        prompt, params, streaming, exclude = self._convert(request)
        outputs = frozenset(name for name in ("num_input_tokens", "num_output_tokens", "log_probs")
                            if self._scalar(request, f"return_{name}", False))
        return Stream(sender, request.request_id(), streaming, [] if exclude else prompt,
                      bool(self._scalar(request, "return_perf_metrics", False)), outputs, params), prompt

    @staticmethod
    def _scalar(request: Any, name: str, default: Any = None) -> Any:
        """One value of a scalar input, checked in its declared type before anything converts it."""
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            return default
        return TENSORRT_LLM_SCALARS[name].read(t.as_numpy(), client_named(name))

    def _convert(self, request: Any) -> tuple[list[int], SamplingParams, bool, bool]:
        """Triton tensors -> (prompt ids, SamplingParams, streaming, exclude_input_in_output)."""
        refuse_unsupported(given(request, UNSUPPORTED_ENGINE_INPUTS), UNSUPPORTED_ENGINE_INPUTS)
        refuse_non_neutral({name: self._scalar(request, name) for name in NEUTRAL})
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if ids is None:
            raise ValueError("input_ids is required")
        ids = ids.as_numpy()
        if ids.ndim == 2 and ids.shape[0] != 1:
            raise RequestError(f"input_ids: one prompt per request expected, got batch {ids.shape[0]} "
                               "(requests are batched in flight; send them separately)")
        ids = ids.reshape(-1)
        length = self._scalar(request, "input_lengths", len(ids))
        if not 0 <= length <= len(ids):
            raise RequestError(f"input_lengths {length} is outside [0, {len(ids)}] (the input_ids given)")
        ids = token_ids(ids[:length], "input_ids", self.vocab_size)
        max_tokens = self._scalar(request, "request_output_len")
        if max_tokens is None:
            raise RequestError("request_output_len (max_tokens) is required")

        stop, stop_ids = [], []
        for word in word_list(request, "stop_words_list", self.vocab_size):
            if len(word) == 1 and word[0] in self.tokenizer.special_ids:
                stop_ids.append(word[0])  # special tokens never show in the text a stop string is matched in
            else:
                stop.append(self.tokenizer.decode(word, skip_special_tokens=False))
        bad_ids = []
        for word in word_list(request, "bad_words_list", self.vocab_size):
            if len(word) != 1:
                raise RequestError(f"bad_words: {self.tokenizer.decode(word, skip_special_tokens=False)!r} is "
                                 f"{len(word)} tokens; only single-token bad words are supported")
            bad_ids.append(word[0])
        seed = self._alias(request, "seed", "random_seed")
        # more than max_tokens means all of them (genai-perf's fixed output length sends min_length = max_tokens)
        min_tokens = min(self._alias(request, "min_tokens", "min_length") or 0, max_tokens)
        temperature, top_k, top_p = self._sampling(request)
        end_id = self._end_id(request)
        ignore_eos = end_id is not None and end_id != self.tokenizer.eos_token_id
        if ignore_eos and end_id >= 0:  # a custom end id replaces eos; -1 means none
            stop_ids.append(end_id)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=tuple(stop),
            stop_token_ids=tuple(stop_ids),
            bad_token_ids=tuple(bad_ids),
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            logprobs=0 if self._scalar(request, "return_log_probs", False) else None,
            repetition_penalty=self._scalar(request, "repetition_penalty", 1.0),
            presence_penalty=self._scalar(request, "presence_penalty", 0.0),
            frequency_penalty=self._scalar(request, "frequency_penalty", 0.0),
            guided_decoding=guided_decoding(given(request, GUIDED_INPUTS)))
        streaming = bool(self._scalar(request, "streaming", False))
        exclude = bool(self._scalar(request, "exclude_input_in_output", self.exclude_input_default))
        return ids, params, streaming, exclude

    def _end_id(self, request: Any) -> int | None:
        """end_id: a token id, or -1 for none (TensorRT-LLM's); any other value, a wrapped INT32 among them, is
        refused rather than read as "no end id"."""
        t = pb_utils.get_input_tensor_by_name(request, "end_id")
        return None if t is None else integer(t.as_numpy(), "end_id", -1, self.vocab_size - 1)

    def _alias(self, request: Any, name: str, old_name: str) -> Any:
        """An input that upstream's older templates name differently (random_seed, min_length)."""
        value, old = self._scalar(request, name), self._scalar(request, old_name)
        if value is not None and old is not None and value != old:
            raise RequestError(f"{name}={value} and {old_name}={old} differ ({old_name} is the older name of "
                               f"{name}); give one of them")
        return old if value is None else value

    def _sampling(self, request: Any) -> tuple[float, int, float]:
        """(temperature, top_k, top_p) as TensorRT-LLM reads its inputs: runtime_top_k 0 or unset with
        runtime_top_p unset or <= 0 decodes greedily whatever the temperature (its top-k kernel then takes
        k = 1); otherwise it samples, at temperature 1.0 when none is given (upstream's default)."""
        temperature = self._scalar(request, "temperature")
        top_k = self._scalar(request, "runtime_top_k", 0)
        top_p = self._scalar(request, "runtime_top_p")
        top_p_set = top_p is not None and top_p > 0  # upstream reads top_p <= 0 as "not set"
        sampling = top_k != 0 or top_p_set
        if temperature is None:
            temperature = 1.0 if sampling else 0.0
        elif not sampling and temperature >= 0:
            temperature = 0.0  # greedy; an invalid temperature still gets its error
        return temperature, top_k, top_p if top_p_set else 1.0

    def response(self, stream: Stream, chunk: Chunk, out: RequestOutput) -> Any:
        """output_ids [1, 1, N] and sequence_length [1, 1], plus what the request asked for: as upstream's, perf
        metrics only with return_perf_metrics, token counts only with return_num_*_tokens and cum_log_probs [1, 1] /
        output_log_probs [1, 1, generated tokens of output_ids] only with return_log_probs, for each tensor costs
        every streamed token its trip through the server, the ensemble and the client."""
        def scalar(name: str, value: Any, dtype: Any) -> Any:
            return pb_utils.Tensor(name, np.array([[value]], dtype))

        ids = chunk.ids
        tensors = [pb_utils.Tensor("output_ids", np.array(ids, np.int32).reshape(1, 1, -1)),
                   pb_utils.Tensor("sequence_length", np.array([[len(ids)]], np.int32))]
        if stream.perf_metrics:
            tensors += self.perf_metric_tensors(stream, out.stats, "legacy", (1, 1))
        if "log_probs" in stream.outputs:  # of the generated tokens in output_ids, under the target model
            chosen = out.logprobs[len(out.logprobs) - len(ids):] if stream.streaming else out.logprobs
            logprobs = [lp.logprob for lp in chosen]
            tensors += [scalar("cum_log_probs", out.cumulative_logprob, np.float32),
                        pb_utils.Tensor("output_log_probs", np.array(logprobs, np.float32).reshape(1, 1, -1))]
        if "num_input_tokens" in stream.outputs:
            tensors.append(scalar("num_input_tokens", out.stats.prompt_tokens, np.int32))
        if "num_output_tokens" in stream.outputs:
            tensors.append(scalar("num_output_tokens", out.stats.output_tokens, np.int32))
        return pb_utils.InferenceResponse(tensors)
