"""DeepSeek-V3's auxiliary-loss-free expert balancing, for train_model (every gate) and distill_mtp (the MTP layer's):
no loss term pulls the router towards even loads; instead each gate's `e_score_correction_bias`, which only picks the
experts (not their weights), moves a fixed step towards the experts that took fewer tokens than the mean."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from runtime.model.deepseek_v3 import Gate


class ExpertBalancer:
    """A forward hook on each gate counts the tokens it sent to each expert in the last forward; `step()`, after an
    optimizer step, moves each bias by `gamma` up for the experts below the mean load and down for those above."""

    def __init__(self, gates: Iterable[Gate], gamma: float):
        self.gamma = gamma
        self.loads: dict[Gate, torch.Tensor] = {}
        self.hooks = [g.register_forward_hook(self._record) for g in gates]

    def _record(self, gate: Gate, inputs: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.loads[gate] = torch.bincount(output[1].flatten(), minlength=len(gate.e_score_correction_bias)).float()

    @torch.no_grad()
    def step(self) -> None:
        for gate, load in self.loads.items():
            gate.e_score_correction_bias += self.gamma * torch.sign(load.mean() - load)

    def remove(self) -> None:
        """Stop counting (the hooks removed)."""
        for h in self.hooks:
            h.remove()
