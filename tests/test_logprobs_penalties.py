"""Logprobs, penalties and min_tokens, exact under MTP speculation.

- Logprobs come from the verification forward: for k = 1..4, alone and batched, every emitted token's
  logprob and top alternatives equal plain decoding's (k = 0) within 1e-5, and they are the log-softmax of
  a dense teacher-forced forward (raw), or of the exact sampling distribution (processed). Prompt logprobs
  equal the dense forward's over chunked prefills; streamed deltas add up to the totals.
- Penalties (repetition: HF over prompt and output; presence / frequency: OpenAI over the output) and
  min_tokens: greedy output is token for token the k = 0 output for k = 1..4, alone and in mixed batches,
  and equals a reference decoder written here from the definitions; sampled output follows the penalized
  target distribution (chi-square on a 64-token model, where the unpenalized distribution is rejected).
- Logit biases (vLLM's / OpenAI's logit_bias), added before the penalties: the same three properties.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace

import pytest
import torch

from runtime.core.sampling import Adjustments, SamplingTensors, probabilities, token_logprobs
from runtime.core.sampling_params import SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.executors.outputs import RequestOutput
from runtime.io.loading import load_engine
from runtime.model.kernels import cpu_missing_flags

from conftest import bigram_tensors, chi2_pvalue, tiny_config_dict
from executor_util import assert_all_free, run_fresh as run, seeded_requests_take_rejection_sampling

pytestmark = pytest.mark.usefixtures("torch_one_thread")

MAX_SEQ_LEN = 256
TOL = 1e-5
P_MIN = 1e-4



@pytest.fixture(scope="module")
def prompts(shipped_model_dir, shipped_tokenizer) -> list[list[int]]:
    rows = json.loads((shipped_model_dir / "heldout_prompts.json").read_text())
    return [shipped_tokenizer.encode(r["text"])[:40] for r in rows[:6]]


@torch.inference_mode()
def dense_logits(engine, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of one dense forward: row i predicts token i + 1."""
    m = engine.model
    return m.logits(m(torch.tensor([ids]))[0]).double()


def penalized_reference(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                        stop_ids: set[int]) -> torch.Tensor:
    """The definitions, token by token: HF's repetition penalty over prompt and output, OpenAI's frequency
    and presence penalties over the output, stop tokens banned before min_tokens."""
    x = logits.clone()
    r = params.repetition_penalty
    for t in set(prompt) | set(output):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, c in Counter(output).items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    if len(output) < params.min_tokens:
        x[list(stop_ids)] = float("-inf")
    return x


def assert_same_logprobs(a: RequestOutput, b: RequestOutput, label: str) -> None:
    assert a.token_ids == b.token_ids, f"{label}: tokens differ"
    assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
    for i, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
        assert x.token_id == y.token_id == a.token_ids[i]
        assert abs(x.logprob - y.logprob) <= TOL, f"{label}: token {i}: {x.logprob} vs {y.logprob}"
        assert x.rank == y.rank, f"{label}: token {i}: rank {x.rank} vs {y.rank}"
        assert len(x.top) == len(y.top)
        for (ti, vi), (tj, vj) in zip(x.top, y.top):
            assert abs(vi - vj) <= TOL and (ti == tj or abs(vi - vj) <= TOL), f"{label}: token {i}: top differs"
    assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)
    assert a.cumulative_logprob == pytest.approx(sum(x.logprob for x in a.logprobs), abs=1e-9)


# ---------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------
def logprob_params() -> list[SamplingParams]:
    """Six requests of one batch: top-5 raw, top-0 processed, penalized with logprobs, sampled seeded with
    processed logprobs, none, and min_tokens with top-20 (greedy ones are identical for every k)."""
    return [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=5),
            SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0, logprobs_mode="processed_logprobs"),
            SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3, repetition_penalty=1.3, frequency_penalty=0.4),
            SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2, temperature=0.8, seed=5,
                           logprobs_mode="processed_logprobs"),
            SamplingParams(max_tokens=24, ignore_eos=True),
            SamplingParams(max_tokens=24, logprobs=20, min_tokens=20, presence_penalty=0.5)]


@pytest.fixture(scope="module")
def plain_logprobs(shipped_engine, prompts):
    return run(shipped_engine, prompts, logprob_params(), 0)


