"""Helpers shared by the executor tests: ordering the step loop against the test's thread, outputs of a fresh
executor, and the end-of-test check that every KV block came back."""

from __future__ import annotations

import threading

import pytest

from runtime.core.model_runner import ModelRunner
from runtime.core.sampling_params import SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.executors.outputs import RequestOutput


def seeded_requests_take_rejection_sampling(mp: pytest.MonkeyPatch) -> None:
    """Seeded sampled requests race (runtime.core.sampling); the others, whose seeds a test cannot choose, take
    rejection sampling: this gives seeded requests the others' path, for tests of it."""
    mp.setattr(ModelRunner, "_raced_rows", lambda self, seqs: [])


def hold_inbox_until(ex: Executor, event: threading.Event) -> None:
    """Make the step loop wait for `event` before it next takes submitted requests: everything submitted
    meanwhile joins the scheduler in one step, however slowly the test's thread runs on a loaded machine."""
    drain = ex._drain_inbox

    def held() -> None:
        event.wait(30)
        ex._drain_inbox = drain  # once: a test that fails before setting the event waits 30 s, not at every step
        drain()

    ex._drain_inbox = held


def assert_all_free(ex: Executor) -> None:
    s = ex.stats()
    assert s.kv_blocks_used == 0 and s.kv_blocks_free == ex.cache.allocator.num_blocks, s
    assert s.running == 0 and s.queued == 0, s
    assert ex.cache.allocator.all_free(), "a block is missing from the free list or is on it twice"


def run_fresh(engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], k: int, *,
              alone: bool = False, speculation: str = "fixed", max_seq_len: int = 256, **config) -> list[RequestOutput]:
    """Outputs on a fresh executor drafting k tokens (0: plain), all submitted together or one at a time; every
    KV block back at the end."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    cfg = ExecutorConfig(num_draft_tokens=k, speculation=speculation, max_seq_len=max_seq_len,
                         **config)
    with Executor(engine, cfg) as ex:
        if alone:
            outs = [ex.submit(p, sp).result(120) for p, sp in zip(prompts, params)]
        else:
            outs = [h.result(120) for h in [ex.submit(p, sp) for p, sp in zip(prompts, params)]]
        assert_all_free(ex)
    return outs
