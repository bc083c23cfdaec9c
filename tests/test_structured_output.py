"""Structured output (JSON schema, any JSON object, regex, EBNF grammar), exact under MTP, on the shipped model.

- Greedy output under a guide is token for token the k = 0 output for k = 1..4, alone and in a batch with
  unconstrained requests (whose output the guided neighbours do not change), and every output parses:
  json.loads and the schema's constraints, re.fullmatch for the regex and for the grammar's language.
- Sampled outputs are all valid, and the first token follows the grammar-masked target distribution exactly
  under k = 2 (chi-square against a dense forward): the lossless sampler applied to masked distributions.
- The matcher's masks leave its state as they found it, and rows after a refused draft are unconstrained.
- Invalid guides are refused before anything is submitted, naming the field and the position of the problem.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import replace

import pytest
import torch

from runtime.core.grammar import GrammarCompiler, GrammarMatcher, grammar_bitmasks
from runtime.core.guide_check import MAX_SCHEMA_DEPTH, check_guide
from runtime.core.sampling import refused_tokens
from runtime.core.sampling_params import GuidedDecodingParams, SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.executors.outputs import RequestOutput
from runtime.executors.session import Session

from conftest import chi2_pvalue
from executor_util import assert_a_refusal_frees_its_callers, assert_all_free, run_fresh as run

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def masks(m: GrammarMatcher, drafts: list[int], first: int, num_rows: int) -> torch.Tensor:
    """[num_rows, V] bool, True where m's grammar bans a token (`fill_masks`'s rows, of one sequence)."""
    return refused_tokens(grammar_bitmasks([m], [drafts], first, num_rows)[0], m.vocab_size)


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}}
REGEX = r"[A-Z][a-z]{1,8} (and|or) [a-z]{2,10}\."
EBNF = "root ::= term (op term){0,3}\nop ::= \"+\" | \"-\"\nterm ::= [0-9] | [1-9] [0-9]"
EBNF_LANGUAGE = r"(?:[0-9]|[1-9][0-9])(?:[+-](?:[0-9]|[1-9][0-9])){0,3}"
GUIDES = {"json": GuidedDecodingParams(json=SCHEMA), "json_object": GuidedDecodingParams(json_object=True),
          "regex": GuidedDecodingParams(regex=REGEX), "grammar": GuidedDecodingParams(grammar=EBNF)}
MAX_TOKENS = 96


def conforms(kind: str, text: str) -> bool:
    """Whether an output is in its guide's language (the schema's constraints checked one by one)."""
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "grammar":
        return re.fullmatch(EBNF_LANGUAGE, text) is not None
    value = json.loads(text)
    if kind == "json_object":
        return isinstance(value, dict)
    return (isinstance(value, dict) and set(value) == {"name", "age", "tags"}
            and isinstance(value["name"], str) and len(value["name"]) <= 12
            and type(value["age"]) is int and 0 <= value["age"] <= 120
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(isinstance(t, str) and len(t) <= 8 for t in value["tags"]))


@pytest.fixture(scope="module")
def prompts(shipped_model_dir, shipped_tokenizer) -> list[list[int]]:
    rows = json.loads((shipped_model_dir / "heldout_prompts.json").read_text())
    return [shipped_tokenizer.encode(r["text"])[:32] for r in rows[:6]]



def test_greedy_output_is_the_same_for_every_k_and_parses(shipped_engine, shipped_tokenizer, prompts) -> None:
    """Four guided requests and two unconstrained ones in one batch, k = 0..4 and adaptive; and each guided one
    alone at k = 0 and k = 3: the same tokens everywhere, every guided output complete ("stop") and in its guide's
    language."""
    kinds = list(GUIDES)
    params = [SamplingParams(max_tokens=MAX_TOKENS, guided_decoding=GUIDES[kind]) for kind in kinds]
    # bans and the grammar together: the regex's " and" spelt otherwise, or " or"
    params[kinds.index("regex")] = replace(params[kinds.index("regex")], bad_token_ids=tuple(shipped_tokenizer.encode(
        " and", add_bos=False)))
    free = [SamplingParams(max_tokens=24)] * 2
    free_alone = [o.token_ids for o in run(shipped_engine, prompts[4:], free, 0)]
    reference = [o.token_ids for o in run(shipped_engine, prompts[:4], params, 0, alone=True)]
    assert [o.token_ids for o in run(shipped_engine, prompts[:4], params, 3, alone=True)] == reference
    drafted = 0
    for k in range(5):
        outs = run(shipped_engine, prompts[:6], params + free, k)
        assert [o.token_ids for o in outs[:4]] == reference, k
        assert [o.token_ids for o in outs[4:]] == free_alone, k  # guided neighbours change nothing of theirs
        for kind, o in zip(kinds, outs):
            assert o.finish_reason == "stop" and conforms(kind, o.text), (k, kind, o.text)
        drafted += sum(o.stats.num_accepted_draft_tokens for o in outs[:4])
    assert drafted > 0  # drafts under the grammar were accepted, not merely rejected
    adaptive = run(shipped_engine, prompts[:6], params + free, 3, speculation="adaptive")  # k chosen per step
    assert [o.token_ids for o in adaptive] == reference + free_alone


def test_chunked_prefill_preemption_and_cancellation_keep_guided_output_exact(shipped_engine, prompts) -> None:
    """Under a 32-token budget (prompts prefilled in chunks) and a cache of 9 blocks, two long unconstrained
    requests admitted first make the guided ones admitted after them be preempted and recomputed (their grammar
    state kept with their tokens): every output is its k = 0 output alone. A guided request cancelled mid-way
    gives its blocks back like any other."""
    params = [SamplingParams(max_tokens=64, ignore_eos=True)] * 2
    params += [SamplingParams(max_tokens=MAX_TOKENS, guided_decoding=g) for g in GUIDES.values()]
    ordered = prompts[4:] + prompts[:4]
    reference = [o.token_ids for o in run(shipped_engine, ordered, params, 0, alone=True)]
    config = ExecutorConfig(num_draft_tokens=3, speculation="fixed", max_num_tokens=32, max_batch_size=7,
                            kv_cache_tokens=128, max_seq_len=256)
    with Executor(shipped_engine, config) as ex:
        preempt, victims = ex.scheduler._preempt_latest, []

        def recorded():
            victims.append(preempt())
            return victims[-1]

        def cancel_early(o: RequestOutput) -> None:
            if len(o.token_ids) >= 3 and not o.finished:
                ex.cancel(o.request_id)

        ex.scheduler._preempt_latest = recorded
        handles = [ex.submit(p, sp) for p, sp in zip(ordered, params)]
        outs = [h.result(120) for h in handles]
        cancelled = ex.submit(prompts[0], params[2], on_output=cancel_early).result(120)
        assert_all_free(ex)
    assert any(v.grammar is not None for v in victims), "no guided request was preempted"
    assert [o.token_ids for o in outs] == reference
    assert cancelled.finish_reason == "cancelled" and reference[2][: len(cancelled.token_ids)] == cancelled.token_ids


class FailingLexer:
    """llguidance's matcher, failing as its lexer does past its limits (a regex like a{1,100000}b{50000} compiles,
    then may fail at its first tokens, depending on which lexer states earlier requests built): consuming a token
    fails with its error. Everything else is the real matcher's."""

    def __init__(self, matcher):
        self._matcher = matcher

    def consume_tokens(self, tokens):
        return False

    def get_error(self):
        return "lexer error: too many expressions constructed"

    def deep_copy(self):
        return type(self)(self._matcher.deep_copy())

    def __getattr__(self, name):
        return getattr(self._matcher, name)


