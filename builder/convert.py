"""HF DeepSeek-V3 checkpoint -> TensorRT-LLM checkpoint directory, streamed tensor by tensor.

The target is what TensorRT-LLM's DeepSeek-V2 converter writes (config.json plus one
`rank{N}.safetensors` per rank, `transformer.*` names, fused `attention.fused_a` and expert `mlp.fc`),
extended with the MTP module as a draft layer under `transformer.mtp_layers.{j}.`.

Memory: a rank file's header (every name, dtype, shape and offset) follows from the config and
the build options alone, so `RankFileWriter` writes it first and then drops each tensor's bytes at
its offset as the tensor streams by. No rank's tensors are ever accumulated; the process holds
one source tensor (read into a reused buffer, no memory map) and its shards. docs/engine-format.md
has the names, the sharding rules and the measured peak memory.
"""

from __future__ import annotations

import contextlib
import json
import sys
from functools import cached_property
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from runtime.io.atomic import new_output_dir
from runtime.io.checkpoint import FP8_CODE, SCALE_SUFFIX, HFCheckpoint
from runtime.io.engine_format import BuildConfig, shard_index
from runtime.io.weights import parameter_shapes, to_internal
from runtime.model.config import ModelConfig
from runtime.model.fp8 import covering_blocks, dequantize_block_fp8, quantize_block_fp8, quantize_tensor_fp8
from builder.validation import BuildError, copy_tokenizer, open_hf_checkpoint
from builder.trtllm_layout import FLOAT32, PartLayout, TensorLayout, is_quantized, rank_layout, trtllm_config
from builder.rank_file import RankFileWriter


def convert_checkpoint(model: str | Path | HFCheckpoint, output_dir: str | Path, build: BuildConfig, *,
                       progress: bool = True) -> Path:
    """Write the TensorRT-LLM checkpoint of the HF checkpoint `model` (its directory, or it opened); return
    output_dir."""
    output_dir = Path(output_dir)
    ckpt, cfg = open_hf_checkpoint(model, build)
    layout = rank_layout(cfg, build)
    where = {p.name: (t, p) for t in layout for p in t.parts}
    shapes = parameter_shapes(cfg)
    names = [n for n in ckpt.tensor_names if not n.endswith(SCALE_SUFFIX)]
    split = blocks_split(ckpt, cfg, build, where, shapes)
    if split:
        print(f"note: tp_size {build.tp_size} cuts through the 128x128 FP8 blocks of {len(split)} "
              f"tensors (e.g. {split[0]}); their rank pieces are quantized again on their own grid, so the "
              "engine is close to, not bit-identical with, the release (docs/engine-format.md)", file=sys.stderr)
    with new_output_dir(output_dir, force=False) as tmp:
        (tmp / "config.json").write_text(json.dumps(trtllm_config(cfg, build), indent=2) + "\n")
        specs = {}
        for t in layout:
            specs[t.tensor.name] = (t.dtype, t.shape)
            if t.scale_shape is not None:
                specs[t.tensor.scale_name] = (torch.float32, t.scale_shape)
        with contextlib.ExitStack() as stack:
            writers = [stack.enter_context(RankFileWriter(tmp / f"rank{r}.safetensors", specs))
                       for r in range(build.tp_size)]
            bar = stack.enter_context(tqdm(total=len(names), desc="convert", unit="tensor", disable=not progress))
            for name, tensor, scale in ckpt.iter_weights():
                source = _Source(tensor, scale)
                internal, expert = to_internal(name, cfg)
                if internal not in where:
                    raise BuildError(f"{ckpt.path}: unexpected tensor {name!r}, not part of a DeepSeek-V3 model with this config.json")
                tensor, part = where[internal]
                for rank, writer in enumerate(writers):
                    _write_shard(writer, tensor, part, source, shapes[internal], expert, build, rank)
                del source, tensor, scale  # before the next tensor is read
                bar.update()
        if (ckpt.path / "tokenizer.json").is_file():
            copy_tokenizer(ckpt.path, tmp)
    return output_dir


