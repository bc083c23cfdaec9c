"""The in-flight batching executor: exactness under batching, chunked prefill, preemption, limits,
cancellation, streaming and statistics, and the adaptive draft-length policy.

Everything runs in float32 on CPU on a tiny random model whose MTP layer is a usable draft model
(conftest.bigram_tensors), so drafts are both accepted and rejected. Greedy outputs are compared
token for token with the same prompt decoded alone without speculation.
"""

from __future__ import annotations

import json
import re
import dataclasses
import logging
from types import SimpleNamespace
import pickle
import sys

import asyncio
import threading
import time

import pytest
import torch

from conftest import tiny_config_dict
from runtime.io.loading import load_engine
from runtime.executors.base import ExecutorConfig, submit_all
from runtime.executors.errors import QueueFull
from runtime.executors import native as native_executor
from runtime.executors import lifetime
from runtime.executors.native import Executor
from runtime.executors.handles import RequestHandle
from runtime.executors.outputs import RequestOutput, RequestStats
from runtime.core.kv_cache import free_memory_bytes
from runtime.core.sampling import TokenLogprob
from runtime.core.sampling_params import RelaxedAcceptance, SamplingParams
from runtime.core.draft_policy import DraftPolicy, StepCosts
from runtime.core.plan import StepResult
from runtime.core.scheduler import Scheduler

from executor_util import assert_all_free, hold_inbox_until  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

TEXTS = [
    "x",
    "def fib(n):",
    "In the beginning God created the heaven and the earth.",
    "import os\nimport sys\n\n\nclass Config:\n    \"\"\"Settings read from the environment.\"\"\"\n\n    def __init__(self):",
    "And the earth was without form, and void; and darkness was upon the face of the deep. And the Spirit of God "
    "moved upon the face of the waters. And God said, Let there be light: and there was light.",
    "    for key, value in sorted(items.items()):\n        if value is None:\n            continue\n",
    "Copyright (c) the authors. Permission is hereby granted, free of charge, to any person obtaining a copy",
    "for i in range(10):",
]
MAX_TOKENS = [16, 24, 12, 20, 24, 8, 16, 24]


@pytest.fixture(scope="module")
def engine(spec_checkpoint):
    return load_engine(spec_checkpoint)


@pytest.fixture(scope="module")
def tokenizer(engine):
    from runtime.io.tokenizer import Tokenizer

    return Tokenizer.from_dir(engine.path)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert len({len(i) for i in ids}) == len(ids), "prompt lengths should all differ"
    return ids


@pytest.fixture(scope="module")
def alone(engine, prompts):
    """Greedy output of each prompt decoded alone, without speculation."""
    out = []
    with Executor(engine, ExecutorConfig(num_draft_tokens=0, speculation="off")) as ex:
        for p, n in zip(prompts, MAX_TOKENS):
            r = ex.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)).result(60)
            assert len(r.token_ids) == n
            out.append(r.token_ids)
    return out


def wait_until(cond, timeout: float = 30.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.002)




# ---------------------------------------------------------------------------------------------
# Exactness under batching
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("speculation, k", [("fixed", 2), ("adaptive", 3), ("off", 0)])
def test_batched_staggered_equals_alone(engine, prompts, alone, speculation, k, monkeypatch) -> None:
    """Mixed prompt lengths and max_tokens, arriving in three waves while others decode, plus a
    sampled request in the batch: every greedy output equals the prompt decoded alone."""
    # adaptive: a batch limit of 4 makes later waves queue; step costs where drafting pays and no sequence
    # given up, so that the tiny model (whose MTP layer costs half a target step) drafts here
    limit = 4 if speculation == "adaptive" else None
    monkeypatch.setattr(native_executor, "profile_step_costs",
                        lambda runner, batch, max_k: costs(target_per_token=0.001, target_fixed=1.0, mtp=0.01))
    monkeypatch.setattr(Scheduler, "MTP_IDLE_LIMIT", 10**6)
    with Executor(engine, ExecutorConfig(num_draft_tokens=k, speculation=speculation, max_batch_size=limit)) as ex:
        greedy = lambda n: SamplingParams(max_tokens=n, ignore_eos=True)  # noqa: E731
        handles = {}
        for i in (0, 3, 4):
            handles[i] = ex.submit(prompts[i], greedy(MAX_TOKENS[i]))
        sampled = ex.submit(prompts[2], SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True))
        wait_until(lambda: ex.stats().generated_tokens >= 10, what="the first wave to decode")
        for i in (1, 2, 5):
            handles[i] = ex.submit(prompts[i], greedy(MAX_TOKENS[i]))
        wait_until(lambda: ex.stats().generated_tokens >= 40, what="the second wave to decode")
        for i in (6, 7):
            handles[i] = ex.submit(prompts[i], greedy(MAX_TOKENS[i]))
        outs = {i: h.result(60) for i, h in handles.items()}
        assert sampled.result(60).finish_reason == "length"
        for i, o in sorted(outs.items()):
            assert o.token_ids == alone[i], f"prompt {i} ({speculation}, k={k}) differs from its output alone"
            assert o.finish_reason == "length"
        stats = ex.stats()
        if k:
            assert stats.draft_tokens > 0 and stats.accepted_draft_tokens > 0, stats
        else:
            assert stats.draft_tokens == 0
        assert_all_free(ex)


def test_adaptive_reports_its_draft_length(engine, prompts) -> None:
    with Executor(engine, ExecutorConfig(num_draft_tokens=3, speculation="adaptive", max_batch_size=3)) as ex:
        costs = ex.policy.costs
        assert isinstance(costs, StepCosts) and costs.batch_sizes == [1, 2, 3]
        assert sorted(costs.target) == [1, 2, 3, 4]
        assert all(len(v) == len(costs.batch_sizes) and min(v) > 0 for v in costs.target.values())
        seen = set()
        h = ex.submit(prompts[3], SamplingParams(max_tokens=24, ignore_eos=True),
                      on_output=lambda o: seen.add(ex.stats().current_draft_len))
        h.result(60)
        assert seen <= {0, 1, 2, 3}
        assert_all_free(ex)


# ---------------------------------------------------------------------------------------------
# Chunked prefill
# ---------------------------------------------------------------------------------------------
def record_plans(ex: Executor) -> list[list[tuple[str, int, int]]]:
    """Wrap the runner so each step's plan [(request id, num_new, num_drafts)] is recorded."""
    plans: list[list[tuple[str, int, int]]] = []
    step = ex.runner.step

    def recording(items):
        plans.append([(it.seq.request_id, it.num_new, it.num_drafts) for it in items])
        return step(items)

    ex.runner.step = recording
    return plans


# a budget below k + 1 is refused (test_limits_above_the_engine_are_refused): (2, 3) is the tightest that runs
@pytest.mark.parametrize("k, budget", [(0, 8), (3, 8), (2, 3)])
def test_chunked_prefill_equals_one_shot(engine, prompts, alone, k, budget) -> None:
    long_ids = [4, 6]  # 60 and 36 tokens
    assert all(len(prompts[i]) > 4 * budget for i in long_ids)
    spec = "fixed"
    with Executor(engine, ExecutorConfig(num_draft_tokens=k, speculation=spec, max_num_tokens=budget)) as ex:
        plans = record_plans(ex)
        hs = {i: ex.submit(prompts[i], SamplingParams(max_tokens=MAX_TOKENS[i], ignore_eos=True)) for i in long_ids}
        outs = {i: h.result(60) for i, h in hs.items()}
        assert_all_free(ex)
    for i in long_ids:
        assert outs[i].token_ids == alone[i], f"prompt {i} with max_num_tokens={budget}, k={k}"
    assert all(sum(n for _, n, _ in plan) <= budget for plan in plans), "a step ran more tokens than max_num_tokens"
    prefill_steps = {rid: sum(1 for plan in plans for r, n, d in plan if r == rid and d == 0 and n > 1)
                     for rid in {h.request_id for h in hs.values()}}
    assert all(n >= 4 for n in prefill_steps.values()), f"prompts were not prefilled in chunks: {prefill_steps}"
    if k:
        assert max(d for plan in plans for _, _, d in plan) == min(k, budget - 1)


# ---------------------------------------------------------------------------------------------
# Preemption
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 2])
def test_preemption_with_tiny_kv_cache(engine, prompts, alone, k) -> None:
    """Room for little more than one sequence (8 blocks of 16): six greedy requests and a seeded
    sampled one still all finish with their own outputs, sequences really are preempted (and
    recomputed), and every block is free at the end."""
    ids = [1, 2, 3, 4, 6, 7]
    spec = "fixed"
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=9, ignore_eos=True)
    with Executor(engine, ExecutorConfig(num_draft_tokens=k, speculation=spec)) as ex:
        sampled_alone = ex.submit(prompts[5], sampled).result(30).token_ids
    with Executor(engine, ExecutorConfig(num_draft_tokens=k, speculation=spec, kv_cache_tokens=7 * 16)) as ex:
        assert ex.cache.allocator.num_blocks == 8
        need = max(len(prompts[i]) + MAX_TOKENS[i] + k for i in ids)
        assert need <= 7 * 16 < 2 * need, "the cache should hold one sequence but not two"
        preempted = []
        orig = ex.scheduler._preempt_latest

        def counting():
            victim = orig()
            preempted.append(victim.request_id)
            return victim

        ex.scheduler._preempt_latest = counting
        submitted = threading.Event()
        hold_inbox_until(ex, submitted)  # all compete for the cache (one done before the next arrives preempts none)
        hs = {i: ex.submit(prompts[i], SamplingParams(max_tokens=MAX_TOKENS[i], ignore_eos=True)) for i in ids}
        hs["sampled"] = ex.submit(prompts[5], sampled)
        submitted.set()
        outs = {i: h.result(120) for i, h in hs.items()}
        assert_all_free(ex)
    assert len(preempted) >= 2, "too little preemption: the test does not exercise it"
    for i in ids:
        assert outs[i].finish_reason == "length"
        assert outs[i].token_ids == alone[i], f"prompt {i} changed after preemption (k={k})"
    assert outs["sampled"].token_ids == sampled_alone, "a seeded sampled request changed with preemption"


