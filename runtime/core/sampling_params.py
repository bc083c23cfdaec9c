"""A request's generation parameters and the checks a request passes before it runs (`validate_request`): no
torch here, so that the Triton text models, which refuse a request before tensorrt_llm sees it, can run the same
checks in their light stubs (runtime.core.sampling samples with them)."""

from __future__ import annotations

import json as _json
import math
import os
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from runtime.model.config import is_bool, is_int, is_number

MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's top_logprobs limit)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # vLLM's names
PENALTY_LIMIT = 2.0  # |presence_penalty| and |frequency_penalty| at most this (OpenAI's range)
# repetition_penalty's range: wide enough for any use (1.0-1.5 in practice), narrow enough that a logit divided or
# multiplied by it stays a float32 number (a logit divided by 1e-38 is inf, and sampling from the NaN that follows
# draws token 0)
REPETITION_PENALTY_RANGE = (0.01, 100.0)
LOGIT_BIAS_LIMIT = 100.0  # |logit_bias| values at most this (OpenAI's range, trtllm-serve's)
SEED_MODULUS = 2**63  # seeds are in [0, 2^63): they travel in int64 tensors


def fresh_seed() -> int:
    """The seed of a sampled request that gave none: random, so that two unseeded requests never share their draws."""
    return int.from_bytes(os.urandom(6), "little")


def seed_from_client(seed: int | None) -> int | None:
    """A client's seed, any integer its API's type carries (int64 in OpenAI's, uint64 in Triton's), as a request's:
    its residue modulo 2^63, so every such seed is taken and equal seeds stay equal."""
    return None if seed is None else int(seed) % SEED_MODULUS
# Stop strings are searched in every new token's text on the step loop every request shares: bounded so that one
# request cannot slow the others (vLLM and TensorRT-LLM set no bound; OpenAI takes 4)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1024


