"""Write a DeepSeek-V3 checkpoint in the released Hugging Face layout, streamed.

Tensors are written in the order they arrive and a shard is flushed as soon as the next tensor
would not fit, so at most one shard's tensors are held. The directory appears only when complete:
everything is written into a temporary sibling that is renamed at the end.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from runtime.io.atomic import atomic_dir, check_output_dir
from runtime.io.checkpoint import INDEX_NAME, SCALE_SUFFIX, is_fp8_quantized
from runtime.io.tokenizer import TOKENIZER_FILES
from runtime.model.config import ModelConfig, QuantizationConfig
from runtime.model.fp8 import FP8_DTYPE, quantize_block_fp8


def write_hf_checkpoint(
    out_dir: str | Path,
    config: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    fp8: bool = True,
    max_shard_bytes: int = 5 * 2**30,
    tokenizer_dir: Path | None = None,
    force: bool = False,
) -> Path:
    """Write config.json, `model-0000i-of-0000N.safetensors` shards and their index; return out_dir.

    With fp8, the Linear weights of `is_fp8_quantized` become float8_e4m3fn plus a float32
    `<name>_scale_inv` per 128x128 block; already-quantized pairs (from
    `HFCheckpoint.iter_tensors(dequantize=False)`) pass through unchanged. Other tensors take the
    release dtypes: float32 for `e_score_correction_bias`, bfloat16 for everything else.
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir, force)
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    if tokenizer_dir is not None and not (Path(tokenizer_dir) / "tokenizer.json").is_file():  # before the work
        raise FileNotFoundError(f"{Path(tokenizer_dir) / 'tokenizer.json'}: not found, expected the tokenizer to copy")
    if fp8 and config.quantization_config is None:
        config = dataclasses.replace(config, quantization_config=QuantizationConfig())
    elif not fp8:
        config = dataclasses.replace(config, quantization_config=None)

    with atomic_dir(out_dir, force) as tmp:
        (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        shards: list[list[str]] = []  # tensor names per shard, in order
        shard: dict[str, torch.Tensor] = {}
        shard_bytes = total_size = 0

        def flush() -> None:
            nonlocal shard_bytes
            path = tmp / f"model-{len(shards) + 1:05d}.safetensors"
            save_file(shard, path, metadata={"format": "pt"})
            shutil.copymode(tmp / "config.json", path)  # safetensors writes 0600; the checkpoint's files share a mode
            shards.append(list(shard))
            shard.clear()
            shard_bytes = 0

        seen: set[str] = set()
        for name, tensor in tqdm(tensors, desc=f"writing {out_dir.name}", unit="tensor"):
            for out_name, t in _release_tensors(name, tensor, fp8):
                if out_name in seen:
                    raise ValueError(f"{out_dir}: tensor {out_name!r} given twice, expected each name once")
                seen.add(out_name)
                nbytes = t.numel() * t.element_size()
                if shard and shard_bytes + nbytes > max_shard_bytes:
                    flush()
                shard[out_name] = t
                shard_bytes += nbytes
                total_size += nbytes
        if shard:
            flush()

        weight_map: dict[str, str] = {}
        for i, names in enumerate(shards, start=1):
            final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            (tmp / f"model-{i:05d}.safetensors").rename(tmp / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

        if tokenizer_dir is not None:
            tokenizer_dir = Path(tokenizer_dir)
            for fname in TOKENIZER_FILES:
                if (tokenizer_dir / fname).is_file():
                    shutil.copy2(tokenizer_dir / fname, tmp / fname)

    return out_dir


def _release_tensors(name: str, t: torch.Tensor, fp8: bool) -> list[tuple[str, torch.Tensor]]:
    """The stored tensor(s) for one logical tensor: FP8 ones in 128x128 blocks, the one size config.py accepts."""
    t = t.detach()
    if t.dtype == FP8_DTYPE or name.endswith(SCALE_SUFFIX):
        if not fp8:
            raise ValueError(f"tensor {name!r} is already FP8-quantized, expected dequantized tensors when fp8=False")
        return [(name, t.contiguous())]
    if fp8 and is_fp8_quantized(name):
        q, scale = quantize_block_fp8(t)
        return [(name, q), (name + SCALE_SUFFIX, scale)]
    dtype = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
    # copy: the caller may reuse its buffer, and safetensors refuses tensors sharing storage
    return [(name, t.to(dtype, copy=True).contiguous())]
