"""Launch tritonserver on a model repository (TensorRT-LLM backend's launch_triton_server.py,
made to work without NVIDIA's container).

The `nvidia-pytriton` wheel ships the real tritonserver, but not runnable in place: the Python
backend looks for its stub next to libtriton_python.so, the wheel keeps one stub per Python
version elsewhere, and the binaries need the wheel's bundled libraries and a shared libpython on
the library path. This script prepares a private copy of the backends with the right stub, sets
LD_LIBRARY_PATH and PATH (the stub takes its Python environment from the `python3` first on PATH),
starts the server bound to 127.0.0.1 unless told otherwise, waits until /v2/health/ready answers,
and stops it on SIGINT/SIGTERM. --world_size N serves an engine built with --tp_size N from one tritonserver whose
engine model starts the engine's ranks itself (runtime.executors.ranks), as TensorRT-LLM's LLM API spawns its
workers under upstream's `llmapi` model; upstream's mpirun of one tritonserver per rank served the C++ backend it
deleted.

    launch_triton_server --model_repo /tmp/repo --http_port 8000

As a library (tests): `with start_server(repo) as server: ... server.http_url ...`.
"""

from __future__ import annotations

import argparse
import atexit
import bisect
import contextlib
import importlib.util
import itertools
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from runtime.executors.lifetime import (PID_NAMESPACE, free_ports, live_descendants, remove_dead_pids_leftovers,
                                        spawn, stop_signals_to)
from runtime.cli import show_defaults
from serving.triton.engine_limits import SERVER_DIR_PREFIX, server_dir
from serving.triton.parameters import WORLD_SIZE_ENV
from serving.watchdog import KILL_AFTER_S, STOP_REASON_ENV

CONTAINER_TRITONSERVER = Path("/opt/tritonserver/bin/tritonserver")
RESTRICTED_APIS = "shared-memory,model-repository,logging,trace"
ADMIN_HEADER = "admin-key"
SHM_DIR = Path("/dev/shm")
# Names that carry the pid of a launcher (stub regions, work directories) or of a tritonserver (limits directories):
# each pattern's group is the pid. Only this pid namespace's: another's pids say nothing here.
LEFTOVERS = ((SHM_DIR, re.compile(rf"dsv3_{PID_NAMESPACE}_(\d+)_\d+_")),  # dsv3_<ns>_<launcher pid>_<n>_<Triton's>
             (None, re.compile(rf"dsv3-triton-{PID_NAMESPACE}-(\d+)-")),  # dsv3-triton-<ns>-<launcher pid>-<random>
             (None, re.compile(rf"{re.escape(SERVER_DIR_PREFIX)}(\d+)$")))  # server_dir: None is the temporary dir
STUB_BINARY = "triton_python_backend_stub"
SUPERVISE_PERIOD_S = 1.0
STOP_REASON_FILE = "stop_reason"  # in the work directory, named to the models by serving.watchdog.STOP_REASON_ENV
# Each Python backend stub's shared-memory region starts this large (Triton's default is 1 MiB), so that request
# bodies up to a few MB (refused ones included) fit without growing it: Triton 2.51 maps a grown region again and
# keeps the old mapping, so every growth adds to the resident memory of the stub and of tritonserver for good.
# The file is sparse: pages are memory only once a body has used them.
PYTHON_SHM_REGION_BYTES = 16 << 20
_instance_counter = itertools.count()


@dataclass(frozen=True)
class TritonInstall:
    """Where the pieces of a tritonserver installation are."""

    tritonserver: Path
    backends: Path  # contains python/libtriton_python.so
    caches: Path | None
    stub: Path | None  # the wheel's Python stub, to put next to libtriton_python.so (None: already there)
    lib_dirs: tuple[Path, ...]  # to prepend to LD_LIBRARY_PATH


def find_install(tritonserver: str | Path | None = None) -> TritonInstall:
    """The installation to use: `tritonserver` if given, else the nvidia-pytriton wheel's, else
    NVIDIA's container layout (/opt/tritonserver)."""
    if tritonserver is not None:
        binary = Path(tritonserver).resolve()
        if not binary.is_file():
            raise FileNotFoundError(f"--tritonserver {tritonserver}: no such file")
        root = binary.parent.parent
        return _install_from_root(root, binary)
    spec = importlib.util.find_spec("pytriton")
    if spec is not None and spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
        if (root / "bin" / "tritonserver").is_file():
            return _install_from_root(root, root / "bin" / "tritonserver")
    if CONTAINER_TRITONSERVER.is_file():
        return _install_from_root(CONTAINER_TRITONSERVER.parent.parent, CONTAINER_TRITONSERVER)
    raise FileNotFoundError(
        "tritonserver not found: install it with `pip install nvidia-pytriton==0.7.0` "
        "or pass --tritonserver PATH")


