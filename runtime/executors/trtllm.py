"""The executor for `build_engine --backend trtllm` engines: TensorRT-LLM's LLM API behind our API.

`TrtllmExecutor` has the public surface of `runtime.executors.native.Executor` (`submit`, `cancel`,
`stats`, `shutdown`, `tokenizer`, context manager) and returns the same `RequestHandle`,
`RequestOutput`, `RequestStats` and `ExecutorStats`, so `Session` and the Triton model can take
either. Underneath it opens the engine directory (engine.json with backend "trtllm", the HF
layout under `hf/`, `extra_llm_api_options.yaml`), builds
`tensorrt_llm.LLM(model=<engine>/hf, backend="pytorch", **<the YAML>)` and streams each request
through `LLM.generate_async(..., streaming=True)` on an asyncio loop in a background thread.

What stays ours, so that text handling is identical to the native executor: the text (our
`IncrementalDetokenizer` over the token ids TensorRT-LLM streams; its own detokenizer is switched
off), stop strings (matched on that text with the native hold-back rule, then the upstream request
is aborted), and the truncation at stop token ids, eos and max_tokens (re-applied to the streamed
ids). TensorRT-LLM is still told max_tokens, end_id and stop_token_ids so that it stops computing.

`tensorrt_llm` is imported only when an executor is constructed (`import_tensorrt_llm`); this
module imports without it. Nothing here has run against the real package: the tests inject a test
double module (a contract test of the names and arguments we use; see docs/trtllm-backend.md).

Upstream names used, and where they come from (NVIDIA/TensorRT-LLM, main branch as of the 1.x
releases; the LLM API of the PyTorch backend, which is the only one that runs DeepSeek-V3 + MTP):
- `tensorrt_llm.LLM` (tensorrt_llm/llmapi/llm.py: `class LLM(_TorchLLM)` since 1.0, whose
  `__init__` does `kwargs.pop("backend", "pytorch")`; in 0.19-0.21 `LLM(backend="pytorch")` selects
  the same backend, `tensorrt_llm._torch.LLM` is deprecated and raises ImportError in 1.x).
- `LLM.generate_async(inputs, sampling_params=None, ..., streaming=False, ...)` (same file); inputs
  `{"prompt_token_ids": [...]}` (tensorrt_llm/inputs/data.py, TokensPrompt). It must be called on
  the thread running the event loop: GenerationResultBase creates its asyncio queue only when
  `has_event_loop()` (tensorrt_llm/executor/result.py).
- The result (`RequestOutput(DetokenizedGenerationResultBase, GenerationResult)`) is async
  iterable (`__aiter__`/`__anext__` yield itself, updated), with `.finished`, `.abort()`,
  `.decoding_iter`, `.outputs` (n `CompletionOutput`s, SamplingParams.n) with cumulative `.token_ids`,
  `.finish_reason` in {'stop', 'length', 'timeout', 'cancelled', None} and (1.x)
  `.request_perf_metrics` (tensorrt_llm/executor/result.py).
- `request_perf_metrics.speculative_decoding.{total_draft_tokens, total_accepted_draft_tokens,
  acceptance_rate}` (bindings RequestPerfMetrics, read the same way by
  triton_backend/.../tensorrt_llm/1/model.py and the accuracy tests), filled when the request has
  `return_perf_metrics=True`.
- `request_perf_metrics.kv_cache_metrics.{num_reused_blocks, num_missed_blocks}` (the same bindings; upstream's
  llmapi Triton model returns them as kv_cache_reused_block / kv_cache_missed_block), and
  `KvCacheConfig.enable_block_reuse` (tensorrt_llm/llmapi/llm_args.py, default True).
- `tensorrt_llm.SamplingParams` fields (tensorrt_llm/sampling_params.py): see
  `to_trtllm_sampling_kwargs`.
- `tensorrt_llm.llmapi.GuidedDecodingParams(json=, regex=, grammar=, json_object=)` (tensorrt_llm/sampling_params.py,
  re-exported by tensorrt_llm/llmapi; also `structural_tag`, not used) on `SamplingParams.guided_decoding`, served
  when the LLM was built with `guided_decoding_backend` "xgrammar" or "llguidance" (llm_args.py; the engine's
  YAML key, passed through as is): see `guided_decoding_fields`.
- `CompletionOutput.logprobs` / `.prompt_logprobs` (tensorrt_llm/executor/result.py, `LogprobResults`:
  per position a dict {token id: `Logprob(logprob, rank)`}) and `.cumulative_logprob`: see
  `logprobs_from_upstream`.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from runtime.io.engine_format import ENGINE_JSON, LLM_API_OPTIONS, BuildConfig, EngineError, EngineManifest, file_sha256
from runtime.io.yaml_file import read_yaml
from runtime.executors.base import ExecutorConfig
from runtime.executors.requests import ExecutorStats, RequestHandle, RequestIds, RequestOutput, RequestTracker
from runtime.core.guide_check import check_guide
from runtime.core.sampling import TokenLogprob
from runtime.core.sampling_params import GuidedDecodingParams, SamplingParams, validate_request
from runtime.core.scheduler import SchedulerConfig
from runtime.io.tokenizer import Tokenizer

log = logging.getLogger("runtime.executors.trtllm")

GUIDED_DECODING_BACKENDS = ("xgrammar", "llguidance")  # llm_args.py: TorchLlmArgs.guided_decoding_backend

TRTLLM_MISSING_MESSAGE = (
    "TensorRT-LLM is not available: the Python package `tensorrt_llm` could not be imported. "
    "Engines built with --backend trtllm run only where TensorRT-LLM and its CUDA libraries are installed: "
    "run inside NVIDIA's TensorRT-LLM container (nvcr.io/nvidia/tensorrt-llm/release:<version>) or the "
    "Triton TensorRT-LLM container (nvcr.io/nvidia/tritonserver:<xx.yy>-trtllm-python-py3), "
    "or rebuild the engine with --backend native."
)

# SamplingParams fields we may leave out when an older TensorRT-LLM lacks them: the adapter
# re-applies what they ask for itself (or, for perf metrics, reports 0 draft tokens).
_OPTIONAL_UPSTREAM_FIELDS = ("detokenize", "include_stop_str_in_output", "return_perf_metrics")
# Fields newer than some supported releases, which may be left out when they ask for what the older
# releases do anyway: logprobs_mode arrived after 1.0, whose PyTorch sampler returns raw logprobs; min_p 0 is off.
_DEFAULT_WHEN_MISSING = {"logprobs_mode": "raw_logprobs", "min_p": 0.0}


class TensorRTLLMUnavailable(ImportError):
    """`tensorrt_llm` cannot be imported here; the message says where it can."""


def import_tensorrt_llm() -> Any:
    """The `tensorrt_llm` module, or TensorRTLLMUnavailable naming the package and the containers."""
    try:
        import tensorrt_llm
    except (ImportError, OSError) as e:  # OSError: a wheel whose CUDA libraries are missing
        raise TensorRTLLMUnavailable(
            f"{TRTLLM_MISSING_MESSAGE}\n(import failed with {type(e).__name__}: {e})") from e
    return tensorrt_llm


# ---- pure mappings (unit-tested) --------------------------------------------------------------
def to_trtllm_sampling_kwargs(params: SamplingParams, tokenizer: Any) -> dict[str, Any]:
    """Keyword arguments for `tensorrt_llm.SamplingParams` equivalent to our `params`.

    `tokenizer` needs `eos_token_id` and `pad_token_id` (ours, or anything with them). Field
    names and conventions are those of tensorrt_llm/sampling_params.py:
    - greedy (temperature 0): `temperature=0.0, top_k=1`, no top_p. Greedy under every version's
      rule: 1.x `params_imply_greedy_decoding` (top_k == 1 or temperature == 0); older
      `_greedy_decoding` (top_k in (None, 1) and top_p in (None, 0)); the C++
      `SamplingConfig::checkTemperature` accepts 0.
    - sampling: `temperature`, `top_p` (always given: None means 0 in older C++ defaults), `top_k`
      only when ours is > 0 and fits upstream's int32 (ours 0 = off; upstream None = "C++ runtime
      default 0, i.e., all logits"), `seed` as it is (ours in [0, 2^63) fit upstream's uint64). An unseeded request
      is given a random seed by `TrtllmExecutor.submit` (upstream None would be seed 0 for every
      request).
    - eos: `end_id` = the tokenizer's eos, or -1 (no end token) when `ignore_eos` or there is none.
      Upstream's own `ignore_eos=True` is NOT used: executor/base_worker.py then also drops every
      stop word (`stop_words=[] if ignore_eos`), which would ignore our stop_token_ids.
      `pad_id` = the tokenizer's pad, else eos, else -1 (upstream's default is pad = end).
    - `stop_token_ids` as a list; `bad_token_ids` as a list (upstream's `_get_bad_words` turns it
      into single-token bad words `[[id], ...]`).
    - stop strings are not passed: upstream's `stop` needs `_setup(tokenizer)`, which LLM calls
      only when end_id is None, and it matches token sequences, not text. The executor matches
      them on the detokenized text exactly as the native executor does and aborts the request.
    - `include_stop_str_in_output=True`: upstream never trims tokens it already streamed (it trims
      stop words from `token_ids` at the end otherwise); the executor trims itself.
    - `detokenize=False` (we detokenize), `return_perf_metrics=True` (draft/accepted counts).
    - `logprobs` / `prompt_logprobs` at least 1 (upstream's `_validate` turns 0 into "no logprobs":
      `self.logprobs = self.logprobs and int(self.logprobs)`; the adapter keeps the top-N asked for) and
      `logprobs_mode` (vLLM's names, as upstream's since 1.1) when either is asked for.
    - `repetition_penalty`, `presence_penalty`, `frequency_penalty`, `min_tokens` (same names and
      meanings) when not at their neutral values.
    - `n` and `best_of` (same names and meanings; `use_beam_search` stays False) when more than one sequence is
      asked for: upstream samples best_of and returns the n with the highest cumulative logprob, seeding its
      sequences its own way (ours: seed + i).
    - `guided_decoding` as the fields of upstream's GuidedDecodingParams (`guided_decoding_fields`; the
      executor builds the upstream object, `upstream_sampling_params`). Upstream's MTP path may not apply penalties (its
      speculative decoders use a smaller sampler: docs/trtllm-backend.md).
    """
    eos = tokenizer.eos_token_id
    end_id = -1 if params.ignore_eos or eos is None else eos
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = eos if eos is not None else -1
    kwargs: dict[str, Any] = {"max_tokens": params.max_tokens, "end_id": end_id, "pad_id": pad}
    if params.greedy:
        kwargs.update(temperature=0.0, top_k=1)
    else:
        kwargs.update(temperature=float(params.temperature), top_p=float(params.top_p))
        if 0 < params.top_k < 2**31:  # a top_k past int32 is past any vocabulary: all tokens
            kwargs["top_k"] = params.top_k
        if params.min_p > 0:
            kwargs["min_p"] = float(params.min_p)
        if params.seed is not None:
            kwargs["seed"] = int(params.seed)  # a numpy int, validation accepts, as the Python int
    if params.stop_token_ids:
        kwargs["stop_token_ids"] = list(params.stop_token_ids)
    if params.bad_token_ids:
        kwargs["bad_token_ids"] = list(params.bad_token_ids)
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            kwargs[name] = max(getattr(params, name), 1)
            kwargs["logprobs_mode"] = params.logprobs_mode
    for name, neutral in (("repetition_penalty", 1), ("presence_penalty", 0), ("frequency_penalty", 0)):
        if getattr(params, name) != neutral:
            kwargs[name] = float(getattr(params, name))
    if params.min_tokens:
        kwargs["min_tokens"] = params.min_tokens
    if params.guided_decoding is not None:
        kwargs["guided_decoding"] = guided_decoding_fields(params.guided_decoding)
    if params.num_sequences > 1:
        kwargs["n"] = params.n
        if params.best_of is not None:
            kwargs["best_of"] = params.best_of
    kwargs.update(include_stop_str_in_output=True, detokenize=False, return_perf_metrics=True)
    return kwargs


def guided_decoding_fields(guide: GuidedDecodingParams) -> dict[str, Any]:
    """Upstream's GuidedDecodingParams keyword arguments: the same names; a schema as its JSON text (upstream takes a
    str, a dict or a pydantic model)."""
    return {"json_object": True} if guide.kind == "json_object" else {guide.kind: guide.text}


def upstream_sampling_params(trtllm: Any, kwargs: dict[str, Any]) -> Any:
    """`tensorrt_llm.SamplingParams(**kwargs)`, a guided_decoding dict made upstream's GuidedDecodingParams."""
    if "guided_decoding" in kwargs:
        kwargs = {**kwargs, "guided_decoding": trtllm.llmapi.GuidedDecodingParams(**kwargs["guided_decoding"])}
    return trtllm.SamplingParams(**kwargs)


