"""Parity of our runtime with HF transformers' `DeepseekV3ForCausalLM`, in float32.

Both models read the SAME checkpoint (written by `write_hf_checkpoint`): HF through
`from_pretrained`, ours through `HFCheckpoint` + `load_release_tensors` (conftest). The tiny configs switch on every
feature of the real model: YaRN (factor > 1, both mscale keys: equal as in V3 with q LoRA, unequal
without), grouped routing (n_group > 1, topk_group < n_group) with a random correction bias that
changes most tokens' experts, q LoRA on and off, a dense first layer, two shared experts,
routed_scaling_factor != 1, and an MTP layer with its own embedding and head. Weights have
std ~ 1/sqrt(fan_in), so logits are O(1) and an absolute tolerance of 1e-4 is meaningful.

transformers needs `accelerate` to load an FP8 checkpoint; without it that one case is skipped
(the FP8 test's other reference, dequantized here in plain torch, still runs).

The MTP layer is compared with a transcription of its equations in plain torch (HF never builds
it): only its decoder block is HF's `DeepseekV3DecoderLayer`, loaded with the MTP block weights.

`test_checks_can_fail` shows each comparison would catch a mistake: one perturbed weight, a
dropped bias, plain RoPE instead of YaRN, ungrouped routing and others move the logits far past
the tolerance.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import transformers
from transformers import DeepseekV3ForCausalLM as HFDeepseekV3
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

from builder.hf_writer import write_hf_checkpoint
from runtime.io.checkpoint import HFCheckpoint, expected_tensor_shapes
from runtime.model.config import ModelConfig
from runtime.model.batch import PagedBatch
from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM

from conftest import load_release_tensors, tiny_config_dict

TOL = 1e-4  # max |logit difference|; logits have std ~1
BLOCK_SIZE = 4
NUM_BLOCKS = 12
SHARD_BYTES = 60_000  # several shards, so both loaders follow the index


# ---------------------------------------------------------------------------------------------
# Config, weights, loading
# ---------------------------------------------------------------------------------------------
def parity_config(q_lora: bool, hidden_size: int = 32) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config_dict(
        hidden_size=hidden_size,
        num_hidden_layers=3,  # layer 0 dense, 1-2 MoE, MTP at layer 3
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24 if q_lora else None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,  # 4 frequencies: YaRN's ramp blends them (low 0, high 2)
        v_head_dim=8,
        n_routed_experts=12,
        n_group=3,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=2,
        moe_intermediate_size=16,
        routed_scaling_factor=2.5,
        rms_norm_eps=1e-6,  # HF hard-codes 1e-6 for q_a_layernorm / kv_a_layernorm
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            # V3's own values (equal: the cos/sin factor is 1) and unequal ones (factor != 1).
            "mscale": 1.0,
            "mscale_all_dim": 1.0 if q_lora else 0.5,
        },
        max_position_embeddings=256,
    ))


def parity_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Release-named float32 tensors, rounded to bfloat16 (what the non-FP8 writer stores)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_tensor_shapes(cfg).items():
        if name.endswith("e_score_correction_bias"):
            # Sigmoid scores spread ~0.2: with this bias 2/3 or more of the tokens pick other
            # experts than without it, and most experts still get tokens.
            out[name] = 0.1 * torch.randn(shape, generator=g)
            continue
        if len(shape) == 1:  # norms
            t = 1.0 + 0.2 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[1])
        out[name] = t.to(torch.bfloat16).float()
    return out


def load_ours(cfg: ModelConfig, tensors) -> DeepseekV3ForCausalLM:
    model = DeepseekV3ForCausalLM(cfg)
    load_release_tensors(model, tensors)
    return model.eval()


def load_hf(path: Path, cfg: ModelConfig) -> HFDeepseekV3:
    """HF's model from a checkpoint directory, all float32; checks that it used every tensor."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # it lists the MTP tensors it ignores
    try:
        model, info = HFDeepseekV3.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
    finally:
        transformers.logging.set_verbosity(verbosity)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    assert all(k.startswith(mtp_prefix) for k in info["unexpected_keys"]), info["unexpected_keys"]
    # With an FP8 checkpoint HF dequantizes the FP8 linears to float32 but leaves the tensors
    # stored as bf16 (norms, embeddings, router, lm_head) in bf16; .float() is exact for those.
    return model.float().eval()


