"""Sampling parameters, target/draft distributions and the acceptance rules of speculative decoding.

Randomness is counter-based: every uniform draw is a hash of (request seed, token position, purpose),
so a seeded request draws the same numbers whatever else shares its batch, and the draws are
vectorized over the batch without per-request generator objects. Its output repeats when its
draft lengths repeat (always at k = 0; at a fixed k unless a full token budget cuts drafts).
Lossless acceptance consumes the draws differently for different k, so under adaptive
speculation, whose k follows the load, a seeded sampled request can take another path, drawn
from the same distribution. Greedy output never depends on k.

Acceptance (rows are sequences, columns draft positions j = 0..k-1, target rows j = 0..k):
- greedy: accept while the draft equals the target argmax; emit the argmax at the first mismatch;
- lossless sampling (Leviathan et al.): accept d_j with probability min(1, p_j(d_j) / q_j(d_j));
  at the first rejection sample from normalize(max(0, p_j - q_j)); after k acceptances sample the
  bonus token from p_k. The emitted tokens follow p exactly, for any draft distribution q;
- relaxed (TensorRT-LLM's, for thinking; lossy, greedy only): also accept d_j when it is among the
  target's top-N and p_j(d_j) >= p_j(top1) - delta.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from runtime.model.config import is_int, is_number


def _as_given(value: object) -> object:
    """A list field as the caller wrote it (SamplingParams holds lists as tuples)."""
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation parameters (names as vLLM / TensorRT-LLM use them)."""

    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = all tokens
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    bad_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        """A single stop string is one stop string (not one per character); lists become tuples."""
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids", "bad_token_ids"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the parameter and what was expected."""
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {_as_given(self.stop)!r}")
        for name in ("stop_token_ids", "bad_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not all(map(is_int, ids)):
                raise ValueError(f"{name} must be a list of integer token ids, got {_as_given(ids)!r}")
            bad = [t for t in ids if vocab_size is not None and not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} must be token ids in [0, {vocab_size}), got {bad}")
        if vocab_size is not None and len(set(self.bad_token_ids)) == vocab_size:
            raise ValueError(f"bad_token_ids bans all {vocab_size} tokens; at least one must stay allowed")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_argmax(self) -> bool:
        """Greedy with nothing banned: a token is the logits' plain argmax, drafts included."""
        return self.greedy and not self.bad_token_ids


@dataclass(frozen=True)
class RelaxedAcceptance:
    """TensorRT-LLM's relaxed acceptance for reasoning models; off unless configured."""

    top_n: int = 10
    delta: float = 0.6
    begin_thinking_token: int = -1
    end_thinking_token: int = -1

    def __post_init__(self) -> None:
        if not is_int(self.top_n) or self.top_n < 1:
            raise ValueError(f"relaxed acceptance top_n must be an integer >= 1, got {self.top_n!r}")
        if not is_number(self.delta) or not 0 <= self.delta <= 1:
            raise ValueError(f"relaxed acceptance delta must be in [0, 1], got {self.delta!r}")

    def advance(self, thinking: bool, token: int) -> bool:
        """Whether a thinking span is open after `token`, given whether one was open before it."""
        return True if token == self.begin_thinking_token else False if token == self.end_thinking_token else thinking


# ---- counter-based uniforms --------------------------------------------------------------------
PURPOSE_ACCEPT, PURPOSE_SAMPLE, PURPOSE_DRAFT = 1, 2, 3
_M32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (multipliers below 2^31 so int64 products never overflow)."""
    x = x & _M32
    for mult in (0x7FEB352D, 0x68E31DA5, 0x5BD1E995):
        x = ((x ^ (x >> 16)) * mult) & _M32
    return x ^ (x >> 15)


def uniforms(seeds: Tensor, positions: Tensor, purpose: int) -> Tensor:
    """U(0,1) float64 draws, one per (seed, position) pair; same inputs give the same numbers. Both
    halves of a 64-bit seed go into two different 32-bit hashes, so seeds such as 1 and 2^32 differ."""
    seed_lo, seed_hi = seeds & _M32, seeds >> 32
    where = _mix32(positions * 4 + purpose)
    hi = _mix32(_mix32(_mix32(seed_lo) ^ seed_hi) ^ where)
    lo = _mix32(_mix32(_mix32(seed_hi ^ 0x27D4EB2F) ^ seed_lo) ^ _mix32(where ^ 0x165667B1))
    return (hi.double() * 2.0**32 + lo.double() + 0.5) / 2.0**64


# ---- distributions ---------------------------------------------------------------------------
@dataclass
class SamplingTensors:
    """Per-row sampling parameters of a batch as tensors (rows are token positions to decide)."""

    temperature: Tensor  # [R] float; 0 marks a greedy row
    top_k: Tensor  # [R] long; 0 = off
    top_p: Tensor  # [R] float
    bad_mask: Tensor | None = field(default=None)  # [R, V] True where the token is banned

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())


def probabilities(logits: Tensor, st: SamplingTensors) -> Tensor:
    """Softmax of logits/temperature after top-k and top-p; greedy rows become one-hot argmax."""
    logits = logits.float()
    if st.bad_mask is not None:
        logits = logits.masked_fill(st.bad_mask, float("-inf"))
    greedy = st.temperature == 0
    temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    # shifted so the largest is 0: a tiny temperature then sends the rest to -inf (the argmax), not to inf / NaN;
    # a banned token stays -inf at any temperature (an infinite one, a float32 overflow, would make it NaN)
    shifted = logits - logits.amax(-1, keepdim=True)
    scaled = torch.where(shifted == float("-inf"), shifted, shifted / temp[:, None])
    if bool(((st.top_k > 0) | (st.top_p < 1)).any()):
        order = shifted.sort(dim=-1, descending=True).indices  # the ranking of any temperature, without its ties
        sorted_logits = scaled.gather(-1, order)
        rank = torch.arange(scaled.shape[-1], device=scaled.device)
        drop = (st.top_k[:, None] > 0) & (rank[None, :] >= st.top_k[:, None])
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        nucleus = (sorted_probs.cumsum(-1) - sorted_probs) >= st.top_p[:, None]  # keep the smallest nucleus
        nucleus[:, 0] = False  # and never less than the top token (a top_p below float32's least is 0 here)
        drop |= nucleus & (st.top_p[:, None] < 1)  # rounding must not cut the tail of a row without top-p
        scaled = scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = scaled.softmax(-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def sample(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling of one token per row with the given uniforms."""
    cdf = probs.double().cumsum(-1)
    u = u[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, u).clamp(max=probs.shape[-1] - 1).squeeze(-1)


def accept_greedy(drafts: list[int], target_argmax: list[int]) -> int:
    """How many leading drafts equal the target's argmax at their position (target_argmax has one more)."""
    n = 0
    while n < len(drafts) and drafts[n] == target_argmax[n]:
        n += 1
    return n


def accept(
    drafts: Tensor, draft_probs: Tensor | None, target_probs: Tensor, num_drafts: Tensor,
    seeds: Tensor, positions: Tensor, greedy: Tensor,
    relaxed: RelaxedAcceptance | None = None, relaxed_probs: Tensor | None = None, relaxed_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Decide a prefix of each row's drafts and the token that follows it.

    drafts [B, K] (padding past num_drafts[b] is ignored), draft_probs [B, K, V] or None for one-hot
    (argmax) drafts, target_probs [B, K+1, V] after temperature/top-k/top-p (one-hot for greedy rows),
    positions [B] the absolute position of each row's first draft, greedy [B] bool. Relaxed
    acceptance needs the plain softmax of the target logits [B, K, V] and a [B, K] mask of the draft
    positions inside a thinking span. Returns (num_accepted [B], next_token [B]): row b emits
    drafts[b, :num_accepted[b]] then next_token[b].
    """
    B, K = drafts.shape
    row = torch.arange(B, device=drafts.device)
    if K == 0:
        num_accepted = torch.zeros(B, dtype=torch.long, device=drafts.device)
        residual = target_probs[:, 0]
    else:
        cols = torch.arange(K, device=drafts.device)
        p_draft = target_probs[:, :K].gather(-1, drafts[..., None]).squeeze(-1)  # p_j(d_j)
        q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
        u = uniforms(seeds[:, None].expand(B, K), positions[:, None] + cols[None, :], PURPOSE_ACCEPT)
        ok_random = u < (p_draft / q_draft.clamp_min(1e-30)).double()
        ok_greedy = drafts == target_probs[:, :K].argmax(-1)
        if relaxed is not None and relaxed_probs is not None:
            top = relaxed_probs.topk(min(relaxed.top_n, relaxed_probs.shape[-1]), dim=-1)
            p_relaxed = relaxed_probs.gather(-1, drafts[..., None]).squeeze(-1)
            in_top = (top.indices == drafts[..., None]).any(-1)
            ok_greedy |= relaxed_mask & in_top & (p_relaxed >= top.values[..., 0] - relaxed.delta)
        ok = torch.where(greedy[:, None], ok_greedy, ok_random) & (cols[None, :] < num_drafts[:, None])
        num_accepted = ok.long().cumprod(-1).sum(-1)  # [B]
        # The token after the accepted prefix comes from normalize(max(0, p - q)) at the first
        # rejection, or from p itself after the last draft (where q is zero).
        rejected = num_accepted < num_drafts
        at = num_accepted.clamp(max=K - 1)
        p_next = target_probs[row, num_accepted]  # [B, V]
        if draft_probs is None:  # q is one-hot on the rejected draft
            d = drafts[row, at]
            residual = p_next.clone()
            residual[row, d] = torch.where(rejected, 0.0, p_next[row, d])
        else:
            q_next = torch.where(rejected[:, None], draft_probs[row, at], 0.0)
            residual = (p_next - q_next).clamp_min(0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)  # p == q: sample p
    next_token = torch.where(greedy, target_probs[row, num_accepted].argmax(-1),
                             sample(residual, uniforms(seeds, positions + num_accepted, PURPOSE_SAMPLE)))
    return num_accepted, next_token
