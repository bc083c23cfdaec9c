"""Target/draft distributions and the acceptance rules of speculative decoding.

Randomness is counter-based: every draw is a hash of (request seed, token position, purpose, and for the
race below the token), so a request draws the same numbers whatever else shares its batch, and the draws are
vectorized over the batch without per-request generator objects.

Acceptance (rows are sequences, columns draft positions j = 0..k-1, target rows j = 0..k):
- greedy: accept while the draft equals the target argmax; emit the argmax at the first mismatch;
- seeded sampling (an exponential race, the Gumbel-max trick): target row j picks argmax_v p_j(v) / E_v with
  E_v ~ Exp(1) hashed from (seed, position, v) (a 64-bit uniform each): a sample of p_j that depends only on the
  seed, the position and p_j. Drafts race on the MTP distribution with the same E at the same position; they are
  accepted while they equal the target's pick, and the pick at the first mismatch follows them. Every emitted
  token is the pick plain decoding makes at its position, so a seeded request's output is the same for every
  draft length, batch and load (adaptive speculation included), and follows p exactly (Daliri et al. 2024,
  "drafter-invariant speculative decoding"). A draft is accepted with P[race(p) = race(q)] >= (1 - TV) / (1 + TV),
  TV the total variation distance of p and q, a little below rejection sampling's 1 - TV: so it is kept for
  requests that set a seed (SamplingParams.races);
- other sampling, lossless rejection sampling (Leviathan et al.): accept d_j with probability
  min(1, p_j(d_j) / q_j(d_j)); at the first rejection sample from normalize(max(0, p_j - q_j)); after k
  acceptances sample the bonus token from p_k. The emitted tokens follow p exactly, for any draft distribution q;
- relaxed (TensorRT-LLM's, for thinking; lossy, greedy only): also accept d_j when it is among the
  target's top-N and p_j(d_j) >= p_j(top1) - delta.

Penalties and min_tokens depend on the tokens before a position, so row j of a sequence (its output
token num_output + j) is decided with the counts its own prefix has: the output so far plus drafts
d_1..d_j-1 (accepted drafts are exactly that prefix). Target rows and drafts use the same rule, so
greedy output with penalties is plain decoding's and sampled output follows the penalized target.
A guided request's grammar bans, per row, the tokens its state after that same prefix refuses (a bitmask
per row, runtime.core.grammar): drafts are drawn from the MTP distribution so masked, target rows are
masked the same way, and the acceptance rules above then apply to the masked distributions unchanged.
Order, as vLLM and HF: repetition penalty (HF / TensorRT-LLM: over prompt and output), frequency and
presence penalties (OpenAI: over the output), bans (bad tokens, stop tokens before min_tokens), then
temperature, top-k, top-p.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from runtime.core.sampling_params import RelaxedAcceptance
from runtime.model.kernels import cpu_kernels
from runtime.model.kernels.modules import cpu_kernels_serve


# ---- counter-based draws -----------------------------------------------------------------------
PURPOSE_RACE, PURPOSE_ACCEPT, PURPOSE_SAMPLE, PURPOSE_DRAFT = 0, 1, 2, 3
_M32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (multipliers below 2^31 so int64 products never overflow)."""
    x = x & _M32
    for mult in (0x7FEB352D, 0x68E31DA5, 0x5BD1E995):
        x = ((x ^ (x >> 16)) * mult) & _M32
    return x ^ (x >> 15)


def _hashes(seeds: Tensor, positions: Tensor, purpose: int) -> tuple[Tensor, Tensor]:
    """Two 32-bit hashes (int64, on the tensors' device) of each (seed, position, purpose); both halves of a 64-bit
    seed go into each, so seeds such as 1 and 2^32 differ. The CPU kernels compute the same (`seed_hash`)."""
    seed_lo, seed_hi = seeds & _M32, seeds >> 32
    where = _mix32(positions * 4 + purpose)
    hi = _mix32(_mix32(_mix32(seed_lo) ^ seed_hi) ^ where)
    lo = _mix32(_mix32(_mix32(seed_hi ^ 0x27D4EB2F) ^ seed_lo) ^ _mix32(where ^ 0x165667B1))
    return hi, lo


