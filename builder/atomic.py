"""Directories that appear whole or not at all: build in a temporary sibling, rename at the end.

Each temporary sibling has an owner that holds an exclusive lock on `<sibling>.lock` while it lives. A
build killed by SIGKILL cannot clean up, but the kernel drops its lock with it, so the next build of
the same output can prove which leftovers are stale (`remove_stale`) and remove them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

LOCK_SUFFIX = ".lock"
OLD_SUFFIX = ".old"  # an output renamed aside while its replacement is moved in


@contextlib.contextmanager
def owned_tempdir(parent: Path, prefix: str) -> Iterator[Path]:
    """A new directory `parent/<prefix>XXXX`, locked by this process until the block ends, then removed
    (unless the block renamed it away)."""
    parent.mkdir(parents=True, exist_ok=True)
    fd, lock = tempfile.mkstemp(prefix=prefix, suffix=LOCK_SUFFIX, dir=parent)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        tmp = Path(lock[: -len(LOCK_SUFFIX)])
        tmp.mkdir(0o755)
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        os.unlink(lock)
        os.close(fd)


@contextlib.contextmanager
def atomic_dir(out_dir: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of out_dir that becomes out_dir only if the block completes; on any
    exception (KeyboardInterrupt too) the sibling is removed and out_dir is untouched.

    An out_dir that exists at the end (made while the block ran, or replaced with force) is renamed
    aside first and removed only after the new one is in place, so an interruption never leaves a
    half-deleted output; without force it is an error and nothing is replaced.
    """
    out_dir = Path(out_dir)
    with owned_tempdir(out_dir.parent, f".{out_dir.name}.tmp-") as tmp:
        yield tmp
        old = None
        if out_dir.exists() or out_dir.is_symlink():
            if not force:
                raise FileExistsError(f"{out_dir}: appeared while the output was being written; not replaced "
                                      "(--force replaces it)")
            old = tmp.with_name(tmp.name + OLD_SUFFIX)
            os.rename(out_dir, old)
        try:
            tmp.rename(out_dir)
        except BaseException:
            if old is not None:
                os.rename(old, out_dir)
            raise
        if old is not None:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink()


def remove_stale(out_dir: Path) -> list[str]:
    """Clear what killed builds of out_dir left beside it; one line for each leftover, saying what was done.

    A leftover whose lock nobody holds is stale: it is removed, except an output renamed aside while the
    build was killed and not yet replaced, which is put back. Leftovers of a build in progress are not
    touched, and a leftover without a lock file (from an older version) is only reported.
    """
    out_dir = Path(out_dir)
    notes = []
    for lock in sorted(out_dir.parent.glob(f".{out_dir.name}.*-*{LOCK_SUFFIX}")):
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:  # its build just finished
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live build holds it
            os.close(fd)
            continue
        try:
            tmp = lock.with_name(lock.name[: -len(LOCK_SUFFIX)])
            old = tmp.with_name(tmp.name + OLD_SUFFIX)
            if old.exists() and not (out_dir.exists() or out_dir.is_symlink()):
                os.rename(old, out_dir)
                notes.append(f"{out_dir} was renamed aside to {old.name} by a killed build; restored it")
            for leftover in (tmp, old):
                if leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover)
                    notes.append(f"removed {leftover}, left by a killed build")
            lock.unlink()
        finally:
            os.close(fd)
    locked = {p.name[: -len(LOCK_SUFFIX)] for p in out_dir.parent.glob(f".{out_dir.name}.*-*{LOCK_SUFFIX}")}
    for leftover in sorted(out_dir.parent.glob(f".{out_dir.name}.*-*")):
        if leftover.name.removesuffix(OLD_SUFFIX) not in locked and not leftover.name.endswith(LOCK_SUFFIX):
            notes.append(f"{leftover} was left by an interrupted build without a lock to prove it stale; delete it "
                         "to free its space")
    return notes