@dataclass
class Pair:
    cfg: ModelConfig
    tensors: dict[str, torch.Tensor]
    path: Path
    hf: HFDeepseekV3
    ours: DeepseekV3ForCausalLM


@pytest.fixture(scope="module", params=[True, False], ids=["q_lora", "no_q_lora"])
def pair(request, tmp_path_factory) -> Pair:
    cfg = parity_config(request.param)
    tensors = parity_tensors(cfg, seed=1)
    path = write_hf_checkpoint(
        tmp_path_factory.mktemp("parity") / "bf16", cfg, tensors.items(), fp8=False, max_shard_bytes=SHARD_BYTES
    )
    ours = load_ours(cfg, HFCheckpoint(path).iter_tensors())
    return Pair(cfg, tensors, path, load_hf(path, cfg), ours)


def token_ids(cfg: ModelConfig, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    d = max_diff(got, want)
    print(f"{what}: max |diff| = {d:.2e}")
    assert d <= TOL, f"{what}: max |logit diff| {d:.3e} > {TOL}"


# ---------------------------------------------------------------------------------------------
# Paged decoding helper
# ---------------------------------------------------------------------------------------------
class PagedRunner:
    """Sequences in a latent paged cache with fixed (non-contiguous) block tables.

    The cache starts full of large garbage, so reading any slot that was never written (or was
    written by another sequence) shows in the logits.
    """

    def __init__(self, model: DeepseekV3ForCausalLM, block_tables: list[list[int]], seed: int = 0):
        cfg = model.cfg
        self.model = model
        g = torch.Generator().manual_seed(seed)
        self.kv_cache = 100.0 * torch.randn(
            model.num_cache_layers, NUM_BLOCKS * BLOCK_SIZE, cfg.latent_dim, generator=g
        )
        self.block_tables = torch.tensor(block_tables)
        self.lens = [0] * len(block_tables)

    @torch.no_grad()
    def step(self, seqs: list[int], chunks: list[torch.Tensor], next_chunks: list[torch.Tensor] | None = None):
        """One paged forward of `chunks[i]` appended to sequence `seqs[i]`.

        Returns per-sequence target logits and, with `next_chunks` (the token after each one),
        per-sequence MTP logits from the target hidden states of this same forward.
        """
        sizes = [len(c) for c in chunks]
        batch = PagedBatch.build([self.lens[s] for s in seqs], sizes, self.block_tables[seqs], BLOCK_SIZE)
        hidden = self.model(torch.cat(chunks), batch=batch, kv_cache=self.kv_cache)
        logits = self.model.logits(hidden).split(sizes)
        mtp = None
        if next_chunks is not None:
            mtp_logits, _ = self.model.mtp_forward(0, torch.cat(next_chunks), hidden, batch=batch, kv_cache=self.kv_cache)
            mtp = mtp_logits.split(sizes)
        for s, n in zip(seqs, sizes):
            self.lens[s] += n
        return logits, mtp


# Two sequences whose blocks are interleaved and in reverse order; blocks 2, 5, 8, 11 stay unused.
DECODE_TABLES = [[9, 6, 3, 0], [10, 7, 4, 1]]
DECODE_LENS = (14, 9)  # decoded tokens of sequences 0 and 1
DECODE_B_START = 3  # sequence 1 joins the batch at step 3, so positions differ within a step


def decode_ragged(model: DeepseekV3ForCausalLM, ids: torch.Tensor, with_mtp: bool):
    """Token-by-token decode of ids[0, :14] and ids[1, :9] in one ragged batch.

    Returns ([logits seq0 [14, V], seq1 [9, V]], same for MTP fed the next token or None).
    """
    runner = PagedRunner(model, DECODE_TABLES)
    logits = [[], []]
    mtp = [[], []]
    steps = max(DECODE_LENS[0], DECODE_B_START + DECODE_LENS[1])
    for t in range(steps):
        pos = {0: t, 1: t - DECODE_B_START}
        seqs = [s for s in (1, 0) if 0 <= pos[s] < DECODE_LENS[s]]  # shorter context first
        chunks = [ids[s, pos[s]: pos[s] + 1] for s in seqs]
        nexts = [ids[s, pos[s] + 1: pos[s] + 2] for s in seqs] if with_mtp else None
        out, out_mtp = runner.step(seqs, chunks, nexts)
        for i, s in enumerate(seqs):
            logits[s].append(out[i])
            if with_mtp:
                mtp[s].append(out_mtp[i])
    cat = lambda xs: [torch.cat(x) for x in xs]  # noqa: E731
    return cat(logits), (cat(mtp) if with_mtp else None)


# ---------------------------------------------------------------------------------------------
# MTP reference: its equations in plain torch from the raw release tensors
# ---------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def hf_mtp_block(pair: Pair) -> DeepseekV3DecoderLayer:
    """HF's decoder layer (MLA + MoE) holding the MTP block's weights."""
    cfg, N = pair.cfg, pair.cfg.num_hidden_layers
    layer = DeepseekV3DecoderLayer(pair.hf.config, layer_idx=N).float().eval()
    p = f"model.layers.{N}."
    own = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
    state = {
        n[len(p):]: t for n, t in pair.tensors.items()
        if n.startswith(p) and not n[len(p):].startswith(own) and ".experts." not in n
    }
    experts = range(cfg.n_routed_experts)
    w = lambda e, proj: pair.tensors[f"{p}mlp.experts.{e}.{proj}.weight"]  # noqa: E731
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w(e, "gate_proj"), w(e, "up_proj")]) for e in experts])
    state["mlp.experts.down_proj"] = torch.stack([w(e, "down_proj") for e in experts])
    layer.load_state_dict(state, strict=True)
    return layer


