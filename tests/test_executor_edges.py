"""Edge cases of the in-flight batching executor and its scheduler, on the shipped model in float32.

On this model the CPU kernels make a sequence's logits bit for bit the same alone and in any ragged
batch, so every greedy output here is compared token for token with the same prompt decoded alone
without speculation. Ordering between the test's thread and the step loop uses events and callbacks
(which run on the executor's thread, between steps), never sleeps: a request submitted from a callback
is in the inbox before the next step takes it, so the schedules below are deterministic.

Invariants checked at every step by `Watch` (on the executor's thread, asserted afterwards): blocks used
+ free == all blocks, blocks used == the blocks of the running sequences, no waiting sequence holds a
block, running <= max_batch_size, the tokens of a step <= max_num_tokens, each sequence's block table
covers what the step writes (its drafts included), drafts <= k and never past max_tokens - 1.
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from runtime.io.loading import load_engine
from runtime.executors.base import ExecutorConfig
from runtime.executors import native
from runtime.executors.native import Executor
from runtime.executors.outputs import RequestOutput
from runtime.core.sampling_params import SamplingParams
from runtime.core.draft_policy import StepCosts
from runtime.core.scheduler import Scheduler
from runtime.io.tokenizer import Tokenizer

from executor_util import assert_all_free, hold_inbox_until  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

MAX_SEQ_LEN = 256
REF_TOKENS = 40  # greedy reference length; shorter outputs are its prefixes
BLOCK = 16


# ---------------------------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(shipped_model_dir, shipped_tokenizer) -> list[int]:
    """Token ids of the held-out prompts, one after another: prompts are slices of it."""
    f = shipped_model_dir / "heldout_prompts.json"
    if not f.is_file():
        pytest.skip("no heldout_prompts.json next to the shipped model")
    rows = json.loads(f.read_text())
    ids: list[int] = []
    for r in rows[:12]:
        ids += shipped_tokenizer.encode(r["text"])
    assert len(ids) > 600
    return ids


def prompt(corpus: list[int], start: int, length: int) -> list[int]:
    return corpus[start : start + length]


@pytest.fixture(scope="module")
def alone(shipped_engine):
    """alone(prompt, n): greedy output of `prompt` (n tokens, eos ignored) decoded alone without speculation."""
    cache: dict[tuple[int, ...], list[int]] = {}
    ex = Executor(shipped_engine, ExecutorConfig(num_draft_tokens=0, speculation="off", max_seq_len=MAX_SEQ_LEN))

    def get(p: list[int], n: int) -> list[int]:
        assert n <= REF_TOKENS
        key = tuple(p)
        if key not in cache:
            n_ref = min(REF_TOKENS, MAX_SEQ_LEN - len(p))
            out = ex.submit(list(p), SamplingParams(max_tokens=n_ref, ignore_eos=True)).result(60)
            assert out.finish_reason == "length" and len(out.token_ids) == n_ref
            cache[key] = out.token_ids
        assert n <= len(cache[key])
        return cache[key][:n]

    yield get
    ex.shutdown()


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)




def cheap_drafting(runner, max_batch_size: int, max_k: int) -> StepCosts:
    """Profiled costs under which adaptive speculation drafts (the shipped model's real costs on a
    loaded 2-core machine may pick k = 0, which would test nothing)."""
    sizes = [1, 2, 4, 8]
    return StepCosts(sizes, {q: [b * (1.0 + q * 0.001) for b in sizes] for q in range(1, max_k + 2)},
                     [b * 0.01 for b in sizes])


class Watch:
    """Records every step's plan [(request id, num_new, num_drafts)] and preemption, and checks the
    scheduler's invariants before each step (on the executor's thread; `check()` asserts afterwards)."""

    def __init__(self, ex: Executor):
        self.ex = ex
        self.plans: list[list[tuple[str, int, int]]] = []
        self.prefilling: list[set[str]] = []  # ids whose item in that step was a prefill chunk
        self.preempted: list[dict] = []
        self.violations: list[str] = []
        self.peak_used = 0
        self.emitted: list[list[tuple[str, list[int], int, int]]] = []  # per step: (id, tokens, drafts, accepted)
        self.k = ex.policy.max_k
        step, preempt = ex.runner.step, ex.scheduler._preempt_latest

        def watched_step(items):
            self._check(items)
            results = step(items)
            self.emitted.append([(r.seq.request_id, list(r.new_token_ids), r.num_drafts, r.num_accepted)
                                 for r in results])
            return results

        def watched_preempt():
            latest = max(ex.scheduler.running, key=lambda s: s.admitted_at)
            state = dict(id=latest.request_id, step=len(self.plans), output_tokens=latest.num_output_tokens,
                         in_prefill=latest.in_prefill, cached=latest.num_cached, blocks=len(latest.block_table),
                         drafted=ex._requests[latest.request_id][1].num_draft_tokens)
            victim = preempt()
            if victim is not latest:
                self.violations.append(f"preempted {victim.request_id}, not the latest admitted {latest.request_id}")
            if victim.block_table or victim.num_cached or victim not in ex.scheduler.waiting:
                self.violations.append(f"preempted {victim.request_id} kept blocks or is not waiting")
            self.preempted.append(state)
            return victim

        ex.runner.step = watched_step
        ex.scheduler._preempt_latest = watched_preempt

    def _check(self, items) -> None:
        ex, sched, alloc = self.ex, self.ex.scheduler, self.ex.cache.allocator
        bad = self.violations.append
        n = len(self.plans)
        self.plans.append([(it.seq.request_id, it.num_new, it.num_drafts) for it in items])
        self.prefilling.append({it.seq.request_id for it in items if it.seq.in_prefill})
        self.peak_used = max(self.peak_used, alloc.num_used)
        if alloc.num_used + alloc.num_free != alloc.num_blocks:
            bad(f"step {n}: used {alloc.num_used} + free {alloc.num_free} != {alloc.num_blocks}")
        held = sum(len(s.block_table) for s in sched.running)
        if alloc.num_used != held:
            bad(f"step {n}: {alloc.num_used} blocks used, running sequences hold {held}")
        if any(s.block_table for s in sched.waiting):
            bad(f"step {n}: a waiting sequence holds blocks")
        if len(sched.running) > ex.limits.max_batch_size:
            bad(f"step {n}: {len(sched.running)} running > max_batch_size {ex.limits.max_batch_size}")
        total = sum(it.num_new for it in items)
        if total > ex.limits.max_num_tokens:
            bad(f"step {n}: {total} tokens > max_num_tokens {ex.limits.max_num_tokens}")
        if len({id(it.seq) for it in items}) != len(items):
            bad(f"step {n}: a sequence is scheduled twice")
        for it in items:
            s = it.seq
            if len(s.block_table) * BLOCK < s.num_cached + it.num_new:
                bad(f"step {n}: {s.request_id} writes {s.num_cached + it.num_new} positions into "
                    f"{len(s.block_table)} blocks")
            if len(s.block_table) > ex.cache.blocks_for(s.num_prompt_tokens + s.params.max_tokens - 1):
                bad(f"step {n}: {s.request_id} holds {len(s.block_table)} blocks, more than its last position needs")
            if it.num_drafts > self.k:
                bad(f"step {n}: {s.request_id} drafts {it.num_drafts} > k {self.k}")
            if it.num_drafts and it.num_drafts > s.params.max_tokens - s.num_output_tokens - 1:
                bad(f"step {n}: {s.request_id} drafts {it.num_drafts} past max_tokens")
            if it.num_drafts and s.in_prefill:
                bad(f"step {n}: {s.request_id} drafts while in prefill")
            if s not in sched.running:
                bad(f"step {n}: {s.request_id} is scheduled but not running")

    def check(self) -> None:
        assert not self.violations, "\n".join(self.violations[:10])

    def steps_of(self, rid: str) -> list[int]:
        return [i for i, plan in enumerate(self.plans) if any(r == rid for r, _, _ in plan)]


class StatsLog:
    """on_output callback: at every output, running + queued must be the requests not finished yet, and
    the blocks used those of the running sequences."""

    def __init__(self, ex: Executor):
        self.ex = ex
        self.submitted = 0  # the test counts its submits
        self.finished = 0
        self.max_running = 0
        self.max_queued = 0
        self.violations: list[str] = []
        self.lock = threading.Lock()

    def submit(self, prompt_ids: list[int], params: SamplingParams):
        """Submit a request whose outputs this log checks, and count it."""
        handle = self.ex.submit(prompt_ids, params, on_output=self)
        self.submitted += 1
        return handle

    def __call__(self, o: RequestOutput) -> None:  # executor thread
        with self.lock:
            self.finished += o.finished
            s = self.ex.stats()
            self.max_running = max(self.max_running, s.running)
            self.max_queued = max(self.max_queued, s.queued)
            if s.running + s.queued != self.submitted - self.finished:
                self.violations.append(f"{o.request_id}: running {s.running} + queued {s.queued} != "
                                       f"{self.submitted - self.finished} unfinished")
            held = sum(len(q.block_table) for q in self.ex.scheduler.running)
            if s.kv_blocks_used != held or s.kv_blocks_used + s.kv_blocks_free != self.ex.cache.allocator.num_blocks:
                self.violations.append(f"{o.request_id}: {s} vs {held} blocks held by running sequences")

    def check(self) -> None:
        assert not self.violations, "\n".join(self.violations[:10])


# ---------------------------------------------------------------------------------------------
# Greedy exactness: mixed lengths, arrivals in waves, chunked prefill, drafts, preemption
# ---------------------------------------------------------------------------------------------
# (corpus start, prompt length, max_tokens, wave): a 1-token prompt, max_tokens 1 and 2, a prompt one past a
# block (17) and one that fills two with its first token (31), and two long prompts prefilled in chunks
MIXED = {
    "A": (0, 90, 20, 1), "B": (100, 1, 12, 1), "C": (200, 17, 1, 1), "D": (300, 31, 2, 1),
    "E": (400, 47, 16, 2), "F": (500, 5, 24, 2), "G": (50, 120, 10, 3), "H": (150, 33, 3, 3),
}


@pytest.mark.parametrize("speculation, k, profiled", [("off", 0, False), ("fixed", 4, False), ("fixed", 1, False),
                                                      ("adaptive", 3, False), ("adaptive", 3, True)])
def test_mixed_batch_with_chunked_prefill_and_preemption_equals_alone(shipped_engine, corpus, alone, speculation, k, profiled,
                                                                      monkeypatch) -> None:
    """Three waves of requests (the later ones submitted from a callback while the first decode) under a
    12-token budget, a batch limit of 4 and a cache of 9 blocks: prompts are prefilled in chunks beside
    drafting decodes, requests queue and are preempted; every output is the prompt's output alone.
    Adaptive runs with costs under which it drafts, and with this machine's profile (`profiled`: it may
    choose k = 0 and give sequences' MTP inputs up)."""
    if not profiled:
        monkeypatch.setattr(native, "profile_step_costs", cheap_drafting)
        monkeypatch.setattr(Scheduler, "MTP_IDLE_LIMIT", 10**6)
    config = ExecutorConfig(num_draft_tokens=k, speculation=speculation, max_num_tokens=12, max_batch_size=4,
                            kv_cache_tokens=128, max_seq_len=MAX_SEQ_LEN)
    with Executor(shipped_engine, config) as ex:
        assert ex.cache.allocator.num_blocks == 9
        watch, log = Watch(ex), StatsLog(ex)
        handles: dict[str, object] = {}
        waves_sent = set()
        all_sent = threading.Event()

        def submit(wave: int) -> None:
            for name, (start, n, max_tokens, w) in MIXED.items():
                if w == wave:
                    handles[name] = ex.submit(prompt(corpus, start, n), greedy(max_tokens), on_output=on_output,
                                              request_id=name)
                    log.submitted += 1
            if wave == 3:
                all_sent.set()

        def on_output(o: RequestOutput) -> None:  # executor thread: later waves join between two steps
            log(o)
            if o.finish_reason == "error":
                all_sent.set()  # fail below, not after a timeout
            if o.request_id == "B" and len(o.token_ids) >= 4 and 2 not in waves_sent:
                waves_sent.add(2)
                submit(2)
            if o.request_id == "F" and len(o.token_ids) >= 3 and 3 not in waves_sent:
                waves_sent.add(3)
                submit(3)

        go = threading.Event()
        hold_inbox_until(ex, go)
        submit(1)
        go.set()
        assert all_sent.wait(60), f"the later waves were not submitted: {sorted(handles)}"
        outs = {name: h.result(60) for name, h in handles.items()}
        errors = {name: o.error for name, o in outs.items() if o.finish_reason == "error"}
        assert not errors and set(outs) == set(MIXED), (errors, sorted(outs))
        stats = ex.stats()
        assert_all_free(ex)
    watch.check()
    log.check()
    for name, (start, n, max_tokens, _) in MIXED.items():
        assert outs[name].finish_reason == "length", (name, outs[name].finish_reason, outs[name].error)
        assert outs[name].token_ids == alone(prompt(corpus, start, n), max_tokens), \
            f"{name} ({speculation}, k={k}) differs from its output alone"
    assert stats.requests_finished == len(MIXED)
    assert stats.generated_tokens == sum(m for _, _, m, _ in MIXED.values())
    if profiled:  # the draft lengths follow this machine's timings: the schedule is not deterministic
        return
    # the schedule really did what this test is about
    assert watch.preempted, "no preemption: the cache is not tight enough for this test"
    assert log.max_queued > 0 and log.max_running >= 3
    for name in ("A", "G"):
        assert sum(name in p for p in watch.prefilling) >= 3, f"{name} was not prefilled in chunks"
    if k:
        assert stats.draft_tokens > 0 and stats.accepted_draft_tokens > 0
        mixed_steps = [i for i, plan in enumerate(watch.plans)
                       if any(d for _, _, d in plan) and watch.prefilling[i]]
        # adaptive drafts leave the budget to waiting prefill work (by design), a fixed k does not
        assert mixed_steps or speculation == "adaptive", "no step ran a prefill chunk beside a drafting decode"
        assert outs["C"].stats.num_draft_tokens == 0  # max_tokens 1: nothing to draft
        assert outs["D"].stats.num_draft_tokens <= 1
    else:
        assert stats.draft_tokens == 0