def matchers_fail_as(monkeypatch: pytest.MonkeyPatch, failing: type) -> None:
    """Every grammar compiled from now on has its llguidance matcher wrapped in `failing`."""
    real = GrammarCompiler.matcher

    def wrapped(self, guide):
        m = real(self, guide)
        m.matcher = failing(m.matcher)
        return m

    monkeypatch.setattr(GrammarCompiler, "matcher", wrapped)


@pytest.mark.parametrize("k", [0, 3])
def test_a_grammar_that_fails_while_generating_ends_its_request_only(shipped_engine, prompts, k, monkeypatch) -> None:
    """A guide that fails while generating ends its own request with an error naming the guide; the request beside
    it, the executor and the blocks are fine (the failure stopped the executor's step loop: every request failed,
    every later one was refused)."""
    matchers_fail_as(monkeypatch, FailingLexer)
    bad = SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(regex="[a-z]+"))
    free = SamplingParams(max_tokens=24, ignore_eos=True)
    reference = run(shipped_engine, [prompts[1]], free, k, alone=True)[0].token_ids
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=k, speculation="fixed")) as ex:
        failed, beside = ex.submit(prompts[0], bad), ex.submit(prompts[1], free)
        failed, beside = failed.result(120), beside.result(120)
        after = ex.submit(prompts[1], free).result(120)
        assert_all_free(ex)
    assert (failed.finish_reason, failed.error) == (
        "error", "guided_decoding.regex: the grammar failed while generating: lexer error: too many expressions "
                 "constructed")
    assert failed.token_ids and failed.text  # drawn under its masks, they failed to advance it: kept, and streamed
    assert beside.finish_reason == after.finish_reason == "length"
    assert beside.token_ids == after.token_ids == reference


