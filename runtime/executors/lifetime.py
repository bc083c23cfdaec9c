"""Child processes that end with their parent: the engine process, tensor-parallel ranks' launcher, servers
started by tests and benchmarks. Kept free of torch so the light command-line tools can use it."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved at import: a forked child only calls it


def terminate_with_parent() -> None:
    """In a child (as a Popen preexec_fn): get SIGTERM when the thread that started it ends, i.e. when its
    parent dies, even by SIGKILL, so that nothing it started keeps running, holding memory or ports."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