PREEMPT = [(0, 40, 30), (100, 23, 36), (200, 9, 40), (300, 50, 28)]  # (corpus start, prompt length, max_tokens)


@pytest.mark.parametrize("speculation, k, budget", [("fixed", 3, 16), ("adaptive", 3, 24), ("off", 0, 16)])
def test_repeated_preemption_mid_prefill_and_mid_draft(shipped_engine, corpus, alone, speculation, k, budget,
                                                       monkeypatch) -> None:
    """A cache of 5 blocks (80 tokens) holds any one of these requests but not two: they are preempted
    again and again, some halfway through a chunked prefill, some after drafting; none is lost, each
    output is its output alone, and every block comes back."""
    monkeypatch.setattr(native, "profile_step_costs", cheap_drafting)
    monkeypatch.setattr(Scheduler, "MTP_IDLE_LIMIT", 10**6)
    config = ExecutorConfig(num_draft_tokens=k, speculation=speculation, kv_cache_tokens=64, max_num_tokens=budget,
                            max_seq_len=MAX_SEQ_LEN)
    with Executor(shipped_engine, config) as ex:
        assert ex.cache.allocator.num_blocks == 5
        assert all(ex.cache.blocks_for(n + m) <= 5 for _, n, m in PREEMPT)
        watch, log = Watch(ex), StatsLog(ex)
        go = threading.Event()
        hold_inbox_until(ex, go)
        hs = [log.submit(prompt(corpus, start, n), greedy(m)) for start, n, m in PREEMPT]
        go.set()
        outs = [h.result(60) for h in hs]
        assert_all_free(ex)
    watch.check()
    log.check()
    for (start, n, m), out in zip(PREEMPT, outs):
        assert out.finish_reason == "length" and out.token_ids == alone(prompt(corpus, start, n), m)
    pre = watch.preempted
    assert len(pre) >= 2, pre
    assert any(p["in_prefill"] and p["cached"] > 0 for p in pre), f"no preemption in the middle of a prefill: {pre}"
    if k:
        assert any(p["drafted"] > 0 and p["output_tokens"] > 0 for p in pre), f"no preemption after drafting: {pre}"