@pytest.mark.parametrize("alone", [False, True], ids=["batched", "alone"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_logprobs_under_speculation_equal_plain(shipped_engine, prompts, plain_logprobs, k, alone) -> None:
    outs = run(shipped_engine, prompts, logprob_params(), k, alone=alone)
    for i, (o, ref) in enumerate(zip(outs, plain_logprobs)):  # a seeded sampled one too: its tokens are k = 0's
        if ref.logprobs is None:
            assert o.logprobs is None and o.cumulative_logprob is None and o.token_ids == ref.token_ids
            continue
        assert_same_logprobs(o, ref, f"k={k}, request {i}")
    assert sum(o.stats.num_accepted_draft_tokens for o in outs) > 0


@pytest.mark.skipif(bool(cpu_missing_flags()), reason="CPU kernels need x86-64 with AVX-512")
@pytest.mark.parametrize("n", [0, 1, 5, 20])
def test_token_logprobs_kernel_equals_the_torch_ops(n, monkeypatch) -> None:
    """token_logprobs in one kernel call reads back what the torch ops do: the token's logprob and rank, and the n
    largest logprobs (ties, -inf from top-k cuts included), with ties in id order."""
    g = torch.Generator().manual_seed(n)
    lp = torch.randn(7, 301, generator=g).log_softmax(-1)
    lp[1, 100:] = float("-inf")  # a processed row after a top-k cut
    lp[2, ::3] = lp[2].max()  # ties at the top, the chosen token among them
    tokens = torch.tensor([0, 150, 6, 300, 17, 17, 299])
    top_n = [n, 0, n, max(n - 1, 0), n, 1 if n else 0, n]
    got = token_logprobs(lp, tokens, top_n)
    monkeypatch.setattr("runtime.core.sampling.cpu_kernels_serve", lambda device, dtype: False)
    want = token_logprobs(lp, tokens, top_n)
    order = lp.sort(dim=-1, descending=True, stable=True)
    for m, (a, b) in enumerate(zip(got, want)):
        assert (a.token_id, a.logprob, a.rank) == (b.token_id, b.logprob, b.rank), m
        assert [v for _, v in a.top] == [v for _, v in b.top], m
        assert [t for t, _ in a.top] == order.indices[m, : top_n[m]].tolist(), m
    assert got[2].rank == 1 and got[1].rank == 101


def test_raw_logprobs_are_the_dense_forward_log_softmax(shipped_engine, prompts, plain_logprobs) -> None:
    """Raw logprobs of every emitted token (greedy, penalized or not) are the log-softmax of the model's logits
    at its position, with the top-N alternatives and the token's rank."""
    for i in (0, 2, 5):
        o = run(shipped_engine, [prompts[i]], logprob_params()[i], 3)[0]
        lp = dense_logits(shipped_engine, prompts[i] + o.token_ids).log_softmax(-1)[len(prompts[i]) - 1:-1]
        for j, (t, x) in enumerate(zip(o.token_ids, o.logprobs)):
            assert x.logprob == pytest.approx(lp[j, t].item(), abs=1e-4)
            assert x.rank == int((lp[j] > lp[j, t]).sum()) + 1
            top = lp[j].topk(len(x.top))
            assert [v for _, v in x.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert len(o.logprobs[0].top) == logprob_params()[i].logprobs


@pytest.mark.parametrize("k", [0, 3])
def test_processed_logprobs_are_the_sampling_distribution(shipped_engine, prompts, k) -> None:
    """processed_logprobs of a sampled, penalized, top-k request: the log of the exact distribution each
    token was drawn from (penalties on the prefix, temperature, top-k), also where drafts decided it."""
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_k=30, seed=11, repetition_penalty=1.2,
                            presence_penalty=0.3, frequency_penalty=0.2, logprobs=4, logprobs_mode="processed_logprobs")
    prompt = prompts[1]
    o = run(shipped_engine, [prompt], params, k)[0]
    logits = dense_logits(shipped_engine, prompt + o.token_ids)[len(prompt) - 1:-1]
    for j, (t, x) in enumerate(zip(o.token_ids, o.logprobs)):
        adjusted = penalized_reference(logits[j], prompt, o.token_ids[:j], params, set())
        probs = probabilities(adjusted[None].float(), SamplingTensors(torch.tensor([0.8]), torch.tensor([30]),
                                                                     torch.tensor([1.0])))[0].double()
        assert x.logprob == pytest.approx(math.log(probs[t]), abs=1e-4), f"token {j}"
        assert [v for _, v in x.top] == pytest.approx(probs.topk(4).values.log().tolist(), abs=1e-4)
    if k:
        assert o.stats.num_accepted_draft_tokens > 0


def test_prompt_logprobs_over_chunked_prefill(shipped_engine, prompts) -> None:
    """prompt_logprobs: None for the first token, then each token's logprob given the tokens before it,
    over a prefill cut into chunks of 7; once per request even when several share a step."""
    two = [prompts[0], prompts[3]]
    outs = run(shipped_engine, two, SamplingParams(max_tokens=3, prompt_logprobs=2), 2, max_num_tokens=7)
    for p, o in zip(two, outs):
        lp = dense_logits(shipped_engine, p).log_softmax(-1)
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
        for i, x in enumerate(o.prompt_logprobs[1:]):
            assert x.token_id == p[i + 1]
            assert x.logprob == pytest.approx(lp[i, p[i + 1]].item(), abs=1e-4)
            assert [t for t, _ in x.top] == lp[i].topk(2).indices.tolist()
        assert o.logprobs is None


def test_streamed_logprob_deltas_add_up_and_stop_tokens_have_none(shipped_engine, prompts, plain_logprobs) -> None:
    """Each output carries the logprobs of its new tokens; joined they are the final list. A request that
    stops at a stop token reports logprobs for the tokens it kept, not for the stop token."""
    ref = plain_logprobs[0]
    stop = ref.token_ids[9]
    params = SamplingParams(max_tokens=24, logprobs=5, stop_token_ids=(stop,))
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=3, speculation="fixed", max_seq_len=MAX_SEQ_LEN)) as ex:
        outs = list(ex.submit(prompts[0], params))
    joined = [x for o in outs for x in o.new_logprobs]
    assert all(len(o.new_logprobs) == len(o.new_token_ids) for o in outs)
    final = outs[-1]
    assert final.finish_reason == "stop" and final.token_ids == ref.token_ids[:ref.token_ids.index(stop)]
    assert joined == final.logprobs and len(final.logprobs) == len(final.token_ids)
    assert [x.logprob for x in final.logprobs] == pytest.approx([x.logprob for x in ref.logprobs[:len(joined)]], abs=TOL)


