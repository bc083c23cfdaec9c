"""FP8 block and per-tensor quantization against a loop-over-blocks reference and e4m3 error bounds."""

import pytest
import torch

from runtime.model.fp8 import (
    FP8_DTYPE,
    dequantize_block_fp8,
    dequantize_tensor_fp8,
    quantize_block_fp8,
    quantize_tensor_fp8,
)


def e4m3_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest rounding error of w ~= q * scale: e4m3 has 3 mantissa bits, so half an ulp is
    2^-4 relative for normal q, and 2^-10 (half the subnormal step 2^-9) absolute for subnormal q."""
    return (w.abs() * 2**-4 + scale * 2**-10) * (1 + 1e-5)


def block_amax_reference(w: torch.Tensor, b: int = 128) -> torch.Tensor:
    rows, cols = w.shape
    out = torch.empty((rows + b - 1) // b, (cols + b - 1) // b)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = w[i * b : (i + 1) * b, j * b : (j + 1) * b].abs().max()
    return out


def blockwise_magnitudes(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random weights whose blocks differ in magnitude by up to 1e4, so a scale applied to the
    wrong block shows up as a large error."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    nr, nc = (rows + 127) // 128, (cols + 127) // 128
    mags = 10.0 ** torch.arange(nr * nc, dtype=torch.float32).view(nr, nc).remainder(5)
    return w * mags.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]


def expand(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]


def test_block_roundtrip_with_edge_blocks():
    w = blockwise_magnitudes(200, 300)
    q, scale = quantize_block_fp8(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (2, 3)
    # the stored scale is the multiplier amax/448, amax over the real (unpadded) elements
    torch.testing.assert_close(scale, block_amax_reference(w) / 448, rtol=0, atol=0)
    assert q.float().abs().max() == 448  # each block's largest element maps to the e4m3 max
    deq = dequantize_block_fp8(q, scale)
    assert deq.dtype == torch.float32
    assert ((deq - w).abs() <= e4m3_bound(w, expand(scale, w.shape))).all()


def test_block_bound_is_tight():
    # the bound is not vacuous: some elements come close to it
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_block_fp8(w)
    ratio = (dequantize_block_fp8(q, scale) - w).abs() / e4m3_bound(w, expand(scale, w.shape))
    assert ratio.max() > 0.8


@pytest.mark.parametrize("wrong", ["transposed", "rows_swapped"])
def test_mis_tiled_scale_is_caught(wrong):
    w = blockwise_magnitudes(256, 256)
    q, scale = quantize_block_fp8(w)
    bad = scale.t().contiguous() if wrong == "transposed" else scale.flip(0)
    ratio = (dequantize_block_fp8(q, bad) - w).abs() / e4m3_bound(w, expand(scale, w.shape))
    assert ratio.max() > 100  # off by the factor between two blocks' magnitudes, not by rounding


def test_zero_block():
    w = torch.randn(256, 130)
    w[:128, :128] = 0
    q, scale = quantize_block_fp8(w)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    deq = dequantize_block_fp8(q, scale)
    assert not torch.isnan(deq).any()
    assert (deq[:128, :128] == 0).all()
    assert ((deq - w).abs() <= e4m3_bound(w, expand(scale, w.shape))).all()


def test_custom_block_and_dtype():
    w = blockwise_magnitudes(64, 96)
    q, scale = quantize_block_fp8(w, block=(32, 64))
    assert scale.shape == (2, 2)
    deq = dequantize_block_fp8(q, scale, block=(32, 64), dtype=torch.bfloat16)
    assert deq.dtype == torch.bfloat16
    full = scale.repeat_interleave(32, 0).repeat_interleave(64, 1)[:, :96]
    # bf16 output adds its own rounding (8 bits) on top of e4m3's
    assert ((deq.float() - w).abs() <= e4m3_bound(w, full) + w.abs() * 2**-8).all()


def test_dequantize_rejects_wrong_scale_shape():
    q, scale = quantize_block_fp8(torch.randn(200, 300))
    with pytest.raises(ValueError, match=r"scale_inv has shape \[3, 2\] for weight \[200, 300\], expected \[2, 3\]"):
        dequantize_block_fp8(q, scale.t())


def test_per_tensor():
    w = blockwise_magnitudes(200, 300)
    q, scale = quantize_tensor_fp8(w)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.dim() == 0
    assert scale == w.abs().max() / 448
    deq = dequantize_tensor_fp8(q, scale)
    assert ((deq - w).abs() <= e4m3_bound(w, scale)).all()
    zq, zscale = quantize_tensor_fp8(torch.zeros(4, 4))
    assert zscale > 0 and (dequantize_tensor_fp8(zq, zscale) == 0).all()
