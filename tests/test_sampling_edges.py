"""Edge cases of sampling with and without MTP speculation, SamplingParams validation and the Session API,
on the shipped model in float32.

- Lossless: over many seeds, the first two tokens sampled with a fixed k (by the race seeded requests run, and by
  rejection sampling against the MTP's own temperature / top-k / top-p / bad-token distribution) follow the exact
  target distribution (chi-square, p > 1e-4), as k = 0 does; banned tokens never appear.
- Seeds: a seeded request repeats its output alone and in other batch compositions.
- Validation: every bad value raises ValueError with the message the code defines, and the
  executor keeps serving afterwards.
- Session: several prompts, streaming, stop strings inside multi-token steps, multi-byte text, finish
  reasons and statistics consistent with the emitted tokens.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from runtime import SamplingParams, Session
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.executors.outputs import RequestOutput
from runtime.executors.requests import RequestTracker
from runtime.core.sampling import SamplingTensors, probabilities
from runtime.io.tokenizer import IncrementalDetokenizer

from conftest import chi2_pvalue  # noqa: E402
from executor_util import assert_all_free, hold_inbox_until, seeded_requests_take_rejection_sampling  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

MAX_SEQ_LEN = 256
P_MIN = 1e-4
FIB = "def fibonacci(n):\n    "


# ---------------------------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def heldout(shipped_model_dir) -> list[str]:
    f = shipped_model_dir / "heldout_prompts.json"
    if not f.is_file():
        pytest.skip("no heldout_prompts.json next to the shipped model")
    return [r["text"] for r in json.loads(f.read_text())]


@pytest.fixture(scope="module")
def session(shipped_model_dir):
    with Session(shipped_model_dir, num_draft_tokens=3, dtype="float32", max_seq_len=MAX_SEQ_LEN) as s:
        yield s




def target_probs(shipped_engine, ids: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """Exact next-token distributions [len(ids), V] after temperature / top-k / top-p / bad tokens."""
    rows = []
    with torch.inference_mode():
        for p in ids:
            rows.append(shipped_engine.model.logits(shipped_engine.model(torch.tensor([p]))[0, -1]))
    return probs_under(torch.stack(rows), params)


def probs_under(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distributions [n, V] of logits [n, V] under one request's parameters (float64)."""
    n = logits.shape[0]
    logits = logits.float().index_fill(-1, torch.tensor(params.bad_token_ids, dtype=torch.long), float("-inf"))
    st = SamplingTensors(torch.full((n,), float(params.temperature)), torch.full((n,), params.top_k, dtype=torch.long),
                         torch.full((n,), float(params.top_p)), torch.full((n,), float(params.min_p)))
    return probabilities(logits, st).double()


def run(shipped_engine, prompts, params, k: int, **config) -> tuple[list[RequestOutput], object]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    cfg = ExecutorConfig(num_draft_tokens=k, speculation="fixed", max_seq_len=MAX_SEQ_LEN, **config)
    with Executor(shipped_engine, cfg) as ex:
        hs = [ex.submit(p, sp) for p, sp in zip(prompts, params)]
        outs = [h.result(120) for h in hs]
        stats = ex.stats()
        assert_all_free(ex)
    return outs, stats


# ---------------------------------------------------------------------------------------------
# Lossless sampling end to end: k = 0 and fixed k follow the same (exact) distribution
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fib_prompt(shipped_tokenizer) -> list[int]:
    return shipped_tokenizer.encode(FIB)


@pytest.fixture(scope="module")
def lossless_params(shipped_engine, fib_prompt) -> SamplingParams:
    """temperature 0.8, top_k 12, top_p 0.9, and the target's argmax at the first position banned
    (the MTP proposes it often, so a draft that ignores the ban would show)."""
    plain = target_probs(shipped_engine, [fib_prompt], SamplingParams(temperature=1.0))[0]
    banned = int(plain.argmax())
    return SamplingParams(max_tokens=2, temperature=0.8, top_k=12, top_p=0.9, bad_token_ids=(banned,),
                          ignore_eos=True)


N_SEEDS = 1500
REJECTION = "3-rejection"  # k = 3 with rejection sampling, which unseeded requests take


OTHER_PROMPT = "import numpy as np\n"


