"""What the model runner and the MTP proposer both build from a step's sequences: paged layouts and token-id tensors
on the device, and each row's sampling rules (temperature, top-k, top-p, min-p, and the adjustments: logit biases,
bans, grammar masks, penalties; and which rows race).

One home for both, because drafts are proposed under the very rules their target rows are verified under (a
banned token is never drafted only to be rejected, a penalized greedy row drafts what its target row will choose),
and a grammar that fails computing masks while drafting leaves the step's later rows, verified ones included,
unmasked.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.core.grammar import grammar_bitmasks
from runtime.core.kv_cache import KVCache
from runtime.core.sampling import Adjustments, SamplingTensors
from runtime.core.sequence import LogitBias, Sequence
from runtime.model.batch import PagedBatch
from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM
from runtime.model.kernels.modules import attends_in_kernels


class StepInputs:
    """A step's paged layouts, id tensors and row rules, built alike for drafts and target rows (one per runner)."""

    def __init__(self, model: DeepseekV3ForCausalLM, kv_cache: KVCache):
        self.cache = kv_cache
        self.device = kv_cache.tensor.device
        self.vocab_size = model.cfg.vocab_size
        self.for_kernels = attends_in_kernels(model)  # paged batches in the per-token form the kernels read
        # the step's grammars that failed computing masks, with why (the runner clears it at each step and reports
        # them): their later rows in the step are left unmasked
        self.grammar_errors: dict[Sequence, str] = {}

    # ---- batch plumbing -----------------------------------------------------------------------
    def paged_batch(self, tables: list[list[int]], starts: list[int], lens: list[int]) -> PagedBatch:
        width = max(map(len, tables))
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        return PagedBatch.build(starts, lens, padded.to(self.device), self.cache.block_size, self.for_kernels)

    def ids(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    # ---- each row's sampling rules ------------------------------------------------------------
    def sampling_tensors(self, seqs: list[Sequence], drafts: Tensor | None, first: int, num_rows: int) -> SamplingTensors:
        """Rows j = first .. first + num_rows - 1 of each sequence: its output token num_output + j, decided after
        drafts[:, :j] ([B, >= first + num_rows - 1]; None when no row follows a draft)."""
        V, dev = self.vocab_size, self.device
        values = torch.tensor([[s.params.temperature, min(s.params.top_k, V), s.params.top_p, s.params.min_p]
                               for s in seqs], dtype=torch.float64).repeat_interleave(num_rows, dim=0).to(dev)
        min_p = values[:, 3].float() if any(s.params.min_p > 0 for s in seqs) else None  # known here: no device sync
        return SamplingTensors(values[:, 0].float(), values[:, 1].long(), values[:, 2].float(), min_p,
                               self.adjustments(seqs, drafts, first, num_rows))

    def adjustments(self, seqs: list[Sequence], drafts: Tensor | None, first: int, num_rows: int) -> Adjustments | None:
        """What changes the logits of those rows before temperature (all a greedy row needs): the logit biases, the
        banned tokens (bad tokens, stop tokens while min_tokens is not reached by that row's index, and what a guided
        request's grammar refuses after the drafts before the row, as the grammar's bitmasks) and the penalties, which
        count the drafts before it; applied in one kernel call."""
        bad = [list(s.params.bad_token_ids) for s in seqs]
        stops = [list(s.stop_ids) if s.bans_stop_ids else [] for s in seqs]
        # rows before min_tokens is reached
        stop_rows = [max(s.params.min_tokens - s.num_output_tokens - first, 0) if s.bans_stop_ids else 0 for s in seqs]
        allowed = None
        grammars = [s.grammar for s in seqs]
        if any(g is not None for g in grammars):
            # row j: what the grammar allows after the drafts before it
            rows = None if drafts is None or first + num_rows == 1 else drafts[:, : first + num_rows - 1].tolist()
            failed = {b for b, s in enumerate(seqs) if s in self.grammar_errors}
            allowed, errors = grammar_bitmasks(grammars, rows, first, num_rows, failed)
            self.grammar_errors.update((seqs[b], error) for b, error in errors.items())
        pen = [b for b, s in enumerate(seqs) if s.penalty is not None]
        biased = any(s.logit_bias is not None for s in seqs)
        if not pen and not any(bad) and not any(stop_rows) and allowed is None and not biased:
            return None
        values = [v for b in pen for v in (seqs[b].params.repetition_penalty, seqs[b].params.presence_penalty,
                                           seqs[b].params.frequency_penalty)]
        return Adjustments(num_rows, first, drafts, pen, [seqs[b].penalty.counts for b in pen],
                           [seqs[b].penalty.in_prompt for b in pen], values, bad, stops, stop_rows,
                           [NO_BIAS.tokens if s.logit_bias is None else s.logit_bias.tokens for s in seqs],
                           [NO_BIAS.values if s.logit_bias is None else s.logit_bias.values for s in seqs], allowed)

    def raced_rows(self, seqs: list[Sequence]) -> list[int]:
        """The rows of the sampled sequences of seeded requests, which race (runtime.core.sampling)."""
        return [b for b, s in enumerate(seqs) if s.params.races]

    def raced_mask(self, seqs: list[Sequence]) -> Tensor | None:
        """[B] bool of `raced_rows`, None if no row races."""
        rows = set(self.raced_rows(seqs))
        return self.ids([b in rows for b in range(len(seqs))]).bool() if rows else None


NO_BIAS = LogitBias.create({}, "cpu")  # a sequence without a logit_bias, in Adjustments' per-sequence lists
