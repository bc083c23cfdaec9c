"""Tensor and expert parallelism as the model sees it: which part of each weight a rank holds, and the two
collectives the math needs, as in DeepSeek's inference/model.py.

- Attention heads, the dense MLP's and the shared expert's intermediate features and the vocabulary are split
  over the tp ranks (column parallel: each rank computes its own outputs; row parallel: each its partial sum).
- Routed experts are split over moe_ep_size ranks by expert, and each expert's intermediate features over
  moe_tp_size (moe_tp_size x moe_ep_size = tp_size; TensorRT-LLM's rank order,
  rank = moe_tp_rank * moe_ep_size + moe_ep_rank).
- A decoder layer sums its attention's and its MLP's partial outputs over the ranks (`Parallel.sum`), and the
  embedding its vocabulary pieces' lookups; the heads' logits are gathered (`Parallel.gather_vocab`).

At world size 1 every collective is the identity and nothing is sent or copied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class Layout:
    """tp_size ranks, routed experts over ep_size of them; `rank` this one. Every split dim is cut into
    equal chunks of ceil(n / parts) (`chunk`); the vocabulary's last chunk may be padded."""

    tp_size: int = 1
    ep_size: int = 1
    rank: int = 0

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def moe_ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def moe_tp_rank(self) -> int:
        return self.rank // self.ep_size

    def part(self, n: int) -> int:
        """Size of this rank's chunk of a tensor-parallel dim of n (heads, features, padded vocabulary)."""
        return math.ceil(n / self.tp_size)

    def experts(self, n: int) -> slice:
        """The routed experts this rank holds, of n."""
        return chunk(n, self.ep_size, self.moe_ep_rank)


def chunk(n: int, parts: int, i: int) -> slice:
    """Chunk i of n cut into `parts` equal chunks of ceil(n / parts), clipped to n."""
    size = math.ceil(n / parts)
    return slice(min(i * size, n), min((i + 1) * size, n))


class Parallel:
    """This rank's `Layout` and the collectives over its ranks' process group (none at world size 1; set once the
    ranks have loaded their weights and met, runtime.executors.ranks).

    Sums are all-gathers followed by one sum in rank order, so every rank gets the same bits (a ring
    all-reduce adds in a different order on each rank) and a result never depends on which rank computed it.
    `received_bytes` counts what this rank received, for the benchmark."""

    def __init__(self, layout: Layout = Layout()):
        self.layout = layout
        self.group: torch.distributed.ProcessGroup | None = None
        self.received_bytes = 0

    @property
    def size(self) -> int:
        return self.layout.tp_size

    def _gather(self, x: Tensor) -> Tensor:
        """[world, *x.shape]: every rank's x, in rank order."""
        x = x.contiguous()
        out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        self.group.allgather(list(out.unbind(0)), x).wait()
        self.received_bytes += (self.size - 1) * x.numel() * x.element_size()
        return out

    def sum(self, x: Tensor) -> Tensor:
        """The sum over the ranks of their partial outputs x (row-parallel linears, experts)."""
        return x if self.size == 1 else self._gather(x).sum(0)

    def gather_vocab(self, logits: Tensor, vocab_size: int) -> Tensor:
        """Every rank's vocabulary piece of the logits [..., V / tp] side by side, padding cut: [..., V]."""
        if self.size == 1:
            return logits
        return torch.cat(self._gather(logits).unbind(0), dim=-1)[..., :vocab_size]


WHOLE = Parallel()  # one process, the whole model


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding; a token another rank holds looks up zeros here, and the ranks' lookups
    are summed (exact: one rank holds each token)."""

    def __init__(self, vocab_size: int, dim: int, par: Parallel):
        rows = par.layout.part(vocab_size)
        super().__init__(rows, dim, _weight=torch.empty(rows, dim))  # loaded, not initialized (normal_ is slow on meta)
        self.par = par
        self.first = par.layout.rank * self.num_embeddings

    def forward(self, ids: Tensor) -> Tensor:
        if self.par.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        elsewhere = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(elsewhere, 0), self.weight).masked_fill(elsewhere[..., None], 0.0)
        return self.par.sum(rows)
