"""The CPU kernels against the PyTorch path they replace, and the property the executor relies on:
a row's result does not depend on the other rows it is computed with (bit for bit)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from runtime.model import kernels
from runtime.model.batch import PagedBatch
from runtime.model.config import ModelConfig
from runtime.model.fp8 import dequantize_block_fp8, dequantize_tensor_fp8, quantize_block_fp8, quantize_tensor_fp8
from runtime.model.kernels.modules import (FusedDecoderLayer, FusedDecoderStack, FusedMTPLayer, GreedyStep, KernelMLA,
                                     KernelMoE, PackedLinear, attends_in_kernels, swap_class)
from runtime.core.kv_cache import KVCache
from runtime.io.loading import load_engine
from runtime.model.deepseek_v3 import MLA, DeepseekV3ForCausalLM, MoE
from tests.conftest import tiny_config_dict

# skipped only where the CPU lacks the instructions: where it has them, a kernel build that fails fails these tests
pytestmark = pytest.mark.skipif(bool(kernels.cpu_missing_flags()), reason="CPU kernels need x86-64 with AVX-512")


def test_the_kernels_build_where_the_cpu_runs_them() -> None:
    """The runtime falls back to its PyTorch path when the build fails (with a warning); a test run must not."""
    assert kernels.cpu_kernels() is not None, "building runtime/model/kernels/cpu_kernels.cpp failed: see the warning"


def fp8_codes(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes and 128x128 block scales of a random weight, as an FP8 release stores them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, k)  # wide range: subnormal FP8 values too
    return quantize_block_fp8(w)


@pytest.mark.parametrize("n,k", [(128, 256), (100, 200), (4096, 256), (16, 16), (300, 129)])
def test_fp8_linear_matches_the_dequantized_matmul(n, k) -> None:
    q, s = fp8_codes(n, k)
    w = dequantize_block_fp8(q, s)
    packed = kernels.pack_fp8(q, s)
    for m in (1, 2, 3, 4, 5, 6, 7, 13, 64):  # every register tile (a verify of 1 + k tokens, k <= 5), then buffered
        x = torch.randn(m, k)
        torch.testing.assert_close(kernels.packed_linear(x, packed), x @ w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [300, 100])  # 100: one column block, so two threads split the rows instead
def test_fp8_linear_rows_do_not_depend_on_the_batch(n) -> None:
    packed = kernels.pack_fp8(*fp8_codes(n, 256))
    x = torch.randn(40, 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone = torch.cat([kernels.packed_linear(x[i : i + 1], packed) for i in range(40)])
        for m in (2, 3, 4, 5, 6, 7, 16, 17, 40):  # register path up to 6 rows, buffered path above
            assert torch.equal(kernels.packed_linear(x[:m], packed), alone[:m]), m
    finally:
        torch.set_num_threads(threads)


def test_subnormal_fp8_values_are_exact() -> None:
    q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)  # every e4m3 code
    q = q[~q.float().isnan()][:240].view(16, 15)  # finite codes, subnormals and both zeros included
    packed = kernels.pack_fp8(q, torch.ones(1, 1))
    assert torch.equal(kernels.packed_linear(torch.eye(15), packed), q.float().t())


def test_pack_fp8_takes_power_of_two_and_per_tensor_scales() -> None:
    """Codes go in as stored, whatever recipe made their scales: UE8M0 (power-of-two) block scales, one scale for
    the whole tensor."""
    w = torch.randn(200, 300) * 0.05
    pow2 = torch.exp2(torch.ceil(torch.log2(quantize_block_fp8(w)[1])))  # UE8M0-style block scales
    full = pow2.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    ue8m0 = ((w / full).to(torch.float8_e4m3fn), pow2)
    per_tensor = quantize_tensor_fp8(w)
    x = torch.randn(3, 300)
    for (q, s), exact in ((ue8m0, dequantize_block_fp8(*ue8m0)), (per_tensor, dequantize_tensor_fp8(*per_tensor))):
        packed = kernels.pack_fp8(q, s)
        assert packed.panels.dtype == torch.uint8
        assert torch.equal(kernels.packed_linear(torch.eye(300), packed), exact.t())
        torch.testing.assert_close(kernels.packed_linear(x, packed), x @ exact.t(), rtol=1e-5, atol=1e-5)


def test_nan_reaches_the_attention_output() -> None:
    """As in the PyTorch path: a NaN query is not turned into a finite average of the context."""
    cache = torch.randn(32, 32)
    q = torch.zeros(1, 2, 32)
    q[0, 0, 3] = float("nan")
    out = kernels.mla_attention(q, cache, torch.tensor([5]), torch.tensor([0]), torch.tensor([[0, 1]]), 16,
                                torch.randn(2, 16, 16))
    assert out[0, :16].isnan().all() and not out[0, 16:].isnan().any()


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_mla_attention_splits_heads_of_few_tokens_exactly(threads, tokens) -> None:
    """Fewer tokens than threads (a batch-1 decode or verify) split each token's heads over the threads, in
    uneven groups here (5 heads): every head's output as the formula gives it, bit for bit the one-thread result."""
    g = torch.Generator().manual_seed(tokens)
    heads, D, rank, vdim, bs = 5, 48, 32, 16, 4
    cache = torch.randn(40, D, generator=g)
    tables = torch.tensor([[7, 2, 9, 0, 5, 3], [1, 4, 6, 8, 0, 0]])
    positions = torch.tensor([17, 9, 21][:tokens])
    seq = torch.tensor([0, 1, 0][:tokens])
    q = torch.randn(tokens, heads, D, generator=g) * 0.3
    w_uv = torch.randn(heads, rank, vdim, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.mla_attention(q, cache, positions, seq, tables, bs, w_uv)
        torch.set_num_threads(threads)
        got = kernels.mla_attention(q, cache, positions, seq, tables, bs, w_uv)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, one)
    for t in range(tokens):
        slots = torch.tensor([tables[seq[t], i // bs] * bs + i % bs for i in range(positions[t] + 1)])
        ctx = cache[slots].double()
        p = torch.softmax(q[t].double() @ ctx.t(), dim=-1)  # [heads, L]
        ref = torch.einsum("hr,hrv->hv", p @ ctx[:, :rank], w_uv.double()).reshape(-1)
        torch.testing.assert_close(got[t].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3])
def test_mla_prepare_splits_large_heads_exactly(tokens) -> None:
    """Heads with a W_UK of 128 x 512 are items of their own, spread over the threads even for one token: the
    queries bit for bit the one-thread ones and as the formula gives them, the cache rows the same."""
    g = torch.Generator().manual_seed(tokens)
    heads, nope, rope, rank = 6, 128, 16, 512
    q = torch.randn(tokens, heads * (nope + rope), generator=g)
    kv = torch.randn(tokens, rank + rope, generator=g)
    rot = torch.polar(torch.ones(tokens, rope // 2), torch.rand(tokens, rope // 2, generator=g) * 6)
    w_uk = torch.randn(heads, nope, rank, generator=g) * 0.1
    norm, slots = torch.rand(rank, generator=g) + 0.5, torch.tensor([5, 0, 7][:tokens])
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            cache = torch.zeros(8, rank + rope)
            results.append((kernels.mla_prepare(q, kv, rot, norm, 1e-6, w_uk, 0.125, cache, slots), cache))
    finally:
        torch.set_num_threads(before)
    (one, one_cache), *others = results
    for out, cache in others:
        assert torch.equal(out, one) and torch.equal(cache, one_cache)
    q_nope = q.view(tokens, heads, nope + rope)[..., :nope].double()
    ref = 0.125 * torch.einsum("thn,hnr->thr", q_nope, w_uk.double())
    torch.testing.assert_close(one[..., :rank].double(), ref, rtol=1e-5, atol=1e-5)


def stacked(codes: list[tuple[torch.Tensor, torch.Tensor]]) -> kernels.PackedWeight:
    packed = kernels.PackedWeight.empty_fp8(len(codes), *codes[0][0].shape)
    for e, (q, s) in enumerate(codes):
        kernels.pack_fp8_into(packed, e, q, s)
    return packed


@pytest.mark.parametrize("inter", [32, 192, 384])
def test_moe_layer_matches_the_pytorch_moe(inter) -> None:
    """Routing (grouped, biased, normalized, scaled), routed experts and the shared expert in one call. The
    shared expert runs in two halves: cut inside its one scale block (32), or at a block boundary (192, 384)."""
    cfg = ModelConfig.from_dict(tiny_config_dict(hidden_size=64, moe_intermediate_size=inter, n_routed_experts=16,
                                                 num_experts_per_tok=3, n_group=4, topk_group=2))
    moe = MoE(cfg)
    gen = torch.Generator().manual_seed(1)
    packs = []
    with torch.no_grad():
        for p in (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj):
            codes = [fp8_codes(*p.shape[1:], seed=e) for e in range(p.shape[0])]
            p.copy_(torch.stack([dequantize_block_fp8(*c) for c in codes]))
            packs.append(stacked(codes))
        for i, lin in enumerate((moe.shared_experts.gate_proj, moe.shared_experts.up_proj, moe.shared_experts.down_proj)):
            codes = fp8_codes(*lin.weight.shape, seed=100 + i)
            lin.weight.copy_(dequantize_block_fp8(*codes))
            packs.append(kernels.pack_fp8(*codes))
        moe.gate.weight.copy_(torch.randn(16, 64, generator=gen) * 0.3)
        moe.gate.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.1)
    weights = tuple(t for p in packs for t in (p.panels, p.scale))
    for tokens in (1, 3, 40):  # the PyTorch per-pair and grouped paths
        x = torch.randn(tokens, 64, generator=gen)
        with torch.no_grad():
            ref = moe(x)
        got = kernels.moe(x, moe.gate.weight, moe.gate.e_score_correction_bias, cfg, weights)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())
        alone = torch.cat([kernels.moe(x[i : i + 1], moe.gate.weight, moe.gate.e_score_correction_bias, cfg, weights)
                           for i in range(tokens)])
        assert torch.equal(got, alone)


def kernel_cfg() -> ModelConfig:
    """Tiny, but with latent sizes the attention kernel takes (multiples of 16)."""
    return ModelConfig.from_dict(tiny_config_dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                                  v_head_dim=16))


def test_mla_attention_matches_the_padded_groups() -> None:
    """Ragged step: decodes, a verify chunk, a prefill chunk after a cached prefix, a fresh prefill."""
    cfg = kernel_cfg()
    torch.manual_seed(0)
    attn = MLA(cfg, cache_layer=0)
    kernel_attn = swap_class(attn, KernelMLA)
    kernel_attn.absorb()
    model = DeepseekV3ForCausalLM(cfg)
    starts, lens, bs = [5, 40, 0, 17, 3], [1, 4, 30, 12, 1], 4
    blocks = [-(-(s + q) // bs) for s, q in zip(starts, lens)]
    cache = KVCache(cfg, num_blocks=sum(blocks) + 1, block_size=bs)
    cache.tensor.normal_()
    width = max(blocks)
    ids = torch.randperm(sum(blocks) + 1)[: sum(blocks)].tolist()  # scattered blocks
    tables, at = [], 0
    for n in blocks:
        tables.append(ids[at : at + n] + [0] * (width - n))
        at += n
    tables = torch.tensor(tables)
    x = torch.randn(sum(lens), cfg.hidden_size)
    outs = []
    for kernel in (False, True):
        batch = PagedBatch.build(starts, lens, tables, bs, for_kernels=kernel)
        assert (batch.token_seq is not None) == kernel
        kv = cache.tensor.clone()
        with torch.no_grad():
            outs.append(((kernel_attn if kernel else attn).forward_paged(x, model.rope(batch.positions), batch, kv), kv))
    (ref, ref_kv), (got, got_kv) = outs
    torch.testing.assert_close(got_kv, ref_kv, rtol=1e-5, atol=1e-5)  # the same slots written, the same latents
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_loading_keeps_each_weight_in_its_release_form(tiny_checkpoint) -> None:
    path = tiny_checkpoint("fp8", tiny_config_dict(hidden_size=64, moe_intermediate_size=32, kv_lora_rank=32,
                                                   qk_rope_head_dim=16, v_head_dim=16), fp8=True)
    plain = load_engine(path, cpu_kernels=False).model
    fast = load_engine(path).model
    assert attends_in_kernels(fast) and not attends_in_kernels(plain)
    packed = {n: m.packed.panels.dtype for n, m in fast.named_modules() if isinstance(m, PackedLinear)}
    assert packed["model.layers.0.self_attn.q_a_proj"] == torch.uint8  # FP8 in the release
    assert packed["mtp.0.block.self_attn.o_proj"] == torch.uint8
    for name in ("lm_head", "mtp.0.eh_proj", "mtp.0.shared_head.head"):  # BF16 in the release
        assert packed[name] == torch.bfloat16
    assert "model.layers.0.self_attn.kv_b_proj" not in packed  # read per head by absorbed attention
    assert all(isinstance(m, KernelMoE) for m in fast.modules() if isinstance(m, MoE))
    plain_params = dict(plain.named_parameters())
    for name, module in fast.named_modules():
        if isinstance(module, PackedLinear):  # the packed weight holds exactly the loaded values
            w = plain_params[name + ".weight"]
            assert torch.equal(kernels.packed_linear(torch.eye(w.shape[1]), module.packed), w.t())


def test_fp8_codes_are_packed_as_stored(tiny_checkpoint) -> None:
    """No recipe is searched for: a weight stored with scales twice its block's amax / 448 (its codes use half the
    range) is packed with those very codes and scales."""
    from safetensors.torch import load_file, save_file

    path = tiny_checkpoint("fp8", tiny_config_dict(hidden_size=64, moe_intermediate_size=32, kv_lora_rank=32,
                                                   qk_rope_head_dim=16, v_head_dim=16), fp8=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = "model.layers.0.self_attn.q_a_proj.weight"
    w = None
    for key in (name, name + "_scale_inv"):
        shard = path / index["weight_map"][key]
        tensors = load_file(shard)
        if key == name:
            w = dequantize_block_fp8(tensors[name], load_file(path / index["weight_map"][name + "_scale_inv"])[name + "_scale_inv"])
            q, s = quantize_block_fp8(w, scale=quantize_block_fp8(w)[1] * 2)
            tensors[name] = q
        else:
            tensors[key] = s
        save_file(tensors, shard)
    lin = load_engine(path).model.model.layers[0].self_attn.q_a_proj
    assert torch.equal(lin.packed.panels, kernels.pack_fp8(q, s).panels)
    assert torch.equal(lin.packed.scale, s * kernels.FP8_TO_HALF)
    torch.testing.assert_close(kernels.packed_linear(torch.eye(64), lin.packed), dequantize_block_fp8(q, s).t())


def test_rms_norm_matches_and_takes_strided_rows() -> None:
    x = torch.randn(7, 96)
    w = torch.randn(64)
    got = kernels.rms_norm(x[:, :64], w, 1e-6)  # rows 96 apart, as the latent part of kv_a's output
    torch.testing.assert_close(got, F.rms_norm(x[:, :64], (64,), w, 1e-6), rtol=1e-5, atol=1e-6)
    x3 = torch.randn(2, 3, 40)  # 40: a masked tail
    torch.testing.assert_close(kernels.rms_norm(x3, w[:40], 1e-6), F.rms_norm(x3, (40,), w[:40], 1e-6),
                               rtol=1e-5, atol=1e-6)


def test_bf16_linear_matches_and_refuses_other_values() -> None:
    w = torch.randn(300, 200).bfloat16().float()
    packed = kernels.pack_bf16(w)
    x = torch.randn(9, 200)
    torch.testing.assert_close(kernels.packed_linear(x, packed), x @ w.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(kernels.packed_linear(x[:1], packed), kernels.packed_linear(x, packed)[:1])
    assert kernels.pack_bf16(torch.randn(30, 20)) is None


def _random_paged(cfg, starts: list[int], lens: list[int], gen: torch.Generator, bs: int = 16):
    """A cache of random latents holding each sequence's `starts` tokens and room for its `lens` new ones,
    block tables padded to one width, and random token ids for the new tokens."""
    blocks = [-(-(s + q) // bs) for s, q in zip(starts, lens)]
    cache = KVCache(cfg, num_blocks=sum(blocks), block_size=bs)
    cache.tensor.normal_(generator=gen)
    width = max(blocks)
    tables = torch.tensor([cache.allocator.allocate(n) + [0] * (width - n) for n in blocks])
    return cache, tables, torch.randint(cfg.vocab_size, (sum(lens),), generator=gen)


def test_shipped_model_logits_with_and_without_kernels(shipped_model_dir) -> None:
    fast, plain = (load_engine(shipped_model_dir, cpu_kernels=k).model for k in (True, False))
    assert attends_in_kernels(fast)
    cfg, bs = fast.cfg, 16
    starts, lens = [0, 100, 37], [50, 1, 4]
    cache, tables, ids = _random_paged(cfg, starts, lens, torch.Generator().manual_seed(0), bs)
    with torch.inference_mode():
        logits = [m.logits(m(ids, batch=PagedBatch.build(starts, lens, tables, bs, attends_in_kernels(m)),
                             kv_cache=cache.tensor.clone())) for m in (fast, plain)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
    assert F.cosine_similarity(logits[0], logits[1], dim=-1).min() > 0.99999


def test_shipped_model_rows_do_not_depend_on_the_batch(shipped_model_dir) -> None:
    """With the kernels every op of a paged step is row-wise with fixed arithmetic, so a sequence's logits
    are bit for bit the same alone and inside a ragged batch (other decodes, a verify chunk, a prefill)."""
    model = load_engine(shipped_model_dir).model
    cfg, bs = model.cfg, 16
    gen = torch.Generator().manual_seed(3)
    starts, lens = [40, 0, 77, 12], [1, 30, 4, 1]  # sequence 2 is the one watched
    cache, tables, ids = _random_paged(cfg, starts, lens, gen, bs)
    with torch.inference_mode():
        together = model.logits(model(ids, batch=PagedBatch.build(starts, lens, tables, bs, True), kv_cache=cache.tensor.clone()))
        mine = slice(sum(lens[:2]), sum(lens[:3]))
        alone = model.logits(model(ids[mine], batch=PagedBatch.build(starts[2:3], lens[2:3], tables[2:3], bs, True),
                                   kv_cache=cache.tensor.clone()))
    assert torch.equal(together[mine], alone)


def test_attention_kernel_refuses_block_ids_past_the_cache() -> None:
    """A bad block table is an error, not a read past the cache (which could take the server down)."""
    cache = torch.zeros(32, 32)
    q = torch.zeros(1, 2, 32)
    w_uv = torch.zeros(2, 16, 16)
    with pytest.raises(RuntimeError, match="block id past the cache"):
        kernels.mla_attention(q, cache, torch.tensor([5]), torch.tensor([0]), torch.tensor([[9]]), 16, w_uv)
    with pytest.raises(RuntimeError, match="position negative or past the block table"):
        kernels.mla_attention(q, cache, torch.tensor([20]), torch.tensor([0]), torch.tensor([[1]]), 16, w_uv)
    with pytest.raises(RuntimeError, match="position negative or past the block table"):
        kernels.mla_attention(q, cache, torch.tensor([-1]), torch.tensor([0]), torch.tensor([[1]]), 16, w_uv)
    with pytest.raises(RuntimeError, match="block id past the cache"):  # no overflow in the bounds check
        kernels.mla_attention(q, cache, torch.tensor([2]), torch.tensor([0]), torch.tensor([[2**62 - 1]]), 4, w_uv)


def _ragged_step(model, seed: int = 5):
    """A prefill chunk, two decodes and a verify chunk in one paged step: logits, MTP logits and hidden
    states (all rows, and each sequence's last row), the cache."""
    cfg, bs = model.cfg, 16
    gen = torch.Generator().manual_seed(seed)
    starts, lens = [0, 40, 77, 12], [30, 1, 4, 1]
    cache, tables, ids = _random_paged(cfg, starts, lens, gen, bs)
    hidden = torch.randn(sum(lens), cfg.hidden_size, generator=gen)
    batch = PagedBatch.build(starts, lens, tables, bs, attends_in_kernels(model))
    with torch.inference_mode():
        logits = model.logits(model(ids, batch=batch, kv_cache=cache.tensor))
        mtp_logits, mtp_hidden = model.mtp_forward(0, ids, hidden, batch=batch, kv_cache=cache.tensor)
        last_logits, _ = model.mtp_forward(0, ids, hidden, batch=batch, kv_cache=cache.tensor, rows=batch.last_index)
    return logits, mtp_logits, mtp_hidden, last_logits, cache.tensor


def test_whole_layer_call_equals_the_kernels_one_by_one(shipped_model_dir) -> None:
    """`kernels.decoder_layers` (all layers in one call), `kernels.decoder_layer` and `kernels.mtp_layer` run
    DecoderLayer's and MTPLayer's kernels in their order: the dense first layer, the MoE layers and the MTP
    module give bit for bit what the calls one by one give, cache writes included."""
    model = load_engine(shipped_model_dir).model
    fusable = [m for m in model.modules() if isinstance(m, (FusedDecoderStack, FusedDecoderLayer, FusedMTPLayer))]
    assert len(fusable) == 1 + model.num_cache_layers + len(model.mtp) and all(m.handle is not None for m in fusable)
    whole_stack = _ragged_step(model)
    model.model.layers.handle = None  # each layer as its own call
    per_layer = _ragged_step(model)
    for m in fusable:
        m.handle = None  # each layer's kernels one by one
    one_by_one = _ragged_step(model)
    for a, b, c in zip(whole_stack, per_layer, one_by_one):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_greedy_drafts_in_one_call_equal_drafting_step_by_step(shipped_model_dir) -> None:
    """`FusedMTPLayer.greedy_drafts` (the MTP module over a ragged catch-up, then K - 1 steps on its own drafts, in
    one kernel call) proposes the tokens and writes the MTP cache entries that drafting one step at a time does."""
    model = load_engine(shipped_model_dir).model
    cfg, bs, K = model.cfg, 16, 4
    cache = KVCache(cfg, num_blocks=16, block_size=bs)
    cache.tensor.normal_(generator=torch.Generator().manual_seed(0))
    tables = torch.tensor([cache.allocator.allocate(3) for _ in range(3)])
    starts, lens = [5, 20, 40], [1, 3, 2]  # last catch-up positions 5, 22, 41; drafts 2..4 after them
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=gen)
    hidden = torch.randn(sum(lens), cfg.hidden_size, generator=gen)
    batch = PagedBatch.build(starts, lens, tables, bs, attends_in_kernels(model))
    one_call = cache.tensor.clone()
    with torch.inference_mode():
        drafts = model.mtp[0].greedy_drafts(model.rope, ids, hidden, batch, one_call, K)
        by_step = cache.tensor.clone()
        logits, h = model.mtp_forward(0, ids, hidden, batch=batch, kv_cache=by_step, rows=batch.last_index)
        want = [logits.argmax(-1)]
        for j in range(1, K):
            step = PagedBatch.build([s + n - 1 + j for s, n in zip(starts, lens)], [1] * 3, tables, bs, True)
            logits, h = model.mtp_forward(0, want[-1], h, batch=step, kv_cache=by_step)
            want.append(logits.argmax(-1))
        assert torch.equal(drafts, torch.stack(want, dim=1))
        assert torch.equal(one_call, by_step)
        with pytest.raises(RuntimeError, match="block tables do not cover the draft positions"):
            model.mtp[0].greedy_drafts(model.rope, ids, hidden, batch, one_call, 8)  # draft 8 of the last: position 48


def test_greedy_step_without_drafts_is_the_target_forward_and_argmax(shipped_model_dir) -> None:
    """`GreedyStep` with no drafts (plain decoding) runs the target over each sequence's last token alone: bit for
    bit the hidden states after the final norm and the cache writes of the model's forward, and the argmax of its
    logits; the MTP module is not needed (a step with drafts refuses to run without it)."""
    model = load_engine(shipped_model_dir).model
    cfg, bs = model.cfg, 16
    num_cached = [5, 40, 77]
    cache, tables, ids = _random_paged(cfg, num_cached, [1, 1, 1], torch.Generator().manual_seed(3), bs)
    step = GreedyStep.of(model)
    step.mtp = None
    rows = [row[: -(-(n + 1) // bs)] for row, n in zip(tables.tolist(), num_cached)]  # unpadded, as the runner's
    one_call = cache.tensor.clone()
    with torch.inference_mode():
        emitted, hidden, logprobs = step(torch.empty(0), torch.empty(0), one_call, rows, bs, [], num_cached,
                                         ids.tolist(), [0, 0, 0])
        forward = cache.tensor.clone()
        want = model(ids, batch=PagedBatch.build(num_cached, [1, 1, 1], tables, bs, True), kv_cache=forward)
        assert torch.equal(hidden, want)
        assert emitted == [[t] for t in model.logits(want).argmax(-1).tolist()]
        assert torch.equal(one_call, forward) and logprobs.shape == (0, 3)
        with pytest.raises(RuntimeError, match="greedy_step: drafts need the MTP module and num_mtp per sequence"):
            step(ids, want, one_call, rows, bs, [n - 1 for n in num_cached], num_cached, ids.tolist(), [0, 1, 0])


def test_layers_the_whole_layer_call_cannot_run_stay_on_the_kernels_one_by_one(tiny_checkpoint) -> None:
    """Without a q LoRA (DeepSeek-V2-Lite style) a layer is not fused, and still matches the PyTorch path."""
    path = tiny_checkpoint("noqlora", tiny_config_dict(hidden_size=64, moe_intermediate_size=32, kv_lora_rank=32,
                                                       qk_rope_head_dim=16, v_head_dim=16, q_lora_rank=None), fp8=True)
    fast, plain = (load_engine(path, cpu_kernels=k).model for k in (True, False))
    assert attends_in_kernels(fast)
    assert not any(isinstance(m, (FusedDecoderStack, FusedDecoderLayer, FusedMTPLayer)) for m in fast.modules())
    for a, b in zip(_ragged_step(fast), _ragged_step(plain)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_paged_batch_names_block_tables_that_do_not_cover_the_positions() -> None:
    with pytest.raises(ValueError, match=r"block_tables \[1, 2\] do not cover the positions up to 40 \(block size 16\)"):
        PagedBatch.build([40], [1], torch.tensor([[3, 4]]), 16, True)


def test_results_do_not_depend_on_the_number_of_threads(shipped_model_dir) -> None:
    """The kernels split work by output columns, tokens, whole routed experts and the shared expert's two
    halves, and add the experts' outputs in a fixed order after the parallel part: one thread and two give
    the same bits."""
    model = load_engine(shipped_model_dir).model
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _ragged_step(model)
        torch.set_num_threads(2)
        two = _ragged_step(model)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_errors_in_parallel_work_reach_the_caller_and_the_pool_goes_on() -> None:
    """A check that fails on a worker thread is raised in the caller; the next call runs normally."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cache = torch.randn(64, 32)
        q = torch.randn(4, 2, 32)
        w_uv = torch.randn(2, 16, 16)
        seq, tables = torch.tensor([0, 0, 0, 0]), torch.tensor([[0, 1, 2, 3]])
        with pytest.raises(RuntimeError, match="position negative or past the block table"):
            kernels.mla_attention(q, cache, torch.tensor([1, 2, 3, 99]), seq, tables, 16, w_uv)
        positions = torch.tensor([1, 2, 3, 40])
        together = kernels.mla_attention(q, cache, positions, seq, tables, 16, w_uv)
        alone = [kernels.mla_attention(q[i : i + 1], cache, positions[i : i + 1], seq[:1], tables, 16, w_uv) for i in range(4)]
        assert torch.equal(together, torch.cat(alone))
    finally:
        torch.set_num_threads(threads)


def test_kernels_called_from_two_threads_at_once_give_the_same_bits() -> None:
    """One parallel job at a time: a call made meanwhile from another thread runs on its own thread, correctly."""
    import threading

    w = kernels.pack_fp8(*fp8_codes(4096, 256))
    x = torch.randn(8, 256)
    want = kernels.packed_linear(x, w)
    errors: list[str] = []

    def hammer() -> None:
        for _ in range(200):
            if not torch.equal(kernels.packed_linear(x, w), want):
                errors.append("mismatch")

    workers = [threading.Thread(target=hammer) for _ in range(3)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert errors == []


def test_a_forked_child_runs_the_kernels_on_its_own_pool() -> None:
    """The parent's pool workers do not exist in a forked child (and a lock one held would stay held):
    the child starts its own pool and gets the parent's bits."""
    import os

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        w = kernels.pack_fp8(*fp8_codes(4096, 256))
        x = torch.randn(8, 256)
        want = kernels.packed_linear(x, w)  # the parent's pool has run a job
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 when the bits match
            os._exit(0 if all(torch.equal(kernels.packed_linear(x, w), want) for _ in range(20)) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(threads)


def test_bf16_experts_stay_on_the_pytorch_path(tiny_checkpoint) -> None:
    """BF16 experts are not FP8, so their MoE layer runs in PyTorch while its shared expert's linears are held as
    BF16; it still gives the PyTorch path's logits."""
    path = tiny_checkpoint("bf16", tiny_config_dict(hidden_size=64, moe_intermediate_size=32, kv_lora_rank=32,
                                                    qk_rope_head_dim=16, v_head_dim=16))
    fast, plain = (load_engine(path, cpu_kernels=k).model for k in (True, False))
    moes = [m for m in fast.modules() if isinstance(m, MoE)]
    assert moes and not any(isinstance(m, KernelMoE) for m in moes)
    assert all(m.shared_experts.gate_proj.packed.panels.dtype == torch.bfloat16 for m in moes)
    for a, b in zip(_ragged_step(fast), _ragged_step(plain)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_copied_model_leaves_the_fused_calls_behind(shipped_model_dir) -> None:
    """The fused kernel calls hold the original's tensors: a deep copy (or a pickle) drops them and runs
    the kernels one by one, with the same bits."""
    import copy

    model = load_engine(shipped_model_dir).model
    twin = copy.deepcopy(model)
    fusable = (FusedDecoderStack, FusedDecoderLayer, FusedMTPLayer)
    assert all(m.handle is not None for m in model.modules() if isinstance(m, fusable))
    assert all(m.handle is None for m in twin.modules() if isinstance(m, fusable))
    for a, b in zip(_ragged_step(model), _ragged_step(twin)):
        assert torch.equal(a, b)


def test_a_killed_build_does_not_hang_the_next_load() -> None:
    """torch marks a build in progress with a lock file that a killed build leaves behind; every later load
    then waited for ever without a word (a Triton model that never finished loading). Under our own lock a torch
    lock file is provably stale and is removed."""
    import subprocess
    import sys
    from pathlib import Path

    kernels.cpu_kernels()
    build_dir = Path(kernels.cpu_kernels().__file__).parent
    (build_dir / "lock").touch()
    done = subprocess.run([sys.executable, "-c", "from runtime.model.kernels import cpu_kernels; assert cpu_kernels()"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"CPU kernels: removing {build_dir / 'lock'}, left by a build that was killed" in done.stderr
    assert not (build_dir / "lock").exists()


def test_kernels_are_not_loaded_from_a_directory_others_can_write(tmp_path) -> None:
    """The extension is built into and loaded from TORCH_EXTENSIONS_DIR: a directory another user can write (or
    made first, in a shared /tmp) would let them swap in their own library, which the load would run. The build
    directory and every directory above it must be this user's or root's and writable by no other user; otherwise
    the kernels are off, with a warning naming the directory."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = tmp_path / "ext"
    root.mkdir()
    script = ("import logging; logging.basicConfig(level=logging.WARNING); from runtime.model import kernels; "
              "print(kernels.build_dir()); print(kernels.cpu_kernels())")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    build = root / kernels.build_dir().name
    for opened, closed in ((root, None), (build, root)):
        if closed is not None:
            closed.chmod(0o755)
        opened.mkdir(exist_ok=True)
        opened.chmod(0o777)
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert run.stdout.split() == [str(build), "None"], run.stderr
        assert (f"CPU kernels off: {opened} is not private to uid {os.getuid()} (owner uid {os.getuid()}, group "
                f"{os.getgid()}, mode 777): choose a TORCH_EXTENSIONS_DIR no other user can change; using the "
                "PyTorch path") in run.stderr, run.stderr
        assert not list(build.glob("*.so"))


def test_private_build_directories_need_no_other_users_write_access(tmp_path) -> None:
    """What the kernels accept: this user's directories under a sticky one (as /tmp), group-writable ones whose
    group is this user's alone (a umask of 002 with per-user groups), and a symlinked TORCH_EXTENSIONS_DIR whose
    target is private; what they refuse: a parent anyone can write, wherever it is above."""
    import grp
    import os

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    own = shared / "mine" / "ext"
    own.mkdir(parents=True)
    kernels.check_private(own)
    if not grp.getgrgid(os.getgid()).gr_mem:  # this user's group has no other member
        own.chmod(0o775)
        kernels.check_private(own)
    link = tmp_path / "link"
    link.symlink_to(own)
    kernels.check_private(link)
    shared.chmod(0o777)  # two levels up: another user could rename mine/ away and put theirs there
    with pytest.raises(OSError, match=f"{shared} is not private to uid {os.getuid()}"):
        kernels.check_private(own)