@torch.no_grad()
def mtp_reference(pair: Pair, block: DeepseekV3DecoderLayer, hidden: torch.Tensor, next_ids: torch.Tensor):
    """h' = eh_proj([enorm(embed(t_next)); hnorm(h)]) -> decoder layer -> shared_head.norm -> head.

    hidden [B, S, H] is the target's final hidden state after model.norm at positions 0..S-1.
    """
    cfg, T = pair.cfg, pair.tensors
    p, eps = f"model.layers.{cfg.num_hidden_layers}.", cfg.rms_norm_eps
    e = rms_norm(F.embedding(next_ids, T[p + "embed_tokens.weight"]), T[p + "enorm.weight"], eps)
    h = rms_norm(hidden, T[p + "hnorm.weight"], eps)
    x = F.linear(torch.cat([e, h], dim=-1), T[p + "eh_proj.weight"])  # embedding first
    S = x.shape[1]
    positions = torch.arange(S)[None]
    causal = torch.full((S, S), float("-inf")).triu(1)[None, None]  # additive mask for eager attention
    x = block(x, attention_mask=causal, position_ids=positions,
              position_embeddings=pair.hf.model.rotary_emb(x, positions))
    h = rms_norm(x, T[p + "shared_head.norm.weight"], eps)
    return F.linear(h, T[p + "shared_head.head.weight"]), h


# ---------------------------------------------------------------------------------------------
# 1. Dense forward
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def test_dense_forward_matches_hf(pair):
    ids = token_ids(pair.cfg, (2, 24), seed=10)
    want = pair.hf(ids).logits
    got = pair.ours.logits(pair.ours(ids))
    assert 0.3 < want.std().item() < 3.0  # O(1) logits: an absolute tolerance means something
    assert_close(got, want, "dense forward")


# ---------------------------------------------------------------------------------------------
# 2. Token-by-token decode through the paged latent cache, ragged batch
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def test_paged_decode_matches_hf(pair):
    ids = token_ids(pair.cfg, (2, 15), seed=20)
    want = pair.hf(ids[:, : DECODE_LENS[0]]).logits  # causal: seq 1's first 9 logits ignore the rest
    got, _ = decode_ragged(pair.ours, ids, with_mtp=False)
    for s, n in enumerate(DECODE_LENS):
        assert_close(got[s], want[s, :n], f"paged decode seq {s}")