def other_params(seed: int) -> SamplingParams:
    """The sampled requests that share the k = 3 run's batches: other prompt, temperature, nucleus, min-p, and
    max_tokens 2 (so they draft 1 where the others draft 3)."""
    return SamplingParams(max_tokens=2, temperature=1.5, top_p=0.95, min_p=0.02, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module")
def lossless_runs(shipped_engine, shipped_tokenizer, fib_prompt, lossless_params):
    """k = 0: N_SEEDS requests of lossless_params. k = 3: the same requests (other seeds), with every
    other one followed by an `other_params` request and every sixth by a greedy request with bans, so
    that rows of one verification differ in k, parameters and greediness; seeded, they race. REJECTION: k = 3's
    run with rejection sampling (what unseeded requests take)."""
    runs = {}
    other_prompt = shipped_tokenizer.encode(OTHER_PROMPT)
    for run_name in (0, 3, REJECTION):
        k = 3 if run_name == REJECTION else run_name
        prompts, params, kinds = [], [], []
        for s in range(N_SEEDS):
            # at k = 3 four tokens, so that the first decode step really drafts 3 (drafts stop at max_tokens - 1)
            prompts.append(fib_prompt)
            params.append(SamplingParams(**{**lossless_params.__dict__, "seed": 10_000 * k + s,
                                            "max_tokens": 2 + 2 * (k > 0)}))
            kinds.append("main")
            if k and s % 2:
                prompts.append(other_prompt), params.append(other_params(50_000 + s)), kinds.append("other")
            if k and s % 6 == 0:
                prompts.append(other_prompt), kinds.append("greedy")
                params.append(SamplingParams(max_tokens=3, bad_token_ids=(5, 6), ignore_eos=True))
        with pytest.MonkeyPatch.context() as mp:
            if run_name == REJECTION:
                seeded_requests_take_rejection_sampling(mp)
            outs, stats = run(shipped_engine, prompts, params, k)
        runs[run_name] = ([o for o, kd in zip(outs, kinds) if kd == "main"], stats,
                   {kd: [o for o, kk in zip(outs, kinds) if kk == kd] for kd in ("other", "greedy")})
    return runs


@pytest.mark.parametrize("k", [0, 3, REJECTION])
def test_first_two_tokens_follow_the_target_with_top_k_top_p_temperature_and_a_ban(
        shipped_engine, fib_prompt, lossless_params, lossless_runs, k) -> None:
    """The first token and the (first, second) pair, sampled over 1500 seeds, follow the exact target
    distribution after temperature / top-k / top-p / bad tokens, at k = 0 and at a fixed k = 3, by the race and by
    rejection sampling (where both accepted drafts and residual samples decide them)."""
    outs, stats, _ = lossless_runs[k]
    banned = lossless_params.bad_token_ids[0]
    assert all(len(o.token_ids) == (4 if k else 2) for o in outs)
    assert all(banned not in o.token_ids for o in outs), "a banned token was emitted"
    if k:
        assert stats.draft_tokens >= 3 * N_SEEDS, "the first decode step did not draft 3"
        assert 0.05 * stats.draft_tokens < stats.accepted_draft_tokens < stats.draft_tokens, stats
    p1 = target_probs(shipped_engine, [fib_prompt], lossless_params)[0]
    first = torch.tensor([o.token_ids[0] for o in outs])
    counts1 = torch.bincount(first, minlength=p1.numel())
    pv1 = chi2_pvalue(counts1, p1)
    assert pv1 > P_MIN, f"k={k}: first-token distribution differs from the target (p={pv1:.2e})"
    # joint (t1, t2): p(t1) p(t2 | t1)
    uniq = first.unique().tolist()
    p2 = target_probs(shipped_engine, [fib_prompt + [t] for t in uniq], lossless_params)  # [U, V]
    joint = p1[uniq][:, None] * p2
    idx = {t: i for i, t in enumerate(uniq)}
    V = p1.numel()
    cells = torch.tensor([idx[o.token_ids[0]] * V + o.token_ids[1] for o in outs])
    counts = torch.bincount(cells, minlength=joint.numel()).double()
    expected = joint.flatten() / joint.sum()  # tokens t1 never drawn carry no mass here: renormalize
    pv2 = chi2_pvalue(counts, expected)
    assert pv2 > P_MIN, f"k={k}: (first, second) joint distribution differs from the target (p={pv2:.2e})"


def test_rows_sharing_the_batch_keep_their_own_distribution(shipped_engine, shipped_tokenizer, lossless_runs) -> None:
    """In the mixed k = 3 run: the other sampled requests' first token follows their own target
    (temperature 1.5, top_p 0.95, min_p 0.02, one draft), and the greedy ones with bans all equal the plain greedy
    output."""
    _, _, rest = lossless_runs[3]
    other_prompt = shipped_tokenizer.encode(OTHER_PROMPT)
    p1 = target_probs(shipped_engine, [other_prompt], other_params(0))[0]
    first = torch.tensor([o.token_ids[0] for o in rest["other"]])
    pv = chi2_pvalue(torch.bincount(first, minlength=p1.numel()), p1)
    assert pv > P_MIN, f"other rows' first token differs from their target (p={pv:.2e})"
    ref, _ = run(shipped_engine, [other_prompt], SamplingParams(max_tokens=3, bad_token_ids=(5, 6), ignore_eos=True), 0)
    assert all(o.token_ids == ref[0].token_ids for o in rest["greedy"])


def test_speculative_and_plain_samples_agree_two_sample(lossless_runs) -> None:
    """Two-sample chi-square on the first token: k = 3 vs k = 0 (independent seeds)."""
    a = torch.tensor([o.token_ids[0] for o in lossless_runs[0][0]])
    b = torch.tensor([o.token_ids[0] for o in lossless_runs[3][0]])
    V = int(max(a.max(), b.max())) + 1
    ca, cb = torch.bincount(a, minlength=V).double(), torch.bincount(b, minlength=V).double()
    tot = ca + cb
    keep = tot >= 10
    ca = torch.cat([ca[keep], ca[~keep].sum()[None]])
    cb = torch.cat([cb[keep], cb[~keep].sum()[None]])
    tot = ca + cb
    nz = tot > 0
    ca, cb, tot = ca[nz], cb[nz], tot[nz]
    n_a, n_b = ca.sum(), cb.sum()
    ea, eb = tot * n_a / (n_a + n_b), tot * n_b / (n_a + n_b)
    stat = (((ca - ea) ** 2) / ea + ((cb - eb) ** 2) / eb).sum()
    df = ca.numel() - 1
    pv = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))
    assert pv > P_MIN, f"k=3 and k=0 first tokens differ (p={pv:.2e})"