class _Source:
    """One logical tensor as read: plain, or FP8 with its block scale; derived forms made once."""

    def __init__(self, tensor: Tensor, scale: Tensor | None = None):
        self.tensor, self.scale = tensor, scale

    @cached_property
    def dequantized(self) -> Tensor:
        return self.tensor if self.scale is None else dequantize_block_fp8(self.tensor, self.scale)

    @cached_property
    def per_tensor(self) -> tuple[Tensor, Tensor]:
        return quantize_tensor_fp8(self.dequantized)


def _write_shard(writer: RankFileWriter, tensor: TensorLayout, part: PartLayout, source: _Source,
                 full_shape: tuple[int, ...], expert: int | None, build: BuildConfig, rank: int) -> None:
    """Cut rank's piece of one logical tensor, store it in its dtype and write it at its offset."""
    index = shard_index(part.name, full_shape, build, rank)
    local = 0
    if expert is not None:  # one expert of a stacked parameter: is it this rank's?
        if not index[0].start <= expert < index[0].stop:
            return
        local, index = expert - index[0].start, index[1:]
    rows, cols = tensor.shape[-2:] if len(tensor.shape) > 1 else (1, tensor.shape[-1])
    data, scale = _stored_piece(source, index, part, build)
    writer.write(tensor.tensor.name, data, ((local * rows + part.row) * cols) if data.dim() > 1 else 0)
    if scale is not None:
        if build.quant_algo == "FP8_BLOCK_SCALES":
            srows, scols = tensor.scale_shape[-2:]
            writer.write(tensor.tensor.scale_name, scale, (local * srows + part.scale_row) * scols)
        else:
            writer.write(tensor.tensor.scale_name, scale.reshape(1), local * len(tensor.parts) + part.scale_row)


def _stored_piece(source: _Source, index: tuple[slice, ...], part: PartLayout,
                  build: BuildConfig) -> tuple[Tensor, Tensor | None]:
    """Rank's piece in its stored form: (data, scale or None).

    Block FP8 sources keep their bytes and block scales whenever every 128x128 block of the piece
    lies inside one source block (split at a multiple of 128, or the piece within one block);
    otherwise the piece is dequantized and quantized again on its own 128x128 grid, which is also
    how BF16/FP32 sources are quantized. Per-tensor FP8 quantizes the whole tensor once, so all
    ranks share its scale.
    """
    if not is_quantized(part.name, build.quant_algo):
        dtype = torch.float32 if part.name.endswith(FLOAT32) else build.torch_dtype
        piece = source.dequantized[index].to(dtype)
        want = part.shape[-piece.dim():]
        if tuple(piece.shape) != want:  # the padded tail of the vocabulary
            piece = F.pad(piece, (0, 0, 0, want[0] - piece.shape[0]))
        return piece, None
    if build.quant_algo == "FP8":
        q, scale = source.per_tensor
        return q[index], scale
    if source.scale is not None:
        grid = _source_grid(index, source.tensor.shape)
        if grid is not None:
            return source.tensor[index], source.scale[grid]
    return quantize_block_fp8(source.dequantized[index])


def blocks_split(ckpt: HFCheckpoint, cfg: ModelConfig, build: BuildConfig,
                 where: dict[str, tuple[TensorLayout, PartLayout]], shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Block-FP8 tensors of the checkpoint whose rank pieces `_stored_piece` must quantize again."""
    if build.quant_algo != "FP8_BLOCK_SCALES" or not ckpt.quantized:
        return []
    split = []
    for name in ckpt.tensor_names:
        internal, expert = to_internal(name, cfg)
        if (internal not in where or ckpt.tensor_info(name).dtype != FP8_CODE
                or not is_quantized(where[internal][1].name, build.quant_algo)):
            continue
        part = where[internal][1].name
        for rank in range(build.tp_size):
            index = shard_index(part, shapes[internal], build, rank)
            if _source_grid(index[1:] if expert is not None else index, ckpt.tensor_info(name).shape) is None:
                split.append(name)
                break
    return split


def _source_grid(index: tuple[slice, ...], shape: Sequence[int]) -> tuple[slice, ...] | None:
    """The source block scales of a piece, if each 128x128 block of it lies in one source block."""
    grid = tuple(covering_blocks(s, n) for s, n in zip(index, shape))
    return None if None in grid else grid