class FailingMasks(FailingLexer):
    """A matcher whose lexer gives out while the masks of a step are computed: they are not the grammar's."""

    def consume_tokens(self, tokens):
        return self._matcher.consume_tokens(tokens)

    def is_error(self):
        return True


@pytest.mark.parametrize("k", [0, 3])
def test_a_grammar_that_fails_computing_masks_keeps_none_of_that_steps_tokens(shipped_engine, prompts, k,
                                                                            monkeypatch) -> None:
    """The step's rows were masked by a failed grammar, so none of its tokens is the guide's: the request ends with
    the output before that step (here none, at every k), and what was streamed adds up to it (the final output
    carried the failing step's unguided tokens, which differed with k and were never streamed)."""
    matchers_fail_as(monkeypatch, FailingMasks)
    bad = SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(regex="[a-z]+"))
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=k, speculation="fixed")) as ex:
        handle = ex.submit(prompts[0], bad)
        streamed = list(handle)
        final = handle.result(120)
        assert_all_free(ex)
    assert (final.finish_reason, final.error) == (
        "error", "guided_decoding.regex: the grammar failed while generating: lexer error: too many expressions "
                 "constructed")
    assert final.token_ids == [] and final.text == ""
    assert [t for o in streamed for t in o.new_token_ids] == [] and "".join(o.text_delta for o in streamed) == ""


def test_a_mask_that_fails_is_reported_by_the_runner_and_recorded_by_the_update(shipped_engine, prompts,
                                                                               monkeypatch) -> None:
    """The runner writes no sequence state: a grammar that fails computing a step's masks comes back in the step's
    results (`StepResult.grammar_error`), its matcher untouched, and the step's one writer records it (the runner set
    it on the matcher mid-step)."""
    from runtime.core.model_runner import ModelRunner

    matchers_fail_as(monkeypatch, FailingMasks)
    seen = []
    step = ModelRunner.step

    def watched(self, items):
        results = step(self, items)
        seen.extend((r.grammar_error, r.seq.grammar.error) for r in results)
        return results

    monkeypatch.setattr(ModelRunner, "step", watched)
    bad = SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(regex="[a-z]+"))
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=3, speculation="fixed")) as ex:
        final = ex.submit(prompts[0], bad).result(120)
    error = "the grammar failed while generating: lexer error: too many expressions constructed"
    assert final.error == f"guided_decoding.regex: {error}"
    assert seen[-1] == (error, None) and all(recorded is None for _, recorded in seen)


class RefusesPastTwoTokens(FailingLexer):
    """A matcher whose lexer gives out at the third token although its masks allow one (llguidance's lazy lexer
    past its limits does so), as llguidance's binding reports it: the tokens before are consumed, the matcher is in
    its error state, and try_consume_tokens says 0 (`unwrap_or(0)`)."""

    LIMIT = 2

    def __init__(self, matcher, taken=0, failed=False):
        super().__init__(matcher)
        self.taken, self.failed = taken, failed

    def _consume(self, tokens):
        room = max(self.LIMIT - self.taken, 0)
        ok = self._matcher.consume_tokens(tokens[:room]) if room and tokens else True
        self.taken += min(room, len(tokens))
        self.failed = self.failed or not ok or len(tokens) > room
        return not self.failed

    def try_consume_tokens(self, tokens):
        return len(tokens) if self._consume(tokens) else 0

    def consume_tokens(self, tokens):
        return self._consume(tokens)

    def is_error(self):
        return self.failed or self._matcher.is_error()

    def rollback(self, n):
        self.taken -= n
        return self._matcher.rollback(n)

    def deep_copy(self):
        return RefusesPastTwoTokens(self._matcher.deep_copy(), self.taken, self.failed)


