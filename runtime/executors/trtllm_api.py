"""TensorRT-LLM's LLM API in our terms, for the executor of `build_engine --backend trtllm` engines
(runtime.executors.trtllm): our SamplingParams as its SamplingParams' keyword arguments, an engine's
`extra_llm_api_options.yaml` and an ExecutorConfig as `LLM()` keyword arguments, and its results' logprobs and
counters as ours. Each name is checked against upstream's sources; fields a release lacks are adapted or left out
where that changes nothing (`adapt_to_upstream_fields`, `adapt_llm_kwargs`).

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

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any, Mapping

import torch
import yaml

from runtime.core.sampling import TokenLogprob
from runtime.core.sampling_params import GuidedDecodingParams, SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.io.engine_format import DRAFT_LEN_NAMES, LLM_API_OPTIONS, EngineError, EngineManifest, with_draft_len
from runtime.io.yaml_file import read_yaml, shown
from runtime.model.config import is_int

log = logging.getLogger("runtime.executors.trtllm_api")

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
    - `logit_bias` as `embedding_bias`, here a dict {token id: bias}: `upstream_sampling_params` makes it the float32
      tensor [vocab] upstream takes (trtllm-serve's `_logit_bias_to_embedding_bias`, serve/openai_protocol.py).
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
    if params.logit_bias:
        kwargs["embedding_bias"] = {int(t): float(v) for t, v in params.logit_bias.items()}
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


def upstream_sampling_params(trtllm: Any, kwargs: dict[str, Any], vocab_size: int) -> Any:
    """`tensorrt_llm.SamplingParams(**kwargs)`, a guided_decoding dict made upstream's GuidedDecodingParams and an
    embedding_bias dict its float32 tensor [vocab_size]."""
    if "guided_decoding" in kwargs:
        kwargs = {**kwargs, "guided_decoding": trtllm.llmapi.GuidedDecodingParams(**kwargs["guided_decoding"])}
    if "embedding_bias" in kwargs:
        bias = torch.zeros(vocab_size, dtype=torch.float32)
        bias[list(kwargs["embedding_bias"])] = torch.tensor(list(kwargs["embedding_bias"].values()))
        kwargs = {**kwargs, "embedding_bias": bias}
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
    refuse_unsafe_options(options, str(options_file))
    return options


def refuse_unsafe_options(options: Mapping[str, Any], source: str) -> None:
    """EngineError for LLM-API options that would run code or serve other weights than the engine's, wherever they
    come from (the engine's file, an llmapi model.yaml)."""
    if options.get("trust_remote_code"):
        raise EngineError(f"{source}: trust_remote_code must be false or absent: DeepSeek-V3 needs no code from "
                          "its checkpoint, and an engine directory must not run any")
    if options.get("load_format", "auto") != "auto":
        raise EngineError(f"{source}: load_format {options['load_format']!r}: only auto (the engine's checkpoint; "
                          "dummy would serve random weights)")


def chosen_options(own: Mapping[str, Any], config: ExecutorConfig | None) -> Mapping[str, Any]:
    """The LLM-API options an executor runs an engine with: config.llm_api_options (an llmapi model.yaml's) where
    given, else the engine's own."""
    return own if config is None or config.llm_api_options is None else config.llm_api_options


def llm_kwargs_for(options: Mapping[str, Any], manifest: EngineManifest, config: ExecutorConfig | None = None,
                   overrides: Mapping[str, Any] | None = None, source: str = LLM_API_OPTIONS) -> dict[str, Any]:
    """The `LLM(...)` keyword arguments: the engine's LLM-API options (the YAML), with the serving
    settings of `config` applied (None: as built) and then `overrides` merged in (dicts deeply); the draft length
    under both of its names at one value, whichever set it (`_with_overrides`).

    From ExecutorConfig: num_draft_tokens / speculation -> speculative_config (0 or "off" removes
    it; otherwise the draft length k (`with_draft_len`), at most the built max_draft_len; "adaptive" runs
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
    refuse_unsafe_options(options, source)
    kwargs = copy.deepcopy(dict(options))
    build, cfg = manifest.build, manifest.model_config
    if config is not None:
        if config.max_queued_requests is not None:
            raise ValueError(f"max_queued_requests {config.max_queued_requests}: not available with a --backend "
                             "trtllm engine (TensorRT-LLM's LLM API takes no queue bound); leave it unset")
        limits = config.limits_for(build, cfg, source)
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
            spec = with_draft_len(spec, k)
            if config.speculation == "adaptive":
                log.warning("speculation 'adaptive' is not available with TensorRT-LLM; drafting a fixed %d", k)
            relaxed = config.relaxed_acceptance
            if relaxed is not None:
                relaxed.check_tokens(cfg.vocab_size)
                spec.update(use_relaxed_acceptance_for_thinking=True, relaxed_topk=relaxed.top_n,
                            relaxed_delta=relaxed.delta, begin_thinking_phase_token=relaxed.begin_thinking_token,
                            end_thinking_phase_token=relaxed.end_thinking_token)
            kwargs["speculative_config"] = spec
    return _with_overrides(kwargs, overrides or {}, source)


def _with_overrides(kwargs: dict[str, Any], overrides: Mapping[str, Any], source: str) -> dict[str, Any]:
    """`kwargs` with `overrides` merged in and the draft length under both names (`with_draft_len`), whichever gave it:
    an override naming it replaces both (its other name in `kwargs` would conflict), and its bad value is refused
    naming llm_overrides."""
    given = overrides.get("speculative_config")
    if given is not None and not isinstance(given, Mapping):
        raise ValueError(f"llm_overrides: speculative_config must be a mapping, got {type(given).__name__}")
    renamed = given is not None and any(name in given for name in DRAFT_LEN_NAMES)
    if renamed and isinstance(kwargs.get("speculative_config"), dict):
        kwargs["speculative_config"] = {k: v for k, v in kwargs["speculative_config"].items()
                                        if k not in DRAFT_LEN_NAMES}
    kwargs = _deep_merge(kwargs, overrides)
    spec = kwargs.get("speculative_config")
    if spec is not None:
        kwargs["speculative_config"] = with_draft_len(spec, draft_len_of(spec, "llm_overrides" if renamed else source))
    return kwargs


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


def model_fields(cls: Any) -> set[str] | None:
    """Field names of a pydantic config class of tensorrt_llm.llmapi, None when there is none."""
    fields = getattr(cls, "model_fields", None)
    return set(fields) if isinstance(fields, Mapping) else None


def draft_len_of(spec: Mapping[str, Any] | None, source: str) -> int:
    """The MTP draft length a speculative_config asks for: `max_draft_len` (upstream's name since 2026) or its older
    name `num_nextn_predict_layers` (every release reads it), one value where both are given; upstream's default 1
    where neither is, and 0 without a speculative_config. ValueError naming `source` and the key otherwise."""
    if spec is None:
        return 0
    given = {name: spec[name] for name in DRAFT_LEN_NAMES if spec.get(name) is not None}
    for name, value in given.items():
        if not is_int(value) or value < 0:
            raise ValueError(f"{source}: speculative_config.{name} must be an integer >= 0, got {shown(value)}")
    if len(set(given.values())) > 1:
        raise ValueError(f"{source}: speculative_config: max_draft_len {given['max_draft_len']} and "
                         f"num_nextn_predict_layers {given['num_nextn_predict_layers']} differ "
                         "(num_nextn_predict_layers is the older name of max_draft_len); give one")
    return next(iter(given.values()), 1)


def _perf_metrics(result: Any) -> Any:
    """The request's `request_perf_metrics`, or None: upstream keeps them on the first CompletionOutput
    (tensorrt_llm/executor/result.py), and has none before 1.0 or without return_perf_metrics."""
    outputs = getattr(result, "outputs", None) or []
    return getattr(outputs[0], "request_perf_metrics", None) if outputs else None


def speculative_counts(result: Any) -> tuple[int, int] | None:
    """(total_draft_tokens, total_accepted_draft_tokens) TensorRT-LLM reports for a request so far,
    or None where it reports none (no `request_perf_metrics`, no `speculative_decoding` in them, or that
    section left at zero: the PyTorch backend's TorchSampler never fills it in the 1.x releases)."""
    spec = getattr(_perf_metrics(result), "speculative_decoding", None)
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
    kv = getattr(_perf_metrics(result), "kv_cache_metrics", None)
    try:
        return int(kv.num_reused_blocks), int(kv.num_missed_blocks)
    except (AttributeError, TypeError, ValueError):
        return None
