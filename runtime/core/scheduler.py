"""Which sequences run in the next step, with how many tokens and how many drafts.

Each step: running decodes first (1 + k tokens each, draft tokens reserved in the token budget and
in the KV cache, but never the token of a decode after them), then prefill chunks for partially
prefilled and waiting sequences within max_num_tokens. When the cache cannot hold a decode's drafts,
it decodes without them; when it cannot grow a running sequence at all, the most recently admitted
one is preempted: its blocks are freed and it is recomputed later from its tokens (a prefill chunk
preempts only sequences admitted after its own; if it still does not fit, it waits). New requests
wait while blocks run out: none is admitted in a step that preempted or left a prefill waiting.
Nothing is dropped.

With prefix caching (`PrefixCache`), a sequence being admitted starts on the longest chain of cached blocks its
tokens match, shared with other sequences, and prefills only the rest; a preempted one thus recomputes only
what was evicted meanwhile. The sequences of a request with several outputs (n / best_of) share its prompt
that way: the others wait until the first has prefilled it (`_held`). A drafting sequence recomputes the part of
the chain whose MTP rows it cannot use, unless the draft policy would not draft at the batch size it joins: it
then stops drafting and reuses it all.

The draft length comes from a `DraftPolicy` (runtime.core.draft_policy), and no more than leaves the token
budget to prompts waiting to be prefilled.

After the step, `update_from_output` applies what the runner computed, the one writer of a step's
results: tokens (as many as the stop rules keep), the penalties' counts and the grammar state of them (or the
grammar's failure the runner reported), cache lengths, MTP inputs, prompt logprobs done, blocks filled (registered
for reuse), finished sequences, blocks given back, and what the draft policy learns.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from itertools import islice

from runtime.core.draft_policy import DraftPolicy, draft_kind
from runtime.core.kv_cache import KVCache, OutOfBlocks
from runtime.core.plan import Scheduled, StepResult
from runtime.core.prefix_cache import PrefixCache
from runtime.core.sequence import Sequence, Status


@dataclass(frozen=True)
class ServingLimits:
    """The bounds a step is planned within and a request is validated against: sequences in a step, tokens in a
    step, and tokens in a sequence (prompt and output)."""

    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int


class Scheduler:
    MTP_IDLE_LIMIT = 8  # decode steps in a row for which adaptive speculation chose k = 0 before it drops a sequence

    def __init__(self, limits: ServingLimits, cache: KVCache, policy: DraftPolicy,
                 prefix_cache: PrefixCache | None = None):
        self.limits, self.cache, self.policy, self.prefix_cache = limits, cache, policy, prefix_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.admissions = 0  # admission counter: preemption takes the latest admitted
        self.preemptions = 0
        self.last_k = 0
        self.policy_k = 0  # the policy's own choice in the last step (before the token budget's limit)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Finished or cancelled: give its blocks back at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.release(seq.block_table)
        seq.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt_latest(self) -> Sequence:
        victim = max(self.running, key=lambda s: s.admitted_at)
        self.preemptions += 1
        self.running.remove(victim)
        self.cache.release(victim.block_table)
        victim.reset_for_recompute()
        self.waiting.appendleft(victim)
        return victim

    def _grow_preempting_newer(self, seq: Sequence, num_tokens: int, plan: list[Scheduled]) -> bool:
        """Grow seq's blocks to num_tokens, preempting running sequences admitted after it (newest first; one
        already in `plan` leaves it) until they fit; False when they do not fit even then."""
        while True:
            try:
                self.cache.grow(seq.block_table, num_tokens)
                return True
            except OutOfBlocks:
                if max(self.running, key=lambda s: s.admitted_at) is seq:
                    return False
                victim = self._preempt_latest()
                plan[:] = [it for it in plan if it.seq is not victim]

    def _draft_room(self, num_decodes: int, budget: int) -> int:
        """Drafts per decode that still leave the step's token budget to the prefill work waiting for
        it: a draft that delays admitting a request costs more throughput than it brings (adaptive
        speculation only; a fixed k is the user's choice)."""
        seats = max(self.limits.max_batch_size - len(self.running), 0)
        waiting = [s for s in self.running if s.in_prefill] + list(islice(self.waiting, seats))
        prefill = sum(s.num_to_prefill for s in waiting)
        return max(0, (budget - num_decodes - prefill) // num_decodes)

    def _drafts_for(self, seq: Sequence, k: int) -> int:
        """The step's k within what the request allows (its num_draft_tokens) and what is left of it."""
        if not seq.can_draft:
            return 0
        room = min(self.limits.max_seq_len - seq.num_tokens, seq.params.max_tokens - seq.num_output_tokens - 1)
        if seq.params.num_draft_tokens is not None:
            room = min(room, seq.params.num_draft_tokens)
        return max(0, min(k, room))

    def schedule(self) -> list[Scheduled]:
        budget = self.limits.max_num_tokens
        preemptions = self.preemptions
        decodes = [s for s in self.running if not s.in_prefill]
        drafters = Counter(draft_kind(s.params) for s in decodes if s.can_draft)
        k = self.policy_k = self.policy.choose(len(decodes), drafters) if drafters else 0
        if self.policy.mode == "adaptive" and decodes:
            k = min(k, self._draft_room(len(decodes), budget))
        self.last_k = k
        plan: list[Scheduled] = []
        for i, seq in enumerate(sorted(decodes, key=lambda s: s.admitted_at)):
            if seq not in self.running:  # preempted while making room for an older sequence
                continue
            if budget < 1:
                break
            later = len(decodes) - i - 1  # drafts leave a token of the budget to each decode after this one
            drafts = max(0, min(self._drafts_for(seq, k), budget - 1 - later))
            try:
                self.cache.grow(seq.block_table, seq.num_tokens + drafts)
            except OutOfBlocks:  # drafts are optional: decode without them before preempting anyone
                drafts = 0
                if not self._grow_preempting_newer(seq, seq.num_tokens, plan):
                    self._preempt_latest()  # seq itself, the newest: recomputed later
                    continue
            plan.append(Scheduled(seq, 1 + drafts, drafts))
            budget -= 1 + drafts

        # Prefill: sequences already admitted first, then the queue, while the budget and blocks allow. A
        # prefill that cannot grow preempts those admitted after it; if it still cannot, new requests wait.
        stalled = False
        for seq in [s for s in self.running if s.in_prefill]:
            if budget <= 0:
                break
            if seq not in self.running:  # preempted to make room for an older prefill
                continue
            chunk = min(seq.num_to_prefill, budget)
            if not self._grow_preempting_newer(seq, seq.num_cached + chunk, plan):
                stalled = True
                continue
            plan.append(Scheduled(seq, chunk))
            budget = self.limits.max_num_tokens - sum(it.num_new for it in plan)
        admit = not stalled and self.preemptions == preemptions
        admitted: list[Sequence] = []  # taken off the queue after the walk: the walk reads only its head
        for seq in self.waiting if admit else ():
            if budget <= 0 or len(self.running) >= self.limits.max_batch_size:
                break
            if self._held(seq):
                continue
            cached, with_mtp = self.prefix_cache.match(seq) if self.prefix_cache is not None else ([], 0)
            stop_drafting = with_mtp < len(cached) and not self.policy.drafts_at(len(self.running) + 1)
            if not stop_drafting:
                cached = cached[:with_mtp]
            start = len(cached) * self.cache.block_size
            chunk = min(seq.num_tokens - 1 - start, budget)
            need = self.cache.blocks_for(start + max(chunk, 1)) - len(cached)
            if need > self.cache.allocator.free_after_taking(cached):
                break  # new requests wait for blocks
            if stop_drafting:
                seq.drop_mtp()
            self.cache.reuse(seq.block_table, cached)
            self.cache.grow(seq.block_table, start + max(chunk, 1))
            self._start_at(seq, start)
            admitted.append(seq)
            self.admissions += 1
            seq.status, seq.admitted_at = Status.RUNNING, self.admissions
            self.running.append(seq)
            plan.append(Scheduled(seq, chunk) if chunk else Scheduled(seq, 1, 0))
            budget -= max(chunk, 1)
        for seq in admitted:  # each near the head: only held siblings come before it
            self.waiting.remove(seq)
        return plan

    def _held(self, seq: Sequence) -> bool:
        """A sibling of a request with several outputs waits while its leader prefills the shared prompt, and, where
        both draft, until the leader's first decode step has computed the prompt blocks' MTP rows (the catch-up):
        admitted earlier, it would compute the prompt again instead of sharing the leader's blocks. Later (whether
        or not that step drafted) it is admitted, and the prefix cache's rules decide what it reuses."""
        lead = seq.leader
        if lead is None or self.prefix_cache is None or lead.status is Status.FINISHED:
            return False
        if lead.status is Status.WAITING or lead.in_prefill:
            return True
        return self.prefix_cache.drafts(lead) and self.prefix_cache.drafts(seq) and lead.num_output_tokens < 2

    def _start_at(self, seq: Sequence, start: int) -> None:
        """A sequence admitted on `start` cached positions: its target KV, and its MTP rows where it drafts
        (PrefixCache.match took only blocks whose MTP rows it can use), are valid up to there."""
        blocks = start // self.cache.block_size
        seq.num_cached, seq.num_registered_blocks = start, blocks
        if seq.num_reused_blocks is None:
            seq.num_reused_blocks = blocks
        if self.prefix_cache is not None and self.prefix_cache.drafts(seq):
            seq.num_mtp, seq.num_mtp_blocks = start, blocks

    def update_from_output(self, plan: list[Scheduled], results: list[StepResult], kept: dict[Sequence, int],
                           finished: set[Sequence], seconds: float) -> None:
        """Apply a step: each sequence takes `kept[seq]` of its emitted tokens (all of them when absent: the stop
        rules cut at a stop), the KV positions and MTP inputs it made valid, and its thinking state; sequences
        not `finished` (those leave through `remove` as the executor reports them) give back blocks past their
        length (rejected drafts).
        Under adaptive speculation a sequence for which the policy chose k = 0 for MTP_IDLE_LIMIT decode steps in
        a row stops drafting (steps the token budget, the cache or max_tokens cut do not count). The policy learns
        acceptance, and the step's cost when it was a decode-only step in which every sequence drafted the same
        k without an MTP catch-up over a prompt (a one-off per request that would price every later step)."""
        catch_up = max((it.seq.num_cached - it.seq.num_mtp for it in plan if it.num_drafts), default=0)
        decode_only = not any(it.seq.in_prefill for it in plan)
        for r in results:
            seq = r.seq
            new = r.new_token_ids[: kept.get(seq, len(r.new_token_ids))]
            seq.token_ids += new
            if seq.penalty is not None:
                seq.penalty.add(new)
            if seq.grammar is not None:
                if r.grammar_error is not None:  # its masks failed: it keeps none of the step's tokens
                    seq.grammar.error = r.grammar_error
                seq.grammar.advance(new)
            if r.prompt_logprobs:
                seq.num_prompt_logprobs += len(r.prompt_logprobs)
            seq.num_cached += r.num_trusted
            seq.in_thinking = r.in_thinking
            if r.mtp_caught_up:
                seq.num_mtp, seq.pending_hidden = seq.num_cached - r.num_trusted, []
            if r.hidden is not None and not seq.mtp_dropped:
                seq.pending_hidden.append(r.hidden)
            if self.prefix_cache is not None:
                self.prefix_cache.commit(seq)
            if seq in finished:
                continue
            self.cache.shrink(seq.block_table, seq.num_tokens)
            if r.new_token_ids and self.policy.mode == "adaptive" and not seq.mtp_dropped:
                seq.mtp_idle_steps = seq.mtp_idle_steps + 1 if self.policy_k == 0 else 0
                if seq.mtp_idle_steps >= self.MTP_IDLE_LIMIT:
                    seq.drop_mtp()
        self.policy.observe(results)
        ks = {it.num_drafts for it in plan}
        if decode_only and len(ks) == 1 and catch_up <= self.policy.max_k + 1:
            self.policy.observe_step(len(plan), ks.pop(), seconds)
