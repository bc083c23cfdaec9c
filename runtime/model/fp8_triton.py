"""A block-scaled FP8 GEMM in Triton, in the style of DeepSeek-V3's `inference/kernel.py` (`fp8_gemm`).

Weights come as FP8 codes with a float32 scale per 128x128 block, activations in bf16; the kernel
quantizes each token's 128-channel slice of K as it loads it (amax / 448, as DeepSeek's `act_quant`),
multiplies it with the weight's slice on the tensor cores in FP8, and adds the product to a float32
accumulator times the two scales: one launch per product, quantization included. Imported only where
Triton is installed (`runtime.model.fp8_linear`). Tile sizes are fixed by the row count rather than
autotuned, so no benchmarking runs inside a CUDA graph capture, and row and column counts are not
specialized on, so a new batch size compiles nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from runtime.model.fp8 import BLOCK, FP8_MAX, MIN_SCALE

BLOCK_K = BLOCK[1]  # K advances one scale block per iteration: one activation and one weight scale each
SCALE_N = BLOCK[0]  # output columns per weight scale
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def _quantize(x, axis: tl.constexpr, codes_dtype: tl.constexpr):
    """float32 x quantized per slice along `axis` as `quantize_block_fp8` does (scale = amax / 448): (codes, scales)."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=axis) / _FP8_MAX, _MIN_SCALE)
    codes = tl.clamp(x / tl.expand_dims(scale, axis), -_FP8_MAX, _FP8_MAX).to(codes_dtype)
    return codes, scale


@triton.jit(do_not_specialize=["M", "N", "K"])
def _fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, b_scale_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SCALE_N: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    k_blocks = tl.cdiv(K, BLOCK_K)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_rows, b_cols = rows % M, cols % N  # wrapped: out-of-range rows and columns are computed and not stored
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * K + ks[None, :]  # 64-bit: M x K passes 2^31 in long prefills
    b_ptrs = b_ptr + b_cols.to(tl.int64)[None, :] * K + ks[:, None]
    b_scale_ptrs = b_scale_ptr + (b_cols // SCALE_N) * k_blocks
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(k_blocks):
        left = K - i * BLOCK_K
        a = tl.load(a_ptrs, mask=ks[None, :] < left, other=0.0).to(tl.float32)
        a_codes, a_scale = _quantize(a, 1, b_ptr.dtype.element_ty)  # each token's 128 channels
        b = tl.load(b_ptrs, mask=ks[:, None] < left, other=0.0)
        acc += tl.dot(a_codes, b) * a_scale[:, None] * tl.load(b_scale_ptrs)[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
        b_scale_ptrs += 1
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def fp8_gemm(a: Tensor, b: Tensor, b_scale: Tensor, block_n: int = 32) -> Tensor:
    """a [M, K] (bf16) times b [N, K] FP8 with scales [ceil(N/128), ceil(K/128)], transposed: [M, N] in a's dtype.
    Each token's activations are quantized per 128 channels inside the kernel (as `quantize_block_fp8` with 1x128
    blocks does). Every operand contiguous."""
    M, K = a.shape
    N = b.shape[0]
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    block_m = 16 if M <= 16 else 32
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _fp8_gemm_kernel[grid](a, b, c, b_scale, M, N, K, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
                           SCALE_N=SCALE_N, num_warps=4, num_stages=3)
    return c


@triton.jit(do_not_specialize=["M", "K", "M_PADDED"])
def _act_quant_kernel(x_ptr, codes_ptr, scale_t_ptr, M, K, M_PADDED, BLOCK_K: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    ks = block * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + row.to(tl.int64) * K + ks, mask=(ks < K) & (row < M), other=0.0).to(tl.float32)
    codes, scale = _quantize(x, 0, codes_ptr.dtype.element_ty)
    tl.store(codes_ptr + row.to(tl.int64) * K + ks, codes, mask=ks < K)
    tl.store(scale_t_ptr + block * M_PADDED + row, scale)


def act_quant(x: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """x [M, K] quantized per token and 128 channels in one launch, as `quantize_block_fp8` with 1x128 blocks:
    codes [rows, K] (rows >= M; the rows past M zero) and scales [rows, ceil(K/128)] stored column-major, the
    layout `torch._scaled_mm` takes."""
    M, K = x.shape
    blocks = triton.cdiv(K, BLOCK_K)
    codes = torch.empty(rows, K, dtype=torch.float8_e4m3fn, device=x.device)
    scale_t = torch.empty(blocks, rows, dtype=torch.float32, device=x.device)
    _act_quant_kernel[(rows, blocks)](x, codes, scale_t, M, K, rows, BLOCK_K=BLOCK_K)
    return codes, scale_t.t()


@triton.jit(do_not_specialize=["N", "K"])
def _fp8_pairs_kernel(x_ptr, w_ptr, w_scale_ptr, expert_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SCALE_N: tl.constexpr):
    pair, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    expert = tl.load(expert_ptr + pair).to(tl.int64)
    k_blocks, n_blocks = tl.cdiv(K, BLOCK_K), tl.cdiv(N, SCALE_N)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * N * K
    scale_ptrs = w_scale_ptr + expert * n_blocks * k_blocks + (cols // SCALE_N) * k_blocks
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in range(k_blocks):
        kk = i * BLOCK_K + ks
        k_ok = kk < K
        a = tl.load(x_ptr + pair * K + kk, mask=k_ok, other=0.0).to(tl.float32)
        a_codes, a_scale = _quantize(a, 0, w_ptr.dtype.element_ty)
        w = tl.load(w_base + cols[None, :] * K + kk[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        partial = tl.sum(a_codes.to(tl.float32)[:, None] * w.to(tl.float32), axis=0)
        acc += partial * a_scale * tl.load(scale_ptrs + i, mask=col_ok, other=0.0)
    tl.store(out_ptr + pair * N + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def fp8_pairs(x: Tensor, w: Tensor, w_scale: Tensor, experts: Tensor, block_n: int = 64, num_warps: int = 4) -> Tensor:
    """Row p of x [P, K] (bf16) times expert experts[p]'s weight (w [E, N, K] FP8, scales [E, ceil(N/128),
    ceil(K/128)]) transposed: [P, N] in x's dtype, each row's activations quantized per 128 channels as in
    `fp8_gemm`. One launch for all (token, expert) pairs of a decode step, reading only their experts' weights."""
    P, K = x.shape
    N = w.shape[1]
    out = torch.empty(P, N, dtype=x.dtype, device=x.device)
    _fp8_pairs_kernel[(P, triton.cdiv(N, block_n))](x, w, w_scale, experts, out, N, K, BLOCK_N=block_n,
                                                     BLOCK_K=BLOCK_K, SCALE_N=SCALE_N, num_warps=num_warps)
    return out
