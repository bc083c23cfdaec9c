"""The CPU kernels as modules, swapped into the model where they run (as gpt-fast swaps quantized linears in).

`prepare` runs before the weights load: each part whose weights the kernels can keep as the release stores
them is replaced by a module that holds them so (linears: FP8 codes in scaled 128x128 blocks, or BF16; a
MoE layer's routed experts stacked FP8), and norms and attention by their kernel forms. The loader fills
them tensor by tensor (`load`). `finish` runs after: attention's per-head absorption weights, and each
decoder layer, the whole stack and the MTP module whose parts are all on the kernels as one call each.
Every module computes what the PyTorch module it replaces computes; `runtime.model.deepseek_v3` knows nothing of this.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.model import kernels
from runtime.model.batch import PagedBatch
from runtime.model.fp8 import FP8_DTYPE
from runtime.model.deepseek_v3 import (MLA, MLP, DecoderLayer, DecoderStack, DeepseekV3ForCausalLM, Experts, MoE,
                                      MTPLayer, RMSNorm, read_per_head)

log = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)
StoredDtype = Callable[[str], "torch.dtype | None"]  # parameter name -> the dtype its file stores it in


def swap_class(module: nn.Module, cls: type[M]) -> M:
    """`module` as an instance of `cls`, a subclass that only adds state or changes forward: the same
    parameters and children, under the same names."""
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    return new


class PackedLinear(nn.Module):
    """A bias-free linear whose weight stays as stored: FP8 codes with their block scales, or BF16. A float
    weight that is not exactly BF16 stays float32 and runs in PyTorch."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.packed: kernels.PackedWeight | None = None
        self.weight: Tensor | None = None  # float32 [out, in], when not packed

    def load(self, tensor: Tensor, scale: Tensor | None) -> None:
        if scale is not None:
            self.packed = kernels.pack_fp8(tensor, scale)
        else:
            self.packed = kernels.pack_bf16(tensor)
            if self.packed is None:
                self.weight = tensor.float().mT.contiguous().mT  # K-major, as plain CPU weights (loading)

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is None:
            return F.linear(x, self.weight)
        return kernels.packed_linear(x, self.packed)


class PackedExperts(nn.Module):
    """A MoE layer's routed experts (this rank's, from `first`), stacked FP8 [E, out, in] per projection, filled
    one expert at a time."""

    def __init__(self, experts: Experts):
        super().__init__()
        self.first = experts.first
        E, I, H = experts.gate_proj.shape
        self.gate_proj, self.up_proj = (kernels.PackedWeight.empty_fp8(E, I, H) for _ in range(2))
        self.down_proj = kernels.PackedWeight.empty_fp8(E, H, I)

    def load(self, name: str, expert: int | None, codes: Tensor, scale: Tensor) -> None:
        packed = getattr(self, name)
        for e, (c, s) in enumerate(zip(codes, scale)) if expert is None else [(expert, (codes, scale))]:
            kernels.pack_fp8_into(packed, e, c, s)


class KernelRMSNorm(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class KernelMLA(MLA):
    """Absorbed MLA in two kernel calls, reading latents in place from the paged cache; kv_b_proj split per head
    into the absorption weights once (`finish`)."""

    absorbed: tuple[Tensor, Tensor]  # W_UK [h, nope, c], W_UV^T [h, c, v]

    def absorb(self) -> None:
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(self.n_heads, -1, cfg.kv_lora_rank)
        self.absorbed = (w[:, : cfg.qk_nope_head_dim].contiguous(), w[:, cfg.qk_nope_head_dim :].transpose(1, 2).contiguous())

    def forward_paged(self, x: Tensor, rot: Tensor, batch: PagedBatch, kv_cache: Tensor) -> Tensor:
        if not batch.for_kernels:
            return super().forward_paged(x, rot, batch, kv_cache)
        cfg, cache = self.cfg, kv_cache[self.cache_layer]
        w_uk, w_uv = self.absorbed
        q = kernels.mla_prepare(self._project_q(x), self.kv_a_proj_with_mqa(x), rot, self.kv_a_layernorm.weight,
                                self.kv_a_layernorm.eps, w_uk, cfg.softmax_scale, cache, batch.slot_mapping)
        return self.o_proj(kernels.mla_attention(q, cache, batch.positions, batch.token_seq, batch.block_tables,
                                                 batch.block_size, w_uv))


class KernelMoE(MoE):
    """A whole MoE layer in one kernel call: routing, the routed experts (FP8) and the shared expert."""

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights = [t for p in (self.experts.gate_proj, self.experts.up_proj, self.experts.down_proj,
                               *(lin.packed for lin in self._shared())) for t in (p.panels, p.scale)]
        return kernels.moe(flat, self.gate.weight, self.gate.e_score_correction_bias, self.cfg, tuple(weights),
                           self.experts.first).view_as(x)

    def _shared(self) -> tuple[PackedLinear, PackedLinear, PackedLinear]:
        mlp = self.shared_experts
        return mlp.gate_proj, mlp.up_proj, mlp.down_proj


class _Fused:
    """A module whose whole forward is one kernel call over `handle` (the tensors of its parts, gathered). A
    copy or a pickle leaves the handle behind (it holds the original's tensors) and runs the parts' forwards."""

    handle: object | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "handle": None}