# ---------------------------------------------------------------------------------------------
# max_tokens / max_seq_len with drafts
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [3, 4])
@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_small_max_tokens_with_drafts(shipped_engine, corpus, alone, k, max_tokens) -> None:
    """Drafts stop at max_tokens - 1 and need no KV room past prompt + max_tokens - 1: a 31-token prompt
    (prompt + 1 fills 2 blocks exactly) never takes a third block for max_tokens <= 2; alone and beside
    other requests the output is plain greedy decoding's."""
    p = prompt(corpus, 0, 31)
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=k, speculation="fixed", max_seq_len=MAX_SEQ_LEN)) as ex:
        watch = Watch(ex)
        out = ex.submit(p, greedy(max_tokens)).result(30)
        assert out.finish_reason == "length" and out.token_ids == alone(p, max_tokens)
        assert out.stats.output_tokens == max_tokens
        assert [d for r, _, d in sum(watch.plans, []) if r == out.request_id][:2] == [0, max_tokens - 1]
        assert watch.peak_used == ex.cache.blocks_for(len(p) + max_tokens - 1)
        assert_all_free(ex)
        # the same in a batch where the others draft k
        go = threading.Event()
        hold_inbox_until(ex, go)
        others = [ex.submit(prompt(corpus, 100 + 40 * i, 20 + i), greedy(12)) for i in range(2)]
        h = ex.submit(p, greedy(max_tokens))
        go.set()
        assert h.result(30).token_ids == alone(p, max_tokens)
        for i, o in enumerate(others):
            assert o.result(30).token_ids == alone(prompt(corpus, 100 + 40 * i, 20 + i), 12)
        assert_all_free(ex)
    watch.check()
    assert max(d for plan in watch.plans for _, _, d in plan) == k