@pytest.mark.parametrize("k", [2, 3])
def test_greedy_with_bad_tokens_equals_plain_and_never_emits_them(shipped_engine, shipped_tokenizer, heldout, k) -> None:
    """Greedy with bad_token_ids: speculation changes nothing (token for token the k = 0 output with the
    same ban), and no banned token appears, although the unbanned output uses them."""
    prompts = [shipped_tokenizer.encode(t)[:24] for t in heldout[:3]]
    free, _ = run(shipped_engine, prompts, SamplingParams(max_tokens=24, ignore_eos=True), 0)
    banned = tuple(sorted({t for o in free for t in o.token_ids[:6]}))
    params = SamplingParams(max_tokens=24, ignore_eos=True, bad_token_ids=banned)
    plain, _ = run(shipped_engine, prompts, params, 0)
    spec, stats = run(shipped_engine, prompts, params, k)
    for o in plain + spec:
        assert not set(o.token_ids) & set(banned), "a banned token was emitted"
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats.accepted_draft_tokens > 0


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_drafts_never_propose_banned_tokens(shipped_engine, shipped_tokenizer, heldout, temperature) -> None:
    """Drafts come from the MTP distribution (greedy: its argmax) with the bans applied: record every
    draft the runner makes and check none is banned (a banned greedy draft would always be rejected). The general
    path's drafts: greedy steps run in one kernel call otherwise, which tests/test_speculative.py shows accepts the
    same drafts at every position as this path (with bans too)."""
    prompts = [shipped_tokenizer.encode(t)[:20] for t in heldout[3:6]]
    free, _ = run(shipped_engine, prompts, SamplingParams(max_tokens=16, ignore_eos=True), 0)
    banned = tuple(sorted({t for o in free for t in o.token_ids[:8]}))
    params = [SamplingParams(max_tokens=16, temperature=temperature, seed=s, bad_token_ids=banned, ignore_eos=True)
              for s in range(3)]
    cfg = ExecutorConfig(num_draft_tokens=3, speculation="fixed", max_seq_len=MAX_SEQ_LEN)
    proposed: list[int] = []
    with Executor(shipped_engine, cfg) as ex:
        draft = ex.runner.proposer.propose

        def recording(items):
            d, q = draft(items)
            for row, it in zip(d.tolist(), items):
                proposed.extend(row[: it.num_drafts])
            return d, q

        ex.runner.proposer.propose = recording
        ex.runner._in_one_call = lambda items: False
        outs = [h.result(60) for h in [ex.submit(p, sp) for p, sp in zip(prompts, params)]]
    assert proposed
    assert not set(proposed) & set(banned), "a banned token was drafted"
    for o in outs:
        assert not set(o.token_ids) & set(banned)