def _install_from_root(root: Path, binary: Path) -> TritonInstall:
    backends = root / "backends"
    if not (backends / "python" / "libtriton_python.so").is_file():
        raise FileNotFoundError(f"{backends}/python/libtriton_python.so not found (Python backend missing)")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        if (backends / "python" / "triton_python_backend_stub").is_file():
            stub = None  # a container build: the stub is in place
        else:
            raise FileNotFoundError(f"no Python backend stub for Python {version} under {root}")
    lib_dirs = [d for d in (root.parent.parent / "nvidia_pytriton.libs", root / "lib") if d.is_dir()]
    if stub is not None:  # a stub built elsewhere links a shared libpython we must point it to
        lib_dirs.append(find_libpython_dir())
    caches = root / "caches" if (root / "caches").is_dir() else None
    return TritonInstall(binary, backends, caches, stub, tuple(dict.fromkeys(lib_dirs)))


def find_libpython_dir() -> Path:
    """Directory of the shared libpython of the running Python's version, which the stub links."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    names = [sysconfig.get_config_var("INSTSONAME"), f"libpython{version}.so.1.0", f"libpython{version}.so"]
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [sysconfig.get_config_var("LIBDIR"), Path(sys.base_prefix) / "lib",
            Path("/usr/lib") / multiarch, Path("/usr/local/lib"), Path("/usr/lib")]
    for d in dirs:
        for name in names:
            if d and name and ".so" in name and (Path(d) / name).is_file():
                return Path(d)
    raise FileNotFoundError(
        f"no shared libpython{version} found (looked in {', '.join(str(d) for d in dirs if d)}); the "
        f"Python backend stub needs one: use a Python built with --enable-shared or install libpython{version}")


def prepare_backends(install: TritonInstall, workdir: Path) -> Path:
    """The backend directory to use: the installation's when its Python stub is in place (a
    container), else a copy in `workdir` with the wheel's stub for this Python added."""
    if install.stub is None:
        return install.backends
    backends = workdir / "backends"
    shutil.copytree(install.backends, backends, ignore=shutil.ignore_patterns("__pycache__"))
    dst = backends / "python" / "triton_python_backend_stub"
    shutil.copy2(install.stub, dst)
    dst.chmod(0o755)
    return backends


def server_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver: bundled libraries and libpython on LD_LIBRARY_PATH, this
    Python's bin directory first on PATH (the stub's `python3`)."""
    env = dict(os.environ if base is None else base)
    libs = [str(d) for d in install.lib_dirs]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def restricted_api_args(admin_api_key: str | None) -> list[str]:
    """Keep the admin APIs (shared memory, model repository and control, logging, tracing) away from clients:
    Triton serves them only to requests carrying the header `admin-key` (gRPC: `triton-grpc-protocol-admin-key`)
    with this value. Without one they are off: the value is random and holds a line break, which no HTTP header
    or gRPC metadata value can carry, since tritonserver's command line (and the key on it) is readable by every
    local user. Shared-memory registration let any client that reaches the port crash the server through a
    Python stub's own region."""
    key = admin_api_key or f"{secrets.token_hex(16)}\n{secrets.token_hex(16)}"
    return [f"--http-restricted-api={RESTRICTED_APIS}:{ADMIN_HEADER}={key}",
            f"--grpc-restricted-protocol={RESTRICTED_APIS}:{ADMIN_HEADER}={key}"]


def build_command(install: TritonInstall, backends: Path, model_repo: Path, *,
                  host: str, http_port: int, grpc_port: int, metrics_port: int, log_verbose: int = 0,
                  exit_timeout_s: int = 30, shm_prefix: str = "dsv3_", admin_api_key: str | None = None) -> list[str]:
    """The tritonserver command line."""
    cmd = [
        str(install.tritonserver),
        f"--model-repository={model_repo}",
        f"--backend-directory={backends}",
        f"--http-address={host}", f"--http-port={http_port}",
        f"--grpc-address={host}", f"--grpc-port={grpc_port}",
        f"--metrics-address={host}", f"--metrics-port={metrics_port}",
        "--allow-gpu-metrics=false",
        "--disable-auto-complete-config",
        f"--exit-timeout-secs={exit_timeout_s}",
        *restricted_api_args(admin_api_key),
        # distinct per server: python stubs of two servers must not share shm regions
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
        f"--backend-config=python,shm-default-byte-size={PYTHON_SHM_REGION_BYTES}",
    ]
    if install.caches is not None:
        cmd.append(f"--cache-directory={install.caches}")
    if log_verbose:
        cmd.append(f"--log-verbose={log_verbose}")
    return cmd