def test_prompt_of_max_seq_len_minus_one(shipped_engine, corpus, alone) -> None:
    """max_seq_len 64: a 63-token prompt gets exactly one token (no drafts, no block past its 4), a longer
    request is refused with the limits named, and prompts near the limit with k = 4 stop at it."""
    msl = 64
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=4, speculation="fixed", max_seq_len=msl)) as ex:
        watch = Watch(ex)
        p = prompt(corpus, 0, msl - 1)
        out = ex.submit(p, greedy(1)).result(30)
        assert out.finish_reason == "length" and out.token_ids == alone(p, 1)
        assert out.stats.num_draft_tokens == 0
        assert watch.peak_used == ex.cache.blocks_for(msl - 1)
        with pytest.raises(ValueError) as e:
            ex.submit(p, SamplingParams(max_tokens=2))
        assert str(e.value) == "max_tokens 2 with a 63-token prompt exceeds max_seq_len 64; at most 1"
        with pytest.raises(ValueError) as e:
            ex.submit(prompt(corpus, 0, msl), SamplingParams(max_tokens=1))
        assert str(e.value) == "prompt has 64 tokens; max_seq_len is 64"
        hs = {n: ex.submit(prompt(corpus, 0, n), greedy(msl - n)) for n in (57, 59, 60, 62)}
        for n, h in hs.items():
            o = h.result(30)
            assert o.finish_reason == "length" and o.token_ids == alone(prompt(corpus, 0, n), msl - n), n
            assert len(o.token_ids) + n == msl
        assert_all_free(ex)
    watch.check()


def test_cache_too_small_for_a_request_is_refused_with_the_numbers(shipped_engine, corpus, alone) -> None:
    """3 blocks of 16: a 40-token prompt with max_tokens 10 caches 49 positions (the last token is never
    cached): refused, naming the numbers; with max_tokens 8 it runs, drafting, in the 3 blocks."""
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed", kv_cache_tokens=32)) as ex:
        assert ex.cache.allocator.num_blocks == 3
        watch = Watch(ex)
        with pytest.raises(ValueError) as e:
            ex.submit(prompt(corpus, 0, 40), greedy(10))
        assert str(e.value) == ("max_tokens 10 with a 40-token prompt needs 4 KV blocks; the cache has 3 of 16 "
                                "tokens")
        out = ex.submit(prompt(corpus, 0, 40), greedy(8)).result(30)
        assert out.finish_reason == "length" and out.token_ids == alone(prompt(corpus, 0, 40), 8)
        assert out.stats.num_draft_tokens > 0
        assert_all_free(ex)
    watch.check()


def test_request_that_fits_the_cache_exactly_is_accepted(shipped_engine, corpus, alone) -> None:
    """The last generated token is never cached (drafts stop short of it), so a request needs blocks for
    prompt + max_tokens - 1 positions: 40 + 9 - 1 = 48 fit 3 blocks exactly (validate once asked for 4)."""
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=3, speculation="fixed", kv_cache_tokens=32)) as ex:
        assert ex.cache.allocator.num_blocks == 3
        watch = Watch(ex)
        p = prompt(corpus, 0, 40)
        assert ex.cache.blocks_for(len(p) + 9 - 1) == 3  # positions 0..47 are all it ever caches
        out = ex.submit(p, greedy(9)).result(30)
        assert out.finish_reason == "length" and out.token_ids == alone(p, 9)
        assert watch.peak_used == 3
        assert_all_free(ex)
    watch.check()


def test_drafts_never_take_a_later_decodes_token(shipped_engine, corpus, alone) -> None:
    """Budget 4, k = 3: the older decode's drafts shrink so that the younger one decodes every step too
    (it was skipped for 8 steps in a row when the first took 1 + 3 tokens)."""
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=3, speculation="fixed", max_num_tokens=4,
                                                 max_seq_len=MAX_SEQ_LEN)) as ex:
        sched, schedule, skipped, drafted = ex.scheduler, ex.scheduler.schedule, [], []

        def watched():
            decoding = {s.request_id for s in sched.running if not s.in_prefill}
            plan = schedule()
            skipped.extend(decoding - {it.seq.request_id for it in plan})
            drafted.extend(it.num_drafts for it in plan)
            return plan

        sched.schedule = watched
        go = threading.Event()
        hold_inbox_until(ex, go)
        reqs = {"a": 0, "b": 50}
        hs = {rid: ex.submit(prompt(corpus, start, 3), greedy(12), request_id=rid) for rid, start in reqs.items()}
        go.set()
        outs = {rid: h.result(60) for rid, h in hs.items()}
        assert_all_free(ex)
    assert skipped == []
    assert max(drafted) == 3  # alone at the end, a decode still drafts k
    for rid, start in reqs.items():
        assert outs[rid].token_ids == alone(prompt(corpus, start, 3), 12)


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_token_budget_below_one_plus_k(shipped_engine, corpus, alone, budget) -> None:
    """max_num_tokens < 1 + the default k (3): each step stays within the budget (the default drafts budget - 1; a k
    given is refused, test_executor's test_limits_above_the_engine_are_refused), prompts are prefilled budget tokens
    at a time, and nothing waits forever."""
    with Executor(shipped_engine, ExecutorConfig(speculation="fixed", max_num_tokens=budget,
                                                 max_seq_len=MAX_SEQ_LEN)) as ex:
        watch = Watch(ex)
        go = threading.Event()
        hold_inbox_until(ex, go)
        reqs = [(0, 12, 10), (100, 1, 8), (200, 7, 6)]
        hs = [ex.submit(prompt(corpus, s, n), greedy(m)) for s, n, m in reqs]
        go.set()
        outs = [h.result(60) for h in hs]
        assert_all_free(ex)
    watch.check()
    for (s, n, m), o in zip(reqs, outs):
        assert o.token_ids == alone(prompt(corpus, s, n), m)
    assert max(d for plan in watch.plans for _, _, d in plan) == budget - 1
    assert max(sum(n for _, n, _ in plan) for plan in watch.plans) == budget


