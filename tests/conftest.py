"""Shared test helpers: a tiny DeepSeek-V3 config and random weights for it.

The config keeps every feature of the real one (q LoRA, yarn, grouped routing with a bias,
a dense first layer, a shared expert, one MTP layer, FP8 quantization config) at toy sizes.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterator

import pytest
import torch

from runtime.checkpoint import expected_tensor_shapes
from runtime.config import ModelConfig

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_nextn_predict_layers": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}


def tiny_config_dict(**overrides: Any) -> dict[str, Any]:
    """config.json contents of the tiny model, with top-level fields replaced by `overrides`."""
    return {**copy.deepcopy(TINY_CONFIG), **overrides}


def random_tensors(cfg: ModelConfig, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, float32 tensor) for every tensor of the release layout, MTP included; deterministic."""
    g = torch.Generator().manual_seed(seed)
    for name, shape in expected_tensor_shapes(cfg).items():
        if name.endswith("e_score_correction_bias"):
            t = 0.01 * torch.randn(shape, generator=g)
        elif len(shape) == 1:  # norms
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = 0.05 * torch.randn(shape, generator=g)
        yield name, t


@pytest.fixture
def tiny_cfg() -> Callable[..., dict[str, Any]]:
    """Factory: tiny_cfg(**overrides) -> config.json dict (see tiny_config_dict)."""
    return tiny_config_dict


@pytest.fixture
def tiny_weights() -> Callable[..., Iterator[tuple[str, torch.Tensor]]]:
    """Factory: tiny_weights(cfg, seed) -> (name, tensor) stream (see random_tensors)."""
    return random_tensors
