"""The model runner: turns a scheduled step into forwards, then drafts, verifies and accepts.

One step for a batch of sequences, each with its own number of new target tokens:
1. draft: for sequences given k > 0, one MTP forward catches the MTP cache up over the positions the
   target verified since the last draft (teacher-forced: true hidden states, true next tokens);
   its output at the last position proposes draft 1; drafts 2..k re-run the single MTP module on
   its own previous draft and its own hidden state after shared_head.norm (greedy, with one k for all:
   the whole chain in one kernel call, `FusedMTPLayer.greedy_drafts`);
2. verify: one ragged target forward over prefill chunks and [last token, d1..dk] chunks together;
3. accept a prefix of each sequence's drafts and emit one more token (sampling.accept); rejected
   positions are simply left behind: the sequence's length is what the cache is trusted up to,
   and the scheduler gives back blocks past it.
k = 0 is plain decoding through the same code. The runner reads sequences and writes none: what a step
computed comes back as `StepResult`s, which `Scheduler.update_from_output` applies.
"""

from __future__ import annotations

import time
from itertools import accumulate

import torch
from torch import Tensor

from runtime.core.cuda_graphs import CudaGraphRunner
from runtime.core.kv_cache import KVCache
from runtime.model.batch import SHORT_QUERY, PagedBatch
from runtime.model.kernels.modules import FusedMTPLayer, attends_in_kernels
from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM
from runtime.core.sampling import (PURPOSE_DRAFT, RelaxedAcceptance, SamplingTensors, accept, accept_greedy,
                              probabilities, sample, uniforms)
from runtime.core.plan import Scheduled, StepResult
from runtime.core.sequence import Sequence


