"""Liveness that reflects whether requests are being served.

A server whose health endpoint answers while its step loop or its response sender is stuck is the worst
kind of failure: load balancers keep sending it traffic that never completes. The watchdog polls probes
(each returns None while healthy, else why not) and, the first time one fails, calls `on_failure` with
the reason once: the servers log it with every thread's stack and take themselves down, so readiness
fails and a supervisor can restart them.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from runtime.executors.lifetime import running
from runtime.io.atomic import atomic_write

log = logging.getLogger(__name__)

# how long a step loop (or a response sender) with work may go without progress before it counts as stalled, by
# default: no step of a deployment here comes near it, and a wedged loop waits for ever
STALL_TIMEOUT_S = 120.0

# how long a server stopped by its watchdog gets to exit on SIGTERM before it is killed
KILL_AFTER_S = 60.0

# a file (launch_triton_server's, for its tritonserver) where stop_server writes why it stopped the server: the
# launcher names that reason, not the other models' stubs that exit as the server unloads
STOP_REASON_ENV = "DSV3_STOP_REASON_FILE"

Probe = Callable[[], "str | None"]


class Progress:
    """A loop's heartbeat: it calls `beat()` whenever it completes an item or finds nothing to do, so a long
    `stalled_for()` while it has work means it is stuck."""

    def __init__(self) -> None:
        self._last = time.monotonic()

    def beat(self) -> None:
        self._last = time.monotonic()

    def stalled_for(self) -> float:
        return time.monotonic() - self._last


class Watchdog:
    def __init__(self, probes: dict[str, Probe], on_failure: Callable[[str], None], period_s: float = 1.0):
        self.probes, self.on_failure, self.period_s = probes, on_failure, period_s
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for name, probe in self.probes.items():
                try:
                    reason = probe()
                except Exception as e:  # a probe that cannot tell is a failure, not the end of the watching
                    reason = f"its check raised {type(e).__name__}: {e}"
                if reason is not None:
                    self.failure = f"{name}: {reason}"
                    log.error("watchdog: %s; every thread's stack follows", self.failure)
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                    self.on_failure(self.failure)
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def stop_server(pid: int, reason: str, kill_after_s: float = KILL_AFTER_S) -> None:
    """Take a server that no longer serves down: SIGTERM, then SIGKILL if it is still running `kill_after_s` later.
    A server wedged in its own shutdown ignores SIGTERM and keeps answering health checks (seen: tritonserver
    deadlocked in its abort handler after a heap corruption). Said on stderr, not through the server's logger,
    which may be what is stuck."""
    print(f"watchdog: {reason}; stopping the server (pid {pid})", file=sys.stderr, flush=True)
    if os.environ.get(STOP_REASON_ENV):
        with contextlib.suppress(OSError):
            atomic_write(Path(os.environ[STOP_REASON_ENV]), reason)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + kill_after_s
    while time.monotonic() < deadline:
        if not running(pid):
            return
        time.sleep(0.2)
    print(f"watchdog: pid {pid} still running {kill_after_s:.0f} s after SIGTERM; killing it", file=sys.stderr,
          flush=True)
    os.kill(pid, signal.SIGKILL)
