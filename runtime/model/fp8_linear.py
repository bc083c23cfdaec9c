"""FP8 weights kept FP8 in memory, for models computed in bfloat16 (the GPU path real releases need).

The release stores each Linear and routed-expert weight as float8_e4m3fn codes with one float32 scale per
128x128 block (`runtime.model.fp8`). Dequantized to bf16 they take twice the memory, in fp32 four times; here
they stay as stored. `prepare` swaps these modules in before the weights load, as the CPU kernels' modules are
(`runtime.model.kernels.modules`); `finish` picks, per weight shape, how its matrix products run, taking the
first of these that a probe on the model's device shows to give what the dequantized weight gives:

- "scaled_mm": activations quantized per token and 128 channels (1x128 blocks, amax / 448, as DeepSeek's
  `act_quant`; one Triton launch where Triton is installed), then `torch._scaled_mm` with 1x128 and 128x128
  float32 scales (cuBLASLt, Hopper and newer, where the installed torch wires it and the weight's scales meet
  its 16-byte alignment: ceil(in/128) a multiple of 4, as in every DeepSeek-V3 weight);
- "triton": a Triton block-scaled FP8 GEMM that quantizes the activations itself (`runtime.model.fp8_triton`),
  for the shapes cuBLASLt refuses, where Triton is installed;
- "dequantize": the weight dequantized to the activations' dtype for each product (memory as FP8, arithmetic
  as bf16). Everywhere else, the CPU included.

By default (`fp8_weights` unset) FP8 stays only where it runs fast: on GPUs with FP8 products (compute capability
8.9 or newer), and there a weight shape with no fast path (an expert stack with none) is dequantized at load, as
in a model loaded with `fp8_weights=False`. Asked for (`fp8_weights=True`), every FP8 weight stays FP8 anywhere,
dequantized for each product where nothing faster runs: memory for time.

Routed experts run a Triton kernel over a decode step's (token, expert) pairs where Triton is installed, and
longer batches every expert over every token, each projection by its shape's path as above. `kv_b_proj` stays a plain
dequantized Linear: absorbed MLA reads its weight per head. Every path is free of host synchronization, so CUDA
graphs capture them.
"""

from __future__ import annotations

import logging
from collections import Counter
from importlib.util import find_spec
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM, Experts, MoE, read_per_head
from runtime.model.fp8 import BLOCK, FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8, scale_shape
from runtime.model.kernels import block_scales
from runtime.model.kernels.modules import StoredDtype, replace_submodule

log = logging.getLogger(__name__)

GemmPath = Literal["scaled_mm", "triton", "dequantize"]
FAST_PATHS: tuple[GemmPath, ...] = ("scaled_mm", "triton")  # in the order they are tried (docs/gpu.md says why)
ACTIVATION_BLOCK = (1, BLOCK[1])  # one scale per token and 128 input channels
_HAS_TRITON = find_spec("triton") is not None
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # an expert stack's
COMPUTE_DTYPE = torch.bfloat16  # the only dtype FP8 weights stay FP8 in
ROW_ALIGN = 4  # cuBLASLt wants the activations' scale columns 16-byte aligned: rows padded to a multiple of 4
SCALE_ALIGN = 16  # bytes: cuBLASLt wants each scale tensor to start on a 16-byte boundary


def keeps_fp8(device: torch.device, dtype: torch.dtype, requested: bool | None) -> bool:
    """Whether FP8 weights load as FP8: in bfloat16 models on GPUs with FP8 products by default (`requested` None),
    on any device when requested; never in float32 (the exact reference, dequantized at load)."""
    if dtype != COMPUTE_DTYPE or requested is False:
        return False
    return requested is True or _fp8_capable(device)


def fp8_product(path: GemmPath, x: Tensor, codes: Tensor, scale: Tensor) -> Tensor:
    """x [M, K] times the FP8 weight (codes [N, K], block scales [ceil(N/128), ceil(K/128)]) transposed, by `path`,
    in x's dtype."""
    if path == "dequantize":
        return F.linear(x, dequantize_block_fp8(codes, scale, dtype=x.dtype))
    if path == "triton":
        from runtime.model.fp8_triton import fp8_gemm

        return fp8_gemm(x.contiguous(), codes, scale)
    M = x.shape[0]
    q, s = _quantize_rows(x, M + -M % ROW_ALIGN)
    if scale.data_ptr() % SCALE_ALIGN:  # an expert's slice of a stack's scales can start mid-word: cuBLASLt refuses
        scale = scale.clone()
    return torch._scaled_mm(q, codes.t(), scale_a=s, scale_b=scale.t(), out_dtype=x.dtype)[:M]


