"""The TensorRT-LLM adapter (runtime.executors.trtllm, trtllm_api) and serving/check_trtllm.py, without TensorRT-LLM.

TensorRT-LLM cannot be installed here, so this file has three kinds of tests:
- the pure mappings: our SamplingParams -> tensorrt_llm.SamplingParams keyword arguments (every
  field), ExecutorConfig + the engine's YAML -> LLM(...) keyword arguments;
- the error raised where `tensorrt_llm` cannot be imported (the exact message), and the check
  script's exit status 2 there;
- a CONTRACT TEST against a test double of the `tensorrt_llm` module injected into
  sys.modules["tensorrt_llm"] (`make_tensorrt_llm_double`). The double has the names and
  signatures the adapter relies on, as upstream documents them (SamplingParams field names from
  tensorrt_llm/sampling_params.py, LLM(model, **llm_args), generate_async(inputs, sampling_params,
  ..., streaming), the result's async iteration / finished / outputs[0].token_ids / finish_reason
  / request_perf_metrics.speculative_decoding / abort()) and replays token streams the tests script,
  stopping the way upstream does (end_id, stop_token_ids, max_tokens, abort). These tests check
  that our calls use those names and arguments and that the streamed outputs become our
  RequestOutputs (text deltas, finish reasons, statistics), including output identical to the
  native executor's for the same token stream. A contract test is never a proof that the adapter
  runs with the real TensorRT-LLM: nothing here imports it, uses a GPU or serves a trtllm engine
  through Triton.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import re
import importlib
import json
import logging
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Callable, Sequence

import numpy as np
import pytest
import yaml

from builder.trtllm_engine import TrtllmOptions, build_trtllm_engine
from runtime.io.engine_format import BuildConfig, EngineError, engine_backend
from runtime.executors.backends import create_executor
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.executors.outputs import RequestOutput
from runtime.core.sampling_params import RelaxedAcceptance
from runtime.core.sampling_params import GuidedDecodingParams, SamplingParams
from runtime.core.scheduler import ServingLimits
from runtime.executors.trtllm import TrtllmEngine, TrtllmExecutor
from runtime.executors.trtllm_api import (TensorRTLLMUnavailable, adapt_to_upstream_fields, draft_len_of,
                                          llm_kwargs_for, read_llm_api_options, to_trtllm_sampling_kwargs)
from runtime.io.engine_format import LLM_API_OPTIONS

ROOT = Path(__file__).resolve().parents[1]
EXACT_MISSING_MESSAGE = (
    "TensorRT-LLM is not available: the Python package `tensorrt_llm` could not be imported. "
    "Engines built with --backend trtllm run only where TensorRT-LLM and its CUDA libraries are installed: "
    "run inside NVIDIA's TensorRT-LLM container (nvcr.io/nvidia/tensorrt-llm/release:<version>) or the "
    "Triton TensorRT-LLM container (nvcr.io/nvidia/tritonserver:<xx.yy>-trtllm-python-py3), "
    "or rebuild the engine with --backend native.\n"
    "(import failed with ModuleNotFoundError: import of tensorrt_llm halted; None in sys.modules)"
)

# ---- the test double of `tensorrt_llm` ------------------------------------------------------------
# The init fields of tensorrt_llm.SamplingParams (tensorrt_llm/sampling_params.py, 1.x): a keyword
# the adapter passes that is not one of these fails like upstream's kw_only dataclass would.
UPSTREAM_SAMPLING_FIELDS = (
    "end_id", "pad_id", "max_tokens", "bad", "bad_token_ids", "stop", "stop_token_ids",
    "include_stop_str_in_output", "embedding_bias", "logits_processor", "apply_batched_logits_processor",
    "n", "best_of", "use_beam_search", "top_k", "top_p", "top_p_min", "top_p_reset_ids", "top_p_decay", "seed",
    "temperature", "min_tokens", "beam_search_diversity_rate", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "length_penalty", "early_stopping", "no_repeat_ngram_size", "min_p", "beam_width_array",
    "logprobs", "prompt_logprobs", "return_context_logits", "return_generation_logits", "exclude_input_from_output",
    "return_encoder_output", "return_perf_metrics", "additional_model_outputs", "lookahead_config",
    "guided_decoding", "ignore_eos", "detokenize", "add_special_tokens", "truncate_prompt_tokens",
    "skip_special_tokens", "spaces_between_special_tokens",
)
_SAMPLING_DEFAULTS = {"max_tokens": 32, "include_stop_str_in_output": False, "n": 1, "use_beam_search": False,
                      "return_perf_metrics": False, "ignore_eos": False, "detokenize": True}
# LLM-API arguments (tensorrt_llm/llmapi/llm_args.py: TorchLlmArgs, KvCacheConfig, CudaGraphConfig,
# MTPDecodingConfig and its DecodingBaseConfig) that the engine's YAML and the executor's overrides may use.
UPSTREAM_LLM_ARGS = {
    "backend": None, "dtype": None, "tensor_parallel_size": None, "moe_expert_parallel_size": None,
    "enable_attention_dp": None, "max_batch_size": None, "max_num_tokens": None, "max_seq_len": None,
    "guided_decoding_backend": None,
    "kv_cache_config": {"dtype", "free_gpu_memory_fraction", "enable_block_reuse", "tokens_per_block", "max_tokens"},
    "cuda_graph_config": {"enable_padding", "max_batch_size", "batch_sizes"},
    "speculative_config": {"decoding_type", "max_draft_len", "num_nextn_predict_layers",
                           "use_relaxed_acceptance_for_thinking", "relaxed_topk", "relaxed_delta", "use_mtp_vanilla", "mtp_eagle_one_model",
                           "begin_thinking_phase_token", "end_thinking_phase_token"},
}


def sampling_params_class(names: Sequence[str] = UPSTREAM_SAMPLING_FIELDS) -> type:
    return dataclasses.make_dataclass(
        "SamplingParams", [(n, Any, field(default=_SAMPLING_DEFAULTS.get(n))) for n in names], kw_only=True)


@dataclass
class Plan:
    """What the double's "model" generates for one request: tokens[i] (a list, or a function of
    i for an endless stream), `steps` tokens per iteration (cycled; MTP-like accepted + 1), an
    optional failure at an iteration, and the delay before each response."""

    tokens: Sequence[int] | Callable[[int], int]
    steps: Sequence[int] = (1,)
    delay: float = 0.0
    fail_at: int | None = None
    finish_reason: str | None = None  # replaces upstream's own reason on the final response

    def token(self, i: int) -> int | None:
        if callable(self.tokens):
            return self.tokens(i)
        return self.tokens[i] if i < len(self.tokens) else None


def default_plan(prompt: list[int], sp: Any) -> Plan:
    base = sum(prompt)
    return Plan(lambda i: 100 + (base + 37 * i) % 3000, steps=(1, 2, 4, 3))


def double_logprobs(token: int, position: int, n: int) -> dict[int, SimpleNamespace]:
    """The double's LogprobResults entry at a position: the token (rank 2 at odd positions) and n others."""
    entry = {token + 1 + i: SimpleNamespace(logprob=-0.5 - i - position % 3, rank=i + 1) for i in range(n)}
    entry[token] = SimpleNamespace(logprob=-0.25 - position % 3 - (position % 2) * 0.5, rank=1 + position % 2)
    return entry


