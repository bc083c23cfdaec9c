"""Child processes and threads of ours: the interpreter children run on, their ending with their parent (the engine
process, tensor-parallel ranks, servers started by tests and benchmarks), executors stopped at exit, resident
memory, a process's live descendants, free ports for the servers we start, and the removal of what killed processes
left. Kept free of torch so the light command-line tools can use it."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

log = logging.getLogger("runtime.executors.lifetime")

PR_SET_PDEATHSIG = 1
# the most torch threads a server's process may be given: more cores than any host this runs on (OpenMP aborts
# allocating the stacks of a huge count)
MAX_TORCH_THREADS = 1024
# A pid names a process only within its pid namespace; containers that share /dev/shm or /tmp (docker --ipc=host)
# do not share pids, so names that carry a pid carry the namespace too.
PID_NAMESPACE = os.stat("/proc/self/ns/pid").st_ino
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved at import: a forked child only calls it


def python_executable() -> str:
    """This environment's interpreter. A Triton Python stub embeds Python: its sys.executable is the stub, and
    the interpreter is the `python3` that the launcher puts first on PATH."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    found = shutil.which("python3")
    if found is None:
        raise RuntimeError(f"no Python interpreter to start a child process with ({sys.executable!r} is not one "
                           "and no python3 is on PATH)")
    return found


# runs `module` as __main__ with the directory this project's packages were imported from first on sys.path, where
# `python -m` puts the working directory: a `runtime/` there (another checkout, a stranger's file in /tmp) is not run
# (where PYTHONSAFEPATH leaves the working directory out, the root goes first all the same)
_RUN_MODULE = ("import runpy, sys; root = sys.argv.pop(2); "
               "sys.path[:1] = [root] if sys.path[:1] == [''] else [root, *sys.path[:1]]; "
               "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")
PACKAGES_ROOT = str(Path(__file__).resolve().parents[2])  # holds runtime/


def python_module(module: str) -> list[str]:
    """The command that runs our `module` as `python -m module` would, but importing our packages from where this
    process did, whatever the child's working directory holds."""
    return [python_executable(), "-c", _RUN_MODULE, module, PACKAGES_ROOT]


def module_run_by(argv: Sequence[bytes]) -> str | None:
    """The module a process started by `python_module` runs, from its command line as /proc holds it; else None."""
    code = _RUN_MODULE.encode()
    return argv[argv.index(code) + 1].decode() if code in argv[:-1] else None


_spawns: queue.SimpleQueue = queue.SimpleQueue()  # (args, Popen keyword arguments, future) for the spawner
_spawner: threading.Thread | None = None
_spawner_lock = threading.Lock()


def _spawn_forever(spawns: queue.SimpleQueue) -> None:
    while True:
        args, kwargs, death_signal, future = spawns.get()
        try:  # the child gets death_signal when this thread ends
            future.set_result(subprocess.Popen(args, preexec_fn=partial(_prctl, PR_SET_PDEATHSIG, death_signal),
                                               **kwargs))
        except BaseException as e:
            future.set_exception(e)


def _kill_unowned(future: Future) -> None:
    if future.exception() is None:
        future.result().kill()