# ---------------------------------------------------------------------------------------------
# Cancellation: waiting, mid chunked prefill, preempted, finished; ids reused
# ---------------------------------------------------------------------------------------------
def test_cancel_request_waiting_for_kv_blocks(shipped_engine, corpus, alone) -> None:
    """A 69-token prefill takes all 5 blocks; a second request waits for blocks (not for a batch seat).
    Cancelled there it ends at once with no tokens, was never scheduled, and the first is unaffected."""
    first_token, cancelled = threading.Event(), threading.Event()
    seen = {}

    def pause(o: RequestOutput) -> None:  # executor thread
        if not first_token.is_set():
            seen["stats"] = ex.stats()
            first_token.set()
            cancelled.wait(30)

    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=3, speculation="fixed", kv_cache_tokens=64,
                                                 max_seq_len=MAX_SEQ_LEN)) as ex:
        watch = Watch(ex)
        go = threading.Event()
        hold_inbox_until(ex, go)
        big = ex.submit(prompt(corpus, 0, 70), greedy(10), on_output=pause)
        small = ex.submit(prompt(corpus, 200, 10), greedy(10))
        go.set()
        assert first_token.wait(30)
        s = seen["stats"]
        assert (s.running, s.queued, s.kv_blocks_used, s.kv_blocks_free) == (1, 1, 5, 0), s
        small.cancel()
        cancelled.set()
        out = small.result(10)
        assert out.finish_reason == "cancelled" and out.token_ids == [] and out.text == ""
        assert out.stats.queue_s is None and out.stats.num_steps == 0
        assert big.result(30).token_ids == alone(prompt(corpus, 0, 70), 10)
        assert ex.stats().requests_finished == 2
        assert_all_free(ex)
    watch.check()
    assert watch.steps_of(small.request_id) == []


def test_cancel_during_chunked_prefill_frees_its_blocks_at_once(shipped_engine, corpus, alone) -> None:
    """Budget 8 beside a decode drafting 2: a 60-token prompt is prefilled 5 tokens a step. Cancelled after
    three chunks, it ends with no tokens, holds no block when its final output arrives, and never runs again."""
    chunks, resume = threading.Event(), threading.Event()
    at_final = {}
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed", max_num_tokens=8,
                                                 max_seq_len=MAX_SEQ_LEN)) as ex:
        watch = Watch(ex)
        update = ex.scheduler.update_from_output

        def gated(*args):  # executor thread: once the third chunk is applied, no step until the test has cancelled
            update(*args)
            if not chunks.is_set() and sum("long" in p for p in watch.prefilling) == 3:
                chunks.set()
                resume.wait(30)

        ex.scheduler.update_from_output = gated

        def on_final(o: RequestOutput) -> None:  # executor thread
            if o.finished:
                at_final["used"] = ex.stats().kv_blocks_used
                at_final["held"] = sum(len(s.block_table) for s in ex.scheduler.running)
                at_final["running"] = [s.request_id for s in ex.scheduler.running]

        decoding, submitted = threading.Event(), threading.Event()

        def first_output(o: RequestOutput) -> None:  # executor thread: `long` joins right after this step
            if not decoding.is_set():
                decoding.set()
                submitted.wait(30)

        other = ex.submit(prompt(corpus, 300, 20), greedy(40), request_id="other", on_output=first_output)
        assert decoding.wait(30)
        long = ex.submit(prompt(corpus, 0, 60), greedy(10), request_id="long", on_output=on_final)
        submitted.set()
        assert chunks.wait(30)
        seq = ex._requests["long"][0]
        assert seq.in_prefill and seq.num_cached == 15 and len(seq.block_table) == 1, (seq.num_cached, seq.block_table)
        steps_before = len(watch.plans)
        long.cancel()
        resume.set()
        out = long.result(10)
        assert out.finish_reason == "cancelled" and out.token_ids == []
        assert at_final["running"] == ["other"] and at_final["used"] == at_final["held"] > 0, at_final
        assert other.result(30).token_ids == alone(prompt(corpus, 300, 20), 40)
        assert_all_free(ex)
    watch.check()
    assert all(s < steps_before for s in watch.steps_of("long"))


def test_cancel_preempted_request(shipped_engine, corpus, alone) -> None:
    """A request preempted (blocks freed, waiting to be recomputed) and cancelled before it is readmitted:
    it ends with the tokens it had (a prefix of its output alone), holds nothing, and the rest finish exactly."""
    resume, hit = threading.Event(), threading.Event()
    state: dict = {}
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=3, speculation="fixed", kv_cache_tokens=64,
                                                 max_num_tokens=16, max_seq_len=MAX_SEQ_LEN)) as ex:
        watch = Watch(ex)
        step = ex.runner.step

        def gated(items):  # executor thread: the first time a preempted request is still waiting after a schedule
            if "victim" not in state:
                ids = {p["id"] for p in watch.preempted}
                waiting = [s for s in ex.scheduler.waiting if s.request_id in ids and s.num_output_tokens > 0]
                if waiting:
                    state["victim"] = waiting[0].request_id
                    state["tokens"] = waiting[0].num_output_tokens
                    hit.set()
                    resume.wait(30)
            return step(items)

        ex.runner.step = gated
        at_final = {}
        finished = []

        def on_output(o: RequestOutput) -> None:  # executor thread
            if o.finished:
                finished.append(o.request_id)
                if len(finished) == len(PREEMPT):
                    hit.set()  # all done without the gate: fail below rather than wait
                if o.request_id == state.get("victim"):
                    at_final["used"] = ex.stats().kv_blocks_used
                    at_final["held"] = sum(len(s.block_table) for s in ex.scheduler.running)

        go = threading.Event()
        hold_inbox_until(ex, go)
        hs = {f"r{i}": ex.submit(prompt(corpus, s, n), greedy(m), request_id=f"r{i}", on_output=on_output)
              for i, (s, n, m) in enumerate(PREEMPT)}
        go.set()
        assert hit.wait(60)
        assert "victim" in state, f"no preempted request was left waiting: {watch.preempted}"
        victim = state["victim"]
        hs[victim].cancel()
        resume.set()
        outs = {rid: h.result(60) for rid, h in hs.items()}
        assert_all_free(ex)
    watch.check()
    for i, (s, n, m) in enumerate(PREEMPT):
        rid, ref = f"r{i}", alone(prompt(corpus, s, n), m)
        if rid == victim:
            assert outs[rid].finish_reason == "cancelled"
            assert outs[rid].token_ids == ref[: state["tokens"]]
        else:
            assert outs[rid].finish_reason == "length" and outs[rid].token_ids == ref, rid
    assert at_final["used"] == at_final["held"], at_final