class FusedDecoderLayer(_Fused, DecoderLayer):
    def forward(self, x: Tensor, rot: Tensor, batch: PagedBatch | None, kv_cache: Tensor | None,
                mask: Tensor | None = None) -> Tensor:
        if self.handle is None or batch is None or not batch.for_kernels:
            return super().forward(x, rot, batch, kv_cache, mask)
        return kernels.decoder_layer(self.handle, x, rot, kv_cache, batch)


class FusedDecoderStack(_Fused, DecoderStack):
    def forward(self, x: Tensor, rot: Tensor, batch: PagedBatch | None, kv_cache: Tensor | None) -> Tensor:
        if self.handle is None or batch is None or not batch.for_kernels:
            return super().forward(x, rot, batch, kv_cache)
        return kernels.decoder_layers(self.handle, x, rot, kv_cache, batch)


class FusedMTPLayer(_Fused, MTPLayer):
    def forward(self, next_ids: Tensor, hidden: Tensor, rot: Tensor, batch: PagedBatch | None = None,
                kv_cache: Tensor | None = None, rows: Tensor | None = None, mask: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        if self.handle is None or batch is None or not batch.for_kernels:
            return super().forward(next_ids, hidden, rot, batch, kv_cache, rows, mask)
        return kernels.mtp_layer(self.handle, next_ids, hidden, rot, kv_cache, batch, rows)

    def greedy_drafts(self, rope: Callable[[Tensor], Tensor], next_ids: Tensor, hidden: Tensor, batch: PagedBatch,
                      kv_cache: Tensor, num_drafts: int) -> Tensor:
        """Greedy drafts [B, num_drafts] in one kernel call: this module over the catch-up `batch` (rotations from
        `rope`, the model's) proposes draft 1 at each sequence's last token; drafts 2.. follow at the next
        positions, each from the draft and hidden state before it: the tokens drafting step by step gives."""
        after = torch.arange(1, num_drafts, device=next_ids.device)[:, None]
        draft_positions = batch.positions[batch.last_index][None] + after  # [K - 1, B]
        rot = rope(torch.cat([batch.positions, draft_positions.flatten()]))
        T = batch.positions.numel()
        return kernels.mtp_greedy_drafts(self.handle, next_ids, hidden, rot[:T], kv_cache, batch, draft_positions,
                                         rot[T:].view(*draft_positions.shape, -1))


class GreedyStep:
    """The greedy step in one kernel call (`kernels.greedy_step`): the MTP catch-up and drafts, the verification
    forward and greedy acceptance (penalties and bans applied to each draft's and verified row's logits where given),
    or with no drafts the plain decoding forward and argmax, with only the emitted tokens, the verified hidden states
    and the emitted tokens' logprobs (where asked for) coming back, for a model whose layers and lm_head are each one
    call (`of`); drafting also needs its MTP module as one call (`mtp`, else None)."""

    def __init__(self, model: DeepseekV3ForCausalLM):
        head, norm = model.lm_head.packed, model.model.norm
        fused_mtp = len(model.mtp) > 0 and isinstance(model.mtp[0], FusedMTPLayer) and model.mtp[0].handle is not None
        self.mtp: object | None = model.mtp[0].handle if fused_mtp else None
        self.target = kernels.cpu_kernels().make_target(model.model.embed_tokens.weight, norm.weight, norm.eps,
                                                        model.model.layers.handle, head.panels, head.scale,
                                                        head.out_features, model.inv_freq, model.rope_attention_factor)

    @classmethod
    def of(cls, model: DeepseekV3ForCausalLM) -> "GreedyStep | None":
        """The step for `model`, or None where a part of the target is not on the kernels as one call."""
        layers, head = model.model.layers, model.lm_head
        fused = (isinstance(layers, FusedDecoderStack) and layers.handle is not None
                 and isinstance(head, PackedLinear) and head.packed is not None
                 and isinstance(model.model.norm, KernelRMSNorm))
        return cls(model) if fused else None

    def __call__(self, next_ids: Tensor, hidden: Tensor, kv_cache: Tensor, tables: list[list[int]], block_size: int,
                 num_mtp: list[int], num_cached: list[int], last_ids: list[int], num_drafts: list[int],
                 adjustments: tuple | None = None, logprobs: tuple[list[int], list[bool]] | None = None
                 ) -> tuple[list[list[int]], Tensor, Tensor]:
        """For B sequences, sequence b drafting num_drafts[b] >= 0 tokens after its num_cached[b] cached ones: the MTP
        module over the catch-up of those that draft (next_ids, hidden at positions num_mtp[b] ..; not read where none
        drafts), the drafts, and the target over [last_ids[b], drafts], with `adjustments` and `logprobs`
        (`kernels.greedy_step`) if given: each sequence's emitted tokens, the target's hidden states
        (num_drafts[b] + 1 rows per sequence, in order) and the emitted tokens' logprob rows."""
        return kernels.greedy_step(self.target, self.mtp, next_ids, hidden, kv_cache, tables, block_size, num_mtp,
                                   num_cached, last_ids, num_drafts, adjustments, logprobs)


# ---- swapping in ------------------------------------------------------------------------------------------
def cpu_kernels_serve(device: torch.device, dtype: torch.dtype) -> bool:
    """The kernels serve float32 models on CPUs that can run them."""
    return device.type == "cpu" and dtype == torch.float32 and kernels.cpu_kernels() is not None


def prepare(model: DeepseekV3ForCausalLM, stored: StoredDtype) -> None:
    """Swap in, before any weight is loaded, the kernel form of every part the kernels can hold as stored."""
    cfg = model.cfg
    moe_fits = (cfg.hidden_size % kernels.PANEL == cfg.moe_intermediate_size % kernels.PANEL == 0
                and cfg.n_shared_experts > 0 and cfg.n_routed_experts <= kernels.MAX_EXPERTS
                and cfg.n_group <= kernels.MAX_GROUPS)
    attention_fits = all(n % kernels.PANEL == 0 for n in (cfg.kv_lora_rank, cfg.latent_dim, cfg.v_head_dim))
    for name, module in list(model.named_modules()):
        if isinstance(module, MoE) and moe_fits and stored(f"{name}.experts.gate_proj") == FP8_DTYPE and \
                stored(f"{name}.shared_experts.gate_proj.weight") == FP8_DTYPE:
            module.experts = PackedExperts(module.experts)
            replace_submodule(model, name, swap_class(module, KernelMoE))
    for name, module in list(model.named_modules()):
        if isinstance(module, RMSNorm):
            replace_submodule(model, name, swap_class(module, KernelRMSNorm))
        elif isinstance(module, MLA) and attention_fits:
            replace_submodule(model, name, swap_class(module, KernelMLA))
        elif isinstance(module, nn.Linear) and not read_per_head(name):
            replace_submodule(model, name, PackedLinear(module.in_features, module.out_features))


def finish(model: DeepseekV3ForCausalLM) -> None:
    """After loading: absorption weights, one shared pack for the MTP head where it equals lm_head (the
    release stores a copy), and one kernel call for each layer, the stack and the MTP module whose parts all
    run on the kernels."""
    ext = kernels.cpu_kernels()
    for module in model.modules():
        if isinstance(module, KernelMLA):
            module.absorb()
        if isinstance(module, KernelMoE):  # a row per expert, as the routing kernel reads the router
            module.gate.weight.data = module.gate.weight.data.contiguous()
    for mtp in model.mtp:
        head, lm_head = mtp.shared_head.head, model.lm_head
        if head.packed is not None and lm_head.packed is not None and _same(head.packed, lm_head.packed):
            head.packed = lm_head.packed
    if model.par.size > 1:  # a fused layer would skip the sums over the ranks between its parts
        log.info("CPU kernels: rank %d of %d, each part on the kernels, layers not fused", model.par.layout.rank,
                 model.par.size)
        return
    for name, layer in list(model.named_modules()):
        if isinstance(layer, DecoderLayer) and (handle := _layer_handle(layer)) is not None:
            fused = swap_class(layer, FusedDecoderLayer)
            fused.handle = handle
            replace_submodule(model, name, fused)
    layers = model.model.layers
    if all(isinstance(layer, FusedDecoderLayer) for layer in layers):
        model.model.layers = swap_class(layers, FusedDecoderStack)
        model.model.layers.handle = ext.stack_layers([layer.handle for layer in layers])
    for j, mtp in enumerate(model.mtp):
        eh, head = mtp.eh_proj, mtp.shared_head.head
        if isinstance(mtp.block, FusedDecoderLayer) and eh.packed is not None and head.packed is not None:
            fused = swap_class(mtp, FusedMTPLayer)
            fused.handle = ext.make_mtp(
                mtp.embed_tokens.weight, mtp.enorm.weight, mtp.hnorm.weight, mtp.shared_head.norm.weight, mtp.enorm.eps,
                eh.packed.panels, eh.packed.scale, head.packed.panels, head.packed.scale, head.packed.out_features,
                mtp.block.handle)
            model.mtp[j] = fused
    packed = [n for n, m in model.named_modules() if isinstance(m, PackedLinear) and m.packed is not None]
    log.info("CPU kernels: %d linear weights held as stored (FP8 or BF16); %d of %d decoder layers and %d of %d MTP "
             "modules run as one call each", len(packed), sum(isinstance(m, FusedDecoderLayer) for m in model.modules()),
             model.num_cache_layers, sum(isinstance(m, FusedMTPLayer) for m in model.mtp), len(model.mtp))


def attends_in_kernels(model: nn.Module) -> bool:
    """Whether paged batches for `model` must be built in the per-token form the kernels read."""
    return any(isinstance(m, KernelMLA) for m in model.modules())


def _same(a: kernels.PackedWeight, b: kernels.PackedWeight) -> bool:
    return torch.equal(a.panels, b.panels) and torch.equal(a.scale, b.scale)


def replace_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def _layer_handle(layer: DecoderLayer) -> object | None:
    """The layer's weights gathered for `kernels.decoder_layer`, or None where some part is not on the kernels
    (a float32 linear, no q LoRA, a MoE on the PyTorch path)."""
    attn, ffn = layer.self_attn, layer.mlp
    linears = [getattr(attn, name, None) for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")]
    if isinstance(ffn, MLP):
        linears += [ffn.gate_proj, ffn.up_proj, ffn.down_proj]
    elif not isinstance(ffn, KernelMoE):
        return None
    if not isinstance(attn, KernelMLA) or not all(isinstance(lin, PackedLinear) and lin.packed is not None
                                                  for lin in linears):
        return None
    w = [lin.packed for lin in linears]
    cfg = attn.cfg
    moe = isinstance(ffn, KernelMoE)
    shared = [t for lin in ffn._shared() for t in (lin.packed.panels, lin.packed.scale)] if moe else []
    experts = [t for p in (ffn.experts.gate_proj, ffn.experts.up_proj, ffn.experts.down_proj)
               for t in (p.panels, p.scale)] if moe else []
    return kernels.cpu_kernels().make_layer(
        attn.cache_layer, layer.input_layernorm.weight, attn.q_a_layernorm.weight, attn.kv_a_layernorm.weight,
        layer.post_attention_layernorm.weight, layer.input_layernorm.eps, attn.q_a_layernorm.eps,
        attn.kv_a_layernorm.eps, *[[p.panels, p.scale] for p in w[:4]], [p.out_features for p in w],
        *attn.absorbed, cfg.softmax_scale,
        ffn.gate.weight if moe else None, ffn.gate.e_score_correction_bias if moe else None, cfg.n_group,
        cfg.topk_group, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.routed_scaling_factor,
        experts + shared, [t for p in w[4:] for t in (p.panels, p.scale)])
