"""Tensor and expert parallel ranks (runtime.model.parallel, runtime.executors.ranks) on CPU with gloo, two processes.

The shipped model built at tp 2 (ep 1: experts split by features; ep 2: by expert) and at tp 4 = moe_tp 2 x
moe_ep 2 runs as ranks and as its rank files joined in one process (world_size 1, the same weights): greedy
tokens must be the same for 20 held-out prompts and k = 0..3, batched (and the first few alone). The ranks' sums are in a fixed order but not the joined
model's order, so logits agree to rounding (checked too), and the tokens exactly.
"""

from __future__ import annotations

import ipaddress
import json
import urllib.request
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from builder.convert import convert_checkpoint
from builder.native_engine import build_engine
from runtime.core.sampling_params import SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.executors.ranks import RankFailure, RankGroup, _file_store
from runtime.io.engine_format import BuildConfig
from runtime.io.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # one thread per rank: two ranks on two cores
PROMPTS, ALONE, MAX_TOKENS = 20, 4, 12


def tp_engine(model: Path, out: Path, tp: int, ep: int) -> Path:
    build = BuildConfig(max_batch_size=PROMPTS, max_seq_len=256, max_num_tokens=512, tp_size=tp, ep_size=ep,
                        quant_algo="FP8_BLOCK_SCALES")
    convert_checkpoint(model, out / "ckpt", build, progress=False)
    return build_engine(out / "ckpt", out / "engine", build, progress=False)


@pytest.fixture(scope="module", params=[pytest.param((2, 1), id="tp2"), pytest.param((2, 2), id="tp2-ep2"),
                                        pytest.param((4, 2), id="tp4-ep2", marks=pytest.mark.slow)])  # 4 processes
def engine(request, shipped_model_dir, tmp_path_factory) -> Path:
    tp, ep = request.param
    return tp_engine(shipped_model_dir, tmp_path_factory.mktemp(f"tp{tp}ep{ep}"), tp, ep)


def prompts(model_dir: Path) -> list[list[int]]:
    tok = Tokenizer.from_dir(model_dir)
    texts = [p["text"] for p in json.loads((model_dir / "heldout_prompts.json").read_text())[:PROMPTS]]
    return [tok.encode(t)[:48] for t in texts]


def executor(path: Path, world: int | None) -> Executor:
    return Executor(path, ExecutorConfig(num_draft_tokens=3, speculation="fixed", world_size=world,
                                         max_batch_size=PROMPTS, kv_cache_tokens=PROMPTS * 256))


def greedy(ex: Executor, ids: list[list[int]], k: int, batched: bool) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, num_draft_tokens=k)
    if batched:
        return [h.result().token_ids for h in [ex.submit(p, params) for p in ids]]
    return [ex.submit(p, params).result().token_ids for p in ids]


@torch.inference_mode()
def dense_logits(ex: Executor, ids: list[int]) -> torch.Tensor:
    """The dense (training) forward's logits, on every rank alike."""
    model = ex.engine.model
    return model.logits(model(torch.tensor([ids])))


def run_all(ex: Executor, ids: list[list[int]]) -> dict:
    return {(k, batched): greedy(ex, ids if batched else ids[:ALONE], k, batched) for k in range(4)
            for batched in (True, False)}


def test_ranks_give_the_tokens_of_one_process(engine, shipped_model_dir):
    ids = prompts(shipped_model_dir)
    with executor(engine, 1) as ex:
        want = run_all(ex, ids)
        logits_one = dense_logits(ex, ids[0])
    with executor(engine, None) as ex:
        stats, world = ex.stats(), ex.engine.build.tp_size
        assert stats.world_size == world and len(stats.rank_memory_bytes) == world and min(stats.rank_memory_bytes) > 0
        rank0_holds_its_part(ex.engine.model)
        got = run_all(ex, ids)
        logits_ranks = dense_logits(ex, ids[0])
    assert got == want
    assert (logits_ranks - logits_one).abs().max() < 1e-3