def uniforms(seeds: Tensor, positions: Tensor, purpose: int) -> Tensor:
    """U(0,1) float64 draws, one per (seed, position) pair; same inputs give the same numbers. In one kernel call
    where the CPU kernels are (bit for bit the torch ops', which are many small ops)."""
    if seeds.device.type == "cpu" and (kernels := cpu_kernels()) is not None:
        seeds, positions = torch.broadcast_tensors(seeds, positions)
        draws = kernels.uniforms(seeds.flatten().contiguous(), positions.flatten().contiguous(), purpose)
        return draws.view(seeds.shape)
    hi, lo = _hashes(seeds, positions, purpose)
    return (hi.double() * 2.0**32 + lo.double() + 0.5) / 2.0**64


@functools.lru_cache(maxsize=8)
def _token_codes(vocab_size: int, device: torch.device) -> Tensor:
    return _mix32(torch.arange(vocab_size, device=device) + 0x9E3779B9)


def race(probs: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """One token per row of probs [B, V], distributed as the row: argmax_v p(v) / E_v with E_v ~ Exp(1) a hash of
    (seed, position, v), the same for the same inputs. In one kernel call where the CPU kernels run (bit for bit the
    torch ops' pick); with torch ops a few rows at a time, since each row's draws take V float64 and int64 values."""
    if cpu_kernels_serve(probs.device, probs.dtype):
        return cpu_kernels().race(probs.contiguous(), seeds.contiguous(), positions.contiguous(), PURPOSE_RACE)
    hi, lo = _hashes(seeds, positions, PURPOSE_RACE)
    rows = max(1, 2**20 // probs.shape[-1])
    return torch.cat([(probs[i : i + rows].double() / arrivals(hi[i : i + rows], lo[i : i + rows], probs.shape[-1]))
                      .argmax(-1) for i in range(0, probs.shape[0], rows)])


def arrivals(hi: Tensor, lo: Tensor, vocab_size: int) -> Tensor:
    """The race's Exp(1) draws [B, V] float64 from each row's two 32-bit keys: E = -log(1 - w) with w a 64-bit
    uniform, so that a token as unlikely as 1e-15 still wins as often as it should (a 32-bit draw cannot make E
    smaller than 1.2e-10)."""
    x1 = _mix32(hi[:, None] ^ _token_codes(vocab_size, hi.device))
    x2 = _mix32(x1 ^ lo[:, None])
    w = (x1.double() * 2.0**32 + x2.double() + 0.5) / 2.0**64
    return -torch.log1p(-w)


# ---- distributions ---------------------------------------------------------------------------
@dataclass
class Adjustments:
    """Logit biases, penalties and token bans of a batch's rows, per sequence: rows b * num_rows + r are sequence b's
    output tokens num_output + first + r, each decided after the drafts before it (drafts[b, :first + r]), whose
    occurrences its frequency / presence / repetition penalties count on top of the output's. Applied in one kernel
    call where the CPU kernels run (a few small torch ops per step cost more than the work), else with torch ops."""

    num_rows: int
    first: int
    drafts: Tensor | None  # [B, >= first + num_rows - 1] long; None when no row follows a draft
    penalized: list[int]  # the sequences with penalties
    counts: list[Tensor]  # theirs: output token counts [V] float32 (drafts not included)
    in_prompt: list[Tensor]  # [V] bool
    values: list[float]  # repetition, presence, frequency of each penalized sequence in turn
    bad: list[list[int]]  # per sequence: tokens banned in all its rows
    stops: list[list[int]]  # per sequence: stop tokens banned in its first stop_rows rows (min_tokens)
    stop_rows: list[int]
    bias_tokens: list[Tensor]  # per sequence: the tokens its logit_bias names (int64, empty for none)
    bias_values: list[Tensor]  # and what it adds to each one's logit in all its rows (float32)
    # a guided batch's grammar bitmasks [B * num_rows, >= ceil(V / 32)] int32 on the host: bit t % 32 of word t // 32
    # set where the row's grammar allows token t (all set for a row without one); bad and stop bans that would leave
    # nothing it allows yield to it in that row
    allowed: Tensor | None = None

    def apply(self, logits: Tensor) -> Tensor:
        """float32 logits [B * num_rows, V] adjusted (a new tensor): the logit biases added (vLLM's and TensorRT-LLM's
        order), HF's repetition penalty over prompt and output (a positive logit divided, a negative one multiplied),
        OpenAI's frequency and presence penalties over the output, then the bans (-inf)."""
        logits = logits.float()
        if cpu_kernels_serve(logits.device, logits.dtype):
            drafts = torch.empty(0, 0, dtype=torch.long) if self.drafts is None else self.drafts.contiguous()
            allowed = torch.empty(0, 0, dtype=torch.int32) if self.allowed is None else self.allowed.contiguous()
            return cpu_kernels().adjust_logits(logits.contiguous(), self.num_rows, self.first, drafts,
                                               *self.kernel_args(), allowed)
        return self.apply_with_torch(logits)

    def kernel_args(self) -> tuple:
        """The penalties and bans as the kernels take them (`adjust_logits`, `kernels.greedy_step`)."""
        return (self.penalized, self.counts, self.in_prompt, self.values, self.bad, self.stops, self.stop_rows,
                self.bias_tokens, self.bias_values)

    def apply_with_torch(self, logits: Tensor) -> Tensor:
        """`apply` with torch ops (where the CPU kernels do not run)."""
        logits = logits.float()
        if any(len(t) for t in self.bias_tokens):
            logits = self._bias(logits)
        if self.penalized:
            logits = self._penalize(logits)
        V = logits.shape[-1]
        bans = ban_mask(self.bad, self.stops, self.stop_rows, self.num_rows, V)
        if self.allowed is not None:
            refused = refused_tokens(self.allowed, V)
            if bans is not None:  # bans that leave nothing the grammar allows yield to it
                empty = (bans | refused).all(-1)
                refused = torch.where(empty[:, None], refused, bans | refused)
            bans = refused
        return logits if bans is None else logits.masked_fill(bans.to(logits.device), float("-inf"))

    def _bias(self, logits: Tensor) -> Tensor:
        logits = logits.clone()
        n = self.num_rows
        for b, (tokens, values) in enumerate(zip(self.bias_tokens, self.bias_values)):
            if len(tokens):
                rows = logits[b * n : (b + 1) * n]
                rows[:, tokens] += values
        return logits

    def _penalize(self, logits: Tensor) -> Tensor:
        V, dev, n = logits.shape[-1], logits.device, self.num_rows
        counts = torch.stack(self.counts)[:, None].expand(-1, n, -1)  # [P, rows, V]
        last = self.first + n - 1  # drafts before the last row
        if last > 0:
            d = self.drafts[torch.tensor(self.penalized, device=self.drafts.device), :last].to(dev)
            before = torch.zeros(len(self.penalized), last + 1, V, device=dev)
            before[:, 1:].scatter_(2, d[..., None], 1.0)
            counts = counts + before.cumsum(1)[:, self.first :]  # row j: the drafts before it
        counts = counts.reshape(-1, V)
        in_prompt = torch.stack(self.in_prompt)[:, None].expand(-1, n, -1).reshape(-1, V)
        values = torch.tensor(self.values, device=dev).view(-1, 3).repeat_interleave(n, dim=0)
        rep, presence, frequency = values.split(1, -1)  # [P * rows, 1] each
        rows = torch.tensor([b * n + r for b in self.penalized for r in range(n)], device=dev)
        x = logits[rows]
        seen = counts > 0
        x = torch.where(seen | in_prompt, torch.where(x > 0, x / rep, x * rep), x)
        x = x - (frequency * counts + presence * seen)
        return logits.index_copy(0, rows, x)


def ban_mask(bad: list[list[int]], stops: list[list[int]], stop_rows: list[int], num_rows: int, vocab_size: int
             ) -> Tensor | None:
    """[B * num_rows, V] bool on the host, True where a token is banned (None if none is): bad[b] in all of sequence
    b's rows, stops[b] in its first stop_rows[b]."""
    if not any(bad) and not any(stop_rows):
        return None
    mask = torch.zeros(len(bad), num_rows, vocab_size, dtype=torch.bool)
    for b, (tokens, stop, rows) in enumerate(zip(bad, stops, stop_rows)):
        if tokens:
            mask[b, :, tokens] = True
        if rows:
            mask[b, :rows, stop] = True
    return mask.view(-1, vocab_size)


def refused_tokens(allowed: Tensor, vocab_size: int) -> Tensor:
    """[rows, V] bool, True where bitmask words [rows, W] int32 (`Adjustments.allowed`) refuse the token."""
    bits = np.unpackbits(allowed.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits == 0)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of a batch as tensors (rows are token positions to decide)."""

    temperature: Tensor  # [R] float; 0 marks a greedy row
    top_k: Tensor  # [R] long; 0 = off
    top_p: Tensor  # [R] float
    min_p: Tensor | None = None  # [R] float, 0 = off; None: no row has one
    adjustments: Adjustments | None = field(default=None)


def adjusted_logits(logits: Tensor, adjustments: Adjustments | None) -> Tensor:
    """float32 logits after penalties and bans: what a greedy row takes the argmax of."""
    return logits.float() if adjustments is None else adjustments.apply(logits)


def _processed(logits: Tensor, st: SamplingTensors) -> Tensor:
    """Adjusted logits scaled by temperature (1 for greedy rows) with min-p, then top-k / top-p cuts at -inf (vLLM's
    order)."""
    greedy = st.temperature == 0
    temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    # shifted so the largest is 0: a tiny temperature then sends the rest to -inf (the argmax), not to inf / NaN;
    # a banned token stays -inf at any temperature (an infinite one, a float32 overflow, would make it NaN)
    shifted = logits - logits.amax(-1, keepdim=True)
    scaled = torch.where(shifted == float("-inf"), shifted, shifted / temp[:, None])
    if st.min_p is not None:  # p(v) < min_p * max p: scaled(v) < log(min_p) (the largest is 0); log(0) cuts nothing
        scaled = scaled.masked_fill(scaled < st.min_p.log()[:, None], float("-inf"))
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
    return scaled


def probabilities(logits: Tensor, st: SamplingTensors) -> Tensor:
    """Softmax of the adjusted logits / temperature after top-k and top-p; greedy rows become one-hot argmax."""
    logits = adjusted_logits(logits, st.adjustments)
    probs = _processed(logits, st).softmax(-1)
    greedy = st.temperature == 0
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def processed_logprobs(logits: Tensor, st: SamplingTensors) -> Tensor:
    """Log-probabilities of the distribution a row is drawn from (vLLM's processed_logprobs); a greedy row's
    are its adjusted logits' (temperature, top-k and top-p do not change its choice)."""
    adjusted = adjusted_logits(logits, st.adjustments)
    out = _processed(adjusted, st).log_softmax(-1)
    greedy = st.temperature == 0
    return torch.where(greedy[:, None], adjusted.log_softmax(-1), out) if bool(greedy.any()) else out


@dataclass(frozen=True)
class TokenLogprob:
    """One position's logprob: the token's, its rank (1 = most likely, as vLLM) and the N most likely."""

    token_id: int
    logprob: float
    rank: int | None  # None where a backend does not report it
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first; N = the request's logprobs


def token_logprobs(logprobs: Tensor, tokens: Tensor, top_n: list[int]) -> list[TokenLogprob]:
    """TokenLogprobs of rows [M, V] of log-probabilities for the tokens [M] chosen there, with top_n[m]
    alternatives each, read back to the host in one transfer."""
    n = max(top_n)
    # one float64 tensor, one transfer: [token, logprob, rank, n logprobs, n ids] per row (ids are exact in float64)
    if cpu_kernels_serve(logprobs.device, logprobs.dtype):  # one kernel call: the torch ops cost more than the work
        rows = cpu_kernels().token_logprobs(logprobs.contiguous(), tokens.contiguous(), n)
    else:
        chosen = logprobs.gather(-1, tokens[:, None])
        rank = (logprobs > chosen).sum(-1, keepdim=True) + 1
        top = logprobs.topk(n, dim=-1)
        rows = torch.cat([t.double() for t in (tokens[:, None], chosen, rank, top.values, top.indices)], dim=-1)
    return read_token_logprobs(rows, top_n)


def read_token_logprobs(rows: Tensor, top_n: list[int]) -> list[TokenLogprob]:
    """TokenLogprobs of float64 rows [M, 3 + 2n] in the `token_logprobs` kernel's layout ([token, logprob, rank,
    n logprobs, n ids]), with top_n[m] <= n alternatives each (also what `kernels.greedy_step` returns)."""
    n = (rows.shape[1] - 3) // 2
    return [TokenLogprob(int(r[0]), r[1], int(r[2]), tuple(zip(map(int, r[3 + n : 3 + n + k]), r[3 : 3 + k])))
            for r, k in zip(rows.tolist(), top_n)]


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
    seeds: Tensor, positions: Tensor, greedy: Tensor, raced: Tensor | None = None,
    relaxed: RelaxedAcceptance | None = None, relaxed_probs: Tensor | None = None, relaxed_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Decide a prefix of each row's drafts and the token that follows it.

    drafts [B, K] (padding past num_drafts[b] is ignored), draft_probs [B, K, V] or None for one-hot
    (argmax) drafts, target_probs [B, K+1, V] after temperature/top-k/top-p (one-hot for greedy rows),
    positions [B] the absolute position of each row's first draft, greedy [B] bool, raced [B] bool the
    sampled rows that race (seeded requests; their drafts raced too), None for none. Relaxed
    acceptance needs the plain softmax of the target logits [B, K, V] and a [B, K] mask of the draft
    positions inside a thinking span. Returns (num_accepted [B], next_token [B]): row b emits
    drafts[b, :num_accepted[b]] then next_token[b].
    """
    B, K = drafts.shape
    row = torch.arange(B, device=drafts.device)
    picks = target_probs.argmax(-1)  # [B, K+1]: the greedy rows' tokens, and the raced rows' below
    picked = greedy
    if raced is not None:
        at = positions[raced][:, None] + torch.arange(K + 1, device=drafts.device)
        picks[raced] = race(target_probs[raced].flatten(0, 1), seeds[raced].repeat_interleave(K + 1),
                            at.flatten()).view(-1, K + 1)
        picked = greedy | raced
    num_accepted = torch.zeros(B, dtype=torch.long, device=drafts.device)
    if K:
        cols = torch.arange(K, device=drafts.device)
        ok = drafts == picks[:, :K]
        if relaxed is not None and relaxed_probs is not None:
            top = relaxed_probs.topk(min(relaxed.top_n, relaxed_probs.shape[-1]), dim=-1)
            p_relaxed = relaxed_probs.gather(-1, drafts[..., None]).squeeze(-1)
            in_top = (top.indices == drafts[..., None]).any(-1)
            ok |= greedy[:, None] & relaxed_mask & in_top & (p_relaxed >= top.values[..., 0] - relaxed.delta)
        if not bool(picked.all()):
            p_draft = target_probs[:, :K].gather(-1, drafts[..., None]).squeeze(-1)  # p_j(d_j)
            q_draft = (torch.ones_like(p_draft) if draft_probs is None
                       else draft_probs.gather(-1, drafts[..., None]).squeeze(-1))
            u = uniforms(seeds[:, None].expand(B, K), positions[:, None] + cols[None, :], PURPOSE_ACCEPT)
            ok = torch.where(picked[:, None], ok, u < (p_draft / q_draft.clamp_min(1e-30)).double())
        num_accepted = (ok & (cols[None, :] < num_drafts[:, None])).long().cumprod(-1).sum(-1)  # [B]
    if bool(picked.all()):
        return num_accepted, picks[row, num_accepted]
    # A row that samples by rejection takes the token after its accepted prefix from normalize(max(0, p - q)) at
    # the first rejection, or from p itself after the last draft (where q is zero).
    p_next = target_probs[row, num_accepted]  # [B, V]
    residual = p_next
    if K:
        rejected = num_accepted < num_drafts
        at = num_accepted.clamp(max=K - 1)
        if draft_probs is None:  # q is one-hot on the rejected draft
            d = drafts[row, at]
            residual = p_next.clone()
            residual[row, d] = torch.where(rejected, 0.0, p_next[row, d])
        else:
            q_next = torch.where(rejected[:, None], draft_probs[row, at], 0.0)
            residual = (p_next - q_next).clamp_min(0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)  # p == q: sample p
    next_token = torch.where(picked, picks[row, num_accepted],
                             sample(residual, uniforms(seeds, positions + num_accepted, PURPOSE_SAMPLE)))
    return num_accepted, next_token
