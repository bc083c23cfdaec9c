"""FP8 (e4m3) weight quantization as in the DeepSeek-V3 release, in one place.

The release stores each 2-D Linear weight as float8_e4m3fn plus a float32 `weight_scale_inv` with
one entry per 128x128 block. Despite its name the scale is the multiplier: dequantized weight =
q * scale_inv, with scale_inv = block amax / 448 (448 is the largest finite e4m3 value). Edge
blocks are padded with zeros to 128 before the amax is taken, which leaves it unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
MIN_SCALE = 1e-12  # scale of an all-zero block: any positive value dequantizes it to zeros
BLOCK = (128, 128)


def scale_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """Shape of `weight_scale_inv` for a weight of `shape`: one entry per (possibly partial) block."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def covering_blocks(piece: slice, size: int) -> slice | None:
    """The 128-wide blocks of a dimension of `size` that hold `piece` of it, if each block of the piece's own grid
    lies inside one of them (the piece starts on a block boundary, or lies within one block): then the piece keeps
    their scales. None where a block of the piece straddles two."""
    start, stop, b = piece.start or 0, size if piece.stop is None else piece.stop, BLOCK[0]
    if start % b == 0 or start // b == (stop - 1) // b:
        return slice(start // b, (stop - 1) // b + 1)
    return None


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    # Clamp first: rounding of x/scale can land a hair above 448, and e4m3fn has no infinity.
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_block_fp8(
    w: torch.Tensor, block: tuple[int, int] = BLOCK, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight per block: returns (q float8_e4m3fn, scale_inv float32 [ceil(out/bo), ceil(in/bi)]).
    The scales are block amax / 448 unless given."""
    if w.dim() != 2:
        raise ValueError(f"quantize_block_fp8: weight has shape {list(w.shape)}, expected 2-D")
    (rows, cols), (bo, bi) = w.shape, block
    nr, nc = scale_shape(w.shape, block)
    padded = F.pad(w.float(), (0, nc * bi - cols, 0, nr * bo - rows))
    blocks = padded.view(nr, bo, nc, bi)
    if scale is None:
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
    q = _to_fp8(blocks / scale[:, None, :, None]).view(nr * bo, nc * bi)[:rows, :cols].contiguous()
    return q, scale


def dequantize_block_fp8(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Multiply each block of `q` [..., N, K] (matrices, or stacks of them) by its entry of `scale_inv`
    [..., ceil(N/bo), ceil(K/bi)]; computed in float32, returned as `dtype`."""
    if q.dim() < 2:
        raise ValueError(f"dequantize_block_fp8: weight has shape {list(q.shape)}, expected 2-D or stacked 2-D")
    want = (*q.shape[:-2], *scale_shape(q.shape[-2:], block))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"dequantize_block_fp8: scale_inv has shape {list(scale_inv.shape)} for weight "
            f"{list(q.shape)}, expected {list(want)}"
        )
    rows, cols = q.shape[-2:]
    full = scale_inv.float().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :rows, :cols]
    return (q.float() * full).to(dtype)


def quantize_tensor_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with one scale for the whole tensor: returns (q, scale float32 scalar), w ~= q * scale."""
    scale = (w.float().abs().amax() / FP8_MAX).clamp(min=MIN_SCALE)
    return _to_fp8(w.float() / scale), scale


def dequantize_tensor_fp8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)