def adapt_to_upstream_fields(kwargs: dict[str, Any], sampling_params_cls: Any) -> dict[str, Any]:
    """`kwargs` fitted to the fields a given `tensorrt_llm.SamplingParams` class has.

    `seed` becomes `random_seed` for versions that call it that; optional fields
    (_OPTIONAL_UPSTREAM_FIELDS) the class lacks are dropped, and so are newer ones at the value older
    releases behave as (_DEFAULT_WHEN_MISSING); any other missing field is an error naming it (this
    TensorRT-LLM is too old for the adapter, or for what the request asks).
    """
    fields = _field_names(sampling_params_cls)
    if fields is None:  # not introspectable: pass as is
        return dict(kwargs)
    out = {}
    for name, value in kwargs.items():
        if name in fields:
            out[name] = value
        elif name == "seed" and "random_seed" in fields:
            out["random_seed"] = value
        elif name in _OPTIONAL_UPSTREAM_FIELDS or _DEFAULT_WHEN_MISSING.get(name, out) == value:
            log.debug("tensorrt_llm.SamplingParams has no %r; left out", name)
        elif name in _DEFAULT_WHEN_MISSING:
            raise ValueError(f"{name} {value!r} needs a newer TensorRT-LLM: this one's SamplingParams has no {name}")
        else:
            raise RuntimeError(
                f"tensorrt_llm.SamplingParams has no field {name!r}, which the trtllm executor needs; "
                "use TensorRT-LLM 1.0 or newer (the versions whose LLM API runs DeepSeek-V3 with MTP)")
    return out


