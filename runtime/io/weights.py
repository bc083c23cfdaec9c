"""Tensor names of the DeepSeek release <-> parameters of `DeepseekV3ForCausalLM`.

The release stores the MTP layer as `model.layers.{num_hidden_layers + j}` and every routed
expert separately; our module keeps MTP layers under `mtp.{j}` and experts stacked [E, out, in].
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import Tensor

from runtime.model.config import ModelConfig
from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"(.*mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


def to_internal(name: str, cfg: ModelConfig) -> tuple[str, int | None]:
    """Release name -> (parameter name, expert index or None)."""
    m = _LAYER.fullmatch(name)
    if m and int(m.group(1)) >= cfg.num_hidden_layers:
        j, rest = int(m.group(1)) - cfg.num_hidden_layers, m.group(2)
        name = f"mtp.{j}.{rest}" if rest.startswith(_MTP_OWN) else f"mtp.{j}.block.{rest}"
    e = _EXPERT.fullmatch(name)
    if e and int(e.group(2)) < cfg.n_routed_experts:  # past n_routed_experts: an unexpected tensor
        return f"{e.group(1)}.{e.group(3)}", int(e.group(2))
    return name, None


def to_release(name: str, cfg: ModelConfig) -> str:
    """Parameter name -> release name (experts still stacked; see `release_tensors`)."""
    m = re.fullmatch(r"mtp\.(\d+)\.(?:block\.)?(.+)", name)
    if m:
        return f"model.layers.{cfg.num_hidden_layers + int(m.group(1))}.{m.group(2)}"
    return name


def release_tensors(model: DeepseekV3ForCausalLM) -> Iterator[tuple[str, Tensor]]:
    """The model's weights under release names, experts unstacked, in layer order."""
    cfg = model.cfg
    for name, t in list(model.named_parameters()) + [
        (n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
    ]:
        release = to_release(name, cfg)
        m = re.fullmatch(r"(.*mlp\.experts)\.(gate_proj|up_proj|down_proj)", release)
        if m:
            for e in range(t.shape[0]):
                yield f"{m.group(1)}.{e}.{m.group(2)}.weight", t[e].detach()
        else:
            yield release, t.detach()


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Runtime parameter name -> full shape, from a model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shapes |= {n: tuple(b.shape) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    return shapes