# ---------------------------------------------------------------------------------------------
# 3. A multi-token chunk appended to a cache
# ---------------------------------------------------------------------------------------------
# Prefill lengths, not block aligned and unequal: each longer than SHORT_QUERY, so each is its own
# attention group; chunks of 5 and 5 (one uniform group), 5 and 2 (one padded group), 10 and 3 (a
# long group and a short one in one step).
CHUNK_PREFIX = (9, 14)
# Lengths up to 19 and 19 -> 5 blocks each, scattered and interleaved; blocks 8 and 10 are never
# written (6 only by the 10-token chunk).
CHUNK_TABLES = [[11, 2, 9, 4, 6], [1, 7, 5, 3, 0]]


@pytest.mark.parametrize("chunk_lens", [(5, 5), (5, 2), (10, 3)], ids=["uniform_chunk", "ragged_chunk", "two_groups"])
@torch.no_grad()
def test_paged_chunk_matches_hf_and_hf_cache(pair, chunk_lens):
    """Prefill both sequences in one paged forward, then append a chunk to each in another."""
    ids = token_ids(pair.cfg, (2, max(CHUNK_PREFIX) + max(chunk_lens)), seed=30)
    runner = PagedRunner(pair.ours, CHUNK_TABLES)
    prefill, _ = runner.step([0, 1], [ids[s, :P] for s, P in enumerate(CHUNK_PREFIX)])
    chunk, _ = runner.step([0, 1], [ids[s, P: P + C] for s, (P, C) in enumerate(zip(CHUNK_PREFIX, chunk_lens))])
    for s, (P, C) in enumerate(zip(CHUNK_PREFIX, chunk_lens)):
        seq = ids[s: s + 1, : P + C]
        full = pair.hf(seq).logits[0]
        assert_close(prefill[s], full[:P], f"paged prefill seq {s} vs HF")
        assert_close(chunk[s], full[P:], f"paged chunk of {C}, seq {s} vs HF full forward")
        past = pair.hf(seq[:, :P], use_cache=True).past_key_values
        assert past.get_seq_length() == P
        cached = pair.hf(seq[:, P:], past_key_values=past, use_cache=True).logits[0]
        assert_close(chunk[s], cached, f"paged chunk of {C}, seq {s} vs HF cache")


# ---------------------------------------------------------------------------------------------
# 4. FP8 checkpoint
# ---------------------------------------------------------------------------------------------
@dataclass
class FP8Case:
    cfg: ModelConfig
    path: Path
    ours: DeepseekV3ForCausalLM  # from the FP8 checkpoint
    ours_bf16: DeepseekV3ForCausalLM  # the same tensors before quantization


@pytest.fixture(scope="module")
def fp8_case(pair, tmp_path_factory) -> FP8Case:
    # hidden_size 256: every weight reading or producing the hidden state spans two 128-wide
    # blocks, so a transposed or misindexed scale grid shows. The other dimensions stay below
    # 128 (one padded edge block). HF infers the block size from the scale grid
    # (rows // scale_rows), which is only right for dimensions that are multiples of 128 or
    # below it, so no dimension may be e.g. 192 here.
    cfg = parity_config(pair.cfg.q_lora_rank is not None, hidden_size=256)
    tensors = parity_tensors(cfg, seed=2)
    path = write_hf_checkpoint(
        tmp_path_factory.mktemp("parity_fp8") / "fp8", cfg, tensors.items(), fp8=True, max_shard_bytes=4 * SHARD_BYTES
    )
    assert HFCheckpoint(path).get("model.layers.1.self_attn.o_proj.weight_scale_inv", dequantize=False).shape == (2, 1)
    return FP8Case(cfg, path, load_ours(cfg, HFCheckpoint(path).iter_tensors()), load_ours(cfg, tensors.items()))


def dequantize_release(ckpt: HFCheckpoint) -> dict[str, torch.Tensor]:
    """The release's rule in plain torch: each 128x128 block of the e4m3 weight times its
    `weight_scale_inv` entry (edge blocks cut short); everything else as stored, in float32."""
    stored = dict(ckpt.iter_tensors(dequantize=False, dtype=None))
    out = {}
    for name, t in stored.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = stored[name + "_scale_inv"]
            rows, cols = t.shape
            assert scale.shape == (math.ceil(rows / 128), math.ceil(cols / 128))
            t = t.float() * scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        out[name] = t.float().contiguous()
    return out


