"""Delivering a step's outputs to their callbacks and handles: at once on the step loop's thread, or overlapped, on a
thread of its own while the next step's forward runs (ExecutorConfig.overlap_outputs)."""

from __future__ import annotations

import logging
import queue
import threading

from runtime.executors.requests import RequestOutput, RequestTracker

log = logging.getLogger("runtime.executors.delivery")


class OutputDelivery:
    """The step loop builds each output (RequestTracker.output: a snapshot later steps do not change) and sends it
    here. Inline, send() delivers it at once. Overlapped, send() holds it until hand_off(), which the loop calls just
    before a forward and before it waits idle; the delivery thread then delivers while the forward runs, one hand-off
    at a time and in the order sent, so each request's outputs stay in order. hand_off() first waits until the
    previous hand-off is delivered: a slow consumer holds the loop back as it does inline (and a stuck callback
    shows as a stalled step loop)."""

    def __init__(self, overlap: bool):
        self._pending: list[tuple[RequestTracker, list[RequestOutput]]] = []
        self._queue: queue.SimpleQueue[list[tuple[RequestTracker, list[RequestOutput]]] | None] | None = None
        self._delivered = threading.Semaphore(1)  # taken by a hand-off, given back once it is delivered
        if overlap:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name="executor-outputs", daemon=True)
            self._thread.start()

    def send(self, tracker: RequestTracker, outs: list[RequestOutput]) -> None:
        if self._queue is None:
            tracker.deliver(outs)
        elif outs:
            self._pending.append((tracker, outs))

    def hand_off(self) -> None:
        """Overlapped: give what was sent since the last hand-off to the delivery thread."""
        if self._pending:
            self._delivered.acquire()
            self._queue.put(self._pending)
            self._pending = []

    def close(self) -> None:
        """Deliver everything sent, then end the delivery thread."""
        if self._queue is not None:
            self.hand_off()
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            try:
                for tracker, outs in batch:
                    tracker.deliver(outs)
            except Exception:  # a bug of ours (callbacks' errors are caught in deliver): the loop must not wait forever
                log.exception("delivering outputs failed")
            finally:
                self._delivered.release()
