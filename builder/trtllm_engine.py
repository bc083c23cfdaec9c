"""--backend trtllm: an engine directory for TensorRT-LLM's PyTorch backend.

TensorRT-LLM runs DeepSeek-V3 and its MTP layer only in the PyTorch backend, which loads the
Hugging Face layout itself (FP8 blocks as released, `weight_scale_inv` names, the MTP layer at
index num_hidden_layers). So this build validates, links the released files into `hf/` and
writes the LLM-API options (`extra_llm_api_options.yaml`) for
`trtllm-serve <engine>/hf --backend pytorch --extra_llm_api_options <engine>/extra_llm_api_options.yaml`.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

from builder.validation import BuildError, copy_tokenizer, open_hf_checkpoint, quant_algo_flag, validate_build
from builder.native_engine import BUILDER_VERSION
from runtime.io.atomic import new_output_dir
from runtime.io.checkpoint import FP8_CODE, INDEX_NAME, HFCheckpoint
from runtime.io.engine_format import (FREE_MEMORY_FRACTION, HF_DIR, LLM_API_OPTIONS, RELAXED_DELTA, RELAXED_TOP_N,
                                     BuildConfig, EngineManifest, released_quant_algo, with_draft_len)


@dataclass(frozen=True)
class TrtllmOptions:
    """LLM-API options with no meaning for the native runtime; each is one build_engine flag."""

    enable_attention_dp: bool = False
    kv_cache_dtype: str = "auto"  # or "fp8"
    free_gpu_memory_fraction: float = FREE_MEMORY_FRACTION
    enable_block_reuse: bool = True
    cuda_graph_padding: bool = True
    use_mtp_vanilla: bool = False
    use_relaxed_acceptance_for_thinking: bool = False
    relaxed_topk: int = RELAXED_TOP_N
    relaxed_delta: float = RELAXED_DELTA
    guided_decoding_backend: str | None = None  # "xgrammar" | "llguidance": structured output (None: off)


def llm_api_options(build: BuildConfig, options: TrtllmOptions) -> dict[str, Any]:
    """The `LLM(...)` arguments, as trtllm-serve's --extra_llm_api_options YAML takes them."""
    out: dict[str, Any] = {
        "dtype": build.dtype,
        "tensor_parallel_size": build.tp_size,
        "moe_expert_parallel_size": build.ep_size,
        "enable_attention_dp": options.enable_attention_dp,
        "max_batch_size": build.max_batch_size,
        "max_num_tokens": build.max_num_tokens,
        "max_seq_len": build.max_seq_len,
        "kv_cache_config": {
            "dtype": options.kv_cache_dtype,
            "free_gpu_memory_fraction": options.free_gpu_memory_fraction,
            "enable_block_reuse": options.enable_block_reuse,
            "tokens_per_block": build.kv_block_size,
        },
        "cuda_graph_config": {"enable_padding": options.cuda_graph_padding, "max_batch_size": build.max_batch_size},
    }
    if build.max_draft_len:
        spec = with_draft_len({"decoding_type": "MTP"}, build.max_draft_len)
        if options.use_mtp_vanilla:
            spec["use_mtp_vanilla"] = True
        if options.use_relaxed_acceptance_for_thinking:
            spec |= {"use_relaxed_acceptance_for_thinking": True, "relaxed_topk": options.relaxed_topk,
                     "relaxed_delta": options.relaxed_delta}
        out["speculative_config"] = spec
    if options.guided_decoding_backend is not None:
        out["guided_decoding_backend"] = options.guided_decoding_backend
    return out


def build_trtllm_engine(model: str | Path | HFCheckpoint, output_dir: str | Path, build: BuildConfig,
                        options: TrtllmOptions = TrtllmOptions(), *, tokenizer_dir: str | Path | None = None,
                        force: bool = False, progress: bool = True) -> Path:
    """Write a --backend trtllm engine directory for the HF checkpoint `model` (its directory, or it opened); return
    output_dir."""
    ckpt, cfg = open_hf_checkpoint(model, build)
    model_dir = ckpt.path
    source = str(model_dir / "config.json")
    if ckpt.quantized and not ckpt.stored_fp8:  # TensorRT-LLM reads config.json's quantization_config
        raise BuildError(f"{source}: field 'quantization_config' declares FP8 weights but the files store none; remove "
                         "it from config.json (TensorRT-LLM would load the weights as FP8)")
    released = released_quant_algo(ckpt.stored_fp8)
    if build.quant_algo != released:
        raise BuildError(
            f"--quant_algo {quant_algo_flag(build.quant_algo)} with --backend trtllm: TensorRT-LLM loads the weights "
            f"as released, which are {quant_algo_flag(released)} ({source}); leave --quant_algo out"
        )
    fp8 = next((n for n in ckpt.tensor_names if ckpt.tensor_info(n).dtype == FP8_CODE), None)
    if fp8 is not None and not ckpt.quantized:  # TensorRT-LLM would read the FP8 codes as plain values
        raise BuildError(f"{source}: no 'quantization_config', but tensor {fp8!r} ({model_dir / ckpt.weight_map[fp8]}) "
                         "is float8_e4m3fn; add the release's quantization_config (fp8, e4m3, 128x128 blocks)")
    validate_build(cfg, build, source, use_mtp_vanilla=options.use_mtp_vanilla)
    with new_output_dir(Path(output_dir), force) as tmp:
        hf = tmp / HF_DIR
        hf.mkdir()
        shards = sorted(f.relative_to(ckpt.path).as_posix() for f in ckpt.shard_files)  # "sub/model-..." kept
        released_files = shards + [n for n in ("config.json", INDEX_NAME) if (model_dir / n).is_file()]
        for name in tqdm(released_files, desc="link", unit="file", disable=not progress):
            _link_or_copy(model_dir / name, hf / name)
        tokenizer = copy_tokenizer(Path(tokenizer_dir) if tokenizer_dir is not None else model_dir, hf)
        (tmp / LLM_API_OPTIONS).write_text(yaml.safe_dump(llm_api_options(build, options), sort_keys=False))
        files = [f"{HF_DIR}/{n}" for n in released_files + tokenizer] + [LLM_API_OPTIONS]
        EngineManifest.create(tmp, cfg, build, [f"{HF_DIR}/{s}" for s in shards], files, BUILDER_VERSION).write(tmp)
    return Path(output_dir)


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard link (no copy of hundreds of GB; shares the bytes with the source) or copy across devices.

    The link is to the file a symlink names: a hub cache's snapshot files are relative symlinks
    (../../blobs/<sha>), and os.link on Linux links the symlink itself, which points nowhere from dst."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    src = Path(os.path.realpath(src))
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