def make_tensorrt_llm_double() -> ModuleType:
    """A module standing in for `tensorrt_llm` (see the module docstring)."""
    mod = ModuleType("tensorrt_llm")
    mod.__version__ = "test-double"
    mod.SamplingParams = sampling_params_class()
    # tensorrt_llm/sampling_params.py's GuidedDecodingParams, re-exported by tensorrt_llm.llmapi
    mod.llmapi = ModuleType("tensorrt_llm.llmapi")
    mod.llmapi.GuidedDecodingParams = dataclasses.make_dataclass(
        "GuidedDecodingParams", [("json", Any, field(default=None)), ("regex", Any, field(default=None)),
                                 ("grammar", Any, field(default=None)), ("json_object", bool, field(default=False)),
                                 ("structural_tag", Any, field(default=None))], kw_only=True)
    mod.llms = []  # every LLM constructed
    mod.plan = default_plan  # (prompt ids, SamplingParams) -> Plan
    mod.report_metrics = True  # fill outputs[0].request_perf_metrics when asked for

    class CompletionOutput:  # tensorrt_llm/executor/result.py
        def __init__(self, index: int = 0) -> None:
            self.index, self.text, self.token_ids = index, "", []
            self.finish_reason: str | None = None
            self.stop_reason = None
            self.request_perf_metrics = None
            self.logprobs, self.prompt_logprobs, self.cumulative_logprob = [], [], None

    class RequestOutput:  # tensorrt_llm/llmapi/llm.py (a GenerationResult)
        def __init__(self, llm: "LLM", inputs: dict, sp: Any, streaming: bool) -> None:
            self.llm, self.inputs, self.sampling_params, self.streaming = llm, inputs, sp, streaming
            self.prompt_token_ids = list(inputs["prompt_token_ids"])
            # n outputs, best_of candidates: candidate i streams the plan's tokens + i (see _copy_to_candidates)
            self.outputs = [CompletionOutput(i) for i in range(sp.best_of or sp.n)]
            self.finished = False
            self.decoding_iter = 0
            self.abort_calls = 0
            self._plan = mod.plan(self.prompt_token_ids, sp)
            self._pos = 0
            self._drafted = self._accepted = 0

        def abort(self) -> None:
            self.abort_calls += 1

        def __aiter__(self) -> "RequestOutput":
            return self

        async def __anext__(self) -> "RequestOutput":
            if self.finished:
                raise StopAsyncIteration
            await asyncio.sleep(self._plan.delay)
            out, sp, plan = self.outputs[0], self.sampling_params, self._plan
            if self.abort_calls:
                return self._done("cancelled")
            if plan.fail_at is not None and self.decoding_iter == plan.fail_at:
                raise RuntimeError("test double: the engine failed")
            if sp.prompt_logprobs and not out.prompt_logprobs:
                out.prompt_logprobs = [double_logprobs(t, i, sp.prompt_logprobs)
                                       for i, t in enumerate(self.prompt_token_ids[1:])]
            size = plan.steps[self.decoding_iter % len(plan.steps)]
            self.decoding_iter += 1
            reason = None
            for _ in range(size):
                t = plan.token(self._pos)
                if t is None:
                    reason = "length"
                    break
                self._pos += 1
                if t == sp.end_id:  # end token: finished, not in the output
                    reason = "stop"
                    break
                out.token_ids.append(t)
                if sp.logprobs:  # LogprobResults: the token and the sp.logprobs most likely, as upstream
                    out.logprobs.append(double_logprobs(t, len(out.token_ids), sp.logprobs))
                    out.cumulative_logprob = sum(e[i].logprob for e, i in zip(out.logprobs, out.token_ids))
                if t in (sp.stop_token_ids or []):
                    reason = "stop"
                    if not sp.include_stop_str_in_output:
                        out.token_ids.pop()
                    break
                if len(out.token_ids) >= sp.max_tokens:
                    reason = "length"
                    break
            if sp.return_perf_metrics and mod.report_metrics:
                k = self.llm.draft_len
                self._drafted += k
                self._accepted += min(size - 1, k)
                spec = SimpleNamespace(total_draft_tokens=self._drafted, total_accepted_draft_tokens=self._accepted,
                                       acceptance_rate=self._accepted / self._drafted if self._drafted else 0.0)
                out.request_perf_metrics = SimpleNamespace(speculative_decoding=spec)
            self._copy_to_candidates()
            return self._done(reason) if reason else self

        def _copy_to_candidates(self) -> None:
            """Candidate i's tokens are candidate 0's plus i, its cumulative logprob candidate 0's minus i."""
            first = self.outputs[0]
            for o in self.outputs[1:]:
                o.token_ids = [t + o.index for t in first.token_ids]
                o.cumulative_logprob = None if first.cumulative_logprob is None else first.cumulative_logprob - o.index

        def _done(self, reason: str) -> "RequestOutput":
            for o in self.outputs:
                o.finish_reason = self._plan.finish_reason or reason
            self.finished = True
            if len(self.outputs) > self.sampling_params.n:  # best_of: upstream keeps the n it ranks best
                self.outputs = sorted(self.outputs, key=lambda o: -o.index)[: self.sampling_params.n]
            return self

    class LLM:  # tensorrt_llm/llmapi/llm.py
        def __init__(self, model: str, **kwargs: Any) -> None:
            if not isinstance(model, str) or not (Path(model) / "config.json").is_file():
                raise ValueError(f"test double: model {model!r} is not an HF checkpoint directory")
            for key, value in kwargs.items():
                if key not in UPSTREAM_LLM_ARGS:
                    raise TypeError(f"test double: LLM got an unexpected argument {key!r}")
                sub = UPSTREAM_LLM_ARGS[key]
                if sub is not None and value is not None and not set(value) <= sub:  # None: off (cuda_graph_config)
                    raise TypeError(f"test double: {key} has unexpected keys {sorted(set(value) - sub)}")
            self.model, self.kwargs = model, kwargs
            self.requests: list[RequestOutput] = []
            self.shutdown_calls = 0
            mod.llms.append(self)

        @property
        def draft_len(self) -> int:
            return (self.kwargs.get("speculative_config") or {}).get("num_nextn_predict_layers", 0)

        def generate_async(self, inputs: Any, sampling_params: Any = None, lora_request: Any = None,
                           prompt_adapter_request: Any = None, streaming: bool = False, queries: Any = None,
                           kv_cache_retention_config: Any = None, disaggregated_params: Any = None) -> RequestOutput:
            # upstream's result streams asynchronously only when created on a running event loop
            asyncio.get_running_loop()
            if not isinstance(sampling_params, mod.SamplingParams):
                raise TypeError("test double: sampling_params must be a tensorrt_llm.SamplingParams")
            if not isinstance(inputs, dict) or set(inputs) != {"prompt_token_ids"}:
                raise TypeError(f"test double: unexpected inputs {inputs!r}")
            result = RequestOutput(self, inputs, sampling_params, streaming)
            self.requests.append(result)
            return result

        def shutdown(self) -> None:
            self.shutdown_calls += 1

    mod.LLM = LLM
    return mod