def test_request_larger_than_kv_cache_does_not_hang(engine, prompts, caplog) -> None:
    """A request that can never fit in the KV cache (3 blocks of 16; prompt + max_tokens = 70)
    must be refused at submit or finish with an error; it must not spin forever. A cache that small is said at start
    (it loaded silently while the servers advertised max_seq_len)."""
    with caplog.at_level(logging.WARNING, logger="runtime.executors.native"), \
            Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed", kv_cache_tokens=32)) as ex:
        assert [r.getMessage() for r in caplog.records if "KV cache of" in r.getMessage()] == [
            f"a KV cache of 32 tokens holds less than one sequence of the {ex.limits.max_seq_len}-token context served "
            f"({ex.limits.max_seq_len + 2 + 16} tokens with the drafts and a block): a request that needs more is "
            "refused"]
        try:
            h = ex.submit(prompts[2], SamplingParams(max_tokens=70 - len(prompts[2]), ignore_eos=True))
        except ValueError:
            return
        try:
            out = h.result(8)
        except TimeoutError:
            pytest.fail(f"the request neither was refused nor finished: {ex.stats()}")
        assert out.finish_reason == "error"
        assert_all_free(ex)


def test_adaptive_with_small_kv_cache_starts(engine, prompts, alone) -> None:
    """Profiling for adaptive speculation must not need more KV blocks than the cache has."""
    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="adaptive", kv_cache_tokens=7 * 16)) as ex:
        out = ex.submit(prompts[3], SamplingParams(max_tokens=MAX_TOKENS[3], ignore_eos=True)).result(60)
        assert out.token_ids == alone[3]
        assert_all_free(ex)


# ---------------------------------------------------------------------------------------------
# Limits
# ---------------------------------------------------------------------------------------------
def test_limits_above_the_engine_are_refused(engine) -> None:
    """A built engine's limits are hard; a plain checkpoint's are defaults that a config may raise."""
    with Executor(engine, ExecutorConfig(max_batch_size=100, speculation="off")) as ex:
        assert ex.limits.max_batch_size == 100
    engine = dataclasses.replace(engine, built=True)
    path = engine.path
    with pytest.raises(ValueError) as e:
        Executor(engine, ExecutorConfig(max_batch_size=100, speculation="off"))
    assert str(e.value) == (f"max_batch_size 100 exceeds the engine's max_batch_size 8 ({path}); "
                            "rebuild the engine with --max_batch_size 100")
    with pytest.raises(ValueError, match=r"^max_seq_len 100000 exceeds the engine's max_seq_len 256 "):
        Executor(engine, ExecutorConfig(max_seq_len=100_000, speculation="off"))
    with pytest.raises(ValueError, match=r"^max_num_tokens 4096 exceeds the engine's max_num_tokens 2048 "):
        Executor(engine, ExecutorConfig(max_num_tokens=4096, speculation="off"))
    with pytest.raises(ValueError, match=r"^num_draft_tokens 5 exceeds the engine's max_draft_len 4 "):
        Executor(engine, ExecutorConfig(num_draft_tokens=5, speculation="fixed"))
    with pytest.raises(ValueError, match="speculation must be 'off', 'fixed' or 'adaptive', got 'always'"):
        Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="always"))
    # a step verifies k drafts and one more token of a sequence at once: a budget below that drafted less, silently
    with pytest.raises(ValueError, match=re.escape("num_draft_tokens 3 needs max_num_tokens >= 4 (a verification step "
                                                   "runs the drafts and one more token), got 2")):
        Executor(engine, ExecutorConfig(num_draft_tokens=3, max_num_tokens=2, speculation="fixed"))
    with Executor(engine, ExecutorConfig(max_num_tokens=2, speculation="fixed")) as ex:  # the default k fits it
        assert ex.policy.max_k == 1
    # drafting nothing is plain decoding whatever the mode (every caller used to spell this out)
    assert [ExecutorConfig(num_draft_tokens=0, speculation=mode).speculation for mode in ("fixed", "adaptive")] == [
        "off", "off"]
    assert ExecutorConfig(num_draft_tokens=None).speculation == "adaptive"


@pytest.mark.parametrize("config", [ExecutorConfig(num_draft_tokens=3, max_num_tokens=2),
                                    ExecutorConfig(llm_api_options={"max_batch_size": 2}),
                                    ExecutorConfig(relaxed_acceptance=RelaxedAcceptance())])
def test_settings_are_refused_before_a_weight_loads(shipped_model_dir, monkeypatch, config) -> None:
    """Refusals that need only config.json / engine.json come before loading (minutes on a full-size model) and are
    those make_model_repo's check_settings makes."""
    import runtime.executors.native as native
    from runtime.executors.backends import check_settings

    monkeypatch.setattr(native, "load_engine", lambda *a, **k: pytest.fail("weights loaded before the refusal"))
    with pytest.raises(ValueError) as refused:
        Executor(shipped_model_dir, config)
    with pytest.raises(ValueError) as checked:
        check_settings(shipped_model_dir, config)
    assert str(refused.value) == str(checked.value)


def test_one_executor_start_reads_engine_json_once(spec_checkpoint, tmp_path, monkeypatch) -> None:
    """create_executor read an engine's engine.json four times (its backend, the settings' check, the rank count, the
    load) and resolved the settings twice; it reads it once, resolves once and hands both on."""
    from builder.convert import convert_checkpoint
    from builder.native_engine import build_engine
    from runtime.executors.backends import create_executor
    from runtime.io.engine_format import BuildConfig, EngineManifest

    build = BuildConfig(max_seq_len=256)
    convert_checkpoint(spec_checkpoint, tmp_path / "ckpt", build, progress=False)
    path = build_engine(tmp_path / "ckpt", tmp_path / "engine", build, progress=False)
    reads, resolves = [], []
    read, resolve = EngineManifest.read.__func__, ExecutorConfig.resolve
    monkeypatch.setattr(EngineManifest, "read", classmethod(lambda cls, d: reads.append(d) or read(cls, d)))
    monkeypatch.setattr(ExecutorConfig, "resolve", lambda self, *a, **k: resolves.append(a) or resolve(self, *a, **k))
    with create_executor(path, ExecutorConfig(num_draft_tokens=2, speculation="fixed")) as ex:
        out = ex.submit([1, 2, 3], SamplingParams(max_tokens=4)).result()
    assert len(out.token_ids) == 4 and ex.policy.max_k == 2
    assert reads == [path] and len(resolves) == 1


def test_a_shut_down_executor_is_freed_by_reference_counting(engine) -> None:
    """No reference cycle holds an executor (its output processor kept the executor's own _finish): one left to the
    cycle collector is freed wherever that runs, a Triton python model's stub at shutdown included."""
    import gc
    import weakref

    ex = Executor(engine, ExecutorConfig(speculation="off"))
    ex.submit([1, 2, 3], SamplingParams(max_tokens=3, n=2, temperature=1.0)).results(60)
    ex.shutdown()
    freed = weakref.ref(ex)
    gc.disable()
    try:
        del ex
        assert freed() is None
    finally:
        gc.enable()


def test_a_bad_tokenizer_is_refused_before_a_weight_loads(shipped_model_dir, tmp_path, monkeypatch) -> None:
    """The tokenizer was read after the weights (minutes on a full-size model) had loaded."""
    import shutil

    import runtime.executors.native as native

    model = tmp_path / "model"
    shutil.copytree(shipped_model_dir, model)
    (model / "tokenizer.json").write_text("{")
    monkeypatch.setattr(native, "load_engine", lambda *a, **k: pytest.fail("weights loaded before the refusal"))
    with pytest.raises(ValueError, match=re.escape(f"cannot read tokenizer file {model / 'tokenizer.json'}")):
        Executor(model, ExecutorConfig(speculation="off"))


@pytest.mark.parametrize("speculation", ["fixed", "adaptive"])
def test_a_checkpoints_draft_length_is_bounded(shipped_model_dir, speculation) -> None:
    """A checkpoint has no max_draft_len of its own: num_draft_tokens 100000 was taken (adaptive speculation then
    profiled 100001 verify lengths at start, and dsv3-serve never came up); it is refused past the cap an engine's
    max_draft_len has."""
    with pytest.raises(ValueError) as e:
        Executor(shipped_model_dir, ExecutorConfig(num_draft_tokens=100_000, speculation=speculation))
    assert str(e.value) == f"num_draft_tokens 100000 exceeds 8, the most the MTP module is re-run for ({shipped_model_dir})"


def test_a_checkpoints_max_seq_len_is_bounded_by_its_positions(shipped_model_dir) -> None:
    """An engine's max_seq_len is checked against max_position_embeddings at build and load; a checkpoint opened
    directly took any max_seq_len and ran positions the model was never trained on."""
    with pytest.raises(ValueError) as e:
        Executor(shipped_model_dir, ExecutorConfig(max_seq_len=4096, num_draft_tokens=0))
    assert str(e.value) == f"max_seq_len 4096 exceeds max_position_embeddings (2048) of {shipped_model_dir}"


@pytest.mark.parametrize("field,value,message", [
    ("max_num_tokens", 0, "max_num_tokens must be an integer >= 1, got 0"),
    ("max_batch_size", 0, "max_batch_size must be an integer >= 1, got 0"),
    ("max_seq_len", 2.5, "max_seq_len must be an integer >= 2, got 2.5"),
    ("max_seq_len", 1, "max_seq_len must be an integer >= 2, got 1"),
    ("kv_cache_tokens", -16, "kv_cache_tokens must be an integer >= 1, got -16"),
    ("num_draft_tokens", -1, "num_draft_tokens must be an integer >= 0, got -1"),
])
def test_config_values_are_checked(field, value, message) -> None:
    """A zero limit would leave every request waiting forever: refused when the config is made."""
    with pytest.raises(ValueError) as e:
        ExecutorConfig(**{field: value})
    assert str(e.value) == message


def test_drafts_need_no_kv_room_past_max_tokens(engine, prompts, alone) -> None:
    """Drafts stop at max_tokens - 1, so a cache that holds prompt + max_tokens serves k = 4 too."""
    prompt = prompts[3]
    blocks = -(-(len(prompt) + 1) // 16)
    n = blocks * 16 - len(prompt)  # prompt + max_tokens fills `blocks` blocks exactly
    assert 1 <= n <= MAX_TOKENS[3]
    config = ExecutorConfig(num_draft_tokens=4, speculation="fixed", kv_cache_tokens=(blocks - 1) * 16)
    with Executor(engine, config) as ex:
        assert ex.cache.allocator.num_blocks == blocks
        out = ex.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True)).result(60)
        assert out.token_ids == alone[3][:n]
        assert out.stats.num_draft_tokens > 0
        assert_all_free(ex)