@pytest.mark.parametrize("reference", ["hf_fp8", "hf_dequantized_fp32"])
@torch.no_grad()
def test_fp8_checkpoint_matches_hf(fp8_case, reference, tmp_path):
    """Ours reading the FP8 checkpoint (dequantized) against HF reading it.

    hf_fp8: HF loads the FP8 checkpoint itself (transformers 5.x dequantizes it on CPU; that
    needs `accelerate`). hf_dequantized_fp32: HF loads the stored tensors dequantized here by
    `dequantize_release` (independent of runtime/model/fp8.py) and saved as a plain float32 checkpoint
    (not through write_hf_checkpoint(fp8=False), which would round them to bf16).
    """
    cfg, fp8_path, ours = fp8_case.cfg, fp8_case.path, fp8_case.ours
    if reference == "hf_fp8":
        pytest.importorskip("accelerate", reason="transformers needs accelerate to load FP8 checkpoints")
        hf = load_hf(fp8_path, cfg)
    else:
        path = tmp_path / "fp32"
        path.mkdir()
        raw = cfg.to_dict()
        raw.pop("quantization_config", None)
        (path / "config.json").write_text(json.dumps(raw))
        save_file(dequantize_release(HFCheckpoint(fp8_path)), path / "model.safetensors")
        hf = load_hf(path, cfg)
    ids = token_ids(cfg, (2, 24), seed=40)
    got = ours.logits(ours(ids))
    assert_close(got, hf(ids).logits, f"FP8 checkpoint, {reference}")
    # The FP8 weights really are different from the bf16 ones (the test is not vacuous).
    assert max_diff(got, fp8_case.ours_bf16.logits(fp8_case.ours_bf16(ids))) > 10 * TOL


# ---------------------------------------------------------------------------------------------
# 5. MTP module vs a transcription of its equations, dense and paged
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def test_mtp_dense_matches_reference(pair):
    S = 24
    ids = token_ids(pair.cfg, (2, S + 1), seed=50)
    block = hf_mtp_block(pair)
    hf_hidden = pair.hf.model(ids[:, :S]).last_hidden_state  # after model.norm
    want_logits, want_h = mtp_reference(pair, block, hf_hidden, ids[:, 1:])
    hidden = pair.ours(ids[:, :S])
    got_logits, got_h = pair.ours.mtp_forward(0, ids[:, 1:], hidden)
    assert 0.3 < want_logits.std().item() < 3.0
    assert_close(got_logits, want_logits, "MTP dense logits")
    assert_close(got_h, want_h, "MTP dense hidden after shared_head.norm")


@torch.no_grad()
def test_mtp_paged_matches_reference(pair):
    ids = token_ids(pair.cfg, (2, 15), seed=60)
    n = DECODE_LENS[0]
    block = hf_mtp_block(pair)
    hf_hidden = pair.hf.model(ids[:, :n]).last_hidden_state
    want, _ = mtp_reference(pair, block, hf_hidden, ids[:, 1: n + 1])
    target, got = decode_ragged(pair.ours, ids, with_mtp=True)  # MTP uses cache layer N
    want_target = pair.hf(ids[:, :n]).logits
    for s, L in enumerate(DECODE_LENS):
        assert_close(target[s], want_target[s, :L], f"paged decode with MTP, target seq {s}")
        assert_close(got[s], want[s, :L], f"MTP paged seq {s}")


