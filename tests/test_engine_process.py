"""The executor in its own process (runtime/executors/process.py), as dsv3-serve runs it by default: the same
tokens as in-process, errors raised in the caller, cancellation and KV blocks through the pipe, and no engine
process left behind when the executor shuts down, its engine dies or its parent is killed."""

from __future__ import annotations

import os
import pickle
import pickletools
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runtime.core.sampling_params import SamplingParams
from runtime.executors.backends import create_executor
from runtime.executors.base import ExecutorConfig
from runtime.executors.errors import QueueFull
from runtime.executors.lifetime import running
from runtime.executors.process import ProcessExecutor, _delta_of, _Stream

from executor_util import assert_a_refusal_frees_its_callers

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPTS = [[5, 17, 42, 99, 7], [300, 12], list(range(40, 70))]
CONFIG = ExecutorConfig(num_draft_tokens=3, speculation="fixed", max_seq_len=96)


@pytest.fixture(scope="module")
def engine(spec_checkpoint):
    with ProcessExecutor(spec_checkpoint, CONFIG, torch_threads=1) as ex:
        yield ex


def wait_gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not running(pid):  # gone, or exited and not reaped yet
            return True
        time.sleep(0.1)
    return False


def test_same_tokens_as_in_process(engine, spec_checkpoint):
    params = [SamplingParams(max_tokens=24, ignore_eos=True), SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=7, logprobs=2)]
    got = [h.result(60) for h in [engine.submit(p, sp) for p, sp in zip(PROMPTS, params)]]
    with create_executor(spec_checkpoint, CONFIG) as local:
        want = [local.submit(p, sp).result(60) for p, sp in zip(PROMPTS, params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert got[2].cumulative_logprob == pytest.approx(want[2].cumulative_logprob, abs=1e-4)
    assert all(o.stats.num_draft_tokens > 0 for o in got)  # it speculated over there


def test_several_outputs_per_prompt_as_in_process(engine, spec_checkpoint):
    """n / best_of through the pipe: each output rebuilt from its own deltas, the prompt's logprobs on every one,
    the same as in one process; streamed by index."""
    cases = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, seed=3, n=3, prompt_logprobs=1),
             SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, seed=5, n=2, best_of=3)]
    with create_executor(spec_checkpoint, CONFIG) as local:
        want = [local.submit(PROMPTS[2], sp).results(60) for sp in cases]
    seen: list = []
    got = [engine.submit(PROMPTS[2], sp, on_output=seen.append).results(60) for sp in cases]
    for g, w in zip(got, want):
        assert [(o.index, o.token_ids, o.text, o.finish_reason) for o in g] == \
            [(o.index, o.token_ids, o.text, o.finish_reason) for o in w]
    assert all(o.prompt_logprobs is not None and len(o.prompt_logprobs) == len(PROMPTS[2]) for o in got[0])
    first = [o for o in seen if o.request_id == seen[0].request_id]
    streamed = {i: [t for o in first if o.index == i for t in o.new_token_ids] for i in range(3)}
    assert [streamed[i] for i in range(3)] == [o.token_ids for o in got[0]]


def test_streams_every_output_and_callbacks_run(engine):
    seen = []
    h = engine.submit(PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True), on_output=seen.append)
    streamed = [t for out in h for t in out.new_token_ids]
    assert streamed == h.result(1).token_ids and len(streamed) == 16
    assert [t for out in seen for t in out.new_token_ids] == streamed and seen[-1].finished


def test_a_callback_that_calls_the_executor_is_refused_at_once(engine):
    """Callbacks run on the thread that reads the engine's replies, so a call from one waited for itself: stats()
    timed out after 60 s with an empty message, stalling every stream meanwhile. Refused at once, naming the call;
    the request and the executor go on."""
    errors: list[str] = []

    def on_output(out) -> None:
        try:
            engine.stats()
        except RuntimeError as e:
            errors.append(str(e))

    started = time.monotonic()
    h = engine.submit(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True), on_output=on_output)
    assert len(h.result(30).token_ids) == 4 and time.monotonic() - started < 30
    assert errors and errors[0] == ("stats() cannot be called from an output callback of an executor in an engine "
                                    "process: callbacks run on the thread that reads the engine's replies; call it "
                                    "from another thread")
    assert engine.stats().running == 0