def test_cancel_after_finish_and_in_the_inbox(shipped_engine, corpus, alone) -> None:
    """Cancelling a finished request changes nothing (no second final output, no count); a request
    cancelled before the step loop took it ends cancelled with no tokens and is never scheduled."""
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=3, speculation="fixed", max_seq_len=MAX_SEQ_LEN)) as ex:
        watch = Watch(ex)
        outputs = []
        h = ex.submit(prompt(corpus, 0, 20), greedy(6), request_id="done", on_output=outputs.append)
        final = h.result(30)
        assert final.finish_reason == "length" and final.token_ids == alone(prompt(corpus, 0, 20), 6)
        h.cancel()
        ex.cancel("done")
        # a request submitted after those cancels runs past any step that could have taken them
        after = ex.submit(prompt(corpus, 100, 9), greedy(4)).result(30)
        assert after.finish_reason == "length"
        assert h.result(0) is final and sum(o.finished for o in outputs) == 1
        assert ex.stats().requests_finished == 2
        go = threading.Event()
        hold_inbox_until(ex, go)
        early = ex.submit(prompt(corpus, 200, 9), greedy(4), request_id="early")
        early.cancel()
        kept = ex.submit(prompt(corpus, 300, 9), greedy(4))
        go.set()
        out = early.result(30)
        assert out.finish_reason == "cancelled" and out.token_ids == []
        assert kept.result(30).token_ids == alone(prompt(corpus, 300, 9), 4)
        assert ex.stats().requests_finished == 4
        assert_all_free(ex)
    watch.check()
    assert watch.steps_of("early") == []


def test_request_ids_reused_after_finish(shipped_engine, corpus, alone) -> None:
    """An id is free again once its request finished: reused in turn, from the finished request's own final
    callback, and refused (with the message) while in flight; outputs are each prompt's own."""
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=3, speculation="fixed", max_seq_len=MAX_SEQ_LEN)) as ex:
        for i in range(3):
            out = ex.submit(prompt(corpus, 50 * i, 10 + i), greedy(5), request_id="same").result(30)
            assert out.request_id == "same" and out.token_ids == alone(prompt(corpus, 50 * i, 10 + i), 5)
        chained: list = []
        done = threading.Event()

        def resubmit(o: RequestOutput) -> None:  # executor thread, at the final output
            if o.finished and not chained:
                chained.append(ex.submit(prompt(corpus, 400, 13), greedy(7), request_id="same",
                                         on_output=lambda o2: o2.finished and done.set()))

        go = threading.Event()
        hold_inbox_until(ex, go)  # `first` cannot finish before the duplicate is tried
        first = ex.submit(prompt(corpus, 300, 12), greedy(7), request_id="same", on_output=resubmit)
        with pytest.raises(ValueError) as e:
            ex.submit(prompt(corpus, 0, 5), greedy(3), request_id="same")
        assert str(e.value) == "request_id 'same' is already in flight"
        go.set()
        assert first.result(30).token_ids == alone(prompt(corpus, 300, 12), 7)
        assert done.wait(30)
        assert chained[0].result(0).token_ids == alone(prompt(corpus, 400, 13), 7)
        assert_all_free(ex)


def test_a_submit_that_fails_frees_its_request_id(shipped_engine, corpus, alone, monkeypatch) -> None:
    """A failure while the request's state is made (a device allocation, a guide recompiled) left its id claimed: every
    later request under that id was refused "already in flight"."""
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=0, max_seq_len=MAX_SEQ_LEN)) as ex:
        def fail(*args, **kwargs):
            raise MemoryError("test: no room for the penalty counts")

        with monkeypatch.context() as m:
            m.setattr(native.PenaltyState, "create", fail)
            with pytest.raises(MemoryError):
                ex.submit(prompt(corpus, 0, 8), SamplingParams(max_tokens=3, repetition_penalty=1.2), request_id="x")
        out = ex.submit(prompt(corpus, 0, 8), greedy(3), request_id="x").result(30)
        assert out.token_ids == alone(prompt(corpus, 0, 8), 3)
        assert_all_free(ex)


