"""The model runner: turns a scheduled step into forwards, verifies the MTP proposer's drafts and accepts them.

One step for a batch of sequences, each with its own number of new target tokens:
1. draft: the sequences given k > 0 get k drafts each, and the distributions they were drawn from, from the MTP
   proposer (runtime.core.mtp_proposer);
2. verify: one ragged target forward over prefill chunks and [last token, d1..dk] chunks together;
3. accept a prefix of each sequence's drafts and emit one more token (sampling.accept); rejected
   positions are simply left behind: the sequence's length is what the cache is trusted up to,
   and the scheduler gives back blocks past it.
k = 0 is plain decoding through the same code. Where the CPU kernels run the whole model, a step of greedy decodes,
each with its own k (no grammar; penalties, bans and logprobs computed in the call), runs 1-3 in one kernel call
(`GreedyStep`, from the proposer's catch-up inputs; a sequence with k = 0: the target forward and argmax alone; a
step where none drafts also for a model without an MTP layer): only the emitted tokens, their logprobs and the
verified hidden states come back. The runner reads sequences and writes none: what a step computed comes back as
`StepResult`s, which `Scheduler.update_from_output` applies (a grammar that fails while its masks are computed is
reported there too, `StepResult.grammar_error`, and the executor ends the request).

Each verified row is decided under its own rules (`StepInputs`, the proposer's too): penalties and min_tokens bans
with the counts of the row's own prefix (sampling module docstring), and a guided request's grammar as one more ban,
the state after the drafts before the row (a bitmask per row); the state advances by the kept tokens only in the
update, so rejected drafts leave no trace.

Logprobs come from the verification forward's logits at the emitted positions, the same logits plain
decoding would compute there; prompt logprobs from the prefill chunks' hidden states.
"""

from __future__ import annotations

from functools import partial
from itertools import accumulate
from typing import Callable

import torch
from torch import Tensor

from runtime.core.cuda_graphs import CudaGraphRunner
from runtime.core.kv_cache import KVCache
from runtime.model.batch import SHORT_QUERY
from runtime.model.kernels.modules import GreedyStep
from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM
from runtime.core.mtp_proposer import MtpProposer
from runtime.core.sampling import (SamplingTensors, TokenLogprob, accept, accept_greedy, adjusted_logits,
                                   probabilities, processed_logprobs, read_token_logprobs, token_logprobs)
from runtime.core.plan import Scheduled, StepResult
from runtime.core.sampling_params import RelaxedAcceptance
from runtime.core.sequence import Sequence
from runtime.core.step_inputs import StepInputs