def test_session_results_carry_logprobs(shipped_model_dir) -> None:
    from runtime import Session

    with Session(shipped_model_dir, num_draft_tokens=2, dtype="float32", max_seq_len=MAX_SEQ_LEN) as s:
        [r] = s.generate("def f(x):", SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=0))
        [plain] = s.generate("def f(x):", SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(r.logprobs) == len(r.token_ids) == 8 and r.token_ids == plain.token_ids
    assert r.cumulative_logprob == pytest.approx(sum(x.logprob for x in r.logprobs))
    assert r.prompt_logprobs[0] is None and all(x.top == () for x in r.prompt_logprobs[1:])
    assert plain.logprobs is None and plain.cumulative_logprob is None and plain.prompt_logprobs is None


# ---------------------------------------------------------------------------------------------
# Penalties and min_tokens
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["apply", "apply_with_torch"])
def test_penalties_follow_hf_and_openai_definitions(path) -> None:
    """Adjustments, in the kernel and with torch ops, against transformers' RepetitionPenaltyLogitsProcessor (HF's
    definition) and the OpenAI formula logit - frequency * count - presence * (count > 0)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    V = 50
    logits = torch.randn(2, V, generator=g) * 3
    prompt, output = [3, 7, 7, 11], [7, 20, 20, 20, 33]
    counts = torch.bincount(torch.tensor(output), minlength=V).float()
    in_prompt = torch.zeros(V, dtype=torch.bool)
    in_prompt[prompt] = True
    none = [torch.empty(0, dtype=torch.long)] * 2, [torch.empty(0)] * 2
    adj = Adjustments(1, 0, None, [1], [counts], [in_prompt], [1.7, 0.5, 0.25], [[], []], [[], []], [0, 0], *none)
    got = getattr(adj, path)(logits)
    assert torch.equal(got[0], logits[0]), "a row without penalties changed"
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits[1:].clone())[0]
    want = hf - 0.25 * counts - 0.5 * (counts > 0)
    torch.testing.assert_close(got[1], want)
    assert got[1, 20] == pytest.approx((logits[1, 20] / 1.7 if logits[1, 20] > 0 else logits[1, 20] * 1.7) - 0.75 - 0.5)


@pytest.mark.skipif(bool(cpu_missing_flags()), reason="CPU kernels need x86-64 with AVX-512")
@pytest.mark.parametrize("first,num_rows", [(0, 1), (2, 1), (0, 5), (1, 4)])
def test_adjustments_kernel_equals_the_torch_ops(first, num_rows) -> None:
    """The one-call kernel gives the torch ops' bits on random rows: logit biases (on penalized, drafted and banned
    tokens too), repeated drafts (counted per row on top of the output's), negative logits, repetition penalties above
    and below 1, frequency / presence penalties of either sign, bad tokens and min_tokens bans lifting at a row; the
    logits given are left as they were."""
    g = torch.Generator().manual_seed(first * 10 + num_rows)
    B, V = 4, 301  # V not a multiple of the kernel's 16 lanes
    for _ in range(20):
        logits = torch.randn(B * num_rows, V, generator=g) * 4
        logits[:, :8] = torch.tensor([-3.0, -0.5, 0.0, 0.5, 3.0, -7.0, 2.0, -2.0])
        given = logits.clone()
        drafts = torch.randint(0, 12, (B, first + num_rows + 1), generator=g)  # few tokens: drafts repeat
        drafts[:, 1] = drafts[:, 0]
        penalized = [0, 2, 3]
        counts = [torch.randint(0, 10, (V,), generator=g).float() * (torch.rand(V, generator=g) < 0.05) for _ in penalized]
        in_prompt = [torch.rand(V, generator=g) < 0.03 for _ in penalized]  # sparse: whole lanes of 16 untouched
        # repetition above and below 1, presence and frequency of either sign, with full mantissas (so a fused
        # multiply-add would round frequency * count + presence differently from the torch ops)
        values = [v for _ in penalized for v in (torch.empty(1).uniform_(0.5, 2, generator=g).item(),
                                                 *torch.empty(2).uniform_(-2, 2, generator=g).tolist())]
        bad = [[], [5, 17], [], [300]]
        stops = [[1, 2], [], [], [4]]
        stop_rows = [max(2 - first, 0), 0, 0, 1]
        bias_tokens = [torch.tensor(t, dtype=torch.long) for t in ([3, 5, 7, 299], [], [0, 1, 2, 4, 9, 11], [300, 6])]
        bias_values = [torch.empty(len(t)).uniform_(-100, 100, generator=g) for t in bias_tokens]  # bad 5 and 300
        adj = Adjustments(num_rows, first, drafts, penalized, counts, in_prompt, values, bad, stops, stop_rows,
                          bias_tokens, bias_values)
        got, want = adj.apply(logits), adj.apply_with_torch(logits)
        assert torch.equal(logits, given), "the kernel wrote into the logits it was given"
        assert torch.equal(got, want), (got - want).abs().max()
        assert got.isinf().sum() == want.isinf().sum() > 0


@pytest.mark.skipif(bool(cpu_missing_flags()), reason="CPU kernels need x86-64 with AVX-512")
@pytest.mark.parametrize("first,num_rows", [(0, 1), (2, 1), (0, 4)])
def test_grammar_bitmask_words_ban_what_they_refuse_in_the_kernel_as_with_torch(first, num_rows) -> None:
    """A guided batch's bitmask words go to the kernel as they are: random words (bits past the vocabulary, which is
    not a multiple of 32, set or not), rows of all bits (no grammar), penalties, bad and stop bans on top; bans that
    would leave nothing the words allow yield to them. The kernel, the torch ops (which unpack the words) and a
    reference written token by token all agree."""
    g = torch.Generator().manual_seed(first * 10 + num_rows)
    B, V = 4, 301
    W = -(-V // 32)
    for trial in range(20):
        logits = torch.randn(B * num_rows, V, generator=g) * 4
        drafts = torch.randint(0, 12, (B, first + num_rows + 1), generator=g)
        allowed = torch.randint(-2**31, 2**31, (B * num_rows, W), generator=g, dtype=torch.int64).to(torch.int32)
        allowed[num_rows : 2 * num_rows] = -1  # sequence 1: no grammar
        allowed[-1] = 0
        allowed[-1, 3] = 1 << 5 | 1 << 9  # tokens 101 and 105 only: banned below, so the bans yield
        bad = [[7, 40], [5, 17], [], [101, 105, 250]]
        stops = [[1, 2, 300], [], [], [4]]
        stop_rows = [max(2 - first, 0), 0, 0, num_rows]
        counts = [torch.randint(0, 3, (V,), generator=g).float()]
        args = (num_rows, first, drafts, [2], counts, [torch.rand(V, generator=g) < 0.1], [1.3, 0.4, 0.2])
        no_bias = [torch.empty(0, dtype=torch.long)] * B, [torch.empty(0)] * B
        adj = Adjustments(*args, bad, stops, stop_rows, *no_bias, allowed)
        got, with_torch = adj.apply(logits), adj.apply_with_torch(logits)
        want = Adjustments(*args, [[]] * B, [[]] * B, [0] * B, *no_bias).apply_with_torch(logits)
        for row in range(B * num_rows):
            b, r = divmod(row, num_rows)
            words = [w & 0xFFFFFFFF for w in allowed[row].tolist()]
            grammar = {t for t in range(V) if words[t // 32] >> (t % 32) & 1}
            listed = set(bad[b]) | (set(stops[b]) if r < stop_rows[b] else set())
            kept = grammar - listed or grammar
            want[row, [t for t in range(V) if t not in kept]] = float("-inf")
        assert torch.equal(got, want), (trial, (got != want).nonzero()[:5])
        assert torch.equal(with_torch, want), trial
        assert got[-1].isfinite().nonzero().flatten().tolist() == [101, 105]


def penalty_params() -> list[SamplingParams]:
    """A mixed batch: penalized greedy requests of each kind, min_tokens, a plain greedy one and a seeded
    penalized sampled one (which only shares the steps)."""
    return [SamplingParams(max_tokens=32, ignore_eos=True, repetition_penalty=1.5),
            SamplingParams(max_tokens=32, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5),
            SamplingParams(max_tokens=32, ignore_eos=True, repetition_penalty=0.8, frequency_penalty=-0.3),
            SamplingParams(max_tokens=32, ignore_eos=True),
            SamplingParams(max_tokens=32, temperature=0.9, seed=3, repetition_penalty=1.2, presence_penalty=0.7),
            SamplingParams(max_tokens=32, repetition_penalty=1.1, frequency_penalty=2.0, bad_token_ids=(13,))]


@pytest.fixture(scope="module")
def plain_penalized(shipped_engine, prompts):
    return run(shipped_engine, prompts, penalty_params(), 0)


@pytest.mark.parametrize("alone", [False, True], ids=["batched", "alone"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_with_penalties_equals_plain_for_every_k(shipped_engine, prompts, plain_penalized, k, alone) -> None:
    outs = run(shipped_engine, prompts, penalty_params(), k, alone=alone)
    for i, (o, ref) in enumerate(zip(outs, plain_penalized)):
        if not penalty_params()[i].temperature:
            assert o.token_ids == ref.token_ids, f"k={k}, request {i}: penalized greedy output differs from k = 0"
    assert sum(o.stats.num_accepted_draft_tokens for o in outs) > 0


def test_greedy_penalties_equal_the_reference_decoder(shipped_engine, prompts, plain_penalized) -> None:
    """The penalized greedy outputs are the argmax of the penalized logits at every step (a decoder written
    from the definitions over dense forwards), and they differ from the unpenalized output."""
    penalized = (0, 1, 2, 5)
    unpenalized = run(shipped_engine, [prompts[i] for i in penalized],
                      [replace(penalty_params()[i], repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
                       for i in penalized], 0)
    for i, plain in zip(penalized, unpenalized):
        assert plain_penalized[i].token_ids != plain.token_ids, f"request {i}: the penalties changed nothing"
    for i in penalized:
        params, prompt, got = penalty_params()[i], prompts[i], plain_penalized[i].token_ids
        out: list[int] = []
        while len(out) < len(got):
            x = penalized_reference(dense_logits(shipped_engine, prompt + out)[-1], prompt, out, params, set())
            x[list(params.bad_token_ids)] = float("-inf")
            out.append(int(x.argmax()))
        assert out == got, f"request {i}"


@pytest.mark.parametrize("k", [0, 3])
def test_min_tokens_bans_stop_tokens_and_stop_strings_until_reached(shipped_engine, shipped_tokenizer, prompts,
                                                                    plain_penalized, k) -> None:
    """The plain greedy output's 3rd token as a stop token ends it after 2 tokens; with min_tokens 10 it cannot
    appear among the first 10 (the output then is the reference decoder's with that token banned there), and
    speculation does not change it. A stop string in the first min_tokens tokens' text is ignored."""
    ref = plain_penalized[3].token_ids
    stop = ref[2]
    [short] = run(shipped_engine, [prompts[3]], SamplingParams(max_tokens=24, stop_token_ids=(stop,)), k)
    assert short.token_ids == ref[:2] and short.finish_reason == "stop"
    params = SamplingParams(max_tokens=24, stop_token_ids=(stop,), min_tokens=10)
    [o] = run(shipped_engine, [prompts[3]], params, k)
    assert len(o.token_ids) >= 10 and stop not in o.token_ids[:10]
    out: list[int] = []
    while len(out) < 10:
        x = penalized_reference(dense_logits(shipped_engine, prompts[3] + out)[-1], prompts[3], out, params,
                                {stop, shipped_tokenizer.eos_token_id})
        out.append(int(x.argmax()))
    assert o.token_ids[:10] == out
    text = shipped_tokenizer.decode(ref[:2])
    [s] = run(shipped_engine, [prompts[3]], SamplingParams(max_tokens=12, ignore_eos=True, stop=[text], min_tokens=6), k)
    assert s.token_ids == ref[:12] and s.finish_reason == "length"


# ---- sampled output follows the penalized distribution: a 64-token model ------------------------------
SMALL_V = 64


@pytest.fixture(scope="module")
def small_engine(tmp_path_factory):
    """A tiny fp32 model over 64 tokens whose MTP layer drafts decently (conftest.bigram_tensors), with the
    embeddings added to the heads so that it likes to repeat the token it just saw (p ~ 0.2-0.7): then
    whether a penalty counts the drafts before a row shows in the samples."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from builder.hf_writer import write_hf_checkpoint
    from runtime.model.config import ModelConfig

    cfg = ModelConfig.from_dict(tiny_config_dict(vocab_size=SMALL_V))
    ts = dict(bigram_tensors(cfg, 3, embed_scale=3.0))
    ts["lm_head.weight"] = ts["lm_head.weight"] + ts["model.embed_tokens.weight"]
    ts[f"model.layers.{cfg.num_hidden_layers}.shared_head.head.weight"] = ts["lm_head.weight"].clone()
    path = write_hf_checkpoint(tmp_path_factory.mktemp("small") / "v64", cfg, ts.items(), fp8=False)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(SMALL_V)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return load_engine(path)


SAMPLED = dict(temperature=1.0, repetition_penalty=2.0, presence_penalty=1.5, frequency_penalty=1.0, ignore_eos=True)
N_SEEDS = 3000


REJECTION = "2-rejection"


@pytest.fixture(scope="module")
def penalized_samples(small_engine):
    """At k = 0, at k = 2 (seeded: the race), and at k = 2 with rejection sampling (what unseeded requests take)."""
    prompt = [5, 35, 17, 8, 40, 9]  # the likeliest next tokens, 8 and 35, in it: the repetition penalty bites
    out = {}
    for name in (0, 2, REJECTION):
        k = 2 if name == REJECTION else name
        params = [SamplingParams(max_tokens=3, seed=1000 * k + s, **SAMPLED) for s in range(N_SEEDS)]
        with pytest.MonkeyPatch.context() as mp:
            if name == REJECTION:
                seeded_requests_take_rejection_sampling(mp)
            out[name] = run(small_engine, [prompt] * N_SEEDS, params, k)
    return prompt, out


def penalized_probs(engine, prompt: list[int], output: list[int], params: SamplingParams | None) -> torch.Tensor:
    logits = dense_logits(engine, prompt + output)[-1]
    if params is not None:
        logits = penalized_reference(logits, prompt, output, params, set())
    return logits.softmax(-1)


@pytest.mark.parametrize("k", [0, 2, REJECTION])
def test_sampled_tokens_follow_the_penalized_target(small_engine, penalized_samples, k) -> None:
    """Over 3000 seeds: the (first, second) pair follows p(t1) p(t2 | t1) of the penalized target (t2's
    frequency / presence penalties count t1, which at k = 2 was a draft), and the third token its penalized
    conditional given both (randomized PIT, 20 bins); the unpenalized target is rejected on the same samples."""
    params = SamplingParams(max_tokens=3, **SAMPLED)
    prompt, outs = penalized_samples
    outs = outs[k]
    if k:
        drafted = sum(o.stats.num_draft_tokens for o in outs)
        accepted = sum(o.stats.num_accepted_draft_tokens for o in outs)
        assert 0.1 * drafted < accepted < 0.9 * drafted, (accepted, drafted)
    for p, expect in ((params, "pass"), (None, "fail")):
        p1 = penalized_probs(small_engine, prompt, [], p)
        pairs = Counter((o.token_ids[0], o.token_ids[1]) for o in outs)
        firsts = sorted({a for a, _ in pairs})
        cond = {a: penalized_probs(small_engine, prompt, [a], p) for a in firsts}
        joint = torch.stack([p1[a] * cond[a] for a in firsts]).flatten()
        counts = torch.zeros_like(joint)
        for (a, b), c in pairs.items():
            counts[firsts.index(a) * SMALL_V + b] = c
        pv_pair = chi2_pvalue(counts, joint / joint.sum())
        # third token: u = F(t3-) + w p(t3) under its conditional must be uniform
        w = torch.rand(len(outs), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        cache: dict[tuple[int, int], torch.Tensor] = {}
        us = []
        for o, wi in zip(outs, w.tolist()):
            key = (o.token_ids[0], o.token_ids[1])
            if key not in cache:
                cache[key] = penalized_probs(small_engine, prompt, list(key), p)
            q = cache[key]
            t = o.token_ids[2]
            us.append(float(q[q > q[t]].sum() + wi * q[t]))
        bins = torch.bincount((torch.tensor(us) * 20).long().clamp(max=19), minlength=20)
        pv_third = chi2_pvalue(bins, torch.full((20,), 1 / 20))
        if expect == "pass":
            assert pv_pair > P_MIN, f"k={k}: (t1, t2) differs from the penalized target (p={pv_pair:.2e})"
            assert pv_third > P_MIN, f"k={k}: t3 differs from the penalized target (p={pv_third:.2e}): {bins}"
        else:
            assert min(pv_pair, pv_third) < 1e-6, "the test cannot tell the penalized from the plain target"


def test_greedy_with_penalties_equals_plain_on_a_model_that_repeats(small_engine) -> None:
    """On the 64-token model that likes repeats, a penalty's verdict on a draft's own repetition decides many
    tokens: penalized greedy output is still k = 0's for k = 1..4, and differs from the unpenalized output."""
    prompts = [[5, 35, 17, 8, 40, 9], [3, 3, 12], [60, 1, 22, 22, 7], [30]]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(max_tokens=40, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.7),
              SamplingParams(max_tokens=40, ignore_eos=True, frequency_penalty=1.5),
              SamplingParams(max_tokens=40, ignore_eos=True, repetition_penalty=1.3, presence_penalty=-0.5, min_tokens=30)]
    plain = [o.token_ids for o in run(small_engine, prompts, params, 0)]
    unpenalized = [o.token_ids for o in run(small_engine, prompts, SamplingParams(max_tokens=40, ignore_eos=True), 0)]
    assert all(a != b for a, b in zip(plain, unpenalized))
    for k in (1, 2, 3, 4):
        outs = run(small_engine, prompts, params, k)
        assert [o.token_ids for o in outs] == plain, f"k={k}"
        assert sum(o.stats.num_accepted_draft_tokens for o in outs) > 0