def fields(out) -> tuple:
    """An output's reported content (not its timings), logprobs rounded: the two processes' sums may differ in
    the last bits."""
    lps = None if out.logprobs is None else [(lp.token_id, round(lp.logprob, 4)) for lp in out.logprobs]
    plps = None if out.prompt_logprobs is None else [lp and (lp.token_id, round(lp.logprob, 4))
                                                     for lp in out.prompt_logprobs]
    return (out.new_token_ids, out.token_ids, out.text_delta, out.text, out.finished, out.finish_reason,
            len(out.new_logprobs or []), lps, plps)


def test_every_output_of_a_long_stream_as_in_process(engine, spec_checkpoint):
    """The cumulative token_ids, text, logprobs and prompt logprobs the parent rebuilds from the child's deltas
    are, output by output, what the executor reports in one process (stop strings hold text back meanwhile)."""
    params = SamplingParams(max_tokens=90, ignore_eos=True, temperature=0.8, seed=3, logprobs=2, prompt_logprobs=1,
                            stop=["zzzz"])
    got: list = []
    engine.submit(PROMPTS[0], params, on_output=got.append).result(120)
    with create_executor(spec_checkpoint, CONFIG) as local:
        want: list = []
        local.submit(PROMPTS[0], params, on_output=want.append).result(120)
    assert len(got[-1].token_ids) == 90 and len(got) > 20
    assert [fields(o) for o in got] == [fields(o) for o in want]
    # views of the parent's growing lists, not a copy of every token so far per output (8 bytes a token)
    held = sum(sys.getsizeof(o.token_ids) + sys.getsizeof(o.logprobs) for o in got[:-1])
    assert held < 100 * len(got), f"{held} bytes held by {len(got) - 1} outputs' token_ids and logprobs"


def test_the_pipe_carries_what_is_new(spec_checkpoint):
    """Each message from the child holds its output's new tokens, not every token so far: its size does not
    grow along the stream; and _Stream rebuilds each output whole. Without logprobs a message is plain values, no
    class to look up (what unpickling at every output costs the reader least)."""
    params = SamplingParams(max_tokens=60, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outs: list = []
    with create_executor(spec_checkpoint, CONFIG) as local:
        local.submit(PROMPTS[2], params, on_output=outs.append).result(120)
        plain = local.submit(PROMPTS[2], SamplingParams(max_tokens=4, ignore_eos=True)).result(60)
    deltas = [_delta_of(o, i == 0) for i, o in enumerate(outs)]
    sizes = [len(pickle.dumps(d)) - len(pickle.dumps(o.new_token_ids + o.new_logprobs))
             for d, o in zip(deltas[1:], outs[1:])]
    assert max(sizes) - min(sizes) < 64, sizes
    stream = _Stream(None, None, len(PROMPTS[2]))
    assert [fields(stream.rebuild(d)) for d in deltas] == [fields(o) for o in outs]
    opcodes = {op.name for op, _, _ in pickletools.genops(pickle.dumps(_delta_of(plain, True)))}
    assert not opcodes & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "NEWOBJ", "BUILD"}, opcodes


def test_a_callback_only_handle_keeps_no_outputs(spec_checkpoint):
    """How the child submits: outputs go to on_output alone, result() still answers, iterating says why not."""
    seen: list = []
    with create_executor(spec_checkpoint, CONFIG) as local:
        h = local.submit(PROMPTS[1], SamplingParams(max_tokens=40, ignore_eos=True), on_output=seen.append)
        h.callback_only()
        out = h.result(60)
        assert not h._pending
        with pytest.raises(RuntimeError, match="on_output callback only"):
            next(iter(h))
    assert out.token_ids == [t for o in seen for t in o.new_token_ids] and len(out.token_ids) == 40


def test_stop_reason_is_the_stop_string_or_token_that_ended_it(engine, spec_checkpoint):
    """RequestOutput.stop_reason (the LLM API's): the stop string or stop token id that ended the output, in one
    process and through the pipe alike; None for a length limit."""
    with create_executor(spec_checkpoint, CONFIG) as local:
        plain = local.submit(PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True)).result(60)
        ids, text = plain.token_ids, plain.text
        token = next(t for i, t in enumerate(ids) if i >= 3 and t not in ids[:i])
        stop = next(text[i:i + 3] for i in range(4, len(text) - 3)
                    if text[i:i + 3].strip() and text[i:i + 3] not in text[:i + 2])
        cases = [(SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(token,)), token),
                 (SamplingParams(max_tokens=40, ignore_eos=True, stop=("not in the text", stop)), stop),
                 (SamplingParams(max_tokens=40, ignore_eos=True), None)]
        for params, reason in cases:
            for ex in (local, engine):
                out = ex.submit(PROMPTS[0], params).result(60)
                assert (out.finish_reason, out.stop_reason) == ("length" if reason is None else "stop", reason)


