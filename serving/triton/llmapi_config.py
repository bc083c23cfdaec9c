"""The `llmapi` Triton model's `1/model.yaml`: TensorRT-LLM's `LLM(...)` keyword arguments plus `triton_config`,
read into this runtime's settings, and written by `make_model_repo --flavour llmapi`.

The file is the one upstream's own llmapi model (triton_backend/all_models/llmapi/tensorrt_llm in NVIDIA/TensorRT-LLM)
reads: LLM-API keys at the top level, Triton's under `triton_config` (upstream reads `max_batch_size`, `decoupled` and
`cancellation_check_period_ms` there and ignores the rest, so this runtime's own settings live there too). Every
key is read or refused: a key that changes what is generated and that this runtime does not implement is an error
naming it; a key that only changes how the work is done (parallelism, CUDA graphs, scheduling, how drafts are made:
speculation never changes the output here) is named in a warning and not applied where it has no counterpart.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from runtime.core.sampling_params import RelaxedAcceptance
from runtime.executors.base import ExecutorConfig
from runtime.model.config import is_int
from runtime.executors.trtllm_api import draft_len_of, read_llm_api_options
from runtime.io.engine_format import HF_DIR, LLM_API_OPTIONS, MIN_SEQ_LEN, engine_backend, read_limits, with_draft_len
from runtime.io.yaml_file import read_yaml, shown
from serving.triton.parameters import (QUEUE_SIZE, TritonConfig, launcher_world_size, named_as_deployed, queue_bound,
                                       settings)

MODEL_YAML = "model.yaml"
# model.yaml's keys for the executor settings whose names differ (its refusals, at reading and at loading, say these)
SETTING_NAMES = {"kv_cache_tokens": "kv_cache_config.max_tokens",
                 "free_memory_fraction": "kv_cache_config.free_gpu_memory_fraction",
                 "enable_block_reuse": "kv_cache_config.enable_block_reuse",
                 "max_queued_requests": f"triton_config.{QUEUE_SIZE}",
                 "num_draft_tokens": "speculative_config.max_draft_len",
                 "device": "triton_config.device", "speculation": "triton_config.speculation"}
SPECULATION_WARNED = ("use_mtp_vanilla", "mtp_eagle_one_model", "max_concurrency", "draft_len_schedule",
                      "acceptance_rate_window_size", "acceptance_rate_threshold", "use_rejection_sampling",
                      "max_total_draft_tokens")
RELAXED_FIELDS = {"relaxed_topk": "top_n", "relaxed_delta": "delta", "begin_thinking_phase_token": "begin_thinking_token",
                  "end_thinking_phase_token": "end_thinking_token"}  # upstream's name -> RelaxedAcceptance's
RELAXED = ("use_relaxed_acceptance_for_thinking", *RELAXED_FIELDS)
KV_CACHE_WARNED = ("tokens_per_block", "host_cache_size", "onboard_blocks",
                   "event_buffer_max_size", "enable_partial_reuse", "copy_on_partial_reuse", "use_uvm",
                   "cross_kv_cache_fraction")
# LLM-API keys that change how the work is done, not what is generated
WARNED = ("tensor_parallel_size", "pipeline_parallel_size", "moe_expert_parallel_size", "moe_tensor_parallel_size",
          "context_parallel_size", "gpus_per_node", "enable_attention_dp", "enable_chunked_prefill",
          "disable_overlap_scheduler", "print_iter_log", "enable_iter_perf_stats", "enable_iter_req_stats",
          "trust_remote_code", "moe_config", "attn_backend", "scheduler_config", "stream_interval",
          "num_postprocess_workers", "postprocess_tokenizer_dir", "return_perf_metrics", "perf_metrics_max_requests",
          "enable_layerwise_nvtx_marker", "garbage_collection_gen0_threshold", "pytorch_backend_config",
          "load_format", "checkpoint_format", "batch_wait_timeout_ms", "enable_autotuner")
TRITON_KEYS = (*(f.name for f in fields(TritonConfig)), "speculation", "device", QUEUE_SIZE)


class ModelYamlError(ValueError):
    """A model.yaml this runtime cannot serve as written; the message names the file and the key."""


@dataclass(frozen=True)
class LlmApiModel:
    model: Path
    executor: ExecutorConfig
    triton: TritonConfig
    warnings: list[str] = field(default_factory=list)


def _int(value: Any, key: str, source: str, low: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ModelYamlError(f"{source}: {key} must be an integer >= {low}, got {shown(value)}")
    return value


def _number(value: Any, key: str, source: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ModelYamlError(f"{source}: {key} must be a number, got {shown(value)}")
    return float(value)


def _bool(value: Any, key: str, source: str) -> bool:
    if not isinstance(value, bool):
        raise ModelYamlError(f"{source}: {key} must be true or false, got {shown(value)}")
    return value


def _mapping(value: Any, key: str, source: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ModelYamlError(f"{source}: {key} must be a mapping, got {shown(value)}")
    return value


def read_model_yaml(path: Path, model_dir: Path) -> LlmApiModel:
    """model.yaml at `path` -> what to serve and how (with the launcher's --world_size); `model` relative to
    `model_dir` (the Triton model's directory, where make_model_repo links the engine). Refusals raise ModelYamlError
    naming the key."""
    source = str(path)
    try:
        doc = read_yaml(path)
    except (OSError, ValueError, yaml.YAMLError) as e:  # ValueError: an integer of more digits than Python converts
        raise ModelYamlError(f"{source}: cannot read it: {e}") from None
    doc = dict(_mapping(doc, "the file", source))
    written = dict(doc)
    warnings: list[str] = []
    if "model" not in doc:
        raise ModelYamlError(f"{source}: model (the engine directory or Hugging Face checkpoint) is not set")
    given = doc.pop("model")
    if not isinstance(given, str) or not given:
        raise ModelYamlError(f"{source}: model must be the engine directory or Hugging Face checkpoint (a path), got "
                             f"{shown(given)}")
    model = model_dir / given
    if model.name == HF_DIR and engine_backend(model.parent) == "trtllm":
        model = model.parent  # upstream's LLM loads the engine's checkpoint directory, this runtime the engine
    _, build = read_limits(model)
    engine_options = _engine_options(model)
    tokenizer = doc.pop("tokenizer", None)
    if tokenizer is not None and (model_dir / str(tokenizer)).resolve() != model.resolve():
        raise ModelYamlError(f"{source}: tokenizer {shown(tokenizer)}: this runtime uses the model's own tokenizer; "
                             "leave tokenizer out")
    backend = doc.pop("backend", None)
    if backend not in (None, "pytorch"):
        raise ModelYamlError(f"{source}: backend {shown(backend)}: supported: pytorch (TensorRT-LLM's; this runtime runs "
                             "a native engine natively and a --backend trtllm engine on TensorRT-LLM's PyTorch backend)")
    dtype = doc.pop("dtype", None)
    if dtype not in (None, "auto", build.dtype):
        raise ModelYamlError(f"{source}: dtype {shown(dtype)}: the engine's is {build.dtype!r}; rebuild it with --dtype "
                             f"or set dtype auto")
    max_beam_width = doc.pop("max_beam_width", 1)
    if max_beam_width != 1 or isinstance(max_beam_width, bool):  # true == 1 in Python
        raise ModelYamlError(f"{source}: max_beam_width {shown(max_beam_width)}: supported: 1 (no beam search)")
    limits = {k: _int(doc.pop(k), k, source, low=MIN_SEQ_LEN if k == "max_seq_len" else 1)  # ExecutorConfig's bounds
              for k in ("max_batch_size", "max_seq_len", "max_num_tokens") if k in doc}

    # a --backend trtllm engine runs on TensorRT-LLM with the file's LLM-API keys as written (as upstream's llmapi
    # model passes them to LLM()): what the native runtime does not apply, TensorRT-LLM does
    llm_api_options = None if not engine_options else {  # LLM() is given its model and backend apart
        key: value for key, value in written.items() if key not in ("model", "tokenizer", "backend", "triton_config")}
    unapplied: list[str] = []  # keys the native runtime does not apply, named in a warning
    draft_len, relaxed = _speculative(doc.pop("speculative_config", None), source, warnings, unapplied)
    kv = _kv_cache(doc.pop("kv_cache_config", None), engine_options, source, unapplied)
    cuda_graphs = _cuda_graphs(doc.pop("cuda_graph_config", {}), source, unapplied)
    triton_config = doc.pop("triton_config", None)
    triton = {} if triton_config is None else _mapping(triton_config, "triton_config", source)
    if triton.get("speculation") is False:
        raise ModelYamlError(f"{source}: triton_config.speculation is false: YAML reads an unquoted off as false; "
                             "write speculation: 'off'")
    unknown = sorted(map(str, set(triton) - set(TRITON_KEYS)))
    if unknown:
        raise ModelYamlError(f"{source}: triton_config: unknown key(s) {', '.join(unknown)} (supported: "
                             f"{', '.join(TRITON_KEYS)})")

    for key in [k for k in WARNED if k in doc]:
        value = doc.pop(key)
        if key in ("tensor_parallel_size", "moe_expert_parallel_size"):
            value = _int(value, key, source)
            built = build.tp_size if key == "tensor_parallel_size" else build.ep_size
            if value != built:
                unapplied.append(f"{key} {value}: not applied (the engine was built for {built}; build_engine "
                                f"--{'tp_size' if key == 'tensor_parallel_size' else 'ep_size'} sets it)")
        else:
            unapplied.append(f"{key}: not applied (it changes how the work is done, not what is generated)")
    if doc:
        raise ModelYamlError(f"{source}: unknown key(s) {', '.join(sorted(map(str, doc)))}: not implemented by this "
                             "runtime (see serving/triton/llmapi_config.py for the keys it reads)")

    device, world_size = triton.get("device"), launcher_world_size()
    try:
        queued = None if triton.get(QUEUE_SIZE) is None else queue_bound(triton[QUEUE_SIZE])
    except ValueError as e:
        raise ModelYamlError(f"{source}: triton_config.{QUEUE_SIZE} {e}") from None
    try:
        executor = settings(
            ExecutorConfig, num_draft_tokens=draft_len,
            speculation=triton.get("speculation"),
            max_batch_size=limits.get("max_batch_size"), max_seq_len=limits.get("max_seq_len"),
            max_num_tokens=limits.get("max_num_tokens"), kv_cache_tokens=kv.get("max_tokens"),
            free_memory_fraction=kv.get("free_gpu_memory_fraction"), device=None if device is None else str(device),
            relaxed_acceptance=relaxed, cuda_graphs=cuda_graphs, enable_block_reuse=kv.get("enable_block_reuse"),
            max_queued_requests=queued, world_size=world_size, llm_api_options=llm_api_options)
    except ValueError as e:
        raise ModelYamlError(f"{source}: {named_as_deployed(str(e), SETTING_NAMES)}") from None
    checks = {"max_batch_size": lambda v, key, src: _int(v, key, src, low=0), "decoupled": _bool,
              "cancellation_check_period_ms": _int, "stats_check_period_ms": _int, "watchdog_timeout_s": _number,
              "torch_threads": _int, "engine_process": _bool}
    given = {key: None if triton.get(key) is None else check(triton[key], f"triton_config.{key}", source)
             for key, check in checks.items()}
    try:
        return LlmApiModel(model, executor, settings(TritonConfig, **given),
                           warnings + ([] if engine_options else unapplied))
    except ValueError as e:  # a value out of its range
        raise ModelYamlError(f"{source}: triton_config.{e}") from None


def _cuda_graphs(value: Any, source: str, unapplied: list[str]) -> bool:
    """cuda_graph_config: null turns CUDA graphs off, as the LLM API; a mapping (upstream's CudaGraphConfig, whose
    fields only choose the batch sizes captured) leaves them on, its fields named in a warning."""
    if value is None:
        return False
    config = _mapping(value, "cuda_graph_config", source)
    unknown = sorted(map(str, set(config) - {"batch_sizes", "max_batch_size", "enable_padding"}))
    if unknown:
        raise ModelYamlError(f"{source}: cuda_graph_config: unknown key(s) {', '.join(unknown)} (upstream's "
                             "CudaGraphConfig has batch_sizes, max_batch_size, enable_padding)")
    sizes = config.get("batch_sizes")
    if sizes is not None and not (isinstance(sizes, list) and all(is_int(s) and s >= 1 for s in sizes)):
        raise ModelYamlError(f"{source}: cuda_graph_config.batch_sizes must be a list of integers >= 1, got "
                             f"{shown(sizes)}")
    if "max_batch_size" in config:
        _int(config["max_batch_size"], "cuda_graph_config.max_batch_size", source, low=0)
    if "enable_padding" in config:
        _bool(config["enable_padding"], "cuda_graph_config.enable_padding", source)
    if config:
        unapplied.append(f"cuda_graph_config.{', cuda_graph_config.'.join(sorted(config))}: not applied (the "
                        "batch sizes CUDA graphs are captured for change how the work is done, not what is generated)")
    return True


def _engine_options(model: Path) -> dict[str, Any]:
    """A --backend trtllm engine's own LLM-API options ({} for a native engine or a checkpoint)."""
    return read_llm_api_options(model) if engine_backend(model) == "trtllm" else {}


def _speculative(spec: Any, source: str, warnings: list[str], unapplied: list[str]
                 ) -> tuple[int, RelaxedAcceptance | None]:
    """speculative_config -> (draft length, relaxed acceptance); no speculative_config drafts nothing (as the LLM
    API)."""
    if spec is None:
        return 0, None
    spec = dict(_mapping(spec, "speculative_config", source))
    kind = spec.pop("decoding_type", None)
    if kind != "MTP":
        raise ModelYamlError(f"{source}: speculative_config.decoding_type {shown(kind)}: supported: MTP (this runtime "
                             "drafts with the model's own MTP layer)")
    try:
        k = draft_len_of(spec, source)
    except ValueError as e:
        raise ModelYamlError(str(e)) from None
    if spec.pop("max_draft_len", None) is None and spec.get("num_nextn_predict_layers") is not None:
        warnings.append("speculative_config.num_nextn_predict_layers is deprecated upstream: write max_draft_len")
    spec.pop("num_nextn_predict_layers", None)
    relaxed = None
    values = {name: spec.pop(name) for name in RELAXED if name in spec}
    if _bool(values.pop("use_relaxed_acceptance_for_thinking", False),
             "speculative_config.use_relaxed_acceptance_for_thinking", source):
        try:
            relaxed = RelaxedAcceptance(**{RELAXED_FIELDS[name]: value for name, value in values.items()})
        except ValueError as e:
            raise ModelYamlError(f"{source}: speculative_config: {e}") from None
    for name in [n for n in SPECULATION_WARNED if n in spec]:
        spec.pop(name)
        unapplied.append(f"speculative_config.{name}: not applied (it changes how drafts are made or scheduled; "
                        "speculation never changes the output here)")
    if spec:
        raise ModelYamlError(f"{source}: speculative_config: unknown key(s) {', '.join(sorted(spec))}")
    return k, relaxed


def _kv_cache(kv: Any, engine_options: dict[str, Any], source: str, unapplied: list[str]) -> dict[str, Any]:
    """kv_cache_config -> {free_gpu_memory_fraction, max_tokens, enable_block_reuse} (as read); the cache dtype must
    be the engine's."""
    if kv is None:
        return {}
    kv = dict(_mapping(kv, "kv_cache_config", source))
    out = {}
    if "free_gpu_memory_fraction" in kv:
        out["free_gpu_memory_fraction"] = _number(kv.pop("free_gpu_memory_fraction"),
                                                  "kv_cache_config.free_gpu_memory_fraction", source)
    if "max_tokens" in kv:
        out["max_tokens"] = _int(kv.pop("max_tokens"), "kv_cache_config.max_tokens", source)
    if "enable_block_reuse" in kv:
        out["enable_block_reuse"] = _bool(kv.pop("enable_block_reuse"), "kv_cache_config.enable_block_reuse", source)
    dtype = kv.pop("dtype", None)
    built = engine_options.get("kv_cache_config", {}).get("dtype", "auto")
    if dtype not in (None, "auto", built):
        raise ModelYamlError(f"{source}: kv_cache_config.dtype {shown(dtype)}: supported: auto (the model's dtype) or the "
                             f"engine's ({built!r}; build_engine --kv_cache_dtype sets it for a --backend trtllm engine)")
    for name in [n for n in KV_CACHE_WARNED if n in kv]:
        kv.pop(name)
        unapplied.append(f"kv_cache_config.{name}: not applied (it changes how the cache is kept, not what is "
                        "generated)")
    if kv:
        raise ModelYamlError(f"{source}: kv_cache_config: unknown key(s) {', '.join(sorted(kv))}: not implemented "
                             "by this runtime")
    return out


def model_yaml(engine_dir: Path, model: str, *, decoupled: bool) -> dict[str, Any]:
    """The model.yaml make_model_repo writes for the engine at `engine_dir`, named `model` in it (the link in the model
    directory): a --backend trtllm engine's own LLM-API options with `model` its checkpoint directory (so upstream's
    llmapi model, given the same file, builds the same LLM), or the native engine's limits and MTP draft length in the
    LLM API's keys. Triton batches nothing (triton_config.max_batch_size 0): the executor batches in flight."""
    cfg, build = read_limits(engine_dir)
    options = dict(_engine_options(engine_dir))
    if options:
        model = f"{model}/{HF_DIR}"  # what upstream's LLM loads; read_model_yaml takes the engine around it
        spec = options.get("speculative_config")
        if spec is not None:
            options["speculative_config"] = with_draft_len(spec, draft_len_of(spec, str(engine_dir / LLM_API_OPTIONS)))
    else:
        options = {"backend": "pytorch", "tensor_parallel_size": build.tp_size,
                   "moe_expert_parallel_size": build.ep_size, "max_batch_size": build.max_batch_size,
                   "max_seq_len": build.max_seq_len, "max_num_tokens": build.max_num_tokens}
        k = ExecutorConfig().draft_len(build.max_draft_len, cfg.num_nextn_predict_layers, str(engine_dir))
        if k:
            options["speculative_config"] = with_draft_len({"decoding_type": "MTP"}, k)
        options["kv_cache_config"] = {"free_gpu_memory_fraction": ExecutorConfig.free_memory_fraction}
    return {"model": model, **options, "triton_config": {"max_batch_size": 0, "decoupled": decoupled}}