@pytest.mark.parametrize("prompt, stop, m", [([3, 3, 12], 40, 2), ([3, 3, 12], 40, 4), ([30], 16, 5), ([30], 41, 4)])
def test_min_tokens_lifts_its_ban_at_the_right_draft(small_engine, prompt, stop, m) -> None:
    """Cases where plain decoding emits the stop token at the first position min_tokens allows it (so the
    output is exactly min_tokens long): with drafts the ban must lift at the same verification row."""
    params = SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=(stop,), min_tokens=m)
    [plain] = run(small_engine, [prompt], params, 0)
    assert plain.finish_reason == "stop" and len(plain.token_ids) == m
    for k in (1, 2, 3, 4):
        [o] = run(small_engine, [prompt], params, k)
        assert (o.token_ids, o.finish_reason) == (plain.token_ids, "stop"), f"k={k}"


def test_preempted_requests_keep_penalties_logprobs_and_prompt_logprobs(shipped_engine, prompts) -> None:
    """A KV cache that holds one request at a time: requests are preempted and recomputed, and their penalized
    outputs, logprobs and prompt logprobs (computed once, not again on recompute) are those of a roomy cache."""
    import threading

    from executor_util import hold_inbox_until

    params = [SamplingParams(max_tokens=32, ignore_eos=True, logprobs=2, prompt_logprobs=1, repetition_penalty=1.3,
                             frequency_penalty=0.5),
              SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.7, seed=4, presence_penalty=1.0, logprobs=0)]
    params = [params[i % 2] for i in range(4)]
    roomy = run(shipped_engine, prompts[:4], params, 2)
    cfg = ExecutorConfig(num_draft_tokens=2, speculation="fixed", max_seq_len=MAX_SEQ_LEN, kv_cache_tokens=7 * 16)
    with Executor(shipped_engine, cfg) as ex:
        go = threading.Event()
        hold_inbox_until(ex, go)
        handles = [ex.submit(p, sp) for p, sp in zip(prompts[:4], params)]
        go.set()
        outs = [h.result(120) for h in handles]
        assert ex.scheduler.preemptions >= 2, "the test does not exercise preemption"
        assert_all_free(ex)
    for o, ref in zip(outs, roomy):
        assert_same_logprobs(o, ref, "preempted")
        assert (o.prompt_logprobs is None) == (ref.prompt_logprobs is None)
        if ref.prompt_logprobs is not None:
            assert len(o.prompt_logprobs) == len(ref.prompt_logprobs)
            assert [x.logprob for x in o.prompt_logprobs[1:]] == pytest.approx(
                [x.logprob for x in ref.prompt_logprobs[1:]], abs=TOL)