def test_a_token_the_grammar_refuses_after_its_mask_allowed_it_ends_the_output_at_every_k(shipped_engine, prompts,
                                                                                         monkeypatch) -> None:
    """Plain decoding emits the token its mask allowed and fails consuming it. With drafts, the rows after a draft
    the matcher refused were never masked, and an accepted draft there let an unguided token in (k = 3: 'aabbb\n'
    from a{1,100000}b{50000}). The request keeps what plain decoding keeps, and fails the same way, at every k."""
    matchers_fail_as(monkeypatch, RefusesPastTwoTokens)
    guided = SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(regex="[a-z ]+"))
    outputs = {}
    for k in range(5):
        with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=k, speculation="fixed")) as ex:
            handles = [ex.submit(p, guided) for p in prompts[:4]]
            outputs[k] = [(h.result(120).token_ids, h.result(120).finish_reason) for h in handles]
            assert_all_free(ex)
    assert all(len(ids) == 3 and reason == "error" for ids, reason in outputs[0])
    assert all(outputs[k] == outputs[0] for k in range(1, 5)), outputs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_draft_is_drawn_within_the_grammar(shipped_engine, shipped_tokenizer, prompts, temperature) -> None:
    """Drafts come from the MTP distribution masked by the state each would be drawn in (the output so far plus the
    drafts before it): every draft chain of every step is a continuation the grammar accepts."""
    tok = shipped_tokenizer
    compiler = GrammarCompiler(tok.backend.to_str(), 4096, tok.eos_token_id)
    chains = []
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=3, speculation="fixed", max_seq_len=256)) as ex:
        draft = ex.runner.proposer.propose

        def spy(items):
            drafts, probs = draft(items)
            chains.extend((it.seq.params.guided_decoding, it.seq.token_ids[it.seq.num_prompt_tokens:], row[: it.num_drafts])
                          for it, row in zip(items, drafts.tolist()))
            return drafts, probs

        ex.runner.proposer.propose = spy
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=1, guided_decoding=g)
                  for g in GUIDES.values()]
        [h.result(120) for h in [ex.submit(p, sp) for p, sp in zip(prompts, params)]]
    assert len(chains) > 10
    eos = tok.eos_token_id
    for guide, output, drafts in chains:
        body = drafts[: drafts.index(eos)] if eos in drafts else drafts  # eos ends the request: nothing after counts
        m = compiler.matcher(guide)
        m.advance(output)
        assert m.matcher.try_consume_tokens(body) == len(body), (guide.kind, output, drafts)
        assert eos not in drafts or m.matcher.is_accepting(), (guide.kind, output, drafts)


def test_sampled_outputs_are_all_valid(shipped_engine, prompts) -> None:
    for k in (0, 3):
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, guided_decoding=GUIDES[kind])
                  for seed in range(3) for kind in GUIDES]
        outs = run(shipped_engine, [prompts[i % 6] for i in range(len(params))], params, k)
        for p, o in zip(params, outs):
            if o.finish_reason == "stop":  # a sampled JSON string may run past max_tokens: then it is cut
                assert conforms(p.guided_decoding.kind, o.text), (k, o.text)
        assert sum(o.finish_reason == "stop" for o in outs) >= len(outs) - 2


@torch.inference_mode()
def test_sampled_first_token_follows_the_masked_target(shipped_engine, prompts, shipped_tokenizer) -> None:
    """A one-letter regex at temperature 1 with k = 2 (draft 1 from the masked MTP distribution, draft 2 forced eos):
    the letter's distribution is the target's softmax restricted to the letters' tokens, exactly."""
    guide = GuidedDecodingParams(regex="[a-z]")
    prompt = prompts[0]
    m = shipped_engine.model
    logits = m.logits(m(torch.tensor([prompt]))[0, -1:]).float()[0]
    compiler = GrammarCompiler(shipped_tokenizer.backend.to_str(), logits.shape[0], shipped_tokenizer.eos_token_id)
    banned = masks(compiler.matcher(guide), [], 0, 1)[0]
    target = logits.masked_fill(banned, float("-inf")).softmax(-1)
    n = 400
    outs = run(shipped_engine, [prompt] * n, [SamplingParams(max_tokens=4, temperature=1.0, seed=s,
                                                             guided_decoding=guide) for s in range(n)], 2)
    assert all(len(o.token_ids) == 1 and o.finish_reason == "stop" for o in outs)
    counts = torch.zeros_like(target, dtype=torch.float64)
    for t, c in Counter(o.token_ids[0] for o in outs).items():
        counts[t] = c
    assert chi2_pvalue(counts, target) > 1e-4
    assert sum(o.stats.num_draft_tokens for o in outs) > 0


def test_compiled_guides_kept_are_bounded_in_size(shipped_tokenizer, monkeypatch) -> None:
    """A compiled guide takes memory in its size: 64 large ones kept made an engine process over a GB larger. The cache
    keeps at most CACHE_GUIDE_BYTES of guide text (and always the newest)."""
    import runtime.core.grammar as grammar

    monkeypatch.setattr(grammar, "CACHE_GUIDE_BYTES", 100)
    compiler = GrammarCompiler(shipped_tokenizer.backend.to_str(), 4096, shipped_tokenizer.eos_token_id)
    guides = [GuidedDecodingParams(regex=f"{c}{'x' * 40}") for c in "abcd"]
    for guide in guides:
        compiler.check(guide)
    assert [text[0] for _, text in compiler._cache] == ["c", "d"]
    compiler.check(GuidedDecodingParams(regex="y" * 200))  # larger than the bound alone: kept, alone
    assert [text[0] for _, text in compiler._cache] == ["y"]


