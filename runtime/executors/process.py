"""The executor in a process of its own, as vLLM v1 runs its engine core beside its API server.

In one process a server's event loop (HTTP parsing, response formatting, waking streams) takes the GIL
each time the step loop releases it, at every torch op, and the step loop waits to get it back. Here the
step loop's process runs nothing else: requests, cancels and calls go down a pipe, and each output comes
back as one message that one reader thread hands to its request's handle. A message carries what is new
(tokens, text delta, logprobs; the prompt's logprobs once): the parent rebuilds the cumulative token_ids,
text and logprobs, so a long stream costs each output its own tokens on both sides, not all so far.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import pickle
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass, field, fields, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import torch

from runtime.core.sampling import TokenLogprob
from runtime.core.sampling_params import SamplingParams, check_request_form
from runtime.executors.backends import create_executor
from runtime.executors.base import ExecutorConfig, ExecutorProtocol, ExecutorStats
from runtime.executors.lifetime import forget_at_exit, python_module, spawn, stop_at_exit
from runtime.executors.handles import RequestHandle, check_callback
from runtime.executors.outputs import RequestOutput, RequestStats, so_far
from runtime.executors.requests import RequestIds

log = logging.getLogger("runtime.executors.process")

START_TIMEOUT_S = 600.0  # loading an engine (and profiling its drafts) before the process answers
CALL_TIMEOUT_S = 60.0


def use_engine_process(choice: bool | None, device: str) -> bool:
    """Whether a server runs its executor apart: as asked, else on CUDA devices only. On a CPU the forward's
    torch threads take every core, and a second process's work (pickling, the pipe, the reader) takes them
    from it (docs/openai-server.md measures it); on a GPU the host's cores are free while the device computes."""
    return device.startswith("cuda") if choice is None else choice


def open_server_executor(path: str | Path, config: ExecutorConfig, engine_process: bool | None,
                         torch_threads: int | None) -> ExecutorProtocol:
    """A server's executor, in a process of its own where `use_engine_process` says (the server's threads then never
    hold the GIL its step loop needs); torch_threads set where the forward runs (small decode steps on a busy CPU run
    faster on fewer threads)."""
    if use_engine_process(engine_process, config.device):
        return ProcessExecutor(path, config, torch_threads=torch_threads)
    if torch_threads:
        torch.set_num_threads(torch_threads)
    return create_executor(path, config)


class EngineProcessError(RuntimeError):
    """The engine process failed to start or died."""


@dataclass(eq=False)
class _Output:
    """One output's cumulative view (RequestOutput's token_ids, text and logprobs), rebuilt from the deltas: the
    lists grow in place, each output a view of them (requests.so_far)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    last: RequestOutput | None = None


@dataclass(eq=False)
class _Stream:
    """The parent's side of one request: where its outputs go, and the cumulative view of each of its outputs
    (SamplingParams.n) rebuilt from the deltas the child sends; the prompt's logprobs come once, for all."""

    handle: RequestHandle
    on_output: Callable[[RequestOutput], None] | None
    prompt_tokens: int
    outputs: dict[int, _Output] = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def rebuild(self, delta: Delta) -> RequestOutput:
        """The output as the executor reported it, from what _delta_of sent of it."""
        sent, stats, prompt_logprobs = delta
        fields_of = dict(zip(_SENT, sent))
        o = self.outputs.setdefault(fields_of["index"], _Output())
        o.token_ids += fields_of["new_token_ids"]
        o.text += fields_of["text_delta"]
        if fields_of["new_logprobs"] is not None:
            if o.logprobs is None:
                o.logprobs = []
            o.logprobs += fields_of["new_logprobs"]
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        finished = fields_of["finished"]
        o.last = RequestOutput(**fields_of, stats=RequestStats(*stats), token_ids=so_far(o.token_ids, finished),
                               text=o.text, logprobs=None if o.logprobs is None else so_far(o.logprobs, finished),
                               prompt_logprobs=self.prompt_logprobs)
        return o.last

    def ended(self, request_id: str, error: str) -> list[Delta]:
        """The deltas that end each of this request's outputs still open with `error` here (the engine process is
        gone)."""
        ends = []
        for index in range(self.handle.num_outputs):
            o = self.outputs.get(index, _Output())
            if o.last is not None and o.last.finished:
                continue
            last = o.last or RequestOutput(request_id, [], [], "", "", False, None,
                                           RequestStats(self.prompt_tokens, 0, 0, 0, 0, None, None), index=index)
            ends.append(_delta_of(replace(last, new_token_ids=[], text_delta="",
                                          new_logprobs=None if o.logprobs is None else [], finished=True,
                                          finish_reason="error", error=error), first=False))
        return ends


# What the pipe carries of an output: its fields but the cumulative ones (token_ids, text, logprobs: the parent's
# _Stream rebuilds them), its stats and the prompt's logprobs, as tuples of plain values: they pickle and unpickle
# several times faster than the dataclasses, on the step loop's thread and the reader's, at every output
_SENT = tuple(f.name for f in fields(RequestOutput)
              if f.name not in ("token_ids", "text", "logprobs", "stats", "prompt_logprobs"))