def test_cost_benchmark_smoke_run(tmp_path, monkeypatch) -> None:
    """benchmarks.sampling_features at its smoke settings writes its results, and logprobs left tokens alone."""
    import benchmarks.sampling_features as bench

    monkeypatch.setattr("sys.argv", ["sampling_features", "--quick", "--ks", "0,2", "--concurrency", "2",
                                     "--out_dir", str(tmp_path)])
    bench.main()
    res = json.loads((tmp_path / "sampling_features_quick.json").read_text())["results"]
    assert set(res) == {"k0_c2", "k2_c2"}
    for r in res.values():
        assert r["logprobs_keep_tokens"] and r["off"]["tpot_over_off"] == 1.0
        assert set(r) >= {"off", "logprobs", "penalties", "both", "logit_bias"}
    assert res["k2_c2"]["off"]["acceptance_rate"] > 0
    assert "| k | concurrency | setting |" in (tmp_path / "sampling_features_quick.md").read_text()
    monkeypatch.setattr("sys.argv", ["sampling_features", "--quick", "--ks", "0", "--concurrency", "1", "--settings",
                                     "off,logit_bias", "--name", "bias", "--out_dir", str(tmp_path)])
    bench.main()
    assert set(json.loads((tmp_path / "bias_quick.json").read_text())["results"]["k0_c1"]) == {"off", "logit_bias"}