@pytest.fixture
def trtllm(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The test double, as sys.modules["tensorrt_llm"] for this test."""
    mod = make_tensorrt_llm_double()
    monkeypatch.setitem(sys.modules, "tensorrt_llm", mod)
    return mod


@pytest.fixture(scope="module")
def engine_dir(spec_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A --backend trtllm engine of the tiny checkpoint (project tokenizer), max_draft_len 3."""
    build = BuildConfig(max_seq_len=256, max_draft_len=3, max_batch_size=8, max_num_tokens=512, dtype="bfloat16",
                        backend="trtllm")
    return build_trtllm_engine(spec_checkpoint, tmp_path_factory.mktemp("trtllm") / "engine", build, progress=False)


@pytest.fixture(scope="module")
def engine(engine_dir: Path) -> TrtllmEngine:
    return TrtllmEngine.open(engine_dir)


def test_make_model_repo_checks_the_settings_as_the_trtllm_executor_does(engine_dir: Path, tmp_path: Path,
                                                                          capsys) -> None:
    """The legacy tensorrt_llm model serves a --backend trtllm engine through TrtllmExecutor, whose LLM-API
    arguments refuse a queue bound: make_model_repo refuses it too (it wrote the repository, and the server then
    failed to load the model), and takes the engine's settings (no TensorRT-LLM needed for either)."""
    import serving.triton.model_repo as model_repo

    assert model_repo.main(["--engine_dir", str(engine_dir), "--output_dir", str(tmp_path / "repo"),
                            "--set", "max_queue_size:4"]) == 2
    assert capsys.readouterr().err == (
        "make_model_repo: model tensorrt_llm: max_queue_size 4: not available with a --backend trtllm "
        "engine (TensorRT-LLM's LLM API takes no queue bound); leave it unset\n")
    assert model_repo.main(["--engine_dir", str(engine_dir), "--output_dir", str(tmp_path / "repo"),
                            "--set", "num_draft_tokens:2,speculation:fixed"]) == 0
    assert (tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").is_file()


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def every_output(ex: object, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    """Each output as the executor reports it (iteration may merge those it has not collected yet)."""
    seen: list[RequestOutput] = []
    ex.submit(prompt, params, on_output=seen.append).result(60)
    return seen


def check_stream(outs: list[RequestOutput]) -> None:
    """Deltas add up: each output's text/token_ids are the concatenation so far; one final output."""
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    text, ids = "", []
    for o in outs:
        text += o.text_delta
        ids += o.new_token_ids
        assert o.text == text and o.token_ids == ids
        o.text_delta.encode("utf-8")


class Tok:  # the two attributes to_trtllm_sampling_kwargs reads
    def __init__(self, eos: int | None = 1, pad: int | None = 2) -> None:
        self.eos_token_id, self.pad_token_id = eos, pad


COMMON = {"include_stop_str_in_output": True, "detokenize": False, "return_perf_metrics": True}


# ---- mapping of sampling parameters ---------------------------------------------------------------
def test_greedy_maps_to_top_k_1_temperature_0() -> None:
    assert to_trtllm_sampling_kwargs(SamplingParams(), Tok()) == {
        "max_tokens": 64, "end_id": 1, "pad_id": 2, "temperature": 0.0, "top_k": 1, **COMMON}
    # greedy: top_k / top_p / seed have no effect in ours, and are not passed
    assert to_trtllm_sampling_kwargs(SamplingParams(max_tokens=3, top_k=5, top_p=0.5, seed=9), Tok()) == {
        "max_tokens": 3, "end_id": 1, "pad_id": 2, "temperature": 0.0, "top_k": 1, **COMMON}


def test_every_sampling_field_maps() -> None:
    params = SamplingParams(max_tokens=5, temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=2**63 - 3,
                            stop=("END", "\n\n"), stop_token_ids=(5, 6), bad_token_ids=(7, 8), ignore_eos=True)
    assert to_trtllm_sampling_kwargs(params, Tok()) == {
        "max_tokens": 5, "end_id": -1, "pad_id": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
        "seed": 2**63 - 3, "min_p": 0.05, "stop_token_ids": [5, 6], "bad_token_ids": [7, 8], **COMMON}
    # top_k 0 (ours: off) is left to upstream's default (None: all logits); top_p is always given
    kw = to_trtllm_sampling_kwargs(SamplingParams(temperature=1.0, seed=np.int64(5)), Tok())
    assert "top_k" not in kw and kw["top_p"] == 1.0 and kw["seed"] == 5 and type(kw["seed"]) is int and kw["end_id"] == 1
    # so is a top_k past int32 (upstream's type), which is past any vocabulary
    assert "top_k" not in to_trtllm_sampling_kwargs(SamplingParams(temperature=1.0, top_k=2**31), Tok())
    assert to_trtllm_sampling_kwargs(SamplingParams(temperature=1.0, top_k=2**31 - 1), Tok())["top_k"] == 2**31 - 1
    # stop strings stay with the adapter (matched on the text, as natively)
    assert "stop" not in kw and "stop" not in to_trtllm_sampling_kwargs(params, Tok())


def test_end_and_pad_ids_from_the_tokenizer() -> None:
    assert to_trtllm_sampling_kwargs(SamplingParams(), Tok(eos=7, pad=None))["pad_id"] == 7
    kw = to_trtllm_sampling_kwargs(SamplingParams(), Tok(eos=None, pad=None))
    assert (kw["end_id"], kw["pad_id"]) == (-1, -1)
    assert to_trtllm_sampling_kwargs(SamplingParams(ignore_eos=True), Tok(eos=7, pad=3))["end_id"] == -1


def test_sampling_kwargs_are_upstream_field_names() -> None:
    """Contract: every keyword we pass is a tensorrt_llm.SamplingParams field."""
    params = SamplingParams(max_tokens=5, temperature=0.7, top_k=40, top_p=0.9, seed=1, stop=("x",),
                            stop_token_ids=(5,), bad_token_ids=(7,), ignore_eos=True)
    for p in (params, SamplingParams()):
        kw = to_trtllm_sampling_kwargs(p, Tok())
        assert set(kw) <= set(UPSTREAM_SAMPLING_FIELDS)
        assert adapt_to_upstream_fields(kw, sampling_params_class()) == kw


def test_older_sampling_params_are_adapted() -> None:
    old = sampling_params_class([n for n in UPSTREAM_SAMPLING_FIELDS
                                 if n not in ("seed", "detokenize", "return_perf_metrics")] + ["random_seed"])
    kw = to_trtllm_sampling_kwargs(SamplingParams(temperature=0.5, seed=4), Tok())
    assert adapt_to_upstream_fields(kw, old) == {
        "max_tokens": 64, "end_id": 1, "pad_id": 2, "temperature": 0.5, "top_p": 1.0, "random_seed": 4,
        "include_stop_str_in_output": True}
    too_old = sampling_params_class([n for n in UPSTREAM_SAMPLING_FIELDS if n != "stop_token_ids"])
    with pytest.raises(RuntimeError, match="has no field 'stop_token_ids'.*TensorRT-LLM 1.0 or newer"):
        adapt_to_upstream_fields(to_trtllm_sampling_kwargs(SamplingParams(stop_token_ids=(3,)), Tok()), too_old)


def test_logprobs_penalties_and_min_tokens_map() -> None:
    """Logprobs at least 1 (upstream reads 0 as "none"; ours keeps the top-N asked for), logprobs_mode with
    them, penalties and min_tokens under their own names, only when not neutral."""
    params = SamplingParams(max_tokens=8, logprobs=0, prompt_logprobs=3, repetition_penalty=1.2, presence_penalty=-0.5,
                            frequency_penalty=0.25, min_tokens=4)
    kw = to_trtllm_sampling_kwargs(params, Tok())
    assert {k: kw[k] for k in ("logprobs", "prompt_logprobs", "logprobs_mode", "repetition_penalty", "presence_penalty",
                               "frequency_penalty", "min_tokens")} == {
        "logprobs": 1, "prompt_logprobs": 3, "logprobs_mode": "raw_logprobs", "repetition_penalty": 1.2,
        "presence_penalty": -0.5, "frequency_penalty": 0.25, "min_tokens": 4}
    plain = to_trtllm_sampling_kwargs(SamplingParams(), Tok())
    assert not set(plain) & {"logprobs", "prompt_logprobs", "logprobs_mode", "repetition_penalty", "presence_penalty",
                             "frequency_penalty", "min_tokens"}
    # 1.0's SamplingParams has no logprobs_mode: raw (what it returns) is left out, processed is refused
    assert "logprobs_mode" not in adapt_to_upstream_fields(kw, sampling_params_class())
    processed = to_trtllm_sampling_kwargs(SamplingParams(logprobs=2, logprobs_mode="processed_logprobs"), Tok())
    with pytest.raises(ValueError) as e:
        adapt_to_upstream_fields(processed, sampling_params_class())
    assert str(e.value) == ("logprobs_mode 'processed_logprobs' needs a newer TensorRT-LLM: this one's SamplingParams "
                            "has no logprobs_mode")
    newer = sampling_params_class(list(UPSTREAM_SAMPLING_FIELDS) + ["logprobs_mode"])
    assert adapt_to_upstream_fields(processed, newer)["logprobs_mode"] == "processed_logprobs"


def test_n_and_best_of_map() -> None:
    """n and best_of under upstream's names, only when more than one sequence is asked for."""
    kw = to_trtllm_sampling_kwargs(SamplingParams(temperature=1.0, n=2, best_of=3), Tok())
    assert (kw["n"], kw["best_of"]) == (2, 3) and "use_beam_search" not in kw
    assert to_trtllm_sampling_kwargs(SamplingParams(temperature=1.0, n=2), Tok())["n"] == 2
    assert not {"n", "best_of"} & set(to_trtllm_sampling_kwargs(SamplingParams(temperature=1.0), Tok()))


def test_logit_bias_maps_to_embedding_bias() -> None:
    """logit_bias under upstream's name (embedding_bias), as a dict the executor makes a tensor of; none when unset."""
    kw = to_trtllm_sampling_kwargs(SamplingParams(logit_bias={np.int64(5): 2, 9: -100.0}), Tok())
    assert kw["embedding_bias"] == {5: 2.0, 9: -100.0} and all(type(t) is int for t in kw["embedding_bias"])
    assert "embedding_bias" not in to_trtllm_sampling_kwargs(SamplingParams(), Tok())


def test_contract_logit_bias_reaches_upstream_as_a_vocabulary_tensor(engine_dir: Path, trtllm: ModuleType) -> None:
    """What upstream's trtllm-serve passes for OpenAI's logit_bias: a float32 tensor [vocab], zero but at the ids."""
    import torch

    with TrtllmExecutor(engine_dir) as ex:
        prompt = ex.tokenizer.encode("def fib(n):")
        ex.submit(prompt, SamplingParams(max_tokens=4, logit_bias={5: 2.5, 7: -1.0})).result(10)
        [req] = trtllm.llms[0].requests
        bias = req.sampling_params.embedding_bias
        want = torch.zeros(ex.model_config.vocab_size)
        want[5], want[7] = 2.5, -1.0
        assert bias.dtype == torch.float32 and torch.equal(bias, want)


def test_contract_n_outputs_stream_by_index_and_best_of_arrives_ranked(engine_dir: Path, trtllm: ModuleType) -> None:
    with TrtllmExecutor(engine_dir) as ex:
        prompt = ex.tokenizer.encode("def fib(n):")
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True, n=2)
        handle = ex.submit(prompt, params)
        streamed = list(handle)
        outs = handle.results(5)
        [req] = trtllm.llms[0].requests
        assert req.sampling_params == trtllm.SamplingParams(**to_trtllm_sampling_kwargs(params, ex.tokenizer))
        plan = default_plan(prompt, None)
        assert [o.token_ids for o in outs] == [[plan.token(i) + k for i in range(10)] for k in (0, 1)]
        assert [o.index for o in outs] == [0, 1] and {o.index for o in streamed} == {0, 1}
        assert all("".join(o.text_delta for o in streamed if o.index == k) == outs[k].text for k in (0, 1))
        assert outs[1].stats.output_tokens == 10 and outs[1].stats.num_steps == outs[0].stats.num_steps
        # upstream counts drafts per request: the first output carries them, or summed over outputs they doubled
        stats = ex.stats()
        assert stats.draft_tokens > 0 and sum(o.stats.num_draft_tokens for o in outs) == stats.draft_tokens
        assert sum(o.stats.num_accepted_draft_tokens for o in outs) == stats.accepted_draft_tokens
        # best_of 3, n 1: nothing until upstream has chosen; then its best (the double ranks candidate 2 first)
        handle = ex.submit(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True, best_of=3))
        streamed = list(handle)
        assert [(o.index, o.finished) for o in streamed] == [(0, True)]
        assert streamed[0].token_ids == [plan.token(i) + 2 for i in range(10)]
        stats = ex.stats()
        assert (stats.requests_finished, stats.running, stats.queued) == (2, 0, 0)
        with pytest.raises(ValueError, match="n 9 exceeds this executor's max_batch_size"):
            ex.submit(prompt, SamplingParams(temperature=1.0, n=9))
        with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):
            ex.submit(prompt, SamplingParams(n=2))


def test_logprobs_from_upstream() -> None:
    from runtime.core.sampling import TokenLogprob
    from runtime.executors.trtllm_api import logprobs_from_upstream

    lp = lambda v, r: SimpleNamespace(logprob=v, rank=r)  # noqa: E731
    entries = [{5: lp(-1.0, 2), 9: lp(-0.5, 1), 3: lp(-2.0, 3)}, {7: lp(-0.1, 1)}, -0.75]
    assert logprobs_from_upstream(entries, [5, 7, 4], 2) == [
        TokenLogprob(5, -1.0, 2, ((9, -0.5), (5, -1.0))), TokenLogprob(7, -0.1, 1, ((7, -0.1),)),
        TokenLogprob(4, -0.75, None, ())]
    assert logprobs_from_upstream(entries[:1], [5], 0) == [TokenLogprob(5, -1.0, 2, ())]