def logprobs_from_upstream(entries: list[Any], token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """Upstream's logprobs of `token_ids` as ours: per position a dict {token id: Logprob(logprob, rank)}
    holding the token and the most likely ones (LogprobResults), of which the top_n best are kept; a bare
    float (older C++ results) gives the logprob alone."""
    out = []
    for t, entry in zip(token_ids, entries):
        if isinstance(entry, Mapping):
            own = entry[t]
            best = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top_n]
            out.append(TokenLogprob(t, float(own.logprob), own.rank, tuple((i, float(lp.logprob)) for i, lp in best)))
        else:
            out.append(TokenLogprob(t, float(entry), None, ()))
    return out


def _field_names(cls: Any) -> set[str] | None:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls) if f.init}
    try:
        import inspect

        return set(inspect.signature(cls).parameters) - {"self"}
    except (TypeError, ValueError):
        return None


def read_llm_api_options(engine_dir: Path) -> dict[str, Any]:
    """A --backend trtllm engine's LLM-API options (what it gives `LLM()`, and what make_model_repo copies into an
    llmapi model.yaml), refused unless a mapping without trust_remote_code: LLM() would run Python the engine's
    hf/ directory brings (an auto_map in its config.json), and DeepSeek-V3 needs none."""
    options_file = engine_dir / LLM_API_OPTIONS
    if not options_file.is_file():
        raise EngineError(f"{options_file}: missing; rebuild the engine with build_engine --backend trtllm")
    try:
        options = read_yaml(options_file)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise EngineError(f"{options_file}: cannot read it: {e}") from None
    if not isinstance(options, dict):
        raise EngineError(f"{options_file}: expected a mapping of LLM-API options")
    for section in ("kv_cache_config", "speculative_config", "cuda_graph_config"):
        if options.get(section) is not None and not isinstance(options[section], dict):
            raise EngineError(f"{options_file}: {section} must be a mapping, got {type(options[section]).__name__}")
    if options.get("trust_remote_code"):
        raise EngineError(f"{options_file}: trust_remote_code must be false or absent: DeepSeek-V3 needs no code from "
                          "its checkpoint, and an engine directory must not run any")
    return options