class ModelRunner:
    def __init__(self, model: DeepseekV3ForCausalLM, kv_cache: KVCache,
                 relaxed: RelaxedAcceptance | None = None, keep_mtp_inputs: bool = True,
                 graphs: CudaGraphRunner | None = None):
        self.model, self.cache = model, kv_cache
        self.device = kv_cache.tensor.device
        self.graphs = graphs
        self.relaxed = relaxed
        self.keep_mtp_inputs = keep_mtp_inputs and model.cfg.num_nextn_predict_layers > 0
        self.timings = {"draft": 0.0, "target": 0.0}
        self.for_kernels = attends_in_kernels(model)  # paged batches in the per-token form the kernels read

    # ---- batch plumbing -----------------------------------------------------------------------
    def _paged_batch(self, tables: list[list[int]], starts: list[int], lens: list[int]) -> PagedBatch:
        width = max(map(len, tables))
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        return PagedBatch.build(starts, lens, padded.to(self.device), self.cache.block_size, self.for_kernels)

    def _ids(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def forward_target(self, tables: list[list[int]], starts: list[int], lens: list[int], ids: list[int]) -> Tensor:
        """Hidden states [sum(lens), H] of lens[b] new tokens after starts[b] cached ones per sequence, whose
        cache blocks are tables[b]."""
        if self.graphs is not None:
            hidden = self.graphs.target(ids, starts, lens, tables)
            if hidden is not None:
                return hidden
        batch = self._paged_batch(tables, starts, lens)
        return self.model(self._ids(ids), batch=batch, kv_cache=self.cache.tensor)

    def forward_mtp(self, tables: list[list[int]], starts: list[int], lens: list[int], ids: Tensor,
                    hidden: Tensor) -> tuple[Tensor, Tensor]:
        """The MTP layer over the same layout: (logits, hidden after shared_head.norm) at each sequence's last token."""
        if self.graphs is not None:
            out = self.graphs.mtp(ids, hidden, starts, lens, tables)
            if out is not None:
                return out
        batch = self._paged_batch(tables, starts, lens)
        return self.model.mtp_forward(0, ids, hidden, batch=batch, kv_cache=self.cache.tensor, rows=batch.last_index)

    @staticmethod
    def sampling_tensors(seqs: list[Sequence], rows_per_seq: list[int], vocab: int, device: torch.device) -> SamplingTensors:
        rep = torch.tensor(rows_per_seq)
        temp = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32).repeat_interleave(rep)
        top_k = torch.tensor([min(s.params.top_k, vocab) for s in seqs], dtype=torch.long).repeat_interleave(rep)
        top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32).repeat_interleave(rep)
        bad = None
        if any(s.params.bad_token_ids for s in seqs):
            bad = torch.zeros(len(seqs), vocab, dtype=torch.bool)
            for i, s in enumerate(seqs):
                bad[i, list(s.params.bad_token_ids)] = True
            bad = bad.repeat_interleave(rep, dim=0).to(device)
        return SamplingTensors(temp.to(device), top_k.to(device), top_p.to(device), bad)

    # ---- drafting -----------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, items: list[Scheduled]) -> tuple[Tensor, Tensor | None]:
        """Drafts [B, K] (K = max k) and their draft distributions [B, K, V] (None if all greedy)."""
        model, seqs = self.model, [it.seq for it in items]
        ks = [it.num_drafts for it in items]
        K = max(ks)
        # Catch-up: positions num_mtp .. num_cached-1, inputs h_i and the true token t_{i+1}.
        tables = [s.block_table for s in seqs]
        starts = [s.num_mtp for s in seqs]
        lens = [s.num_cached - s.num_mtp for s in seqs]  # the pending hidden rows
        next_ids = self._ids([t for s in seqs for t in s.token_ids[s.num_mtp + 1 : s.num_cached + 1]])
        hidden = torch.cat([h for s in seqs for h in s.pending_hidden])
        # Plain argmax drafts unless a row samples or bans tokens (its drafts then come from the MTP's own
        # distribution, bans applied, so a banned token is never drafted only to be rejected).
        plain = all(s.params.plain_argmax for s in seqs)
        if plain and min(ks) == K > 1 and isinstance(model.mtp[0], FusedMTPLayer) and self.for_kernels:
            return model.mtp[0].greedy_drafts(model.rope, next_ids, hidden, self._paged_batch(tables, starts, lens),
                                              self.cache.tensor, K), None
        logits, h = self.forward_mtp(tables, starts, lens, next_ids, hidden)
        if not plain:
            st = self.sampling_tensors(seqs, [1] * len(seqs), model.cfg.vocab_size, self.device)
            seeds = self._ids([s.seed for s in seqs])
            positions = self._ids([s.num_tokens for s in seqs])  # absolute position of draft 1
        drafts, probs = [], []
        for j in range(K):
            if plain:
                d = logits.argmax(-1)
            else:
                q = probabilities(logits, st)
                d = torch.where(st.temperature == 0, q.argmax(-1), sample(q, uniforms(seeds, positions + j, PURPOSE_DRAFT)))
                probs.append(q)
            drafts.append(d)
            if j + 1 == K:
                break
            # Draft j+2 at position num_tokens - 1 + j from the MTP's own hidden state and draft.
            active = [i for i, k in enumerate(ks) if k > j + 1]
            sub = [tables[i] for i in active]
            starts = [seqs[i].num_tokens - 1 + j for i in active]
            if len(active) == len(seqs):
                logits, h = self.forward_mtp(sub, starts, [1] * len(sub), d, h)
            else:
                idx = self._ids(active)
                sub_logits, sub_h = self.forward_mtp(sub, starts, [1] * len(sub), d[idx], h[idx])
                logits, h = logits.clone(), h.clone()
                logits[idx], h[idx] = sub_logits, sub_h
        draft_probs = torch.stack(probs, dim=1) if probs else None
        return torch.stack(drafts, dim=1), draft_probs

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, items: list[Scheduled]) -> list[StepResult]:
        """Run one step. Prefill chunks cover every prompt token but the last, so they emit nothing;
        decode items feed [last token, drafts...] and emit 1..k+1 tokens. Items run shortest context
        first, long chunks last, so sequences of similar length share attention groups."""
        items = sorted(items, key=lambda it: (it.num_new > SHORT_QUERY, it.seq.num_cached + it.num_new))
        t0 = time.perf_counter()
        drafting = [it for it in items if it.num_drafts > 0]
        drafts, draft_probs = self.draft(drafting) if drafting else (None, None)
        rows = drafts.tolist() if drafting else []
        draft_of = {id(it.seq): row[: it.num_drafts] for row, it in zip(rows, drafting)}
        t1 = time.perf_counter()

        seqs = [it.seq for it in items]
        decoding = [i for i, s in enumerate(seqs) if not s.in_prefill]
        tokens: list[int] = []
        for it in items:
            s = it.seq
            tokens += ([s.token_ids[-1]] + draft_of.get(id(s), [])) if not s.in_prefill else \
                s.token_ids[s.num_cached : s.num_cached + it.num_new]
        hidden = self.forward_target([s.block_table for s in seqs], [s.num_cached for s in seqs],
                                     [it.num_new for it in items], tokens)
        results = self._verify(items, decoding, hidden, rows, draft_probs, drafting) if decoding else {}

        out, offset = [], 0
        for i, it in enumerate(items):
            s = it.seq
            emitted, accepted = results.get(i, ([], 0))
            trusted = accepted + 1 if emitted else it.num_new  # positions whose target KV is now valid
            kept = None
            if self.keep_mtp_inputs and not s.mtp_dropped:  # a copy: a view would keep the step's hidden alive
                kept = hidden[offset : offset + trusted].clone()
            offset += it.num_new
            thinking = s.in_thinking
            if self.relaxed is not None:
                for t in emitted:
                    thinking = self.relaxed.advance(thinking, t)
            out.append(StepResult(s, emitted, it.num_drafts, accepted, trusted, kept, it.num_drafts > 0, thinking))
        self.timings["draft"] += t1 - t0
        self.timings["target"] += time.perf_counter() - t1
        return out

    def _verify(self, items: list[Scheduled], decoding: list[int], hidden: Tensor, drafts: list[list[int]],
                draft_probs: Tensor | None, drafting: list[Scheduled]) -> dict[int, tuple[list[int], int]]:
        """Target distributions at each decoding sequence's last k+1 positions, then acceptance."""
        V = self.model.cfg.vocab_size
        seqs = [items[i].seq for i in decoding]
        ks = [items[i].num_drafts for i in decoding]
        B, K = len(seqs), max(ks)
        # Row j of sequence b is chunk position j (j <= k_b); rows past k_b repeat the last one.
        ends = list(accumulate(it.num_new for it in items))
        rows = [ends[i] - 1 - max(k - j, 0) for i, k in zip(decoding, ks) for j in range(K + 1)]
        logits = self.model.logits(hidden[self._ids(rows)]).view(B, K + 1, V)
        row_of = {id(it.seq): r for r, it in enumerate(drafting)}
        d = [drafts[row_of[id(s)]] if k else [0] * K for s, k in zip(seqs, ks)]  # [B][K]; past k_b: ignored
        if self.relaxed is None and all(s.params.plain_argmax for s in seqs):
            out = {}
            for i, db, k, argmax in zip(decoding, d, ks, logits.argmax(-1).tolist()):
                n = accept_greedy(db[:k], argmax)
                out[i] = (db[:n] + [argmax[n]], n)
            return out
        dt = self._ids(d).view(B, K)
        dp = None
        if draft_probs is not None:
            has = self._ids(ks) > 0
            dp = torch.where(has[:, None, None], draft_probs[self._ids([row_of.get(id(s), 0) for s in seqs])], 0.0)
        st = self.sampling_tensors(seqs, [K + 1] * B, V, self.device)
        target_probs = probabilities(logits.flatten(0, 1), st).view(B, K + 1, V)
        greedy = st.temperature.view(B, K + 1)[:, 0] == 0
        relaxed_kw = {}
        if self.relaxed is not None and K:
            plain = logits[:, :K].float()
            if st.bad_mask is not None:  # a banned token is never accepted, relaxed or not
                plain = plain.masked_fill(st.bad_mask.view(B, K + 1, V)[:, :K], float("-inf"))
            relaxed_kw = dict(relaxed=self.relaxed, relaxed_probs=plain.softmax(-1),
                              relaxed_mask=self._thinking_mask(seqs, dt, ks))
        num_acc, nxt = accept(dt, dp, target_probs, self._ids(ks), self._ids([s.seed for s in seqs]),
                              self._ids([s.num_tokens for s in seqs]), greedy, **relaxed_kw)
        num_acc, nxt = num_acc.tolist(), nxt.tolist()
        return {i: (d[b][: num_acc[b]] + [nxt[b]], num_acc[b]) for b, i in enumerate(decoding)}

    def _thinking_mask(self, seqs: list[Sequence], drafts: Tensor, ks: list[int]) -> Tensor:
        """[B, K] True where a draft position lies between <think> and </think>."""
        mask = torch.zeros(drafts.shape, dtype=torch.bool)
        for b, s in enumerate(seqs):
            state = s.in_thinking
            for j, t in enumerate(drafts[b, : ks[b]].tolist()):
                mask[b, j] = state
                state = self.relaxed.advance(state, t)
        return mask.to(self.device)