# ---------------------------------------------------------------------------------------------
# Seeded sampling: same output alone and in other batch compositions
# ---------------------------------------------------------------------------------------------
def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("k", [0, 2, 3])
def test_seeded_sampling_batched_equals_alone_with_bans_and_nucleus(shipped_engine, shipped_tokenizer, heldout, k) -> None:
    """A seed repeats the output (at every draft length: tests/test_speculative.py). A top-p / top-k / bad-token
    seeded request alone, twice in one batch, and beside greedy requests (with and without bans), other sampled
    requests and a request that joins mid-way."""
    ps = [shipped_tokenizer.encode(t)[:n] for t, n in zip(heldout[:4], (18, 30, 9, 25))]
    sp = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.85, top_k=40, seed=123,
                        bad_token_ids=(ps[1][3], 13), ignore_eos=True)
    other = SamplingParams(max_tokens=25, temperature=1.3, seed=7, ignore_eos=True)
    cfg = ExecutorConfig(num_draft_tokens=k, speculation="fixed", max_seq_len=MAX_SEQ_LEN)
    with Executor(shipped_engine, cfg) as ex:
        solo = ex.submit(ps[0], sp).result(60).token_ids
        solo_other = ex.submit(ps[3], other).result(60).token_ids
    with Executor(shipped_engine, cfg) as ex:
        later: list = []

        def join(o: RequestOutput) -> None:  # executor thread
            if len(o.token_ids) >= 4 and not later:
                later.append(ex.submit(ps[0], sp))

        go = threading.Event()
        hold_inbox_until(ex, go)
        hs = [ex.submit(ps[1], greedy(30), on_output=join), ex.submit(ps[0], sp),
              ex.submit(ps[2], greedy(12, bad_token_ids=(5, 6))), ex.submit(ps[3], other), ex.submit(ps[0], sp)]
        go.set()
        outs = [h.result(60).token_ids for h in hs]
        assert later
        outs.append(later[0].result(60).token_ids)
        assert_all_free(ex)
    assert outs[1] == solo, "seeded request changed beside other requests"
    assert outs[4] == solo, "the same seed twice in one batch gave another output"
    assert outs[5] == solo, "seeded request joining mid-way gave another output"
    assert outs[3] == solo_other


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
BAD_PARAMS = [
    (dict(seed=-1), "seed must be an integer in [0, 2^63), got -1"),
    (dict(seed=2**63), f"seed must be an integer in [0, 2^63), got {2**63}"),
    (dict(seed=1.5), "seed must be an integer in [0, 2^63), got 1.5"),
    (dict(seed=True), "seed must be an integer in [0, 2^63), got True"),
    (dict(seed="1"), "seed must be an integer in [0, 2^63), got '1'"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
    (dict(temperature=True), "temperature must be a finite number >= 0, got True"),
    (dict(top_p=float("nan")), "top_p must be in (0, 1], got nan"),
    (dict(top_p=-0.1), "top_p must be in (0, 1], got -0.1"),
    (dict(top_k=2.0), "top_k must be an integer >= 0, got 2.0"),
    (dict(top_k=None), "top_k must be an integer >= 0, got None"),
    (dict(max_tokens=1.0), "max_tokens must be an integer >= 1, got 1.0"),
    (dict(max_tokens=None), "max_tokens must be an integer >= 1, got None"),
    (dict(stop=""), "stop must be a list of non-empty strings, got ['']"),
    (dict(stop=[1]), "stop must be a list of non-empty strings, got [1]"),
    (dict(stop=["ok", b"x"]), "stop must be a list of non-empty strings, got ['ok', b'x']"),
    (dict(bad_token_ids=[-1]), "bad_token_ids must be token ids in [0, 4096), got [-1]"),
    (dict(bad_token_ids=[3, 4096, 9999]), "bad_token_ids must be token ids in [0, 4096), got [4096, 9999]"),
    (dict(bad_token_ids=5), "bad_token_ids must be a list of integer token ids, got 5"),
    (dict(bad_token_ids=[True]), "bad_token_ids must be a list of integer token ids, got [True]"),
    (dict(bad_token_ids=list(range(4096)) + [0]), "bad_token_ids bans all 4096 tokens; at least one must stay allowed"),
    (dict(stop_token_ids=[-2]), "stop_token_ids must be token ids in [0, 4096), got [-2]"),
    (dict(ignore_eos=1), "ignore_eos must be true or false, got 1"),
    (dict(logprobs=21), "logprobs must be None or an integer in [0, 20], got 21"),
    (dict(logprobs=-1), "logprobs must be None or an integer in [0, 20], got -1"),
    (dict(logprobs=True), "logprobs must be None or an integer in [0, 20], got True"),
    (dict(prompt_logprobs=2.0), "prompt_logprobs must be None or an integer in [0, 20], got 2.0"),
    (dict(logprobs_mode="raw"), "logprobs_mode must be 'raw_logprobs' or 'processed_logprobs', got 'raw'"),
    (dict(repetition_penalty=0), "repetition_penalty must be a number in [0.01, 100], got 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a number in [0.01, 100], got inf"),
    (dict(repetition_penalty=None), "repetition_penalty must be a number in [0.01, 100], got None"),
    # a logit divided by 1e-38 is inf in float32: the sampled distribution was NaN, and token 0 came out
    (dict(repetition_penalty=1e-38), "repetition_penalty must be a number in [0.01, 100], got 1e-38"),
    (dict(repetition_penalty=101), "repetition_penalty must be a number in [0.01, 100], got 101"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
    (dict(presence_penalty=float("nan")), "presence_penalty must be in [-2, 2], got nan"),
    (dict(frequency_penalty=-2.01), "frequency_penalty must be in [-2, 2], got -2.01"),
    (dict(frequency_penalty="1"), "frequency_penalty must be in [-2, 2], got '1'"),
    (dict(min_tokens=5), "min_tokens must be an integer in [0, max_tokens (4)], got 5"),
    (dict(min_tokens=-1), "min_tokens must be an integer in [0, max_tokens (4)], got -1"),
    (dict(min_tokens=1.0), "min_tokens must be an integer in [0, max_tokens (4)], got 1.0"),
]


def test_min_tokens_must_leave_a_token_allowed(validation_executor) -> None:
    """Before min_tokens is reached eos and the stop token ids are banned besides bad_token_ids: a request whose bans
    cover the vocabulary is refused (it came back with no token at all); with ignore_eos, eos is no stop and stays
    allowed."""
    ex, prompt, _ = validation_executor
    eos = ex.tokenizer.eos_token_id
    others = [t for t in range(4096) if t != eos]
    message = ("min_tokens 2 bans eos and stop_token_ids until it is reached; with bad_token_ids that bans all 4096 "
               "tokens: at least one must stay allowed")
    for kw in (dict(stop_token_ids=others), dict(stop_token_ids=others[:100], bad_token_ids=others[100:])):
        with pytest.raises(ValueError) as e:
            ex.submit(prompt, SamplingParams(max_tokens=4, min_tokens=2, **kw))
        assert str(e.value) == message
    out = ex.submit(prompt, SamplingParams(max_tokens=4, min_tokens=2, ignore_eos=True, stop_token_ids=others)).result(30)
    assert out.token_ids[:2] == [eos, eos]


@pytest.mark.parametrize("kw, message", BAD_PARAMS, ids=[str(i) for i in range(len(BAD_PARAMS))])
def test_invalid_params_exact_message_and_executor_keeps_serving(shipped_engine, kw, message, validation_executor) -> None:
    ex, prompt, ref = validation_executor
    with pytest.raises(ValueError) as e:
        ex.submit(prompt, SamplingParams(**{"max_tokens": 4, **kw}))
    assert str(e.value) == message
    out = ex.submit(prompt, SamplingParams(max_tokens=4, ignore_eos=True)).result(30)
    assert out.finish_reason == "length" and out.token_ids == ref
    assert_all_free(ex)


@pytest.fixture(scope="module")
def validation_executor(shipped_engine, fib_prompt):
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed", max_seq_len=MAX_SEQ_LEN)) as ex:
        ref = ex.submit(fib_prompt, SamplingParams(max_tokens=4, ignore_eos=True)).result(30).token_ids
        yield ex, fib_prompt, ref


def test_valid_edge_values_are_accepted(validation_executor) -> None:
    """The edges of the documented ranges are valid: seed 0 and 2^63 - 1 (numpy integers too, the same seed), top_p 1,
    top_k above the vocabulary, logprobs 0 and 20, penalties at their limits, min_tokens = max_tokens, bans of all
    tokens but one."""
    import numpy as np

    ex, prompt, _ = validation_executor
    for kw in (dict(seed=0, temperature=1.0), dict(seed=2**63 - 1, temperature=1.0),
               dict(seed=np.uint64(2**63 - 1), temperature=1.0), dict(top_k=10**6, temperature=1.0, seed=1),
               dict(top_p=1.0, temperature=0.5, seed=2), dict(logprobs=0, prompt_logprobs=20),
               dict(logprobs=20, logprobs_mode="processed_logprobs"), dict(repetition_penalty=0.01),
               dict(repetition_penalty=100),
               dict(presence_penalty=-2, frequency_penalty=2), dict(min_tokens=3)):
        out = ex.submit(prompt, SamplingParams(max_tokens=3, ignore_eos=True, **kw)).result(30)
        assert out.finish_reason == "length" and len(out.token_ids) == 3
    # a numpy seed is the same seed as the Python int (np.int64 + 1 overflowed, and % 2**63 of it was a float)
    for seed in (2**63 - 1, 2**60 + 1):
        outs = [ex.submit(prompt, SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=s, ignore_eos=True)).results(30)
                for s in (seed, np.int64(seed), np.uint64(seed))]
        assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[2]]
        assert len({tuple(o.token_ids) for o in outs[0]}) > 1  # each sequence its own seed
    # everything but one token banned: greedy and sampled both emit only that token
    keep = 77
    ban = [t for t in range(4096) if t != keep]
    for kw in (dict(), dict(temperature=1.0, seed=3, top_p=0.5)):
        out = ex.submit(prompt, SamplingParams(max_tokens=5, ignore_eos=True, bad_token_ids=ban, **kw)).result(30)
        assert out.token_ids == [keep] * 5