_REQUEST_ID = _SENT.index("request_id")
_sent_of = operator.attrgetter(*_SENT)
_stats_of = operator.attrgetter(*(f.name for f in fields(RequestStats)))
Delta = tuple[tuple, tuple, "list[TokenLogprob | None] | None"]


def _delta_of(out: RequestOutput, first: bool) -> Delta:
    """What the pipe carries of an output; the prompt's logprobs with the request's first output only (later ones
    repeat them)."""
    return _sent_of(out), _stats_of(out.stats), out.prompt_logprobs if first else None


class ProcessExecutor:
    """An executor (native or TensorRT-LLM, as create_executor picks) run in a child process, behind the
    same interface. The child ends with this object's shutdown, at this process's exit, or with its death."""

    def __init__(self, path: str | Path, config: ExecutorConfig = ExecutorConfig(), torch_threads: int | None = None):
        parent, child = socket.socketpair()
        # a fresh interpreter (not multiprocessing's spawn, which re-runs the caller's __main__), told its end
        # of the pair by descriptor; the settings follow as the first message
        self._process = spawn([*python_module("runtime.executors.process"), str(child.fileno())], signal.SIGKILL,
                              pass_fds=[child.fileno()])
        child.close()
        self._conn = Connection(parent.detach())
        self._conn.send((str(path), config, torch_threads, _logging_levels()))
        if not self._conn.poll(START_TIMEOUT_S):
            self._process.kill()
            raise EngineProcessError(f"the engine process did not load {path} within {START_TIMEOUT_S:.0f} s")
        try:
            kind, *payload = self._conn.recv()
        except EOFError:
            raise EngineProcessError(f"the engine process exited (status {self._process.wait(5)}) while loading "
                                     f"{path}; its log says why") from None
        if kind == "failed":
            self._process.wait(5)
            raise payload.pop()  # not left in a local: its traceback holds this frame
        (self.model_config, self.limits, self.config, self.tokenizer, self.kv_block_size,
         self.request_draft_len) = payload
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the maps below
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._ids = RequestIds()
        self._error: str | None = None
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="engine-outputs", daemon=True)
        self._reader.start()
        stop_at_exit(self, lambda: self.shutdown(timeout=5))  # left open: the engine stops while it can be read

    # -- the executor interface

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._check_here(prompt_token_ids, params)
        self._call("validate", list(prompt_token_ids), params)

    @staticmethod
    def _check_here(prompt_token_ids: list[int], params: SamplingParams) -> None:
        """What needs no engine, checked before the request is sent (it could fail to pickle instead, or be taken
        there in a form the engine refuses in process); the engine checks the rest."""
        check_request_form(prompt_token_ids, params)
        params.validate()

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None] | None = None, request_id: str | None = None,
               bounded: bool = True) -> RequestHandle:
        """Queue a request; invalid parameters raise ValueError naming the parameter (from the engine's own
        validation). The handle is registered before the request leaves, so no output can arrive unclaimed."""
        self._check_here(prompt_token_ids, params)
        check_callback(on_output)
        with self._ids.claimed(request_id) as rid:
            handle = RequestHandle(rid, self, params.n, delivered_by=self._reader)
            with self._lock:
                self._streams[rid] = _Stream(handle, on_output, len(prompt_token_ids))
            try:
                self._call("submit", list(prompt_token_ids), params, rid, bounded)
            except BaseException as e:
                if isinstance(e, (TimeoutError, FutureTimeout)):  # it may be running there: the cancel follows it,
                    with contextlib.suppress(RuntimeError):       # before the id is free for a retry it must not reach
                        self._post(("cancel", rid))
                with self._lock:
                    self._streams.pop(rid, None)
                raise
        return handle

    def cancel(self, request_id: str, handle: RequestHandle | None = None) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None and (handle is None or stream.handle is handle):
            self._post(("cancel", request_id))

    def stats(self) -> ExecutorStats:
        return self._call("stats")

    def health(self, timeout_s: float) -> str | None:
        if self._error is not None:
            return self._error
        try:  # the engine answers at once (its executor's health reads a clock): a wait is its own stall
            return self._call("health", timeout_s, timeout=timeout_s)
        except (TimeoutError, FutureTimeout):  # one class from Python 3.11, two before
            return f"the engine process did not answer within {timeout_s:g} s"
        except RuntimeError as e:  # it died during the call: a reason for the watchdog, not an exception
            return str(e)

    def shutdown(self, timeout: float | None = 30) -> None:
        """Stop the engine (it ends what is in flight as "cancelled") and wait for its process to exit."""
        if self._closed:
            return
        self._closed = True
        forget_at_exit(self)
        with contextlib.suppress(RuntimeError):  # already gone
            self._post(("shutdown",))
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not stop within %s s; killing it", timeout)
            self._process.kill()
            self._process.wait(5)
        self._reader.join(5)

    def __enter__(self) -> "ProcessExecutor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the pipe

    def _post(self, message: tuple) -> None:
        if self._error is not None:
            raise RuntimeError(self._error)
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as e:  # the engine process is gone
            raise RuntimeError(self._error or f"the engine process is gone ({e})") from None

    def _call(self, name: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        if threading.current_thread() is self._reader:  # its reply would wait for this very thread to read it
            raise RuntimeError(f"{name}() cannot be called from an output callback of an executor in an engine "
                               "process: callbacks run on the thread that reads the engine's replies; call it from "
                               "another thread")
        call, future = next(self._call_ids), Future()
        with self._lock:
            self._calls[call] = future
        try:
            self._post(("call", call, name, args))
            return future.result(timeout)
        finally:
            del future  # it holds a raised refusal, whose traceback holds this frame: a reference cycle
            with self._lock:
                self._calls.pop(call, None)

    def _read(self) -> None:
        """The one reader of the pipe: outputs to their handles, replies to their callers; at its end (the
        engine process exited or died) every request still open ends with an error."""
        try:
            while True:
                kind, *payload = self._conn.recv()
                if kind == "out":
                    self._deliver(payload[0])
                elif kind == "reply":
                    call, value, error = payload
                    with self._lock:
                        future = self._calls.get(call)
                    if future is not None:
                        future.set_exception(error) if error is not None else future.set_result(value)
                    future = value = error = payload = None  # the caller's now: not held here until the next reply
        except (EOFError, OSError):
            pass
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(5 if self._closed else 1)
        if not self._closed:
            self._error = f"the engine process exited (status {self._process.returncode})"
            log.error("%s; ending its requests", self._error)
        with self._lock:
            streams = list(self._streams.items())
            calls, self._calls = list(self._calls.values()), {}
        for future in calls:
            future.set_exception(RuntimeError(self._error or "executor is shut down"))
        for rid, stream in streams:
            for end in stream.ended(rid, self._error or "shut down"):
                self._deliver(end)

    def _deliver(self, delta: Delta) -> None:
        """Rebuild an output from the child's delta and hand it to its request's callback and handle."""
        with self._lock:
            stream = self._streams.get(delta[0][_REQUEST_ID])
            if stream is None:  # ended here already (the engine process died first)
                return
            out = stream.rebuild(delta)
        if stream.on_output is not None:
            try:
                stream.on_output(out)
            except BaseException:  # user code on the reader's thread must not stop the deliveries
                log.exception("output callback of %s failed", out.request_id)
        stream.handle._push(out)
        if stream.handle.finished:  # the last of its outputs (SamplingParams.n)
            with self._lock:
                self._streams.pop(out.request_id, None)
            self._ids.release(out.request_id)


def _logging_levels() -> dict[str, int]:
    """The parent's logging levels (root's and those set on named loggers), for the child to log alike."""
    levels = {name: logger.level for name, logger in logging.root.manager.loggerDict.items()
              if isinstance(logger, logging.Logger) and logger.level}
    return {"": logging.root.level, **levels}


def _engine_main(conn: Connection) -> None:
    """The child: load the executor, then serve the parent's messages until it says shutdown or goes away."""
    path, config, torch_threads, levels = conn.recv()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    logging.basicConfig(level=levels.pop(""), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    if torch_threads:
        torch.set_num_threads(torch_threads)
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        data = pickle.dumps(message)  # not conn.send's ForkingPickler: it builds a pickler per call (each output's)
        with send_lock:
            conn.send_bytes(data)

    try:
        executor = create_executor(path, config)
    except BaseException as e:
        send(("failed", e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")))
        return
    send(("ready", executor.model_config, executor.limits, executor.config, executor.tokenizer, executor.kv_block_size,
          executor.request_draft_len))

    unanswered: set[str] = set()  # requests submitted that have sent no output yet

    def output(out: RequestOutput) -> None:  # on the step loop's thread, the only other sender
        first = out.request_id in unanswered
        unanswered.discard(out.request_id)
        with contextlib.suppress(OSError):  # the parent has gone: this process ends when its read sees it
            send(("out", _delta_of(out, first)))

    try:
        while True:
            try:
                kind, *payload = conn.recv()
            except (EOFError, OSError):  # the parent went away without a shutdown
                break
            if kind == "shutdown":
                break
            if kind == "cancel":
                executor.cancel(payload[0])
                continue
            call, name, args = payload
            value = error = None
            try:
                if name == "submit":
                    ids, params, rid, bounded = args
                    unanswered.add(rid)
                    try:
                        # read through `output` alone: the handle keeps nothing for an iteration that never comes
                        executor.submit(ids, params, on_output=output, request_id=rid, bounded=bounded).callback_only()
                    except BaseException:
                        unanswered.discard(rid)
                        raise
                else:
                    value = getattr(executor, name)(*args)
            except Exception as e:
                error = e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")
            send(("reply", call, value, error))
    finally:
        executor.shutdown()  # its last outputs ("cancelled") go out before the pipe closes
        conn.close()


def _picklable(e: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(e))
        return True
    except Exception:
        return False


if __name__ == "__main__":
    _engine_main(Connection(int(sys.argv[1])))