@dataclass
class TritonServer:
    """A running tritonserver; stop() it, or use it as a context manager."""

    process: subprocess.Popen
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path | None
    workdir: Path
    shm_prefix: str  # of the Python backend's shared-memory regions, unique to this server
    _log_handle: object | None = field(default=None, repr=False)
    stubs: dict[int, str] = field(default_factory=dict)  # the Python backend stubs once ready: pid -> instance

    def dead_stubs(self) -> dict[int, str]:
        """The stubs (pid -> model instance) that were running when the server became ready and are gone now.
        Triton 2.51 does not restart a stub that died: its model fails every request while the server says ready."""
        alive = python_stubs(self.process.pid)
        return {pid: name for pid, name in self.stubs.items() if pid not in alive}

    def stop_reason(self) -> str | None:
        """Why a model's watchdog stopped the server (serving.watchdog.stop_server), if one did."""
        try:
            return (self.workdir / STOP_REASON_FILE).read_text()
        except OSError:
            return None

    @property
    def client_host(self) -> str:
        """Address a client on this machine connects to."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def http_url(self) -> str:
        return f"{self.client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.client_host}:{self.metrics_port}/metrics"

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def endpoints_closed(self) -> bool:
        """Whether its HTTP port refuses connections: tritonserver closes its endpoints as a signal's stop begins, long
        before it has unloaded its models. A connection not taken within 2 s (a busy server whose backlog is full) or
        failing otherwise says nothing of a stop."""
        try:
            with socket.create_connection((self.client_host, self.http_port), timeout=2):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:
            return False

    def make_regions_private(self) -> None:
        """Mode 0600 for this server's Python-backend shared-memory regions: Triton 2.51 makes them 0644 whatever
        the umask, and they carry every request's prompt and output. Done as they appear, while the server
        starts and while `supervise` watches it; a process that opened a region before cannot be shut out
        (docs/reliability.md: give Triton a private /dev/shm on a shared host)."""
        for region in SHM_DIR.glob(f"{self.shm_prefix}*"):
            with contextlib.suppress(OSError):  # gone meanwhile, or not a file of ours
                fd = os.open(region, os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    st = os.fstat(fd)
                    if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != 0o600:
                        os.fchmod(fd, 0o600)
                finally:
                    os.close(fd)

    def wait_ready(self, timeout_s: float) -> None:
        """Poll readiness; raise RuntimeError (with the log's tail) if the server exits or times out."""
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            self.make_regions_private()
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with status {self.process.returncode} before "
                                   f"becoming ready{self._log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f} s{self._log_tail()}")
            time.sleep(0.1)
        self.make_regions_private()

    def _log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()[-n:]
        return f"; last log lines ({self.log_path}):\n" + "\n".join(lines)

    def crash_frames(self) -> list[str]:
        """The backtrace of a fatal signal in the server's log, its own frames named (`named_crash_frames`); empty
        without one, or when the server's output is not captured."""
        if self.log_path is None or not self.log_path.is_file():
            return []
        return named_crash_frames(self.log_path.read_text(errors="replace"), Path(self.process.args[0]))

    def stub_crashes(self) -> int:
        """How many Python backend stubs logged a crash (each model's stub enables faulthandler, which writes
        STUB_CRASH and the stub's Python stacks); 0 when the server's output is not captured."""
        if self.log_path is None or not self.log_path.is_file():
            return 0
        return self.log_path.read_text(errors="replace").count(STUB_CRASH)

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 30.0) -> int | None:
        """Forward `sig` (tritonserver shuts down gracefully on SIGINT/SIGTERM), wait, then kill the whole
        process group (the stubs and the engine's rank processes with them); return the exit status."""
        atexit.unregister(self.stop)
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # The group also holds the Python backend stubs, which can outlive a server that exited
        # (they ignore SIGTERM), and the stubs leave their shared-memory regions behind.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        for region in SHM_DIR.glob(f"{self.shm_prefix}*"):
            region.unlink(missing_ok=True)
        shutil.rmtree(server_dir(self.process.pid), ignore_errors=True)  # left behind by a model that did not finalize
        if self._log_handle is not None:
            self._log_handle.close()
        shutil.rmtree(self.workdir, ignore_errors=True)
        return self.process.returncode

    def __enter__(self) -> TritonServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def remove_stale_leftovers() -> list[Path]:
    """Remove what launchers and servers killed before their stop() left (LEFTOVERS): Python backend regions in
    /dev/shm (memory: a few MB per model instance), work directories (a copy of the backends) and limits
    directories."""
    return [p for directory, pattern in LEFTOVERS
            for p in remove_dead_pids_leftovers(directory or Path(tempfile.gettempdir()), pattern)]