def test_masks_restore_the_matcher_and_free_rows_after_a_refused_draft(shipped_tokenizer) -> None:
    tok = shipped_tokenizer
    compiler = GrammarCompiler(tok.backend.to_str(), 4096, tok.eos_token_id)
    m = compiler.matcher(GuidedDecodingParams(regex="ab+c"))
    a, b, c = (tok.backend.token_to_id(x) for x in "abc")
    before = masks(m, [], 0, 1)
    rows = masks(m, [a, b, b], 0, 4)  # after nothing, a, ab, abb
    assert torch.equal(masks(m, [], 0, 1), before)  # the state is restored
    assert not before[0, a] and before[0, b] and rows[1:, b].logical_not().all() and rows[2:, c].logical_not().all()
    assert rows[1, c]  # "ac" is refused
    refused = masks(m, [a, c, b], 0, 3)
    assert not refused[2].any()  # after a refused draft: unconstrained (never used)
    m.advance([a, b, c])
    [only_eos] = masks(m, [], 0, 1)
    assert (~only_eos).nonzero().flatten().tolist() == [tok.eos_token_id]
    assert m.error is None
    m.advance([a])  # a token the grammar refuses: only a failing grammar lets one be kept; the executor ends it
    assert m.error is not None and m.error.startswith("the grammar failed while generating: ")
    assert not masks(m, [], 0, 1).any()  # no more masks: the sequence ends after this step


def test_verification_reuses_a_draft_mask_only_for_the_same_drafts_in_the_same_state(shipped_tokenizer) -> None:
    """The masks drafting computed are reused by the rows after the same drafts, and only until the state advances:
    a verification after other drafts (drafted another way) or after an advance gets its own masks, those of a
    matcher that never drafted."""
    tok = shipped_tokenizer
    compiler = GrammarCompiler(tok.backend.to_str(), 4096, tok.eos_token_id)
    guide = GuidedDecodingParams(regex="(ab|ba)c+")
    m = compiler.matcher(guide)
    a, b, c = (tok.backend.token_to_id(x) for x in "abc")

    def fresh(kept: list[int], drafts: list[int]) -> torch.Tensor:
        ref = compiler.matcher(guide)
        ref.advance(kept)
        return masks(ref, drafts, 0, len(drafts) + 1)

    for j, drafts in enumerate(([a], [a, b], [a, b, c])):  # drafting: row j after drafts[:j], one row at a time
        masks(m, drafts, j, 1)
    assert torch.equal(masks(m, [a, b, c], 0, 4), fresh([], [a, b, c]))
    assert torch.equal(masks(m, [b, a, c], 0, 4), fresh([], [b, a, c]))  # other drafts: a's row is not b's
    m.advance([a])
    assert torch.equal(masks(m, [b, c], 0, 3), fresh([a], [b, c]))  # row 0 after nothing: the new state's


@pytest.mark.parametrize("guide, message", [
    (GuidedDecodingParams(regex="(abc"), "guided_decoding.regex is invalid at position 0: unclosed group"),
    (GuidedDecodingParams(regex="ab{3,1}"), "guided_decoding.regex is invalid at position 2: invalid repetition "
                                            "count range, the start must be <= the end"),
    (GuidedDecodingParams(json='{"type": "object", "properties": {"a": }}'),
     "guided_decoding.json is not valid JSON: Expecting value at line 1, column 40"),
    (GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "array", "items": {"type": "foo"}}}}),
     "guided_decoding.json is invalid at /properties/a/items of the schema: Invalid type: foo"),
    (GuidedDecodingParams(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
     "guided_decoding.json is invalid at /properties/a of the schema: Pointer '/$defs/missing' does not exist"),
    # number bounds the grammar engine cannot turn into a pattern (it said "min=Some(1e308), max=None")
    (GuidedDecodingParams(json={"type": "object", "properties": {"x": {"type": "number", "minimum": 1e308}}}),
     "guided_decoding.json is invalid at /properties/x of the schema: the grammar engine cannot express these number "
     "bounds (minimum 1e308)"),
    (GuidedDecodingParams(json={"type": "number", "exclusiveMinimum": 1e300, "maximum": 1e301}),
     "guided_decoding.json is invalid at / of the schema: the grammar engine cannot express these number bounds "
     "(minimum 1e300, maximum 1e301)"),
    (GuidedDecodingParams(grammar='root ::= "yes" | maybe'),
     "guided_decoding.grammar is invalid at line 1, column 18: Rule 'maybe' not found"),
    (GuidedDecodingParams(grammar='root ::= "a" x\nx ::= ("b" | "c"'),
     "guided_decoding.grammar is invalid at line 2, column 17: Expected ')'"),
    (GuidedDecodingParams(regex="a", grammar='root ::= "a"'),
     "guided_decoding takes exactly one of json, regex, grammar, json_object; got regex, grammar"),
    (GuidedDecodingParams(json="[" * 100_000), "guided_decoding.json is nested deeper than Python's JSON reader goes"),
])
def test_invalid_guides_name_the_field_and_position(guide, message) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(guided_decoding=guide).validate()
        check_guide(guide)
    assert str(e.value) == message


