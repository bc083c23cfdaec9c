"""The ranks of a tensor/expert-parallel engine as processes of their own, on torch.distributed (gloo on CPU).

Rank 0 is the executor's process: it alone schedules, samples and accepts. `RankGroup.start` starts ranks 1.. (this
module as `python -m` runs it: `lifetime.python_module`), or torchrun has started every rank (`RankGroup.open`: rank
0's executor joins them; any other rank's executor becomes a worker that exits when rank 0 stops it); each loads its
own rank file (`load_engine(par=...)`), then runs every forward rank 0 runs, with the same arguments: rank 0's model
becomes a `DrivingModel`, whose forwards first broadcast their call (the method and its arguments: token ids,
positions, the `PagedBatch`, hidden states) to the other ranks. Each rank keeps a KV cache of the same shape, written
by the same forwards at the same slots (the latent cache is replicated, see runtime.model.deepseek_v3), so block
tables mean the same on every rank, and scheduling, speculation, in-flight batching, preemption and cancellation stay
on rank 0 unchanged.

Ranks started here meet through a file store in a directory only this user can open (removed once the group has
formed) and connect over loopback: torch's TCPStore listens on every interface, whatever host it is given, and
the ranks' calls are pickles. Ranks torchrun started meet at its store and connect as torch.distributed chooses.

Lifetime: a worker is killed (SIGKILL) with rank 0's process, even while stopped (runtime.executors.lifetime), and
exits when the group's connections close; `RankGroup.close` sends a stop, then SIGTERM, then SIGKILL. Any failure
inside a driven forward leaves the ranks out of step (some wait in a collective the others never reach), so it ends
the group and raises `RankFailure`, naming the rank that failed and why (a rank writes its exception before it exits:
to a pipe if started here, else to torchrun's store) or its exit code: the executor stops with it. When one rank dies,
the others lose their connections to it and report that too; the rank named is the one that failed on its own, or
where each that stopped only lost a peer, the one that sent no report (`culprit`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import json
import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.executors.lifetime import PID_NAMESPACE, python_module, remove_dead_pids_leftovers, rss_bytes, spawn
from runtime.io.engine_format import BuildConfig, EngineManifest
from runtime.io.loading import load_engine
from runtime.model.batch import PagedBatch
from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM
from runtime.model.kernels.modules import swap_class
from runtime.model.parallel import Parallel

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # the ranks of one host (a multi-host launch would use torchrun's rendezvous)
CONNECT_TIMEOUT = datetime.timedelta(seconds=120)  # a worker's loading and the group's forming
# A rank waits in a collective for the others for as long as they compute, and idle workers wait for rank 0's
# next call for as long as no request comes: no timeout fits both, so a dead rank is found by its closed
# connection (at once) and a stuck one by the executor's health watchdog.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)
RENDEZVOUS_LEFT = re.compile(rf"dsv3-ranks-{PID_NAMESPACE}-(\d+)-")  # a rank 0 killed while its ranks met
_CACHE = "<kv_cache>"  # stands for the rank's own KV cache in a broadcast call
REPORT_BYTES = 4096  # of a rank's last words (its exception) to rank 0: PIPE_BUF, so its one write arrives whole
# gloo's error when a peer's connection closes or breaks (its transport's file names it): a rank that reports it lost
# a peer, the one that failed
LOST_PEER = "gloo/transport/"


class RankFailure(RuntimeError):
    """A rank exited, or a forward failed on one, so the ranks are out of step: the executor must stop."""


@dataclass(frozen=True)
class Stopped:
    """A rank that exited (`code`; None: not seen exiting, as torchrun's are not) or reported why it stops (`reason`)."""

    rank: int
    pid: int | None
    code: int | None
    reason: str

    @property
    def lost_peer(self) -> bool:
        """It stopped because another rank's connection closed: that rank is the one to name."""
        return LOST_PEER in self.reason

    def __str__(self) -> str:
        who = f"rank {self.rank} (pid {self.pid})"
        return f"{who} failed: {self.reason}" if self.reason else f"{who} exited with code {self.code}"


def culprit(stopped: list[Stopped], pids: dict[int, int | None]) -> str:
    """What to say of the ranks that stopped (`pids`: every rank but 0's): one that failed on its own (its exception, a
    signal, an exit with nothing reported) before one that reports a lost connection (at tp > 2 the others' follow-on
    when one dies), the lowest rank among equals. When each only lost a peer, those lost are the ranks that sent no
    report: torchrun's ranks are not seen exiting, so one it killed says nothing."""
    first = min(stopped, key=lambda s: (s.lost_peer, s.rank))
    lost = sorted(s.rank for s in stopped)
    silent = [f"rank {r} (pid {pid})" for r, pid in sorted(pids.items()) if r not in lost]
    if not first.lost_peer or not silent:
        return str(first)
    who = silent[0] if len(silent) == 1 else f"one of {', '.join(silent)}"
    ranks = f"rank {lost[0]} lost its connection" if len(lost) == 1 else \
        f"ranks {', '.join(map(str, lost))} lost their connections"
    return f"{who} stopped without a report; {ranks} to it"


@dataclass(frozen=True)
class RankOptions:
    """What every rank loads with (ExecutorConfig's)."""

    dtype: str | None = None
    cpu_kernels: bool = True
    threads: int = 1  # torch intra-op threads per rank
    fp8_weights: bool | None = None


class RankGroup:
    """Rank 0's handle on ranks 1..world-1: their processes, the store they met at and the process group."""

    def __init__(self, path: Path, build: BuildConfig, store: dist.Store, procs: list[subprocess.Popen],
                 rendezvous: Path | None = None, reports: list[BinaryIO] | None = None):
        self.path, self.build, self.store, self.procs = path, build, store, procs
        self.pids = {r: p.pid for r, p in enumerate(procs, 1)}  # torchrun's ranks say theirs once loaded
        self.rendezvous = rendezvous  # the file store's directory, for ranks started here
        # for ranks started here, a pipe from each: why it stops after loading (the store is gone by then); torchrun's
        # say it in torchrun's store, which lives as long as they do
        self.reports = reports or []
        self.reasons: dict[int, str] = {}  # rank -> what it reported as it stopped
        self.par = Parallel(build.layout(0))  # its group once `connect` has formed it
        self.closed = False
        self.owner = os.getpid()  # a fork()ed copy of this process must leave the ranks alone
        _groups.add(self)
        self.sent_bytes = 0  # calls broadcast to each other rank
        # rank 0's share of this process's torch threads, for the thread that runs its steps (None: torchrun's setting)
        self.threads: int | None = None

    @property
    def world_size(self) -> int:
        return self.build.tp_size

    @classmethod
    def open(cls, path: str | Path, build: BuildConfig, options: RankOptions) -> "RankGroup":
        """Rank 0's group for a tp > 1 engine: the ranks torchrun started (on any other rank of those, serve rank 0's
        calls, then exit the process), else ranks 1.. started here; rank 0 loads its own file, then `connect`s.
        Torch threads: torchrun's setting, or this process's divided among the ranks (the host's cores): rank 0's share
        is `threads`, which the executor's step loop takes, leaving the caller's own setting as it was."""
        world = build.tp_size
        launched = torchrun_rank()
        if launched is not None:
            rank, size = launched
            if size != world:
                raise ValueError(f"torchrun started {size} ranks; {path} has tp_size {world}")
            if rank:
                options = dataclasses.replace(options, threads=torch.get_num_threads())
                store = _torchrun_store(rank, world)
                raise SystemExit(_worker(str(path), rank, world, store, options, loopback=False,
                                         report=lambda reason: store.set(f"failed/{rank}", reason)))
            return cls(Path(path), build, _torchrun_store(0, world), [])  # torchrun watches and ends the ranks
        threads = max(1, torch.get_num_threads() // world)
        group = cls.start(path, build, dataclasses.replace(options, threads=threads))
        group.threads = threads
        return group

    @classmethod
    def start(cls, path: str | Path, build: BuildConfig, options: RankOptions) -> "RankGroup":
        """Start ranks 1..tp_size-1 loading their rank files."""
        remove_dead_pids_leftovers(Path(tempfile.gettempdir()), RENDEZVOUS_LEFT)  # killed rank 0s' leftovers
        rendezvous = Path(tempfile.mkdtemp(prefix=f"dsv3-ranks-{PID_NAMESPACE}-{os.getpid()}-"))  # mode 0700
        store_file = str(rendezvous / "store")
        store = _file_store(store_file, build.tp_size)
        opts = json.dumps(asdict(options))
        procs, reports = [], []
        for r in range(1, build.tp_size):
            read, write = os.pipe()
            os.set_blocking(read, False)
            reports.append(os.fdopen(read, "rb", buffering=0))
            try:
                procs.append(spawn([*python_module("runtime.executors.ranks"), str(path), str(r), str(build.tp_size),
                                    store_file, opts, str(write)], signal.SIGKILL, pass_fds=(write,)))
            finally:
                os.close(write)
        log.info("started ranks 1..%d of %s (pids %s)", build.tp_size - 1, path, [p.pid for p in procs])
        return cls(Path(path), build, store, procs, rendezvous, reports)

    def connect(self) -> None:
        """Wait for every rank to have loaded its weights (or fail, naming why), then form the process group."""
        deadline = time.monotonic() + CONNECT_TIMEOUT.total_seconds()
        waiting = set(range(1, self.world_size))
        while waiting:
            for r in sorted(waiting):
                if self.store.check([f"error/{r}"]):
                    raise RankFailure(f"rank {r} could not load {self.path}: {self.store.get(f'error/{r}').decode()}")
                if self.store.check([f"loaded/{r}"]):
                    if r not in self.pids:  # torchrun's
                        self.pids[r] = int(self.store.get(f"loaded/{r}"))
                    waiting.discard(r)
            self.check()
            if time.monotonic() > deadline:
                raise RankFailure(f"ranks {sorted(waiting)} did not load {self.path} within "
                                  f"{CONNECT_TIMEOUT.total_seconds():.0f} s")
            time.sleep(0.02)
        self.par.group = self._form_group()
        self._remove_rendezvous()

    def _form_group(self) -> dist.ProcessGroup:
        """The process group, formed on a thread of its own while the ranks' processes are watched: gloo waits for
        every rank to join for as long as its collectives may take (COLLECTIVE_TIMEOUT), so a rank that exits after
        loading held rank 0 there."""
        formed: dict[str, Any] = {}

        def form() -> None:
            try:
                formed["group"] = _group(self.store, 0, self.world_size, loopback=self.rendezvous is not None)
            except Exception as e:  # raised below, on the caller's thread
                formed["error"] = e

        thread = threading.Thread(target=form, name="rank-group", daemon=True)
        thread.start()
        deadline = time.monotonic() + CONNECT_TIMEOUT.total_seconds()
        while thread.is_alive():
            self.check()
            if time.monotonic() > deadline:
                raise RankFailure(f"the ranks of {self.path} did not form their group within "
                                  f"{CONNECT_TIMEOUT.total_seconds():.0f} s")
            thread.join(0.05)
        if "error" in formed:  # taken out: its traceback holds form's frame, which holds `formed` (a cycle)
            raise RankFailure(f"the ranks of {self.path} could not form their group: {formed.pop('error')}")
        return formed["group"]

    def _remove_rendezvous(self) -> None:
        if self.rendezvous is not None:
            shutil.rmtree(self.rendezvous, ignore_errors=True)

    def _stopped(self, rank: int, read_report: bool) -> Stopped | None:
        """The rank if it exited, with what it reported; `read_report` also reads a report of a rank still exiting
        (after a failed call; each step's check only polls: a read a step and a rank is a system call, a round trip to
        torchrun's store)."""
        code = self.procs[rank - 1].poll() if self.procs else None  # torchrun's are not ours to poll
        reason = self._reason(rank) if code is not None or read_report else ""
        return Stopped(rank, self.pids.get(rank), code, reason) if code is not None or reason else None

    def _reason(self, rank: int) -> str:
        """What a rank reported as it stopped (its exception, one write: whole or not yet there); '' if nothing."""
        if not self.reasons.get(rank):
            self.reasons[rank] = self._read_report(rank)
        return self.reasons[rank]

    def _read_report(self, rank: int) -> str:
        if not self.reports:  # torchrun's ranks: its store
            with contextlib.suppress(RuntimeError):  # gone: torchrun is ending the ranks
                if self.store.check([f"failed/{rank}"]):
                    return self.store.get(f"failed/{rank}").decode(errors="replace")
            return ""
        with contextlib.suppress(ValueError):  # closed by a shutdown's close(), maybe meanwhile on another thread
            return (self.reports[rank - 1].read(REPORT_BYTES) or b"").decode(errors="replace")
        return ""

    def check(self, read_reports: bool = False) -> None:
        """RankFailure if a rank has exited, or with `read_reports` has reported, naming the `culprit` and why (every
        rank's report is read first: the one to name may still be exiting)."""
        if read_reports or any(self._stopped(r, False) for r in range(1, self.world_size)):
            if stopped := self._all_stopped():
                raise RankFailure(self._culprit(stopped))

    def _all_stopped(self) -> list[Stopped]:
        return [s for r in range(1, self.world_size) if (s := self._stopped(r, True))]

    def _culprit(self, stopped: list[Stopped]) -> str:
        return culprit(stopped, {r: self.pids.get(r) for r in range(1, self.world_size)})

    def send(self, call: tuple[str, dict[str, Any]] | None) -> None:
        """Broadcast a call (method name, keyword arguments) to ranks 1..; None stops them."""
        data = torch.frombuffer(bytearray(pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        self.sent_bytes += _broadcast(self.par, torch.tensor([data.numel()])) + _broadcast(self.par, data)

    def attach_cache(self, cache: Tensor) -> None:
        """Every rank allocates a KV cache of rank 0's shape and dtype; a rank that cannot fails this call, naming why,
        not a later step."""
        try:
            self.send(("cache", {"shape": tuple(cache.shape), "dtype": cache.dtype}))
            self.par.group.barrier().wait()
        except Exception as e:
            raise self.failed(e) from e

    def failed(self, error: BaseException) -> RankFailure:
        """The failure to raise after `error` inside a driven call: which rank failed or exited, if one did (waiting a
        moment for it to show; the whole moment while those stopped only lost a peer, for the others' reports, which
        tell the one lost), else the error itself. The group is closed: its ranks are out of step."""
        stopped: list[Stopped] = []
        for _ in range(50):
            stopped = self._all_stopped()
            if stopped and not all(s.lost_peer for s in stopped):
                break
            time.sleep(0.02)
        self.close(graceful=False)
        if LOST_PEER in str(error):  # rank 0 lost a peer too: at tp 2 under torchrun, the only word of a killed rank 1
            stopped.append(Stopped(0, os.getpid(), None, f"{type(error).__name__}: {error}"))
        if stopped:
            return RankFailure(self._culprit(stopped))
        return RankFailure(f"a forward failed on rank 0 of {self.world_size} ({type(error).__name__}: {error}); "
                           "the ranks are out of step")

    def memory(self) -> list[int]:
        """Each rank's resident memory in bytes, rank 0 first (rank 0's alone under torchrun, which started the
        others: their pids are not known here)."""
        return [rss_bytes(pid) for pid in [os.getpid(), *(p.pid for p in self.procs)]]

    def close(self, graceful: bool = True) -> None:
        """Stop the ranks: a stop message when `graceful` (no call may be in flight) and a wait for them to exit, then
        SIGTERM, then SIGKILL. Nothing in a fork()ed child: the ranks are its parent's."""
        if self.closed or os.getpid() != self.owner:
            return
        self.closed = True
        self._remove_rendezvous()
        steps: tuple[tuple[signal.Signals | None, float | None], ...] = ((signal.SIGTERM, 5.0), (signal.SIGKILL, None))
        if graceful and self.par.group is not None and all(p.poll() is None for p in self.procs):
            try:
                self.send(None)
                steps = ((None, 5.0), *steps)
            except RuntimeError:
                pass
        for sig, wait in steps:
            alive = [p for p in self.procs if p.poll() is None]
            if not alive:
                break
            for p in alive:
                if sig is not None:
                    p.send_signal(sig)
            for p in alive:
                try:
                    p.wait(wait)
                except subprocess.TimeoutExpired:
                    pass
        for r in range(1, len(self.reports) + 1):  # what they reported, before the pipes close
            self._reason(r)
        for report in self.reports:
            report.close()
        self.par.group = None


_groups: weakref.WeakSet[RankGroup] = weakref.WeakSet()


def _keep_in_child() -> None:
    """A fork()ed child has copies of the groups' gloo state and stores but not their threads: destroying them there
    (a close, the garbage collector, the interpreter's exit) hangs joining those threads or aborts. It keeps them,
    one reference more each, until it exits."""
    for group in list(_groups):
        for kept in (group.store, group.par.group):
            if kept is not None:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))


os.register_at_fork(after_in_child=_keep_in_child)


class DrivingModel(DeepseekV3ForCausalLM):
    """Rank 0's model: each forward is broadcast to the other ranks before it runs here (swapped in by `drive`)."""

    ranks: RankGroup

    def _driven(self, name: str, kwargs: dict[str, Any]) -> Any:
        if self.ranks.closed:
            raise RankFailure("the ranks have stopped")
        cache = kwargs.get("kv_cache")
        try:
            self.ranks.send((name, {**kwargs, "kv_cache": _CACHE} if cache is not None else kwargs))
            return getattr(super(), name)(**kwargs)
        except Exception as e:
            raise self.ranks.failed(e) from e

    def forward(self, input_ids: Tensor, positions: Tensor | None = None, batch: PagedBatch | None = None,
                kv_cache: Tensor | None = None) -> Tensor:
        return self._driven("forward", dict(input_ids=input_ids, positions=positions, batch=batch, kv_cache=kv_cache))

    def mtp_forward(self, depth: int, next_ids: Tensor, hidden: Tensor, positions: Tensor | None = None,
                    batch: PagedBatch | None = None, kv_cache: Tensor | None = None, rows: Tensor | None = None,
                    mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self._driven("mtp_forward", dict(depth=depth, next_ids=next_ids, hidden=hidden, positions=positions,
                                                batch=batch, kv_cache=kv_cache, rows=rows, mask=mask))

    def logits(self, hidden: Tensor) -> Tensor:
        return self._driven("logits", dict(hidden=hidden))


def drive(model: DeepseekV3ForCausalLM, ranks: RankGroup) -> DrivingModel:
    """Rank 0's model as a `DrivingModel` of `ranks` (the same parameters and modules)."""
    driving = swap_class(model, DrivingModel)
    driving.ranks = ranks
    return driving


# ---- plumbing ------------------------------------------------------------------------------------------------
def _group(store: dist.Store, rank: int, world: int, loopback: bool) -> dist.ProcessGroup:
    """The ranks' gloo group, of their own (not torch.distributed's default group: one process may hold several),
    formed when every rank has joined it (its store is no longer needed then); over loopback for ranks of one host
    (else gloo listens on the address the host name resolves to)."""
    store = dist.PrefixStore("gloo", store)
    if loopback:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = COLLECTIVE_TIMEOUT
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
        group = dist.ProcessGroupGloo(store, rank, world, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, world, COLLECTIVE_TIMEOUT)
    group.barrier().wait()
    return group


def _file_store(path: str, world: int) -> dist.FileStore:
    store = dist.FileStore(path, world)
    store.set_timeout(CONNECT_TIMEOUT)
    return store


def _broadcast(par: Parallel, t: Tensor) -> int:
    """Rank 0's t to every rank; its bytes."""
    par.group.broadcast(t, 0).wait()
    if par.layout.rank:
        par.received_bytes += t.numel() * t.element_size()
    return t.numel() * t.element_size()


def _receive(par: Parallel) -> tuple[str, dict[str, Any]] | None:
    size = torch.zeros(1, dtype=torch.long)
    _broadcast(par, size)
    data = torch.empty(int(size), dtype=torch.uint8)
    _broadcast(par, data)
    return pickle.loads(data.numpy().tobytes())


@torch.inference_mode()
def _serve(model: DeepseekV3ForCausalLM, par: Parallel) -> None:
    """Run rank 0's calls in order until it sends None."""
    cache = None
    while (call := _receive(par)) is not None:
        name, kwargs = call
        if name == "cache":
            cache = torch.zeros(kwargs["shape"], dtype=kwargs["dtype"])
            par.group.barrier().wait()  # rank 0 waits for every rank's cache
            continue
        if kwargs.get("kv_cache") == _CACHE:
            kwargs["kv_cache"] = cache
        getattr(model, name)(**kwargs)


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when torchrun (torch.distributed's env:// variables) started this process, else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2 or "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        return None
    return int(os.environ["RANK"]), world


def _torchrun_store(rank: int, world: int) -> dist.Store:
    """The store at MASTER_ADDR:MASTER_PORT: torchrun's agent hosts it, or else rank 0."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent, timeout=CONNECT_TIMEOUT)
    return dist.PrefixStore("dsv3", store)


def _worker(path: str, rank: int, world: int, store: dist.Store, options: RankOptions, loopback: bool,
            report: Callable[[str], object]) -> int:
    """Load this rank's file and serve rank 0's calls. A load failure goes to the store (rank 0 waits there); a later
    one, to `report`, where rank 0 reads it when a call fails or the rank has exited."""
    torch.set_num_threads(options.threads)
    try:
        manifest = EngineManifest.read(Path(path))
        par = Parallel(manifest.build.layout(rank))
        engine = load_engine(path, dtype=options.dtype, cpu_kernels=options.cpu_kernels,
                             fp8_weights=options.fp8_weights, par=par, manifest=manifest)
    except Exception as e:  # rank 0 reports it
        store.set(f"error/{rank}", f"{type(e).__name__}: {e}")
        return 1
    store.set(f"loaded/{rank}", str(os.getpid()))
    par.group = _group(store, rank, world, loopback)
    try:
        _serve(engine.model, par)
    except Exception as e:  # rank 0 has gone (its connection closed), a collective failed, or this rank's own part
        log.error("rank %d of %d stops: %s", rank, world, e)
        with contextlib.suppress(OSError, RuntimeError):  # rank 0 (or torchrun's store) has gone
            report(f"{type(e).__name__}: {e}")
        return 1
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description="one worker rank of a tensor-parallel engine (started by RankGroup)")
    p.add_argument("path")
    p.add_argument("rank", type=int)
    p.add_argument("world", type=int)
    p.add_argument("store", help="the file store rank 0 made")
    p.add_argument("options")
    p.add_argument("report", type=int, help="a pipe to rank 0: why this rank stops")
    args = p.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0's process decides
    logging.basicConfig(level=logging.WARNING, format=f"rank {args.rank}: %(levelname)s %(message)s")
    return _worker(args.path, args.rank, args.world, _file_store(args.store, args.world),
                   RankOptions(**json.loads(args.options)), loopback=True,
                   report=lambda reason: os.write(args.report, reason.encode()[:REPORT_BYTES]))


if __name__ == "__main__":
    sys.exit(main())
