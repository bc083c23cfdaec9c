"""Structured output: guides compiled to grammars, one matcher per sequence, token masks per decided row.

The engine is llguidance (guidance-ai): a Rust wheel with no Python dependencies (xgrammar 0.2 pulls in
triton and transformers), masks computed lazily per step without a per-grammar
token-table precompilation, exact rollback of consumed tokens (what speculation needs), and grammar
errors reported as text with a position rather than raised from C++. TensorRT-LLM offers it as its
`guided_decoding_backend="llguidance"`.

A guide is compiled once per distinct guide (an LRU of pristine matchers, keyed by kind and text); each
sequence gets a deep copy. The matcher holds the grammar state after the sequence's kept output tokens:
`GrammarMatcher.advance` is called by the step's one writer (`Scheduler.update_from_output`). The model
runner asks for the bitmasks of rows that follow drafts (`grammar_bitmasks`): each matcher consumes the drafts,
writes one bitmask per row and rolls them back, leaving the state as it found it, and a grammar that fails doing so
says why (the runner reports it, the step's one writer records it); the bitmasks reach the logits as llguidance
writes them (`Adjustments.allowed`). Once the grammar is complete the mask allows EOS only, so the
request ends the way any request ends (a stop token), at the same token for every draft length: greedy output
under a grammar does not depend on k.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Container

import llguidance
import numpy as np
import torch
from torch import Tensor

from runtime.core.guide_check import check_guide, on_compile_stack
from runtime.core.sampling_params import GuidedDecodingParams

CACHE_SIZE = 64  # compiled guides kept per executor
# and at most this much guide text between them: a compiled guide takes memory in its size (tens of MB for a guide
# of a MB), so a count alone would let 64 large ones add over a GB to an engine process
CACHE_GUIDE_BYTES = 4 * 2**20


def first_line(error: str) -> str:
    """llguidance's error without the parser state it appends; its lexer's budget said as what it means to a client
    (the message names llguidance's own limits, which no request can change)."""
    line = error.split("\n", 1)[0][:200]
    if line.startswith("lexer precomputation failed"):
        return "the guide is too large for the grammar engine's lexer (its precomputation ran out of budget)"
    return line


class GrammarMatcher:
    """One sequence's grammar state after its kept output tokens, and the masks of the rows it decides next. The masks
    computed since the last advance are kept by the drafts before their row: a verification's rows 0..k-1 are the
    step's draft rows (the same state, the same drafts), so only its last row is computed again."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, mask_words: int):
        self.matcher, self.vocab_size, self.mask_words = matcher, vocab_size, mask_words
        self._masks: dict[tuple[int, ...], np.ndarray] = {}  # drafts before a row -> its bitmask, in this state
        # Why the grammar stopped working, if it did: llguidance builds its lexer lazily, so a guide that compiled
        # can still exceed its limits while generating (a regex of huge repeats). Set by the step's one writer (a
        # kept token it refuses, or the runner's report that a mask failed); the executor ends this sequence with
        # the error, the others go on.
        self.error: str | None = None

    def advance(self, tokens: list[int]) -> None:
        """Consume kept output tokens (drawn under its masks, so only a failing grammar refuses them)."""
        if tokens and self.error is None:
            self._masks.clear()
            if not self.matcher.consume_tokens(tokens):
                self.error = f"the grammar failed while generating: {first_line(self.matcher.get_error())}"

    def num_keepable(self, tokens: list[int]) -> int:
        """How many of a step's emitted tokens the request may keep: those the grammar takes, and the one it refuses
        first, if any. Token j was drawn under row j's mask, computed after tokens[:j]; llguidance can still refuse a
        token its mask allowed (a lexer past its limits), and the rows after it were never masked. Plain decoding
        would emit that token and fail consuming it, so the request keeps it, fails, and never keeps a token of an
        unmasked row."""
        if self.error is not None or len(tokens) < 2:
            return len(tokens)
        probe = self.matcher.deep_copy()  # a lexer error leaves a matcher in its error state, past rolling back
        for j, token in enumerate(tokens):
            if probe.try_consume_tokens([token]) != 1 or probe.is_error():
                return j + 1
        return len(tokens)

    def fill_masks(self, words: np.ndarray, drafts: list[int], first: int) -> str | None:
        """Write the bitmasks of rows first .. first + len(words) - 1 into words [rows, W] (int32, all bits set on
        entry): row r is decided after drafts[:first + r], explored on a copy of the matcher (a lexer error leaves a
        matcher in its error state, past rolling back). Rows after a draft the grammar refuses, or after the eos that
        completes it, keep every bit: that draft is rejected (its own row bans it), ends the request, or is the last
        token the request keeps (`num_keepable`), so no later row's token is ever kept. Returns the error where the
        grammar fails computing a mask (the rows are then not its guide's: none of their tokens may be kept)."""
        if self.error is not None:
            return None
        probe, consumed = None, 0  # the probe is in the state after drafts[:consumed]
        for r in range(len(words)):
            before = tuple(drafts[: first + r])
            if len(before) < first + r:  # no drafts given for the row: it is never used
                break
            known = self._masks.get(before)
            if known is not None:
                words[r] = known
                continue
            if probe is None:
                probe = self.matcher.deep_copy()
            want = len(before) - consumed
            if want and (probe.try_consume_tokens(list(before[consumed:])) != want or probe.is_error()):
                break
            consumed = len(before)
            probe.unsafe_compute_mask_ptr(words[r].ctypes.data, words[r].nbytes)
            if probe.is_error():
                return f"the grammar failed while generating: {first_line(probe.get_error())}"
            self._masks[before] = words[r].copy()
        return None


def grammar_bitmasks(matchers: list[GrammarMatcher | None], drafts: list[list[int]] | None, first: int, num_rows: int,
                     failed: Container[int] = ()) -> tuple[Tensor, dict[int, str]]:
    """[B * num_rows, W] int32 bitmask words (`Adjustments.allowed`) of what each sequence's grammar allows at those
    rows (every bit set for a sequence without one, or whose grammar failed earlier in the step: its index in
    `failed`), and the errors of the grammars that failed computing them, by index."""
    some = next(m for m in matchers if m is not None)
    words = np.full((len(matchers), num_rows, some.mask_words), -1, dtype=np.int32)
    errors = {}
    for b, m in enumerate(matchers):
        if m is not None and b not in failed:
            error = m.fill_masks(words[b], drafts[b] if drafts else [], first)
            if error is not None:
                errors[b] = error
    return torch.from_numpy(words.reshape(-1, some.mask_words)), errors


class GrammarCompiler:
    """Compiles guides for one tokenizer (an LRU of compiled guides) and hands each sequence its own matcher."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int):
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)
        self.vocab_size = vocab_size
        self.mask_words = -(-self.tokenizer.vocab_size // 32)  # the size unsafe_compute_mask_ptr takes
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # submit runs on callers' threads

    def _compiled(self, guide: GuidedDecodingParams) -> llguidance.LLMatcher:
        """The pristine matcher of a guide (callers hold the lock)."""
        key = (guide.kind, guide.text)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        matcher = on_compile_stack(lambda: self._compile(guide))
        self._cache[key] = matcher
        while len(self._cache) > 1 and (len(self._cache) > CACHE_SIZE or
                                        sum(len(text) for _, text in self._cache) > CACHE_GUIDE_BYTES):
            self._cache.popitem(last=False)
        return matcher

    def _compile(self, guide: GuidedDecodingParams) -> llguidance.LLMatcher:
        """A guide's matcher, checked to begin some output (on a compile stack: llguidance recurses)."""
        matcher = llguidance.LLMatcher(self.tokenizer, check_guide(guide), log_level=0)
        if matcher.is_error():  # valid grammar the tokenizer cannot serve
            raise ValueError(f"guided_decoding.{guide.kind} cannot be served: {first_line(matcher.get_error())}")
        probe, words = matcher.deep_copy(), np.empty(self.mask_words, np.int32)
        probe.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if probe.is_error():  # an empty language (root ::= root, a self-referencing schema), or past the lexer's limits
            error = first_line(probe.get_error())
            raise ValueError(f"guided_decoding.{guide.kind} allows no output: no token can begin it ({error})"
                             if error == "NoExtensionBias" else
                             f"guided_decoding.{guide.kind} cannot be served: {error}")
        return matcher

    def check(self, guide: GuidedDecodingParams) -> None:
        """ValueError naming the field and the position of the problem; compiles (and caches) a valid guide."""
        with self._lock:
            self._compiled(guide)

    def matcher(self, guide: GuidedDecodingParams) -> GrammarMatcher:
        with self._lock:
            return GrammarMatcher(self._compiled(guide).deep_copy(), self.vocab_size, self.mask_words)