def llm_kwargs_for(options: Mapping[str, Any], manifest: EngineManifest, config: ExecutorConfig | None = None,
                   overrides: Mapping[str, Any] | None = None, source: str = LLM_API_OPTIONS) -> dict[str, Any]:
    """The `LLM(...)` keyword arguments: the engine's LLM-API options (the YAML), with the serving
    settings of `config` applied (None: as built) and then `overrides` merged in (dicts deeply).

    From ExecutorConfig: num_draft_tokens / speculation -> speculative_config (0 or "off" removes
    it; otherwise num_nextn_predict_layers = k, at most the built max_draft_len; "adaptive" runs
    as "fixed", TensorRT-LLM's MTP drafts a fixed length); max_batch_size, max_num_tokens,
    max_seq_len -> the same keys, at most the built values (cuda_graph_config.max_batch_size is
    lowered with max_batch_size); kv_cache_tokens -> kv_cache_config.max_tokens; enable_block_reuse False ->
    kv_cache_config.enable_block_reuse False (True keeps the engine's own, build_engine --[no-]enable_block_reuse,
    on unless built off, as upstream's default); dtype -> dtype;
    relaxed_acceptance -> speculative_config.{use_relaxed_acceptance_for_thinking, relaxed_topk,
    relaxed_delta, begin_thinking_phase_token, end_thinking_phase_token}; max_queued_requests is refused. `device`
    does not apply (TensorRT-LLM places ranks on the visible GPUs) and is ignored.
    """
    if not isinstance(options, Mapping):
        raise EngineError(f"{source}: expected a mapping of LLM-API options, got {type(options).__name__}")
    kwargs = copy.deepcopy(dict(options))
    build, cfg = manifest.build, manifest.model_config
    if config is not None:
        if config.max_queued_requests is not None:
            raise ValueError(f"max_queued_requests {config.max_queued_requests}: not available with a --backend "
                             "trtllm engine (TensorRT-LLM's LLM API takes no queue bound); leave it unset")
        limits = config.limits(build, cfg, source)
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len"):
            if getattr(config, name) is not None:
                kwargs[name] = getattr(limits, name)
        graphs = kwargs.get("cuda_graph_config")
        if config.max_batch_size is not None and isinstance(graphs, dict) and "max_batch_size" in graphs:
            graphs["max_batch_size"] = min(graphs["max_batch_size"], config.max_batch_size)
        if config.kv_cache_tokens is not None:
            kwargs.setdefault("kv_cache_config", {})["max_tokens"] = config.kv_cache_tokens
        if not config.enable_block_reuse:
            kwargs.setdefault("kv_cache_config", {})["enable_block_reuse"] = False
        if config.dtype is not None:
            kwargs["dtype"] = config.dtype
        k = config.draft_len(build.max_draft_len, cfg.num_nextn_predict_layers, source)
        if k == 0:
            kwargs.pop("speculative_config", None)
        else:
            spec = dict(kwargs.get("speculative_config") or {"decoding_type": "MTP"})
            if spec.get("use_mtp_vanilla") and k > cfg.num_nextn_predict_layers:
                raise ValueError(f"num_draft_tokens {k} with use_mtp_vanilla needs as many MTP layers; "
                                 f"the model has {cfg.num_nextn_predict_layers}")
            # tensorrt_llm/llmapi/llm_args.py, MTPDecodingConfig: a validator sets max_draft_len (and
            # max_total_draft_tokens) to num_nextn_predict_layers; with a one-layer checkpoint and
            # use_mtp_vanilla False that layer is re-run (MTP Eagle), so k may exceed the layer count.
            spec["num_nextn_predict_layers"] = k
            if "max_draft_len" in spec:  # both names given (an llmapi model.yaml's): one value
                spec["max_draft_len"] = k
            if config.speculation == "adaptive":
                log.warning("speculation 'adaptive' is not available with TensorRT-LLM; drafting a fixed %d", k)
            relaxed = config.relaxed_acceptance
            if relaxed is not None:
                spec.update(use_relaxed_acceptance_for_thinking=True, relaxed_topk=relaxed.top_n,
                            relaxed_delta=relaxed.delta)
                if relaxed.begin_thinking_token >= 0:
                    spec["begin_thinking_phase_token"] = relaxed.begin_thinking_token
                if relaxed.end_thinking_token >= 0:
                    spec["end_thinking_phase_token"] = relaxed.end_thinking_token
            kwargs["speculative_config"] = spec
    return _deep_merge(kwargs, overrides or {})


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def adapt_llm_kwargs(kwargs: Mapping[str, Any], kv_cache_fields: set[str] | None,
                     mtp_fields: set[str] | None) -> dict[str, Any]:
    """LLM arguments fitted to the installed release's config classes (None: not introspectable, as is).

    kv_cache_config.tokens_per_block exists from the 1.1-era releases on (left out before, with a
    warning: the block size is then upstream's); MTPDecodingConfig spells the thinking-phase tokens
    BEGIN_/END_THINKING_PHASE_TOKEN in 1.0/1.1 and lower-case later.
    """
    out = copy.deepcopy(dict(kwargs))
    kv = out.get("kv_cache_config")
    if kv_cache_fields is not None and isinstance(kv, dict) and "tokens_per_block" in kv \
            and "tokens_per_block" not in kv_cache_fields:
        log.warning("this TensorRT-LLM's KvCacheConfig has no tokens_per_block; its default block size is used")
        kv.pop("tokens_per_block")
    spec = out.get("speculative_config")
    if mtp_fields is not None and isinstance(spec, dict):
        for name in ("begin_thinking_phase_token", "end_thinking_phase_token"):
            if name in spec and name not in mtp_fields and name.upper() in mtp_fields:
                spec[name.upper()] = spec.pop(name)
    return out