def test_penalized_drafts_benchmark_smoke_run(tmp_path, monkeypatch) -> None:
    """benchmarks.penalized_drafts at its smoke settings: drafts without the penalties are really other drafts
    (another acceptance), and neither changes a penalized output, greedy or sampled with a seed (the target rows
    decide every token)."""
    import benchmarks.penalized_drafts as bench

    monkeypatch.setattr("sys.argv", ["penalized_drafts", "--quick", "--out_dir", str(tmp_path)])
    bench.main()
    res = json.loads((tmp_path / "penalized_drafts_quick.json").read_text())["results"]["k2"]
    greedy, sampled = res["greedy"], res["sampled"]
    assert greedy["penalized"]["output_equals_k0"] == greedy["unpenalized"]["output_equals_k0"] == 2
    assert sampled["penalized"]["output_equals_k0"] == sampled["unpenalized"]["output_equals_k0"] == 2
    assert greedy["penalized"]["draft_tokens"] > 0 and sampled["unpenalized"]["draft_tokens"] > 0
    assert greedy["penalized"]["acceptance_rate"] != greedy["unpenalized"]["acceptance_rate"]
    assert "| k | requests | drafts |" in (tmp_path / "penalized_drafts_quick.md").read_text()


def test_sampling_coupling_benchmark_smoke_run(tmp_path, monkeypatch) -> None:
    """benchmarks.sampling_coupling at its smoke settings: the race's outputs are plain decoding's, rejection
    sampling (the same seeds) draws other tokens, and both accept drafts."""
    import benchmarks.sampling_coupling as bench

    monkeypatch.setattr("sys.argv", ["sampling_coupling", "--quick", "--out_dir", str(tmp_path)])
    bench.main()
    res = json.loads((tmp_path / "sampling_coupling_quick.json").read_text())["results"]["T1.0_k2"]
    assert res["race"]["output_equals_k0"] == 2 and res["rejection"]["output_equals_k0"] < 2
    assert res["race"]["accepted_draft_tokens"] > 0 and res["rejection"]["accepted_draft_tokens"] > 0
    assert set(res["race_over_rejection"]) == {"acceptance", "tokens_per_step", "time_per_token"}
    assert "| temperature | k | coupling |" in (tmp_path / "sampling_coupling_quick.md").read_text()


