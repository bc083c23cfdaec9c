"""How many tokens to draft: fixed, off, or adaptive, the k that maximizes expected tokens per second for
the current batch, from the acceptance measured per draft depth and kind of request and a step cost table
profiled on this machine at start-up (k = 0 when verifying costs more than it saves). It learns from the
steps the executor runs (`Scheduler.update_from_output` feeds it)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass

from runtime.core.plan import StepResult
from runtime.core.sampling_params import SamplingParams

# Greedy requests, seeded sampled ones (the race) and other sampled ones (rejection sampling) accept drafts at
# different rates, so the policy learns each apart: sampled traffic must not price drafts for greedy requests.
GREEDY, SEEDED, SAMPLED = "greedy", "seeded", "sampled"
KINDS = (GREEDY, SEEDED, SAMPLED)
SPECULATION_MODES = ("off", "fixed", "adaptive")


def check_speculation(mode: object) -> None:
    if mode not in SPECULATION_MODES:
        raise ValueError(f"speculation must be 'off', 'fixed' or 'adaptive', got {mode!r}")


def draft_kind(params: SamplingParams) -> str:
    return GREEDY if params.greedy else SEEDED if params.races else SAMPLED


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
    one i.i.d. rate over-values long drafts. It is learned per kind of request (`draft_kind`), and a
    step's expected tokens sum each drafter's by its kind. Step costs are profiled forwards, corrected as the
    executor runs: for each profiled batch size and k, the ratio of whole decode steps (the
    runner's Python, drafting's catch-up over positions verified since the last draft, the
    outputs) to the profiled forwards is learned; a k not yet run there borrows k = 0's ratio.
    Steps that catch the MTP cache up over a prompt are left out (a one-off per request, they
    would price every later step), and so are steps in which not every sequence drafted k. Over a k's
    first MIN_COST_SAMPLES steps its ratio is their median (a profile taken on a busy start-up can be
    off by more than smoothing would mend soon, and one slow step among them does not count), then
    each step moves it by smoothing; every sample is clipped to within 2x of the ratio. Drafting needs a
    predicted gain of at least MIN_GAIN, for what stays unmodelled (those prompt catch-ups, the prefill
    work drafts delay). Every EXPLORE_EVERY-th step at a batch size runs a neighbour of the chosen k
    instead (one more draft and one fewer in turn; one more only where it would win if that draft were
    always accepted), so the costs and acceptance next to the choice are measured again. A k one above
    the choice that has not yet been priced by MIN_COST_SAMPLES steps there is run on that step and the
    next, whatever the profile predicts (the first is a sequence's catch-up, left out; the second is
    priced), so a profile that over-priced drafting cannot rule it out for good; the gain is one-peaked in k
    (each extra draft costs more than the last and is accepted less often), so a far k never beats a
    near one that loses, and trying it, at a large batch size, costs a step several times plain's.
    """

    MIN_GAIN = 1.1
    EXPLORE_EVERY = 64
    MIN_COST_SAMPLES = 4

    def __init__(self, mode: str, max_k: int, costs: StepCosts | None = None, prior_acceptance: float = 0.7,
                 smoothing: float = 0.05, cost_smoothing: float = 0.1):
        check_speculation(mode)
        if mode == "adaptive" and costs is None:
            raise ValueError("adaptive speculation needs measured step costs")
        self.mode, self.max_k, self.costs = mode, max_k if mode != "off" else 0, costs
        # per kind, smoothed conditional rates
        self.acceptance_by_depth = {kind: [prior_acceptance] * max(max_k, 1) for kind in KINDS}
        self.drafted = dict.fromkeys(KINDS, 0)  # drafting steps observed per kind
        self.smoothing, self.cost_smoothing = smoothing, cost_smoothing
        self.cost_ratio: dict[tuple[int, int], float] = {}  # (profiled batch size, k) -> whole step / profiled
        self.first_ratios: dict[tuple[int, int], list[float]] = {}  # (profiled batch size, k) -> first samples
        self.decisions: dict[int, int] = {}  # profiled batch size -> steps decided there

    @property
    def acceptance(self) -> float:
        """Acceptance of the first draft (what k = 1 would see), of the kind of request that drafted most."""
        return self.acceptance_by_depth[max(KINDS, key=self.drafted.get)][0]

    def observe(self, results: list[StepResult]) -> None:
        """Depth j is reached when drafts 1..j-1 passed; it counts as accepted when draft j did too."""
        depth = len(self.acceptance_by_depth[GREEDY])
        seen: dict[str, tuple[list[int], list[int]]] = {}  # kind -> (reached, accepted) per depth, in one pass
        for r in results:
            if r.num_drafts:
                kind = draft_kind(r.seq.params)
                reached, accepted = seen.setdefault(kind, ([0] * depth, [0] * depth))
                self.drafted[kind] += 1
                for j in range(min(r.num_accepted + 1, r.num_drafts)):
                    reached[j] += 1
                    accepted[j] += j < r.num_accepted
        for kind, (reached, accepted) in seen.items():
            rates = self.acceptance_by_depth[kind]
            for j, n in enumerate(reached):
                if n:
                    rates[j] += self.smoothing * (accepted[j] / n - rates[j])

    def observe_step(self, batch_size: int, k: int, seconds: float) -> None:
        """A whole decode step (no prefill in it) of batch_size sequences at draft length k took `seconds`."""
        if self.mode != "adaptive" or batch_size == 0:
            return
        key = (self.costs.bucket(batch_size), k)
        old = self._ratio(*key)
        ratio = min(max(seconds / self.costs.step_seconds(batch_size, k), old / 2), old * 2)
        first = self.first_ratios.setdefault(key, [])
        if len(first) < self.MIN_COST_SAMPLES:
            first.append(ratio)
            self.cost_ratio[key] = sorted(first)[(len(first) - 1) // 2]
        else:
            self.cost_ratio[key] = old + self.cost_smoothing * (ratio - old)

    def _ratio(self, bucket: int, k: int) -> float:
        """Whole step / profiled forwards at a profiled batch size: learned, else k = 0's, else 1."""
        return self.cost_ratio.get((bucket, k), self.cost_ratio.get((bucket, 0), 1.0))

    def expected_tokens(self, k: int, kind: str = GREEDY) -> float:
        """1 + sum over depths j <= k of P(drafts 1..j all accepted), for a request of `kind`."""
        total, p = 1.0, 1.0
        for a in self.acceptance_by_depth[kind][:k]:
            p *= a
            total += p
        return total

    def step_seconds(self, batch_size: int, k: int) -> float:
        """Predicted seconds of a whole decode step: the profiled forwards times the learned ratio."""
        return self.costs.step_seconds(batch_size, k) * self._ratio(self.costs.bucket(batch_size), k)

    def _rate(self, batch_size: int, drafters: Mapping[str, int], k: int, tokens: Mapping[str, float]) -> float:
        """Predicted tokens per second of a step at draft length k where each drafter emits its kind's `tokens`."""
        extra = sum(n * (tokens[kind] - 1) for kind, n in drafters.items())
        return (batch_size + extra) / self.step_seconds(batch_size, k)

    def _rates(self, batch_size: int, drafters: Mapping[str, int]) -> dict[int, float]:
        return {k: self._rate(batch_size, drafters, k, {kind: self.expected_tokens(k, kind) for kind in drafters})
                for k in range(self.max_k + 1)}

    def drafts_at(self, batch_size: int) -> bool:
        """Whether a step of batch_size decodes, all able to draft and of one kind, would draft for some kind
        (`choose` without exploring and without counting a decision)."""
        if self.mode != "adaptive":
            return self.max_k > 0
        for kind in KINDS:
            rate = self._rates(batch_size, {kind: batch_size})
            if max(rate.values()) >= self.MIN_GAIN * rate[0]:
                return True
        return False

    def choose(self, batch_size: int, drafters: Mapping[str, int] | None = None) -> int:
        """k for a step of batch_size decodes, `drafters[kind]` of which can draft and are of that kind (default:
        all, greedy)."""
        if self.mode != "adaptive" or batch_size == 0:
            return self.max_k
        drafters = {GREEDY: batch_size} if drafters is None else drafters
        rate = self._rates(batch_size, drafters)
        best = max(rate, key=rate.get)
        choice = best if rate[best] >= self.MIN_GAIN * rate[0] else 0
        bucket = self.costs.bucket(batch_size)
        n = self.decisions[bucket] = self.decisions.get(bucket, 0) + 1
        if choice < self.max_k and n > 1 and n % self.EXPLORE_EVERY < 2 \
                and len(self.first_ratios.get((bucket, choice + 1), ())) < self.MIN_COST_SAMPLES:
            # a k not yet priced is tried on two decisions in a row: a sequence's first drafting step catches the MTP
            # layer up over its prompt and is left out of the costs, the second is priced
            return choice + 1
        if self.max_k and n % self.EXPLORE_EVERY == 0:  # explore a neighbour: one draft more, then one fewer
            up = choice == 0 or ((n // self.EXPLORE_EVERY) % 2 == 1 and choice < self.max_k)
            if not up:
                return choice - 1
            # One draft more only if it could win were that draft always accepted (reached whenever drafts
            # 1..choice pass): otherwise no acceptance could make it the choice, and trying it would cost a
            # step (with a catch-up over every prompt not yet drafted from) to learn nothing.
            always = {kind: self.expected_tokens(choice, kind) + math.prod(self.acceptance_by_depth[kind][:choice])
                      for kind in drafters}
            if self._rate(batch_size, drafters, choice + 1, always) >= max(rate[choice], self.MIN_GAIN * rate[0]):
                return choice + 1
        return choice
