"""The native runtime's CPU kernels (`cpu_kernels.cpp`), compiled on first use and cached.

On CPU a decode step is dominated by per-operation overhead and by streaming weights, so three
pieces run as C++ with AVX-512 instead of chains of small ATen calls: FP8 block-scaled linear layers
(the release's FP8 weights stay FP8 in memory), the routed experts of a MoE layer, and absorbed MLA
over the paged latent cache. Without AVX-512 (or a compiler) the runtime uses its PyTorch path,
which computes the same thing.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from runtime.fp8 import dequantize_block_fp8, quantize_block_fp8

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-mavx512f"]
PANEL = 16  # weight rows per packed panel (one AVX-512 register of outputs)
FP8_TO_HALF = 256.0  # the kernel reads e4m3 bytes as fp16 values 2^8 times too small


def cpu_missing_flags() -> list[str]:
    """CPU features the kernels need that this machine lacks (all of them off x86-64 Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return list(CPU_FLAGS)
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return [f for f in CPU_FLAGS if f not in flags]


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled extension, or None (with one warning saying why) where it cannot run here."""
    missing = cpu_missing_flags()
    if missing:
        log.warning("CPU kernels off: this CPU lacks %s; using the PyTorch path", ", ".join(missing))
        return None
    from torch.utils.cpp_extension import load

    try:  # built once into torch's extension cache (TORCH_EXTENSIONS_DIR), rebuilt when the source changes
        return load("dsv3_cpu_kernels", [str(SOURCE)], extra_cflags=CFLAGS,
                    verbose=os.environ.get("DSV3_KERNELS_VERBOSE") == "1")
    except (OSError, RuntimeError, ImportError) as e:  # no compiler, failed build
        log.warning("CPU kernels off: building %s failed (%s); using the PyTorch path", SOURCE.name, e)
        return None


@dataclass
class PackedFP8:
    """A weight [N, K] (or experts stacked [E, N, K]) as e4m3 bytes in panels [(E,) ceil(N/16), K, 16]
    and its 128x128 block scales [(E,) ceil(N/128), ceil(K/128)], times 2^8 for the kernel."""

    panels: Tensor
    scale: Tensor
    out_features: int
    in_features: int


def pack_fp8(w: Tensor) -> PackedFP8 | None:
    """Pack `w` if every 128x128 block of it (of each expert's matrix) is exactly FP8 values times one
    scale, what an FP8 release dequantizes to; None otherwise, so a weight the release keeps in BF16
    is never rounded."""
    if w.dtype != torch.float32 or w.dim() not in (2, 3):
        return None
    mats = list(w) if w.dim() == 3 else [w]
    N, K = mats[0].shape
    rows = -(-N // PANEL) * PANEL
    panels, scales = [], []
    for m in mats:
        q, scale = quantize_block_fp8(m)
        if not torch.equal(dequantize_block_fp8(q, scale), m):
            return None
        padded = torch.zeros(rows, K, dtype=torch.uint8)
        padded[:N] = q.view(torch.uint8)
        panels.append(padded.view(rows // PANEL, PANEL, K).transpose(1, 2).contiguous())
        scales.append(scale * FP8_TO_HALF)
    if w.dim() == 2:
        return PackedFP8(panels[0], scales[0].contiguous(), N, K)
    return PackedFP8(torch.stack(panels), torch.stack(scales).contiguous(), N, K)


def fp8_linear(x: Tensor, w: PackedFP8) -> Tensor:
    """x [..., K] float32 -> [..., N]."""
    flat = x.reshape(-1, w.in_features).contiguous()
    return cpu_kernels().fp8_linear(flat, w.panels, w.scale, w.out_features).view(*x.shape[:-1], w.out_features)


def moe_experts(x: Tensor, weights: Tensor, idx: Tensor, gate: PackedFP8, up: PackedFP8, down: PackedFP8) -> Tensor:
    """Routed experts (stacked, packed) for tokens x [T, H] routed by idx / weights [T, k]."""
    return cpu_kernels().moe_experts(x.contiguous(), idx.contiguous(), weights.float().contiguous(),
                                     gate.panels, gate.scale, up.panels, up.scale, down.panels, down.scale)


def mla_attention(q: Tensor, cache: Tensor, positions: Tensor, token_seq: Tensor, block_tables: Tensor,
                  block_size: int, rank: int) -> Tensor:
    """q [T, h, rank + rope] (scaled) against each token's own sequence in the paged cache [slots, rank + rope]."""
    return cpu_kernels().mla_attention(q.contiguous(), cache, positions, token_seq, block_tables, block_size, rank)
