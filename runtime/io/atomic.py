"""Outputs that appear whole or not at all: written in a temporary sibling, renamed into place at the end.

Each temporary sibling has an owner that holds an exclusive lock on `<sibling>.lock` while it lives. A
build killed by SIGKILL cannot clean up, but the kernel drops its lock with it, so the next build of
the same output can prove which leftovers are stale (`remove_stale`) and remove them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
from pathlib import Path
from typing import Iterator

LOCK_SUFFIX = ".lock"
OLD_SUFFIX = ".old"  # an output renamed aside while its replacement is moved in
TMP_TAG = ".tmp-"  # `.<output name>.tmp-XXXX`: the temporary sibling an output is written in


class OutputDirError(ValueError):
    """An output directory a command may not write (it exists without --force, or holds the command's inputs); the
    message names it."""


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends (their handlers run in the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


# the lock files of this process's owned temporaries: their descriptors and the directories made for them
_owned: dict[str, tuple[int, list[Path]]] = {}


@contextlib.contextmanager
def owned_tempdir(parent: Path, prefix: str) -> Iterator[Path]:
    """A new directory `parent/<prefix>XXXX`, locked by this process until the block ends, then removed
    (unless the block renamed it away), with the directories above it that it made and the block left empty."""
    lock: str | None = None
    made: list[Path] = []  # deepest first
    try:  # everything inside: an interrupt (SIGTERM, Ctrl-C) anywhere still cleans up what exists
        with interrupts_held():  # between creating the lock file and recording it, an interrupt would leave it
            _make_dirs(parent, made)
            fd, lock = tempfile.mkstemp(prefix=prefix, suffix=LOCK_SUFFIX, dir=parent)
            _owned[lock] = fd, made
        fcntl.flock(fd, fcntl.LOCK_EX)
        tmp = Path(lock[: -len(LOCK_SUFFIX)])
        tmp.mkdir(0o755)
        yield tmp
    finally:
        if lock is not None:
            _release(lock)
        else:
            _remove_empty(made)


def _make_dirs(path: Path, made: list[Path]) -> None:
    """mkdir -p, recording in `made` (deepest first) each directory this call made, so that a failed command removes
    those and nothing the user had."""
    for d in reversed([path, *path.parents]):
        if d.is_dir():
            continue
        try:
            d.mkdir()
        except FileExistsError:
            if d.is_dir():  # made meanwhile by someone else: theirs
                continue
            raise  # a file in the way, named
        made.insert(0, d)


def _remove_empty(dirs: list[Path]) -> None:
    """Remove `dirs` (deepest first) while they are empty: one holding an output (or anything else) stays."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return


def release_owned() -> None:
    """Remove the temporaries an interrupt left behind: one that lands after a `with owned_tempdir(...)`'s entry has
    returned but before its block starts skips the exit that would remove them (rarely: a SIGTERM in a test's CI
    run). For a command's interrupt handler."""
    for lock in list(_owned):
        _release(lock)


def _release(lock: str) -> None:
    owned = _owned.pop(lock, None)
    if owned is None:
        return
    fd, made = owned
    shutil.rmtree(lock[: -len(LOCK_SUFFIX)], ignore_errors=True)  # gone already where the block renamed it away
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock)
    os.close(fd)
    _remove_empty(made)