# ---------------------------------------------------------------------------------------------
# Session API
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts3(heldout) -> list[str]:
    return [heldout[0][:80], FIB, heldout[5][:60]]


@pytest.fixture(scope="module")
def session_ref(session, prompts3):
    """Greedy output of each prompt alone (48 tokens, eos ignored)."""
    return [session.generate(p, SamplingParams(max_tokens=48, ignore_eos=True))[0] for p in prompts3]


def test_generate_several_prompts_in_order_with_consistent_stats(session, prompts3, session_ref) -> None:
    outs = session.generate(prompts3, SamplingParams(max_tokens=48, ignore_eos=True))
    assert [o.prompt for o in outs] == prompts3
    for o, r in zip(outs, session_ref):
        assert o.token_ids == r.token_ids
        assert o.text == r.text == session.tokenizer.decode(o.token_ids)
        assert o.finish_reason == "length"
        s = o.stats
        assert s.output_tokens == len(o.token_ids) == 48
        assert s.prompt_tokens == len(session.tokenizer.encode(o.prompt))
        assert 0 <= s.num_accepted_draft_tokens <= s.num_draft_tokens
        assert s.num_draft_tokens <= 3 * s.num_steps
        # every step emits its accepted drafts plus one token
        assert s.output_tokens == s.num_steps + s.num_accepted_draft_tokens
        assert s.tokens_per_step == pytest.approx(48 / s.num_steps)
        assert s.ttft_s is not None and s.ttft_s >= 0 and s.tpot_s is not None and s.tpot_s >= 0
        assert s.queue_s is not None and 0 <= s.queue_s <= s.ttft_s
    assert sum(o.stats.num_accepted_draft_tokens for o in outs) > 0