def test_a_schema_nested_past_the_grammar_engines_reader_is_refused_with_the_bound() -> None:
    """llguidance's JSON reader stops at ~124 levels: such a schema was "invalid at / of the schema: recursion limit
    exceeded at line 1 column 3430", and a server's docs said schemas thousands of levels deep were served."""
    schema: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH - 1):
        schema = {"type": "array", "items": schema}
    check_guide(GuidedDecodingParams(json=schema))  # MAX_SCHEMA_DEPTH levels: served
    for deeper in ({"type": "array", "items": schema}, {"type": "array", "items": [1, {"a": [schema]}]}):
        with pytest.raises(ValueError) as e:
            check_guide(GuidedDecodingParams(json=deeper), "response_format.json_schema.schema")
        depth = MAX_SCHEMA_DEPTH + (1 if "type" in deeper["items"] else 4)
        assert str(e.value) == (f"response_format.json_schema.schema is nested {depth} levels deep (objects and "
                                f"arrays); at most {MAX_SCHEMA_DEPTH} are taken")


def test_a_schema_that_is_no_json_is_refused_naming_the_field() -> None:
    """A dict schema is written as JSON when the guide is made: a set in it, or nesting past Python's recursion limit,
    raised TypeError / RecursionError from json.dumps."""
    deep: dict = {}
    for _ in range(5000):
        deep = {"items": deep}
    for schema, why in (({"enum": {1, 2}}, "Object of type set is not JSON serializable"),
                        (deep, "it is nested too deeply")):
        with pytest.raises(ValueError) as e:
            GuidedDecodingParams(json=schema)
        assert str(e.value) == f"guided_decoding.json: the schema cannot be written as JSON: {why}"


def test_a_guide_checked_lately_is_looked_up_without_a_compile_thread(monkeypatch) -> None:
    """A server checks a request's guide, then its executor compiles the same one: the second check is a look-up (it
    started a thread of COMPILE_STACK_BYTES of stack to find the guide cached). An invalid guide is refused each
    time."""
    from runtime.core import guide_check

    grammar = check_guide(GuidedDecodingParams(regex="[ab]{3}-looked-up"))
    compiles = []
    real = guide_check.on_compile_stack
    monkeypatch.setattr(guide_check, "on_compile_stack", lambda compile_: compiles.append(1) or real(compile_))
    assert check_guide(GuidedDecodingParams(regex="[ab]{3}-looked-up")) == grammar and not compiles
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^guided_decoding.regex is invalid at position 0: unclosed character class$"):
            check_guide(GuidedDecodingParams(regex="[ab"))
    assert len(compiles) == 2


def test_a_refused_guide_leaves_its_callers_objects_to_reference_counting() -> None:
    """The compile thread handed its exception back through a list its frame held, a reference cycle: the refusal's
    traceback kept every caller's frame, and their objects, until a garbage collection. In the Triton BLS those were
    the server's request objects; collected only at the stub's exit, after its connection to the server was gone,
    they crashed every instance (segmentation faults at shutdown after invalid guides, in the soak test)."""
    assert_a_refusal_frees_its_callers(lambda: check_guide(GuidedDecodingParams(regex="a{2")),
                                       "unclosed counted repetition")


def test_a_guide_past_the_lexers_budget_is_refused_in_the_clients_terms(shipped_tokenizer) -> None:
    """llguidance's message named its own settings ("either increase limits.initial_lexer_fuel or disable
    limits.precompute_large_lexemes"), which no request can change (found by an adversarial run)."""
    compiler = GrammarCompiler(shipped_tokenizer.backend.to_str(), 4096, shipped_tokenizer.eos_token_id)
    with pytest.raises(ValueError) as e:
        compiler.check(GuidedDecodingParams(regex="(a|b)*" * 2000))
    assert str(e.value) == ("guided_decoding.regex cannot be served: the guide is too large for the grammar engine's "
                            "lexer (its precomputation ran out of budget)")


