"""Which sequences run in the next step, with how many tokens and how many drafts.

Each step: running decodes first (1 + k tokens each, draft tokens reserved in the token budget and
in the KV cache, but never the token of a decode after them), then prefill chunks for partially
prefilled and waiting sequences within max_num_tokens. When the cache cannot hold a decode's drafts,
it decodes without them; when it cannot grow a running sequence at all, the most recently admitted
one is preempted: its blocks are freed and it is recomputed later from its tokens (a prefill chunk
preempts only sequences admitted after its own; if it still does not fit, it waits). New requests
wait while blocks run out: none is admitted in a step that preempted or left a prefill waiting.
Nothing is dropped.

The draft length comes from a `DraftPolicy`: fixed, off, or adaptive: the k that maximizes
expected tokens per second for the current batch size, from the acceptance measured per draft depth
and a step cost table profiled on this machine at start-up (k = 0 when verifying costs more than it
saves), and no more than leaves the token budget to prompts waiting to be prefilled.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

from runtime.kv_cache import KVCache, OutOfBlocks
from runtime.sequence import Sequence, Status
from runtime.worker import Scheduled, StepResult


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int


@dataclass
class StepCosts:
    """Measured seconds of a target forward with q tokens for each of b sequences, and of an MTP
    forward with one token per sequence, at the profiled batch sizes."""

    batch_sizes: list[int]
    target: dict[int, list[float]]  # q -> seconds per batch size
    mtp: list[float]  # seconds per batch size

    def _interp(self, values: list[float], b: int) -> float:
        bs = self.batch_sizes
        i = bisect.bisect_left(bs, b)
        if i == 0:
            return values[0]
        if i == len(bs):
            return values[-1] * b / bs[-1]
        lo, hi = bs[i - 1], bs[i]
        return values[i - 1] + (values[i] - values[i - 1]) * (b - lo) / (hi - lo)

    def bucket(self, b: int) -> int:
        """The smallest profiled batch size >= b (the largest past the end)."""
        return self.batch_sizes[min(bisect.bisect_left(self.batch_sizes, b), len(self.batch_sizes) - 1)]

    def step_seconds(self, b: int, k: int) -> float:
        qs = sorted(self.target)
        q = min(qs, key=lambda x: abs(x - (k + 1)))
        target = self._interp(self.target[q], b) * (k + 1) / q
        return target + (k * self._interp(self.mtp, b) if k else 0.0)


class DraftPolicy:
    """mode 'off' (k = 0), 'fixed' (k = max_k), or 'adaptive' (throughput-optimal k per step).

    Acceptance is learned per draft depth: a[j] = P(draft j+1 accepted | drafts 1..j accepted),
    since a draft chained on drafts is right less often than the first one; treating depths as
    one i.i.d. rate over-values long drafts. Step costs are profiled forwards, corrected as the
    executor runs: for each profiled batch size and k, the ratio of whole decode steps (the
    runner's Python, drafting's catch-up over positions verified since the last draft, the
    outputs) to the profiled forwards is learned; a k not yet run there borrows k = 0's ratio.
    Steps that catch the MTP cache up over a prompt are left out (a one-off per request, they
    would price every later step), and so are steps in which not every sequence drafted k. A ratio
    starts from k = 0's (from 1, the profile, for k = 0 itself) and moves by smoothing, one step's
    sample clipped to within 2x of it: an optimistic start that a single slow step cannot turn into
    a k priced out for good. Drafting needs a predicted gain of at least MIN_GAIN, for what stays
    unmodelled (those prompt catch-ups, the prefill work drafts delay). Every EXPLORE_EVERY-th step
    at a batch size runs a neighbour of the chosen k instead (one more draft and one fewer in turn; one
    more only where it would win if that draft were always accepted), so the costs and acceptance next
    to the choice are measured again; the gain is one-peaked in k
    (each extra draft costs more than the last and is accepted less often), so a far k never beats a
    near one that loses, and trying it, at a large batch size, costs a step several times plain's.
    """

    MIN_GAIN = 1.1
    EXPLORE_EVERY = 64

    def __init__(self, mode: str, max_k: int, costs: StepCosts | None = None, prior_acceptance: float = 0.7,
                 smoothing: float = 0.05, cost_smoothing: float = 0.1):
        if mode not in ("off", "fixed", "adaptive"):
            raise ValueError(f"speculation must be 'off', 'fixed' or 'adaptive', got {mode!r}")
        if mode == "adaptive" and costs is None:
            raise ValueError("adaptive speculation needs measured step costs")
        self.mode, self.max_k, self.costs = mode, max_k if mode != "off" else 0, costs
        self.acceptance_by_depth = [prior_acceptance] * max(max_k, 1)  # smoothed conditional rates
        self.smoothing, self.cost_smoothing = smoothing, cost_smoothing
        self.cost_ratio: dict[tuple[int, int], float] = {}  # (profiled batch size, k) -> whole step / profiled
        self.decisions: dict[int, int] = {}  # profiled batch size -> steps decided there

    @property
    def acceptance(self) -> float:
        """Acceptance of the first draft (what k = 1 would see)."""
        return self.acceptance_by_depth[0]

    def observe(self, results: list[StepResult]) -> None:
        """Depth j is reached when drafts 1..j-1 passed; it counts as accepted when draft j did too."""
        reached = [0] * len(self.acceptance_by_depth)
        accepted = [0] * len(self.acceptance_by_depth)
        for r in results:
            for j in range(min(r.num_accepted + 1, r.num_drafts)):
                reached[j] += 1
                accepted[j] += j < r.num_accepted
        for j, n in enumerate(reached):
            if n:
                self.acceptance_by_depth[j] += self.smoothing * (accepted[j] / n - self.acceptance_by_depth[j])

    def observe_step(self, batch_size: int, k: int, seconds: float) -> None:
        """A whole decode step (no prefill in it) of batch_size sequences at draft length k took `seconds`."""
        if self.mode != "adaptive" or batch_size == 0:
            return
        bucket = self.costs.bucket(batch_size)
        old = self._ratio(bucket, k)
        ratio = min(max(seconds / self.costs.step_seconds(batch_size, k), old / 2), old * 2)
        self.cost_ratio[(bucket, k)] = old + self.cost_smoothing * (ratio - old)

    def _ratio(self, bucket: int, k: int) -> float:
        """Whole step / profiled forwards at a profiled batch size: learned, else k = 0's, else 1."""
        return self.cost_ratio.get((bucket, k), self.cost_ratio.get((bucket, 0), 1.0))

    def expected_tokens(self, k: int) -> float:
        """1 + sum over depths j <= k of P(drafts 1..j all accepted)."""
        total, p = 1.0, 1.0
        for a in self.acceptance_by_depth[:k]:
            p *= a
            total += p
        return total

    def step_seconds(self, batch_size: int, k: int) -> float:
        """Predicted seconds of a whole decode step: the profiled forwards times the learned ratio."""
        return self.costs.step_seconds(batch_size, k) * self._ratio(self.costs.bucket(batch_size), k)

    def _rate(self, batch_size: int, drafters: int, k: int, tokens: float) -> float:
        """Predicted tokens per second of a step at draft length k where each drafter emits `tokens`."""
        return (batch_size + drafters * (tokens - 1)) / self.step_seconds(batch_size, k)

    def choose(self, batch_size: int, drafters: int | None = None) -> int:
        """k for a step of batch_size decodes, `drafters` of which can draft (default: all)."""
        if self.mode != "adaptive" or batch_size == 0:
            return self.max_k
        drafters = batch_size if drafters is None else drafters
        rate = {k: self._rate(batch_size, drafters, k, self.expected_tokens(k)) for k in range(self.max_k + 1)}
        best = max(rate, key=rate.get)
        choice = best if rate[best] >= self.MIN_GAIN * rate[0] else 0
        bucket = self.costs.bucket(batch_size)
        n = self.decisions[bucket] = self.decisions.get(bucket, 0) + 1
        if self.max_k and n % self.EXPLORE_EVERY == 0:  # explore a neighbour: one draft more, then one fewer
            up = choice == 0 or ((n // self.EXPLORE_EVERY) % 2 == 1 and choice < self.max_k)
            if not up:
                return choice - 1
            # One draft more only if it could win were that draft always accepted (reached whenever drafts
            # 1..choice pass): otherwise no acceptance could make it the choice, and trying it would cost a
            # step (with a catch-up over every prompt not yet drafted from) to learn nothing.
            always = self.expected_tokens(choice) + math.prod(self.acceptance_by_depth[:choice])
            if self._rate(batch_size, drafters, choice + 1, always) >= max(rate[choice], self.MIN_GAIN * rate[0]):
                return choice + 1
        return choice


class Scheduler:
    MTP_IDLE_LIMIT = 8  # decode steps in a row for which adaptive speculation chose k = 0 before it drops a sequence

    def __init__(self, config: SchedulerConfig, cache: KVCache, policy: DraftPolicy):
        self.config, self.cache, self.policy = config, cache, policy
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
        seats = max(self.config.max_batch_size - len(self.running), 0)
        waiting = [s for s in self.running if s.in_prefill] + list(self.waiting)[:seats]
        prefill = sum(s.num_to_prefill for s in waiting)
        return max(0, (budget - num_decodes - prefill) // num_decodes)

    def _drafts_for(self, seq: Sequence, k: int) -> int:
        if not seq.can_draft:
            return 0
        room = min(self.config.max_seq_len - seq.num_tokens, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(k, room))

    def schedule(self) -> list[Scheduled]:
        budget = self.config.max_num_tokens
        preemptions = self.preemptions
        decodes = [s for s in self.running if not s.in_prefill]
        drafters = sum(s.can_draft for s in decodes)
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
            budget = self.config.max_num_tokens - sum(it.num_new for it in plan)
        admit = not stalled and self.preemptions == preemptions
        while admit and self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            seq = self.waiting[0]
            chunk = min(seq.num_to_prefill, budget)
            try:
                self.cache.grow(seq.block_table, seq.num_cached + max(chunk, 1))
            except OutOfBlocks:
                break  # new requests wait for blocks
            self.waiting.popleft()
            self.admissions += 1
            seq.status, seq.admitted_at = Status.RUNNING, self.admissions
            self.running.append(seq)
            plan.append(Scheduled(seq, chunk) if chunk else Scheduled(seq, 1, 0))
            budget -= max(chunk, 1)
        return plan

    def after_step(self, results: list[StepResult]) -> None:
        """Give back blocks past what each sequence needs (rejected drafts), learn acceptance; under
        adaptive speculation, drop drafting for sequences that decoded MTP_IDLE_LIMIT steps in a row
        for which the policy chose k = 0 (not steps the token budget, the cache or max_tokens cut)."""
        for r in results:
            seq = r.seq
            if seq.status is Status.RUNNING:
                self.cache.shrink(seq.block_table, seq.num_tokens)
            if r.new_token_ids and self.policy.mode == "adaptive" and not seq.mtp_dropped:
                seq.mtp_idle_steps = seq.mtp_idle_steps + 1 if self.policy_k == 0 else 0
                if seq.mtp_idle_steps >= self.MTP_IDLE_LIMIT:
                    seq.drop_mtp()
        self.policy.observe(results)