def test_stats_after_stop_count_only_reported_tokens(session, prompts3, session_ref) -> None:
    """A stop token inside a multi-token step: output_tokens is the tokens reported, not the step's."""
    ref = session_ref[0].token_ids
    stop_id = ref[20]
    i = ref.index(stop_id)
    [o] = session.generate(prompts3[0], SamplingParams(max_tokens=48, ignore_eos=True, stop_token_ids=[stop_id]))
    assert o.finish_reason == "stop" and o.token_ids == ref[:i]
    assert o.stats.output_tokens == i
    assert o.text == session.tokenizer.decode(ref[:i])


def _texts(shipped_tokenizer, ids):
    detok = IncrementalDetokenizer(shipped_tokenizer)
    return [detok.push([t]) for t in ids]


@pytest.mark.parametrize("which", [0, 1, 2])
def test_stop_string_across_token_boundaries_generate_and_stream(session, prompts3, session_ref, which) -> None:
    """A stop string spanning two tokens, completed inside a speculative step: the text ends exactly
    before its first occurrence, the stream shows the same and never a part of it, reason 'stop', and
    token_ids end at the token that completes it."""
    ref = session_ref[which]
    texts = _texts(session.tokenizer, ref.token_ids)
    full = "".join(texts)
    assert full == ref.text
    # a stop string made of the last 2 chars of token i and the first 2 of token i + 1
    for i in range(6, len(texts) - 1):
        a, b = texts[i], texts[i + 1]
        if len(a) >= 2 and len(b) >= 2:
            stop = a[-2:] + b[:2]
            if stop.strip():
                break
    else:
        pytest.skip("no suitable token pair")
    first = full.index(stop)
    end = next(n for n in range(1, len(texts) + 1) if stop in "".join(texts[:n]))
    params = SamplingParams(max_tokens=48, ignore_eos=True, stop=[stop, "\x00zz"])
    [r] = session.generate(ref.prompt, params)
    assert r.finish_reason == "stop"
    assert r.text == full[:first]
    assert r.token_ids == ref.token_ids[:end]
    assert r.stats.output_tokens == end
    deltas = list(session.stream(ref.prompt, params))
    assert "".join(deltas) == full[:first]


MULTIBYTE = "naïve café — 日本語のテキスト 🎉🚀 Ωμέγα ok"


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 5])
def test_multibyte_text_in_multi_token_steps(shipped_tokenizer, chunk) -> None:
    """Several tokens per step (accepted drafts) of multi-byte text: every delta is whole characters
    (no U+FFFD), deltas join to the decoded text, and the token stream ends where one token per step
    ends, also with a stop string that is one multi-byte character."""
    ids = shipped_tokenizer.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE.split())  # multi-byte characters split over several tokens
    for params in (SamplingParams(max_tokens=200, ignore_eos=True),
                   SamplingParams(max_tokens=200, ignore_eos=True, stop=["語の"]),
                   SamplingParams(max_tokens=200, ignore_eos=True, stop=["🚀"])):
        tracker = RequestTracker.create("r", 3, params, shipped_tokenizer, handle=None)
        text, reason, kept_all = "", None, []
        for i in range(0, len(ids), chunk):
            kept, delta, reason = tracker.consume(ids[i: i + chunk], now=1.0)
            assert "\ufffd" not in delta
            delta.encode("utf-8")
            text += delta
            kept_all += kept
            if reason:
                break
        decoded = shipped_tokenizer.decode(ids)
        assert decoded == MULTIBYTE
        if params.stop:
            s = params.stop[0]
            assert reason == "stop" and text == decoded[: decoded.index(s)]
            end = next(n for n in range(1, len(ids) + 1) if s in shipped_tokenizer.decode(ids[:n]))
            assert kept_all == ids[:end]
        else:
            assert text == decoded and kept_all == ids