@contextlib.contextmanager
def atomic_dir(out_dir: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of out_dir that becomes out_dir only if the block completes; on any
    exception (KeyboardInterrupt too) the sibling is removed and out_dir is untouched.

    An out_dir that exists at the end (made while the block ran, or replaced with force) is renamed
    aside first and removed only after the new one is in place, so an interruption never leaves a
    half-deleted output; without force it is an error and nothing is replaced.
    """
    out_dir = Path(out_dir)
    with owned_tempdir(out_dir.parent, f".{out_dir.name}{TMP_TAG}") as tmp:
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
    touched, and a leftover without a lock file (nothing proves it stale) is only reported.
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


def atomic_write(path: Path, data: bytes | str) -> None:
    """Replace `path` with `data` so that a reader (or a crash) sees the old file or the new one, never a partial
    one: a temporary file beside it, flushed to disk, then renamed; an existing file keeps its mode."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix, suffix = f".{path.name}.", ".tmp"
    tmp = ""
    try:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        os.replace(tmp, path)
    except BaseException as e:
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        named = [Path(f).name for f in (getattr(e, "filename", None), getattr(e, "filename2", None)) if f]
        if isinstance(e, OSError) and any(n.startswith(prefix) and n.endswith(suffix) for n in named):
            raise OSError(e.errno, e.strerror, str(path)) from e  # the temporary, gone, is no name for the user
        raise


def check_output_dir(out_dir: Path, force: bool) -> None:
    """OutputDirError unless out_dir is free or `force` lets it be replaced."""
    if (Path(out_dir).exists() or Path(out_dir).is_symlink()) and not force:  # a dangling link too
        raise OutputDirError(f"{out_dir}: output directory already exists; pass --force to replace it")


def check_not_replacing(out_dir: Path, flag: str, inputs: dict[str, Path | None]) -> None:
    """Refuse an output directory that is or contains one of the inputs (flag -> path; files too): replacing it
    would delete them."""
    out = Path(out_dir).resolve()
    for name, src in inputs.items():
        if src is not None and (out == Path(src).resolve() or out in Path(src).resolve().parents):
            raise OutputDirError(f"{flag} {out_dir} is or contains {name} ({src}); replacing it would delete that; "
                                 "choose another directory")


@contextlib.contextmanager
def new_output_dir(out_dir: Path, force: bool) -> Iterator[Path]:
    """A command's output directory, made atomically (`atomic_dir`) once out_dir is known to be free or forced."""
    check_output_dir(out_dir, force)
    try:
        with atomic_dir(out_dir, force) as tmp:
            yield tmp
    except FileExistsError as e:
        raise OutputDirError(str(e)) from None


def os_error_text(e: OSError, out_dir: Path | None = None) -> str:
    """The file system's own refusal (no space, no permission, a file in the way) as one line naming the file (both,
    for a rename). With the `out_dir` being written, names the user gave: a file of its temporary sibling is named
    inside out_dir and one of its other temporaries (a lock, an intermediate checkpoint) as out_dir, which a write
    that names no file (a full disk) names too. shutil.copytree's error, which keeps only its copies' messages, is
    named by its first failed copy."""
    what = e.strerror or next((a for a in e.args if isinstance(a, str)), type(e).__name__)
    files = [str(f) for f in (e.filename, e.filename2) if f is not None]
    if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list) and e.args[0]:
        _, dst, why = e.args[0][0]  # (source, destination, str(the OSError)) for each file it could not copy
        code = re.match(r"\[Errno (\d+)\] ", why)
        what, files = os.strerror(int(code.group(1))) if code else why, [dst]
    if out_dir is not None:
        files = list(dict.fromkeys(_as_output(f, Path(out_dir)) for f in files)) or [str(out_dir)]
    where = " -> ".join(files)
    return f"{where}: {what}" if where else what


def _as_output(file: str, out_dir: Path) -> str:
    """`file` as the user knows it: inside out_dir where it lies in out_dir's temporary sibling, out_dir where it is
    another of its temporaries (`.<name>.<kind>-XXXX`, as `remove_stale` finds them), else as it is."""
    path, out = Path(os.path.abspath(file)), Path(os.path.abspath(out_dir))
    for temporary in (path, *path.parents):
        if temporary.parent == out.parent and temporary.name.startswith(f".{out.name}."):
            if temporary.name.startswith(f".{out.name}{TMP_TAG}") and not temporary.name.endswith(
                    (LOCK_SUFFIX, OLD_SUFFIX)):
                return str(out_dir / path.relative_to(temporary))
            return str(out_dir)
    return file
