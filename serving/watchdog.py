"""Liveness that reflects whether requests are being served.

A server whose health endpoint answers while its step loop or its response sender is stuck is the worst
kind of failure: load balancers keep sending it traffic that never completes. The watchdog polls probes
(each returns None while healthy, else why not) and, the first time one fails, calls `on_failure` with
the reason once: the servers log it with every thread's stack and take themselves down, so readiness
fails and a supervisor can restart them.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

# how long a step loop (or a response sender) with work may go without progress before it counts as stalled, by
# default: no step of a deployment here comes near it, and a wedged loop waits for ever
STALL_TIMEOUT_S = 120.0

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
                reason = probe()
                if reason is not None:
                    self.failure = f"{name}: {reason}"
                    log.error("watchdog: %s; every thread's stack follows", self.failure)
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                    self.on_failure(self.failure)
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
