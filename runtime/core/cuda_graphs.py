"""CUDA graphs for every step of up to MAX_QUERY new tokens per sequence (decode, verification, MTP
drafting, prefill chunks).

On a GPU, a decode step of this runtime is over a thousand small kernels; launched one by one from Python, the
launches take far longer than the GPU's work (docs/gpu.md). A graph captured once per batch shape replays them in
one launch, as vLLM and TensorRT-LLM do.

A graph needs fixed shapes and no host syncs: batches are laid out as [B, Q] tokens by
`PagedBatch.padded` (sequences padded to a power-of-two count B, block tables to a power-of-two
width, tokens past a sequence's query length written to the cache's scratch block), and the MoE
layer runs its sync-free paths on CUDA. Decodes and prefill chunks of a step replay separate graphs
(see `_groups`); chunks longer than MAX_QUERY run eagerly. An executor captures every decode shape it
can meet before it serves (`capture_decodes`, as vLLM does), so no request waits for a capture; prefill
chunks' shapes are captured on first use.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, product

import torch
from torch import Tensor
from tqdm import tqdm

from runtime.core.kv_cache import KVCache
from runtime.model.batch import SHORT_QUERY, PagedBatch
from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM


_CAPTURING = threading.Lock()
MAX_QUERY = 512  # longer prefill chunks run eagerly
MIN_CONTEXT = 256  # block tables padded to at least this many tokens: fewer shapes to capture as contexts grow
# Graphs of at most this many tokens are recorded with cuBLASLt's GEMMs, larger ones with cuBLAS's: each is the
# faster below / above it for this runtime's small GEMMs (docs/gpu.md)
CUBLASLT_MAX_TOKENS = 16


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _groups(lens: Sequence[int]) -> list[list[int]] | None:
    """Sequences of up to SHORT_QUERY new tokens (decodes) in one graph, longer chunks (prefill, padded
    to a power of two) in another, so that a prefill chunk does not pad every decode to its length."""
    if max(lens) > MAX_QUERY:
        return None
    short = [i for i, q in enumerate(lens) if q <= SHORT_QUERY]
    long = [i for i, q in enumerate(lens) if q > SHORT_QUERY]
    return [g for g in (short, long) if g]


def _token_rows(members: list[int], lens: Sequence[int]) -> list[int]:
    """Rows of the members' new tokens in the flat [sum(lens)] layout."""
    ends = list(accumulate(lens))
    return [t for i in members for t in range(ends[i] - lens[i], ends[i])]


def _in_order(pieces: list[Tensor], order: list[int]) -> Tensor:
    """Concatenated pieces whose rows are `order`, put back in 0, 1, 2, ... order."""
    out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    if order == sorted(order):
        return out
    return out[torch.tensor(order, device=out.device).argsort()]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: replayed eagerly (capture=False)
    meta: Tensor  # [B, 2 + width]: start, query length, block table
    inputs: list[Tensor]  # [B * Q, ...] each
    outputs: tuple[Tensor, ...]
    run: Callable[[], tuple[Tensor, ...]]