def test_max_batch_size_respected(engine, prompts) -> None:
    limit = 2
    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed", max_batch_size=limit)) as ex:
        running, queued = [], []

        def on_output(o: RequestOutput) -> None:  # runs on the executor thread, between steps
            s = ex.stats()
            running.append(s.running)
            queued.append(s.queued)
            assert s.kv_blocks_used + s.kv_blocks_free == ex.cache.allocator.num_blocks

        submitted = threading.Event()
        hold_inbox_until(ex, submitted)  # else a slow submitter could leave nothing queued, or one request running
        hs = [ex.submit(p, SamplingParams(max_tokens=12, ignore_eos=True), on_output=on_output) for p in prompts[:6]]
        submitted.set()
        outs = [h.result(60) for h in hs]
        assert_all_free(ex)
    assert all(len(o.token_ids) == 12 for o in outs)
    assert max(running) == limit, f"never ran {limit} at once: {running}"
    assert max(queued) > 0
    assert ex.stats().requests_finished == 6


def test_an_output_callback_that_waits_on_a_handle_is_refused(engine, prompts) -> None:
    """A callback runs on the thread that delivers outputs: waiting there for a result or the next output would
    wait forever, and stalled every request of the executor. It is refused at once (the callback's own error is
    logged), and the requests go on."""
    handles: dict[str, RequestHandle] = {}
    errors: list[str] = []

    def on_output(o: RequestOutput) -> None:
        for wait in (lambda: handles["waiting"].result(30), lambda: next(iter(handles["waiting"]))):
            try:
                wait()
            except RuntimeError as e:
                errors.append(str(e))

    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed")) as ex:
        submitted = threading.Event()
        hold_inbox_until(ex, submitted)
        handles["waiting"] = ex.submit(prompts[0], SamplingParams(max_tokens=6, ignore_eos=True), on_output=on_output)
        other = ex.submit(prompts[1], SamplingParams(max_tokens=6, ignore_eos=True))
        submitted.set()
        assert other.result(30).finish_reason == handles["waiting"].result(30).finish_reason == "length"
        rid = handles["waiting"].request_id
        assert errors and set(errors) == {
            f"results() of request {rid} cannot wait on the thread that delivers outputs (an output callback): it "
            "would wait forever; wait from another thread",
            f"iterating the outputs of request {rid} cannot wait on the thread that delivers outputs (an output "
            "callback): it would wait forever; wait from another thread"}


# ---------------------------------------------------------------------------------------------
# Cancellation
# ---------------------------------------------------------------------------------------------
def test_cancel_frees_blocks_at_once(engine, prompts) -> None:
    """The step loop is held (in the output callback, then before the model step) wherever a slow test
    thread would let a request run to max_tokens before the test looks or cancels."""
    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed")) as ex:
        submitted, started, cancelled, steps = (threading.Event() for _ in range(4))
        hold_inbox_until(ex, submitted)  # both decode from the same step on
        steps.set()
        step = ex.runner.step

        def gated_step(items):
            steps.wait(30)
            return step(items)

        ex.runner.step = gated_step
        at_finish = {}

        def on_output(o: RequestOutput) -> None:  # executor thread
            if len(o.token_ids) >= 5 and not started.is_set():
                steps.clear()  # no step after the cancel until the test has seen `other` unfinished
                started.set()
                cancelled.wait(30)
            if o.finished:  # the request's blocks must already be back
                at_finish["used"] = ex.stats().kv_blocks_used
                at_finish["held_by_running"] = sum(len(s.block_table) for s in ex.scheduler.running)
                at_finish["running"] = [s.request_id for s in ex.scheduler.running]

        other = ex.submit(prompts[1], SamplingParams(max_tokens=150, ignore_eos=True))
        h = ex.submit(prompts[4], SamplingParams(max_tokens=150, ignore_eos=True), on_output=on_output)
        submitted.set()
        assert started.wait(30)
        assert ex.stats().kv_blocks_used >= ex.cache.blocks_for(len(prompts[4]) + 5)
        h.cancel()
        cancelled.set()
        out = h.result(10)
        assert out.finished and out.finish_reason == "cancelled"
        assert 5 <= len(out.token_ids) < 150
        assert at_finish["running"] == [other.request_id]
        assert at_finish["used"] == at_finish["held_by_running"], at_finish
        assert not other.finished, "the other request should still be running"
        steps.set()
        assert len(other.result(60).token_ids) == 150
        assert_all_free(ex)

        # alone: blocks drop to zero as soon as the cancelled handle finishes
        decoding, cancelled = threading.Event(), threading.Event()

        def pause(o: RequestOutput) -> None:  # executor thread: no step until the test has cancelled
            if len(o.token_ids) >= 5 and not decoding.is_set():
                decoding.set()
                cancelled.wait(30)

        h = ex.submit(prompts[4], SamplingParams(max_tokens=150, ignore_eos=True), on_output=pause)
        assert decoding.wait(30)
        assert ex.stats().kv_blocks_used > 0
        h.cancel()
        cancelled.set()
        assert h.result(10).finish_reason == "cancelled"
        assert ex.stats().kv_blocks_used == 0


def test_cancelled_request_text_covers_its_tokens(engine, prompts, tokenizer) -> None:
    """With stop strings, text that could start one is held back; a request cancelled meanwhile
    still reports it: its final text is the text of its tokens."""
    decoding, cancelled = threading.Event(), threading.Event()

    def pause(o: RequestOutput) -> None:  # executor thread: no step until the test has cancelled
        if len(o.token_ids) >= 6 and not decoding.is_set():
            decoding.set()
            cancelled.wait(30)

    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed")) as ex:
        h = ex.submit(prompts[4], SamplingParams(max_tokens=190, ignore_eos=True, stop=("\x00never stop here\x00",)),
                      on_output=pause)
        assert decoding.wait(30)
        h.cancel()
        cancelled.set()
        out = h.result(10)
        assert out.finish_reason == "cancelled" and len(out.token_ids) >= 6
        assert out.text == tokenizer.decode(out.token_ids)
        assert_all_free(ex)


def test_cancel_queued_and_unknown_requests(engine, prompts) -> None:
    started, cancelled = threading.Event(), threading.Event()

    def pause(o: RequestOutput) -> None:  # executor thread: the first request holds the only slot until the cancel
        if not started.is_set():
            started.set()
            cancelled.wait(30)

    with Executor(engine, ExecutorConfig(num_draft_tokens=0, speculation="off", max_batch_size=1)) as ex:
        first = ex.submit(prompts[1], SamplingParams(max_tokens=40, ignore_eos=True), on_output=pause)
        queued = ex.submit(prompts[2], SamplingParams(max_tokens=40, ignore_eos=True))
        assert started.wait(30)
        queued.cancel()
        cancelled.set()
        out = queued.result(10)
        assert out.finish_reason == "cancelled" and out.token_ids == []
        ex.cancel("no-such-request")  # ignored
        assert first.result(60).finish_reason == "length"
        assert_all_free(ex)


def test_a_finished_requests_handle_does_not_cancel_a_later_one_with_its_id(engine, prompts) -> None:
    with Executor(engine, ExecutorConfig(num_draft_tokens=0, speculation="off")) as ex:
        old = ex.submit(prompts[0], SamplingParams(max_tokens=2, ignore_eos=True), request_id="reused")
        assert old.result(30).finish_reason == "length"
        new = ex.submit(prompts[1], SamplingParams(max_tokens=30, ignore_eos=True), request_id="reused")
        old.cancel()
        assert new.result(60).finish_reason == "length"
        started, cancelled = threading.Event(), threading.Event()

        def pause(o: RequestOutput) -> None:  # executor thread: no step until the test has cancelled
            if not started.is_set():
                started.set()
                cancelled.wait(30)

        again = ex.submit(prompts[2], SamplingParams(max_tokens=200, ignore_eos=True), request_id="reused",
                          on_output=pause)
        assert started.wait(30) and ex.stats().running == 1
        ex.cancel("reused")  # by id: whatever is in flight with it
        cancelled.set()
        assert again.result(30).finish_reason == "cancelled"
        assert_all_free(ex)


def test_shutdown_cancels_unfinished(engine, prompts) -> None:
    ex = Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed"))
    decoding = threading.Event()

    def pause(o: RequestOutput) -> None:  # executor thread: no step until shutdown began, however late that is
        if len(o.token_ids) >= 3 and not decoding.is_set():
            decoding.set()
            wait_until(lambda: ex._stopping, what="shutdown")

    h = ex.submit(prompts[4], SamplingParams(max_tokens=190, ignore_eos=True), on_output=pause)
    assert decoding.wait(30)
    ex.shutdown()
    assert h.result(5).finish_reason == "cancelled"
    with pytest.raises(RuntimeError, match="executor is shut down"):
        ex.submit(prompts[0], SamplingParams())