# ---------------------------------------------------------------------------------------------
# Batch limits and statistics
# ---------------------------------------------------------------------------------------------
def test_many_requests_beyond_max_batch_size(shipped_engine, corpus, alone) -> None:
    """14 requests at once, 3 seats: never more than 3 running, the rest queued, all exact, counts consistent."""
    reqs = [(37 * i, 3 + 5 * i, 4 + (i % 5)) for i in range(14)]
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=2, speculation="fixed", max_batch_size=3,
                                                 max_seq_len=MAX_SEQ_LEN)) as ex:
        watch, log = Watch(ex), StatsLog(ex)
        go = threading.Event()
        hold_inbox_until(ex, go)
        hs = [log.submit(prompt(corpus, s, n), greedy(m)) for s, n, m in reqs]
        assert ex.stats().queued == 14
        go.set()
        outs = [h.result(60) for h in hs]
        stats = ex.stats()
        assert_all_free(ex)
    watch.check()
    log.check()
    assert log.max_running == 3 and log.max_queued >= 10
    for (s, n, m), o in zip(reqs, outs):
        assert o.finish_reason == "length" and o.token_ids == alone(prompt(corpus, s, n), m)
    assert stats.requests_finished == 14 and stats.generated_tokens == sum(m for _, _, m in reqs)
    assert stats.draft_tokens == sum(o.stats.num_draft_tokens for o in outs)
    assert stats.accepted_draft_tokens == sum(o.stats.num_accepted_draft_tokens for o in outs)


# ---------------------------------------------------------------------------------------------
# Seeded sampling: the same output alone and batched
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("speculation, k, kv", [("off", 0, None), ("fixed", 3, None), ("off", 0, 64)])
def test_seeded_sampling_batched_equals_alone(shipped_engine, corpus, speculation, k, kv) -> None:
    """A seed makes a sampled request repeat its output: alone vs beside greedy and other sampled requests arriving
    at other times (and, at k = 0, under preemption in a 5-block cache)."""
    params = [SamplingParams(max_tokens=20, temperature=0.9, seed=s, top_k=tk, top_p=tp, ignore_eos=True)
              for s, tk, tp in [(1, 0, 1.0), (2, 50, 1.0), (3, 0, 0.9)]]
    ps = [prompt(corpus, 0, 30), prompt(corpus, 120, 12), prompt(corpus, 240, 45)]
    config = ExecutorConfig(num_draft_tokens=k, speculation=speculation, kv_cache_tokens=kv, max_seq_len=MAX_SEQ_LEN)
    with Executor(shipped_engine, config) as ex:
        solo = [ex.submit(p, sp).result(30).token_ids for p, sp in zip(ps, params)]
    with Executor(shipped_engine, config) as ex:
        watch = Watch(ex)
        later: list = []

        def join(o: RequestOutput) -> None:  # executor thread: the third joins while the others decode
            if len(o.token_ids) >= 5 and not later:
                later.append(ex.submit(ps[2], params[2]))

        go = threading.Event()
        hold_inbox_until(ex, go)
        g1 = ex.submit(prompt(corpus, 360, 25), greedy(30), on_output=join)
        hs = [ex.submit(p, sp) for p, sp in zip(ps[:2], params[:2])]
        g2 = ex.submit(prompt(corpus, 500, 7), greedy(12))
        go.set()
        batched = [h.result(60).token_ids for h in hs]
        g1.result(60), g2.result(60)
        assert later
        batched.append(later[0].result(60).token_ids)
        assert_all_free(ex)
    watch.check()
    for i, (a, b) in enumerate(zip(solo, batched)):
        assert a == b, f"sampled request {i} ({speculation}, k={k}, kv={kv}) changed in a batch"
    if kv:
        assert watch.preempted, "no preemption"


# ---------------------------------------------------------------------------------------------
# Stop conditions inside accepted drafts
# ---------------------------------------------------------------------------------------------
STOP_PROMPTS = [(0, 20), (64, 33), (128, 15), (256, 41), (384, 26)]


def stop_inside_a_draft_run(shipped_engine, corpus, k: int) -> tuple[list[int], list[int], int]:
    """(prompt, greedy output, i): output[i] is an accepted draft of a step that emitted tokens after it,
    and its first occurrence in the output (a stop id there ends the request at i)."""
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=k, speculation="fixed", max_seq_len=MAX_SEQ_LEN)) as ex:
        watch = Watch(ex)
        for start, n in STOP_PROMPTS:
            p = prompt(corpus, start, n)
            out = ex.submit(p, greedy(REF_TOKENS)).result(30)
            produced = 0
            for step in watch.emitted:
                for rid, new, drafts, accepted in step:
                    if rid != out.request_id:
                        continue
                    # positions of the accepted drafts that are followed by more tokens of the same step
                    for j in range(1, len(new) - 1):
                        i = produced + j
                        if j <= accepted and i >= 2 and out.token_ids.index(out.token_ids[i]) == i:
                            return p, out.token_ids, i
                    produced += len(new)
    pytest.fail("no accepted draft run with a fresh token inside it")


@pytest.mark.parametrize("k", [3, 4])
def test_stop_token_inside_accepted_drafts(shipped_engine, corpus, alone, k) -> None:
    """A stop id that the target accepts in the middle of a run of drafts ends the request right before it:
    the tokens the same step emitted after it are never reported (not in the stream, the result, the text or
    the counts), alone and batched. With max_tokens at the same token, the stop id wins (stop, not length)."""
    p, ref, i = stop_inside_a_draft_run(shipped_engine, corpus, k)
    assert ref == alone(p, REF_TOKENS)
    stop_id = ref[i]
    config = ExecutorConfig(num_draft_tokens=k, speculation="fixed", max_seq_len=MAX_SEQ_LEN)
    with Executor(shipped_engine, config) as ex, Executor(shipped_engine, config) as batched:
        watch = Watch(ex)
        streamed: list[RequestOutput] = []
        out = ex.submit(p, greedy(REF_TOKENS, stop_token_ids=[stop_id]), on_output=streamed.append).result(30)
        assert out.finish_reason == "stop" and out.token_ids == ref[:i]
        assert out.text == ex.tokenizer.decode(ref[:i])
        assert sum((o.new_token_ids for o in streamed), []) == ref[:i]
        assert "".join(o.text_delta for o in streamed) == out.text
        assert out.stats.output_tokens == i and ex.stats().generated_tokens == i
        # the runner really emitted tokens past the stop id in one step
        emitted = [new for step in watch.emitted for rid, new, _, _ in step if rid == out.request_id]
        assert any(stop_id in new and new.index(stop_id) < len(new) - 1 for new in emitted), emitted
        for max_tokens, reason in ((i + 1, "stop"), (i, "length")):
            o = ex.submit(p, greedy(max_tokens, stop_token_ids=[stop_id])).result(30)
            assert (o.finish_reason, o.token_ids) == (reason, ref[:i]), max_tokens
        assert_all_free(ex)
        # batched, beside requests that keep drafting
        go = threading.Event()
        hold_inbox_until(batched, go)
        others = [batched.submit(prompt(corpus, 500 + 30 * j, 9 + j), greedy(24)) for j in range(3)]
        h = batched.submit(p, greedy(REF_TOKENS, stop_token_ids=[stop_id]))
        go.set()
        o = h.result(30)
        assert (o.finish_reason, o.token_ids) == ("stop", ref[:i])
        for j, other in enumerate(others):
            assert other.result(30).token_ids == alone(prompt(corpus, 500 + 30 * j, 9 + j), 24)
        assert_all_free(batched)
    watch.check()