# ---------------------------------------------------------------------------------------------
# Logit bias
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias, message", [
    ([(1, 2.0)], "logit_bias must be a dict of token id -> bias, got [(1, 2.0)]"),
    ({"5": 1.0}, "logit_bias keys must be integer token ids in [0, 129280), got ['5']"),
    ({129280: 1.0, -1: 2.0}, "logit_bias keys must be integer token ids in [0, 129280), got [129280, -1]"),
    ({True: 1.0}, "logit_bias keys must be integer token ids in [0, 129280), got [True]"),
    ({5: 100.5}, "logit_bias[5] must be a number in [-100, 100], got 100.5"),
    ({5: float("nan")}, "logit_bias[5] must be a number in [-100, 100], got nan"),
    ({5: "1"}, "logit_bias[5] must be a number in [-100, 100], got '1'"),
])
def test_logit_bias_is_refused_naming_what_is_wrong(bias, message) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(logit_bias=bias).validate(129280)
    assert str(e.value) == message


def test_logit_bias_is_copied_and_an_empty_one_is_none() -> None:
    given = {5: 1.0}
    params = SamplingParams(logit_bias=given)
    given[6] = 2.0
    assert params.logit_bias == {5: 1.0}
    assert SamplingParams(logit_bias={}).logit_bias is None and SamplingParams(logit_bias={}).plain_argmax
    assert not params.plain_argmax