def spawn(args: Sequence[str | Path], death_signal: signal.Signals = signal.SIGTERM, **kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(args, **kwargs)` for a child that gets `death_signal` when this process dies, even by SIGKILL,
    so that nothing it started keeps running, holding memory or ports. The signal (PR_SET_PDEATHSIG) comes when the
    thread that forked the child ends, not the process: every child is forked by one thread that lives as long as the
    process, whatever thread asks (a worker thread that loads an executor, asyncio.to_thread, ends before it).
    SIGTERM lets a server child shut down cleanly; a child with nothing to save once its parent is gone takes SIGKILL,
    which also ends it while it is stopped (SIGSTOP), where SIGTERM would wait until it is continued."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = threading.Thread(target=_spawn_forever, args=(_spawns,), name="child-process spawner",
                                        daemon=True)
            _spawner.start()
    future: Future = Future()
    _spawns.put((list(args), kwargs, death_signal, future))
    try:
        return future.result()
    except BaseException:  # interrupted while it started (Ctrl-C): nobody will own the child
        future.add_done_callback(_kill_unowned)
        raise
    finally:
        del future  # it holds a raised error, whose traceback holds this frame: a reference cycle


_at_exit: dict[int, tuple[object, Callable[[], None]]] = {}  # id(owner) -> (owner, how to stop it), kept till exit


def stop_at_exit(owner: object, stop: Callable[[], None]) -> None:
    """Run `stop` at interpreter exit unless `forget_at_exit(owner)` comes first: executors left open stop while this
    process can still take their outputs (an engine process then exits with it, not after it into a closed pipe)
    and before the interpreter finalizes (a step loop's daemon thread that takes the GIL back after a kernel is ended
    by pthread_exit, whose unwinding through C++ frames aborts the process). Plain atexit, not
    threading._register_atexit: that runs before non-daemon threads are joined, which may still be generating."""
    _at_exit[id(owner)] = owner, stop


def forget_at_exit(owner: object) -> None:
    _at_exit.pop(id(owner), None)


@atexit.register
def _stop_what_runs() -> None:
    for _, stop in list(_at_exit.values()):
        try:
            stop()
        except Exception:  # one that fails to stop must not leave the others running into finalization
            log.exception("stopping %r at exit failed", stop)


def _after_fork_in_child() -> None:
    """A fork()ed copy of this process starts with no spawner (not the parent's requests, nor its lock held) and owns
    none of its parent's executors (stopping them at its exit would end the parent's)."""
    global _spawns, _spawner, _spawner_lock
    _spawns, _spawner, _spawner_lock = queue.SimpleQueue(), None, threading.Lock()
    _at_exit.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def stop_signals_to(handler: Callable[[int, Any], Any]) -> Iterator[None]:
    """SIGINT and SIGTERM go to `handler` inside the block (the main thread's); the previous handlers come back after
    it."""
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after its "pid (comm)" (state, ppid, ...; utime and stime at 11 and 12), None
    once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has), whoever's it is."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def live_descendants(root_pid: int) -> dict[int, list[bytes]]:
    """The live (not zombie) descendants of `root_pid`: pid -> its command line's arguments."""
    children: dict[int, list[int]] = {}
    state: dict[int, str] = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        pid = int(stat_file.parent.name)
        fields = proc_stat(pid)
        if fields is None:
            continue
        state[pid] = fields[0]
        children.setdefault(int(fields[1]), []).append(pid)
    found, todo = {}, [root_pid]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if state[pid] != "Z":
                found[pid] = argv
    return found


def remove_dead_pids_leftovers(directory: Path, pattern: re.Pattern[str]) -> list[Path]:
    """Remove the files and directories in `directory` whose names `pattern` matches with the pid (group 1) of a
    process of this pid namespace that has ended: what a process killed before its cleanup left. A dead pid
    proves them stale; a reused pid keeps them. Returns what was removed (not other users' entries, which a
    sticky directory keeps)."""
    removed = []
    for path in directory.iterdir():
        m = pattern.match(path.name)
        if not m or running(int(m.group(1))):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
        if not path.exists():
            removed.append(path)
    return removed


def status_kb(pid: int, field: str) -> int | None:
    """A /proc/<pid>/status field in kB (VmRSS, VmHWM, RssShmem, ...); None once the process is gone, or where it
    has no such field."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes(pid: int, peak: bool = False) -> int:
    """A process's resident memory (VmRSS), or its peak (VmHWM), in bytes; 0 once it is gone."""
    return (status_kb(pid, "VmHWM" if peak else "VmRSS") or 0) * 1024


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` now (all sockets held until all are chosen)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
        return ports