def test_locating_a_schema_error_compiles_a_bounded_share_of_the_schema(monkeypatch) -> None:
    """An invalid schema's error is located by compiling its subschemas level by level: with a large valid sibling
    at every level that cost grew with the square of the schema (a 196 KB body took 2.4 s of CPU to refuse, and
    eight at once held /health 7 s). The search now stops after compiling ~4 schemas' bytes and names the deepest
    subschema found by then; a small schema's error is still located exactly (the test above)."""
    from runtime.core import guide_check

    heavy = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{1,20}@[a-z]{1,20}\\.com"}
                                              for i in range(50)}}
    schema = {"type": "string", "pattern": "(a"}
    for _ in range(40):
        schema = {"type": "object", "properties": {"h": heavy, "c": schema}}
    compiled = []
    real = guide_check._schema_error
    monkeypatch.setattr(guide_check, "_schema_error", lambda sub: compiled.append(len(json.dumps(sub))) or real(sub))
    with pytest.raises(ValueError) as e:
        check_guide(GuidedDecodingParams(json=schema))
    size = len(json.dumps(schema))
    assert sum(compiled) <= (guide_check.LOCATION_BUDGET + 1) * size + guide_check.LOCATION_FLOOR, (sum(compiled), size)
    assert str(e.value).startswith("guided_decoding.json is invalid at /properties/c")
    assert "(or below it) of the schema: " in str(e.value)


@pytest.mark.parametrize("guide", [GuidedDecodingParams(grammar="root ::= root"),
                                   GuidedDecodingParams(json={"$ref": "#"}),
                                   GuidedDecodingParams(regex="[^\\x00-\\x{10FFFF}]")], ids=["grammar", "json", "regex"])
def test_guides_that_allow_no_output_are_refused_at_submit(shipped_engine, shipped_tokenizer, prompts, guide) -> None:
    """Guides whose language is empty pass the syntax check; the grammar engine finds that nothing can begin them,
    and the request is refused before it runs (an empty output ended by eos would pass for a valid one)."""
    compiler = GrammarCompiler(shipped_tokenizer.backend.to_str(), 4096, shipped_tokenizer.eos_token_id)
    message = f"guided_decoding.{guide.kind} allows no output: no token can begin it (NoExtensionBias)"
    with pytest.raises(ValueError) as e:
        compiler.check(guide)
    assert str(e.value) == message
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed")) as ex:
        with pytest.raises(ValueError) as e:
            ex.submit(prompts[0], SamplingParams(max_tokens=8, guided_decoding=guide))
        assert str(e.value) == message
        assert_all_free(ex)


def test_bad_tokens_that_leave_nothing_yield_to_the_grammar(shipped_engine, shipped_tokenizer, prompts) -> None:
    """A row where the request's bad tokens ban everything the grammar allows takes the grammar's mask alone: the
    output still follows the grammar (a step never emits a token the grammar refuses)."""
    letter = shipped_tokenizer.encode("q", add_bos=False)
    params = SamplingParams(max_tokens=8, bad_token_ids=tuple(letter), guided_decoding=GuidedDecodingParams(regex="q"))
    for k in (0, 2):
        [out] = run(shipped_engine, prompts[:1], [params], k)
        assert out.text == "q" and out.finish_reason == "stop", (k, out.text)


def test_guided_output_with_the_torch_ops_is_the_kernels(shipped_engine, shipped_tokenizer, prompts, monkeypatch
                                                         ) -> None:
    """Where the kernels do not run (CUDA, no AVX-512) the torch ops unpack the grammar's bitmasks: the same output,
    bad tokens yielding to the grammar included."""
    letter = shipped_tokenizer.encode("q", add_bos=False)
    params = [SamplingParams(max_tokens=MAX_TOKENS, guided_decoding=GUIDES["json"]),
              SamplingParams(max_tokens=8, bad_token_ids=tuple(letter), guided_decoding=GuidedDecodingParams(regex="q"))]
    kernels = [o.token_ids for o in run(shipped_engine, prompts[:2], params, 2)]
    monkeypatch.setattr("runtime.core.sampling.cpu_kernels_serve", lambda device, dtype: False)
    assert [o.token_ids for o in run(shipped_engine, prompts[:2], params, 2)] == kernels