def test_eos_inside_accepted_drafts(shipped_engine, corpus, alone, shipped_model_dir, tmp_path) -> None:
    """The same with eos: a copy of the shipped model whose tokenizer names that token eos stops before it
    (eos never in the output), and ignore_eos runs past it."""
    k = 3
    p, ref, i = stop_inside_a_draft_run(shipped_engine, corpus, k)
    model = tmp_path / "eos-model"
    model.mkdir()
    for f in shipped_model_dir.iterdir():
        if f.name != "tokenizer_config.json":
            os.symlink(f, model / f.name)
    cfg = json.loads((shipped_model_dir / "tokenizer_config.json").read_text())
    cfg["eos_token"] = Tokenizer.from_dir(shipped_engine.path).backend.id_to_token(ref[i])
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    eos_engine = load_engine(model, dtype="float32")
    with Executor(eos_engine, ExecutorConfig(num_draft_tokens=k, speculation="fixed", max_seq_len=MAX_SEQ_LEN)) as ex:
        assert ex.tokenizer.eos_token_id == ref[i]
        out = ex.submit(p, SamplingParams(max_tokens=REF_TOKENS)).result(30)
        assert out.finish_reason == "stop" and out.token_ids == ref[:i]
        out = ex.submit(p, SamplingParams(max_tokens=REF_TOKENS, ignore_eos=True)).result(30)
        assert out.finish_reason == "length" and out.token_ids == ref
        assert_all_free(ex)



# ---------------------------------------------------------------------------------------------
# When KV blocks run out, new requests wait
# ---------------------------------------------------------------------------------------------
def record_overtaking(ex: Executor) -> list[dict]:
    """Wrap the scheduler: note every step that admitted a waiting request while a running request's
    prefill chunk was held back for want of KV blocks (not for want of token budget)."""
    sched, events = ex.scheduler, []
    schedule = sched.schedule

    def watched():
        prefilling = [s for s in sched.running if s.in_prefill]
        waiting = list(sched.waiting)
        plan = schedule()
        planned = {id(it.seq) for it in plan}
        held_back = [s.request_id for s in prefilling if id(s) not in planned and s in sched.running]
        admitted = [it.seq.request_id for it in plan if it.seq in waiting]
        if held_back and admitted:
            events.append(dict(held_back=held_back, admitted=admitted, free_after=ex.cache.allocator.num_free))
        return plan

    sched.schedule = watched
    return events


def test_new_requests_wait_while_an_admitted_prefill_waits_for_blocks(shipped_engine, corpus, alone) -> None:
    """r1 (35-token prompt, chunked by a 24-token budget) needs 2 blocks for its second chunk while 1 is free:
    r2, queued behind it, must not take that block (a steady stream of short requests could otherwise
    overtake a long prompt for ever); r1 waits for r0 to finish, and outputs stay exact."""
    reqs = {"r0": (0, 10, 3), "r1": (100, 35, 4), "r2": (200, 10, 3)}
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=0, speculation="off", kv_cache_tokens=32, max_num_tokens=24,
                                                 max_seq_len=MAX_SEQ_LEN)) as ex:
        assert ex.cache.allocator.num_blocks == 3
        watch = Watch(ex)
        events = record_overtaking(ex)
        go = threading.Event()
        hold_inbox_until(ex, go)
        hs = {rid: ex.submit(prompt(corpus, s, n), greedy(m), request_id=rid) for rid, (s, n, m) in reqs.items()}
        go.set()
        outs = {rid: h.result(60) for rid, h in hs.items()}
        assert_all_free(ex)
    watch.check()
    for rid, (s, n, m) in reqs.items():
        assert outs[rid].token_ids == alone(prompt(corpus, s, n), m)
    assert events == [], f"new requests were admitted while an admitted request's prefill waited for blocks: {events}"


def test_drafts_count_as_accepted_only_where_the_output_keeps_them(shipped_engine, corpus) -> None:
    """A stop (eos, a stop id, a guide's end) inside a step's accepted drafts ends the output there: the drafts after
    it were counted as accepted (2 output tokens, 4 accepted in 1 step), so the stats did not add up. Each step
    keeps its accepted drafts and its one token more as far as the output goes."""
    from runtime.core.sampling_params import GuidedDecodingParams

    cases = [SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(regex="(return|yield|pass|raise)")),
             SamplingParams(max_tokens=60, stop_token_ids=[16])]
    with Executor(shipped_engine, ExecutorConfig(num_draft_tokens=4, speculation="fixed")) as ex:
        outs = [ex.submit(prompt(corpus, s, 40), p).result(120) for p in cases for s in range(4)]
        stats = ex.stats()
        assert_all_free(ex)
    assert any(o.stats.num_accepted_draft_tokens for o in outs)
    for o in outs:
        st = o.stats
        assert st.num_accepted_draft_tokens <= st.output_tokens <= st.num_steps + st.num_accepted_draft_tokens, st
    assert stats.accepted_draft_tokens == sum(o.stats.num_accepted_draft_tokens for o in outs)