def test_contract_guided_decoding_passes_through(engine_dir: Path, spec_checkpoint: Path, tmp_path: Path,
                                                 trtllm: ModuleType) -> None:
    """GuidedDecodingParams reach upstream's SamplingParams.guided_decoding under TensorRT-LLM's names, with the
    engine YAML's guided_decoding_backend (build_engine --guided_decoding_backend) passed to LLM(); without one, or
    with an invalid guide, the request is refused before anything is submitted, as the native executor refuses it."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    guides = {"json": GuidedDecodingParams(json=schema), "regex": GuidedDecodingParams(regex="[a-z]+"),
              "grammar": GuidedDecodingParams(grammar='root ::= "yes" | "no"'),
              "json_object": GuidedDecodingParams(json_object=True)}
    with TrtllmExecutor(engine_dir, ExecutorConfig(num_draft_tokens=3, speculation="fixed")) as ex:
        prompt = ex.tokenizer.encode("def fib(n):")
        with pytest.raises(ValueError) as e:
            ex.submit(prompt, SamplingParams(guided_decoding=guides["regex"]))
        assert str(e.value) == ("guided_decoding needs TensorRT-LLM's guided_decoding_backend (xgrammar or llguidance) "
                                "in the engine's extra_llm_api_options.yaml")
    build = BuildConfig(max_seq_len=256, max_draft_len=3, max_batch_size=8, max_num_tokens=512, dtype="bfloat16",
                        backend="trtllm")
    guided_engine = build_trtllm_engine(spec_checkpoint, tmp_path / "guided", build,
                                        TrtllmOptions(guided_decoding_backend="llguidance"), progress=False)
    assert yaml.safe_load((guided_engine / "extra_llm_api_options.yaml").read_text())["guided_decoding_backend"] == \
        "llguidance"
    with TrtllmExecutor(guided_engine, ExecutorConfig(num_draft_tokens=3, speculation="fixed")) as ex:
        assert trtllm.llms[-1].kwargs["guided_decoding_backend"] == "llguidance"
        with pytest.raises(ValueError, match=r"^guided_decoding.regex is invalid at position 0: unclosed group$"):
            ex.submit(prompt, SamplingParams(guided_decoding=GuidedDecodingParams(regex="(a")))
        assert trtllm.llms[-1].requests == []
        for guide in guides.values():
            ex.submit(prompt, SamplingParams(max_tokens=4, guided_decoding=guide)).result(60)
        ex.submit(prompt, SamplingParams(max_tokens=4)).result(60)
    sent = [r.sampling_params.guided_decoding for r in trtllm.llms[-1].requests]
    G = trtllm.llmapi.GuidedDecodingParams
    assert sent == [G(json=json.dumps(schema)), G(regex="[a-z]+"), G(grammar='root ::= "yes" | "no"'),
                    G(json_object=True), None]


def test_contract_triton_draft_caps_reach_tensorrt_llms_refusal(engine_dir: Path, trtllm: ModuleType) -> None:
    """A Triton request's draft cap (the legacy models' num_draft_tokens, the llmapi model's
    sampling_param_num_draft_tokens) is read as every other and handed to the executor, so a TensorRT-LLM-backed
    deployment answers it with TensorRT-LLM's refusal, under the client's name; the engine publishes no draft length
    for the BLS, which leaves this check to it rather than refusing by the native executor's rule."""
    from serving.request_validation import named_for_client
    from serving.triton import legacy_request, llmapi_request
    from serving.triton.engine_limits import EngineLimits

    with TrtllmExecutor(engine_dir, ExecutorConfig(num_draft_tokens=3, speculation="fixed")) as ex:
        assert ex.request_draft_len is None
        prompt = ex.tokenizer.encode("def fib(n):")
        llmapi = llmapi_request.llmapi_request({"text_input": np.array([b"def fib(n):"], object),
                                                "sampling_param_num_draft_tokens": np.array([1], np.int32)}, 1000)
        legacy = legacy_request.engine_request({"input_ids": np.array([prompt], np.int32),
                                                "request_output_len": np.array([[4]], np.int32),
                                                "num_draft_tokens": np.array([[1]], np.int32)},
                                               ex.tokenizer, ex.model_config.vocab_size, False)
        limits = EngineLimits(ex.model_config.vocab_size, ex.limits.max_seq_len, ex.limits.max_batch_size,
                              ex.kv_block_size, 0, ex.request_draft_len)
        legacy_request.check_engine_request(legacy, ex.tokenizer, limits)  # the BLS passes it on
        for request, names, name in ((llmapi, llmapi_request.INPUT_NAMES, "sampling_param_num_draft_tokens"),
                                     (legacy, legacy_request.INPUT_NAMES, "num_draft_tokens")):
            assert request.params.num_draft_tokens == 1
            with pytest.raises(ValueError) as e:
                ex.submit(prompt, request.params)
            assert named_for_client(str(e.value), names) == (
                f"{name} 1 per request is not available with TensorRT-LLM, whose MTP drafts 3 for every request; "
                "leave it unset")
    assert trtllm.llms[-1].requests == []


def test_contract_logprobs_stream_through(engine_dir: Path, trtllm: ModuleType) -> None:
    """Upstream's per-token LogprobResults and prompt logprobs become ours: one per kept token (none for a stop
    token), the top-N asked for, deltas per output, the cumulative logprob of the kept tokens. What this
    TensorRT-LLM cannot do is refused at submit: processed logprobs, a per-request draft length."""
    with TrtllmExecutor(engine_dir, ExecutorConfig(num_draft_tokens=3, speculation="fixed")) as ex:
        prompt = ex.tokenizer.encode("def fib(n):")
        plan = default_plan(prompt, None)
        stop = plan.token(9)
        params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2, prompt_logprobs=0, stop_token_ids=(stop,))
        seen: list[RequestOutput] = []
        ex.submit(prompt, params, on_output=seen.append).result(60)
        with pytest.raises(ValueError, match="^logprobs_mode 'processed_logprobs' needs a newer TensorRT-LLM"):
            ex.submit(prompt, SamplingParams(logprobs=1, logprobs_mode="processed_logprobs"))
        with pytest.raises(ValueError) as e:
            ex.submit(prompt, SamplingParams(num_draft_tokens=1))
        assert str(e.value) == ("num_draft_tokens 1 per request is not available with TensorRT-LLM, whose MTP drafts 3 "
                                "for every request; leave it unset")
        ex.submit(prompt, SamplingParams(max_tokens=2, num_draft_tokens=3)).result(60)
    final = seen[-1]
    assert final.finish_reason == "stop" and final.token_ids == [plan.token(i) for i in range(9)]
    assert [x for o in seen for x in o.new_logprobs] == final.logprobs
    assert [len(o.new_logprobs) for o in seen] == [len(o.new_token_ids) for o in seen]
    for i, (t, x) in enumerate(zip(final.token_ids, final.logprobs), 1):
        want = double_logprobs(t, i, 2)
        assert (x.token_id, x.logprob, x.rank) == (t, want[t].logprob, want[t].rank)
        assert [v for _, v in x.top] == sorted((e.logprob for e in want.values()), reverse=True)[:2]
    assert final.cumulative_logprob == pytest.approx(sum(x.logprob for x in final.logprobs))
    assert final.prompt_logprobs[0] is None and len(final.prompt_logprobs) == len(prompt)
    assert [x.token_id for x in final.prompt_logprobs[1:]] == prompt[1:]
    assert all(x.top == () for x in final.prompt_logprobs[1:])


# ---- the LLM arguments ------------------------------------------------------------------------------
def test_llm_kwargs_as_built_and_with_executor_config(engine: TrtllmEngine, caplog) -> None:
    opts = yaml.safe_load((engine.path / LLM_API_OPTIONS).read_text())
    m = engine.manifest
    assert opts == engine.options
    # both names at one value (with_draft_len): 1.0 / 1.1 read num_nextn_predict_layers, 2026's main max_draft_len
    assert opts["speculative_config"] == {"decoding_type": "MTP", "max_draft_len": 3, "num_nextn_predict_layers": 3}
    assert llm_kwargs_for(engine.options, m) == opts
    assert "speculative_config" not in llm_kwargs_for(opts, m, ExecutorConfig(num_draft_tokens=0))
    with pytest.raises(ValueError, match=r"^max_queued_requests 4: not available with a --backend trtllm engine "):
        llm_kwargs_for(opts, m, ExecutorConfig(max_queued_requests=4))
    assert "speculative_config" not in llm_kwargs_for(opts, m, ExecutorConfig(num_draft_tokens=3, speculation="off"))
    two = llm_kwargs_for(opts, m, ExecutorConfig(num_draft_tokens=2, speculation="fixed"))
    assert two == {**opts, "speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 2,
                                                  "max_draft_len": 2}}
    with caplog.at_level(logging.WARNING, "runtime.executors.trtllm_api"):
        assert llm_kwargs_for(opts, m, ExecutorConfig(num_draft_tokens=2, speculation="adaptive")) == two
    assert "'adaptive' is not available with TensorRT-LLM" in caplog.text
    limited = llm_kwargs_for(opts, m, ExecutorConfig(num_draft_tokens=1, speculation="fixed", max_batch_size=4,
                                                     max_num_tokens=256, max_seq_len=128, kv_cache_tokens=4096,
                                                     dtype="float16", relaxed_acceptance=RelaxedAcceptance(10, 0.6, 3, 4),
                                                     enable_block_reuse=False),
                             overrides={"kv_cache_config": {"free_gpu_memory_fraction": 0.5}, "enable_attention_dp": True})
    assert limited == {
        **opts, "max_batch_size": 4, "max_num_tokens": 256, "max_seq_len": 128, "dtype": "float16",
        "enable_attention_dp": True, "cuda_graph_config": {"enable_padding": True, "max_batch_size": 4},
        "kv_cache_config": {**opts["kv_cache_config"], "max_tokens": 4096, "free_gpu_memory_fraction": 0.5,
                            "enable_block_reuse": False},
        "speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 1, "max_draft_len": 1,
                               "use_relaxed_acceptance_for_thinking": True, "relaxed_topk": 10, "relaxed_delta": 0.6,
                               "begin_thinking_phase_token": 3, "end_thinking_phase_token": 4}}
    assert opts == yaml.safe_load((engine.path / LLM_API_OPTIONS).read_text())  # not modified in place
    # enable_block_reuse True (the default) keeps the engine's own setting, as built
    assert llm_kwargs_for({**opts, "kv_cache_config": {"enable_block_reuse": False}}, m, ExecutorConfig()) == {
        **opts, "kv_cache_config": {"enable_block_reuse": False},
        "speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 3, "max_draft_len": 3}}


def test_the_draft_length_under_either_name(engine: TrtllmEngine, engine_dir: Path, tmp_path: Path) -> None:
    """build_engine writes both names of the draft length at one value: num_nextn_predict_layers (every release reads
    it) and max_draft_len (upstream's 2026 name). The adapter reads either and writes both at one value; so does
    make_model_repo's llmapi model.yaml (max_draft_len alone would draft one token on 1.0 / 1.1), which
    read_model_yaml takes without a deprecation warning."""
    from serving.triton.llmapi_config import model_yaml, read_model_yaml

    m = engine.manifest
    two = {"decoding_type": "MTP", "max_draft_len": 2, "num_nextn_predict_layers": 2}
    renamed = {**engine.options, "speculative_config": {"decoding_type": "MTP", "max_draft_len": 2}}
    # served as built (no ExecutorConfig), max_draft_len alone reached LLM() as is: one draft on 1.0 / 1.1
    assert llm_kwargs_for(renamed, m)["speculative_config"] == two == llm_kwargs_for(
        engine.options, m, ExecutorConfig(num_draft_tokens=2, speculation="fixed"))["speculative_config"]
    both = llm_kwargs_for(renamed, m, ExecutorConfig(num_draft_tokens=1, speculation="fixed"))
    assert both["speculative_config"] == {"decoding_type": "MTP", "max_draft_len": 1, "num_nextn_predict_layers": 1}
    # an override naming the draft length either way replaces both names (it was refused, naming the engine's file,
    # as differing from the other name), and its bad value is refused naming llm_overrides
    for config in (None, ExecutorConfig(num_draft_tokens=3, speculation="fixed")):
        for name in ("max_draft_len", "num_nextn_predict_layers"):
            assert llm_kwargs_for(engine.options, m, config, {"speculative_config": {name: 2}}
                                  )["speculative_config"] == two
    for spec, error in [({"max_draft_len": -1}, "speculative_config.max_draft_len must be an integer >= 0, got -1"),
                        ({"max_draft_len": 1, "num_nextn_predict_layers": 2}, "speculative_config: max_draft_len 1 "
                         "and num_nextn_predict_layers 2 differ (num_nextn_predict_layers is the older name of "
                         "max_draft_len); give one"),
                        (["MTP"], "speculative_config must be a mapping, got list")]:
        with pytest.raises(ValueError) as e:
            llm_kwargs_for(engine.options, m, None, {"speculative_config": spec})
        assert str(e.value) == f"llm_overrides: {error}"
    doc = model_yaml(engine_dir, "engine", decoupled=True)
    assert doc["speculative_config"] == {"decoding_type": "MTP", "num_nextn_predict_layers": 3, "max_draft_len": 3}
    (tmp_path / "engine").symlink_to(engine_dir)
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(doc))
    llm = read_model_yaml(tmp_path / "model.yaml", tmp_path)
    assert llm.executor.num_draft_tokens == 3 and not [w for w in llm.warnings if "deprecated" in w], llm.warnings