def test_session_refuses_before_submitting_anything(shipped_model_dir) -> None:
    with Session(shipped_model_dir, num_draft_tokens=2) as s:
        bad = SamplingParams(guided_decoding=GuidedDecodingParams(regex="ab[c-"))
        with pytest.raises(ValueError, match=r"^guided_decoding.regex is invalid at position 2: unclosed character"):
            s.generate(["In the beginning", "And God said"], bad)
        with pytest.raises(ValueError, match="cannot be combined with ignore_eos or min_tokens"):
            s.generate("In the beginning", SamplingParams(ignore_eos=True, guided_decoding=GUIDES["regex"]))
        assert s.executor.stats().requests_finished == 0 and s.executor.stats().running == 0
        [out] = s.generate("In the beginning", SamplingParams(max_tokens=MAX_TOKENS, guided_decoding=GUIDES["json"]))
        assert out.finish_reason == "stop" and conforms("json", out.text)


def test_openai_server_response_format_and_guided_extras(shipped_model_dir, tmp_path) -> None:
    """dsv3-serve with MTP (k = 3): response_format json_schema and json_object, vLLM's guided_regex and
    structured_outputs give the Session's plain-decoding output (greedy); an invalid guide is a 400 naming the field
    and the position, and the server goes on serving."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from serving.openai_server.process import start_dsv3_serve

    prompt = "And the LORD said unto Moses,"
    with Session(shipped_model_dir, num_draft_tokens=0) as plain:
        expected = {kind: plain.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, guided_decoding=g))[0].text
                    for kind, g in GUIDES.items()}
    serve = start_dsv3_serve(shipped_model_dir, "--torch_threads", "1", "--num_draft_tokens", "3", "--speculation",
                             "fixed", log=tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=serve.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ask = dict(model="deepseek-v3-mini", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
        texts = {"json": client.completions.create(**ask, extra_body={"response_format": schema}),
                 "json_object": client.completions.create(**ask, extra_body={"response_format": {"type": "json_object"}}),
                 "regex": client.completions.create(**ask, extra_body={"guided_regex": REGEX}),
                 "grammar": client.completions.create(**ask, extra_body={"structured_outputs": {"grammar": EBNF}})}
        for kind, r in texts.items():
            assert r.choices[0].text == expected[kind] and conforms(kind, r.choices[0].text), kind
            assert r.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**ask, extra_body={"guided_regex": "ab(c"})
        assert e.value.body["message"] == "guided_regex is invalid at position 2: unclosed group"
        assert e.value.body["param"] == "guided_regex"
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**ask, extra_body={"structured_outputs": {"grammar": "root ::= root"}})
        assert e.value.body["param"] == "structured_outputs"  # refused at submit, said as the client wrote it
        assert e.value.body["message"] == "structured_outputs.grammar allows no output: no token can begin it " \
                                          "(NoExtensionBias)"
        chat = client.chat.completions.create(model="deepseek-v3-mini", messages=[{"role": "user", "content": prompt}],
                                              max_tokens=MAX_TOKENS, temperature=0, response_format=schema)
        assert conforms("json", chat.choices[0].message.content)
    finally:
        assert serve.stop() == 0


def test_triton_guided_decoding_inputs() -> None:
    """TensorRT-LLM's guided_decoding_guide_type / guided_decoding_guide, read for both Triton flavours."""
    import numpy as np

    from serving.request_validation import RequestError
    from serving.triton.contract import guided_decoding

    def read(kind: str | None, guide: str | None) -> GuidedDecodingParams | None:
        inputs = {name: np.array([value.encode()], object) for name, value in
                  (("guided_decoding_guide_type", kind), ("guided_decoding_guide", guide)) if value is not None}
        return guided_decoding(inputs)

    assert read(None, None) is None and read("", "") is None
    assert read("json", None) == GuidedDecodingParams(json_object=True)
    assert read("json_schema", json.dumps(SCHEMA)) == GuidedDecodingParams(json=SCHEMA)
    assert read("regex", REGEX) == GuidedDecodingParams(regex=REGEX)
    assert read("ebnf_grammar", EBNF) == GuidedDecodingParams(grammar=EBNF)
    for kind, guide, message in [
            ("regex", "a{2", "guided_decoding_guide is invalid at position 1: unclosed counted repetition"),
            ("json_schema", '{"type": "object", "properties": {"a": {"type": "foo"}}}',
             "guided_decoding_guide is invalid at /properties/a of the schema: Invalid type: foo"),
            ("xml", "<a/>", "guided_decoding_guide_type must be one of json, json_schema, regex, ebnf_grammar, got 'xml'"),
            ("regex", None, "guided_decoding_guide is required with guided_decoding_guide_type regex"),
            (None, "a+", "guided_decoding_guide needs guided_decoding_guide_type (json_schema, regex, ebnf_grammar)")]:
        with pytest.raises(RequestError) as e:
            read(kind, guide)
        assert str(e.value) == message