@torch.no_grad()
def test_chained_draft_training_rows_match_paged_drafting(pair, monkeypatch):
    """training/distill_mtp.py trains drafts 1..D in one dense forward with a mask; every row must
    equal the paged draft: draft d at p re-runs the layer on the hidden draft d-1 left at p-1, with
    the first drafts up to p-d+1 and the entries of the chain's earlier drafts in the cache."""
    from training.distill_mtp import chained_logits

    model, S, depth = pair.ours, 11, 3
    n = S - 1
    ids = token_ids(pair.cfg, (1, S), seed=90)
    dense = chained_logits(model, ids[:, 1:], model(ids)[:, :-1], depth)  # draft d: [1, n - d + 1, V]

    runner = PagedRunner(model, [[9, 6, 3]])
    batch = PagedBatch.build([0], [S], runner.block_tables, BLOCK_SIZE)
    paged_hidden = model(ids[0], batch=batch, kv_cache=runner.kv_cache)
    batch = PagedBatch.build([0], [n], runner.block_tables, BLOCK_SIZE)
    first, first_own = model.mtp_forward(0, ids[0, 1:], paged_hidden[:-1], batch=batch, kv_cache=runner.kv_cache)
    assert_close(first, dense[0][0], "first drafts vs paged MTP")
    checked = 0
    for m in range(n - 1):  # the chain that continues from the first draft at m
        kv, own = runner.kv_cache.clone(), first_own[m: m + 1]
        for d in range(2, min(depth, n - m) + 1):
            p = m + d - 1
            batch = PagedBatch.build([p], [1], runner.block_tables, BLOCK_SIZE)
            logits, own = model.mtp_forward(0, ids[0, p + 1: p + 2], own, batch=batch, kv_cache=kv)
            assert_close(logits[0], dense[d - 1][0, p - d + 1], f"draft {d} at position {p}")
            checked += 1
    assert checked == (n - 1) + (n - 2)


# (cached lengths, new tokens, expected groups as (first token, end, sequences, queries, padded)).
GROUP_CASES = {
    # short, long, short: a padded group at token 0, a 12-token chunk alone, a padded group after it
    "chunk_between_decodes": ((6, 2, 0, 9, 4), (1, 3, 12, 2, 1),
                              [(0, 4, 2, 3, True), (4, 16, 1, 12, False), (16, 19, 2, 2, True)]),
    # one long context among short ones: cut so the short ones do not gather 301 rows each
    "long_context_among_decodes": ((2, 3, 300, 1, 2), (1, 1, 1, 1, 1),
                                   [(0, 2, 2, 1, False), (2, 3, 1, 1, False), (3, 5, 2, 1, False)]),
}


