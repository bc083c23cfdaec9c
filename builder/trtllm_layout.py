"""The TensorRT-LLM checkpoint's layout: its tensor names (DeepSeek-V2 converter names, the MTP module as a
draft layer under `transformer.mtp_layers.{j}.`), what each rank file holds and stores it as, and its
config.json. docs/engine-format.md has the names and the sharding rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.io.engine_format import BuildConfig, shard_shape
from runtime.io.weights import parameter_shapes
from runtime.model.config import ModelConfig
from runtime.model.fp8 import BLOCK, FP8_DTYPE, scale_shape


MTP_PREFIX = "transformer.mtp_layers"


TRT_SCALE = "weights_scaling_factor"  # `<module>.weights_scaling_factor` next to `<module>.weight`


# Linear weights the FP8 algorithms quantize (runtime names). kv_b_proj stays unquantized, as
# upstream: absorbed MLA splits it per head. eh_proj, the router, embeddings and heads are not listed.
QUANTIZED = ("q_a_proj.weight", "q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight", "o_proj.weight",
             "gate_proj.weight", "up_proj.weight", "down_proj.weight",
             "experts.gate_proj", "experts.up_proj", "experts.down_proj")


# TensorRT-LLM's MoeConfig.ExpertScaleNormalizationMode (tensorrt_llm/layers/moe.py) for the group-limited routing
# DeepSeek uses: DEVICE_LIMITED takes the top-k weights as scored, DEVICE_LIMITED_RENORM renormalizes them to sum 1
# (DeepSeek's norm_topk_prob); its other modes (0 NONE, 1 RENORMALIZE, 2 SPARSE_MIXER) route without groups.
NORMALIZATION_MODES = {3: "DEVICE_LIMITED", 4: "DEVICE_LIMITED_RENORM"}
DEVICE_LIMITED, DEVICE_LIMITED_RENORM = NORMALIZATION_MODES
EXCLUDE_MODULES = ["*kv_b_proj*", "*eh_proj*", "*router*", "*shared_head*", "lm_head"]


FLOAT32 = ("mlp.gate.weight", "e_score_correction_bias")  # the router runs in fp32


# ---- names ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrtTensor:
    """One TensorRT-LLM weight and the runtime parameters it holds, concatenated along dim -2."""

    name: str
    parts: tuple[str, ...]

    @property
    def scale_name(self) -> str:
        return self.name.removesuffix("weight") + TRT_SCALE


def trtllm_tensors(cfg: ModelConfig) -> list[TrtTensor]:
    """Every TensorRT-LLM weight of the model, MTP draft layers last."""
    out = [TrtTensor("transformer.vocab_embedding.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.num_hidden_layers):
        out += _layer_tensors(cfg, i, f"model.layers.{i}.", f"transformer.layers.{i}.")
    out += [TrtTensor("transformer.ln_f.weight", ("model.norm.weight",)), TrtTensor("lm_head.weight", ("lm_head.weight",))]
    for j in range(cfg.num_nextn_predict_layers):
        src, dst = f"mtp.{j}.", f"{MTP_PREFIX}.{j}."
        out += [TrtTensor(dst + "vocab_embedding.weight", (src + "embed_tokens.weight",))]
        out += [TrtTensor(dst + n, (src + n,)) for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight")]
        out += _layer_tensors(cfg, cfg.num_hidden_layers + j, src + "block.", dst)
        out += [TrtTensor(dst + "shared_head_norm.weight", (src + "shared_head.norm.weight",)),
                TrtTensor(dst + "shared_head.weight", (src + "shared_head.head.weight",))]
    return out


def _layer_tensors(cfg: ModelConfig, layer: int, src: str, dst: str) -> list[TrtTensor]:
    a, m = src + "self_attn.", src + "mlp."
    pairs: list[tuple[str, tuple[str, ...]]] = [("input_layernorm.weight", (src + "input_layernorm.weight",))]
    if cfg.q_lora_rank is None:
        pairs += [("attention.fused_a.weight", (a + "kv_a_proj_with_mqa.weight",)),
                  ("attention.q_proj.weight", (a + "q_proj.weight",))]
    else:
        pairs += [("attention.fused_a.weight", (a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight")),
                  ("attention.q_a_layernorm.weight", (a + "q_a_layernorm.weight",)),
                  ("attention.q_b_proj.weight", (a + "q_b_proj.weight",))]
    pairs += [("attention.kv_a_layernorm.weight", (a + "kv_a_layernorm.weight",)),
              ("attention.kv_b_proj.weight", (a + "kv_b_proj.weight",)),
              ("attention.dense.weight", (a + "o_proj.weight",)),
              ("post_layernorm.weight", (src + "post_attention_layernorm.weight",))]
    if cfg.is_moe_layer(layer):
        pairs += [("mlp.router.weight", (m + "gate.weight",)),
                  ("mlp.e_score_correction_bias", (m + "gate.e_score_correction_bias",)),
                  ("mlp.fc.weight", (m + "experts.up_proj", m + "experts.gate_proj")),
                  ("mlp.proj.weight", (m + "experts.down_proj",))]
        if cfg.n_shared_experts:
            s = m + "shared_experts."
            pairs += [("mlp.shared_expert.fc.weight", (s + "up_proj.weight", s + "gate_proj.weight")),
                      ("mlp.shared_expert.proj.weight", (s + "down_proj.weight",))]
    else:
        pairs += [("mlp.fc.weight", (m + "gate_proj.weight",)), ("mlp.gate.weight", (m + "up_proj.weight",)),
                  ("mlp.proj.weight", (m + "down_proj.weight",))]
    return [TrtTensor(dst + name, parts) for name, parts in pairs]


def is_quantized(name: str, quant_algo: str | None) -> bool:
    return quant_algo is not None and name.endswith(QUANTIZED)


def stored_dtype(name: str, build: BuildConfig) -> torch.dtype:
    if is_quantized(name, build.quant_algo):
        return FP8_DTYPE
    return torch.float32 if name.endswith(FLOAT32) else build.torch_dtype


# ---- the layout of one rank ----------------------------------------------------------------------
@dataclass(frozen=True)
class PartLayout:
    """Where one runtime parameter's shard sits inside a (possibly fused) rank tensor."""

    name: str
    shape: tuple[int, ...]  # this rank's shard, lead dims (local experts) first
    row: int  # first row (dim -2) of the part in the fused tensor
    scale_shape: tuple[int, ...] | None  # None: not quantized
    scale_row: int  # first row of its block grid, or its index among the parts (per-tensor FP8)