def test_an_engine_with_max_draft_len_alone_gets_both_names_in_its_model_yaml(engine_dir: Path, tmp_path: Path) -> None:
    """An engine whose options name the draft length max_draft_len alone (edited to 2026's name): the llmapi
    model.yaml carries num_nextn_predict_layers too, which 1.0 / 1.1 read (it was copied as is: one draft there)."""
    from serving.triton.llmapi_config import model_yaml

    engine = tmp_path / "engine"
    shutil.copytree(engine_dir, engine, symlinks=True)
    options = yaml.safe_load((engine / LLM_API_OPTIONS).read_text())
    options["speculative_config"] = {"decoding_type": "MTP", "max_draft_len": 2}
    (engine / LLM_API_OPTIONS).write_text(yaml.safe_dump(options))
    doc = model_yaml(engine, "engine", decoupled=True)
    assert doc["speculative_config"] == {"decoding_type": "MTP", "max_draft_len": 2, "num_nextn_predict_layers": 2}


@pytest.mark.parametrize("spec, expected", [
    (None, 0),
    ({"decoding_type": "MTP"}, 1),  # upstream's default num_nextn_predict_layers
    ({"decoding_type": "MTP", "num_nextn_predict_layers": 3}, 3),
    ({"decoding_type": "MTP", "max_draft_len": 0, "num_nextn_predict_layers": None}, 0),
    ({"decoding_type": "MTP", "max_draft_len": 2, "num_nextn_predict_layers": 3},
     "opts.yaml: speculative_config: max_draft_len 2 and num_nextn_predict_layers 3 differ (num_nextn_predict_layers "
     "is the older name of max_draft_len); give one"),
    ({"decoding_type": "MTP", "num_nextn_predict_layers": "3"},
     "opts.yaml: speculative_config.num_nextn_predict_layers must be an integer >= 0, got '3'"),
    ({"decoding_type": "MTP", "max_draft_len": -1}, "opts.yaml: speculative_config.max_draft_len must be an integer "
     ">= 0, got -1"),
])
def test_draft_len_of(spec: dict | None, expected: int | str) -> None:
    if isinstance(expected, int):
        assert draft_len_of(spec, "opts.yaml") == expected
    else:
        with pytest.raises(ValueError) as e:
            draft_len_of(spec, "opts.yaml")
        assert str(e.value) == expected


def test_the_llmapi_model_yaml_is_what_tensorrt_llm_runs(engine_dir: Path, tmp_path: Path, trtllm: ModuleType) -> None:
    """Upstream's llmapi model passes model.yaml's LLM-API keys to LLM(): edited, they reach TensorRT-LLM (relaxed
    acceptance turned on or off, the memory fraction, CUDA graphs, block reuse), none of them called 'not applied'.
    They were dropped for the engine's own options without a word."""
    from serving.triton.llmapi_config import model_yaml, read_model_yaml

    doc = model_yaml(engine_dir, "engine", decoupled=True)
    assert doc["cuda_graph_config"] and doc["kv_cache_config"]["free_gpu_memory_fraction"] == 0.9
    doc["speculative_config"] |= {"use_relaxed_acceptance_for_thinking": True, "relaxed_topk": 5, "relaxed_delta": 0.5,
                                  "begin_thinking_phase_token": 7, "end_thinking_phase_token": 8}
    doc["kv_cache_config"] |= {"free_gpu_memory_fraction": 0.5, "enable_block_reuse": False}
    doc["cuda_graph_config"] = None
    doc["enable_attention_dp"] = True
    (tmp_path / "engine").symlink_to(engine_dir)
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(doc))
    llm = read_model_yaml(tmp_path / "model.yaml", tmp_path)
    assert not llm.warnings
    with TrtllmExecutor(engine_dir, llm.executor) as ex:
        kwargs = ex.llm_kwargs
    assert kwargs["speculative_config"] == {
        "decoding_type": "MTP", "num_nextn_predict_layers": 3, "max_draft_len": 3,
        "use_relaxed_acceptance_for_thinking": True, "relaxed_topk": 5, "relaxed_delta": 0.5,
        "begin_thinking_phase_token": 7, "end_thinking_phase_token": 8}
    assert kwargs["kv_cache_config"]["free_gpu_memory_fraction"] == 0.5
    assert kwargs["kv_cache_config"]["enable_block_reuse"] is False
    assert kwargs["cuda_graph_config"] is None and kwargs["enable_attention_dp"] is True
    assert "model" not in kwargs and "backend" not in kwargs  # LLM() is given them apart
    # upstream's default thinking span (R1's ids) is refused on a model without those tokens, as the native executor does
    del doc["speculative_config"]["begin_thinking_phase_token"]
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match="relaxed acceptance begin_thinking_token 128798 is not a token of this model"):
        TrtllmExecutor(engine_dir, read_model_yaml(tmp_path / "model.yaml", tmp_path).executor)
    # model.yaml's options pass the checks the engine's own do
    for key, value, message in (("trust_remote_code", True, "trust_remote_code must be false or absent"),
                                ("load_format", "dummy", "load_format 'dummy': only auto")):
        (tmp_path / "model.yaml").write_text(yaml.safe_dump({**model_yaml(engine_dir, "engine", decoupled=True),
                                                             key: value}))
        with pytest.raises(ValueError, match=re.escape(message)):
            TrtllmExecutor(engine_dir, read_model_yaml(tmp_path / "model.yaml", tmp_path).executor)
    # and without the relaxed keys, relaxed acceptance is off (the engine's own options do not come back)
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model_yaml(engine_dir, "engine", decoupled=True)))
    with TrtllmExecutor(engine_dir, read_model_yaml(tmp_path / "model.yaml", tmp_path).executor) as ex:
        assert "use_relaxed_acceptance_for_thinking" not in ex.llm_kwargs["speculative_config"]


def test_a_native_engine_refuses_llm_api_options(spec_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=re.escape(f"llm_api_options: {spec_checkpoint} is a native engine (LLM-API "
                                                   "options run a --backend trtllm engine on TensorRT-LLM)")):
        Executor(spec_checkpoint, ExecutorConfig(llm_api_options={"max_batch_size": 2}))


@pytest.mark.parametrize("config, message", [
    (ExecutorConfig(num_draft_tokens=4, speculation="fixed"),
     "num_draft_tokens 4 exceeds the engine's max_draft_len 3 (extra_llm_api_options.yaml)"),
    (ExecutorConfig(max_seq_len=512), "max_seq_len 512 exceeds the engine's max_seq_len 256 "
                                      "(extra_llm_api_options.yaml); rebuild the engine with --max_seq_len 512"),
])
def test_llm_kwargs_refuse_more_than_built(engine: TrtllmEngine, config: ExecutorConfig, message: str) -> None:
    with pytest.raises(ValueError) as e:
        llm_kwargs_for(engine.options, engine.manifest, config)
    assert str(e.value) == message


def test_an_engine_cannot_ask_to_run_remote_code(engine_dir: Path, tmp_path: Path) -> None:
    """trust_remote_code in an engine's LLM-API options would have TensorRT-LLM run Python from the engine's hf/
    directory (an auto_map in its config.json): refused when the engine is opened and when make_model_repo copies
    the options into an llmapi model.yaml (which upstream's llmapi model hands to LLM() as they are)."""
    from serving.triton.llmapi_config import model_yaml

    engine = tmp_path / "engine"
    shutil.copytree(engine_dir, engine)
    options = engine / LLM_API_OPTIONS
    options.write_text(options.read_text() + "trust_remote_code: true\n")
    message = (f"{options}: trust_remote_code must be false or absent: DeepSeek-V3 needs no code from its checkpoint, "
               "and an engine directory must not run any")
    for read in (read_llm_api_options, lambda e: model_yaml(e, "engine", decoupled=True)):
        with pytest.raises(EngineError) as e:
            read(engine)
        assert str(e.value) == message
    options.write_text(options.read_text().replace("trust_remote_code: true", "trust_remote_code: false"))
    assert read_llm_api_options(engine)["trust_remote_code"] is False


def test_an_engines_option_sections_must_be_mappings(engine_dir: Path, tmp_path: Path) -> None:
    """kv_cache_config: 5 (or a list for speculative_config) was an AttributeError deep in make_model_repo; a section
    given twice is refused naming its key."""
    engine = tmp_path / "engine"
    shutil.copytree(engine_dir, engine)
    options = engine / LLM_API_OPTIONS
    doc = yaml.safe_load(options.read_text())
    for section, value in (("kv_cache_config", 5), ("speculative_config", [1])):
        options.write_text(yaml.safe_dump({**doc, section: value}))
        with pytest.raises(EngineError) as e:
            read_llm_api_options(engine)
        assert str(e.value) == f"{options}: {section} must be a mapping, got {type(value).__name__}"

    # a key given twice was taken with its last value, without a word
    options.write_text(yaml.safe_dump(doc) + "kv_cache_config:\n  enable_block_reuse: false\n")
    with pytest.raises(EngineError) as e:
        read_llm_api_options(engine)
    assert str(e.value).startswith(f"{options}: cannot read it: while constructing a mapping") and \
        "found duplicate key 'kv_cache_config'" in str(e.value), str(e.value)



def test_dsv3_serve_on_a_trtllm_engine_without_tensorrt_llm_is_one_line(engine_dir: Path, capsys) -> None:
    """Where TensorRT-LLM is not installed, dsv3-serve on a --backend trtllm engine says where it runs (a 25-line
    traceback before), as its other start-up refusals do."""
    import importlib.util

    pytest.importorskip("fastapi")
    from serving.openai_server.cli import main

    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("TensorRT-LLM is installed here")
    assert main([str(engine_dir), "--port", "18977", "--no-engine_process"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv3-serve: TensorRT-LLM is not available") and "--backend native" in err, err
    assert "Traceback" not in err and len(err.splitlines()) == 2, err  # the message and the import's own error

def test_engine_directory_checks(engine_dir: Path, spec_checkpoint: Path, tmp_path: Path) -> None:
    assert engine_backend(engine_dir) == "trtllm" and engine_backend(spec_checkpoint) is None
    assert TrtllmEngine.open(engine_dir).model_dir == engine_dir / "hf"
    with pytest.raises(EngineError, match="no engine.json; expected an engine directory built with build_engine "
                                          "--backend trtllm"):
        TrtllmEngine.open(spec_checkpoint)
    edited = tmp_path / "edited"
    shutil.copytree(engine_dir, edited)
    (edited / LLM_API_OPTIONS).write_text((edited / LLM_API_OPTIONS).read_text().replace("max_batch_size: 8",
                                                                                          "max_batch_size: 64"))
    with pytest.raises(EngineError, match="extra_llm_api_options.yaml: content hash mismatch"):
        TrtllmEngine.open(edited)
    flipped = tmp_path / "flipped"  # a weight's last byte changed: hashed only when asked (a release is hundreds of GB)
    shutil.copytree(engine_dir, flipped)
    weight = flipped / next(iter(TrtllmEngine.open(engine_dir).manifest.weights))
    data = bytearray(weight.read_bytes())
    data[-1] ^= 1
    weight.write_bytes(bytes(data))
    assert TrtllmEngine.open(flipped).model_dir == flipped / "hf"
    with pytest.raises(EngineError, match=re.escape(f"{weight}: content hash mismatch (sha256 ")):
        TrtllmEngine.open(flipped, verify_weights=True)
    weight.unlink()
    with pytest.raises(EngineError, match=re.escape(f"{weight}: weight file missing")):
        TrtllmEngine.open(flipped)


# ---- without TensorRT-LLM -----------------------------------------------------------------------------
def test_missing_package_error_is_exact(engine_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # `import tensorrt_llm` fails, as on this machine
    with pytest.raises(TensorRTLLMUnavailable) as e:
        TrtllmExecutor(engine_dir)
    assert isinstance(e.value, ImportError)
    assert str(e.value) == EXACT_MISSING_MESSAGE


def test_tensorrt_llm_is_imported_only_inside_a_function() -> None:
    inner = []
    for module in ("trtllm.py", "trtllm_api.py"):
        tree = ast.parse((ROOT / "runtime" / "executors" / module).read_text())
        top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top_level for a in n.names} | {n.module for n in top_level
                                                                if isinstance(n, ast.ImportFrom)}
        assert not any(str(x).startswith("tensorrt_llm") for x in names)
        inner += [(f.name, a.name) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                  for n in ast.walk(f) if isinstance(n, ast.Import) for a in n.names if a.name.startswith("tensorrt_llm")]
    assert inner == [("import_tensorrt_llm", "tensorrt_llm")]


def test_check_script_exits_2_without_tensorrt_llm(engine_dir: Path, monkeypatch, capsys) -> None:
    check = _import_check()
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    assert check.main(["--engine_dir", str(engine_dir), "--skip_triton"]) == 2
    assert capsys.readouterr().err == f"check_trtllm: {EXACT_MISSING_MESSAGE}\n"


def _import_check() -> ModuleType:
    return importlib.import_module("serving.check_trtllm")


# ---- contract test with the test double --------------------------------------------------------------
def test_contract_llm_built_from_the_yaml(engine_dir: Path, trtllm: ModuleType) -> None:
    with TrtllmExecutor(engine_dir) as ex:
        [llm] = trtllm.llms
        assert llm.model == str(engine_dir / "hf")
        options = yaml.safe_load((engine_dir / LLM_API_OPTIONS).read_text())
        assert llm.kwargs == {"backend": "pytorch", **options, "speculative_config": {
            **options["speculative_config"], "max_draft_len": 3}}  # under both names
        assert ex.num_draft_tokens == 3
        assert ex.limits == ServingLimits(max_batch_size=8, max_num_tokens=512, max_seq_len=256)
        assert ex.tokenizer.eos_token_id == 1
    assert llm.shutdown_calls == 1
    with TrtllmExecutor(engine_dir, ExecutorConfig(num_draft_tokens=0, speculation="off")):
        assert "speculative_config" not in trtllm.llms[1].kwargs


def test_contract_stream_becomes_request_outputs(engine_dir: Path, trtllm: ModuleType) -> None:
    with TrtllmExecutor(engine_dir, ExecutorConfig(num_draft_tokens=3, speculation="fixed")) as ex:
        prompt = ex.tokenizer.encode("def fib(n):")
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        seen: list[RequestOutput] = []
        outs = list(ex.submit(prompt, params, on_output=seen.append))
        stats = ex.stats()
        [req] = trtllm.llms[0].requests
        assert req.inputs == {"prompt_token_ids": prompt} and req.streaming is True
        assert req.sampling_params == trtllm.SamplingParams(**to_trtllm_sampling_kwargs(params, ex.tokenizer))
        check_stream(outs)  # iteration may get several steps' outputs merged into one
        check_stream(seen)
        final = seen[-1]
        assert (outs[-1].token_ids, outs[-1].text, outs[-1].stats) == (final.token_ids, final.text, final.stats)
        plan = default_plan(prompt, None)
        assert final.token_ids == [plan.token(i) for i in range(20)] and final.finish_reason == "length"
        assert final.text == ex.tokenizer.decode(final.token_ids)
        # steps of 1, 2, 4, 3 tokens: 8 upstream responses, one RequestOutput each
        assert [len(o.new_token_ids) for o in seen] == [1, 2, 4, 3, 1, 2, 4, 3]
        s = final.stats
        assert (s.prompt_tokens, s.output_tokens, s.num_steps) == (len(prompt), 20, 8)
        assert (s.num_draft_tokens, s.num_accepted_draft_tokens) == (24, 12)  # what the double reported
        assert s.acceptance_rate == 0.5 and s.ttft_s > 0 and s.tpot_s > 0
        assert ex.reports_draft_stats is True
        assert (stats.requests_finished, stats.generated_tokens, stats.draft_tokens, stats.accepted_draft_tokens,
                stats.current_draft_len, stats.running, stats.queued) == (1, 20, 24, 12, 3, 0, 0)
        assert stats.acceptance_rate == stats.acceptance_estimate == 0.5


def test_contract_without_perf_metrics_reports_zero(engine_dir: Path, trtllm: ModuleType, caplog) -> None:
    trtllm.report_metrics = False
    with TrtllmExecutor(engine_dir) as ex, caplog.at_level(logging.WARNING, "runtime.executors.trtllm"):
        out = ex.submit([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True)).result(5)
        assert (out.stats.num_draft_tokens, out.stats.num_accepted_draft_tokens) == (0, 0)
        assert ex.reports_draft_stats is False and ex.stats().draft_tokens == 0
    assert "reported no speculative-decoding metrics" in caplog.text


def test_contract_sampling_request_gets_a_seed(engine_dir: Path, trtllm: ModuleType) -> None:
    with TrtllmExecutor(engine_dir) as ex:
        ex.submit([5, 6], SamplingParams(max_tokens=2, temperature=0.8, top_k=20)).result(5)
        ex.submit([5, 6], SamplingParams(max_tokens=2, temperature=0.8, seed=11)).result(5)
    a, b = (r.sampling_params for r in trtllm.llms[0].requests)
    assert isinstance(a.seed, int) and 0 <= a.seed < 2**48 and (a.temperature, a.top_k, a.top_p) == (0.8, 20, 1.0)
    assert b.seed == 11


def test_contract_cancel_aborts_upstream(engine_dir: Path, trtllm: ModuleType) -> None:
    """Each request's second token waits until the test has cancelled it: a test thread woken late would
    otherwise take several outputs merged as its first, or see the request run to max_tokens."""
    gates: list[threading.Event] = []

    def plan(prompt: list[int], sp: Any) -> Plan:
        gate = threading.Event()
        gates.append(gate)
        return Plan(lambda i: gate.wait(30) and 100 + i % 50 if i == 1 else 100 + i % 50, delay=0.005)

    trtllm.plan = plan
    with TrtllmExecutor(engine_dir) as ex:
        h = ex.submit([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        first = next(iter(h))
        assert not first.finished and first.new_token_ids == [100]
        h.cancel()
        gates[0].set()
        final = h.result(5)
        assert final.finished and final.finish_reason == "cancelled"
        [req] = trtllm.llms[0].requests
        wait_until(lambda: req.abort_calls == 1)
        ex.cancel("no-such-request")  # ignored
        wait_until(lambda: ex.stats().running == 0)
        assert ex.stats().requests_finished == 1
        # cancelled before it reached TensorRT-LLM: never submitted there (the loop is held meanwhile, so
        # that it cannot start the request between the two calls)
        submitted = threading.Event()
        ex._loop.call_soon_threadsafe(submitted.wait, 30)
        h2 = ex.submit([5, 6, 7], SamplingParams(max_tokens=5), request_id="early")
        ex.cancel("early")
        submitted.set()
        out = h2.result(5)
        assert (out.finish_reason, out.token_ids, out.text) == ("cancelled", [], "")
        assert len(trtllm.llms[0].requests) == 1
        # a finished request's handle does not cancel a later request that reuses its id
        h3 = ex.submit([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), request_id="early")
        h2.cancel()
        assert next(iter(h3)).new_token_ids == [100]
        h3.cancel()
        gates[-1].set()
        assert h3.result(5).finish_reason == "cancelled"
        wait_until(lambda: trtllm.llms[0].requests[-1].abort_calls == 1)


def test_contract_stop_string_finishes_and_aborts(engine_dir: Path, trtllm: ModuleType) -> None:
    with TrtllmExecutor(engine_dir) as ex:
        prompt = [5, 6, 7]
        plan = default_plan(prompt, None)
        full = ex.tokenizer.decode([plan.token(i) for i in range(40)])
        stop = full[len(full) // 2: len(full) // 2 + 3]
        out = ex.submit(prompt, SamplingParams(max_tokens=40, stop=(stop,))).result(5)
        assert out.finish_reason == "stop" and out.text == full[: full.index(stop)]
        [req] = trtllm.llms[0].requests
        wait_until(lambda: req.abort_calls == 1)  # the loop aborts it just after delivering the final output
        assert not req.finished  # upstream did not know the stop string


def test_contract_finish_reasons_from_upstream(engine_dir: Path, trtllm: ModuleType) -> None:
    tokens = [100, 101, 102, 1, 103, 104]  # 1 is eos
    trtllm.plan = lambda prompt, sp: Plan(tokens)
    with TrtllmExecutor(engine_dir) as ex:
        out = ex.submit([5], SamplingParams(max_tokens=10)).result(5)
        assert (out.token_ids, out.finish_reason) == ([100, 101, 102], "stop")  # upstream stopped at end_id
        out = ex.submit([5], SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(103,))).result(5)
        assert (out.token_ids, out.finish_reason) == ([100, 101, 102, 1], "stop")  # stop id not in the output
        trtllm.plan = lambda prompt, sp: Plan(tokens, finish_reason="cancelled")
        out = ex.submit([5], SamplingParams(max_tokens=10, ignore_eos=True)).result(5)
        assert (out.token_ids, out.finish_reason) == (tokens, "cancelled")  # ended by upstream, not by us
        trtllm.plan = lambda prompt, sp: Plan(tokens, fail_at=2)
        out = ex.submit([5], SamplingParams(max_tokens=10, ignore_eos=True)).result(5)
        assert (out.token_ids, out.finish_reason) == ([100, 101], "error")
        trtllm.plan = lambda prompt, sp: Plan(tokens, finish_reason="timeout")
        out = ex.submit([5], SamplingParams(max_tokens=10, ignore_eos=True)).result(5)
        assert out.finish_reason == "error"
        assert ex.stats().requests_finished == 5
        trtllm.plan = default_plan  # the executor still serves
        assert ex.submit([5], SamplingParams(max_tokens=3)).result(5).finish_reason == "length"


def test_a_final_response_without_new_tokens_keeps_the_logprobs(engine_dir: Path, trtllm: ModuleType) -> None:
    """Upstream's final response can carry no new token (the last came in the response before): a request that asked
    for logprobs ended in "error" there (a TypeError reading the missing new logprobs)."""
    trtllm.plan = lambda prompt, sp: Plan([100, 101, 102], steps=(3,))  # 3 tokens, then an empty final response
    with TrtllmExecutor(engine_dir) as ex:
        out = ex.submit([5], SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1)).result(5)
    assert (out.token_ids, out.finish_reason, len(out.logprobs)) == ([100, 101, 102], "length", 3)


def test_a_submit_that_fails_frees_its_request_id(engine_dir: Path, trtllm: ModuleType, monkeypatch) -> None:
    """A failure while the request's trackers are made left its id claimed: 'already in flight' ever after."""
    from runtime.executors import trtllm as adapter

    trtllm.plan = default_plan
    with TrtllmExecutor(engine_dir) as ex:
        with monkeypatch.context() as m:
            m.setattr(adapter._Request, "create_group", classmethod(lambda cls, *a, **k: 1 / 0))
            with pytest.raises(ZeroDivisionError):
                ex.submit([5], SamplingParams(max_tokens=3), request_id="x")
        assert ex.submit([5], SamplingParams(max_tokens=3), request_id="x").result(5).finish_reason == "length"


def test_a_submit_racing_shutdown_is_refused_or_finished(engine_dir: Path, trtllm: ModuleType, monkeypatch) -> None:
    """A submit that passed the shutdown check before shutdown stopped the loop, and queued its start after, left a
    handle that never finished; it is queued before shutdown begins, or refused."""
    from runtime.executors import trtllm as adapter

    trtllm.plan = default_plan
    ex = TrtllmExecutor(engine_dir)
    made, go = threading.Event(), threading.Event()
    create_group = adapter._Request.create_group.__func__

    def paused(cls, *args, **kwargs):  # the submit stops between its checks and queuing its start
        made.set()
        go.wait(10)
        return create_group(cls, *args, **kwargs)

    monkeypatch.setattr(adapter._Request, "create_group", classmethod(paused))
    outcome: list = []

    def submit() -> None:
        try:
            outcome.append(ex.submit([5], SamplingParams(max_tokens=3)))
        except RuntimeError as e:
            outcome.append(e)

    racing = threading.Thread(target=submit)
    racing.start()
    assert made.wait(10)
    join = ex._thread.join

    def stopped_then_go(timeout: float | None = None) -> None:  # the loop's stop is queued: let the submit on
        join(timeout)
        go.set()
        racing.join(10)

    monkeypatch.setattr(ex._thread, "join", stopped_then_go)
    ex.shutdown()
    [got] = outcome
    if isinstance(got, RuntimeError):
        assert str(got) == "executor is shut down"
    else:
        assert got.result(5).finish_reason == "cancelled"


def test_contract_submit_validation_and_shutdown(engine_dir: Path, trtllm: ModuleType) -> None:
    def token(i: int) -> int:  # the second waits for shutdown: a slow test thread must not see the request end first
        if i == 1:
            wait_until(lambda: ex._stopping, timeout=30)
        return 100 + i % 50

    trtllm.plan = lambda prompt, sp: Plan(token, delay=0.005)
    ex = TrtllmExecutor(engine_dir)
    cases = [([], SamplingParams(), "prompt must not be empty"),
             ([5, 4096], SamplingParams(), r"prompt token ids must be in \[0, 4096\)"),
             ([5, 6, 7], SamplingParams(max_tokens=300), "max_tokens 300 with a 3-token prompt exceeds max_seq_len "
                                                         "256; at most 253"),
             ([5], SamplingParams(top_p=0), r"top_p must be in \(0, 1\]"),
             ([5], SamplingParams(bad_token_ids=(5000,)), r"bad_token_ids must be token ids in \[0, 4096\)")]
    for prompt, params, message in cases:
        with pytest.raises(ValueError, match=message):
            ex.submit(prompt, params)
    h = ex.submit([5, 6], SamplingParams(max_tokens=200, ignore_eos=True), request_id="same")
    with pytest.raises(ValueError, match="request_id 'same' is already in flight"):
        ex.submit([5, 6], SamplingParams(max_tokens=5), request_id="same")
    next(iter(h))
    ex.shutdown(timeout=5)  # as a server's watchdog calls every executor's (it took no timeout: TypeError there)
    assert h.result(5).finish_reason == "cancelled"
    assert trtllm.llms[0].requests[0].abort_calls == 1 and trtllm.llms[0].shutdown_calls == 1
    with pytest.raises(RuntimeError, match="executor is shut down"):
        ex.submit([5], SamplingParams())
    ex.shutdown()  # idempotent
    h.cancel()  # after shutdown: ignored
    assert trtllm.llms[0].shutdown_calls == 1
    # without chunked prefill TensorRT-LLM takes a prompt in one step: longer than max_num_tokens is refused
    with TrtllmExecutor(engine_dir, llm_overrides={"max_num_tokens": 64}) as small:
        with pytest.raises(ValueError) as e:
            small.submit([5] * 65, SamplingParams(max_tokens=3))
        assert str(e.value) == ("prompt has 65 tokens; max_num_tokens is 64 (TensorRT-LLM without chunked prefill "
                                "takes a prompt in one step)")


def test_llm_kwargs_fit_the_installed_release() -> None:
    """Field names moved between releases: tokens_per_block is left out where KvCacheConfig lacks it
    (1.0), thinking-phase tokens are upper-case where MTPDecodingConfig spells them so (1.0/1.1)."""
    from runtime.executors.trtllm_api import adapt_llm_kwargs

    kwargs = {"kv_cache_config": {"dtype": "auto", "tokens_per_block": 16},
              "speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 3,
                                     "begin_thinking_phase_token": 7, "end_thinking_phase_token": 8}}
    old = adapt_llm_kwargs(kwargs, {"dtype", "free_gpu_memory_fraction"},
                           {"decoding_type", "num_nextn_predict_layers", "BEGIN_THINKING_PHASE_TOKEN",
                            "END_THINKING_PHASE_TOKEN"})
    assert old == {"kv_cache_config": {"dtype": "auto"},
                   "speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 3,
                                          "BEGIN_THINKING_PHASE_TOKEN": 7, "END_THINKING_PHASE_TOKEN": 8}}
    new = adapt_llm_kwargs(kwargs, {"dtype", "tokens_per_block"},
                           {"decoding_type", "num_nextn_predict_layers", "begin_thinking_phase_token",
                            "end_thinking_phase_token"})
    assert new == kwargs
    assert adapt_llm_kwargs(kwargs, None, None) == kwargs
    assert kwargs["kv_cache_config"]["tokens_per_block"] == 16, "the input was modified"


def test_zeroed_speculative_metrics_are_not_reported_counts() -> None:
    """The PyTorch backend of the 1.x releases sends request_perf_metrics.speculative_decoding left at
    zero even when it drafted: that is "not reported", not "nothing drafted"."""
    from types import SimpleNamespace

    from runtime.executors.trtllm_api import speculative_counts

    def result(drafted: int, accepted: int):
        spec = SimpleNamespace(total_draft_tokens=drafted, total_accepted_draft_tokens=accepted)
        return SimpleNamespace(outputs=[SimpleNamespace(request_perf_metrics=SimpleNamespace(speculative_decoding=spec))])

    assert speculative_counts(result(0, 0)) is None
    assert speculative_counts(result(12, 9)) == (12, 9)
    assert speculative_counts(SimpleNamespace(outputs=[SimpleNamespace(request_perf_metrics=None)])) is None


def test_kv_cache_metrics_are_read_as_upstream_names_them() -> None:
    """request_perf_metrics.kv_cache_metrics.{num_reused_blocks, num_missed_blocks} (tensorrt_llm/executor/result.py,
    read the same way by upstream's llmapi Triton model) become the request's stats; absent, None."""
    from types import SimpleNamespace

    from runtime.executors.trtllm_api import kv_cache_counts

    kv = SimpleNamespace(num_total_allocated_blocks=5, num_new_allocated_blocks=2, num_reused_blocks=3,
                         num_missed_blocks=2, kv_cache_hit_rate=0.6)
    metrics = SimpleNamespace(kv_cache_metrics=kv, speculative_decoding=None)
    assert kv_cache_counts(SimpleNamespace(outputs=[SimpleNamespace(request_perf_metrics=metrics)])) == (3, 2)
    assert kv_cache_counts(SimpleNamespace(outputs=[SimpleNamespace(request_perf_metrics=None)])) is None
    assert kv_cache_counts(SimpleNamespace(outputs=[])) is None


def test_create_executor_dispatches_on_the_backend(engine_dir: Path, spec_checkpoint: Path, trtllm: ModuleType,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    config = ExecutorConfig(num_draft_tokens=0, speculation="off")
    with create_executor(engine_dir, config) as ex:
        assert isinstance(ex, TrtllmExecutor) and ex.num_draft_tokens == 0
    native_calls = []
    monkeypatch.setattr("runtime.executors.backends.Executor", lambda *a: native_calls.append(a) or "native")
    assert create_executor(spec_checkpoint, config) == "native" and native_calls == [(spec_checkpoint, config)]


# ---- the same text as the native executor for the same token stream --------------------------------
PARITY_PROMPTS = ["def fib(n):", "In the beginning God created the heaven and the earth."]


@pytest.fixture(scope="module")
def native(spec_checkpoint: Path) -> dict[str, Any]:
    """Greedy streams of the native executor (one token per step) on the tiny checkpoint: the raw
    continuation of each prompt, and the outputs of each parity case."""
    with Executor(spec_checkpoint, ExecutorConfig(num_draft_tokens=0, speculation="off")) as ex:
        tok = ex.tokenizer
        prompts = [tok.encode(p) for p in PARITY_PROMPTS]
        raw = [ex.submit(p, SamplingParams(max_tokens=48, ignore_eos=True)).result(60).token_ids for p in prompts]
        text = tok.decode(raw[1])
        stop = text[len(text) // 3: len(text) // 3 + 3]
        cases = {
            "eos": (0, SamplingParams(max_tokens=32)),
            "length": (1, SamplingParams(max_tokens=30, ignore_eos=True)),
            "stop_string": (1, SamplingParams(max_tokens=48, ignore_eos=True, stop=(stop, "\x00never"))),
            "stop_token": (1, SamplingParams(max_tokens=48, ignore_eos=True, stop_token_ids=(raw[1][9],))),
        }
        streams = {name: (i, params, every_output(ex, prompts[i], params)) for name, (i, params) in cases.items()}
    assert streams["stop_string"][2][-1].finish_reason == "stop"
    return {"prompts": prompts, "raw": raw, "streams": streams}


def test_contract_same_refusals_as_native(engine_dir: Path, spec_checkpoint: Path, trtllm: ModuleType) -> None:
    """A request the native executor refuses for what it asks is refused by the adapter with the same message
    (it skipped the checks that need the eos id: a guided request banning eos could never end)."""
    with Executor(spec_checkpoint, ExecutorConfig(num_draft_tokens=0, speculation="off")) as native, \
            TrtllmExecutor(engine_dir) as adapter:
        eos, vocab = native.tokenizer.eos_token_id, native.model_config.vocab_size
        assert adapter.tokenizer.eos_token_id == eos
        bad = [SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(regex="[a-z]+"), bad_token_ids=(eos,)),
               SamplingParams(max_tokens=8, min_tokens=4, bad_token_ids=tuple(t for t in range(vocab) if t != eos))]
        for params in bad:
            messages = []
            for ex in (native, adapter):
                with pytest.raises(ValueError) as e:
                    ex.validate([5, 6, 7], params)
                messages.append(str(e.value))
            assert messages[0] == messages[1], messages


@pytest.mark.parametrize("steps", [(1,), (3, 1, 4, 2)], ids=["one-token-steps", "mtp-like-steps"])
def test_contract_same_outputs_as_native(engine_dir: Path, trtllm: ModuleType, native: dict, steps) -> None:
    """The double replays the native model's own greedy tokens; the adapter's RequestOutputs must
    be the native executor's (one token per step: output for output; larger steps: same text,
    finish reason and, without stop strings, the same tokens)."""
    by_prompt = {tuple(p): r for p, r in zip(native["prompts"], native["raw"])}
    trtllm.plan = lambda prompt, sp: Plan(by_prompt[tuple(prompt)], steps=steps)

    def view(o: RequestOutput) -> tuple:
        return o.new_token_ids, o.token_ids, o.text_delta, o.text, o.finished, o.finish_reason

    with TrtllmExecutor(engine_dir) as ex:
        for name, (i, params, want) in native["streams"].items():
            got = every_output(ex, native["prompts"][i], params)
            check_stream(got)
            if steps == (1,):
                assert [view(o) for o in got] == [view(o) for o in want], name
            else:
                assert (got[-1].text, got[-1].finish_reason) == (want[-1].text, want[-1].finish_reason), name
                if not params.stop:
                    assert got[-1].token_ids == want[-1].token_ids, name
            assert (got[-1].stats.prompt_tokens, got[-1].stats.output_tokens) == (
                want[-1].stats.prompt_tokens, len(got[-1].token_ids))


# ---- serving/check_trtllm.py on the executor, with the double -----------------------------------
def test_check_script_executor_path_with_the_double(engine_dir: Path, trtllm: ModuleType, tmp_path: Path,
                                                   capsys, monkeypatch) -> None:
    check = _import_check()
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def fib(n):", {"text": "for i in range(10):"}]))
    args = ["--engine_dir", str(engine_dir), "--skip_triton", "--prompts_file", str(prompts), "--max_tokens", "8",
            "--json_out", str(tmp_path / "out.json")]
    assert check.main(args) == 0
    out = capsys.readouterr().out
    assert "executor k=0" in out and "executor k=3" in out and "TPOT" in out and "acceptance" in out
    assert out.rstrip().endswith("PASS")
    assert [llm.kwargs.get("speculative_config", {}).get("num_nextn_predict_layers", 0) for llm in trtllm.llms] == [0, 3]
    assert all(llm.kwargs["kv_cache_config"]["free_gpu_memory_fraction"] == 0.5 for llm in trtllm.llms)
    results = json.loads((tmp_path / "out.json").read_text())
    assert len(results["paths"]["executor_k3"]) == 2
    assert list(temp.iterdir()) == []  # its work directory went with the pass
    # outputs that depend on the draft length fail the check; the work directory stays for inspection
    trtllm.plan = lambda prompt, sp: Plan(lambda i: 100 + i + trtllm.llms[-1].draft_len)
    assert check.main(args) == 1
    captured = capsys.readouterr()
    assert "MISMATCH executor k=3 vs k=0 at output token 0" in captured.out
    [kept] = temp.iterdir()
    assert captured.err == f"check_trtllm: kept {kept} (engine, model repositories, server logs) for inspection\n"


def test_check_script_builds_the_shipped_model(shipped_model_dir: Path, trtllm: ModuleType, tmp_path: Path,
                                               capsys) -> None:
    """The default flow without --engine_dir: `build_engine --backend trtllm` as a subprocess, then
    the executor (with the double); Triton skipped."""
    check = _import_check()
    args = ["--model_dir", str(shipped_model_dir), "--work_dir", str(tmp_path), "--skip_triton", "--num_prompts", "2",
            "--max_tokens", "4"]
    assert check.main(args) == 0
    engine = tmp_path / "engine"
    assert engine_backend(engine) == "trtllm"
    assert trtllm.llms[0].model == str(engine / "hf")
    assert yaml.safe_load((engine / LLM_API_OPTIONS).read_text())["speculative_config"]["num_nextn_predict_layers"] == 3
    assert capsys.readouterr().out.rstrip().endswith("PASS")


def test_contract_too_old_tensorrt_llm_fails_at_construction(engine_dir: Path, trtllm: ModuleType) -> None:
    trtllm.SamplingParams = sampling_params_class([n for n in UPSTREAM_SAMPLING_FIELDS if n != "bad_token_ids"])
    with pytest.raises(RuntimeError, match="has no field 'bad_token_ids'"):
        TrtllmExecutor(engine_dir)
    assert trtllm.llms == []
