"""DeepSeek-V3 and its MTP module in plain PyTorch, top to bottom like the math.

Two attention paths share every weight:
- dense: a [B, S] batch with a causal mask and the naive MLA expansion through kv_b_proj
  (training and reference forwards);
- paged: a flat ragged batch of T new tokens from many sequences, written into a latent KV cache
  that holds only normalized c_kv and the roped shared key, attended with absorbed MLA (decode,
  chunked prefill and speculative verification are all "a chunk of q tokens per sequence").
The model knows nothing about requests; `PagedBatch` describes where each token lives. Where the CPU
kernels run, `runtime.model.kernels.modules` swaps in modules that compute the same with them.

Under tensor and expert parallelism (`runtime.model.parallel`) each rank builds the same model with its
part of every split weight: its heads, its intermediate features, its experts, its vocabulary rows. What
MLA compresses is replicated: every head attends over the whole latent c_kv and the shared k_pe, so each
rank computes them (kv_a_proj is small) and keeps the whole latent cache; only the per-head up-projections
(q_b_proj, kv_b_proj) and o_proj's inputs are split. A decoder layer sums its attention's and its MLP's
partial outputs over the ranks, once each: the only collectives besides the embedding's and the logits'.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.model.batch import AttentionGroup, PagedBatch
from runtime.model.config import ModelConfig, yarn_mscale
from runtime.model.parallel import WHOLE, Parallel, VocabParallelEmbedding


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> tuple[Tensor, float]:
    """Inverse frequencies (YaRN-blended when rope_scaling is set) and the rotation's scale, on the CPU (also
    while a model is built under the meta device, where these ops would take torch's slow reference path)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    rs = cfg.rope_scaling
    if rs is None:
        return freq, 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
    span = high - low if high != low else 1e-3  # DeepSeek's and transformers' linear_ramp_factor, sign and all
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / span).clamp(0, 1)
    freq = freq / rs.factor * ramp + freq * (1 - ramp)
    if rs.mscale and rs.mscale_all_dim:  # DeepSeek-V3 gives both (equal): the factor is 1
        return freq, yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    return freq, yarn_mscale(rs.factor, 1.0)  # plain YaRN, as HF and vLLM


def apply_rope(x: Tensor, rot: Tensor) -> Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3)... as complex numbers by `rot` (one per pair)."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rot).flatten(-2).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ---------------------------------------------------------------------------------------------
# Multi-head latent attention
# ---------------------------------------------------------------------------------------------
def read_per_head(linear: str) -> bool:
    """Whether MLA reads Linear `linear`'s weight itself, per head (kv_b_proj: absorbed attention's W_UK / W_UV):
    such a Linear stays an nn.Linear where the FP8 and kernel paths swap every other one."""
    return linear.endswith("kv_b_proj")


