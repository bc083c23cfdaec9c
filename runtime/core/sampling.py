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

import json as _json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from runtime.model.config import is_int, is_number
from runtime.model.kernels import cpu_kernels
from runtime.model.kernels.modules import runs_here


MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's top_logprobs limit)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # vLLM's names
PENALTY_LIMIT = 2.0  # |presence_penalty| and |frequency_penalty| at most this (OpenAI's range)


def _as_given(value: object) -> object:
    """A list field as the caller wrote it (SamplingParams holds lists as tuples)."""
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Structured output (TensorRT-LLM's names): exactly one of a JSON schema (`json`: a string, a dict or a
    pydantic model class), a regular expression, an EBNF grammar (GBNF `root ::= ...`, or Lark), or
    `json_object=True` for any JSON object. A dict or model becomes its JSON text here, so a guide is a
    (kind, text) pair: the key its compiled grammar is cached under (runtime.core.grammar)."""

    json: Any = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        value = self.json
        if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a pydantic model class
            value = value.model_json_schema()
        if isinstance(value, dict):
            object.__setattr__(self, "json", _json.dumps(value))  # keeps property order: it is the output's

    def validate(self) -> None:
        """ValueError unless exactly one guide is given, of its type."""
        if not isinstance(self.json_object, bool):
            raise ValueError(f"guided_decoding.json_object must be true or false, got {self.json_object!r}")
        given = [name for name in ("json", "regex", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"guided_decoding takes exactly one of json, regex, grammar, json_object; got "
                             f"{', '.join(given) or 'none'}")
        value = getattr(self, given[0])
        if given[0] != "json_object" and (not isinstance(value, str) or not value):
            kinds = "a non-empty string" + (", a dict or a pydantic model" if given[0] == "json" else "")
            raise ValueError(f"guided_decoding.{given[0]} must be {kinds}, got {value!r:.80}")

    @property
    def kind(self) -> str:
        """"json" | "regex" | "grammar" | "json_object" (of a validated guide)."""
        return "json_object" if self.json_object else next(n for n in ("json", "regex", "grammar") if getattr(self, n))

    @property
    def text(self) -> str:
        return "" if self.json_object else getattr(self, self.kind)


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
    # per emitted token: its logprob under the target and the N most likely alternatives (0..20; None: off)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # "raw_logprobs": log-softmax of the model's logits (vLLM's default); "processed_logprobs": of the
    # distribution tokens are drawn from (penalties, bans, temperature, top-k, top-p; greedy: penalties and bans)
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    repetition_penalty: float = 1.0  # HF / TensorRT-LLM: > 1 discourages tokens of the prompt and output
    presence_penalty: float = 0.0  # OpenAI: subtracted once from the logit of a token in the output
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    min_tokens: int = 0  # eos and stop tokens are banned (and stop strings ignored) before this many
    num_draft_tokens: int | None = None  # at most this many drafts per step (0: plain decoding); None: the executor's
    guided_decoding: GuidedDecodingParams | None = None  # structured output: every token masked by the grammar
    # several outputs per prompt (vLLM / TensorRT-LLM): best_of sequences are sampled (None: n), output i with seed
    # + i, and the n with the highest cumulative logprob returned (all of them, in order, when best_of is n)
    n: int = 1
    best_of: int | None = None

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
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not is_int(n) or not 0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {n!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be 'raw_logprobs' or 'processed_logprobs', got {self.logprobs_mode!r}")
        r = self.repetition_penalty
        if not is_number(r) or not 0 < r < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_number(v) or not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if self.num_draft_tokens is not None and (not is_int(self.num_draft_tokens) or self.num_draft_tokens < 0):
            raise ValueError(f"num_draft_tokens must be None or an integer >= 0, got {self.num_draft_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens ({self.max_tokens})], got {self.min_tokens!r}")
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(f"best_of must be None or an integer >= n ({self.n}), got {self.best_of!r}")
        if self.greedy and self.num_sequences > 1:  # vLLM's rule: every greedy output would be the same
            name = "n" if self.best_of is None else "best_of"
            raise ValueError(f"{name} must be 1 when using greedy sampling (temperature 0), got {getattr(self, name)}")
        if self.guided_decoding is not None:
            if not isinstance(self.guided_decoding, GuidedDecodingParams):
                raise ValueError(f"guided_decoding must be a GuidedDecodingParams, got {type(self.guided_decoding).__name__}")
            self.guided_decoding.validate()
            # the grammar ends the output with eos: a request that ignores or bans it could never end there
            if self.ignore_eos or self.min_tokens:
                raise ValueError("guided_decoding cannot be combined with ignore_eos or min_tokens: the grammar "
                                 "decides where the output ends (with eos)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_sequences(self) -> int:
        """Sequences a request runs: best_of, or n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def plain_argmax(self) -> bool:
        """Greedy with nothing banned, penalized or guided: a token is the logits' plain argmax, drafts included
        (min_tokens aside: `Sequence.plain_argmax` knows whether it still bans)."""
        return self.greedy and not self.bad_token_ids and not self.penalized and self.guided_decoding is None


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
class Adjustments:
    """Penalties and token bans of a batch's rows, per sequence: rows b * num_rows + r are sequence b's output tokens
    num_output + first + r, each decided after the drafts before it (drafts[b, :first + r]), whose occurrences its
    frequency / presence / repetition penalties count on top of the output's. Applied in one kernel call where the
    CPU kernels run (a few small torch ops per step cost more than the work), else with torch ops."""

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
    # a guided batch's grammar bitmasks [B * num_rows, >= ceil(V / 32)] int32 on the host: bit t % 32 of word t // 32
    # set where the row's grammar allows token t (all set for a row without one); bad and stop bans that would leave
    # nothing it allows yield to it in that row
    allowed: Tensor | None = None

    def apply(self, logits: Tensor) -> Tensor:
        """float32 logits [B * num_rows, V] adjusted (a new tensor): HF's repetition penalty over prompt and output (a
        positive logit divided, a negative one multiplied), OpenAI's frequency and presence penalties over the output,
        then the bans (-inf)."""
        logits = logits.float()
        if runs_here(logits.device, logits.dtype):
            drafts = torch.empty(0, 0, dtype=torch.long) if self.drafts is None else self.drafts.contiguous()
            allowed = torch.empty(0, 0, dtype=torch.int32) if self.allowed is None else self.allowed.contiguous()
            return cpu_kernels().adjust_logits(logits.contiguous(), self.num_rows, self.first, drafts, self.penalized,
                                               self.counts, self.in_prompt, self.values, self.bad, self.stops,
                                               self.stop_rows, allowed)
        return self.apply_with_torch(logits)

    def apply_with_torch(self, logits: Tensor) -> Tensor:
        """`apply` with torch ops (where the CPU kernels do not run)."""
        logits = logits.float()
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
    adjustments: Adjustments | None = field(default=None)


def adjusted_logits(logits: Tensor, adjustments: Adjustments | None) -> Tensor:
    """float32 logits after penalties and bans: what a greedy row takes the argmax of."""
    return logits.float() if adjustments is None else adjustments.apply(logits)


def _processed(logits: Tensor, st: SamplingTensors) -> Tensor:
    """Adjusted logits scaled by temperature (1 for greedy rows) with top-k / top-p cuts at -inf."""
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
    if runs_here(logprobs.device, logprobs.dtype):  # in one kernel call: the torch ops' overhead is most of the cost
        rows = cpu_kernels().token_logprobs(logprobs.contiguous(), tokens.contiguous(), n).tolist()
    else:
        chosen = logprobs.gather(-1, tokens[:, None])
        rank = (logprobs > chosen).sum(-1, keepdim=True) + 1
        top = logprobs.topk(n, dim=-1)
        rows = torch.cat([t.double() for t in (tokens[:, None], chosen, rank, top.values, top.indices)], dim=-1).tolist()
    return [TokenLogprob(int(r[0]), r[1], int(r[2]), tuple(zip(map(int, r[3 + n : 3 + n + k]), r[3 : 3 + k])))
            for r, k in zip(rows, top_n)]


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