def test_finish_reasons(session, prompts3, session_ref) -> None:
    """'length' at max_tokens, 'stop' at a stop id, 'cancelled' when a stream is closed early."""
    [a] = session.generate(prompts3[1], SamplingParams(max_tokens=1, ignore_eos=True))
    assert a.finish_reason == "length" and a.token_ids == session_ref[1].token_ids[:1]
    assert a.stats.num_draft_tokens == 0
    [b] = session.generate(prompts3[1], SamplingParams(max_tokens=48, ignore_eos=True,
                                                       stop_token_ids=[session_ref[1].token_ids[0]]))
    assert b.finish_reason == "stop" and b.token_ids == [] and b.text == ""
    # a stop id that is also a bad token: never produced, so the request runs to length
    bad = session_ref[1].token_ids[0]
    [c] = session.generate(prompts3[1], SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=[bad],
                                                       bad_token_ids=[bad]))
    assert c.finish_reason == "length" and bad not in c.token_ids and len(c.token_ids) == 6
    # closed stream: the request is cancelled and its blocks freed (the cancel is in the inbox before the
    # next request, so once that one finishes the step loop has processed it)
    ex = session.executor
    gen = session.stream(prompts3[0], SamplingParams(max_tokens=200, ignore_eos=True))
    next(gen)
    gen.close()
    after = ex.submit(session.tokenizer.encode("x"), SamplingParams(max_tokens=1, ignore_eos=True)).result(30)
    assert after.finish_reason == "length"
    s = ex.stats()
    assert s.running == 0 and s.kv_blocks_used == 0, s


def test_seeded_session_streams_equal_generate(session, prompts3) -> None:
    """Seeded sampling at a fixed k: the streamed text equals generate's text for the same seed."""
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=99, ignore_eos=True)
    [g] = session.generate(prompts3[2], params)
    deltas = list(session.stream(prompts3[2], params))
    assert "".join(deltas) == g.text
    [g2] = session.generate([prompts3[2], prompts3[0]], params)[:1]
    assert g2.token_ids == g.token_ids


def test_length_flushes_text_held_for_a_stop_string_prefix(session, prompts3, session_ref) -> None:
    """Text held back because it could start a stop string is delivered when the request ends at
    max_tokens without the stop string completing (generate and stream)."""
    ref = session_ref[1]
    tail = ref.text[-3:]
    assert tail.strip(), "choose another prompt: the output ends in blanks"
    params = SamplingParams(max_tokens=48, ignore_eos=True, stop=[tail + "\x01\x02never"])
    [r] = session.generate(ref.prompt, params)
    assert r.finish_reason == "length" and r.text == ref.text and r.token_ids == ref.token_ids
    assert "".join(session.stream(ref.prompt, params)) == ref.text


def test_multibyte_output_end_to_end_with_accepted_drafts(session, shipped_tokenizer) -> None:
    """Output restricted (bad_token_ids) to the tokens of multi-byte text, sampled at k = 3 so that
    steps accept drafts: streamed deltas are whole characters on their own and join to the result's
    text, which is the decoded token ids; a multi-byte stop string cuts the text exactly before it."""
    allowed = set(shipped_tokenizer.encode("日本語のテキスト🎉🚀"))
    ban = [t for t in range(4096) if t not in allowed]
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=11, bad_token_ids=ban, ignore_eos=True)
    [g] = session.generate("こんにちは", params)
    assert set(g.token_ids) <= allowed
    assert g.stats.num_accepted_draft_tokens > 0, "no multi-token step"
    assert g.text == shipped_tokenizer.decode(g.token_ids)
    deltas = list(session.stream("こんにちは", params))
    assert "".join(deltas) == g.text
    for d in deltas:
        d.encode("utf-8")
    chars = [c for c in g.text if ord(c) > 0x7F and c != "\ufffd"]
    assert len(chars) >= 3, g.text
    stop = chars[2]
    [s] = session.generate("こんにちは", SamplingParams(**{**params.__dict__, "stop": (stop,)}))
    assert s.finish_reason == "stop" and s.text == g.text[: g.text.index(stop)]
    assert "".join(session.stream("こんにちは", SamplingParams(**{**params.__dict__, "stop": (stop,)}))) == s.text


def test_distinct_seeds_give_distinct_outputs(session) -> None:
    """Seeds differing only above bit 32 (1 and 2^32) draw different numbers: both halves of a seed are hashed."""
    def out(seed: int) -> list[int]:
        [r] = session.generate("def f(x):", SamplingParams(max_tokens=20, temperature=1.0, seed=seed, ignore_eos=True))
        return r.token_ids

    assert out(1) != out(2)  # the check has power for small seeds
    for a, b in [(1, 2**32), (0, 2**32 + 1), (7, (3 << 32) | (7 ^ 3))]:
        assert out(a) != out(b), f"seeds {a} and {b} gave the same output"


