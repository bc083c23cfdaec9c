"""A request's handle: its outputs delivered to a thread (iterate, or wait for the result) or to an asyncio task,
and its cancellation; the same for every backend's executor."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, replace
from typing import AsyncIterator, Iterator, Protocol

from runtime.core.sampling import TokenLogprob
from runtime.executors.outputs import RequestOutput


class Canceller(Protocol):
    """What a request handle needs of its executor."""

    def cancel(self, request_id: str, handle: "RequestHandle | None" = None) -> None: ...


class RequestHandle:
    """Outputs of one request: iterate (blocking or async) over deltas, or wait for the result.

    The handle keeps the newest output of each of the request's outputs (`RequestOutput.index`; one unless
    SamplingParams.n > 1) and what iteration has not handed out yet. An output that arrives before a consumer has
    taken the one of the same index waiting is merged into it (tokens and text deltas joined, the rest from the
    newer), as vLLM merges the outputs a slow consumer has not collected: a consumer that falls behind, or only
    waits for the result, holds one output per index rather than one per step. An output leaves only when a consumer takes it, under the lock, so an async wait cancelled by a timeout
    loses nothing and the same iterator carries on. Async consumers wait on a future of their own event loop,
    woken by the executor's thread, not on a worker thread each (a pool's threads would run out with many
    streams). Waiting for the result wakes when the request finishes, not at every output (a batch's waiters
    would take turns at the GIL with the executor's thread). Waiting on the thread that delivers the outputs (an
    output callback's) is refused: what it waits for would never come.
    """

    def __init__(self, request_id: str, executor: Canceller, num_outputs: int = 1,
                 delivered_by: threading.Thread | None = None):
        self.request_id = request_id
        self.num_outputs = num_outputs
        self._executor = executor
        self._delivered_by = delivered_by  # the thread that pushes the outputs (and runs output callbacks)
        self._last: dict[int, RequestOutput] = {}  # the newest output of each index
        self._pending: dict[int, _Unread] = {}  # not taken yet, per index: every output since
        self._finals_taken = 0
        self._buffered = True  # False after callback_only(): outputs go to on_output alone
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        lock = threading.Lock()
        self._arrived = threading.Condition(lock)  # any output
        self._finished = threading.Condition(lock)  # the final one of every index

    def _push(self, out: RequestOutput) -> None:
        with self._arrived:
            self._last[out.index] = out
            if self._buffered:
                held = self._pending.get(out.index)
                if held is None:
                    self._pending[out.index] = _Unread(out)
                else:
                    held.add(out)
            self._arrived.notify_all()
            if self.finished:
                self._finished.notify_all()
            waiters, self._async_waiters = self._async_waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # that consumer's event loop is closed: nobody waits there any more
                pass

    def _take(self) -> RequestOutput:
        """The oldest output not handed out yet; call with the lock held and something pending."""
        out = self._pending.pop(next(iter(self._pending))).output()
        self._finals_taken += out.finished
        if self._delivered_final:  # another thread iterating the handle waits for what will now never come
            self._arrived.notify_all()
        return out

    def callback_only(self) -> None:
        """Keep no outputs for iteration from now on, for a caller that reads them through on_output alone (the
        engine process's child, a Triton model): each output merged into an unread one copies every token so
        far, O(n^2) over a long stream. result() and finished still answer; iterating raises."""
        with self._arrived:
            self._buffered, self._pending = False, {}

    def _check_can_wait(self, name: str) -> None:
        """Refuse a wait on the thread that would end it: an output callback waiting on a handle stalled every
        request of the executor."""
        if threading.current_thread() is self._delivered_by:
            raise RuntimeError(f"{name} of request {self.request_id} cannot wait on the thread that delivers "
                               "outputs (an output callback): it would wait forever; wait from another thread")

    def _check_buffered(self) -> None:
        if not self._buffered:
            raise RuntimeError(f"request {self.request_id}'s outputs go to its on_output callback only "
                               "(callback_only() was called); it cannot be iterated")

    @property
    def finished(self) -> bool:
        """Every output of the request has its final one."""
        return len(self._last) == self.num_outputs and all(o.finished for o in self._last.values())

    @property
    def _delivered_final(self) -> bool:
        return self._finals_taken == self.num_outputs

    def cancel(self) -> None:
        """Cancel this request; a no-op once it has finished, even if a later request reuses its id."""
        self._executor.cancel(self.request_id, handle=self)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The final output of a request with one output (`results` gives each of several)."""
        if self.num_outputs != 1:
            raise ValueError(f"request {self.request_id} has {self.num_outputs} outputs (n); use results()")
        return self.results(timeout)[0]

    def results(self, timeout: float | None = None) -> list[RequestOutput]:
        """The final output of each of the request's outputs, by index."""
        with self._finished:
            if not self.finished:
                self._check_can_wait("results()")
            if not self._finished.wait_for(lambda: self.finished, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            return [self._last[i] for i in range(self.num_outputs)]

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            with self._arrived:
                self._check_buffered()
                if self._delivered_final:
                    return
                if not self._pending:
                    self._check_can_wait("iterating the outputs")
                self._arrived.wait_for(lambda: bool(self._pending) or self._delivered_final)
                if not self._pending:
                    return
                out = self._take()
            yield out

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            with self._arrived:
                self._check_buffered()
                if self._delivered_final:
                    raise StopAsyncIteration
                if self._pending:
                    return self._take()
                loop = asyncio.get_running_loop()
                future = loop.create_future()
                self._async_waiters.append((loop, future))
            await future


@dataclass(eq=False)
class _Unread:
    """What no consumer has taken yet of one of a request's outputs: the newest output and, once a second has
    arrived, the new tokens, text deltas and logprobs of all of them gathered in lists of its own, each appended
    once (joining them at every arrival would copy everything unread each time: O(n^2) for a consumer that only
    waits for the result)."""

    newest: RequestOutput
    gathered: tuple[list[int], list[str], list[TokenLogprob] | None] | None = None

    def add(self, out: RequestOutput) -> None:
        if self.gathered is None:
            first = self.newest
            self.gathered = (list(first.new_token_ids), [first.text_delta],
                             None if first.new_logprobs is None else list(first.new_logprobs))
        ids, texts, logprobs = self.gathered
        ids += out.new_token_ids
        texts.append(out.text_delta)
        if logprobs is not None and out.new_logprobs is not None:
            logprobs += out.new_logprobs
        self.newest = out

    def output(self) -> RequestOutput:
        """The newest output, carrying what every one of them brought."""
        if self.gathered is None:
            return self.newest
        ids, texts, logprobs = self.gathered
        return replace(self.newest, new_token_ids=ids, text_delta="".join(texts),
                       new_logprobs=None if self.newest.new_logprobs is None else logprobs)


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def check_callback(on_output: object) -> None:
    """An output callback is a callable or None (else it failed at every output, on the executor's thread)."""
    if on_output is not None and not callable(on_output):
        raise ValueError(f"on_output must be a callable taking a RequestOutput, or None; got {on_output!r:.80}")