def start_server(model_repo: str | Path, *, http_port: int = 0, grpc_port: int = 0, metrics_port: int = 0,
                 host: str = "127.0.0.1", log_file: str | Path | None = None, log_verbose: int = 0,
                 world_size: int | None = None, tritonserver: str | Path | None = None, ready_timeout_s: float = 300.0,
                 exit_timeout_s: int = 30, admin_api_key: str | None = None,
                 capture_output: bool = True, env: dict[str, str] | None = None) -> TritonServer:
    """Start tritonserver on `model_repo` and wait until it is ready; ports 0 pick free ones.

    Server output goes to `log_file`; without one, to a file in the private work directory when
    `capture_output` (removed at stop), else to this process's stdout/stderr. The server is
    stopped at interpreter exit and gets SIGTERM if this process dies (lifetime.spawn).
    """
    model_repo = Path(model_repo).resolve()
    if not model_repo.is_dir():
        raise FileNotFoundError(f"--model_repo {model_repo}: not a directory")
    if not any(model_repo.glob("*/config.pbtxt")):  # tritonserver serves none and says it is ready
        raise FileNotFoundError(f"--model_repo {model_repo}: no model in it (no <model>/config.pbtxt); make one with "
                                "make_model_repo" + (" from this engine" if (model_repo / "engine.json").is_file()
                                                     else ""))
    install = find_install(tritonserver)
    stale = remove_stale_leftovers()
    if stale:
        print(f"launch_triton_server: removed {len(stale)} leftovers of killed servers: "
              f"{', '.join(str(p) for p in stale[:3])}{' ...' if len(stale) > 3 else ''}", file=sys.stderr)
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"--world_size {world_size!r}: must be an integer >= 1")
    bind_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    chosen = iter(free_ports(3, bind_host))
    http_port, grpc_port, metrics_port = (p or next(chosen) for p in (http_port, grpc_port, metrics_port))

    workdir = Path(tempfile.mkdtemp(prefix=f"dsv3-triton-{PID_NAMESPACE}-{os.getpid()}-"))
    try:
        backends = prepare_backends(install, workdir)
        shm_prefix = f"dsv3_{PID_NAMESPACE}_{os.getpid()}_{next(_instance_counter)}_"
        cmd = build_command(install, backends, model_repo, host=host, http_port=http_port,
                            grpc_port=grpc_port, metrics_port=metrics_port,
                            log_verbose=log_verbose, exit_timeout_s=exit_timeout_s,
                            shm_prefix=shm_prefix, admin_api_key=admin_api_key)
        log_path = Path(log_file).resolve() if log_file else (workdir / "server.log" if capture_output else None)
        handle = open(log_path, "ab") if log_path else None
        # own session: Ctrl-C in a terminal reaches only us, and stop() can kill the whole group
        server_environ = server_env(install, env)
        if world_size is not None:
            server_environ[WORLD_SIZE_ENV] = str(world_size)
        server_environ[STOP_REASON_ENV] = str(workdir / STOP_REASON_FILE)
        proc = spawn(cmd, env=server_environ, stdin=subprocess.DEVNULL, stdout=handle,
                     stderr=subprocess.STDOUT if handle else None, start_new_session=True)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    server = TritonServer(proc, host, http_port, grpc_port, metrics_port, log_path, workdir, shm_prefix, handle)
    atexit.register(server.stop)  # a caller that dies of an exception still stops its server
    try:
        server.wait_ready(ready_timeout_s)
    except BaseException:
        server.stop(timeout_s=5)
        raise
    server.stubs = python_stubs(proc.pid)
    return server