class ModelRunner:
    """Runs a scheduled step: the proposer's drafts, one target forward over every item, acceptance."""

    def __init__(self, model: DeepseekV3ForCausalLM, kv_cache: KVCache,
                 relaxed: RelaxedAcceptance | None = None, keep_mtp_inputs: bool = True,
                 graphs: CudaGraphRunner | None = None):
        self.model, self.cache = model, kv_cache
        self.graphs = graphs
        self.relaxed = relaxed
        self.keep_mtp_inputs = keep_mtp_inputs and model.cfg.num_nextn_predict_layers > 0
        self.inputs = StepInputs(model, kv_cache)
        self.proposer = MtpProposer(model, kv_cache, self.inputs, graphs)
        # greedy steps in one kernel call where the whole target is on the kernels (None: the general path only)
        self.greedy_step = GreedyStep.of(model) if graphs is None else None

    def forward_target(self, tables: list[list[int]], starts: list[int], lens: list[int], ids: list[int]) -> Tensor:
        """Hidden states [sum(lens), H] of lens[b] new tokens after starts[b] cached ones per sequence, whose
        cache blocks are tables[b]."""
        if self.graphs is not None:
            hidden = self.graphs.target(ids, starts, lens, tables)
            if hidden is not None:
                return hidden
        batch = self.inputs.paged_batch(tables, starts, lens)
        return self.model(self.inputs.ids(ids), batch=batch, kv_cache=self.cache.tensor)

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, items: list[Scheduled]) -> list[StepResult]:
        """Run one step. Prefill chunks cover every prompt token but the last, so they emit nothing;
        decode items feed [last token, drafts...] and emit 1..k+1 tokens. Items run shortest context
        first, long chunks last, so sequences of similar length share attention groups."""
        items = sorted(items, key=lambda it: (it.num_new > SHORT_QUERY, it.seq.num_cached + it.num_new))
        self.inputs.grammar_errors.clear()
        if self.greedy_step is not None and self._in_one_call(items):
            return self._step_in_one_call(items)
        drafting = [it for it in items if it.num_drafts > 0]
        drafts, draft_probs = self.proposer.propose(drafting) if drafting else (None, None)
        rows = drafts.tolist() if drafting else []
        draft_of = {id(it.seq): row[: it.num_drafts] for row, it in zip(rows, drafting)}

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
        prompt_logprobs = self._prompt_logprobs(items, hidden)

        out, offset = [], 0
        for i, it in enumerate(items):
            s = it.seq
            emitted, accepted, logprobs = results.get(i, ([], 0, None))
            trusted = accepted + 1 if emitted else it.num_new  # positions whose target KV is now valid
            kept = None
            if self.keep_mtp_inputs and not s.mtp_dropped:  # a copy: a view would keep the step's hidden alive
                kept = hidden[offset : offset + trusted].clone()
            offset += it.num_new
            thinking = s.in_thinking
            if self.relaxed is not None:
                for t in emitted:
                    thinking = self.relaxed.advance(thinking, t)
            out.append(StepResult(s, emitted, it.num_drafts, accepted, trusted, kept, it.num_drafts > 0, thinking,
                                  logprobs, prompt_logprobs.get(i), self.inputs.grammar_errors.get(s)))
        return out

    def _in_one_call(self, items: list[Scheduled]) -> bool:
        """Whether the greedy step in one kernel call can run the step: every item a greedy decode (each with its own
        k), not guided, no relaxed acceptance, and the call has the MTP module where some item drafts (penalties, bans
        and logprobs the call computes)."""
        if self.relaxed is not None or (self.greedy_step.mtp is None and any(it.num_drafts for it in items)):
            return False
        return all(not it.seq.in_prefill and it.seq.params.greedy and it.seq.grammar is None for it in items)

    def _step_in_one_call(self, items: list[Scheduled]) -> list[StepResult]:
        """The step as `step` runs it for these items, drafts (if any) to acceptance in one kernel call (`GreedyStep`)."""
        seqs, ks = [it.seq for it in items], [it.num_drafts for it in items]
        next_ids = hidden = _NO_CATCH_UP  # plain decoding has no MTP catch-up
        if max(ks):
            _, _, _, next_ids, hidden = self.proposer.catch_up([s for s, k in zip(seqs, ks) if k])
        # the rows from draft 1's on (no grammar here)
        adjustments = self.inputs.adjustments(seqs, None, 0, max(ks) + 1)
        top_n = [-1 if s.params.logprobs is None else s.params.logprobs for s in seqs]
        logprobs = None
        if max(top_n) >= 0:
            logprobs = top_n, [s.params.logprobs_mode == "processed_logprobs" for s in seqs]
        emitted, verified, rows = self.greedy_step(
            next_ids, hidden, self.cache.tensor, [s.block_table for s in seqs], self.cache.block_size,
            [s.num_mtp for s in seqs], [s.num_cached for s in seqs], [s.token_ids[-1] for s in seqs], ks,
            None if adjustments is None else adjustments.kernel_args(), logprobs)
        found = iter(read_token_logprobs(rows, [n for n, tokens in zip(top_n, emitted) if n >= 0 for _ in tokens]))
        out, start = [], 0
        for s, k, tokens, n in zip(seqs, ks, emitted, top_n):
            kept = None  # the trusted positions' hidden states, where the MTP layer will read them
            if self.keep_mtp_inputs and not s.mtp_dropped:
                kept = verified[start : start + len(tokens)].clone()
            start += k + 1
            token_lps = None if n < 0 else [next(found) for _ in tokens]
            out.append(StepResult(s, tokens, k, len(tokens) - 1, len(tokens), kept, k > 0, s.in_thinking, token_lps))
        return out

    def _verify(self, items: list[Scheduled], decoding: list[int], hidden: Tensor, drafts: list[list[int]],
                draft_probs: Tensor | None, drafting: list[Scheduled]
                ) -> dict[int, tuple[list[int], int, list[TokenLogprob] | None]]:
        """Target distributions at each decoding sequence's last k+1 positions, then acceptance: per item index,
        (emitted tokens, accepted drafts, their logprobs when asked for)."""
        V, ids = self.model.cfg.vocab_size, self.inputs.ids
        seqs = [items[i].seq for i in decoding]
        ks = [items[i].num_drafts for i in decoding]
        B, K = len(seqs), max(ks)
        # Row j of sequence b is chunk position j (j <= k_b); rows past k_b repeat the last one.
        ends = list(accumulate(it.num_new for it in items))
        rows = [ends[i] - 1 - max(k - j, 0) for i, k in zip(decoding, ks) for j in range(K + 1)]
        logits = self.model.logits(hidden[ids(rows)]).view(B, K + 1, V)
        row_of = {id(it.seq): r for r, it in enumerate(drafting)}
        d = [drafts[row_of[id(s)]] if k else [0] * K for s, k in zip(seqs, ks)]  # [B][K]; past k_b: ignored
        # Greedy rows need only the argmax: of the logits themselves when nothing adjusts them (the fast path)
        processed: Callable[[Tensor], Tensor] | None = None  # rows -> their processed logprobs, where they differ
        if self.relaxed is None and all(s.params.greedy for s in seqs):
            scores = logits
            if not all(s.plain_argmax for s in seqs):  # else the fast path: the logits' own argmax
                dt = ids(d).view(B, K)
                adjustments = self.inputs.adjustments(seqs, dt, 0, K + 1)
                scores = adjusted_logits(logits.flatten(0, 1), adjustments).view(B, K + 1, V)
                # a greedy row's processed distribution is that of its adjusted logits (processed_logprobs)
                processed = partial(_rows_log_softmax, scores.view(B * (K + 1), V))
            emitted = []
            for db, k, argmax in zip(d, ks, scores.argmax(-1).tolist()):
                n = accept_greedy(db[:k], argmax)
                emitted.append(db[:n] + [argmax[n]])
        else:
            dt = ids(d).view(B, K)
            st = self.inputs.sampling_tensors(seqs, dt, 0, K + 1)
            dp = None
            if draft_probs is not None:
                has = ids(ks) > 0
                dp = torch.where(has[:, None, None], draft_probs[ids([row_of.get(id(s), 0) for s in seqs])], 0.0)
            target_probs = probabilities(logits.flatten(0, 1), st).view(B, K + 1, V)
            greedy = st.temperature.view(B, K + 1)[:, 0] == 0
            relaxed_kw = {}
            if self.relaxed is not None and K:
                # penalized and with bans: a banned token is never accepted, relaxed or not
                adjusted = adjusted_logits(logits.flatten(0, 1), st.adjustments).view(B, K + 1, V)
                relaxed_kw = dict(relaxed=self.relaxed, relaxed_probs=adjusted[:, :K].softmax(-1),
                                  relaxed_mask=self._thinking_mask(seqs, dt, ks))
            num_acc, nxt = accept(dt, dp, target_probs, ids(ks), ids([s.seed for s in seqs]),
                                  ids([s.num_tokens for s in seqs]), greedy, self.inputs.raced_mask(seqs),
                                  **relaxed_kw)
            emitted = [d[b][:n] + [t] for b, (n, t) in enumerate(zip(num_acc.tolist(), nxt.tolist()))]
            processed = partial(_processed_rows, logits.flatten(0, 1), st)
        logprobs = self._logprobs(seqs, logits, processed, emitted)
        return {i: (emitted[b], len(emitted[b]) - 1, logprobs[b]) for b, i in enumerate(decoding)}

    def _logprobs(self, seqs: list[Sequence], logits: Tensor, processed: Callable[[Tensor], Tensor] | None,
                  emitted: list[list[int]]) -> list[list[TokenLogprob] | None]:
        """Per sequence, the logprobs of its emitted tokens from the rows [B, K+1, V] that decided them (None for
        a sequence that did not ask): raw log-softmax of the logits, or of the processed distribution (`processed`
        of the flat rows; None where it is the raw one: all rows plain argmax ones)."""
        asking = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
        out: list[list[TokenLogprob] | None] = [None] * len(seqs)
        if not asking:
            return out
        B, R, V = logits.shape
        rows = self.inputs.ids([b * R + j for b in asking for j in range(len(emitted[b]))])
        flat = logits.view(B * R, V)
        if processed is not None and any(seqs[b].params.logprobs_mode == "processed_logprobs" for b in asking):
            raw = flat[rows].float().log_softmax(-1)
            mode = self.inputs.ids([seqs[b].params.logprobs_mode == "processed_logprobs" for b in asking
                                    for _ in emitted[b]]).bool()
            lp = torch.where(mode[:, None], processed(rows), raw)
        else:
            lp = flat[rows].float().log_softmax(-1)
        tokens = self.inputs.ids([t for b in asking for t in emitted[b]])
        found = iter(token_logprobs(lp, tokens, [seqs[b].params.logprobs for b in asking for _ in emitted[b]]))
        for b in asking:
            out[b] = [next(found) for _ in emitted[b]]
        return out

    def _prompt_logprobs(self, items: list[Scheduled], hidden: Tensor) -> dict[int, list[TokenLogprob]]:
        """Per prefill item of a request asking for prompt logprobs: the raw logprobs of the prompt tokens its
        chunk predicts (position p predicts token p + 1), each computed once (a recomputed prefill skips them)."""
        rows, tokens, top_n, spans = [], [], [], {}
        offset = 0
        for i, it in enumerate(items):
            s, start = it.seq, offset
            offset += it.num_new
            if s.params.prompt_logprobs is None or not s.in_prefill:
                continue
            lo, hi = max(s.num_cached, s.num_prompt_logprobs), min(s.num_cached + it.num_new, s.num_prompt_tokens - 1)
            if lo < hi:
                spans[i] = (len(rows), hi - lo)
                rows += range(start + lo - s.num_cached, start + hi - s.num_cached)
                tokens += s.token_ids[lo + 1 : hi + 1]
                top_n += [s.params.prompt_logprobs] * (hi - lo)
        if not rows:
            return {}
        lp = self.model.logits(hidden[self.inputs.ids(rows)]).float().log_softmax(-1)
        found = token_logprobs(lp, self.inputs.ids(tokens), top_n)
        return {i: found[start : start + n] for i, (start, n) in spans.items()}

    def _thinking_mask(self, seqs: list[Sequence], drafts: Tensor, ks: list[int]) -> Tensor:
        """[B, K] True where a draft position lies between <think> and </think>."""
        mask = torch.zeros(drafts.shape, dtype=torch.bool)
        for b, s in enumerate(seqs):
            state = s.in_thinking
            for j, t in enumerate(drafts[b, : ks[b]].tolist()):
                mask[b, j] = state
                state = self.relaxed.advance(state, t)
        return mask.to(self.inputs.device)


_NO_CATCH_UP = torch.empty(0)  # the MTP catch-up's inputs of a step that drafts nothing


def _rows_log_softmax(logits: Tensor, rows: Tensor) -> Tensor:
    return logits[rows].log_softmax(-1)


def _processed_rows(logits: Tensor, st: SamplingTensors, rows: Tensor) -> Tensor:
    return processed_logprobs(logits, st)[rows]