def rank0_holds_its_part(model) -> None:
    """Its share of the heads, the vocabulary and the features (or experts); FP8 weights kept as FP8 codes."""
    cfg, layout = model.cfg, model.par.layout
    attn, moe = model.model.layers[0].self_attn, model.model.layers[1].mlp
    assert attn.n_heads == cfg.num_attention_heads // layout.tp_size
    assert model.model.embed_tokens.weight.shape[0] == cfg.vocab_size // layout.tp_size
    assert attn.q_b_proj.packed.panels.dtype == torch.uint8  # FP8 codes, packed as stored
    E, I = moe.experts.gate_proj.panels.shape[0], moe.experts.gate_proj.out_features
    assert (E, I) == (cfg.n_routed_experts // layout.ep_size, cfg.moe_intermediate_size // layout.moe_tp_size)


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
            if state == "Z":  # exited, not yet reaped by its parent
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def tp2(shipped_model_dir, tmp_path_factory) -> Path:
    return tp_engine(shipped_model_dir, tmp_path_factory.mktemp("tp2-life"), 2, 1)


def test_ranks_started_on_a_thread_that_ends_live_on(tp2):
    """The ranks were forked by the thread that made the executor and got the parent-death signal when it ended (a
    worker thread that loads an executor): they live as long as the executor."""
    made = []
    worker = threading.Thread(target=lambda: made.append(executor(tp2, None)))
    worker.start()
    worker.join()
    [ex] = made
    try:
        time.sleep(1)
        assert [p.poll() for p in ex.ranks.procs] == [None]
        assert ex.submit([5, 17, 42], SamplingParams(max_tokens=4)).result(60).finish_reason == "length"
    finally:
        ex.shutdown()


def test_close_leaves_no_rank(tp2):
    ex = executor(tp2, None)
    pids = [p.pid for p in ex.ranks.procs]
    ex.shutdown()
    assert all(_gone(pid) for pid in pids)


def listening(pid: int) -> set[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """The TCP (address, port) pairs process `pid` listens on, from /proc."""
    sockets = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:  # closed since listed (the listing's own descriptor)
            continue
        if link.startswith("socket:["):
            sockets.add(link[len("socket:["):-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            local, state, inode = line.split()[1], line.split()[3], line.split()[9]
            if state == "0A" and inode in sockets:  # LISTEN
                raw, port = bytes.fromhex(local.split(":")[0]), int(local.split(":")[1], 16)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word host order
                found.add((ipaddress.ip_address(words), port))
    return found


def loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_ranks_listen_on_loopback_only_and_leave_no_rendezvous(tp2):
    """Ranks started here listen on loopback alone (rank 0 hosted a torch TCPStore, which listens on every
    interface whatever host it is given, and the ranks' calls are pickles), and the directory they met in is
    gone once the group has formed; one that a killed rank 0 left is removed when ranks next start (a live
    process's stays)."""
    import tempfile

    from runtime.executors.lifetime import PID_NAMESPACE

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = Path(tempfile.mkdtemp(prefix=f"dsv3-ranks-{PID_NAMESPACE}-{int(dead.stdout)}-"))
    live = Path(tempfile.mkdtemp(prefix=f"dsv3-ranks-{PID_NAMESPACE}-{os.getpid()}-"))
    before = listening(os.getpid())
    ex = executor(tp2, None)
    assert not left.exists() and live.is_dir()
    live.rmdir()
    try:
        [worker] = ex.ranks.procs
        opened = {"rank 0": listening(os.getpid()) - before, "rank 1": listening(worker.pid)}
        assert all(opened.values()), opened  # gloo's own
        assert all(loopback(a) for socks in opened.values() for a, _ in socks), opened
        assert ex.ranks.rendezvous is not None and not ex.ranks.rendezvous.exists()
        assert ex.submit([5, 17, 300], SamplingParams(max_tokens=4, temperature=0.0)).result().finish_reason == "length"
    finally:
        ex.shutdown()


def test_a_rank_that_exits_after_loading_fails_the_group_at_once(tmp_path):
    """A rank that reports its weights loaded and then exits: rank 0, forming the group, names it at once (gloo
    waits for every member as long as a collective may take, a year, and held rank 0 there)."""
    store_file = str(tmp_path / "store")
    worker = subprocess.Popen([sys.executable, "-c", "import sys, time, torch.distributed as dist; "
                               "dist.FileStore(sys.argv[1], 2).set('loaded/1', '1'); time.sleep(1)", store_file])
    group = RankGroup(tmp_path, BuildConfig(tp_size=2), _file_store(store_file, 2), [worker], tmp_path / "rendezvous")
    failure: list[BaseException] = []

    def connect() -> None:
        try:
            group.connect()
        except RankFailure as e:
            failure.append(e)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "rank 0 is still waiting for a rank that has exited"
    assert [str(e) for e in failure] == [f"rank 1 (pid {worker.pid}) exited with code 0"]


LOST_PEER = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
             "[127.0.0.1]:4242")


def fake_ranks(tmp_path: Path, ranks: list[tuple[str, float]]) -> RankGroup:
    """Rank 0's group of processes that each write a report (ranks[i][0], nothing if empty) to their pipe, then exit
    after ranks[i][1] seconds."""
    procs, reports = [], []
    for report, lives in ranks:
        read, write = os.pipe()
        os.set_blocking(read, False)
        reports.append(os.fdopen(read, "rb", buffering=0))
        procs.append(subprocess.Popen([sys.executable, "-c", "import os, sys, time; os.write(int(sys.argv[1]), "
                                       "sys.argv[2].encode()); time.sleep(float(sys.argv[3])); sys.exit(1)",
                                       str(write), report, str(lives)], pass_fds=(write,)))
        os.close(write)
    store = _file_store(str(tmp_path / "store"), len(ranks) + 1)
    return RankGroup(tmp_path, BuildConfig(tp_size=len(ranks) + 1), store, procs, None, reports)


def test_the_rank_that_failed_is_named_not_those_that_lost_it(tmp_path):
    """At tp > 2, when a rank dies the others lose their connections to it and report gloo's "Connection closed by
    peer": rank 0 named the lowest rank that had stopped, often one of those. It names the rank that failed on its
    own: killed by a signal, with its own exception, or silent while the others lost it, whatever ranks below it
    lost it."""
    group = fake_ranks(tmp_path, [(LOST_PEER, 0), ("", 60), (LOST_PEER, 0)])  # rank 2 is killed
    try:
        group.procs[1].kill()
        for p in group.procs:
            p.wait()
        with pytest.raises(RankFailure) as failure:
            group.check()
        assert str(failure.value) == f"rank 2 (pid {group.procs[1].pid}) exited with code -9"
    finally:
        group.close(graceful=False)
    # a call failed: the reports of ranks still exiting are read, and rank 3's own exception named
    group = fake_ranks(tmp_path, [(LOST_PEER, 60), (LOST_PEER, 60), ("RuntimeError: out of memory", 60)])
    try:
        time.sleep(0.5)  # they have written their reports
        with pytest.raises(RankFailure) as failure:
            group.check(read_reports=True)
        assert str(failure.value) == f"rank 3 (pid {group.procs[2].pid}) failed: RuntimeError: out of memory"
    finally:
        group.close(graceful=False)
    # torchrun's ranks are not seen exiting, and one it killed reports nothing: rank 0 named a rank that only lost it
    # ("rank 1 failed: ... Connection closed by peer"). Where every rank that stopped only lost a peer, those that sent
    # no report are named
    store = _file_store(str(tmp_path / "torchrun_store"), 4)
    group = RankGroup(tmp_path, BuildConfig(tp_size=4), store, [])  # torchrun's: no processes, reports in its store
    group.pids.update({1: 101, 2: 102, 3: 103})  # as each said once loaded
    store.set("failed/1", LOST_PEER)
    with pytest.raises(RankFailure) as failure:
        group.check(read_reports=True)
    assert str(failure.value) == ("one of rank 2 (pid 102), rank 3 (pid 103) stopped without a report; rank 1 lost its "
                                  "connection to it")
    # a failed call waits for the other ranks' reports before it settles on such a rank: rank 3's, later, tells which
    threading.Timer(0.3, store.set, ("failed/3", LOST_PEER)).start()
    assert str(group.failed(RuntimeError("Connection closed by peer"))) == (
        "rank 2 (pid 102) stopped without a report; ranks 1, 3 lost their connections to it")
    # at tp 2 rank 0 is the only one left to lose the killed rank: its own error tells which ("a forward failed on
    # rank 0 of 2 (RuntimeError: ...)" before)
    store = _file_store(str(tmp_path / "torchrun_store_2"), 2)
    group = RankGroup(tmp_path, BuildConfig(tp_size=2), store, [])
    group.pids[1] = 101
    error = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert str(group.failed(error)) == "rank 1 (pid 101) stopped without a report; rank 0 lost its connection to it"


def test_a_killed_rank_stops_the_executor_with_a_clear_error(tp2, shipped_model_dir):
    """Killed during a request: the request ends with an error naming the rank; the executor stops serving."""
    ex = executor(tp2, None)
    [worker] = ex.ranks.procs
    handle = ex.submit(prompts(shipped_model_dir)[0], SamplingParams(max_tokens=200, ignore_eos=True))
    next(iter(handle))  # generating
    worker.kill()
    worker.wait()
    out = handle.result()
    assert out.finish_reason == "error" and f"rank 1 (pid {worker.pid}) exited with code -9" in out.error
    assert "rank 1" in ex.health(60)
    with pytest.raises(RuntimeError, match="shut down"):
        ex.submit([1, 2], SamplingParams(max_tokens=2))
    ex.shutdown()


def test_a_rank_that_fails_after_loading_names_its_error_at_the_call(tp2, monkeypatch):
    """A rank that cannot allocate its KV cache (a host whose ranks' memory differs): the executor was made and
    failed at its first step, "rank 1 exited with code 1", the reason in rank 1's stderr alone. It fails to be
    made, with rank 1's exception."""
    send = RankGroup.send

    def huge_cache(self, call):  # more bytes than the address space: rank 1's allocation fails
        send(self, ("cache", {**call[1], "shape": (1 << 50,)}) if call and call[0] == "cache" else call)

    monkeypatch.setattr(RankGroup, "send", huge_cache)
    started = []
    monkeypatch.setattr(RankGroup, "connect", lambda self, connect=RankGroup.connect: (started.append(self),
                                                                                       connect(self)))
    with pytest.raises(RankFailure) as failure:
        executor(tp2, None)
    [worker] = started[0].procs
    assert str(failure.value).startswith(f"rank 1 (pid {worker.pid}) failed: RuntimeError: "), failure.value
    assert "can't allocate memory: you tried to allocate" in str(failure.value)


def test_ctrl_c_reaches_the_ranks_and_rank_0_decides(tp2, shipped_model_dir):
    """Ctrl-C in a terminal (or a notebook's interrupt) sends SIGINT to the whole process group: a rank died of it,
    and the next request of the session failed naming it; the process that owns the executor decides."""
    ex = executor(tp2, None)
    [worker] = ex.ranks.procs
    worker.send_signal(signal.SIGINT)
    out = ex.submit(prompts(shipped_model_dir)[0], SamplingParams(max_tokens=8, ignore_eos=True)).result(60)
    assert out.finish_reason == "length" and worker.poll() is None and ex.health(60) is None
    ex.shutdown()


def test_a_rank_killed_while_idle_is_found_before_the_next_request(tp2):
    ex = executor(tp2, None)
    [worker] = ex.ranks.procs
    worker.kill()
    worker.wait()
    deadline = time.monotonic() + 10
    while ex.health(60) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"rank 1 (pid {worker.pid}) exited with code -9" in ex.health(60)
    ex.shutdown()


def test_shutdown_shorter_than_a_step_cancels_as_one_process_does(tp2):
    """shutdown(timeout) that ends before the step under way stops the ranks under it: the requests in flight ended
    "error" (RankFailure: the ranks have stopped) where one process ends them "cancelled", and it returned 5 s later."""
    ex = executor(tp2, None)
    handles = [ex.submit([5, 6, 7 + i], SamplingParams(max_tokens=200, ignore_eos=True)) for i in range(4)]
    next(iter(handles[0]))  # generating
    start = time.monotonic()
    ex.shutdown(timeout=0.01)
    took = time.monotonic() - start
    assert {(out.finish_reason, out.error) for out in (h.result(60) for h in handles)} == {("cancelled", None)}
    assert took < 4, f"shutdown(timeout=0.01) took {took:.1f} s"  # it waited 5 s for ranks never told to stop


def test_a_server_watchdog_stops_the_executor_and_a_stopped_rank(tp2, shipped_model_dir, monkeypatch):
    """dsv3-serve's watchdog, finding a rank stopped (SIGSTOP) mid-request, only stopped the server: uvicorn waited on
    the requests in flight until the watchdog killed it, their clients got a dropped connection, and the rank stayed
    behind, stopped. The executor stops first now: its requests end, the rank is killed."""
    from serving.openai_server import cli

    stopped = []
    monkeypatch.setattr(cli, "stop_server", lambda pid, reason: stopped.append((pid, reason)))
    ex = executor(tp2, None)
    [worker] = ex.ranks.procs
    handle = ex.submit(prompts(shipped_model_dir)[0], SamplingParams(max_tokens=200, ignore_eos=True))
    next(iter(handle))  # generating
    os.kill(worker.pid, signal.SIGSTOP)
    time.sleep(0.5)  # rank 0 waits in a collective for rank 1
    cli.stop_after_executor(ex, "engine: stalled")
    assert handle.result(30).finish_reason == "cancelled"
    assert _gone(worker.pid) and stopped == [(os.getpid(), "engine: stalled")]


def test_rank_0_takes_its_share_of_threads_on_its_step_loop_alone(tp2):
    """Rank 0 steps with its share of the process's threads while its ranks run; each tp-2 executor halved the
    caller's threads for good (16, 8, 4, 2 after three), and later executors ran on what was left."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(2):
            ex = executor(tp2, None)
            stepping = []  # an output callback runs on the step loop's thread
            ex.submit([5, 6, 7], SamplingParams(max_tokens=2), on_output=lambda out: stepping.append(
                torch.get_num_threads())).result(60)
            assert ex.ranks.threads == 1 and set(stepping) == {1} and torch.get_num_threads() == 2
            started = []  # a thread started while it runs takes torch's process-wide setting: the caller's
            threading.Thread(target=lambda: started.append(torch.get_num_threads())).start()
            time.sleep(0.2)
            assert started == [2]
            ex.shutdown()
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rank_stopped", [False, True], ids=["running", "stopped"])
def test_ranks_die_with_a_killed_executor_process(tp2, rank_stopped):
    """Also a rank stopped by SIGSTOP: SIGTERM would stay pending until a SIGCONT that never comes, an orphan."""
    script = (f"import sys; from runtime.executors.native import Executor; from runtime.executors.base import ExecutorConfig\n"
              f"ex = Executor({str(tp2)!r}, ExecutorConfig(kv_cache_tokens=512, num_draft_tokens=0))\n"
              f"print(*[p.pid for p in ex.ranks.procs], flush=True)\n"
              f"sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids
        if rank_stopped:
            os.kill(pids[0], signal.SIGSTOP)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert all(_gone(pid) for pid in pids)
    finally:
        proc.kill()


FORK_SCRIPT = """
import gc, os, signal, sys
from runtime.core.sampling_params import SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
ex = Executor(sys.argv[1], ExecutorConfig(kv_cache_tokens=512, num_draft_tokens=0))
for close in (True, False):
    if os.fork() == 0:  # the child ends its copy of the executor, then exits as a script does
        signal.alarm(30)  # one that hangs dies
        if close:
            ex.shutdown()
            del ex
            gc.collect()
        sys.exit(0)
    print("child", os.wait()[1], flush=True)
print(ex.submit([5, 17, 42], SamplingParams(max_tokens=4)).result(60).finish_reason, flush=True)
ex.shutdown()
"""


def test_a_forked_child_leaves_the_ranks_to_its_parent(tp2):
    """A process forked after the executor started (os.fork, multiprocessing's 'fork') holds a copy of rank 0's
    group but none of its threads: closing or collecting it there hung (gloo's destructor joins threads the child
    does not have), and exiting with it aborted the child. The child must leave its parent's ranks alone."""
    run = subprocess.run([sys.executable, "-c", FORK_SCRIPT, str(tp2)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert (run.returncode, run.stdout.split()) == (0, ["child", "0", "child", "0", "length"]), run.stderr[-2000:]


TORCHRUN_SCRIPT = """
import sys
from runtime.core.sampling_params import SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
with Executor(sys.argv[1], ExecutorConfig(num_draft_tokens=2, speculation="fixed", kv_cache_tokens=1024)) as ex:
    out = ex.submit([5, 17, 300, 42, 7], SamplingParams(max_tokens=12, temperature=0.0)).result().token_ids
    print("tokens", ex.stats().world_size, *out, flush=True)
"""


def test_torchrun_starts_the_ranks(tp2, tmp_path):
    """Under torchrun rank 0's executor joins the ranks torchrun started; the others serve it and exit 0."""
    script = tmp_path / "generate.py"
    script.write_text(TORCHRUN_SCRIPT)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(script), str(tp2)], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
    [line] = [x for x in run.stdout.splitlines() if x.startswith("tokens")]
    with Executor(tp2, ExecutorConfig(num_draft_tokens=2, speculation="fixed", kv_cache_tokens=1024,
                                      world_size=1)) as ex:
        want = ex.submit([5, 17, 300, 42, 7], SamplingParams(max_tokens=12, temperature=0.0)).result().token_ids
    assert line.split()[1:] == ["2", *map(str, want)]


TORCHRUN_FAILING_SCRIPT = """
import os, sys
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.executors.ranks import RankFailure, RankGroup
print("pid", os.environ["RANK"], os.getpid(), flush=True)
send = RankGroup.send
def huge_cache(self, call):  # more bytes than the address space: rank 1's allocation fails
    send(self, ("cache", {**call[1], "shape": (1 << 50,)}) if call and call[0] == "cache" else call)
RankGroup.send = huge_cache
try:
    Executor(sys.argv[1], ExecutorConfig(num_draft_tokens=0, kv_cache_tokens=1024))
except RankFailure as e:
    print("error", e, flush=True)
"""


def test_a_rank_torchrun_started_names_its_error_on_rank_0(tp2, tmp_path):
    """A rank torchrun started whose own part fails (its KV cache here) logged its exception alone, and rank 0 raised
    "a forward failed on rank 0 of 2 (RuntimeError: ... Connection closed by peer ...)". It writes its exception to
    torchrun's store, and rank 0 names the rank, its pid and its error, as for ranks the executor starts."""
    script = tmp_path / "fail.py"
    script.write_text(TORCHRUN_FAILING_SCRIPT)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(script), str(tp2)], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    pids = dict(x.split()[1:] for x in run.stdout.splitlines() if x.startswith("pid"))
    [error] = [x for x in run.stdout.splitlines() if x.startswith("error")] or [run.stderr[-2000:]]
    assert error.startswith(f"error rank 1 (pid {pids['1']}) failed: RuntimeError: "), error
    assert "can't allocate memory: you tried to allocate 4503599627370496 bytes" in error


def test_dry_run_plans_what_the_ranks_hold(tp2, shipped_model_dir, capsys):
    """build_engine --dry_run, from config.json alone: each rank file's tensor bytes and the KV bytes per token
    that the tp-2 engine and its executor actually have."""
    from builder.cli import main
    from runtime.model.config import ModelConfig

    assert main(["--model_dir", str(shipped_model_dir), "--dry_run", "--tp_size", "2", "--max_seq_len", "256",
                 "--device_memory_gib", "1"]) == 0
    out = capsys.readouterr().out
    data = {(tp2 / f).stat().st_size - 8 - int.from_bytes((tp2 / f).read_bytes()[:8], "little")
            for f in ("rank0.safetensors", "rank1.safetensors")}
    assert data == {int(out.split("weights per rank: ")[1].split("(")[1].split(" bytes")[0])}
    per_token = ModelConfig.from_json(shipped_model_dir / "config.json").kv_bytes_per_token(4)
    assert f"KV cache per token, on every rank (the latent is replicated): {per_token} bytes" in out
    fit = (int(0.9 * 2**30) - data.pop()) // per_token
    assert f"{fit} tokens of KV cache ({fit // 256} sequences" in out


def test_world_size_must_fit_the_engine(tp2):
    with pytest.raises(ValueError, match="world_size 3: .* has tp_size 2"):
        Executor(tp2, ExecutorConfig(world_size=3))


def _ranks_under(root: int) -> list[str]:
    """Command lines of the rank processes among root's live descendants."""
    from runtime.executors.lifetime import live_descendants

    lines = [b" ".join(argv).decode() for argv in live_descendants(root).values()]
    return [c for c in lines if "runtime.executors.ranks" in c]


def test_triton_world_size_serves_the_engine_from_its_ranks(tp2, tmp_path):
    """launch_triton_server --world_size 2 on a tp-2 engine: one tritonserver, whose engine model starts rank 1 and
    answers as the joined engine does; stopping the server ends the rank. --world_size 3 fails to load, naming it."""
    pytest.importorskip("tritonclient.http")
    from serving.triton.launcher import start_server
    from serving.triton.model_repo import add_llmapi_model
    from test_triton import http_generate

    (tmp_path / "repo").mkdir()
    add_llmapi_model(tmp_path / "repo", tp2, decoupled=False)
    prompt = "def fibonacci(n):"
    with Executor(tp2, ExecutorConfig(world_size=1, kv_cache_tokens=1024)) as ex:
        want = ex.tokenizer.decode(
            ex.submit(ex.tokenizer.encode(prompt), SamplingParams(max_tokens=16, temperature=0.0)).result().token_ids)
    server = start_server(tmp_path / "repo", world_size=2, log_file=tmp_path / "server.log", ready_timeout_s=240,
                          exit_timeout_s=5)
    try:
        ranks = _ranks_under(server.process.pid)
        assert len(ranks) == 1 and "/tensorrt_llm/engine 1 2 " in ranks[0], ranks  # the engine, linked as "engine"
        status, body = http_generate(server, "tensorrt_llm", text_input=prompt, sampling_param_max_tokens=16,
                                     sampling_param_temperature=0.0)
        assert status == 200 and body["text_output"] == want, body
    finally:
        server.stop()
    assert not _ranks_under(os.getpid())
    with pytest.raises(RuntimeError, match="world_size 3: .* has tp_size 2"):
        start_server(tmp_path / "repo", world_size=3, log_file=tmp_path / "bad.log", ready_timeout_s=240,
                     exit_timeout_s=5)


def test_dsv3_serve_stops_when_a_rank_dies(tp2, shipped_model_dir, tmp_path):
    """dsv3-serve on a tp-2 engine serves the joined engine's tokens. A server whose executor has stopped serving
    answered 503 for ever (its /health said why); as vLLM's, it now takes itself down, exit status 1 and the reason
    on stderr, for a supervisor to restart it."""
    from runtime.executors.lifetime import live_descendants
    from serving.openai_server.process import start_dsv3_serve

    log = tmp_path / "serve.log"
    ids = prompts(shipped_model_dir)[0]
    with executor(tp2, 1) as joined:  # the same engine in one process
        want = joined.submit(ids, SamplingParams(max_tokens=16, ignore_eos=True)).result(60).token_ids
    server = start_dsv3_serve(tp2, "--num_draft_tokens", "2", "--kv_cache_tokens", "1024", log=log)
    try:  # first it serves from its ranks what the joined engine gives
        body = json.dumps({"model": tp2.name, "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                           "return_token_ids": True}).encode()
        request = urllib.request.Request(server.base_url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.load(response)["choices"][0]["token_ids"] == want
        [pid] = [p for p, argv in live_descendants(server.process.pid).items()
                 if b"runtime.executors.ranks" in b" ".join(argv)]
        os.kill(pid, signal.SIGKILL)
        assert server.process.wait(timeout=60) == 1
    finally:
        if server.process.poll() is None:
            server.process.kill()
    text = log.read_text()
    assert (f"dsv3-serve: stopped: engine: executor stopped: RankFailure: rank 1 (pid {pid}) exited with code -9"
            in text), text[-2000:]