def test_huge_finite_temperature_with_bad_tokens_samples_the_allowed_tokens(session) -> None:
    """A finite temperature that overflows float32 (1e39 -> inf) keeps banned tokens out and samples the allowed ones
    (banned logits once became -inf / inf = NaN and every draw returned token 4095)."""
    outs = []
    for seed in range(3):
        [r] = session.generate("def f(x):", SamplingParams(max_tokens=8, temperature=1e39, seed=seed,
                                                           bad_token_ids=[5, 6], ignore_eos=True))
        assert r.finish_reason == "length" and not {5, 6} & set(r.token_ids)
        outs += r.token_ids
    # nearly uniform over 4094 tokens: 24 draws are not (almost) all one token
    assert len(set(outs)) > 12, f"huge temperature with a ban gave {outs}"


def test_huge_finite_temperature_keeps_the_top_k_tokens(session, shipped_engine, shipped_tokenizer) -> None:
    """At an infinite float32 temperature every scaled logit ties at 0: top-k still keeps the k most likely tokens."""
    p = shipped_tokenizer.encode("def f(x):")
    top5 = set(target_probs(shipped_engine, [p], SamplingParams(temperature=1.0, top_k=5))[0].nonzero().flatten().tolist())
    assert len(top5) == 5
    firsts = set()
    for seed in range(6):
        [r] = session.generate("def f(x):", SamplingParams(max_tokens=1, temperature=1e39, top_k=5, seed=seed,
                                                           ignore_eos=True))
        firsts.add(r.token_ids[0])
    assert firsts <= top5, f"top_k=5 at temperature 1e39 emitted {firsts - top5}, outside the top 5 {top5}"
    # the same with a large temperature that float32 holds: correct
    for seed in range(6):
        [r] = session.generate("def f(x):", SamplingParams(max_tokens=1, temperature=1e30, top_k=5, seed=seed,
                                                           ignore_eos=True))
        assert r.token_ids[0] in top5


def _cond_probs(shipped_engine, prefixes: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """target_probs for many prefixes of one length, in one batched forward per 500."""
    out = []
    with torch.inference_mode():
        for i in range(0, len(prefixes), 500):
            ids = torch.tensor(prefixes[i: i + 500])
            out.append(shipped_engine.model.logits(shipped_engine.model(ids)[:, -1]))
    return probs_under(torch.cat(out), params)


@pytest.mark.parametrize("j", [2, 3])
def test_third_and_fourth_tokens_follow_the_target_given_the_prefix(shipped_engine, fib_prompt, lossless_params,
                                                                    lossless_runs, j) -> None:
    """k = 3: token j (decided by draft 3, the bonus token or a later step) follows the target given the
    tokens before it: randomized probability integral transform (tokens ordered by probability) uniform."""
    outs, _, _ = lossless_runs[3]
    prefixes = [tuple(o.token_ids[:j]) for o in outs]
    uniq = sorted(set(prefixes))
    row = {p: i for i, p in enumerate(uniq)}
    cond = _cond_probs(shipped_engine, [fib_prompt + list(p) for p in uniq], lossless_params)
    cond = cond[torch.tensor([row[p] for p in prefixes])]
    tok = torch.tensor([o.token_ids[j] for o in outs])
    assert (cond.gather(1, tok[:, None]) > 0).all(), "a token outside the target's support was emitted"

    def pit(cond: torch.Tensor) -> float:
        sorted_p, order = cond.sort(-1, descending=True)
        rank = (order == tok[:, None]).float().argmax(-1)
        before = (sorted_p.cumsum(-1) - sorted_p).gather(1, rank[:, None]).squeeze(1)
        w = torch.rand(len(tok), generator=torch.Generator().manual_seed(j), dtype=torch.float64)
        u = before + w * cond.gather(1, tok[:, None]).squeeze(1)
        bins = torch.bincount((u * 10).long().clamp(max=9), minlength=10)
        return chi2_pvalue(bins, torch.full((10,), 0.1))

    pv = pit(cond)
    assert pv > P_MIN, f"token {j} is not distributed as the target given its prefix (p={pv:.2e})"


@pytest.mark.parametrize("k", [0, 2])
def test_tiny_top_p_keeps_the_most_likely_token(shipped_engine, fib_prompt, k) -> None:
    """A top_p below float32's least value (0 after conversion) keeps the most likely token, as 1e-6 does."""
    greedy_out, _ = run(shipped_engine, [fib_prompt], SamplingParams(max_tokens=8, ignore_eos=True), k)
    for tp in (1e-6, 1e-46, 1e-300):
        outs, _ = run(shipped_engine, [fib_prompt], SamplingParams(max_tokens=8, temperature=1.0, top_p=tp, seed=1,
                                                                   ignore_eos=True), k)
        assert outs[0].token_ids == greedy_out[0].token_ids, f"top_p={tp}"