STUB_CRASH = "Fatal Python error"  # faulthandler's first line
FATAL_SIGNAL = re.compile(r"^Signal \((?:4|6|7|8|11)\) received\.$", re.M)  # Triton's handler, then a backtrace
FRAME = re.compile(r"^ ?(\d+)# (?:0x([0-9A-Fa-f]+) in (\S+)|.*)$")


def named_crash_frames(log_text: str, tritonserver: Path) -> list[str]:
    """The backtrace tritonserver logs after its last fatal signal, its own frames named (`name+0xoffset`), the others
    as logged; empty without one. The wheel's tritonserver keeps its symbols, and frame 0 is its ErrorSignalHandler,
    which gives the load address."""
    signals = list(FATAL_SIGNAL.finditer(log_text))
    if not signals:
        return []
    frames = []
    for line in log_text[signals[-1].end():].splitlines()[1:]:
        m = FRAME.match(line)
        if not m:
            break
        frames.append((line.strip(), int(m.group(2), 16) if m.group(2) else None, m.group(3)))
    try:
        nm = subprocess.run(["nm", "-C", "--defined-only", str(tritonserver)], capture_output=True, text=True,
                            timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return [line for line, _, _ in frames]
    symbols = sorted((int(addr, 16), name) for addr, kind, name in
                     (row.split(" ", 2) for row in nm.splitlines() if row.count(" ") >= 2) if kind in "tTwW")
    handler = next((a for a, name in symbols if name.endswith("ErrorSignalHandler(int)")), None)
    if not frames or handler is None or frames[0][1] is None:
        return [line for line, _, _ in frames]
    base = (frames[0][1] - handler) // 4096 * 4096  # a PIE loads at a page boundary
    starts = [a for a, _ in symbols]
    named = []
    for line, address, path in frames:
        i = bisect.bisect_right(starts, address - base) - 1 if address is not None else -1
        if path and Path(path).name == tritonserver.name and i >= 0:
            named.append(f"{line.split('#')[0]}# {symbols[i][1]}+{address - base - starts[i]:#x}")
        else:
            named.append(line)
    return named


def python_stubs(root_pid: int) -> dict[int, str]:
    """The live Python backend stubs among `root_pid`'s descendants: pid -> model instance name
    (`<model>_<i>_<device>`, the stub's ninth argument)."""
    return {pid: argv[8].decode(errors="replace") for pid, argv in live_descendants(root_pid).items()
            if argv[0].endswith(STUB_BINARY.encode()) and len(argv) > 8}


class _Stop(Exception):
    """Raised from the signal handler so the main thread unwinds into server.stop()."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stop(signum)


def supervise(server: TritonServer) -> int:
    """Wait for tritonserver to exit; if a Python backend stub dies first (its model would fail every request
    while the server reports ready), stop the server so that a supervisor restarts it. Returns the exit status
    to report: the server's, or 1 for a dead stub or a server a model's watchdog stopped (it says why; a server still
    in its shutdown KILL_AFTER_S later is stopped here, since the watchdog that would kill it lives in a stub). A server
    asked to stop by a signal sent to it (not through this launcher) is waited for: its stubs exit as it unloads."""
    stopping_since: float | None = None  # when a model's watchdog stopped the server
    asked_to_stop = False
    while server.process.poll() is None:
        time.sleep(SUPERVISE_PERIOD_S)
        server.make_regions_private()
        if server.stop_reason() is not None:
            stopping_since = stopping_since or time.monotonic()
            if time.monotonic() - stopping_since > KILL_AFTER_S:
                break
            continue
        dead = server.dead_stubs()
        if dead:
            time.sleep(2 * SUPERVISE_PERIOD_S)  # stubs also exit when the server shuts down by itself
            if server.process.poll() is not None or server.stop_reason() is not None:
                continue  # its own shutdown, which may take as long as its models take to unload
            if server.endpoints_closed():  # a SIGTERM or SIGINT sent to it: it closed its endpoints and unloads
                if not asked_to_stop:
                    print("launch_triton_server: tritonserver is stopping (its endpoints closed, as on a SIGTERM or "
                          "SIGINT sent to it); waiting for it to unload its models", file=sys.stderr, flush=True)
                    asked_to_stop = True
                continue
            names = ", ".join(f"{name} (pid {pid})" for pid, name in sorted(dead.items()))
            print(f"launch_triton_server: the Python backend stub of {names} died; Triton does not restart it, so "
                  f"its model would fail every request: stopping tritonserver", file=sys.stderr, flush=True)
            server.stop(signal.SIGTERM)
            return 1
    status = server.process.returncode
    reason = server.stop_reason()
    if reason is not None:
        how = f"exit status {status}" if status is not None else f"still running {KILL_AFTER_S:g} s later: killed"
        print(f"launch_triton_server: a model's watchdog stopped tritonserver ({how}): {reason}",
              file=sys.stderr, flush=True)
        server.stop()
        return 1
    print(f"tritonserver exited with status {status}", file=sys.stderr)
    frames = server.crash_frames()
    if frames:
        print("tritonserver's backtrace, its own frames named:\n  " + "\n  ".join(frames), file=sys.stderr)
    server.stop()
    return status


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line before anything starts (None: nothing)."""
    ports = {"--http_port": args.http_port, "--grpc_port": args.grpc_port, "--metrics_port": args.metrics_port}
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if not 1 <= port <= 65535:
            return f"{flag} {port}: a port must be in 1..65535"
        if port in seen:
            return f"{flag} {port} is also the {seen[port]}; the three ports must differ"
        seen[port] = flag
    if not args.ready_timeout >= 0:  # also refuses NaN
        return f"--ready_timeout {args.ready_timeout}: must be >= 0 seconds"
    if args.exit_timeout < 0:
        return f"--exit_timeout {args.exit_timeout}: must be >= 0 seconds"
    if args.world_size is not None and args.world_size < 1:
        return f"--world_size {args.world_size}: must be an integer >= 1"
    if args.log_file is not None:
        if args.log_file.is_dir():
            return f"--log_file {args.log_file}: is a directory; give a file path"
        try:
            with open(args.log_file, "ab"):
                pass
        except OSError as e:
            return f"--log_file {args.log_file}: cannot write to it ({e.strerror})"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_repo", required=True, type=Path, help="filled model repository")
    parser.add_argument("--tritonserver", type=Path, help="tritonserver binary (default: the nvidia-pytriton wheel's)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--http_port", type=int, default=8000)
    parser.add_argument("--grpc_port", type=int, default=8001)
    parser.add_argument("--metrics_port", type=int, default=8002)
    parser.add_argument("--world_size", type=int,
                        help="processes to run the engine in: its --tp_size (one per rank, started by the engine "
                             "model; the default) or 1 (its ranks joined in one process)")
    parser.add_argument("--log_file", type=Path, help="write server output here instead of the terminal")
    parser.add_argument("--log_verbose", type=int, default=0, help="tritonserver --log-verbose level")
    parser.add_argument("--ready_timeout", type=float, default=600.0, help="seconds to wait for readiness")
    parser.add_argument("--exit_timeout", type=int, default=30,
                        help="seconds tritonserver may take to finish in-flight requests and unload the models when "
                             "stopping (Triton's default; the BLS's instances unload one after another, ~1 s each)")
    parser.add_argument("--admin_api_key", default=os.environ.get("DSV3_TRITON_ADMIN_KEY") or None,
                        help="serve the admin APIs (shared memory, model control, logging, trace) to requests with "
                             f"header '{ADMIN_HEADER}: <this value>' (default: $DSV3_TRITON_ADMIN_KEY, which keeps it "
                             "off this launcher's process list; tritonserver's own command line shows it to local "
                             "users); neither: off")
    args = show_defaults(parser).parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"launch_triton_server: {problem}", file=sys.stderr)
        return 2

    server = None
    status = 0
    with stop_signals_to(_raise_stop):
        try:
            t0 = time.monotonic()
            server = start_server(args.model_repo, http_port=args.http_port, grpc_port=args.grpc_port,
                                  metrics_port=args.metrics_port, host=args.host, log_file=args.log_file,
                                  log_verbose=args.log_verbose, world_size=args.world_size,
                                  tritonserver=args.tritonserver, ready_timeout_s=args.ready_timeout,
                                  exit_timeout_s=args.exit_timeout, admin_api_key=args.admin_api_key,
                                  capture_output=False)
            print(f"tritonserver ready in {time.monotonic() - t0:.1f} s: http {server.http_url}, "
                  f"grpc {server.grpc_url}, metrics {server.metrics_url} (pid {server.process.pid})", flush=True)
            status = supervise(server)
            server = None
        except _Stop as stop:
            if server is not None:
                server.stop(stop.signum)
                server = None
        except (FileNotFoundError, RuntimeError, TimeoutError, ValueError) as e:
            print(f"launch_triton_server: {e}", file=sys.stderr)
            status = 1
        finally:
            if server is not None:
                server.stop()
    return status


if __name__ == "__main__":
    sys.exit(main())