def test_bad_request_raises_in_the_caller(engine):
    with pytest.raises(ValueError, match=r"^max_tokens must be an integer >= 1, got 0$"):
        engine.submit(PROMPTS[0], SamplingParams(max_tokens=0))
    h = engine.submit(PROMPTS[0], SamplingParams(max_tokens=80, ignore_eos=True), request_id="same")
    with pytest.raises(ValueError, match=r"^request_id 'same' is already in flight$"):
        engine.submit(PROMPTS[1], SamplingParams(max_tokens=4), request_id="same")
    h.cancel()
    assert h.result(30).finish_reason == "cancelled"
    assert engine.submit(PROMPTS[1], SamplingParams(max_tokens=4), request_id="same").result(30).finished


def test_a_full_queue_is_queue_full_in_the_caller(spec_checkpoint):
    """Load shedding's refusal crosses the pipe as QueueFull with its bound (each server words it by its own setting's
    name): of a burst of 10 long requests on a batch of one with a bound of one, those past the bound are refused."""
    config = ExecutorConfig(num_draft_tokens=0, max_seq_len=96, max_batch_size=1, max_queued_requests=1)
    with ProcessExecutor(spec_checkpoint, config, torch_threads=1) as ex:
        taken, refused = [], []
        for _ in range(10):
            try:
                taken.append(ex.submit(PROMPTS[0], SamplingParams(max_tokens=80, ignore_eos=True)))
            except QueueFull as e:
                refused.append(e)
        assert refused and all(e.bound == 1 and str(e) == QueueFull.worded(1) for e in refused)
        assert all(len(h.result(60).token_ids) == 80 for h in taken)


def test_cancel_frees_the_blocks(engine):
    h = engine.submit(PROMPTS[2], SamplingParams(max_tokens=60, ignore_eos=True))
    next(iter(h))
    h.cancel()
    assert h.result(30).finish_reason == "cancelled"
    deadline = time.monotonic() + 10
    while engine.stats().kv_blocks_used and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats().kv_blocks_used == 0 and engine.health(5) is None


def test_a_dead_engine_ends_its_requests_and_says_why(spec_checkpoint):
    ex = ProcessExecutor(spec_checkpoint, CONFIG, torch_threads=1)
    try:
        h = ex.submit(PROMPTS[2], SamplingParams(max_tokens=60, ignore_eos=True))
        next(iter(h))
        os.kill(ex._process.pid, signal.SIGKILL)
        out = h.result(30)
        assert (out.finish_reason, out.error) == ("error", "the engine process exited (status -9)")
        assert ex.health(5) == "the engine process exited (status -9)"
        with pytest.raises(RuntimeError, match=r"^the engine process exited \(status -9\)$"):
            ex.submit(PROMPTS[0], SamplingParams(max_tokens=4))
    finally:
        ex.shutdown()