class MLA(nn.Module):
    """This rank's heads (all of them at world size 1); its output is their part of o_proj's sum."""

    def __init__(self, cfg: ModelConfig, cache_layer: int, par: Parallel = WHOLE):
        super().__init__()
        self.cfg, self.cache_layer = cfg, cache_layer
        H, h = cfg.hidden_size, par.layout.part(cfg.num_attention_heads)
        self.n_heads = h
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(H, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)  # fixed eps, as DeepSeek and HF
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, H, bias=False)

    def _project_q(self, x: Tensor) -> Tensor:
        return self.q_proj(x) if self.cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _queries(self, x: Tensor, rot: Tensor) -> tuple[Tensor, Tensor]:
        cfg = self.cfg
        q = self._project_q(x).view(*x.shape[:-1], self.n_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        return q_nope, apply_rope(q_pe, rot.unsqueeze(-2))

    def _latent(self, x: Tensor, rot: Tensor) -> tuple[Tensor, Tensor]:
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(c), apply_rope(k_pe, rot)

    def forward_dense(self, x: Tensor, rot: Tensor, mask: Tensor | None = None) -> Tensor:
        """x [B, S, H], causal over S unless `mask` [S, S] (True: row may attend to column) says
        otherwise; the naive expansion of c into per-head keys and values."""
        cfg = self.cfg
        B, S, _ = x.shape
        q_nope, q_pe = self._queries(x, rot)
        c, k_pe = self._latent(x, rot)
        kv = self.kv_b_proj(c).view(B, S, self.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(B, S, self.n_heads, -1)], dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
            scale=cfg.softmax_scale,
        )
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))

    def _attend(self, q: Tensor, cache: Tensor, g: AttentionGroup) -> Tensor:
        """Softmax over one group's context rows, [c | k_pe] . q, then the weighted sum of c."""
        B, Q, h = g.batch_size, g.num_queries, self.n_heads
        if g.query_index is not None:
            q = torch.cat([q, q.new_zeros(1, h, q.shape[-1])])[g.query_index]  # [B, Q, h, latent]
        ctx = cache.index_select(0, g.context_slots).view(B, g.context_len, -1)  # [B, L, latent]
        scores = torch.bmm(q.view(B, Q * h, -1), ctx.transpose(1, 2))  # [B, Q*h, L]
        if g.blocked is not None:
            scores = scores.view(B, Q, h, -1).masked_fill(g.blocked, float("-inf")).view(B, Q * h, -1)
        o_lat = torch.bmm(scores.softmax(dim=-1), ctx[..., : self.cfg.kv_lora_rank]).view(B * Q, h, -1)
        return o_lat if g.token_index is None else o_lat[g.token_index]  # [T_g, h, c]

    def forward_paged(self, x: Tensor, rot: Tensor, batch: PagedBatch, kv_cache: Tensor) -> Tensor:
        """x [T, H]: write each token's latent to its slot, then absorbed attention over the cache.

        scores = (q_nope W_UK) . c + q_pe . k_pe, so one matmul against the [c | k_pe] cache rows;
        out = (softmax @ c) W_UV^T. No per-head keys or values are ever materialized.
        """
        cfg, h = self.cfg, self.n_heads
        T = x.shape[0]
        cache = kv_cache[self.cache_layer]
        q_nope, q_pe = self._queries(x, rot)  # [T, h, nope], [T, h, rope]
        c, k_pe = self._latent(x, rot)
        cache.index_copy_(0, batch.slot_mapping, torch.cat([c, k_pe], dim=-1))

        w = self.kv_b_proj.weight.view(h, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        w_uk, w_uv = w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]  # [h, nope, c], [h, v, c]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, h, c]
        q = torch.cat([q_lat, q_pe], dim=-1) * cfg.softmax_scale  # [T, h, latent]
        if len(batch.groups) == 1:  # the common case (decode only): no copy
            o_lat = self._attend(q, cache, batch.groups[0])
        else:
            o_lat = torch.cat([self._attend(q[g.start : g.end], cache, g) for g in batch.groups])
        o = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2))  # [h, T, v]
        return self.o_proj(o.transpose(0, 1).reshape(T, h * cfg.v_head_dim))


# ---------------------------------------------------------------------------------------------
# Mixture of experts (noaux_tc routing)
# ---------------------------------------------------------------------------------------------
class Gate(nn.Module):
    """Sigmoid scores; the correction bias steers selection only; group-limited top-k. (Exact ties
    between experts, e.g. saturated sigmoids, go to an order torch.topk leaves unspecified; the CPU
    kernel's routing takes the lower expert index.)"""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        cfg = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        biased = scores + self.e_score_correction_bias
        groups = biased.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
        group_scores = groups.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
        biased = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        idx = biased.topk(cfg.num_experts_per_tok, dim=-1).indices  # [T, k]
        weights = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return (weights * cfg.routed_scaling_factor).to(x.dtype), idx


