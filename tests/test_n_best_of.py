"""Several outputs per prompt (SamplingParams.n / best_of) on the native executor: each output is the output of a
single request seeded with seed + index, under MTP at every draft length; the prompt is prefilled once and its full
blocks are shared by the other sequences (their reused-block counts say so); best_of returns the n candidates with
the highest cumulative logprob; refusals name the parameter and submit nothing; every KV block comes back.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from runtime.core.sampling_params import SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.io.loading import load_engine

from executor_util import assert_all_free, run_fresh  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

BLOCK = 16  # the tiny checkpoint's kv_block_size
PROMPT = [random.Random(5).randrange(4, 4000) for _ in range(3 * BLOCK + 5)]  # 3 full blocks and a partial one
SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(spec_checkpoint):
    eng = load_engine(spec_checkpoint)
    assert eng.build.kv_block_size == BLOCK
    return eng


def executor(engine, k: int, **kw) -> Executor:
    return Executor(engine, ExecutorConfig(num_draft_tokens=k, speculation="fixed", max_seq_len=256,
                                           **kw))


def singles(engine, k: int, params: SamplingParams, count: int) -> list:
    """What single requests seeded seed + i give, alone on a fresh executor each."""
    return [run_fresh(engine, [PROMPT], replace(params, n=1, best_of=None, seed=params.seed + i), k)[0]
            for i in range(count)]


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_each_output_is_the_single_request_with_its_seed_and_the_prompt_is_shared(engine, k: int) -> None:
    n = 3
    with executor(engine, k) as ex:
        outs = ex.submit(PROMPT, replace(SAMPLED, n=n)).results(120)
        stats = ex.stats()
        assert_all_free(ex)
    refs = singles(engine, k, SAMPLED, n)
    assert [o.index for o in outs] == list(range(n))
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert [o.text for o in outs] == [r.text for r in refs]
    assert len({tuple(o.token_ids) for o in outs}) == n, "the outputs' seeds differ"
    if k:  # the same drafts: the shared blocks' MTP rows are those a single request computes
        assert [(o.stats.num_draft_tokens, o.stats.num_accepted_draft_tokens) for o in outs] == \
               [(r.stats.num_draft_tokens, r.stats.num_accepted_draft_tokens) for r in refs]
        assert all(o.stats.num_draft_tokens for o in outs)
    # the prompt was prefilled once: the others took its 3 full blocks (with their MTP rows) from the leader; each
    # output reports what its request found in the prefix cache (nothing: the prompt is new), as vLLM's
    # num_cached_tokens (an output other than the first reported the leader's blocks as cached)
    assert [o.stats.num_reused_blocks for o in outs] == [0] * n
    assert stats.kv_reused_blocks == 3 * (n - 1) and stats.requests_finished == 1


def test_best_of_reports_what_its_request_found_in_the_prefix_cache(engine) -> None:
    """best_of returns candidates other than the first sequence, which reported the blocks they took from it as found
    in the cache: `cached_tokens` of a prompt never seen was 16."""
    with executor(engine, 0) as ex:
        for seed in range(4):
            outs = ex.submit([seed + 4] + PROMPT, replace(SAMPLED, n=1, best_of=3, seed=seed)).results(120)
            assert [o.stats.num_reused_blocks for o in outs] == [0]
        again = ex.submit([4] + PROMPT, replace(SAMPLED, n=2, best_of=3, seed=0)).results(120)
        assert_all_free(ex)
    assert [o.stats.num_reused_blocks for o in again] == [3, 3]  # the first request's blocks, found by this one


def test_without_block_reuse_each_sequence_prefills_the_prompt(engine) -> None:
    with executor(engine, 2, enable_block_reuse=False) as ex:
        outs = ex.submit(PROMPT, replace(SAMPLED, n=2)).results(120)
        assert_all_free(ex)
    assert [o.stats.num_reused_blocks for o in outs] == [0, 0]
    assert [o.token_ids for o in outs] == [r.token_ids for r in singles(engine, 2, SAMPLED, 2)]


@pytest.mark.parametrize("logprobs", [None, 2])
def test_best_of_returns_the_n_candidates_with_the_highest_cumulative_logprob(engine, logprobs) -> None:
    params = replace(SAMPLED, n=2, best_of=4, logprobs=logprobs)
    with executor(engine, 3) as ex:
        handle = ex.submit(PROMPT, params)
        streamed = list(handle)  # nothing before the ranking: each chosen output once, whole
        outs = handle.results(120)
        assert_all_free(ex)
    candidates = singles(engine, 3, replace(params, logprobs=0), 4)
    ranked = sorted(candidates, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [o.token_ids for o in outs] == [c.token_ids for c in ranked[:2]]
    if logprobs is None:  # computed to rank the candidates, not asked for: None, as vLLM's
        assert [(o.logprobs, o.cumulative_logprob) for o in outs] == [(None, None)] * 2
    else:
        assert [o.cumulative_logprob for o in outs] == pytest.approx([c.cumulative_logprob for c in ranked[:2]],
                                                                     abs=1e-5)
    assert [o.index for o in outs] == [0, 1]
    assert [(o.index, o.text_delta, o.finished) for o in streamed] == [(0, outs[0].text, True), (1, outs[1].text, True)]


def test_streams_each_output_by_index_and_a_cancel_ends_them_all(engine) -> None:
    with executor(engine, 2) as ex:
        handle = ex.submit(PROMPT, replace(SAMPLED, n=2, max_tokens=20))
        texts = {0: "", 1: ""}
        finals = {}
        for out in handle:
            texts[out.index] += out.text_delta
            if out.finished:
                finals[out.index] = out
        assert {i: o.text for i, o in finals.items()} == texts and set(finals) == {0, 1}
        long = ex.submit(PROMPT, replace(SAMPLED, n=3, max_tokens=200))
        for out in long:
            if out.token_ids:
                break
        long.cancel()
        outs = long.results(120)
        assert [o.finish_reason for o in outs] == ["cancelled"] * 3
        assert_all_free(ex)


def test_prompt_logprobs_are_computed_once_and_reported_on_every_output(engine) -> None:
    params = replace(SAMPLED, n=2, prompt_logprobs=1)
    with executor(engine, 2) as ex:
        outs = ex.submit(PROMPT, params).results(120)
        reused = ex.stats().kv_reused_blocks
        assert_all_free(ex)
    [ref] = run_fresh(engine, [PROMPT], replace(params, n=1), 2)
    assert outs[0].prompt_logprobs == outs[1].prompt_logprobs == ref.prompt_logprobs
    assert reused == 3  # the second output took the prompt's blocks from the first


@pytest.mark.parametrize("params, message", [
    (replace(SAMPLED, n=0), "n must be an integer >= 1, got 0"),
    (replace(SAMPLED, n=2.0), "n must be an integer >= 1, got 2.0"),
    (replace(SAMPLED, n=3, best_of=2), "best_of must be None or an integer >= n (3), got 2"),
    (replace(SAMPLED, best_of=0), "best_of must be None or an integer >= n (1), got 0"),
    (SamplingParams(n=2), "n must be 1 when using greedy sampling (temperature 0), got 2"),
    (SamplingParams(best_of=3), "best_of must be 1 when using greedy sampling (temperature 0), got 3"),
    (replace(SAMPLED, n=5), "n 5 exceeds this executor's max_batch_size 4"),
    (replace(SAMPLED, n=2, best_of=6), "best_of 6 exceeds this executor's max_batch_size 4"),
])
def test_refusals_name_the_parameter_and_submit_nothing(engine, params: SamplingParams, message: str) -> None:
    with executor(engine, 0, max_batch_size=4) as ex:
        with pytest.raises(ValueError) as e:
            ex.submit(PROMPT, params)
        assert str(e.value).startswith(message), str(e.value)
        s = ex.stats()
        assert (s.running, s.queued, s.requests_finished) == (0, 0, 0)
        assert ex.submit(PROMPT, SAMPLED).result(120).finish_reason == "length"  # its id was not kept either
        assert_all_free(ex)


def test_a_handle_of_several_outputs_gives_them_by_results(engine) -> None:
    with executor(engine, 0) as ex:
        handle = ex.submit(PROMPT, replace(SAMPLED, n=2, max_tokens=2))
        with pytest.raises(ValueError, match=r"has 2 outputs \(n\); use results\(\)"):
            handle.result(120)
        assert len(handle.results(120)) == 2


def test_chunked_prefill_and_preemption_keep_each_output_exact(engine) -> None:
    """The prompt prefilled in chunks of 24 tokens and a KV pool too small for all four sequences at once (some wait
    or are preempted and recomputed): each output is still its single request's, and every block comes back."""
    params = replace(SAMPLED, n=4, max_tokens=40)
    with executor(engine, 0, max_num_tokens=24, kv_cache_tokens=12 * BLOCK) as ex:
        outs = ex.submit(PROMPT, params).results(300)
        preemptions = ex.scheduler.preemptions
        assert_all_free(ex)
    assert preemptions > 0, "the pool was meant to be too small for all four"
    assert [o.token_ids for o in outs] == [r.token_ids for r in singles(engine, 0, params, 4)]