def _model_fields(cls: Any) -> set[str] | None:
    """Field names of a pydantic config class of tensorrt_llm.llmapi, None when there is none."""
    fields = getattr(cls, "model_fields", None)
    return set(fields) if isinstance(fields, Mapping) else None


def draft_len_of(llm_kwargs: Mapping[str, Any]) -> int:
    """The MTP draft length the LLM arguments ask for: `max_draft_len` (upstream's name since 2026) or its older
    name `num_nextn_predict_layers`, which build_engine writes (every release reads it)."""
    spec = llm_kwargs.get("speculative_config") or {}
    if not isinstance(spec, Mapping):
        return 0
    return int(spec.get("max_draft_len", spec.get("num_nextn_predict_layers", 0)))


def speculative_counts(result: Any) -> tuple[int, int] | None:
    """(total_draft_tokens, total_accepted_draft_tokens) TensorRT-LLM reports for a request so far,
    or None where it reports none (no `request_perf_metrics`, e.g. before 1.0 or without
    return_perf_metrics, no `speculative_decoding` in it, or that section left at zero: the PyTorch
    backend's TorchSampler never fills it in the 1.x releases)."""
    outputs = getattr(result, "outputs", None) or []
    metrics = getattr(outputs[0], "request_perf_metrics", None) if outputs else None
    if metrics is None:
        metrics = getattr(result, "request_perf_metrics", None)
    spec = getattr(metrics, "speculative_decoding", None) if metrics is not None else None
    if spec is None:
        return None
    try:
        drafted, accepted = int(spec.total_draft_tokens), int(spec.total_accepted_draft_tokens)
    except (AttributeError, TypeError, ValueError):
        return None
    return (drafted, accepted) if drafted > 0 else None


def kv_cache_counts(result: Any) -> tuple[int, int] | None:
    """(num_reused_blocks, num_missed_blocks) of `request_perf_metrics.kv_cache_metrics` (tensorrt_llm/executor/
    result.py), None where TensorRT-LLM reports none."""
    outputs = getattr(result, "outputs", None) or []
    metrics = getattr(outputs[0], "request_perf_metrics", None) if outputs else None
    kv = getattr(metrics, "kv_cache_metrics", None) if metrics is not None else None
    try:
        return int(kv.num_reused_blocks), int(kv.num_missed_blocks)
    except (AttributeError, TypeError, ValueError):
        return None


_UPSTREAM_REASONS = {"stop": "stop", "length": "length", "cancelled": "cancelled", "timeout": "error", None: "stop"}


# ---- engine directory -------------------------------------------------------------------------
@dataclass(frozen=True)
class TrtllmEngine:
    """A `--backend trtllm` engine directory, read and checked (no TensorRT-LLM needed)."""

    path: Path
    manifest: EngineManifest
    model_dir: Path  # the HF layout TensorRT-LLM loads (`hf/`)
    options: dict[str, Any]  # extra_llm_api_options.yaml

    @classmethod
    def open(cls, path: str | Path, verify_weights: bool = False) -> "TrtllmEngine":
        """Read engine.json (refusing a native engine), check that every listed file is there, hash
        the small ones (options, config, tokenizer) and, with verify_weights, the weights too."""
        path = Path(path)
        if not (path / ENGINE_JSON).is_file():
            raise EngineError(f"{path}: no {ENGINE_JSON}; expected an engine directory built with "
                              "build_engine --backend trtllm")
        manifest = EngineManifest.read(path)
        if manifest.build.backend != "trtllm":
            raise EngineError(f"{path}: built with --backend {manifest.build.backend}; run it with "
                              "runtime.executors.native.Executor, or rebuild with --backend trtllm")
        manifest.verify_files(path, hashes=False)
        for name, digest in manifest.files.items():
            file = path / name
            if not file.is_file():
                raise EngineError(f"{file}: file missing, expected it as listed in {ENGINE_JSON}")
            if (verify_weights or name not in manifest.weights) and file_sha256(file) != digest:
                raise EngineError(f"{file}: content hash mismatch with {ENGINE_JSON}; the file changed "
                                  "or is corrupt, rebuild the engine")
        parents = {Path(w).parent for w in manifest.weights}
        if len(parents) != 1:
            raise EngineError(f"{path / ENGINE_JSON}: weights {list(manifest.weights)} are not in one directory")
        model_dir = path / parents.pop()
        return cls(path, manifest, model_dir, read_llm_api_options(path))

    @property
    def build(self) -> BuildConfig:
        return self.manifest.build