def test_an_executor_left_open_ends_with_its_process(spec_checkpoint):
    """A script that exits with requests running and the executor open: the engine stops at exit, while the parent
    can still read it (it wrote BrokenPipeError tracebacks into the parent's stderr after the parent had exited,
    in 6 of 16 runs, and outlived it by a second or two)."""
    script = (f"from runtime.core.sampling_params import SamplingParams\n"
              f"from runtime.executors.process import ProcessExecutor\n"
              f"ex = ProcessExecutor({str(spec_checkpoint)!r}, torch_threads=1)\n"
              f"hs = [ex.submit([5, 17, 42], SamplingParams(max_tokens=80, ignore_eos=True)) for _ in range(3)]\n"
              f"next(iter(hs[0]))\n"
              f"print(ex._process.pid, flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    assert not Path(f"/proc/{int(done.stdout)}").exists(), "the engine process outlived its parent's exit"


def test_a_request_is_checked_before_it_leaves(engine):
    """What could not cross the pipe, or failed on the way (a generator's len(), an unpicklable stop), is refused
    here as the in-process executor refuses it."""
    import numpy as np

    for ids, shown in (((t for t in [5, 6]), "<generator"), (5, "5"), (np.array([5, 6]), "array([5, 6])")):
        with pytest.raises(ValueError) as e:
            engine.submit(ids, SamplingParams(max_tokens=2))
        assert str(e.value).startswith(f"prompt must be a list of integer token ids, got {shown}"), str(e.value)
    with pytest.raises(ValueError) as e:
        engine.submit([5, 6], SamplingParams(stop=(lambda: 0,)))
    assert str(e.value).startswith("stop must be a list of non-empty strings, got [<function")
    with pytest.raises(ValueError) as e:
        engine.submit([5, 6], SamplingParams(max_tokens=2), on_output=5)
    assert str(e.value) == "on_output must be a callable taking a RequestOutput, or None; got 5"
    assert engine.health(5) is None


def test_a_forked_child_leaves_the_parents_engine_alone(engine):
    """A fork()ed copy inherits the executors to stop at exit; its exit stopped the parent's engine down the
    inherited pipe. The child here runs the exit functions as a normal exit would."""
    pid = os.fork()
    if pid == 0:
        import atexit
        atexit._run_exitfuncs()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert engine.health(5) is None
    assert engine.submit(PROMPTS[0], SamplingParams(max_tokens=3)).result(30).finish_reason == "length"


def test_health_answers_within_its_timeout(engine):
    """A stopped engine process is reported in the time the watchdog asks for (it took the 60 s of every call)."""
    os.kill(engine._process.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert engine.health(1) == "the engine process did not answer within 1 s"
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(engine._process.pid, signal.SIGCONT)
    assert engine.health(30) is None


def test_health_reports_an_engine_that_dies_during_the_call(spec_checkpoint):
    """An engine process killed while a health call waits is a reason for the watchdog: it was a RuntimeError, which
    ended the watchdog's thread, so nothing took the server down."""
    ex = ProcessExecutor(spec_checkpoint, CONFIG, torch_threads=1)
    try:
        os.kill(ex._process.pid, signal.SIGSTOP)
        answer: list = []
        asking = threading.Thread(target=lambda: answer.append(ex.health(30)))
        asking.start()
        time.sleep(0.3)
        os.kill(ex._process.pid, signal.SIGKILL)
        asking.join(20)
        assert answer and answer[0].startswith("the engine process exited"), answer
    finally:
        ex.shutdown()


def test_a_submit_that_times_out_is_cancelled_in_the_engine(spec_checkpoint):
    """A submit whose reply does not come in time is refused here and its id freed; the engine may have taken it, and
    it ran there to max_tokens, holding a place in the batch, for no one: the cancel follows it down the pipe."""
    ex = ProcessExecutor(spec_checkpoint, CONFIG, torch_threads=1)
    try:
        call = ex._call
        ex._call = lambda name, *args, timeout=60: call(name, *args, timeout=0.5 if name == "submit" else timeout)
        os.kill(ex._process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):
                ex.submit(PROMPTS[0], SamplingParams(max_tokens=80, ignore_eos=True), request_id="late")
        finally:
            os.kill(ex._process.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while (stats := ex.stats()).requests_finished < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats.requests_finished == 1 and stats.generated_tokens < 80, stats
        assert ex.submit(PROMPTS[0], SamplingParams(max_tokens=3), request_id="late").result(30).finish_reason == \
            "length"
    finally:
        ex.shutdown()


def test_a_retry_of_a_submit_that_timed_out_is_not_cancelled(spec_checkpoint):
    """The cancel that follows a timed-out submit goes down the pipe before its id is free again: a client's retry
    under that id, sent at once, came before it and was cancelled (where the engine had refused the first)."""
    ex = ProcessExecutor(spec_checkpoint, CONFIG, torch_threads=1)
    try:
        call, release = ex._call, ex._ids.release
        first = [True]

        def call_once_short(name, *args, timeout=60):
            short = name == "submit" and first.pop() if first else False
            return call(name, *args, timeout=0.5 if short else timeout)

        retry: list = []

        def release_then_retry(rid: str) -> None:  # the client retries the moment the id is free
            release(rid)
            if rid == "again" and not retry:
                retry.append(None)
                worker = threading.Thread(target=lambda: retry.append(
                    ex.submit(PROMPTS[0], SamplingParams(max_tokens=3), request_id="again")))
                worker.start()
                time.sleep(0.3)  # its submit is in the pipe

        ex._call, ex._ids.release = call_once_short, release_then_retry
        os.kill(ex._process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):  # refused there too: a draft length the engine cannot run
                ex.submit(PROMPTS[0], SamplingParams(max_tokens=3, num_draft_tokens=99), request_id="again")
        finally:
            os.kill(ex._process.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while len(retry) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert retry[1].result(30).finish_reason == "length"
    finally:
        ex.shutdown()


def test_a_load_error_is_raised_in_the_caller(tmp_path, spec_checkpoint):
    with pytest.raises(ValueError, match=r"missing: neither engine.json nor config.json found"):
        ProcessExecutor(tmp_path / "missing", CONFIG)
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        ProcessExecutor(spec_checkpoint, ExecutorConfig(kv_cache_tokens=10**12))


def test_an_executor_made_on_a_thread_that_ends_lives_on(spec_checkpoint):
    """Its engine process was forked by the thread that made it, and the kernel's parent-death signal comes when
    that thread ends: a worker thread that loaded the executor (asyncio.to_thread) took the engine with it."""
    made = []
    worker = threading.Thread(target=lambda: made.append(ProcessExecutor(spec_checkpoint, CONFIG, torch_threads=1)))
    worker.start()
    worker.join()
    [ex] = made
    try:
        time.sleep(1)
        assert ex._process.poll() is None, f"the engine process ended with its thread: {ex._process.poll()}"
        assert ex.submit(PROMPTS[0], SamplingParams(max_tokens=4)).result(30).finish_reason == "length"
    finally:
        ex.shutdown()


def test_no_engine_process_outlives_its_parent(spec_checkpoint, tmp_path):
    """Shut down: the engine process has exited. Parent killed by SIGKILL (the executor made on the main thread, or
    on a thread that has ended, or with the engine process stopped by SIGSTOP): the engine is killed too."""
    script = (f"import sys, threading; from runtime.executors.process import ProcessExecutor\n"
              f"made = []\n"
              f"make = lambda: made.append(ProcessExecutor({str(spec_checkpoint)!r}, torch_threads=1))\n"
              f"if sys.argv[1] == 'thread':\n"
              f"    t = threading.Thread(target=make); t.start(); t.join()\n"
              f"else:\n    make()\n"
              f"ex = made[0]\n"
              f"print(ex._process.pid, flush=True)\n"
              f"if sys.argv[1] == 'shutdown':\n    ex.shutdown(); print('down', flush=True)\n"
              f"else:\n    import time; time.sleep(600)\n")
    for how in ("shutdown", "sigkill", "thread", "stopped"):
        parent = subprocess.Popen([sys.executable, "-c", script, how], stdout=subprocess.PIPE, text=True)
        try:
            child = int(parent.stdout.readline())
            if how == "stopped":  # SIGTERM would wait, pending, for a SIGCONT that never comes: an orphan for ever
                os.kill(child, signal.SIGSTOP)
            if how != "shutdown":
                time.sleep(0.5)
                parent.kill()
            else:
                assert parent.stdout.readline().strip() == "down"
            assert wait_gone(child), f"engine process {child} still running after its parent's {how}"
        finally:
            parent.kill()
            parent.wait()


def test_the_engine_process_runs_our_runtime_whatever_its_working_directory_holds(spec_checkpoint, tmp_path,
                                                                                  monkeypatch):
    """`python -m` put the working directory first on the child's sys.path: a server started from a directory with a
    `runtime/` package in it (another checkout, a file someone left in /tmp) ran that package in its engine process."""
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "__init__.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    with ProcessExecutor(spec_checkpoint, CONFIG, torch_threads=1) as ex:
        assert ex.submit(PROMPTS[0], SamplingParams(max_tokens=4)).result(30).finish_reason == "length"
    assert not (tmp_path / "ran").exists()


def test_a_refusal_from_the_engine_leaves_its_callers_objects_to_reference_counting(engine):
    """The caller's frame held the future that held the engine's refusal, whose traceback holds that frame: a cycle
    that kept every caller's objects (in a Triton stub, the server's request and response sender) until a garbage
    collection; collected at the stub's exit they crashed it (a segmentation fault at shutdown after such refusals).
    The pipe's reader lets go of the refusal just after handing it over."""
    assert_a_refusal_frees_its_callers(lambda: engine.submit(PROMPTS[0], SamplingParams(max_tokens=100_000)),
                                       "max_tokens 100000", wait_s=5)
