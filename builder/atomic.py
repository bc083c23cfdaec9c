"""Directories that appear whole or not at all: build in a temporary sibling, rename at the end."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a temporary sibling of out_dir that replaces out_dir only if the block completes;
    on any exception (KeyboardInterrupt too) the sibling is removed and out_dir is untouched."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        yield tmp
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
