"""Directories that appear whole or not at all: build in a temporary sibling, rename at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_dir(out_dir: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of out_dir that becomes out_dir only if the block completes; on any
    exception (KeyboardInterrupt too) the sibling is removed and out_dir is untouched.

    An out_dir that exists at the end (made while the block ran, or replaced with force) is renamed
    aside first and removed only after the new one is in place, so an interruption never leaves a
    half-deleted output; without force it is an error and nothing is replaced.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        yield tmp
        old = None
        if out_dir.exists() or out_dir.is_symlink():
            if not force:
                raise FileExistsError(f"{out_dir}: appeared while the output was being written; not replaced "
                                      "(--force replaces it)")
            old = tmp.with_name(tmp.name + ".old")
            os.rename(out_dir, old)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
