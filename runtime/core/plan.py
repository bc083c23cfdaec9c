"""What passes between the scheduler, the model runner and the update that applies a step.

The scheduler plans a step as `Scheduled` items; the runner computes a `StepResult` for each without
touching any sequence; `Scheduler.update_from_output` is the one place that applies results to
sequences (tokens, cache length, MTP inputs, finished state, blocks) and to the draft policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from runtime.core.sampling import TokenLogprob
from runtime.core.sequence import Sequence


@dataclass
class Scheduled:
    """One sequence's share of a step: target tokens to run and how many of them are drafts."""

    seq: Sequence
    num_new: int  # prefill chunk length, or 1 + num_drafts when decoding
    num_drafts: int = 0


@dataclass
class StepResult:
    """What a step computed for one sequence, applied by `Scheduler.update_from_output`."""

    seq: Sequence
    new_token_ids: list[int]  # emitted: accepted drafts and the token after them (none for a prefill chunk)
    num_drafts: int
    num_accepted: int
    num_trusted: int = 0  # positions whose target KV this step made valid
    hidden: Tensor | None = None  # their target hidden states, the MTP layer's next inputs (None: not kept)
    mtp_caught_up: bool = False  # drafting consumed the sequence's pending MTP inputs
    in_thinking: bool = False  # relaxed acceptance: a thinking span is open after the emitted tokens
    logprobs: list[TokenLogprob] | None = None  # one per emitted token, when the request asks for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens this prefill chunk predicted (prompt_logprobs)
    # why the sequence's grammar failed computing this step's masks: its rows were not its guide's, so it keeps none of
    # the step's tokens and ends with the error
    grammar_error: str | None = None