# ---- the executor -----------------------------------------------------------------------------
@dataclass(eq=False)
class _Request(RequestTracker):
    """The shared output side plus the upstream request it streams from."""

    prompt: list[int] = field(default_factory=list)
    seen: int = 0  # upstream output tokens consumed
    upstream: Any = None  # tensorrt_llm's RequestOutput once submitted (on the group's first)
    upstream_done: bool = False
    # the trackers of the request's n outputs (SamplingParams.n), one list shared by all; the first streams upstream
    group: list["_Request"] = field(default_factory=list)

    @property
    def done(self) -> bool:
        """Every output of the request has finished."""
        return all(t.finished for t in self.group)


class TrtllmExecutor:
    """Runs a `--backend trtllm` engine with TensorRT-LLM, with `Executor`'s public API.

    `config` None serves the engine as built (the YAML as is); an `ExecutorConfig` applies its
    serving settings (see `llm_kwargs_for`). `llm_overrides` are merged into the LLM arguments
    last. `verify_weights` hashes the weight files too (slow for a full model; off by default,
    their presence is always checked). Statistics: num_draft_tokens / num_accepted_draft_tokens
    are TensorRT-LLM's per-request speculative-decoding metrics where it reports them and 0
    otherwise (`reports_draft_stats` says which); num_steps is its `decoding_iter`, else the
    number of streamed responses with tokens; ttft/tpot are measured here as in the native
    executor. ExecutorStats' KV-block counts are 0: TensorRT-LLM's iteration stats are not read.
    """

    kv_block_size = 0  # its blocks are TensorRT-LLM's own; their counts read 0 here

    def __init__(self, engine: str | Path | TrtllmEngine, config: ExecutorConfig | None = None, *,
                 llm_overrides: Mapping[str, Any] | None = None, verify_weights: bool = False):
        self.engine = engine if isinstance(engine, TrtllmEngine) else TrtllmEngine.open(engine, verify_weights)
        self.model_config = self.engine.manifest.model_config
        self.config = config
        self.llm_kwargs = llm_kwargs_for(self.engine.options, self.engine.manifest, config, llm_overrides,
                                         source=str(self.engine.path / LLM_API_OPTIONS))
        self.num_draft_tokens = draft_len_of(self.llm_kwargs)
        build = self.engine.build
        self.limits = SchedulerConfig(
            max_batch_size=int(self.llm_kwargs.get("max_batch_size", build.max_batch_size)),
            max_num_tokens=int(self.llm_kwargs.get("max_num_tokens", build.max_num_tokens)),
            max_seq_len=int(self.llm_kwargs.get("max_seq_len", build.max_seq_len)))
        self.tokenizer = Tokenizer.from_dir(self.engine.model_dir)
        if note := self.tokenizer.adopt_eos(self.model_config.eos_token_id):
            log.warning(note)
        self.reports_draft_stats: bool | None = None  # unknown until a request has finished

        self._trtllm = import_tensorrt_llm()
        # fail now, not on the first request, when this TensorRT-LLM lacks a field we need
        adapt_to_upstream_fields(to_trtllm_sampling_kwargs(
            SamplingParams(temperature=1.0, top_k=1, seed=0, stop_token_ids=(0,), bad_token_ids=(0,)), self.tokenizer),
            self._trtllm.SamplingParams)
        # tensorrt_llm/llmapi/llm.py: LLM(model, ..., **kwargs); backend "pytorch" (the default in 1.x)
        llmapi = getattr(self._trtllm, "llmapi", None)
        kwargs = adapt_llm_kwargs(self.llm_kwargs, _model_fields(getattr(llmapi, "KvCacheConfig", None)),
                                  _model_fields(getattr(llmapi, "MTPDecodingConfig", None)))
        self.llm = self._trtllm.LLM(model=str(self.engine.model_dir), backend="pytorch", **kwargs)

        self._requests: dict[str, _Request] = {}  # in flight; touched on the loop thread only
        self._tasks: set[asyncio.Task] = set()
        self._counts = dict(finished=0, generated=0, drafted=0, accepted=0)
        self._ids = RequestIds()
        self._stopping = False
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="trtllm-executor", daemon=True)
        self._thread.start()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def health(self, timeout_s: float) -> str | None:
        """None while requests are served; else why not (a server's watchdog polls this). TensorRT-LLM's own
        loop is not watched here: only this adapter's event loop thread."""
        if self._closed or not self._thread.is_alive():
            return "the TensorRT-LLM executor has shut down"
        return None

    # ---- public API ---------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the parameter when this request cannot run here."""
        validate_request(prompt_token_ids, params, self.model_config.vocab_size, self.limits.max_seq_len,
                         self.limits.max_batch_size, self.tokenizer.eos_token_id)
        # tensorrt_llm/llmapi/llm.py, _check_arguments: without chunked prefill the whole prompt must
        # fit one step's max_num_tokens (generate_async raises otherwise)
        if not self.llm_kwargs.get("enable_chunked_prefill") and len(prompt_token_ids) > self.limits.max_num_tokens:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; max_num_tokens is {self.limits.max_num_tokens} "
                             "(TensorRT-LLM without chunked prefill takes a prompt in one step)")
        if params.num_draft_tokens not in (None, self.num_draft_tokens):
            raise ValueError(f"num_draft_tokens {params.num_draft_tokens} per request is not available with TensorRT-LLM, "
                             f"whose MTP drafts {self.num_draft_tokens} for every request; leave it unset")
        if params.guided_decoding is not None:
            check_guide(params.guided_decoding)  # the native executor's refusal: the field and the position
            if self.llm_kwargs.get("guided_decoding_backend") not in GUIDED_DECODING_BACKENDS:
                raise ValueError("guided_decoding needs TensorRT-LLM's guided_decoding_backend (xgrammar or llguidance) "
                                 f"in the engine's {LLM_API_OPTIONS}")
        # a field this release lacks for what the request asks (logprobs_mode) is refused here, not mid-stream
        adapt_to_upstream_fields(to_trtllm_sampling_kwargs(params, self.tokenizer), self._trtllm.SamplingParams)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None] | None = None, request_id: str | None = None,
               bounded: bool = True) -> RequestHandle:
        """Queue a request; invalid parameters raise ValueError naming the parameter. (`bounded`: there is no queue
        bound here, max_queued_requests is refused.)"""
        self.validate(prompt_token_ids, params)
        if self._stopping:
            raise RuntimeError("executor is shut down")
        rid = self._ids.claim(request_id)
        if not params.greedy and params.seed is None:  # as native: unseeded means a fresh random seed
            params = dataclasses.replace(params, seed=int.from_bytes(os.urandom(6), "little"))
        handle = RequestHandle(rid, self, params.n)
        group: list[_Request] = []
        for i in range(params.n):  # upstream returns n outputs of one request (the best of best_of)
            t = _Request.create(rid, len(prompt_token_ids), params, self.tokenizer, handle, on_output)
            t.index, t.prompt, t.group = i, list(prompt_token_ids), group
            if i:  # upstream's prompt logprobs, read once (by the first), are every output's
                t.prompt_logprobs = group[0].prompt_logprobs
            group.append(t)
        req = group[0]
        try:
            self._loop.call_soon_threadsafe(self._start, req)
        except RuntimeError:  # the loop closed since the check above
            self._ids.release(rid)
            raise RuntimeError("executor is shut down") from None
        return handle

    def cancel(self, request_id: str, handle: RequestHandle | None = None) -> None:
        """Finish the request as "cancelled" and abort it in TensorRT-LLM; unknown ids are ignored, and with
        `handle` a request that is not the handle's (a later one reusing the id)."""
        try:
            self._loop.call_soon_threadsafe(self._cancel_now, request_id, handle)
        except RuntimeError:  # shut down: nothing is in flight
            pass

    def stats(self) -> ExecutorStats:
        reqs = list(self._requests.values())
        c = self._counts
        return ExecutorStats(
            running=sum(1 for r in reqs if r.upstream is not None), queued=sum(1 for r in reqs if r.upstream is None),
            kv_blocks_used=0, kv_blocks_free=0, requests_finished=c["finished"], generated_tokens=c["generated"],
            draft_tokens=c["drafted"], accepted_draft_tokens=c["accepted"], current_draft_len=self.num_draft_tokens,
            acceptance_estimate=c["accepted"] / c["drafted"] if c["drafted"] else 0.0)

    def shutdown(self) -> None:
        """Cancel what is in flight (finish reason "cancelled"), shut TensorRT-LLM down, stop the loop."""
        if self._closed:
            return
        self._stopping = True
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown_on_loop(), self._loop).result(timeout=30)
        except Exception:
            log.exception("cancelling requests at shutdown failed")
        self._closed = True
        try:  # while our loop still runs: TensorRT-LLM may still hand results to it while stopping
            self.llm.shutdown()
        except Exception:
            log.exception("tensorrt_llm.LLM.shutdown failed")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> "TrtllmExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- on the loop thread -------------------------------------------------------------------
    def _start(self, req: _Request) -> None:
        if self._stopping:
            self._finish_all(req, "cancelled")
            return
        self._requests[req.request_id] = req
        task = self._loop.create_task(self._stream(req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stream(self, req: _Request) -> None:
        if req.done:  # cancelled before it started
            return
        try:
            kwargs = adapt_to_upstream_fields(to_trtllm_sampling_kwargs(req.params, self.tokenizer),
                                              self._trtllm.SamplingParams)
            sampling_params = upstream_sampling_params(self._trtllm, kwargs)
            req.upstream = self.llm.generate_async({"prompt_token_ids": req.prompt},
                                                   sampling_params=sampling_params, streaming=True)
        except Exception as e:
            log.exception("submitting %s to TensorRT-LLM failed", req.request_id)
            self._finish_all(req, "error", error=f"{type(e).__name__}: {e}")
            return
        try:
            async for out in req.upstream:
                if req.done:
                    break  # cancelled here, or finished by our own stop rules; abort already sent
                self._on_response(req, out)
                if req.done:
                    break
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not req.done:
                log.exception("TensorRT-LLM request %s failed", req.request_id)
                self._finish_all(req, "error", error=f"{type(e).__name__}: {e}")
            return
        if not req.done:
            self._finish_all(req, "error", error="TensorRT-LLM's stream ended without a finished output")

    def _on_response(self, req: _Request, out: Any) -> None:
        """One upstream response: the request's statistics, then each output's new tokens (output i is upstream's
        outputs[i]; with best_of > n only the final response's, once upstream has chosen the n best)."""
        now = time.perf_counter()
        req.upstream_done = bool(out.finished)
        steps = getattr(out, "decoding_iter", None)
        if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0:
            req.num_steps = steps
        elif any(len(c.token_ids or []) > t.seen for t, c in zip(req.group, out.outputs)):
            req.num_steps += 1
        blocks = kv_cache_counts(out)
        if blocks is not None:
            req.num_reused_blocks, req.num_missed_blocks = blocks
        counts = speculative_counts(out)
        if counts is not None:
            drafted, accepted = counts
            self._counts["drafted"] += max(drafted - req.num_draft_tokens, 0)
            self._counts["accepted"] += max(accepted - req.num_accepted_draft_tokens, 0)
            req.num_draft_tokens, req.num_accepted_draft_tokens = drafted, accepted
            self.reports_draft_stats = True
        if out.finished or req.params.num_sequences == req.params.n:
            for t, completion in zip(req.group, out.outputs):
                if t is not req:  # the request's statistics are every output's
                    t.num_steps, t.num_draft_tokens, t.num_accepted_draft_tokens = \
                        req.num_steps, req.num_draft_tokens, req.num_accepted_draft_tokens
                    t.num_reused_blocks, t.num_missed_blocks = req.num_reused_blocks, req.num_missed_blocks
                if not t.finished:
                    self._on_output(t, completion, now, bool(out.finished))
        if req.done and not req.upstream_done:
            self._abort_upstream(req)

    def _on_output(self, req: _Request, completion: Any, now: float, finished: bool) -> None:
        """One output's new tokens, through the shared stop rules."""
        ids = completion.token_ids or []
        new = list(ids[req.seen:])
        logprobs = self._new_logprobs(req, completion, new)
        req.seen = max(req.seen, len(ids))
        if new or finished:
            upstream_reason = _UPSTREAM_REASONS.get(completion.finish_reason, "error") if finished else None
            if finished and completion.finish_reason not in _UPSTREAM_REASONS:
                log.error("request %s: unknown TensorRT-LLM finish reason %r", req.request_id, completion.finish_reason)
            self._process(req, new, now, upstream_reason, logprobs)

    @staticmethod
    def _new_logprobs(req: _Request, completion: Any, new: list[int]) -> list[TokenLogprob] | None:
        """The logprobs of the newly streamed ids (None unless asked for); the prompt's, once, into `req`.
        Upstream's prompt logprobs are taken as those of prompt tokens 1.. (the last len(prompt) - 1)."""
        params = req.params
        if params.prompt_logprobs is not None and req.prompt_logprobs == [None] and len(req.prompt) > 1:
            entries = (getattr(completion, "prompt_logprobs", None) or [])[1 - len(req.prompt):]
            if entries:
                req.prompt_logprobs += logprobs_from_upstream(entries, req.prompt[1:], params.prompt_logprobs)
        if params.logprobs is None or not new:
            return None
        entries = (getattr(completion, "logprobs", None) or [])[req.seen : req.seen + len(new)]
        if len(entries) < len(new):
            raise RuntimeError(f"TensorRT-LLM returned {len(entries)} logprobs for {len(new)} new tokens")
        return logprobs_from_upstream(entries, new, params.logprobs)

    def _process(self, req: _Request, new: list[int], now: float, upstream_reason: str | None,
                 logprobs: list[TokenLogprob] | None = None) -> None:
        """The shared stop rules over the newly streamed ids (TensorRT-LLM's own finish reason is
        used when none of ours fires), then report the delta."""
        new, delta, reason = req.consume(new, now, logprobs)
        self._counts["generated"] += len(new)
        reason = reason or upstream_reason
        if reason is not None:
            self._finish(req, reason, new, delta)
        else:
            req.report(new, delta, None)

    def _finish(self, req: _Request, reason: str, new: list[int] | None = None, delta: str = "",
                error: str | None = None) -> None:
        """End one output; the request's id is free once its last output has ended."""
        if req.finished:
            return
        req.finished = True
        if req.done:
            self._requests.pop(req.request_id, None)
            self._ids.release(req.request_id)
            self._counts["finished"] += 1
        first = req.group[0]
        if first.upstream_done and self.reports_draft_stats is None and speculative_counts(first.upstream) is None:
            self.reports_draft_stats = False
            log.warning("TensorRT-LLM reported no speculative-decoding metrics (request_perf_metrics); "
                        "draft and accepted token counts are reported as 0")
        if error:
            log.error("request %s failed: %s", req.request_id, error)
        req.report(new or [], delta, reason, error)

    def _finish_all(self, req: _Request, reason: str, error: str | None = None) -> None:
        for t in req.group:
            self._finish(t, reason, error=error)

    def _cancel_now(self, request_id: str, handle: RequestHandle | None = None) -> None:
        req = self._requests.get(request_id)
        if req is None or req.done or (handle is not None and req.handle is not handle):
            return
        self._finish_all(req, "cancelled")
        if req.upstream is not None and not req.upstream_done:
            self._abort_upstream(req)

    @staticmethod
    def _abort_upstream(req: _Request) -> None:
        try:
            req.upstream.abort()  # tensorrt_llm/executor/result.py: GenerationResult.abort()
        except Exception:
            log.exception("aborting %s in TensorRT-LLM failed", req.request_id)

    async def _shutdown_on_loop(self) -> None:
        for req in list(self._requests.values()):
            self._cancel_now(req.request_id)
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