class CudaGraphRunner:
    """Target and MTP forwards over padded fixed-shape batches, one graph per (kind, B, Q, width):
    B and the width padded to powers of two, Q exact up to SHORT_QUERY, a power of two above.

    capture=False runs the same padded calls eagerly, so the padding is tested where there is no GPU.
    """

    def __init__(self, model: DeepseekV3ForCausalLM, cache: KVCache, capture: bool = True):
        self.model, self.cache, self.capture = model, cache, capture
        self.device = cache.tensor.device
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[tuple[str, int, int, int], _Graph] = {}

    def target(self, ids: Sequence[int], starts: Sequence[int], lens: Sequence[int],
               tables: Sequence[Sequence[int]]) -> Tensor | None:
        """Hidden states [sum(lens), H] after the final norm, as `model(...)` returns them; None when
        a sequence has more than MAX_QUERY new tokens."""
        groups = _groups(lens)
        if groups is None:
            return None
        pieces, order = [], []
        for members in groups:
            rows = _token_rows(members, lens)
            group_ids = torch.tensor(ids if len(groups) == 1 else [ids[t] for t in rows])
            g, index = self._prepare("target", members, starts, lens, tables, [group_ids], self._target_fn)
            hidden = g.outputs[0]
            pieces.append(hidden[: len(rows)].clone() if index is None else hidden[index])
            order += rows
        return _in_order(pieces, order)

    def mtp(self, ids: Tensor, hidden: Tensor, starts: Sequence[int], lens: Sequence[int],
            tables: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor] | None:
        """MTP layer 0 at each sequence's last new token: (logits [B, V], hidden after
        shared_head.norm [B, H]), as `model.mtp_forward(..., rows=batch.last_index)` returns them."""
        groups = _groups(lens)
        if groups is None:
            return None
        logits, states = [], []
        for members in groups:
            rows = None if len(groups) == 1 else torch.tensor(_token_rows(members, lens), device=self.device)
            inputs = [ids, hidden] if rows is None else [ids[rows], hidden[rows]]
            g, _ = self._prepare("mtp", members, starts, lens, tables, inputs, self._mtp_fn)
            logits.append(g.outputs[0][: len(members)].clone())
            states.append(g.outputs[1][: len(members)].clone())
        order = [i for members in groups for i in members]
        return _in_order(logits, order), _in_order(states, order)

    def decode_shapes(self, max_batch_size: int, max_query: int, max_seq_len: int, mtp: bool
                      ) -> list[tuple[str, int, int, int]]:
        """The (kind, B, Q, width) of every decode step of at most max_batch_size sequences of at most
        max_seq_len tokens with up to max_query new tokens each (1 + drafts; MTP catch-ups are as long)."""
        bs = self.cache.block_size
        sizes = sorted({_pow2(n) for n in range(1, max_batch_size + 1)})
        widths = sorted({max(_pow2(n), -(-MIN_CONTEXT // bs)) for n in range(1, -(-max_seq_len // bs) + 1)})
        kinds = ("target", "mtp") if mtp else ("target",)
        return list(product(kinds, sizes, range(1, min(max_query, SHORT_QUERY) + 1), widths))

    def capture_decodes(self, max_batch_size: int, max_query: int, max_seq_len: int, mtp: bool) -> int:
        """Capture the graph of every `decode_shapes` shape not captured yet; returns how many. Each runs
        on a batch of padding sequences, whose tokens write only to the cache's scratch block."""
        hidden = torch.zeros(1, self.model.cfg.hidden_size, dtype=self.cache.tensor.dtype)
        ids = torch.zeros(1, dtype=torch.long)
        todo = [key for key in self.decode_shapes(max_batch_size, max_query, max_seq_len, mtp) if key not in self.graphs]
        for kind, B, Q, width in tqdm(todo, desc="capturing CUDA graphs", unit="graph", disable=not todo):
            fn, inputs = (self._target_fn, [ids]) if kind == "target" else (self._mtp_fn, [ids, hidden])
            g = self.graphs[(kind, B, Q, width)] = self._new(fn, B, Q, width, inputs)
            g.meta.copy_(torch.tensor([self._padding_row(width)] * B))
            if self.capture:
                self._capture(g)
            else:
                g.outputs = g.run()
        return len(todo)

    # ---- the captured calls -------------------------------------------------------------------
    def _batch(self, meta: Tensor, Q: int) -> PagedBatch:
        return PagedBatch.padded(meta[:, 0], meta[:, 1], meta[:, 2:], self.cache.block_size, Q,
                                 self.cache.scratch_block * self.cache.block_size)

    def _target_fn(self, meta: Tensor, Q: int, ids: Tensor) -> tuple[Tensor, ...]:
        return (self.model(ids, batch=self._batch(meta, Q), kv_cache=self.cache.tensor),)

    def _mtp_fn(self, meta: Tensor, Q: int, ids: Tensor, hidden: Tensor) -> tuple[Tensor, ...]:
        batch = self._batch(meta, Q)
        return self.model.mtp_forward(0, ids, hidden, batch=batch, kv_cache=self.cache.tensor, rows=batch.last_index)

    # ---- padding, capture, replay -------------------------------------------------------------
    def _prepare(self, kind: str, members: list[int], starts: Sequence[int], lens: Sequence[int],
                 tables: Sequence[Sequence[int]], inputs: list[Tensor],
                 fn: Callable[..., tuple[Tensor, ...]]) -> tuple[_Graph, Tensor | None]:
        """Fill (or first capture) the graph for the shape of sequences `members` and replay it. Returns
        it and the rows of the real tokens in its [B * Q] layout (None when every sequence has Q tokens)."""
        starts, lens, tables = ([x[i] for i in members] for x in (starts, lens, tables))
        n, Q, bs = len(starts), max(lens), self.cache.block_size
        Q = Q if Q <= SHORT_QUERY else _pow2(Q)
        B = _pow2(n)
        width = max(_pow2(max(-(-(s + Q) // bs) for s in starts)), -(-MIN_CONTEXT // bs))
        scratch = self.cache.scratch_block
        # one row per sequence: start, query length, block table padded with the scratch block
        meta = torch.tensor([[s, q, *t[:width], *[scratch] * (width - len(t[:width]))]
                             for s, q, t in zip(starts, lens, tables)] + [self._padding_row(width)] * (B - n))
        index = None
        if any(q != Q for q in lens):
            index = torch.tensor([b * Q + j for b, q in enumerate(lens) for j in range(q)], device=self.device)
        key = (kind, B, Q, width)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._new(fn, B, Q, width, inputs)
        g.meta.copy_(meta)
        for buf, x in zip(g.inputs, inputs):
            if index is None:
                buf[: x.shape[0]].copy_(x)
            else:
                buf[index] = x.to(self.device)
        if not self.capture:
            g.outputs = g.run()
            return g, index
        if g.graph is None:
            self._capture(g)
        g.graph.replay()
        return g, index

    def _padding_row(self, width: int) -> list[int]:
        """Metadata of a padding sequence: one token at position 0 of the scratch block."""
        return [0, 1] + [self.cache.scratch_block] * width

    def _new(self, fn: Callable[..., tuple[Tensor, ...]], B: int, Q: int, width: int, inputs: list[Tensor]) -> _Graph:
        meta = torch.zeros(B, 2 + width, dtype=torch.long, device=self.device)
        bufs = [torch.zeros(B * Q, *x.shape[1:], dtype=x.dtype, device=self.device) for x in inputs]
        return _Graph(None, meta, bufs, (), lambda: fn(meta, Q, *bufs))

    def _capture(self, g: _Graph) -> None:
        """Run once on a side stream (allocator and library warm-up), then record, both with the BLAS
        library that suits the graph's token count (CUBLASLT_MAX_TOKENS). The warm-up computes this very
        call, so its cache writes are the ones the replay makes again. Python's garbage collector stays
        off while recording: a collection that frees another runner's graphs in the middle of a capture
        invalidates it; vLLM freezes it the same way."""
        with _CAPTURING:  # one capture at a time in the process, so that the switches below are not raced
            enabled, blas = gc.isenabled(), torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library(
                "cublaslt" if g.inputs[0].shape[0] <= CUBLASLT_MAX_TOKENS else "cublas")
            try:
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    g.run()
                torch.cuda.current_stream(self.device).wait_stream(stream)
                gc.disable()
                g.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g.graph, pool=self.pool, capture_error_mode="thread_local"):
                    g.outputs = g.run()
            finally:
                torch.backends.cuda.preferred_blas_library(blas)
                if enabled:
                    gc.enable()
