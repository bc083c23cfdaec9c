"""Tensor names of the DeepSeek release <-> parameters of `DeepseekV3ForCausalLM`.

The release stores the MTP layer as `model.layers.{num_hidden_layers + j}` and every routed
expert separately; our module keeps MTP layers under `mtp.{j}` and experts stacked [E, out, in].
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from runtime.config import ModelConfig
from runtime.model import DeepseekV3ForCausalLM

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"(.*mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


class WeightsError(ValueError):
    """A checkpoint whose tensors do not fill the model."""


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


def load_weights(model: DeepseekV3ForCausalLM, tensors: Iterable[tuple[str, Tensor]], source: str = "checkpoint",
                 with_mtp: bool = True) -> None:
    """Copy release-named tensors into the model; every parameter must be filled exactly once."""
    cfg = model.cfg
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    params.pop("inv_freq")
    expected_experts = cfg.n_routed_experts
    filled: dict[str, int] = {}
    with torch.no_grad():
        for name, tensor in tensors:
            internal, expert = to_internal(name, cfg)
            if internal.startswith("mtp.") and not with_mtp:
                continue
            if internal not in params:
                raise WeightsError(f"{source}: unexpected tensor {name!r}")
            target = params[internal] if expert is None else params[internal][expert]
            if tuple(target.shape) != tuple(tensor.shape):
                raise WeightsError(
                    f"{source}: tensor {name!r} has shape {list(tensor.shape)}, expected {list(target.shape)}"
                )
            target.copy_(tensor)
            filled[internal] = filled.get(internal, 0) + 1
    for internal, p in params.items():
        if internal.startswith("mtp.") and not with_mtp:
            continue
        want = expected_experts if internal.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")) else 1
        if filled.get(internal, 0) != want:
            raise WeightsError(f"{source}: missing tensor for {to_release(internal, cfg)!r}")


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