@torch.no_grad()
@pytest.mark.parametrize("case", GROUP_CASES)
def test_attention_groups_match_one_padded_group(pair, monkeypatch, case):
    """Splitting a step into attention groups changes nothing but the padding: target hidden states
    and MTP logits equal those of one group padding every sequence to the longest chunk and context."""
    starts, lens, expected = GROUP_CASES[case]
    cfg, model = pair.cfg, pair.ours
    g = torch.Generator().manual_seed(80)
    need = [-(-(s + q) // BLOCK_SIZE) for s, q in zip(starts, lens)]
    ids_of_blocks = torch.randperm(sum(need), generator=g).split(need)  # scattered blocks
    tables = torch.zeros(len(need), max(need), dtype=torch.long)
    for b, blocks in enumerate(ids_of_blocks):
        tables[b, : len(blocks)] = blocks
    cache = 10.0 * torch.randn(model.num_cache_layers, sum(need) * BLOCK_SIZE, cfg.latent_dim, generator=g)
    ids = token_ids(cfg, (sum(lens),), seed=81)

    def run() -> tuple[PagedBatch, torch.Tensor, torch.Tensor]:
        batch = PagedBatch.build(starts, lens, tables, BLOCK_SIZE)
        kv = cache.clone()
        hidden = model(ids, batch=batch, kv_cache=kv)
        mtp, _ = model.mtp_forward(0, ids, hidden, batch=batch, kv_cache=kv, rows=batch.last_index)
        return batch, hidden, mtp

    grouped, hidden, mtp = run()
    assert [(g.start, g.end, g.batch_size, g.num_queries, g.query_index is not None) for g in grouped.groups] == expected
    monkeypatch.setattr("runtime.model.batch.SHORT_QUERY", 10**6)
    monkeypatch.setattr("runtime.model.batch.SPLIT_MIN_ROWS", 10**9)
    single, hidden_one, mtp_one = run()
    assert len(single.groups) == 1
    assert torch.equal(grouped.positions, single.positions) and torch.equal(grouped.slot_mapping, single.slot_mapping)
    assert_close(hidden, hidden_one, f"{case}: attention groups vs one padded group, target hidden")
    assert_close(mtp, mtp_one, f"{case}: attention groups vs one padded group, MTP logits")


def test_paged_batch_rejects_empty_query():
    with pytest.raises(ValueError, match=r"at least one new token, got \[3, 0, 2\]"):
        PagedBatch.build([0, 4, 1], [3, 0, 2], torch.zeros(3, 2, dtype=torch.long), BLOCK_SIZE)


@torch.no_grad()
@pytest.mark.parametrize("T", [0, 1, 2, 3, 4, 9])
def test_routed_experts_both_paths_match_sum_over_pairs(pair, T):
    """The per-pair path (fewer pairs than experts) and the grouped path equal sum_j w_j MLP_e_j(x)."""
    experts = pair.ours.model.layers[1].mlp.experts
    E, k = pair.cfg.n_routed_experts, pair.cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(70 + T)
    x = torch.randn(T, pair.cfg.hidden_size, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    w = torch.rand(T, k, generator=g)
    want = torch.zeros(T, pair.cfg.hidden_size)
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j])
            h = F.silu(x[t] @ experts.gate_proj[e].T) * (x[t] @ experts.up_proj[e].T)
            want[t] += w[t, j] * (h @ experts.down_proj[e].T)
    got = experts(x, w, idx)
    assert got.shape == want.shape
    if T:
        assert_close(got, want, f"routed experts, {T * k} pairs for {E} experts")


# ---------------------------------------------------------------------------------------------
# The comparisons above can fail
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def test_checks_can_fail(pair):
    """Each mistake below moves the logits (or MTP logits) far beyond TOL."""
    cfg = pair.cfg
    ids = token_ids(cfg, (2, 24), seed=10)
    base = pair.ours.logits(pair.ours(ids))

    def logits_of(model):
        return model.logits(model(ids))

    def with_cfg(**changes):
        return load_ours(dataclasses.replace(cfg, **changes), pair.tensors.items())

    perturbed = copy.deepcopy(pair.ours)
    perturbed.model.layers[2].self_attn.kv_b_proj.weight[0, 0] += 0.1
    no_bias = copy.deepcopy(pair.ours)
    for layer in no_bias.model.layers[cfg.first_k_dense_replace:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    chosen = []  # experts picked by layer 1's router for these tokens
    hook = pair.ours.model.layers[1].mlp.gate.register_forward_hook(lambda m, i, out: chosen.append(out[1]))
    pair.ours(ids)
    hook.remove()
    busiest = int(torch.bincount(chosen[0].flatten()).argmax())
    scaled_expert = copy.deepcopy(pair.ours)
    scaled_expert.model.layers[1].mlp.experts.up_proj[busiest] *= 1.01
    mistakes = {
        "one kv_b_proj element +0.1": logits_of(perturbed),
        "one routed expert's up_proj x1.01": logits_of(scaled_expert),
        "no correction bias": logits_of(no_bias),
        "plain RoPE instead of YaRN": logits_of(with_cfg(rope_scaling=None)),
        "mscale_all_dim changed": logits_of(with_cfg(
            rope_scaling=dataclasses.replace(cfg.rope_scaling, mscale_all_dim=cfg.rope_scaling.mscale_all_dim + 0.25))),
        "no group limit": logits_of(with_cfg(topk_group=cfg.n_group)),
        "routed_scaling_factor 1": logits_of(with_cfg(routed_scaling_factor=1.0)),
    }
    # MTP: its own embedding and head (independent random tensors here, copies in the release).
    hidden = pair.ours(ids[:, :-1])
    mtp_base, _ = pair.ours.mtp_forward(0, ids[:, 1:], hidden)
    swapped = copy.deepcopy(pair.ours)
    swapped.mtp[0].embed_tokens.weight.copy_(swapped.model.embed_tokens.weight)
    mtp_mistakes = {"MTP with the target's embedding": swapped.mtp_forward(0, ids[:, 1:], hidden)[0]}
    moved = {k: max_diff(v, base) for k, v in mistakes.items()}
    moved |= {k: max_diff(v, mtp_base) for k, v in mtp_mistakes.items()}
    print("moved:", {k: f"{v:.2e}" for k, v in moved.items()})
    small = {k: v for k, v in moved.items() if not v > 10 * TOL}
    assert not small, f"mistakes the parity tests would not catch: {small}"


@pytest.mark.parametrize("change", ["rms_norm_eps", "yarn_without_mscale"])
def test_config_corners_match_hf(change, tmp_path):
    """A config eps other than 1e-6 (q_a/kv_a norms keep 1e-6) and YaRN without the mscale keys
    (plain YaRN cos/sin factor) are read as HF reads them."""
    raw = parity_config(True).to_dict()
    if change == "rms_norm_eps":
        raw["rms_norm_eps"] = 1e-2
    else:
        raw["rope_scaling"] = {k: v for k, v in raw["rope_scaling"].items() if not k.startswith("mscale")}
    cfg = ModelConfig.from_dict(raw)
    tensors = parity_tensors(cfg, 2)
    path = write_hf_checkpoint(tmp_path / "ckpt", cfg, tensors.items(), fp8=False)
    ids = token_ids(cfg, (1, 20), 3)
    ours = load_ours(cfg, tensors.items())
    with torch.no_grad():
        assert_close(ours.logits(ours(ids)), load_hf(path, cfg)(ids).logits, change)


@pytest.mark.parametrize("change", ["yarn_betas_swapped", "top_level_original_max_position_embeddings",
                                    "original_max_position_embeddings_as_float", "rope_scaling_empty", "mscale_zero"])
def test_config_variants_read_as_transformers_reads_them(change, tmp_path):
    """config.json forms transformers loads, read as it reads them: YaRN's ramp over a negative span (beta_fast below
    beta_slow: we kept the span at least 1e-3, off by 5 in logits), the pre-YaRN length given only at the top level
    (transformers 5's reading; we used the default), as a float, an empty rope_scaling (plain RoPE) and an mscale of
    0 (no scale)."""
    cfg = parity_config(True)
    tensors = parity_tensors(cfg, 4)
    path = write_hf_checkpoint(tmp_path / "ckpt", cfg, tensors.items(), fp8=False)
    raw = json.loads((path / "config.json").read_text())
    yarn = raw["rope_scaling"]
    if change == "yarn_betas_swapped":
        yarn["beta_fast"], yarn["beta_slow"] = 1, 32
    elif change == "top_level_original_max_position_embeddings":
        raw["original_max_position_embeddings"] = 2 * yarn.pop("original_max_position_embeddings")
    elif change == "original_max_position_embeddings_as_float":
        yarn["original_max_position_embeddings"] = float(yarn["original_max_position_embeddings"])
    elif change == "mscale_zero":
        yarn["mscale_all_dim"] = 0  # falsy: no softmax scale and plain YaRN's cos/sin factor (refused before)
    else:
        raw["rope_scaling"] = {}
    (path / "config.json").write_text(json.dumps(raw))
    ckpt = HFCheckpoint(path)
    if change == "top_level_original_max_position_embeddings":
        assert ckpt.config.rope_scaling.original_max_position_embeddings == raw["original_max_position_embeddings"]
    ours = load_ours(ckpt.config, ckpt.iter_tensors())
    ids = token_ids(cfg, (1, 24), 6)
    with torch.no_grad():
        assert_close(ours.logits(ours(ids)), load_hf(path, ckpt.config)(ids).logits, change)


def test_config_as_installed_transformers_saves_it_matches_hf(pair, tmp_path):
    """Our reader of the config HF itself writes (transformers 5: YaRN in `rope_parameters`, no `rope_scaling`)
    gives HF's logits; reading it as plain RoPE would be off from position 1 on."""
    path = tmp_path / "resaved"
    shutil.copytree(pair.path, path)
    pair.hf.config.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in saved and not saved.get("rope_scaling"), sorted(saved)
    ckpt = HFCheckpoint(path)
    assert ckpt.config.rope_scaling == pair.cfg.rope_scaling
    ours = load_ours(ckpt.config, ckpt.iter_tensors())
    ids = token_ids(pair.cfg, (1, 24), 5)
    with torch.no_grad():
        assert_close(ours.logits(ours(ids)), pair.hf(ids).logits, "config saved by transformers")