def test_session_returns_each_prompts_outputs(spec_checkpoint) -> None:
    from runtime import Session

    with Session(spec_checkpoint, num_draft_tokens=2) as s:
        [one, two] = s.generate(["def fib(n):", "import os"], SamplingParams(max_tokens=6, temperature=1.0, seed=4,
                                                                               n=2, best_of=3))
        assert [o.index for o in one.outputs] == [0, 1] and len(two.outputs) == 2
        assert one.text == one.outputs[0].text and one.token_ids == one.outputs[0].token_ids
        assert (one.outputs[0].logprobs, one.outputs[0].cumulative_logprob) == (None, None)  # ranked by, not asked
        with pytest.raises(ValueError, match="n and best_of must be 1"):
            s.stream("x", SamplingParams(temperature=1.0, n=2))


def test_adaptive_speculation_serves_every_output_and_frees_every_block(engine) -> None:
    """Under adaptive speculation the first sequence's first decode step may not draft; the others are then
    admitted all the same (the prefix cache decides what they reuse) rather than waiting for MTP rows."""
    with Executor(engine, ExecutorConfig(num_draft_tokens=3, speculation="adaptive", max_seq_len=256)) as ex:
        outs = ex.submit(PROMPT, replace(SAMPLED, n=3, max_tokens=16)).results(120)
        assert_all_free(ex)
    assert [len(o.token_ids) for o in outs] == [16] * 3 and len({tuple(o.token_ids) for o in outs}) == 3


