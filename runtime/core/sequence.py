"""The state of one request as the scheduler and the model runner see it.

Invariant while running: the target KV cache holds every position but the last token's
(num_cached == num_tokens - 1 once prefill is done), so each decode step feeds the last token plus
its drafts. The MTP cache lags: positions < num_mtp are done, and the target hidden states of
positions num_mtp .. num_cached - 1 wait in `pending_hidden` until the next drafting step, as the
chunks each step appended (joined once, when drafting uses them: a sequence that does not draft for
a while would otherwise copy its growing backlog every step).

Prefix caching may start a sequence at num_cached > 0 (num_mtp with it where it drafts), on blocks it
shares with others (runtime.core.prefix_cache); nothing ever writes below those positions.

The sequences of one request with several outputs (n / best_of) share its prompt's full blocks: the first
(their `leader`) prefills the prompt, the others are admitted once those blocks are cached, with their MTP
rows where they draft, and compute only the partial last block (PrefixCache.match says when one more).

A guided request keeps its grammar matcher (`GrammarMatcher`), advanced by the step's one writer; a penalized
request keeps its token counts as tensors (`PenaltyState`), updated by the step's one writer
with the tokens it keeps, so a step reads them in O(vocabulary) rather than recounting its history.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from runtime.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtime.core.grammar import GrammarMatcher


@dataclass(eq=False)
class PenaltyState:
    """What penalties read of a sequence: output token counts and the prompt's tokens, both [V]."""

    counts: Tensor  # float32
    in_prompt: Tensor  # bool

    @classmethod
    def create(cls, prompt: list[int], vocab_size: int, device: torch.device | str) -> "PenaltyState":
        in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        in_prompt[torch.tensor(prompt, device=device)] = True
        return cls(torch.zeros(vocab_size, device=device), in_prompt)

    def add(self, tokens: list[int]) -> None:
        if tokens:
            ids = torch.tensor(tokens, device=self.counts.device)
            self.counts.index_put_((ids,), torch.ones(len(tokens), device=self.counts.device), accumulate=True)


@dataclass(frozen=True)
class LogitBias:
    """A request's logit_bias as the adjustments read it at every step: its token ids and the biases, built once."""

    tokens: Tensor  # int64 [n]
    values: Tensor  # float32 [n]

    @classmethod
    def create(cls, bias: dict[int, float], device: torch.device | str) -> "LogitBias":
        return cls(torch.tensor(list(map(int, bias)), dtype=torch.long, device=device),
                   torch.tensor(list(map(float, bias.values())), dtype=torch.float32, device=device))


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by everything generated
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    num_mtp: int = 0
    pending_hidden: list[Tensor] = field(default_factory=list)
    mtp_idle_steps: int = 0  # decode steps in a row for which adaptive speculation chose k = 0
    mtp_dropped: bool = False  # it never drafts (again): no MTP inputs kept (k 0, one token, or given up adaptively)
    in_thinking: bool = False
    admitted_at: int = -1  # admission order of its last admission (preemption takes the latest)
    stop_ids: frozenset[int] = frozenset()  # eos and stop token ids: banned while min_tokens is not reached
    penalty: PenaltyState | None = None  # set for requests with penalties
    logit_bias: LogitBias | None = None  # set for requests with a logit_bias
    grammar: GrammarMatcher | None = None  # set for guided requests: the grammar state after the output
    num_prompt_logprobs: int = 0  # prompt positions whose next-token logprobs were computed (prompt_logprobs)
    # prefix caching (runtime.core.prefix_cache): keys of its full blocks, how many of its blocks are registered
    # and MTP-marked, and how many prompt blocks its first admission reused (None: not admitted yet)
    block_keys: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_mtp_blocks: int = 0
    num_reused_blocks: int | None = None
    # n / best_of: the first sequence of the request, for the others (they wait for its prompt blocks, Scheduler)
    leader: Sequence | None = None

    def __post_init__(self) -> None:
        if (self.logit_bias is None) != (self.params.logit_bias is None):  # plain_argmax reads the params'
            raise ValueError("a sequence's logit_bias is its params' (LogitBias.create of params.logit_bias)")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_to_prefill(self) -> int:
        """Tokens still to run before the first decode (every token but the last is cached then)."""
        return self.num_tokens - 1 - self.num_cached

    @property
    def in_prefill(self) -> bool:
        return self.num_to_prefill > 0

    @property
    def bans_stop_ids(self) -> bool:
        """min_tokens still bans its stop tokens at the next position."""
        return self.num_output_tokens < self.params.min_tokens and bool(self.stop_ids)

    @property
    def plain_argmax(self) -> bool:
        """Its next tokens, drafts included, are the logits' plain argmax (nothing banned or penalized)."""
        return self.params.plain_argmax and not self.bans_stop_ids

    @property
    def can_draft(self) -> bool:
        """Drafting needs the MTP output at position num_tokens - 2, i.e. pending hidden states."""
        return not self.in_prefill and bool(self.pending_hidden)

    def drop_mtp(self) -> None:
        """Never draft again: keeping MTP inputs costs every step, and catching the MTP cache up over
        a long backlog costs more than the drafts it would bring."""
        self.mtp_dropped, self.pending_hidden = True, []

    def reset_for_recompute(self) -> None:
        """After preemption: its blocks are gone (what they registered stays cached until evicted), the tokens
        stay; its next admission reuses what is still cached and prefill recomputes the rest."""
        self.block_table = []
        self.num_cached = self.num_mtp = self.mtp_idle_steps = self.num_registered_blocks = self.num_mtp_blocks = 0
        self.pending_hidden = []
        self.status = Status.WAITING