class Experts(nn.Module):
    """Routed experts stacked as [E, out, in] tensors (with expert parallelism this rank's experts, from
    `first`; pairs routed to other ranks' experts weigh nothing here), run one of three ways by how many
    (token, expert) pairs the batch has and where it runs:

    - no more pairs than experts (decode, verifying a token or two): each pair's expert weights
      gathered and one batched MLP over the pairs; no sorting, no host sync;
    - otherwise on CPU: tokens grouped by expert, one matmul chain per chosen expert, as DeepSeek's
      reference does (the group sizes are read back to the host);
    - otherwise on CUDA: every expert over every token, weighted by a [T, E] routing matrix that is
      zero where a token was not routed. E / top-k times the FLOPs, but no host sync, so a CUDA graph
      can hold it; with a few experts the GPU does not notice the extra FLOPs.
    """

    def __init__(self, cfg: ModelConfig, par: Parallel = WHOLE):
        super().__init__()
        held, layout = par.layout.experts(cfg.n_routed_experts), par.layout
        self.first, self.expert_parallel = held.start, layout.ep_size > 1
        E, H = math.ceil(cfg.n_routed_experts / layout.ep_size), cfg.hidden_size
        I = math.ceil(cfg.moe_intermediate_size / layout.moe_tp_size)
        self.gate_proj = nn.Parameter(torch.empty(E, I, H))
        self.up_proj = nn.Parameter(torch.empty(E, I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def stacked(self, name: str, e: Tensor | int | None = None) -> Tensor:
        """Projection `name`'s weights as real values: every expert's [E, out, in], or those of experts `e`."""
        w = getattr(self, name)
        return w if e is None else w[e]

    def _mlp(self, e: int, rows: Tensor) -> Tensor:
        return F.silu(F.linear(rows, self.stacked("gate_proj", e))) * F.linear(rows, self.stacked("up_proj", e))

    def forward(self, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
        T, k = idx.shape
        if self.expert_parallel:
            idx = idx - self.first
            held = (idx >= 0) & (idx < self.gate_proj.shape[0])
            weights, idx = weights * held, idx.clamp(0, self.gate_proj.shape[0] - 1)
        if T * k <= self.gate_proj.shape[0]:
            return self._pairs(x, weights, idx)
        return self._dense(x, weights, idx) if x.is_cuda else self._grouped(x, weights, idx)

    def _pairs(self, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
        (T, k), H = idx.shape, x.shape[-1]
        e = idx.flatten()
        rows = x[:, None].expand(T, k, H).reshape(T * k, 1, H)
        h = F.silu(rows @ self.stacked("gate_proj", e).mT) * (rows @ self.stacked("up_proj", e).mT)
        return ((h @ self.stacked("down_proj", e).mT).view(T, k, H) * weights[..., None]).sum(1)

    def _dense(self, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
        h = F.silu(x @ self.stacked("gate_proj").mT) * (x @ self.stacked("up_proj").mT)  # [E, T, I]
        routed = x.new_zeros(idx.shape[0], self.gate_proj.shape[0]).scatter_(1, idx, weights)  # [T, E]
        return torch.einsum("te,eth->th", routed, h @ self.stacked("down_proj").mT)

    def _grouped(self, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
        E, k = self.gate_proj.shape[0], idx.shape[1]
        flat = idx.flatten()
        order = flat.argsort()
        counts = torch.bincount(flat, minlength=E).tolist()
        token = order // k
        outs = [F.linear(self._mlp(e, rows), self.stacked("down_proj", e)) for e, rows in enumerate(x[token].split(counts)) if counts[e]]
        y = torch.cat(outs) * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token, y)


class MoE(nn.Module):
    """Routing is replicated (every rank routes every token alike); the experts and the shared expert are
    this rank's parts, so the output is this rank's part of the sum."""

    def __init__(self, cfg: ModelConfig, par: Parallel = WHOLE):
        super().__init__()
        self.cfg = cfg
        self.gate = Gate(cfg)
        self.experts = Experts(cfg, par)
        self.shared_experts = MLP(cfg.hidden_size, par.layout.part(cfg.n_shared_experts * cfg.moe_intermediate_size))

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, idx = self.gate(flat)
        return (self.experts(flat, weights, idx) + self.shared_experts(flat)).view_as(x)


# ---------------------------------------------------------------------------------------------
# Decoder, model, MTP
# ---------------------------------------------------------------------------------------------
class DecoderLayer(nn.Module):
    """Attention and MLP, each adding the sum over the ranks of their partial outputs to the residual."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, cache_layer: int, par: Parallel = WHOLE):
        super().__init__()
        self.par = par
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg, cache_layer, par)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg, par) if cfg.is_moe_layer(layer_idx) else \
            MLP(cfg.hidden_size, par.layout.part(cfg.intermediate_size))

    def forward(self, x: Tensor, rot: Tensor, batch: PagedBatch | None, kv_cache: Tensor | None,
                mask: Tensor | None = None) -> Tensor:
        h = self.input_layernorm(x)
        if batch is None:
            x = x + self.par.sum(self.self_attn.forward_dense(h, rot, mask))
        else:
            x = x + self.par.sum(self.self_attn.forward_paged(h, rot, batch, kv_cache))
        return x + self.par.sum(self.mlp(self.post_attention_layernorm(x)))


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, par: Parallel = WHOLE):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, par.layout.part(cfg.vocab_size), bias=False)  # this rank's vocabulary


class MTPLayer(nn.Module):
    """h' = eh_proj([enorm(embed(t_next)); hnorm(h)]) -> one decoder layer -> shared_head."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, par: Parallel = WHOLE):
        super().__init__()
        self.vocab_size, self.par = cfg.vocab_size, par
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, par)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)  # replicated
        self.block = DecoderLayer(cfg, layer_idx, cache_layer=layer_idx, par=par)
        self.shared_head = SharedHead(cfg, par)

    def forward(
        self, next_ids: Tensor, hidden: Tensor, rot: Tensor,
        batch: PagedBatch | None = None, kv_cache: Tensor | None = None, rows: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Returns (logits for the token after next_ids, hidden after shared_head.norm), at `rows`
        only when given (drafting needs the head at each sequence's last position alone)."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(next_ids)), self.hnorm(hidden)], dim=-1))
        h = self.shared_head.norm(self.block(x, rot, batch, kv_cache, mask))
        if rows is not None:
            h = h[rows]
        return self.par.gather_vocab(self.shared_head.head(h), self.vocab_size), h


class DecoderStack(nn.ModuleList):
    """The target's decoder layers, applied in turn."""

    def forward(self, x: Tensor, rot: Tensor, batch: PagedBatch | None, kv_cache: Tensor | None) -> Tensor:
        for layer in self:
            x = layer(x, rot, batch, kv_cache)
        return x


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, par: Parallel = WHOLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, par)
        self.layers = DecoderStack(DecoderLayer(cfg, i, cache_layer=i, par=par) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    """Target model plus `num_nextn_predict_layers` MTP layers (cache layers N, N+1, ...); `par`: this rank's
    part of it and its collectives (`runtime.model.parallel`), the whole model by default."""

    def __init__(self, cfg: ModelConfig, par: Parallel = WHOLE):
        super().__init__()
        self.cfg, self.par = cfg, par
        self.model = DeepseekV3Model(cfg, par)
        self.lm_head = nn.Linear(cfg.hidden_size, par.layout.part(cfg.vocab_size), bias=False)  # this rank's vocabulary
        N = cfg.num_hidden_layers
        self.mtp = nn.ModuleList(MTPLayer(cfg, N + j, par) for j in range(cfg.num_nextn_predict_layers))
        inv_freq, self.rope_attention_factor = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def num_cache_layers(self) -> int:
        return self.cfg.num_cache_layers

    def rope(self, positions: Tensor) -> Tensor:
        """One complex rotation per position and rope pair, scaled by the YaRN attention factor."""
        freqs = positions[..., None].float() * self.inv_freq
        return torch.polar(torch.full_like(freqs, self.rope_attention_factor), freqs)

    def forward(
        self, input_ids: Tensor, positions: Tensor | None = None,
        batch: PagedBatch | None = None, kv_cache: Tensor | None = None,
    ) -> Tensor:
        """Hidden states after the final norm (what lm_head and the MTP module see).

        Dense: input_ids [B, S] (positions default to 0..S-1). Paged: input_ids [T] with `batch`.
        """
        if positions is None:
            positions = batch.positions if batch is not None else torch.arange(input_ids.shape[-1], device=input_ids.device)
        x = self.model.layers(self.model.embed_tokens(input_ids), self.rope(positions), batch, kv_cache)
        return self.model.norm(x)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.par.gather_vocab(self.lm_head(hidden), self.cfg.vocab_size)

    def mtp_forward(
        self, depth: int, next_ids: Tensor, hidden: Tensor, positions: Tensor | None = None,
        batch: PagedBatch | None = None, kv_cache: Tensor | None = None, rows: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """MTP layer `depth` at the positions of `hidden`: logits for t+2 and its own hidden
        (at `rows` only, when given). Dense `mask` [S, S]: see `MLA.forward_dense`."""
        if positions is None:
            positions = batch.positions if batch is not None else torch.arange(next_ids.shape[-1], device=next_ids.device)
        return self.mtp[depth](next_ids, hidden, self.rope(positions), batch, kv_cache, rows, mask)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int | None = None) -> None:
        """GPT-2 style init for training from scratch: residual outputs scaled by 1/sqrt(2L)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        resid_std = std / math.sqrt(2 * self.cfg.num_cache_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                s = resid_std if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * s)
        for m in self.modules():
            if isinstance(m, Gate):
                m.e_score_correction_bias.zero_()