def test_one_factory_makes_a_requests_trackers_for_every_backend(engine) -> None:
    """Both executors built a request's trackers by patching each one's index, best_of, group and prompt logprobs
    from outside; RequestTracker.create_group makes them: output i at index i, best_of's candidates ranked together
    and computing logprobs to be ranked by, one prompt-logprobs list for all, and no reference cycle (with one, a
    Triton python model's stub crashed collecting a request's trackers at shutdown: tests/test_triton.py
    test_shutdown_after_serving_is_clean)."""
    import gc
    import weakref

    from runtime.executors.requests import RequestTracker
    from runtime.executors.trtllm import _Request
    from runtime.io.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(engine.path)
    params = SamplingParams(n=2, best_of=3, temperature=1.0, prompt_logprobs=1)
    group = RequestTracker.create_group("r", 4, params, params.num_sequences, tokenizer, handle=None)
    assert [t.index for t in group] == [0, 1, 2]
    assert group[0].best_of is not None and all(t.best_of is group[0].best_of for t in group)
    assert all(t.params == replace(params, logprobs=0) and t.logprobs == [] for t in group)
    assert group[0].prompt_logprobs == [None] and all(t.prompt_logprobs is group[0].prompt_logprobs for t in group)
    freed = weakref.ref(group[1])
    gc.disable()
    try:
        del group
        assert freed() is None  # by reference counting alone
    finally:
        gc.enable()
    n_only = _Request.create_group("r", 4, params, params.n, tokenizer, handle=None)  # upstream ranks best_of
    assert len(n_only) == 2 and n_only[0].best_of is None and n_only[0].params == params
    assert all(t.group is n_only for t in n_only) and n_only[1].prompt_logprobs is n_only[0].prompt_logprobs
