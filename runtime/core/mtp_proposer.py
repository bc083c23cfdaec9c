"""The MTP proposer: k drafts for each sequence a step gives k > 0, and the distributions they were drawn from.

For the drafting sequences of a step, one MTP forward catches the MTP cache up over the positions the target
verified since the last draft (teacher-forced: true hidden states, true next tokens); its output at the last position
proposes draft 1; drafts 2..k re-run the single MTP module on its own previous draft and its own hidden state after
shared_head.norm (greedy, with one k for all: the whole chain in one kernel call, `FusedMTPLayer.greedy_drafts`).
The model runner verifies the drafts and accepts a prefix of them (runtime.core.model_runner).

Drafts are plain argmaxes unless a row samples, bans or penalizes tokens: its drafts then come from the MTP's own
distribution under the rules its target rows are verified under (`StepInputs`), each draft's row with the counts and
the grammar state after the drafts before it, so a banned token is never drafted only to be rejected, a penalized
greedy row drafts what its target row will choose, and a guided request's draft j is drawn from the MTP distribution
masked by its grammar's state after drafts 1..j-1. A sampled row of a seeded request races with the noise its target
row will race with at the same position; other sampled rows draw for rejection sampling, whose acceptance needs the
distribution drawn from (runtime.core.sampling).
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.core.cuda_graphs import CudaGraphRunner
from runtime.core.kv_cache import KVCache
from runtime.core.plan import Scheduled
from runtime.core.sampling import PURPOSE_DRAFT, adjusted_logits, probabilities, race, sample, uniforms
from runtime.core.sequence import Sequence
from runtime.core.step_inputs import StepInputs
from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM
from runtime.model.kernels.modules import FusedMTPLayer


class MtpProposer:
    """A step's drafter: the model's MTP layer 0, re-run for each draft, over its own rows of the paged KV cache."""

    def __init__(self, model: DeepseekV3ForCausalLM, kv_cache: KVCache, inputs: StepInputs,
                 graphs: CudaGraphRunner | None = None):
        self.model, self.cache, self.inputs, self.graphs = model, kv_cache, inputs, graphs

    def forward_mtp(self, tables: list[list[int]], starts: list[int], lens: list[int], ids: Tensor,
                    hidden: Tensor) -> tuple[Tensor, Tensor]:
        """The MTP layer over lens[b] new tokens after starts[b] cached ones per sequence, whose cache blocks are
        tables[b]: (logits, hidden after shared_head.norm) at each sequence's last token."""
        if self.graphs is not None:
            out = self.graphs.mtp(ids, hidden, starts, lens, tables)
            if out is not None:
                return out
        batch = self.inputs.paged_batch(tables, starts, lens)
        return self.model.mtp_forward(0, ids, hidden, batch=batch, kv_cache=self.cache.tensor, rows=batch.last_index)

    @torch.inference_mode()
    def propose(self, items: list[Scheduled]) -> tuple[Tensor, Tensor | None]:
        """Drafts [B, K] (K = max k) and their draft distributions [B, K, V] (None if all greedy)."""
        model, seqs = self.model, [it.seq for it in items]
        ks = [it.num_drafts for it in items]
        K = max(ks)
        tables, starts, lens, next_ids, hidden = self.catch_up(seqs)
        plain = all(s.plain_argmax for s in seqs)
        if plain and min(ks) == K > 1 and isinstance(model.mtp[0], FusedMTPLayer) and self.inputs.for_kernels:
            batch = self.inputs.paged_batch(tables, starts, lens)
            return model.mtp[0].greedy_drafts(model.rope, next_ids, hidden, batch, self.cache.tensor, K), None
        logits, h = self.forward_mtp(tables, starts, lens, next_ids, hidden)
        greedy = all(s.params.greedy for s in seqs)  # then drafts are argmaxes: no distribution, no draw
        if not plain:
            # rules that depend on the drafts before a row (penalties, min_tokens) need fresh tensors per draft
            per_draft = any(s.penalty is not None or s.bans_stop_ids or s.grammar is not None for s in seqs)
            rules = self.inputs.adjustments if greedy else self.inputs.sampling_tensors  # greedy: the adjustments only
            st = rules(seqs, None, 0, 1)
            if not greedy:
                seeds = self.inputs.ids([s.seed for s in seqs])
                positions = self.inputs.ids([s.num_tokens for s in seqs])  # absolute position of draft 1
                raced_rows = self.inputs.raced_rows(seqs)  # known on the host: no device sync, no boolean-mask indexing
                raced = self.inputs.ids(raced_rows) if raced_rows else None
                rejecting = [not s.params.greedy and b not in raced_rows for b, s in enumerate(seqs)]
                rejecting_mask = self.inputs.ids(rejecting).bool() if any(rejecting) else None
        drafts, probs = [], []
        for j in range(K):
            if not plain and per_draft and j:
                st = rules(seqs, torch.stack(drafts, dim=1), j, 1)
            if plain:
                d = logits.argmax(-1)
            elif greedy:
                d = adjusted_logits(logits, st).argmax(-1)
            else:
                q = probabilities(logits, st)
                d = q.argmax(-1)  # a greedy row's q is one-hot on its argmax
                if raced is not None:  # with the noise its target row will race with at this position
                    d[raced] = race(q[raced], seeds[raced], positions[raced] + j)
                if rejecting_mask is not None:  # rejection sampling's drafts, and their distribution for acceptance
                    d = torch.where(rejecting_mask, sample(q, uniforms(seeds, positions + j, PURPOSE_DRAFT)), d)
                    probs.append(q)
            drafts.append(d)
            if j + 1 == K:
                break
            logits, h = self._next_draft_logits(tables, seqs, ks, j, d, logits, h)
        draft_probs = torch.stack(probs, dim=1) if probs else None
        return torch.stack(drafts, dim=1), draft_probs

    def catch_up(self, seqs: list[Sequence]) -> tuple[list[list[int]], list[int], list[int], Tensor, Tensor]:
        """The MTP catch-up's layout (tables, starts, lens) and inputs: positions num_mtp .. num_cached-1, each with
        the target's hidden state h_i there and the true token t_{i+1} (also what the runner's greedy step in one
        kernel call drafts from)."""
        tables = [s.block_table for s in seqs]
        starts = [s.num_mtp for s in seqs]
        lens = [s.num_cached - s.num_mtp for s in seqs]  # the pending hidden rows
        next_ids = self.inputs.ids([t for s in seqs for t in s.token_ids[s.num_mtp + 1 : s.num_cached + 1]])
        return tables, starts, lens, next_ids, torch.cat([h for s in seqs for h in s.pending_hidden])

    def _next_draft_logits(self, tables: list[list[int]], seqs: list[Sequence], ks: list[int], j: int, d: Tensor,
                           logits: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """Draft j+2 at position num_tokens - 1 + j from the MTP's own hidden state and draft j+1 (rows whose k
        ends before keep their last logits)."""
        active = [i for i, k in enumerate(ks) if k > j + 1]
        sub = [tables[i] for i in active]
        starts = [seqs[i].num_tokens - 1 + j for i in active]
        if len(active) == len(seqs):
            return self.forward_mtp(sub, starts, [1] * len(sub), d, h)
        idx = self.inputs.ids(active)
        sub_logits, sub_h = self.forward_mtp(sub, starts, [1] * len(sub), d[idx], h[idx])
        logits, h = logits.clone(), h.clone()
        logits[idx], h[idx] = sub_logits, sub_h
        return logits, h