@dataclass(frozen=True)
class TensorLayout:
    tensor: TrtTensor
    dtype: torch.dtype
    shape: tuple[int, ...]
    scale_shape: tuple[int, ...] | None
    parts: tuple[PartLayout, ...]


def rank_layout(cfg: ModelConfig, build: BuildConfig) -> list[TensorLayout]:
    """Names, dtypes and shapes of every tensor of a rank file; the same for every rank."""
    shapes = parameter_shapes(cfg)
    block = build.quant_algo == "FP8_BLOCK_SCALES"
    out = []
    for tt in trtllm_tensors(cfg):
        parts, row, scale_row = [], 0, 0
        for i, name in enumerate(tt.parts):
            shape = shard_shape(name, shapes[name], build)
            sshape = _scale_shape(shape, build.quant_algo) if is_quantized(name, build.quant_algo) else None
            parts.append(PartLayout(name, shape, row, sshape, scale_row if block else i))
            if len(shape) > 1:  # fused parts stack along dim -2, and so do their block grids
                row += shape[-2]
                scale_row += sshape[-2] if block and sshape is not None else 0
        first = parts[0]
        shape = first.shape if len(parts) == 1 else (*first.shape[:-2], row, first.shape[-1])
        sshape = None
        if first.scale_shape is not None:
            lead = first.shape[:-2]
            sshape = (*lead, scale_row, first.scale_shape[-1]) if block else (*lead, len(parts))
        out.append(TensorLayout(tt, stored_dtype(first.name, build), shape, sshape, tuple(parts)))
    return out


def _scale_shape(shape: tuple[int, ...], quant_algo: str) -> tuple[int, ...]:
    """Block FP8: one scale per 128x128 block (per expert); per-tensor FP8: one per weight (per expert)."""
    if quant_algo == "FP8_BLOCK_SCALES":
        return (*shape[:-2], *scale_shape(shape[-2:]))
    return tuple(shape[:-2])


# ---- the converter -------------------------------------------------------------------------------
def trtllm_config(cfg: ModelConfig, build: BuildConfig) -> dict[str, Any]:
    """config.json of the TensorRT-LLM checkpoint (DeepSeek-V2 converter field names)."""
    rs = cfg.rope_scaling
    return {
        "architecture": "DeepseekV3ForCausalLM",
        "dtype": build.dtype,
        "logits_dtype": "float32",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads or cfg.num_attention_heads,
        "head_size": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
        "hidden_act": "swiglu",
        "intermediate_size": cfg.intermediate_size,
        "norm_epsilon": cfg.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": cfg.max_position_embeddings,
        "use_parallel_embedding": True,
        "embedding_sharding_dim": 0,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": cfg.moe_layer_freq,
        "moe_inter_size": cfg.moe_intermediate_size,
        "topk_method": cfg.topk_method,
        "scoring_func": cfg.scoring_func,
        "rotary_base": cfg.rope_theta,
        "rotary_scaling": None if rs is None else {
            "type": rs.type, "factor": rs.factor, "original_max_position_embeddings": rs.original_max_position_embeddings,
            "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow, "mscale": rs.mscale, "mscale_all_dim": rs.mscale_all_dim,
        },
        "moe": {
            "num_experts": cfg.n_routed_experts,
            "top_k": cfg.num_experts_per_tok,
            "shared_expert_intermediate_size": cfg.n_shared_experts * cfg.moe_intermediate_size,
            "normalization_mode": DEVICE_LIMITED_RENORM if cfg.norm_topk_prob else DEVICE_LIMITED,
            "norm_topk_prob": cfg.norm_topk_prob,
            "device_limited_n_group": cfg.n_group,
            "device_limited_topk_group": cfg.topk_group,
            "device_limited_routed_scaling_factor": cfg.routed_scaling_factor,
            "topk_method": cfg.topk_method,
            "scoring_func": cfg.scoring_func,
        },
        "mapping": {"world_size": build.tp_size, "tp_size": build.tp_size, "pp_size": 1,
                    "moe_tp_size": build.moe_tp_size, "moe_ep_size": build.ep_size},
        "quantization": {
            "quant_algo": build.quant_algo,
            "kv_cache_quant_algo": None,
            "group_size": BLOCK[1],
            "exclude_modules": EXCLUDE_MODULES if build.quant_algo else None,
        },
        "speculative_decoding": {
            "decoding_type": "MTP" if cfg.num_nextn_predict_layers else None,
            "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
            "max_draft_len": build.max_draft_len,
            "draft_layer_prefix": MTP_PREFIX + ".",
        },
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }
