"""Where a paged step's tokens go in the latent KV cache and what each may attend to.

One batch description flows into the model for prefill chunks, decode and verification alike: a decode is
a chunk of 1 new token, a verification a chunk of 1 + k. `PagedBatch.build` makes it from host integers
(the runner's sequences); `PagedBatch.padded` from device tensors alone, for CUDA graphs; the CPU kernels
read a per-token form (`for_kernels`) that carries the block tables instead of attention groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

SHORT_QUERY = 8  # sequences with at most this many new tokens (a decode with up to 7 drafts) share one padded group
SPLIT_MIN_ROWS = 256  # a run of short sequences is cut where that saves more padded context rows (~ one group's cost)


@dataclass
class AttentionGroup:
    """Consecutive sequences attended together: flat tokens [start, end) padded to [B, Q] queries
    against [B, L] context slots. Decodes (1 + k tokens each) share a group; each longer prefill
    chunk gets its own, so a 60-token chunk does not pad every decode in the step to 60 queries, and
    decodes are cut into more groups where their contexts differ enough (one 1000-token context
    would otherwise make every decode in the step gather 1000 rows)."""

    start: int
    end: int
    batch_size: int  # B
    num_queries: int  # Q
    context_slots: Tensor  # [B * L] cache slots of each sequence's context, new tokens included
    context_len: int  # L
    blocked: Tensor | None  # [B, Q, 1, L] True where query q of sequence b must not see slot l; None: nothing is
    query_index: Tensor | None  # [B, Q] row of each query in [start, end); padding points at a zero row; None: no padding
    token_index: Tensor | None  # [end - start] position of each token in the [B * Q] padded layout


@dataclass
class PagedBatch:
    """Where the T new tokens of many sequences go in the cache and what each one may attend to."""

    positions: Tensor  # [T] absolute position of each new token
    slot_mapping: Tensor  # [T] cache slot each new token's latent is written to
    last_index: Tensor  # [sequences] flat index of the last new token of each sequence
    groups: list[AttentionGroup]  # empty when the CPU kernel attends (it reads the block tables itself)
    token_seq: Tensor | None = None  # [T] sequence of each token, for the CPU kernel
    block_tables: Tensor | None = None  # for the CPU kernel
    block_size: int = 0

    @classmethod
    def build(
        cls, start_lens: Sequence[int], query_lens: Sequence[int], block_tables: Tensor, block_size: int,
        for_kernels: bool = False,
    ) -> "PagedBatch":
        """start_lens[b] tokens of sequence b are cached already; query_lens[b] >= 1 new ones follow.

        block_tables [sequences, >= blocks of the longest sequence]; lengths are host integers, so
        the shapes are known without a device sync and decode steps skip the masking work.
        for_kernels: the per-token form the CPU kernels read (attention in `kernels.mla_attention` needs only each
        token's sequence and the block tables).
        """
        if min(query_lens) < 1:
            raise ValueError(f"every sequence in a paged batch needs at least one new token, got {list(query_lens)}")
        if for_kernels:
            return cls._per_token(start_lens, query_lens, block_tables, block_size)
        n, totals = len(query_lens), [s + q for s, q in zip(start_lens, query_lens)]
        long = [q > SHORT_QUERY for q in query_lens]
        bounds, run = [], 0
        for b in range(1, n + 1):
            if b == n or long[b] or long[b - 1]:  # [run, b) is one long chunk or a run of short ones
                bounds += [] if long[run] else _cuts(totals, run, b)
                bounds.append(b)
                run = b
        groups, positions, slots, b0, t0 = [], [], [], 0, 0
        for b1 in bounds:
            g, pos, slot = _build_group(start_lens[b0:b1], query_lens[b0:b1], block_tables[b0:b1], block_size, t0)
            groups.append(g)
            positions.append(pos)
            slots.append(slot)
            b0, t0 = b1, g.end
        last_index = torch.tensor(list(accumulate(query_lens)), device=block_tables.device) - 1
        return cls(torch.cat(positions), torch.cat(slots), last_index, groups)

    @classmethod
    def padded(cls, starts: Tensor, query_lens: Tensor, block_tables: Tensor, block_size: int, num_queries: int,
               scratch_slot: int) -> "PagedBatch":
        """B sequences laid out as [B, Q] tokens, from device tensors alone: start [B] cached tokens,
        query_lens [B] <= Q new ones; tokens past a sequence's query length are padding and write to
        `scratch_slot`. Shapes depend only on B, Q and the tables' width, and nothing is read back to
        the host, so a CUDA graph captured over it replays for any values (T = B * Q rows, padding
        included; last_index points at each sequence's last real token)."""
        device = block_tables.device
        B, Q = block_tables.shape[0], num_queries
        L = block_tables.shape[1] * block_size
        context_slots = (block_tables[:, :, None] * block_size + torch.arange(block_size, device=device)).view(B, L)
        steps = torch.arange(Q, device=device)
        pos = starts[:, None] + steps  # [B, Q]
        real = steps < query_lens[:, None]
        slot_mapping = torch.where(real, context_slots.gather(1, pos.clamp(max=L - 1)), scratch_slot)
        blocked = (torch.arange(L, device=device) > pos[:, :, None])[:, :, None, :]  # [B, Q, 1, L]
        last_index = torch.arange(B, device=device) * Q + query_lens - 1
        group = AttentionGroup(0, B * Q, B, Q, context_slots.flatten(), L, blocked, None, None)
        return cls(pos.flatten(), slot_mapping.flatten(), last_index, [group])

    @property
    def for_kernels(self) -> bool:
        """Built for the CPU kernels: per-token sequence ids and block tables, no groups."""
        return self.token_seq is not None

    @classmethod
    def _per_token(cls, start_lens: Sequence[int], query_lens: Sequence[int], block_tables: Tensor,
                   block_size: int) -> "PagedBatch":
        """Host integers in, one tensor out: on CPU a decode step is short enough for per-op costs to show."""
        tables = block_tables.contiguous()
        rows = tables.tolist()
        positions = [p for s, q in zip(start_lens, query_lens) for p in range(s, s + q)]
        seq = [b for b, q in enumerate(query_lens) for _ in range(q)]
        try:
            slots = [rows[b][p // block_size] * block_size + p % block_size for b, p in zip(seq, positions)]
        except IndexError:
            raise ValueError(f"block_tables {list(tables.shape)} do not cover the positions up to {max(positions)} "
                             f"(block size {block_size}), or have fewer rows than sequences") from None
        T = len(positions)
        flat = torch.tensor(positions + slots + seq + [e - 1 for e in accumulate(query_lens)], device=tables.device)
        return cls(flat[:T], flat[T : 2 * T], flat[3 * T :], [], flat[2 * T : 3 * T], tables, block_size)


def _cuts(totals: Sequence[int], lo: int, hi: int) -> list[int]:
    """Where to cut sequences lo..hi-1 into groups: each cut saves more than SPLIT_MIN_ROWS of the
    padded context rows (sequences x longest context, per group). Best when sorted by length."""
    if hi - lo < 2:
        return []
    head = list(accumulate(totals[lo:hi], max))  # longest context of lo..lo+j
    tail = list(accumulate(reversed(totals[lo:hi]), max))[::-1]  # longest context of lo+j..hi-1
    saved, j = max(((hi - lo) * head[-1] - j * head[j - 1] - (hi - lo - j) * tail[j], j) for j in range(1, hi - lo))
    if saved <= SPLIT_MIN_ROWS:
        return []
    return _cuts(totals, lo, lo + j) + [lo + j] + _cuts(totals, lo + j, hi)


def _build_group(start_lens: Sequence[int], query_lens: Sequence[int], block_tables: Tensor, block_size: int,
                 start: int) -> tuple[AttentionGroup, Tensor, Tensor]:
    """One attention group and its tokens' positions and cache slots."""
    device = block_tables.device
    B, Q = len(query_lens), max(query_lens)
    totals = [s + q for s, q in zip(start_lens, query_lens)]
    L, T = max(totals), sum(query_lens)
    num_blocks = -(-L // block_size)
    slots = block_tables[:, :num_blocks, None] * block_size + torch.arange(block_size, device=device)
    context_slots = slots.view(B, num_blocks * block_size)[:, :L]  # past a sequence's end: masked
    pos_pad = torch.tensor(start_lens, device=device)[:, None] + torch.arange(Q, device=device)  # [B, Q]
    query_index = token_index = None
    if T == B * Q:
        positions = pos_pad.flatten()
        slot_mapping = context_slots.gather(1, pos_pad).flatten()
    else:
        q_valid = torch.arange(Q, device=device) < torch.tensor(query_lens, device=device)[:, None]
        positions = pos_pad[q_valid]
        slot_mapping = context_slots.gather(1, pos_pad.clamp(max=L - 1))[q_valid]
        query_index = torch.full((B, Q), T, dtype=torch.long, device=device)
        query_index[q_valid] = torch.arange(T, device=device)
        token_index = torch.arange(B * Q, device=device).view(B, Q)[q_valid]
    blocked = None
    if Q > 1 or any(t != L for t in totals):
        blocked = torch.arange(L, device=device) > pos_pad[:, :, None]  # [B, Q, L]
        if query_index is not None:
            blocked |= ~q_valid[:, :, None]
            blocked[:, :, 0] &= q_valid  # padding queries see slot 0 so softmax stays finite
        blocked = blocked[:, :, None, :]
    group = AttentionGroup(start, start + T, B, Q, context_slots.flatten(), L, blocked, query_index, token_index)
    return group, positions, slot_mapping