def bias_params(plain: list[list[int]]) -> list[SamplingParams]:
    """A mixed batch over the unbiased greedy outputs `plain` of its prompts: biased greedy requests (one forcing a
    token, one moving its output off its course, one with penalties and bans on top), a plain greedy one and a seeded
    sampled biased one, with logprobs here and there (processed ones see the bias)."""
    return [SamplingParams(max_tokens=24, ignore_eos=True, logit_bias={100: 100.0}),
            SamplingParams(max_tokens=24, ignore_eos=True, logit_bias={plain[1][1]: -5.0, plain[1][4]: -2.5, 300: 3.0},
                           logprobs=2, logprobs_mode="processed_logprobs"),
            SamplingParams(max_tokens=24, ignore_eos=True, logit_bias={plain[2][0]: -8.0, plain[2][2]: -4.0, 300: 3.0},
                           repetition_penalty=1.4, frequency_penalty=0.5, bad_token_ids=(plain[2][5],)),
            SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1),
            SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=7, logit_bias={plain[4][0]: 6.0})]


@pytest.fixture(scope="module")
def plain_biased(shipped_engine, prompts):
    unbiased = run(shipped_engine, prompts[:5], SamplingParams(max_tokens=24, ignore_eos=True), 0)
    params = bias_params([o.token_ids for o in unbiased])
    return params, run(shipped_engine, prompts[:5], params, 0)


@pytest.mark.parametrize("alone", [False, True], ids=["batched", "alone"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_logit_bias_under_speculation_equals_plain(shipped_engine, prompts, plain_biased, k, alone) -> None:
    params, plain = plain_biased
    outs = run(shipped_engine, prompts[:5], params, k, alone=alone)
    for i, (o, ref) in enumerate(zip(outs, plain)):  # the seeded sampled one too: it races
        assert o.token_ids == ref.token_ids, f"k={k}, request {i}: biased output differs from k = 0"
        if ref.logprobs is not None:
            assert_same_logprobs(o, ref, f"k={k}, request {i}")
    assert sum(o.stats.num_accepted_draft_tokens for o in outs) > 0


def test_logit_bias_greedy_output_is_the_biased_argmax(shipped_engine, prompts, plain_biased) -> None:
    """Each biased greedy output is the argmax of dense logits + bias (then the penalties and bans) at every step,
    and differs from the output without the bias; a +100 bias forces its token; processed logprobs see the bias."""
    params, plain = plain_biased
    assert plain[0].token_ids == [100] * 24
    unbiased = run(shipped_engine, prompts[1:3], [replace(p, logit_bias=None) for p in params[1:3]], 0)
    for i, ref in zip((1, 2), unbiased):
        p, prompt, got = params[i], prompts[i], plain[i].token_ids
        assert got != ref.token_ids, f"request {i}: the bias changed nothing"
        out: list[int] = []
        while len(out) < len(got):
            x = dense_logits(shipped_engine, prompt + out)[-1].clone()
            for t, v in p.logit_bias.items():
                x[t] += v
            x = penalized_reference(x, prompt, out, p, set())
            x[list(p.bad_token_ids)] = float("-inf")
            if i == 1:
                lp = plain[i].logprobs[len(out)]
                assert lp.logprob == pytest.approx(float(x.log_softmax(-1)[got[len(out)]]), abs=1e-4)
            out.append(int(x.argmax()))
        assert out == got, f"request {i}"


BIAS = {8: -100.0, 35: 2.0, 12: 3.5, 40: 1.0}  # the likeliest next token out, three others up


@pytest.mark.parametrize("k", [0, 2, REJECTION])
def test_sampled_tokens_follow_the_biased_target(small_engine, k) -> None:
    """Over 2000 seeds on the 64-token model: the (first, second) pair follows the biased target
    softmax(logits + bias) (at k = 2 the second was decided by a verification row, drafted from the biased MTP
    distribution), and the unbiased target is rejected on the same samples."""
    prompt, n = [5, 35, 17, 8, 40, 9], 2000
    kd = 2 if k == REJECTION else k
    params = [SamplingParams(max_tokens=2, temperature=1.0, ignore_eos=True, seed=7000 + 100 * kd + s, logit_bias=BIAS)
              for s in range(n)]
    with pytest.MonkeyPatch.context() as mp:
        if k == REJECTION:
            seeded_requests_take_rejection_sampling(mp)
        outs = run(small_engine, [prompt] * n, params, kd)
    if kd:
        assert sum(o.stats.num_accepted_draft_tokens for o in outs) > 0.1 * sum(o.stats.num_draft_tokens for o in outs)
    pairs = Counter((o.token_ids[0], o.token_ids[1]) for o in outs)
    assert not any(8 in pair for pair in pairs), "a -100 bias did not ban its token"
    for biased, expect in ((True, "pass"), (False, "fail")):
        def probs(output: list[int]) -> torch.Tensor:
            x = dense_logits(small_engine, prompt + output)[-1].clone()
            if biased:
                x[list(BIAS)] += torch.tensor(list(BIAS.values()), dtype=x.dtype)
            return x.softmax(-1)
        p1 = probs([])
        firsts = sorted({a for a, _ in pairs})
        joint = torch.stack([p1[a] * probs([a]) for a in firsts]).flatten()
        counts = torch.zeros_like(joint)
        for (a, b), c in pairs.items():
            counts[firsts.index(a) * SMALL_V + b] = c
        pv = chi2_pvalue(counts, joint / joint.sum())
        if expect == "pass":
            assert pv > P_MIN, f"k={k}: (t1, t2) differs from the biased target (p={pv:.2e})"
        else:
            assert pv < 1e-6, f"k={k}: the test cannot tell the biased from the unbiased target (p={pv:.2e})"