def _as_given(value: object) -> object:
    """A list field as the caller wrote it (SamplingParams holds lists as tuples)."""
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class RelaxedAcceptance:
    """TensorRT-LLM's relaxed acceptance for reasoning models (its MTPDecodingConfig's fields and defaults: the
    thinking span is DeepSeek-R1's <think> ... </think>); off unless configured."""

    top_n: int = 1
    delta: float = 0.0
    begin_thinking_token: int = 128798
    end_thinking_token: int = 128799

    def __post_init__(self) -> None:
        if not is_int(self.top_n) or self.top_n < 1:
            raise ValueError(f"relaxed acceptance top_n must be an integer >= 1, got {self.top_n!r}")
        if not is_number(self.delta) or not 0 <= self.delta <= 1:
            raise ValueError(f"relaxed acceptance delta must be in [0, 1], got {self.delta!r}")
        for name in ("begin_thinking_token", "end_thinking_token"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"relaxed acceptance {name} must be a token id (an integer >= 0), got "
                                 f"{getattr(self, name)!r}")

    def check_tokens(self, vocab_size: int) -> None:
        """ValueError unless both thinking tokens are the model's: a span that can never open relaxes nothing (the
        defaults are DeepSeek-R1's ids, outside a smaller vocabulary)."""
        for name in ("begin_thinking_token", "end_thinking_token"):
            if getattr(self, name) >= vocab_size:
                raise ValueError(f"relaxed acceptance {name} {getattr(self, name)} is not a token of this model (its "
                                 f"vocabulary has {vocab_size}); set the model's thinking-span tokens "
                                 "(begin_thinking_phase_token, end_thinking_phase_token)")

    def advance(self, thinking: bool, token: int) -> bool:
        """Whether a thinking span is open after `token`, given whether one was open before it."""
        return True if token == self.begin_thinking_token else False if token == self.end_thinking_token else thinking


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
            try:  # keeps property order: it is the output's
                object.__setattr__(self, "json", _json.dumps(value))
            except (TypeError, ValueError, RecursionError) as e:
                raise ValueError(f"guided_decoding.json: the schema cannot be written as JSON: "
                                 f"{'it is nested too deeply' if isinstance(e, RecursionError) else e}") from None

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
    min_p: float = 0.0  # vLLM's and TensorRT-LLM's: tokens less likely than min_p x the most likely one are cut
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
    # token id -> a number in [-100, 100] added to its logit before penalties, bans and temperature (vLLM's and
    # OpenAI's logit_bias; TensorRT-LLM's embedding_bias as a dict)
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False  # the stop string that ended the output is the end of its text (vLLM's)

    def __post_init__(self) -> None:
        """A single stop string is one stop string (not one per character); lists become tuples; an empty logit_bias
        is none, and a given one is copied (the request must not change with the caller's dict)."""
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids", "bad_token_ids"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("ignore_eos", "include_stop_str_in_output"):  # numpy's bools too, as numpy integers are taken
            if is_bool(getattr(self, name)):
                object.__setattr__(self, name, bool(getattr(self, name)))
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", dict(self.logit_bias) or None)

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
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < SEED_MODULUS):
            raise ValueError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {_as_given(self.stop)!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS}")
        longest = max(range(len(self.stop)), key=lambda i: len(self.stop[i]), default=None)
        if longest is not None and len(self.stop[longest]) > MAX_STOP_CHARS:
            raise ValueError(f"stop[{longest}] is {len(self.stop[longest])} characters; at most {MAX_STOP_CHARS}")
        for name in ("stop_token_ids", "bad_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not all(map(is_int, ids)):
                raise ValueError(f"{name} must be a list of integer token ids, got {_as_given(ids)!r}")
            bad = [t for t in ids if vocab_size is not None and not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} must be token ids in [0, {vocab_size}), got {bad}")
        if vocab_size is not None and len(set(self.bad_token_ids)) == vocab_size:
            raise ValueError(f"bad_token_ids bans all {vocab_size} tokens; at least one must stay allowed")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not is_int(n) or not 0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {n!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be 'raw_logprobs' or 'processed_logprobs', got {self.logprobs_mode!r}")
        r, (low, high) = self.repetition_penalty, REPETITION_PENALTY_RANGE
        if not is_number(r) or not low <= r <= high:
            raise ValueError(f"repetition_penalty must be a number in [{low:g}, {high:g}], got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_number(v) or not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be in [{-PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {v!r}")
        if self.num_draft_tokens is not None and (not is_int(self.num_draft_tokens) or self.num_draft_tokens < 0):
            raise ValueError(f"num_draft_tokens must be None or an integer >= 0, got {self.num_draft_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens ({self.max_tokens})], got {self.min_tokens!r}")
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(f"best_of must be None or an integer >= n ({self.n}), got {self.best_of!r}")
        if self.greedy and self.num_sequences > 1:  # vLLM's rule: every greedy output would be the same
            name = self.num_sequences_name
            raise ValueError(f"{name} must be 1 when using greedy sampling (temperature 0), got {getattr(self, name)}")
        self._validate_logit_bias(vocab_size)
        if self.guided_decoding is not None:
            if not isinstance(self.guided_decoding, GuidedDecodingParams):
                raise ValueError(f"guided_decoding must be a GuidedDecodingParams, got {type(self.guided_decoding).__name__}")
            self.guided_decoding.validate()
            # the grammar ends the output with eos: a request that ignores or bans it could never end there
            if self.ignore_eos or self.min_tokens:
                raise ValueError("guided_decoding cannot be combined with ignore_eos or min_tokens: the grammar "
                                 "decides where the output ends (with eos)")

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r:.80}")
        bad = [t for t in bias if not is_int(t) or (vocab_size is not None and not 0 <= t < vocab_size)]
        if bad:
            ids = "integer token ids" + (f" in [0, {vocab_size})" if vocab_size is not None else "")
            raise ValueError(f"logit_bias keys must be {ids}, got {bad[:8]!r:.120}")
        for t, v in bias.items():
            if not is_number(v) or not -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias[{t}] must be a number in [{-LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], "
                                 f"got {v!r:.40}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def races(self) -> bool:
        """Sampled with a seed: each token is an exponential race its drafts run too (runtime.core.sampling), so the
        output is plain decoding's at every draft length; without a seed, rejection sampling (more drafts accepted)."""
        return self.seed is not None and not self.greedy

    @property
    def num_sequences(self) -> int:
        """Sequences a request runs: best_of, or n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def num_sequences_name(self) -> str:
        """The parameter that set num_sequences, for refusals."""
        return "n" if self.best_of is None else "best_of"

    def stop_ids(self, eos_token_id: int | None) -> frozenset[int]:
        """The token ids that end the output (eos unless ignored, and stop_token_ids): what min_tokens bans."""
        eos = {eos_token_id} if eos_token_id is not None and not self.ignore_eos else set()
        return frozenset(self.stop_token_ids) | eos

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def plain_argmax(self) -> bool:
        """Greedy with nothing banned, penalized or guided: a token is the logits' plain argmax, drafts included
        (min_tokens aside: `Sequence.plain_argmax` knows whether it still bans)."""
        return (self.greedy and not self.bad_token_ids and not self.penalized and self.guided_decoding is None
                and not self.logit_bias)


def check_request_form(prompt_token_ids: list[int], params: SamplingParams) -> None:
    """A request's form: a SamplingParams (whose rules `validate` checks) and a list of integer ids."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if not isinstance(prompt_token_ids, (list, tuple)) or not all(map(is_int, prompt_token_ids)):
        raise ValueError(f"prompt must be a list of integer token ids, got {prompt_token_ids!r:.80}")


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_seq_len: int,
                     max_batch_size: int, eos_token_id: int | None,
                     kv_cache: tuple[int, int] | None = None, draft_len: int | None = None) -> None:
    """Raise ValueError naming the parameter and what was expected. `eos_token_id` is the executor's eos (None: the
    tokenizer has none): a guided request must be able to end with it. With `kv_cache`, its (tokens per block,
    blocks): the request must fit it alone. With `draft_len`, the executor's draft length: a request's
    num_draft_tokens may not ask for more."""
    check_request_form(prompt_token_ids, params)
    params.validate(vocab_size)
    if params.guided_decoding is not None and eos_token_id is not None and eos_token_id in params.bad_token_ids:
        raise ValueError("guided_decoding ends the output with eos; bad_token_ids must not ban it")
    if params.min_tokens and len(params.stop_ids(eos_token_id) | set(params.bad_token_ids)) == vocab_size:
        raise ValueError(f"min_tokens {params.min_tokens} bans eos and stop_token_ids until it is reached; with "
                         f"bad_token_ids that bans all {vocab_size} tokens: at least one must stay allowed")
    if params.num_sequences > max_batch_size:
        raise ValueError(f"{params.num_sequences_name} {params.num_sequences} exceeds this executor's max_batch_size "
                         f"{max_batch_size}: the request's sequences run in one batch")
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt must not be empty")
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if n >= max_seq_len:
        raise ValueError(f"prompt has {n} tokens; max_seq_len is {max_seq_len}")
    if n + params.max_tokens > max_seq_len:
        raise ValueError(f"max_tokens {params.max_tokens} with a {n}-token prompt exceeds max_seq_len "
                         f"{max_seq_len}; at most {max_seq_len - n}")
    if kv_cache is not None:
        # The last token is emitted, never cached, and drafts stop short of it: prompt + max_tokens - 1 positions.
        block_size, blocks = kv_cache
        need = -(-(n + params.max_tokens - 1) // block_size)
        if need > blocks:
            raise ValueError(f"max_tokens {params.max_tokens} with a {n}-token prompt needs {need} KV blocks; the cache "
                             f"has {blocks} of {block_size} tokens")  # its setting has a name of its own on each surface
    if draft_len is not None and params.num_draft_tokens is not None and params.num_draft_tokens > draft_len:
        raise ValueError(f"num_draft_tokens {params.num_draft_tokens} exceeds this executor's draft length {draft_len}")
