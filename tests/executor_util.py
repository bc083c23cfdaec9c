"""Helpers shared by the executor tests: ordering the step loop against the test's thread, and the
end-of-test check that every KV block came back."""

from __future__ import annotations

import threading

from runtime.executors.native import Executor


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
