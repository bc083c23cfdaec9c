"""FP8 weights kept FP8 in bfloat16 models (runtime.model.fp8_linear), on the CPU: loaded as stored, the same
model as dequantizing at load, smaller, and the Triton GEMM checked in Triton's interpreter. The GPU paths are
checked in tests/test_cuda.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from runtime.core.sampling_params import SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.io.engine_format import EngineError
from runtime.io.loading import fill, load_engine
from runtime.model.deepseek_v3 import Experts
from runtime.model.fp8 import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8
from runtime.model.fp8_linear import FP8Experts, FP8Linear, gemm_paths

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "deepseek-v3-mini"


@pytest.fixture(scope="module")
def kept():
    return load_engine(MODEL, dtype="bfloat16", fp8_weights=True)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_bf16_model_keeps_fp8_weights_as_stored(kept):
    """Every linear the release stores as FP8 but kv_b_proj stays FP8 codes with block scales; the routed experts too."""
    linears = {n: m for n, m in kept.model.named_modules() if isinstance(m, FP8Linear)}
    cfg = kept.model_config
    per_layer = 4 + 3  # q_a, q_b, kv_a, o_proj; the MLP's or the shared expert's three
    assert len(linears) == per_layer * (cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    assert not any(n.endswith("kv_b_proj") for n in linears)
    assert all(m.weight.dtype == FP8_DTYPE and m.weight_scale_inv.dtype == torch.float32 for m in linears.values())
    experts = [m for m in kept.model.modules() if isinstance(m, FP8Experts)]
    assert len(experts) == cfg.num_hidden_layers - cfg.first_k_dense_replace + cfg.num_nextn_predict_layers
    assert gemm_paths(kept.model) == {"dequantize": len(linears), **{f"experts {p} dequantize": len(experts) for p in (
        "pairs", "gate_proj", "up_proj", "down_proj")}}  # a CPU has no FP8 product


def test_bf16_fp8_weights_give_the_dequantized_models_logits_and_less_memory(kept):
    """Dequantizing each product computes what dequantizing at load computes, bit for bit; the weights take
    less than two thirds of the bytes."""
    plain = load_engine(MODEL, dtype="bfloat16", fp8_weights=False)
    assert not any(isinstance(m, (FP8Linear, FP8Experts)) for m in plain.model.modules())
    default = load_engine(MODEL, dtype="bfloat16")  # on a CPU only on request: no FP8 product exists here
    assert not any(isinstance(m, (FP8Linear, FP8Experts)) for m in default.model.modules())
    ids = torch.tensor([[0, 5, 17, 99, 1024, 7, 3, 4000, 12, 12, 12, 256]])
    with torch.inference_mode():
        assert torch.equal(kept.model.logits(kept.model(ids)), plain.model.logits(plain.model(ids)))
    assert weight_bytes(kept.model) < 0.65 * weight_bytes(plain.model)


def test_fp8_experts_gather_the_experts_a_batch_uses(kept):
    experts = next(m for m in kept.model.modules() if isinstance(m, FP8Experts))
    whole = experts.stacked("down_proj")
    assert whole.dtype == torch.bfloat16 and whole.shape == experts.down_proj.shape
    e = torch.tensor([3, 0, 3, 7])
    assert torch.equal(experts.stacked("down_proj", e), whole[e])
    assert torch.equal(whole[2], dequantize_block_fp8(experts.down_proj[2], experts.down_proj_scale_inv[2],
                                                      dtype=torch.bfloat16))
    assert isinstance(experts, Experts)


def test_fp8_weight_of_the_wrong_shape_is_refused_by_name():
    model = load_engine(MODEL, dtype="bfloat16", fp8_weights=True).model
    codes, scale = quantize_block_fp8(torch.randn(128, 255))
    with pytest.raises(EngineError, match=r"^test: tensor 'model.layers.0.self_attn.q_a_proj.weight': FP8 weight of "
                                          r"shape \[128, 255\], expected FP8 codes of shape \[128, 256\] with scales$"):
        fill(model, [("model.layers.0.self_attn.q_a_proj.weight", None, codes, scale)], "test")
    with pytest.raises(EngineError, match=r"unscaled torch.bfloat16 weight of shape \[128, 256\]"):
        fill(model, [("model.layers.0.self_attn.q_a_proj.weight", None, torch.zeros(128, 256, dtype=torch.bfloat16),
                      None)], "test")


def test_bf16_fp8_speculative_greedy_equals_plain():
    """With FP8 weights kept, MTP drafting changes no greedy token (k = 3 against k = 0)."""
    prompts = [p["text"] for p in json.loads((MODEL / "heldout_prompts.json").read_text())[:3]]
    outputs = {}
    for k in (0, 3):
        config = ExecutorConfig(num_draft_tokens=k, speculation="fixed", dtype="bfloat16",
                                fp8_weights=True)
        with Executor(MODEL, config) as ex:
            assert any(isinstance(m, FP8Linear) for m in ex.engine.model.modules())
            handles = [ex.submit(ex.tokenizer.encode(p), SamplingParams(max_tokens=20, ignore_eos=True)) for p in prompts]
            outputs[k] = [h.result(timeout=300) for h in handles]
    assert [o.token_ids for o in outputs[3]] == [o.token_ids for o in outputs[0]]
    assert sum(o.stats.num_accepted_draft_tokens for o in outputs[3]) > 0


TRITON_CHECK = """
import torch, torch.nn.functional as F
from runtime.model.fp8 import FP8_DTYPE, quantize_block_fp8, dequantize_block_fp8
from runtime.model.fp8_triton import act_quant, fp8_gemm, fp8_pairs
g = torch.Generator().manual_seed(0)
for M, N, K in ((1, 96, 256), (17, 384, 128), (5, 130, 200), (33, 300, 640)):
    # activations whose 1x128 quantization is exact: e4m3 codes with 448 in every block, times a power of two
    # per block (Triton's interpreter rounds some values to e4m3 wrongly; the GPU test checks the rounding)
    codes = (torch.randn(M, K, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE).float()
    codes[:, ::128] = 448.0
    x = codes * 2.0 ** torch.randint(-6, 6, (M, -(-K // 128)), generator=g).float().repeat_interleave(128, 1)[:, :K]
    w = torch.randn(N, K, generator=g) * (10.0 ** torch.arange(N).remainder(3))[:, None]  # rows differ in scale
    wq, ws = quantize_block_fp8(w)
    q, s = quantize_block_fp8(x, (1, 128))
    assert torch.equal(dequantize_block_fp8(q, s, (1, 128)), x)
    want = F.linear(x, dequantize_block_fp8(wq, ws))
    got = fp8_gemm(x, wq, ws)
    err = ((got - want).abs() / want.abs().amax(0)).max().item()  # per output column, as the scales go
    assert err < 1e-4, (M, N, K, err)
    experts = torch.randn(3, N, K, generator=g) * torch.tensor([1.0, 30.0, 0.01])[:, None, None]
    eq, es = zip(*(quantize_block_fp8(e) for e in experts))
    eq, es = torch.stack(eq), torch.stack(es)
    which = torch.randint(0, 3, (M,), generator=g)
    got = fp8_pairs(x, eq, es, which)
    for p, e in enumerate(which.tolist()):
        want = F.linear(x[p], dequantize_block_fp8(eq[e], es[e]))
        err = ((got[p] - want).abs() / want.abs().max()).max().item()
        assert err < 1e-4, (M, N, K, p, e, err)
    codes, scale = act_quant(x, M + 3)
    q, s = quantize_block_fp8(x, (1, 128))
    assert torch.equal(codes[:M].float(), q.float()) and not codes[M:].float().any()
    assert torch.equal(scale[:M], s) and scale.stride() == (1, M + 3)
print("ok")
"""


@pytest.mark.skipif(find_spec("triton") is None, reason="needs the triton package")
def test_triton_fp8_gemm_in_the_interpreter():
    """The Triton block-scaled GEMM, run by Triton's interpreter on the CPU, quantizes each token's 128-channel
    blocks by their own scale and multiplies by the right weight blocks' scales: the dequantized operands' product,
    partial blocks of rows, columns and K included; the pairs kernel reads each row's own expert; the activation
    quantizer gives `quantize_block_fp8`'s codes and scales, in the layout torch._scaled_mm takes."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_fp8_weights_setting_is_checked():
    with pytest.raises(ValueError, match=r"^fp8_weights must be true, false or unset, got 'yes'$"):
        ExecutorConfig(fp8_weights="yes")


def test_a_probe_that_fails_in_any_way_rules_the_path_out(monkeypatch):
    """Triton's compiler errors are not RuntimeErrors (on a GPU without FP8 support the Triton kernels fail to
    compile): any failure of a path sends the probe on to the next one, and to dequantizing at the end."""
    from runtime.model import fp8_linear

    class CompilationError(Exception):  # as triton.compiler.errors.CompilationError: a plain Exception
        pass

    tried = []

    def failing(path, *args):
        tried.append(path)
        raise CompilationError("fp8e4nv not supported in this architecture")

    monkeypatch.setattr(fp8_linear, "_fp8_capable", lambda device: True)
    monkeypatch.setattr(fp8_linear, "fp8_product", failing)
    codes, scale = quantize_block_fp8(torch.randn(256, 256))
    assert fp8_linear._probe(codes, scale) == "dequantize"
    assert tried == list(fp8_linear.FAST_PATHS)


@pytest.mark.parametrize("requested", [None, True])
def test_by_default_fp8_stays_only_where_a_fast_path_runs(monkeypatch, requested):
    """On a GPU with FP8 products where only some weight shapes have a fast path (as probed), the default load
    dequantizes the rest at load, experts included, and computes what `fp8_weights=False` computes; asked for with
    `fp8_weights=True`, every FP8 weight stays FP8."""
    from runtime.model import fp8_linear

    fast = (96, 256)  # one weight shape with a fast path; its products stand in as dequantized ones on the CPU
    monkeypatch.setattr(fp8_linear, "_fp8_capable", lambda device: True)
    monkeypatch.setattr(fp8_linear, "_probe", lambda codes, scale: "scaled_mm" if tuple(codes.shape) == fast
                        else "dequantize")
    monkeypatch.setattr(fp8_linear, "_probe_pairs", lambda experts: "dequantize")
    monkeypatch.setattr(fp8_linear, "fp8_product", lambda path, x, codes, scale: torch.nn.functional.linear(
        x, dequantize_block_fp8(codes, scale, dtype=x.dtype)))
    loaded = load_engine(MODEL, dtype="bfloat16", fp8_weights=requested)
    plain = load_engine(MODEL, dtype="bfloat16", fp8_weights=False)
    linears = [m for m in loaded.model.modules() if isinstance(m, FP8Linear)]
    stacks = [m for m in loaded.model.modules() if isinstance(m, FP8Experts)]
    everything = 7 * (plain.model_config.num_hidden_layers + plain.model_config.num_nextn_predict_layers)
    if requested:
        assert len(linears) == everything and stacks
    else:
        assert linears and all(tuple(m.weight.shape) == fast for m in linears) and len(linears) < everything
        assert not stacks and any(isinstance(m, Experts) for m in loaded.model.modules())
    ids = torch.tensor([[0, 5, 17, 99, 1024, 7, 3, 4000, 12, 12, 12, 256]])
    with torch.inference_mode():
        assert torch.equal(loaded.model.logits(loaded.model(ids)), plain.model.logits(plain.model(ids)))


def test_fp8_modules_are_built_on_the_meta_device(monkeypatch):
    """The FP8 modules are swapped in before loading with no memory of their own (a DeepSeek-V3 model's worth of
    empty buffers on the CPU first would be ~650 GB of address space)."""
    devices = []
    build = FP8Linear.__init__

    def recording(self, *args):
        build(self, *args)
        devices.append(self.weight.device.type)

    monkeypatch.setattr(FP8Linear, "__init__", recording)
    load_engine(MODEL, dtype="bfloat16", fp8_weights=True)
    assert devices and set(devices) == {"meta"}


def test_fp8_experts_longer_batches_run_each_projection_by_its_own_path(kept, monkeypatch):
    """Beyond decode every expert runs over every token, each projection's products by the path its shape probed
    (here stand-ins that record the path and compute the dequantized product), weighted by the routing as the
    bf16 model's dense path weighs them."""
    from runtime.model import fp8_linear

    experts = next(m for m in kept.model.modules() if isinstance(m, FP8Experts))
    E, _, H = experts.gate_proj.shape
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(20)])
    weights = torch.rand(20, 2, generator=g).to(torch.bfloat16)
    want = experts._dense(x, weights, idx).float()  # every path "dequantize": the base class's dense path
    calls = []

    def product(path, x, codes, scale):
        calls.append(path)
        return torch.nn.functional.linear(x, dequantize_block_fp8(codes, scale, dtype=x.dtype))

    monkeypatch.setattr(fp8_linear, "fp8_product", product)
    paths = {"gate_proj": "scaled_mm", "up_proj": "triton", "down_proj": "dequantize"}
    monkeypatch.setattr(experts, "dense_paths", paths)
    got = experts._dense(x, weights, idx).float()
    assert calls == ["scaled_mm", "triton", "dequantize"] * E
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_scaled_mm_gets_aligned_scales_for_every_expert(kept, monkeypatch):
    """cuBLASLt refuses a scale tensor that does not start on a 16-byte boundary (CUBLAS_STATUS_NOT_SUPPORTED, seen
    on an H200 for odd experts beyond decode): an expert's slice of a stack's scales is handed over aligned, with
    the same values."""
    from runtime.model import fp8_linear

    def scaled_mm(q, codes_t, scale_a, scale_b, out_dtype):
        assert scale_b.data_ptr() % 16 == 0, "scale_b not 16-byte aligned"
        a = dequantize_block_fp8(q, scale_a, fp8_linear.ACTIVATION_BLOCK)
        return torch.nn.functional.linear(a, dequantize_block_fp8(codes_t.t(), scale_b.t())).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    experts = next(m for m in kept.model.modules() if isinstance(m, FP8Experts))
    scales = experts.gate_proj_scale_inv
    assert any(scales[e].data_ptr() % 16 for e in range(scales.shape[0]))  # the case exists in the shipped model
    x = torch.randn(5, experts.gate_proj.shape[2]).to(torch.bfloat16)
    for e in range(scales.shape[0]):
        got = fp8_linear.fp8_product("scaled_mm", x, experts.gate_proj[e], scales[e])
        quantized = fp8_linear._as_quantized(x).to(torch.bfloat16)
        want = fp8_linear.fp8_product("dequantize", quantized, experts.gate_proj[e], scales[e])
        assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.skipif(find_spec("triton") is None, reason="needs the triton package")
def test_triton_kernels_compile_for_hopper():
    """The kernels compile to Hopper (sm_90) machine code on a machine without a GPU, with the argument types the
    runtime passes: Triton's compiler reports errors a CPU-only run of the interpreter never meets."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from runtime.model import fp8_triton as kernels

    blocks = {"BLOCK_K": kernels.BLOCK_K, "SCALE_N": kernels.SCALE_N}
    cases = [
        (kernels._fp8_gemm_kernel, {"a_ptr": "*bf16", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "b_scale_ptr": "*fp32",
                                    "M": "i32", "N": "i32", "K": "i32"}, {"BLOCK_M": 16, "BLOCK_N": 32, **blocks}),
        (kernels._act_quant_kernel, {"x_ptr": "*bf16", "codes_ptr": "*fp8e4nv", "scale_t_ptr": "*fp32", "M": "i32",
                                     "K": "i32", "M_PADDED": "i32"}, {"BLOCK_K": kernels.BLOCK_K}),
        (kernels._fp8_pairs_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
                                     "expert_ptr": "*i64", "out_ptr": "*bf16", "N": "i32", "K": "i32"},
         {"BLOCK_N": 64, **blocks}),
    ]
    for kernel, signature, constants in cases:
        compiled = triton.compile(ASTSource(kernel, signature | dict.fromkeys(constants, "constexpr"),
                                            constexprs=constants), target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"]


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_directories_load_with_fp8_weights_kept(kept, tmp_path, tp):
    """An engine directory, one rank file or two joined in one process, in bfloat16 with its FP8 weights kept (the
    default on GPUs with FP8 products): its block scales were joined while the model was built on the meta device,
    and loading failed ("can't convert meta device type tensor to numpy")."""
    from builder.cli import main

    assert main(["--model_dir", str(MODEL), "--output_dir", str(tmp_path / "engine"), "--max_seq_len", "256",
                 "--tp_size", str(tp)]) == 0
    engine = load_engine(tmp_path / "engine", dtype="bfloat16", fp8_weights=True)
    assert any(isinstance(m, FP8Linear) for m in engine.model.modules())
    ids = torch.tensor([[0, 5, 17, 99, 1024, 7, 3, 4000]])
    with torch.inference_mode():
        got = engine.model.logits(engine.model(ids))
        want = kept.model.logits(kept.model(ids))
    if tp == 1:  # the release's bytes and scales as they are
        assert torch.equal(got, want)
    else:  # pieces split inside a block are quantized again on their own grid
        assert got.isfinite().all() and (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8