def test_shutdown_right_after_submit_loses_no_request(engine, prompts) -> None:
    """Requests still in the inbox when shutdown starts are cancelled, never left unfinished."""
    for _ in range(3):
        ex = Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed"))
        handles = [ex.submit(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts[:3]]
        ex.shutdown()
        for h in handles:
            assert h.result(5).finish_reason in ("cancelled", "length")
        assert_all_free(ex)


# ---------------------------------------------------------------------------------------------
# Streaming and statistics
# ---------------------------------------------------------------------------------------------
def check_stream(outs: list[RequestOutput], tokenizer) -> None:
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    final = outs[-1]
    assert "".join(o.text_delta for o in outs) == final.text
    text = ""
    ids: list[int] = []
    for o in outs:
        text += o.text_delta
        ids += o.new_token_ids
        assert o.text == text, "RequestOutput.text is not the concatenation of the deltas so far"
        assert o.token_ids == ids
        o.text_delta.encode("utf-8")  # no lone surrogates
    assert final.text == tokenizer.decode(final.token_ids)


def test_streaming_callback_and_stats(engine, prompts, tokenizer) -> None:
    with Executor(engine, ExecutorConfig(num_draft_tokens=3, speculation="fixed")) as ex:
        streams: dict[str, list[RequestOutput]] = {}
        lock = threading.Lock()

        def on_output(o: RequestOutput) -> None:
            with lock:
                streams.setdefault(o.request_id, []).append(o)

        params = [SamplingParams(max_tokens=20, ignore_eos=True),
                  SamplingParams(max_tokens=20, temperature=0.8, top_k=50, seed=1, ignore_eos=True),
                  SamplingParams(max_tokens=15, ignore_eos=True)]
        hs = [ex.submit(p, sp, on_output=on_output) for p, sp in zip(prompts[1:4], params)]
        finals = [h.result(60) for h in hs]
        stats = ex.stats()
    for h, final in zip(hs, finals):
        outs = streams[h.request_id]
        assert outs[-1] is final or outs[-1] == final
        check_stream(outs, tokenizer)
        st = final.stats
        assert st.output_tokens == len(final.token_ids)
        assert st.prompt_tokens == len(prompts[1 + hs.index(h)])
        assert 0 < st.num_steps <= st.output_tokens
        assert st.num_accepted_draft_tokens <= st.num_draft_tokens
        assert st.acceptance_rate == pytest.approx(st.num_accepted_draft_tokens / st.num_draft_tokens)
        assert st.tokens_per_step == pytest.approx(st.output_tokens / st.num_steps)
        assert st.ttft_s is not None and st.ttft_s > 0 and st.tpot_s is not None and st.tpot_s > 0
    assert stats.requests_finished == 3
    assert stats.generated_tokens == sum(len(f.token_ids) for f in finals)
    assert stats.draft_tokens == sum(f.stats.num_draft_tokens for f in finals)
    assert stats.accepted_draft_tokens == sum(f.stats.num_accepted_draft_tokens for f in finals)
    assert stats.acceptance_rate == pytest.approx(stats.accepted_draft_tokens / stats.draft_tokens)
    assert stats.current_draft_len == 3
    # each step emits 1..k+1 tokens: steps >= tokens / 4, and drafting helped at least once
    assert sum(f.stats.num_steps for f in finals) < stats.generated_tokens


def test_streamed_outputs_share_the_tokens_so_far(engine, prompts, tokenizer) -> None:
    """Each output's token_ids and logprobs (all so far) are views of the request's lists, not copies: a stream
    of n outputs costs O(n), not O(n^2), and an output kept keeps what it had when it was reported."""
    with Executor(engine, ExecutorConfig(num_draft_tokens=0, speculation="off")) as ex:
        outs: list[RequestOutput] = []
        sp = SamplingParams(max_tokens=200, ignore_eos=True, logprobs=1)
        final = ex.submit(prompts[3], sp, on_output=outs.append).result(60)
    assert len(outs) == 200 and outs[-1] is final
    check_stream(outs, tokenizer)
    assert [list(o.logprobs) for o in outs] == [final.logprobs[: i + 1] for i in range(200)]
    # a copy of every token so far would take 8 bytes a token: 200 outputs, 200 * 201 / 2 tokens in all
    held = sum(sys.getsizeof(o.token_ids) + sys.getsizeof(o.logprobs) for o in outs[:-1])
    assert held < 200 * 200, f"{held} bytes held by 199 outputs' token_ids and logprobs"
    mid = outs[99]
    assert mid.token_ids == final.token_ids[:100] and mid.token_ids[-1] == final.token_ids[99]
    assert mid.token_ids[98:] == final.token_ids[98:100] and mid.token_ids + [7] == final.token_ids[:100] + [7]
    assert pickle.loads(pickle.dumps(mid)).token_ids == final.token_ids[:100]
    with pytest.raises(IndexError):
        mid.token_ids[100]


def test_blocking_and_async_iteration(engine, prompts, tokenizer) -> None:
    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed")) as ex:
        sp = SamplingParams(max_tokens=18, ignore_eos=True)
        blocking = list(ex.submit(prompts[3], sp))
        check_stream(blocking, tokenizer)

        async def collect(handle):
            return [o async for o in handle]

        async def main():
            handles = [ex.submit(prompts[3], sp), ex.submit(prompts[5], sp)]
            return await asyncio.gather(*(collect(h) for h in handles))

        a, b = asyncio.run(main())
        check_stream(a, tokenizer)
        check_stream(b, tokenizer)
        assert a[-1].token_ids == blocking[-1].token_ids
        assert len(b[-1].token_ids) == 18
        assert_all_free(ex)


def test_outputs_not_collected_yet_are_merged(engine, prompts, tokenizer) -> None:
    """A consumer that only waits for the result leaves the handle holding one merged output, not one per
    step with a copy of every token so far; iterating afterwards hands out that one output, whose deltas are
    the whole text. result() is the last step's output."""
    with Executor(engine, ExecutorConfig(num_draft_tokens=0, speculation="off")) as ex:
        h = ex.submit(prompts[3], SamplingParams(max_tokens=30, ignore_eos=True))
        final = h.result(60)
        assert len(final.new_token_ids) == 1 and len(final.token_ids) == 30  # plain decoding: a token per step
        outs = list(h)
        assert len(outs) == 1 and outs[0].new_token_ids == final.token_ids and outs[0].text_delta == final.text
        check_stream(outs, tokenizer)
        assert list(h) == []  # delivered


def test_unread_outputs_are_gathered_in_place() -> None:
    """Outputs no consumer has taken yet are gathered into lists the handle appends each one's tokens, text and
    logprobs to (joining them at every arrival copied everything unread each time: O(n^2) for a consumer that only
    waits for the result); taking them gives one output with all of it and the newest's other fields."""
    h = RequestHandle("r", executor=None)
    stats = RequestStats(3, 0, 0, 0, 0, None, None)
    lp = [TokenLogprob(t, -0.5, 1, ()) for t in range(300)]
    outs = [RequestOutput("r", [t], list(range(t + 1)), f"<{t}>", "", t == 299, "length" if t == 299 else None,
                          stats, new_logprobs=lp[t:t + 1]) for t in range(300)]
    h._push(outs[0])
    h._push(outs[1])
    gathered = h._pending[0].gathered
    for o in outs[2:]:
        h._push(o)
    assert h._pending[0].gathered is gathered and all(o.new_token_ids == [t] for t, o in enumerate(outs))
    [merged] = list(h)
    assert merged.new_token_ids == list(range(300)) and merged.text_delta == "".join(f"<{t}>" for t in range(300))
    assert merged.new_logprobs == lp and merged.finished and merged.token_ids == outs[-1].token_ids
    assert h.result(0) is outs[-1]


def test_async_iteration_survives_a_cancelled_wait(engine, prompts, tokenizer) -> None:
    """A timeout while awaiting the next output (asyncio.wait_for) must not swallow that output nor
    end the iterator: the same iterator carries on where the cancelled wait stopped."""
    timed_out = threading.Event()

    def pause(o: RequestOutput) -> None:  # executor thread: `h` gets no output before a wait timed out
        timed_out.wait(30)

    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed", max_batch_size=1)) as ex:
        first = ex.submit(prompts[4], SamplingParams(max_tokens=24, ignore_eos=True), on_output=pause)
        h = ex.submit(prompts[3], SamplingParams(max_tokens=12, ignore_eos=True))  # waits behind the first

        async def main():
            it, outs, timeouts = aiter(h), [], 0
            while True:
                try:
                    outs.append(await asyncio.wait_for(anext(it), 0.001))
                except asyncio.TimeoutError:
                    timeouts += 1
                    timed_out.set()
                except StopAsyncIteration:
                    return outs, timeouts

        outs, timeouts = asyncio.run(main())
        assert timeouts > 0
        check_stream(outs, tokenizer)
        assert len(outs[-1].token_ids) == 12
        first.result(60)
        assert_all_free(ex)


def test_async_streams_need_no_thread_each(engine, prompts, tokenizer) -> None:
    """Awaiting outputs must not park a worker thread per stream: with more streams than a pool's
    threads, the streams of running requests would wait behind those of queued ones. Here the event
    loop has no threads at all to give."""
    import concurrent.futures

    class NoThreads(concurrent.futures.ThreadPoolExecutor):
        def submit(self, *args, **kwargs):
            raise AssertionError("an async stream asked for a worker thread")

    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed", max_batch_size=2)) as ex:
        async def main():
            asyncio.get_running_loop().set_default_executor(NoThreads())

            async def collect(handle):
                return [o async for o in handle]

            return await asyncio.gather(*(collect(ex.submit(p, sp)) for p in prompts[:6]))

        for outs in asyncio.run(main()):
            check_stream(outs, tokenizer)
            assert len(outs[-1].token_ids) == 12
        assert_all_free(ex)


def test_queueing_time_is_reported(engine, prompts) -> None:
    """queue_s is submit -> first scheduled: a request waiting for the only batch slot waits for the
    first request's decoding (both are submitted before the loop takes either, so all of it)."""
    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed", max_batch_size=1)) as ex:
        submitted = threading.Event()
        hold_inbox_until(ex, submitted)
        first = ex.submit(prompts[4], SamplingParams(max_tokens=24, ignore_eos=True))
        second = ex.submit(prompts[3], SamplingParams(max_tokens=4, ignore_eos=True))
        submitted.set()
        a, b = first.result(60).stats, second.result(60).stats
    assert 0 <= a.queue_s <= a.ttft_s
    assert a.tpot_s * (a.output_tokens - 4) / 2 < b.queue_s <= b.ttft_s


def test_running_and_queued_stats_while_busy(engine, prompts) -> None:
    """Seen from the executor thread (output callbacks), every request is running, queued or
    finished, never more than max_batch_size run, and blocks used + free = all blocks."""
    submitted = threading.Event()
    seen: list = []

    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed", max_batch_size=3)) as ex:
        hold_inbox_until(ex, submitted)  # no step before the last submit: the first wave runs 3 with 3 queued

        def on_output(o: RequestOutput) -> None:
            if submitted.is_set():
                seen.append(ex.stats())

        hs = [ex.submit(p, SamplingParams(max_tokens=30, ignore_eos=True), on_output=on_output) for p in prompts[:6]]
        submitted.set()
        for h in hs:
            h.result(60)
        final = ex.stats()
    assert seen
    for st in seen:
        assert st.running + st.queued + st.requests_finished == 6, st
        assert st.running <= 3
        assert st.kv_blocks_used + st.kv_blocks_free == ex.cache.allocator.num_blocks
    assert max(st.running for st in seen) == 3 and max(st.queued for st in seen) > 0
    assert (final.running, final.queued, final.requests_finished, final.kv_blocks_used) == (0, 0, 6, 0)



def test_one_token_prompt(engine) -> None:
    """A prompt of just BOS has no hidden state to draft from at first; drafting starts later."""
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    with Executor(engine, ExecutorConfig(num_draft_tokens=0, speculation="off")) as ex:
        plain = ex.submit([0], sp).result(30)
    with Executor(engine, ExecutorConfig(num_draft_tokens=3, speculation="fixed")) as ex:
        spec = ex.submit([0], sp).result(30)
        assert_all_free(ex)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.num_draft_tokens > 0


def test_bad_token_ids_never_emitted(engine, prompts, alone) -> None:
    banned = tuple(alone[3][:6])
    with Executor(engine, ExecutorConfig(num_draft_tokens=0, speculation="off")) as ex:
        plain = ex.submit(prompts[3], SamplingParams(max_tokens=20, ignore_eos=True, bad_token_ids=banned)).result(30)
    with Executor(engine, ExecutorConfig(num_draft_tokens=3, speculation="fixed")) as ex:
        greedy = ex.submit(prompts[3], SamplingParams(max_tokens=20, ignore_eos=True, bad_token_ids=banned))
        sampled = [ex.submit(prompts[3], SamplingParams(max_tokens=20, temperature=1.0, seed=s, ignore_eos=True,
                                                        bad_token_ids=banned)) for s in range(4)]
        greedy = greedy.result(30)
        sampled = [h.result(30) for h in sampled]
        assert_all_free(ex)
    assert not set(plain.token_ids) & set(banned)
    assert greedy.token_ids == plain.token_ids
    assert plain.token_ids != alone[3][:20]
    for o in sampled:
        assert not set(o.token_ids) & set(banned)


@pytest.mark.parametrize("error", [RuntimeError("client bug"), SystemExit(1)])
def test_raising_callback_does_not_break_the_request(engine, prompts, alone, error) -> None:
    """A callback runs user code on the executor's thread: whatever it raises (even sys.exit) is
    logged, and the request and the executor go on."""
    calls = []

    def boom(o: RequestOutput) -> None:
        calls.append(o)
        raise error

    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed")) as ex:
        out = ex.submit(prompts[3], SamplingParams(max_tokens=MAX_TOKENS[3], ignore_eos=True), on_output=boom).result(30)
        assert out.token_ids == alone[3] and calls and calls[-1].finished
        assert ex.submit(prompts[1], SamplingParams(max_tokens=5, ignore_eos=True)).result(30).finish_reason == "length"



def test_shutdown_from_an_output_callback(engine, prompts, caplog) -> None:
    """A callback may shut its executor down (a client that got what it wanted): the call returns at once (it
    tried to join its own thread: "cannot join current thread", logged as a callback failure), the loop stops
    after that step, and the requests in flight and later submits are ended or refused."""
    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed")) as ex:
        other = ex.submit(prompts[1], SamplingParams(max_tokens=200, ignore_eos=True))

        def enough(o: RequestOutput) -> None:
            if len(o.token_ids) >= 3:
                ex.shutdown()

        with caplog.at_level(logging.WARNING):
            out = ex.submit(prompts[3], SamplingParams(max_tokens=200, ignore_eos=True), on_output=enough).result(30)
        assert out.finish_reason == "cancelled" and len(out.token_ids) >= 3
        assert other.result(30).finish_reason == "cancelled"
        ex._thread.join(30)
        assert not ex._thread.is_alive() and not caplog.records, [r.getMessage() for r in caplog.records]
        assert id(ex) not in lifetime._at_exit  # nothing keeps the stopped executor (its engine, its cache) alive
        with pytest.raises(RuntimeError, match="executor is shut down"):
            ex.submit(prompts[0], SamplingParams(max_tokens=2))


def test_max_queued_requests_sheds_load(engine, prompts, alone) -> None:
    """With max_queued_requests, a submit while that many requests wait to be scheduled (the batch is full; an n = 3
    request is one) is refused at once (dsv3-serve answers 503) instead of waiting behind them; the queued ones run
    as they would have, and submits are taken again once the queue drains. A burst on an idle server is admitted as
    far as the batch takes it (each request its n places), plus the bound (requests the step loop has not yet taken in
    count). Without the setting the queue has no bound (as vLLM)."""
    with pytest.raises(ValueError, match=r"^max_queued_requests must be an integer >= 1, got 0$"):
        ExecutorConfig(max_queued_requests=0)
    with pytest.raises(ValueError, match=r"^max_queued_requests must be an integer >= 1, got True$"):
        ExecutorConfig(max_queued_requests=True)
    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed", max_queued_requests=1)) as ex:
        go = threading.Event()
        hold_inbox_until(ex, go)
        params = SamplingParams(max_tokens=MAX_TOKENS[3], ignore_eos=True)
        burst = [ex.submit(prompts[3], params) for _ in range(9)]  # an idle server, a batch of 8, one may wait
        with pytest.raises(RuntimeError, match="^the queue is full"):  # a burst passed the bound, however large
            ex.submit(prompts[3], params)
        go.set()
        assert [h.result(30).token_ids for h in burst] == [alone[3]] * 9
        deadline = time.monotonic() + 30
        while (ex._free_places, ex._waiting_requests) != (8, 0) and time.monotonic() < deadline:  # counted idle
            time.sleep(0.01)
        go = threading.Event()
        hold_inbox_until(ex, go)
        three = SamplingParams(max_tokens=4, temperature=1.0, n=3, ignore_eos=True)
        taken = [ex.submit(prompts[3], three) for _ in range(3)]  # 3 + 3 places of 8, then one waits
        with pytest.raises(RuntimeError, match="^the queue is full"):  # a request takes its n places
            ex.submit(prompts[3], three)
        go.set()
        assert all(len(h.results(30)) == 3 for h in taken)
        # a client's request of several prompts is taken or refused whole, by the queue its first prompt finds: 12
        # prompts (past the batch's 8 and the bound's 1) on an idle executor all run; one submit_all behind a full
        # queue submits nothing
        deadline = time.monotonic() + 30
        while (ex._free_places, ex._waiting_requests) != (8, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        go = threading.Event()
        hold_inbox_until(ex, go)
        many = submit_all(ex, [prompts[3]] * 12, params)
        with pytest.raises(RuntimeError, match="^the queue is full"):
            submit_all(ex, [prompts[3]] * 2, params)
        go.set()
        assert [h.result(30).token_ids for h in many] == [alone[3]] * 12
    config = ExecutorConfig(num_draft_tokens=0, speculation="off", max_batch_size=3, max_queued_requests=2)
    with Executor(engine, config) as ex:
        sampled = SamplingParams(max_tokens=200, temperature=1.0, n=3, ignore_eos=True)
        running = ex.submit(prompts[1], sampled)  # fills the batch
        deadline = time.monotonic() + 30
        while ex.stats().running < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        waiting = [ex.submit(prompts[2], dataclasses.replace(sampled, max_tokens=4)),
                   ex.submit(prompts[0], SamplingParams(max_tokens=4))]
        while ex._waiting_requests < 2 and time.monotonic() < deadline:  # as the step loop last counted them
            time.sleep(0.01)
        assert (ex.stats().running, ex.stats().queued) == (3, 4)  # sequences: the metric; requests: the bound
        with pytest.raises(RuntimeError) as e:
            ex.submit(prompts[0], SamplingParams(max_tokens=4))
        assert str(e.value) == ("the queue is full: 2 requests wait to be scheduled (max_queued_requests); "
                                "try again later")
        copied = pickle.loads(pickle.dumps(e.value))  # as an engine process sends it
        assert isinstance(copied, QueueFull) and (copied.bound, str(copied)) == (2, str(e.value))
        running.cancel()
        assert len(waiting[0].results(30)) == 3 and waiting[1].result(30).finish_reason == "length"
        assert ex.submit(prompts[3], SamplingParams(max_tokens=MAX_TOKENS[3], ignore_eos=True)).result(30).token_ids \
            == alone[3]
        assert_all_free(ex)


def test_a_failing_step_loop_ends_every_request_and_refuses_new_ones(engine, prompts) -> None:
    """A bug outside the model step (here in the scheduler's bookkeeping) stops the loop: every request
    in flight or queued finishes with an error naming it, and later submits are refused, rather than
    hanging their callers."""
    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed", max_batch_size=2)) as ex:
        all_submitted = threading.Event()

        def broken(*args):
            all_submitted.wait(30)  # the loop must not stop before the last submit, or that submit is refused
            raise KeyError("bookkeeping")

        ex.scheduler.update_from_output = broken
        handles = [ex.submit(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts[:4]]
        all_submitted.set()
        for h in handles:
            out = h.result(30)
            assert (out.finish_reason, out.error) == ("error", "executor stopped: KeyError: 'bookkeeping'")
        stopped = r"^executor is shut down \(executor stopped: KeyError: 'bookkeeping'\)$"
        with pytest.raises(RuntimeError, match=stopped):
            ex.submit(prompts[0], SamplingParams(max_tokens=2))


def test_a_top_k_past_the_vocabulary_means_all_tokens(engine, prompts, alone) -> None:
    """top_k larger than the vocabulary (even past int64) samples from every token, as top_k=0 does,
    and cannot break the step it shares with other requests."""
    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed")) as ex:
        greedy = ex.submit(prompts[3], SamplingParams(max_tokens=MAX_TOKENS[3], ignore_eos=True))
        huge, off = (ex.submit(prompts[1], SamplingParams(max_tokens=12, temperature=1.0, top_k=top_k, seed=5,
                                                           ignore_eos=True)) for top_k in (2**64, 0))
        assert greedy.result(30).token_ids == alone[3]
        assert huge.result(30).finish_reason == "length"
        assert huge.result().token_ids == off.result(30).token_ids


def test_duplicate_request_id(engine, prompts) -> None:
    """Reusing a request_id must be refused (ValueError) or work; it must not kill the executor
    thread (today: KeyError in Executor._loop, and every later request hangs)."""
    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed")) as ex:
        a = ex.submit(prompts[1], SamplingParams(max_tokens=10, ignore_eos=True), request_id="same")
        try:
            b = ex.submit(prompts[1], SamplingParams(max_tokens=20, ignore_eos=True), request_id="same")
        except ValueError as e:
            assert "same" in str(e)
            b = None
        try:
            assert len(a.result(5).token_ids) == 10
            if b is not None:
                assert len(b.result(5).token_ids) == 20
            # the executor still serves new requests
            ex.submit(prompts[2], SamplingParams(max_tokens=5, ignore_eos=True)).result(5)
        except TimeoutError as e:
            pytest.fail(f"a duplicate request_id broke the executor ({e}; executor thread alive: "
                        f"{ex._thread.is_alive()})")
        for rid in ("", 7):
            with pytest.raises(ValueError) as e:
                ex.submit(prompts[1], SamplingParams(max_tokens=2), request_id=rid)
            assert str(e.value) == f"request_id must be a non-empty string, got {rid!r}"
        assert_all_free(ex)


# ---------------------------------------------------------------------------------------------
# Adaptive speculation policy
# ---------------------------------------------------------------------------------------------
def costs(target_per_token: float, target_fixed: float, mtp: float) -> StepCosts:
    """A target forward with q tokens per sequence costs fixed + q * per_token (for batch size 1;
    x batch size elsewhere); an MTP forward costs `mtp`."""
    sizes = [1, 2, 4, 8]
    return StepCosts(sizes, {q: [b * (target_fixed + q * target_per_token) for b in sizes] for q in range(1, 6)},
                     [b * mtp for b in sizes])


def test_drafts_are_dropped_before_anyone_is_preempted(engine) -> None:
    """When the cache holds a decode's next token but not its drafts, the step decodes without
    drafts: preempting another request for optional drafts would throw its work away."""
    import torch

    from runtime.core.kv_cache import KVCache
    from runtime.core.scheduler import Scheduler, ServingLimits
    from runtime.core.sequence import Sequence, Status

    cache = KVCache(engine.model_config, num_blocks=4, block_size=4)
    sched = Scheduler(ServingLimits(max_batch_size=8, max_num_tokens=64, max_seq_len=64), cache,
                      DraftPolicy("fixed", 3))
    for i in range(2):  # two decoding sequences of 8 tokens fill the 4 blocks
        seq = Sequence(f"r{i}", list(range(8)), 4, SamplingParams(max_tokens=32), seed=i, status=Status.RUNNING,
                       block_table=cache.allocator.allocate(2), num_cached=7, num_mtp=6,
                       pending_hidden=[torch.zeros(1, engine.model_config.hidden_size)], admitted_at=i + 1)
        sched.running.append(seq)
    plan = sched.schedule()
    assert [(it.seq.request_id, it.num_new, it.num_drafts) for it in plan] == [("r0", 1, 0), ("r1", 1, 0)]
    assert len(sched.running) == 2 and not sched.waiting


def test_admission_reads_only_the_head_of_a_long_queue(engine) -> None:
    """A step admits up to max_batch_size requests: with thousands queued it reads the queue's head, not a copy of
    the whole queue per step (which made every step O(queued))."""
    from collections import deque

    from runtime.core.kv_cache import KVCache
    from runtime.core.scheduler import Scheduler, ServingLimits
    from runtime.core.sequence import Sequence

    class CountingQueue(deque):
        visited = 0

        def __iter__(self):
            for seq in super().__iter__():
                CountingQueue.visited += 1
                yield seq

    cache = KVCache(engine.model_config, num_blocks=64, block_size=4)
    sched = Scheduler(ServingLimits(max_batch_size=4, max_num_tokens=64, max_seq_len=64), cache,
                      DraftPolicy("adaptive", 2, costs(target_per_token=0.001, target_fixed=1.0, mtp=0.01),
                                  prior_acceptance=0.9))
    sched.waiting = CountingQueue()
    for i in range(2000):
        sched.add(Sequence(f"r{i}", list(range(6)), 6, SamplingParams(max_tokens=8), seed=i))
    plan = sched.schedule()
    assert [it.seq.request_id for it in plan] == ["r0", "r1", "r2", "r3"]
    assert sched.waiting[0].request_id == "r4" and len(sched.waiting) == 1996
    assert CountingQueue.visited <= 8
    CountingQueue.visited = 0
    sched.schedule()  # decodes; the queue waits for a seat
    assert CountingQueue.visited <= 8


def test_draft_policy_off_when_verification_costs_more() -> None:
    # compute-bound: verifying k drafts costs k+1 full forwards, and drafting is not free either
    policy = DraftPolicy("adaptive", 4, costs(target_per_token=1.0, target_fixed=0.0, mtp=0.3), prior_acceptance=0.7)
    assert policy.choose(1) == 0
    assert policy.choose(8) == 0


def test_draft_policy_needs_a_margin_over_plain() -> None:
    # k=1 predicted at 1.6 / (1 + 0.2 + 0.3) = 1.07x plain: under MIN_GAIN, so no drafts
    policy = DraftPolicy("adaptive", 1, costs(target_per_token=0.2, target_fixed=0.8, mtp=0.3), prior_acceptance=0.6)
    assert policy.expected_tokens(1) / policy.costs.step_seconds(1, 1) < DraftPolicy.MIN_GAIN / policy.costs.step_seconds(1, 0)
    assert policy.choose(1) == 0
    # cheaper drafting: 1.6 / (1 + 0.2 + 0.1) = 1.23x, so k=1
    policy = DraftPolicy("adaptive", 1, costs(target_per_token=0.2, target_fixed=0.8, mtp=0.1), prior_acceptance=0.6)
    assert policy.choose(1) == 1


def test_draft_policy_max_k_when_drafting_is_cheap() -> None:
    # memory-bound: extra query tokens are almost free, the MTP layer costs 1% of a step
    policy = DraftPolicy("adaptive", 4, costs(target_per_token=0.001, target_fixed=1.0, mtp=0.01), prior_acceptance=0.9)
    assert policy.choose(1) == 4
    assert policy.choose(3) == 4


def test_adaptive_drafts_leave_the_budget_to_waiting_prefill(engine) -> None:
    """With a tight token budget, adaptive drafts must not hold back the admission of waiting
    requests (that lowered throughput below plain decoding in the load test); without waiting
    work they take the policy's k. A fixed k is kept either way."""
    import torch

    from runtime.core.kv_cache import KVCache
    from runtime.core.scheduler import Scheduler, ServingLimits
    from runtime.core.sequence import Sequence, Status

    def plan(mode: str, waiting_prompt: int | None) -> list[int]:
        policy = DraftPolicy(mode, 4, costs(target_per_token=0.001, target_fixed=1.0, mtp=0.01), prior_acceptance=0.9)
        cache = KVCache(engine.model_config, num_blocks=64, block_size=4)
        sched = Scheduler(ServingLimits(max_batch_size=8, max_num_tokens=24, max_seq_len=64), cache, policy)
        for i in range(4):
            seq = Sequence(f"r{i}", list(range(8)), 4, SamplingParams(max_tokens=32), seed=i, status=Status.RUNNING,
                           block_table=cache.allocator.allocate(2), num_cached=7, num_mtp=6,
                           pending_hidden=[torch.zeros(1, engine.model_config.hidden_size)], admitted_at=i + 1)
            sched.running.append(seq)
        if waiting_prompt:
            sched.add(Sequence("new", list(range(waiting_prompt)), waiting_prompt, SamplingParams(max_tokens=8), seed=9))
        return [it.num_drafts for it in sched.schedule() if it.seq.request_id != "new"]

    assert plan("adaptive", None) == [4, 4, 4, 4]  # 4 x 5 tokens fit in 24
    assert plan("adaptive", 9) == [3, 3, 3, 3]  # 8 prompt tokens to prefill: (24 - 4 - 8) // 4 drafts each
    assert plan("adaptive", 21) == [0, 0, 0, 0]
    assert plan("fixed", 21) == [4, 4, 4, 4]


def drafted(new_token_ids: list[int], num_drafts: int, num_accepted: int, temperature: float = 0.0) -> StepResult:
    """A drafting step's result for the policy, of a greedy request (or sampled, at a temperature)."""
    seq = SimpleNamespace(params=SamplingParams(temperature=temperature))
    return StepResult(seq, new_token_ids, num_drafts=num_drafts, num_accepted=num_accepted)  # type: ignore[arg-type]


def test_draft_policy_intermediate_and_learning() -> None:
    c = costs(target_per_token=0.2, target_fixed=1.0, mtp=0.05)
    policy = DraftPolicy("adaptive", 4, c, prior_acceptance=0.6)
    k = policy.choose(1)
    # brute force: the k maximizing E[tokens] / seconds
    a = 0.6
    best = max(range(5), key=lambda k: ((1 - a ** (k + 1)) / (1 - a)) / c.step_seconds(1, k))
    assert k == best and 0 < k < 4
    # acceptance drops to zero: the policy learns it and stops drafting
    for _ in range(200):
        policy.observe([drafted([1], num_drafts=k or 1, num_accepted=0)])
    assert policy.acceptance < 0.01
    assert policy.choose(1) == 0
    # all drafts accepted for a while: it drafts the most again
    for _ in range(400):
        policy.observe([drafted([1] * 5, num_drafts=4, num_accepted=4)])
    assert policy.acceptance > 0.99
    assert policy.choose(1) == 4



def test_draft_policy_learns_greedy_and_sampled_requests_apart() -> None:
    """Sampled requests whose drafts are seldom accepted stop drafting for sampled requests, not for greedy ones
    (one rate for all drove k to 0 for every request after a few sampled ones); a mixed batch sums each drafter's
    expected tokens by its kind, so it drafts for the greedy requests' sake."""
    c = costs(target_per_token=0.2, target_fixed=1.0, mtp=0.05)
    policy = DraftPolicy("adaptive", 3, c, prior_acceptance=0.8)
    k = policy.choose(4, {"greedy": 4})
    assert k > 0 and policy.choose(4, {"sampled": 4}) == k
    for _ in range(200):
        policy.observe([drafted([1], num_drafts=k, num_accepted=0, temperature=1.0)])
    assert policy.acceptance_by_depth["sampled"][0] < 0.01 and policy.acceptance_by_depth["greedy"][0] == 0.8
    assert policy.acceptance == pytest.approx(policy.acceptance_by_depth["sampled"][0])  # the kind seen most
    assert policy.choose(4, {"sampled": 4}) == 0
    assert policy.choose(4, {"greedy": 4}) == k
    assert policy.choose(4, {"greedy": 3, "sampled": 1}) > 0
    assert policy.drafts_at(4)  # greedy requests would draft: new ones keep their MTP inputs

def test_draft_policy_modes() -> None:
    assert DraftPolicy("fixed", 3).choose(8) == 3
    assert DraftPolicy("off", 3).choose(1) == 0
    with pytest.raises(ValueError, match="adaptive speculation needs measured step costs"):
        DraftPolicy("adaptive", 3)
    with pytest.raises(ValueError, match="speculation must be 'off', 'fixed' or 'adaptive', got 'x'"):
        DraftPolicy("x", 3)
    # acceptance per depth: [accepted 1 of 3 drafts] reached depths 1 (accepted) and 2 (rejected)
    p = DraftPolicy("fixed", 3, prior_acceptance=0.5, smoothing=1.0)
    p.observe([drafted([1, 2], num_drafts=3, num_accepted=1)])
    assert p.acceptance_by_depth["greedy"] == pytest.approx([1.0, 0.0, 0.5])  # depth 3 not reached: prior kept
    assert p.acceptance == 1.0
    assert p.expected_tokens(1) == pytest.approx(2.0) and p.expected_tokens(3) == pytest.approx(2.0)
    p.observe([drafted([1, 2, 3, 4], num_drafts=3, num_accepted=3),
               drafted([1, 2, 3], num_drafts=3, num_accepted=2)])
    assert p.acceptance_by_depth["greedy"] == pytest.approx([1.0, 1.0, 0.5])
    assert p.expected_tokens(3) == pytest.approx(1 + 1 + 1 + 0.5)


def test_draft_policy_prefers_short_drafts_when_deep_drafts_fail() -> None:
    # the first draft is right 80% of the time, chained ones never: a pooled i.i.d. rate would still
    # pay for long drafts; per-depth rates settle on k = 1
    c = costs(target_per_token=0.05, target_fixed=1.0, mtp=0.05)
    policy = DraftPolicy("adaptive", 4, c, prior_acceptance=0.7, smoothing=0.1)
    for i in range(300):
        policy.observe([drafted([], num_drafts=4, num_accepted=1 if i % 5 else 0)])
    assert policy.acceptance == pytest.approx(0.8, abs=0.1)
    assert policy.acceptance_by_depth["greedy"][1] < 0.05  # depths 3 and 4 are never reached
    assert policy.choose(1) == 1


def test_draft_policy_learns_whole_step_costs() -> None:
    """The profiled forwards predict k=1 at 1.23x plain; whole steps show drafting costs 40% more than
    profiled (the runner's own work) while plain steps cost what was profiled: drafting stops. A ratio
    starts from k=0's (1 for k=0 itself); over a k's first MIN_COST_SAMPLES steps it is their median, each
    sample clipped to 2x, so one very slow step among them does not count; then it moves by smoothing. Ratios
    are kept per profiled batch size."""
    policy = DraftPolicy("adaptive", 1, costs(target_per_token=0.2, target_fixed=0.8, mtp=0.1), prior_acceptance=0.6)
    assert policy.choose(1) == 1
    policy.observe_step(1, 0, 1.0 * policy.costs.step_seconds(1, 0))
    assert policy.cost_ratio[(1, 0)] == pytest.approx(1.0)
    assert policy.step_seconds(1, 1) == pytest.approx(policy.costs.step_seconds(1, 1))  # borrowed ratio 1.0
    policy.observe_step(1, 1, 10.0 * policy.costs.step_seconds(1, 1))  # one very slow step: clipped to 2x
    assert policy.cost_ratio[(1, 1)] == pytest.approx(2.0) and policy.choose(1) == 0
    for _ in range(DraftPolicy.MIN_COST_SAMPLES - 1):
        policy.observe_step(1, 1, 1.0 * policy.costs.step_seconds(1, 1))
    assert policy.cost_ratio[(1, 1)] == pytest.approx(1.0) and policy.choose(1) == 1  # the median
    for _ in range(60):
        policy.observe_step(1, 1, 1.4 * policy.costs.step_seconds(1, 1))
    assert policy.cost_ratio[(1, 1)] == pytest.approx(1.4, abs=0.01)
    assert policy.choose(1) == 0
    assert policy.choose(2) == 1  # nothing learned at batch size 2
    for _ in range(60):  # 3 belongs to the profiled size 4
        policy.observe_step(3, 0, 2.0 * policy.costs.step_seconds(3, 0))
    assert policy.cost_ratio[(4, 0)] == pytest.approx(2.0, abs=0.01) and policy.choose(4) == 1  # k=1 borrows it


def test_draft_policy_recovers_from_a_profile_that_over_priced_drafting() -> None:
    """A start-up profile taken on a busy machine timed the 2-token forward at 1.7-2x the 1-token one (1.15x on a
    quiet one): k = 1 was predicted to lose even with every draft accepted, so it was never tried, never measured,
    and a Triton server never drafted for its whole life. A k run fewer than MIN_COST_SAMPLES times is explored
    whatever its price, and the steps it runs price it; where drafting really loses, it costs those few steps."""
    for profiled, real, drafting in ((2.0, 1.15, True), (2.0, 2.5, False)):
        policy = DraftPolicy("adaptive", 3, StepCosts([1], {q: [1.0 + (profiled - 1) * (q > 1) * (1 + 0.05 * (q - 2))]
                                                           for q in (1, 2, 3, 4)}, [0.2]))
        policy.acceptance_by_depth = {kind: [0.75, 0.7, 0.65] for kind in policy.acceptance_by_depth}
        picks = []
        for _ in range(20 * DraftPolicy.EXPLORE_EVERY):
            picks.append(k := policy.choose(1))
            policy.observe_step(1, k, (1.0 + (real - 1) * (k > 0)) * 1.0 + 0.2 * k)
        tail = picks[-4 * DraftPolicy.EXPLORE_EVERY:]
        assert (tail.count(0) <= 4) if drafting else (sum(k > 0 for k in picks) <= 2 * DraftPolicy.MIN_COST_SAMPLES), \
            (profiled, real, picks.count(0))


def test_an_executor_whose_profile_over_priced_drafting_prices_drafting(shipped_model_dir, monkeypatch) -> None:
    """The recovery above in the executor: a k explored once from k = 0 is a sequence's first drafting step, whose MTP
    catch-up over the prompt keeps it out of the costs, so k = 1 was never priced and an executor profiled at 2x the
    drafting cost (almost) never drafted. Explored on two decisions in a row, the second step prices it. Whether it
    then drafts is the machine's economics (these short prompts are near break-even on a small CPU), so the check is
    that k = 1 was priced and that its measured steps brought the doubled profile down."""
    from runtime.core.sampling_params import SamplingParams as Params

    real = native_executor.profile_step_costs

    def over_priced(runner, *args, **kwargs) -> StepCosts:
        costs = real(runner, *args, **kwargs)
        return StepCosts(costs.batch_sizes, {q: [t * (2.0 if q > 1 else 1.0) for t in times]
                                             for q, times in costs.target.items()}, [t * 2.0 for t in costs.mtp])

    monkeypatch.setattr(native_executor, "profile_step_costs", over_priced)
    with Executor(shipped_model_dir, ExecutorConfig(max_batch_size=4, max_seq_len=512)) as ex:
        prompts = [ex.tokenizer.encode(p["text"])[:64] for p in json.loads(
            (shipped_model_dir / "heldout_prompts.json").read_text())]
        assert not ex.policy.drafts_at(1)  # the profile rules drafting out
        for i in range(24):
            ex.submit(prompts[i % len(prompts)], Params(max_tokens=48, temperature=0.0)).result()
        priced = ex.policy.first_ratios.get((1, 1), [])
        assert len(priced) == DraftPolicy.MIN_COST_SAMPLES, ex.policy.first_ratios
        # real k = 1 steps against k = 0 ones cost less than the doubled profile says (about half)
        assert ex.policy.cost_ratio[(1, 1)] / ex.policy.cost_ratio[(1, 0)] < 1.0, ex.policy.cost_ratio


def scheduler_with_one_decode(engine, policy: DraftPolicy, max_num_tokens: int = 64):
    """A scheduler over a small cache, running one decoding sequence of 8 tokens with MTP inputs pending."""
    import torch

    from runtime.core.kv_cache import KVCache
    from runtime.core.scheduler import ServingLimits
    from runtime.core.sequence import Sequence, Status

    cache = KVCache(engine.model_config, num_blocks=16, block_size=4)
    sched = Scheduler(ServingLimits(max_batch_size=8, max_num_tokens=max_num_tokens, max_seq_len=64), cache, policy)
    seq = Sequence("r", list(range(8)), 4, SamplingParams(max_tokens=32), seed=0, status=Status.RUNNING,
                   block_table=cache.allocator.allocate(2), num_cached=7, num_mtp=6,
                   pending_hidden=[torch.zeros(1, engine.model_config.hidden_size)], admitted_at=1)
    sched.running.append(seq)
    return sched, seq


def test_adaptive_gives_up_drafting_for_sequences_that_went_idle(engine) -> None:
    """Under adaptive speculation a sequence that decoded MTP_IDLE_LIMIT steps in a row for which the
    policy chose k = 0 stops keeping MTP inputs and never drafts again; a fixed k keeps them."""
    for mode in ("adaptive", "fixed"):
        policy = DraftPolicy(mode, 2, costs(target_per_token=1.0, target_fixed=0.0, mtp=0.3))  # drafting never pays
        sched, seq = scheduler_with_one_decode(engine, policy)
        for step in range(Scheduler.MTP_IDLE_LIMIT):
            assert seq.can_draft and not seq.mtp_dropped
            plan = sched.schedule()
            assert [it.num_drafts for it in plan] == [0 if mode == "adaptive" else 2]
            # a decode step that emitted a token, applied without its token so the sequence stays as it was
            sched.update_from_output(plan, [StepResult(seq, [1], num_drafts=0, num_accepted=0)], {seq: 0}, set(), 0.0)
        if mode == "adaptive":
            assert seq.mtp_dropped and seq.pending_hidden == [] and not seq.can_draft
            assert [it.num_drafts for it in sched.schedule()] == [0]
        else:
            assert not seq.mtp_dropped and seq.can_draft


def test_idle_steps_count_only_when_the_policy_chose_no_drafts(engine) -> None:
    """Drafts cut by the token budget (prefill waiting) are not the policy's choice: however long that
    lasts, the sequences keep drafting afterwards."""
    from runtime.core.sequence import Sequence

    policy = DraftPolicy("adaptive", 2, costs(target_per_token=0.001, target_fixed=1.0, mtp=0.01), prior_acceptance=0.9)
    sched, seq = scheduler_with_one_decode(engine, policy, max_num_tokens=4)
    sched.add(Sequence("long", list(range(40)), 40, SamplingParams(max_tokens=8), seed=1))
    for _ in range(3 * Scheduler.MTP_IDLE_LIMIT):  # the waiting prompt takes the budget: no room for drafts
        plan = sched.schedule()
        assert [it.num_drafts for it in plan if it.seq is seq] == [0] and sched.policy_k == 2
        sched.update_from_output(plan, [StepResult(seq, [1], num_drafts=0, num_accepted=0)], {seq: 0}, set(), 0.0)
        sched.running = [seq]  # the long prompt waits again
        sched.waiting.clear()
        sched.add(Sequence("long", list(range(40)), 40, SamplingParams(max_tokens=8), seed=1))
    assert not seq.mtp_dropped and seq.mtp_idle_steps == 0


def test_draft_policy_explores_the_draft_lengths_next_to_its_choice() -> None:
    """Every EXPLORE_EVERY-th step runs a neighbour of the chosen k, one draft more and one fewer in turn, so
    costs learned under other conditions are measured again. When drafting loses (k = 0) that is k = 1:
    a longer draft, which costs a large batch several plain steps, is not tried; and k = 1 is tried only
    if it would pay were its draft always accepted (else the try costs a step and can teach nothing)."""
    n = 4 * DraftPolicy.EXPLORE_EVERY
    every = slice(DraftPolicy.EXPLORE_EVERY - 1, n, DraftPolicy.EXPLORE_EVERY)

    def chosen(picks: list[int]) -> list[int]:
        return [k for i, k in enumerate(picks) if (i + 1) % DraftPolicy.EXPLORE_EVERY]

    def measured(policy: DraftPolicy, verify_ratio: float) -> DraftPolicy:
        for k, ratio in ((0, 1.0), (1, verify_ratio), (2, verify_ratio), (3, verify_ratio)):
            for _ in range(100):
                policy.observe_step(1, k, ratio * policy.costs.step_seconds(1, k))
        return policy

    # k = 1 costs 1.3x plain as profiled: at acceptance 0.05 it loses (1.05 / 1.3), always accepted it
    # would win (2 / 1.3 >= MIN_GAIN), so it is tried
    policy = measured(DraftPolicy("adaptive", 3, costs(target_per_token=0.2, target_fixed=0.8, mtp=0.1),
                                  prior_acceptance=0.05), 1.0)
    picks = [policy.choose(1) for _ in range(n)]
    assert picks[every] == [1, 1, 1, 1] and set(chosen(picks)) == {0}
    # measured at 1.6x that (2.08x plain), k = 1 loses even if every draft were accepted: never tried
    policy = measured(DraftPolicy("adaptive", 3, costs(target_per_token=0.2, target_fixed=0.8, mtp=0.1),
                                  prior_acceptance=0.6), 1.6)
    assert set(policy.choose(1) for _ in range(n)) == {0}
    policy = measured(DraftPolicy("adaptive", 3, costs(target_per_token=0.2, target_fixed=0.8, mtp=0.1)), 1.0)
    policy.acceptance_by_depth["greedy"] = [0.9, 0.9, 0.05]  # rates 1, 1.46, 1.69, 1.45 x plain: k = 2
    picks = [policy.choose(1) for _ in range(n)]
    assert picks[every] == [3, 1, 3, 1] and set(chosen(picks)) == {2}


# ---- draft length defaults, KV cache sizing, health -------------------------------------------
def test_default_draft_length_follows_the_model(engine, tiny_checkpoint) -> None:
    """num_draft_tokens left unset drafts up to 3 (at most the engine's max) where the model has MTP and nothing
    where it has none; asked for explicitly on a model without MTP, it is refused naming the reason."""
    with Executor(engine, ExecutorConfig(speculation="fixed")) as ex:
        assert ex.policy.max_k == 3
    no_mtp = load_engine(tiny_checkpoint("nomtp", tiny_config_dict(num_nextn_predict_layers=0)))
    with Executor(no_mtp, ExecutorConfig()) as ex:
        assert ex.policy.max_k == 0 and ex.policy.mode == "off"
    with pytest.raises(ValueError) as e:
        Executor(no_mtp, ExecutorConfig(num_draft_tokens=2))
    assert str(e.value) == (f"num_draft_tokens 2: {no_mtp.path} has no MTP layer to draft with "
                            "(num_nextn_predict_layers is 0, or the checkpoint stores no MTP weights); "
                            "use num_draft_tokens=0")


def test_kv_cache_is_sized_from_free_memory(engine, prompts, alone) -> None:
    """max_batch_size 100000000 built, then died at load with a raw allocator error: the cache now takes at most
    free_memory_fraction of the memory free after the weights, and what cannot fit is refused naming the setting."""
    fraction = 0.002  # of this machine's free memory: a few tens of MB
    config = ExecutorConfig(speculation="off", max_batch_size=100_000_000, free_memory_fraction=fraction)
    with Executor(engine, config) as ex:
        per_token = ex.cache.tensor[:, 0].numel() * ex.cache.tensor.element_size()
        assert ex.cache.tensor.numel() * ex.cache.tensor.element_size() <= 1.05 * fraction * free_memory_bytes(
            torch.device("cpu")) + 2 * ex.cache.block_size * per_token
        assert ex.submit(prompts[0], SamplingParams(max_tokens=16)).result().token_ids == alone[0][:16]
    with pytest.raises(ValueError) as e:
        Executor(engine, ExecutorConfig(speculation="off", kv_cache_tokens=10**12))
    assert str(e.value).startswith("kv_cache_tokens 1000000000000 does not fit: ")
    assert "tokens of " in str(e.value) and " bytes fit in free_memory_fraction 0.9 of the " in str(e.value)
    with pytest.raises(ValueError) as e:
        Executor(engine, ExecutorConfig(speculation="off", free_memory_fraction=1e-12))
    assert str(e.value).startswith("max_seq_len 256 does not fit: one sequence needs 272 tokens of KV cache and 0 "
                                   "tokens of ")
    assert str(e.value).endswith("; lower max_seq_len (or rebuild with a smaller --max_seq_len)")
    with pytest.raises(ValueError, match=r"^free_memory_fraction must be in \(0, 1\], got 0$"):
        ExecutorConfig(free_memory_fraction=0)


def test_a_kv_cache_where_free_memory_is_unknown_is_what_the_settings_ask(engine, prompts, alone,
                                                                          monkeypatch) -> None:
    """free_memory_bytes is None where /proc/meminfo cannot be read: the sizing formatted None as GiB (TypeError)."""
    monkeypatch.setattr(native_executor, "free_memory_bytes", lambda device: None)
    with Executor(engine, ExecutorConfig(speculation="off", max_batch_size=2)) as ex:
        assert ex.cache.allocator.num_blocks * ex.cache.block_size >= 2 * 256
        assert ex.submit(prompts[0], SamplingParams(max_tokens=16)).result().token_ids == alone[0][:16]


def test_health_reports_a_stalled_or_stopped_step_loop(engine, prompts) -> None:
    """What a server's watchdog polls: a step stuck past the timeout, or a loop that died, is reported with why."""
    with Executor(engine, ExecutorConfig(speculation="off")) as ex:
        assert ex.health(timeout_s=1.0) is None
        release, step = threading.Event(), ex.runner.step
        ex.runner.step = lambda plan: release.wait(30) and step(plan)
        handle = ex.submit(prompts[0], SamplingParams(max_tokens=4))
        wait_until(lambda: ex.health(timeout_s=0.2) is not None, what="a stall report")
        assert ex.health(timeout_s=0.2).startswith("the executor's step loop has made no progress for ")
        assert ex.health(timeout_s=0.2).endswith(" s (1 requests running, 0 waiting)")
        release.set()
        assert handle.result(30).finish_reason == "length"
        wait_until(lambda: ex.health(timeout_s=0.2) is None, what="recovery")
        ex.scheduler.schedule = lambda: 1 / 0  # a bug outside a model step ends the loop
        ex.submit(prompts[1], SamplingParams(max_tokens=4))
        wait_until(lambda: ex.health(timeout_s=60) is not None, what="the loop's end")
        assert ex.health(timeout_s=60) == "executor stopped: ZeroDivisionError: division by zero"


def test_watchdog_calls_on_failure_once_with_the_reason() -> None:
    from serving.watchdog import Watchdog

    failures: list[str] = []
    state = {"stuck": None}
    dog = Watchdog({"loop": lambda: state["stuck"]}, failures.append, period_s=0.01)
    time.sleep(0.1)
    assert failures == [] and dog.failure is None
    state["stuck"] = "no progress for 3 s"
    wait_until(lambda: failures, what="the failure")
    time.sleep(0.1)
    assert failures == ["loop: no progress for 3 s"] and dog.failure == "loop: no progress for 3 s"
    dog.stop()


def test_a_watchdog_probe_that_raises_is_a_failure() -> None:
    """A probe that raises (an engine process dying during the health call) ended the watchdog's thread unheard."""
    from serving.watchdog import Watchdog

    failures: list[str] = []

    def probe() -> str | None:
        raise RuntimeError("the engine process exited (status -9)")

    dog = Watchdog({"executor": probe}, failures.append, period_s=0.01)
    wait_until(lambda: failures, what="the failure")
    assert failures == ["executor: its check raised RuntimeError: the engine process exited (status -9)"]
    dog.stop()


@pytest.mark.parametrize("ignores_sigterm", [False, True])
def test_a_stalled_server_is_killed_when_sigterm_does_not_stop_it(ignores_sigterm: bool) -> None:
    """A server wedged in its own shutdown (tritonserver deadlocked in its abort handler) ignores SIGTERM and keeps
    answering health checks: the watchdog kills it; one that exits on SIGTERM gets nothing more."""
    import signal
    import subprocess
    import sys

    from runtime.executors.lifetime import running
    from serving.watchdog import stop_server

    handler = "signal.SIG_IGN" if ignores_sigterm else "signal.SIG_DFL"
    code = f"import signal, time; signal.signal(signal.SIGTERM, {handler}); print('up', flush=True); time.sleep(60)"
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert server.stdout.readline() == b"up\n"
    stop_server(server.pid, "test: stalled", kill_after_s=1.0)
    assert server.wait(5) == (-signal.SIGKILL if ignores_sigterm else -signal.SIGTERM)
    assert not running(server.pid)


def test_the_step_cost_profile_runs_without_autograd(engine, monkeypatch) -> None:
    """Adaptive speculation's start-up profile times inference forwards (autograd's bookkeeping would price drafts
    wrong, on CPU most); the output callbacks of the step loop run outside inference mode, as the caller's code."""
    from runtime.core.model_runner import ModelRunner

    modes, callback_modes = [], []
    forward = ModelRunner.forward_target

    def recording(self, *args, **kwargs):
        modes.append(torch.is_inference_mode_enabled())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward_target", recording)
    with Executor(engine, ExecutorConfig(num_draft_tokens=2, speculation="adaptive")) as ex:
        assert modes and all(modes)
        ex.submit([5, 6, 7], SamplingParams(max_tokens=2),
                  on_output=lambda out: callback_modes.append(torch.is_inference_mode_enabled())).result(30)
    assert callback_modes and not any(callback_modes)
