"""Child processes of ours: the interpreter they run on, and their ending with their parent (the engine
process, tensor-parallel ranks, servers started by tests and benchmarks). Kept free of torch so the light
command-line tools can use it."""

from __future__ import annotations

import ctypes
import shutil
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1
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


def terminate_with_parent() -> None:
    """In a child (as a Popen preexec_fn): get SIGTERM when the thread that started it ends, i.e. when its
    parent dies, even by SIGKILL, so that nothing it started keeps running, holding memory or ports."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