def _quantize_rows(x: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """x's 1x128-block quantization padded with zero rows to `rows`, scales column-major: in one Triton launch where
    Triton is installed, else in PyTorch operations."""
    if _HAS_TRITON and x.is_cuda:
        from runtime.model.fp8_triton import act_quant

        return act_quant(x.contiguous(), rows)
    q, s = quantize_block_fp8(x, ACTIVATION_BLOCK)
    if rows > x.shape[0]:
        q = F.pad(q.view(torch.uint8), (0, 0, 0, rows - x.shape[0])).view(FP8_DTYPE)
        s = F.pad(s, (0, 0, 0, rows - x.shape[0]), value=1.0)
    return q, s.t().contiguous().t()


class FP8Linear(nn.Module):
    """A bias-free linear whose weight stays FP8 codes [out, in] with float32 scales per 128x128 block."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE))
        self.register_buffer("weight_scale_inv", torch.empty(scale_shape((out_features, in_features))))
        self.path: GemmPath = "dequantize"

    def load(self, codes: Tensor, scale: Tensor | None) -> None:
        if scale is None or codes.shape != self.weight.shape:
            raise ValueError(f"{'FP8' if scale is not None else 'unscaled ' + str(codes.dtype)} weight of shape "
                             f"{list(codes.shape)}, expected FP8 codes of shape {list(self.weight.shape)} with scales")
        self.weight.copy_(codes)
        self.weight_scale_inv.copy_(block_scales(scale, tuple(codes.shape)))

    def forward(self, x: Tensor) -> Tensor:
        out = fp8_product(self.path, x.reshape(-1, self.in_features), self.weight, self.weight_scale_inv)
        return out.view(*x.shape[:-1], self.out_features)


class FP8Experts(Experts):
    """Routed experts stacked as FP8 codes [E, out, in] with scales [E, ceil(out/128), ceil(in/128)]. A decode step's
    (token, expert) pairs run one Triton launch per projection (`fp8_pairs`) where `pairs_path` is "triton"; longer
    batches run every expert over every token, each projection's products by its path in `dense_paths` (probed as a
    linear's of that shape); "dequantize" dequantizes the weights of the experts a product uses."""

    pairs_path: GemmPath = "dequantize"
    dense_paths: dict[str, GemmPath] = dict.fromkeys(PROJECTIONS, "dequantize")

    def __init__(self, experts: Experts, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.first, self.expert_parallel = experts.first, experts.expert_parallel
        for name in PROJECTIONS:
            shape = getattr(experts, name).shape
            self.register_buffer(name, torch.empty(shape, dtype=FP8_DTYPE))
            self.register_buffer(f"{name}_scale_inv", torch.empty(shape[0], *scale_shape(shape[1:])))
        self.dtype = dtype  # the model's compute dtype, what `stacked` dequantizes to

    def load(self, name: str, expert: int | None, codes: Tensor, scale: Tensor) -> None:
        stack, scales = getattr(self, name), getattr(self, f"{name}_scale_inv")
        for e, (c, s) in enumerate(zip(codes, scale)) if expert is None else [(expert, (codes, scale))]:
            stack[e].copy_(c)
            scales[e].copy_(block_scales(s, tuple(c.shape)))

    def stacked(self, name: str, e: Tensor | int | None = None) -> Tensor:
        codes, scale = getattr(self, name), getattr(self, f"{name}_scale_inv")
        if e is not None:  # gathered as bytes: indexing float8 tensors is not implemented everywhere
            codes, scale = codes.view(torch.uint8)[e].view(FP8_DTYPE), scale[e]
        return dequantize_block_fp8(codes, scale, dtype=self.dtype)

    def _pairs(self, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
        if self.pairs_path != "triton":
            return super()._pairs(x, weights, idx)
        from runtime.model.fp8_triton import fp8_pairs

        (T, k), e = idx.shape, idx.flatten()
        rows = x.repeat_interleave(k, 0)  # row t * k + j: token t for its j-th expert
        h = F.silu(fp8_pairs(rows, self.gate_proj, self.gate_proj_scale_inv, e)) * \
            fp8_pairs(rows, self.up_proj, self.up_proj_scale_inv, e)
        out = fp8_pairs(h, self.down_proj, self.down_proj_scale_inv, e)
        return (out.view(T, k, -1) * weights[..., None]).sum(1)

    def _dense(self, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
        if set(self.dense_paths.values()) == {"dequantize"}:
            return super()._dense(x, weights, idx)
        routed = x.new_zeros(idx.shape[0], self.gate_proj.shape[0]).scatter_(1, idx, weights).float()  # [T, E]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.gate_proj.shape[0]):  # every expert over every token, as the base class (no host sync)
            h = F.silu(self._product("gate_proj", e, x)) * self._product("up_proj", e, x)
            out += routed[:, e, None] * self._product("down_proj", e, h)
        return out.to(x.dtype)

    def _product(self, name: str, e: int, x: Tensor) -> Tensor:
        return fp8_product(self.dense_paths[name], x, getattr(self, name)[e], getattr(self, f"{name}_scale_inv")[e])


def prepare(model: DeepseekV3ForCausalLM, stored: StoredDtype, dtype: torch.dtype) -> None:
    """Swap in, before any weight is loaded (under the meta device), an FP8 module for every Linear and expert stack
    stored as FP8."""
    for name, module in list(model.named_modules()):
        if isinstance(module, MoE) and stored(f"{name}.experts.gate_proj") == FP8_DTYPE:
            module.experts = FP8Experts(module.experts, dtype)
        elif isinstance(module, nn.Linear) and not read_per_head(name) and stored(f"{name}.weight") == FP8_DTYPE:
            replace_submodule(model, name, FP8Linear(module.in_features, module.out_features))


def finish(model: DeepseekV3ForCausalLM, keep_all: bool) -> None:
    """After loading: each FP8 linear's GEMM path, probed once per weight shape on the model's device, and the
    experts' (their products' shape probed as a linear's, their pairs kernel on a few of one stack's experts).
    Unless `keep_all`, the linears and expert stacks with no fast path are then dequantized at load."""
    probed: dict[tuple[int, int], GemmPath] = {}

    def path_of(codes: Tensor, scale: Tensor) -> GemmPath:
        shape = tuple(codes.shape)
        if shape not in probed:
            probed[shape] = _probe(codes, scale)
        return probed[shape]

    linears = [m for m in model.modules() if isinstance(m, FP8Linear)]
    for linear in linears:
        linear.path = path_of(linear.weight, linear.weight_scale_inv)
    stacks = [m for m in model.modules() if isinstance(m, FP8Experts)]
    if stacks:
        first = stacks[0]
        pairs = _probe_pairs(first)
        dense = {n: path_of(getattr(first, n)[0], getattr(first, f"{n}_scale_inv")[0]) for n in PROJECTIONS}
        for stack in stacks:
            stack.pairs_path, stack.dense_paths = pairs, dict(dense)
    slow = 0 if keep_all else _dequantize_slow(model)
    log.info("FP8 weights kept as stored: %d linears, %d expert stacks (pairs %s), %d dequantized at load (no fast "
             "path); GEMM paths by weight shape: %s", len(linears), len(stacks), stacks[0].pairs_path if stacks else
             "-", slow, ", ".join(f"{n}x{k} {p}" for (n, k), p in sorted(probed.items())))


def _dequantize_slow(model: DeepseekV3ForCausalLM) -> int:
    """Each FP8 linear whose product would dequantize its weight, and each expert stack with no fast path, replaced
    by its dequantized module (what `fp8_weights=False` loads), one at a time; how many were."""
    slow = [(n, m) for n, m in model.named_modules() if isinstance(m, FP8Linear) and m.path == "dequantize"]
    for name, linear in slow:
        plain = nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
        plain.weight = nn.Parameter(dequantize_block_fp8(linear.weight, linear.weight_scale_inv, dtype=COMPUTE_DTYPE),
                                    requires_grad=False)
        replace_submodule(model, name, plain)
    moes = [m for m in model.modules() if isinstance(m, MoE) and isinstance(m.experts, FP8Experts)
            and m.experts.pairs_path == "dequantize" and set(m.experts.dense_paths.values()) == {"dequantize"}]
    for moe in moes:
        moe.experts = _dequantized_experts(moe.experts)
    return len(slow) + len(moes)


def _dequantized_experts(stack: FP8Experts) -> Experts:
    """The stack as plain Experts in its compute dtype, dequantized one expert at a time (a whole stack at once
    would take several times its bytes in temporaries)."""
    plain = Experts.__new__(Experts)
    nn.Module.__init__(plain)
    plain.first, plain.expert_parallel = stack.first, stack.expert_parallel
    for name in PROJECTIONS:
        codes = getattr(stack, name)
        weights = torch.empty(codes.shape, dtype=stack.dtype, device=codes.device)
        for e in range(codes.shape[0]):
            weights[e] = stack.stacked(name, e)
        setattr(plain, name, nn.Parameter(weights, requires_grad=False))
    return plain


def gemm_paths(model: nn.Module) -> dict[str, int]:
    """How many FP8 linears run each GEMM path, and expert stacks each pairs and dense path."""
    keys = [m.path for m in model.modules() if isinstance(m, FP8Linear)]
    for m in model.modules():
        if isinstance(m, FP8Experts):
            keys += [f"experts pairs {m.pairs_path}", *(f"experts {n} {p}" for n, p in m.dense_paths.items())]
    return dict(Counter(keys))


def _fp8_capable(device: torch.device) -> bool:
    """FP8 tensor-core products (e4m3) need compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _probe(codes: Tensor, scale: Tensor) -> GemmPath:
    """The first fast path that runs this weight on its device and gives, for 1 and 17 tokens, what the dequantized
    weight gives on the same quantized activations (within bf16's rounding); else "dequantize"."""
    if not _fp8_capable(codes.device):
        return "dequantize"
    reference = dequantize_block_fp8(codes, scale)
    gen = torch.Generator(device=codes.device).manual_seed(0)
    inputs = [torch.randn(m, codes.shape[1], device=codes.device, generator=gen).to(torch.bfloat16) for m in (1, 17)]
    wants = [F.linear(_as_quantized(x), reference) for x in inputs]
    for path in FAST_PATHS:
        try:
            for x, want in zip(inputs, wants):
                got = fp8_product(path, x, codes, scale).float()
                if not _agrees(got, want):
                    raise ValueError(f"max error {(got - want).abs().max().item():.3g}")
            return path
        except Exception as e:  # a probe: any failure (torch's, cuBLASLt's, Triton's compiler's) rules the path out
            log.debug("FP8 GEMM path %s for weights %s: %s: %s", path, list(codes.shape), type(e).__name__, e)
    return "dequantize"


def _probe_pairs(experts: FP8Experts, n: int = 4) -> GemmPath:
    """"triton" where the pairs kernel gives, for 2 tokens over the stack's first `n` experts, what the dequantized
    experts give on the same quantized activations; else "dequantize"."""
    codes = experts.gate_proj
    if not _fp8_capable(codes.device):
        return "dequantize"
    n = min(n, codes.shape[0])
    gen = torch.Generator(device=codes.device).manual_seed(0)
    x = torch.randn(2 * n, codes.shape[2], device=codes.device, generator=gen).to(torch.bfloat16)
    which = torch.arange(2 * n, device=codes.device) % n
    weights = dequantize_block_fp8(codes[:n], experts.gate_proj_scale_inv[:n])[which]
    want = torch.einsum("pk,pnk->pn", _as_quantized(x), weights)
    try:
        from runtime.model.fp8_triton import fp8_pairs

        got = fp8_pairs(x, codes, experts.gate_proj_scale_inv, which).float()
    except Exception as e:  # a probe, as `_probe`
        log.debug("FP8 experts' pairs kernel: %s: %s", type(e).__name__, e)
        return "dequantize"
    return "triton" if _agrees(got, want) else "dequantize"


def _as_quantized(x: Tensor) -> Tensor:
    """x as the FP8 paths see it: quantized per token and 128 channels, dequantized to float32."""
    return dequantize_block_fp8(*quantize_block_fp8(x, ACTIVATION_BLOCK), ACTIVATION_BLOCK)


def _agrees(got: Tensor, want: Tensor) -> bool:
    """Within bf16's rounding of the output (2% of the largest value)."""
    return torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
