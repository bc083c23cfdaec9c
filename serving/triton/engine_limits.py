"""The limits of the executor serving a `tensorrt_llm` model, published by that model once it is loaded and read by
the `tensorrt_llm_bls` of the same tritonserver, which checks a request against them before calling it.

They are known only once the executor has loaded its engine (in the tensorrt_llm stub's process), and the BLS runs
in a stub of its own: the two share a small JSON file in a directory private to the server's user, named by the
server's pid (each Python stub's parent), so two servers on one host never read each other's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from runtime.executors.lifetime import PID_NAMESPACE
from runtime.io.atomic import atomic_write


@dataclass(frozen=True)
class EngineLimits:
    """What the executor serving `tensorrt_llm` accepts, as far as a request's checks depend on it."""

    vocab_size: int
    max_seq_len: int
    max_batch_size: int
    kv_block_size: int = 0  # tokens per KV block (0: the executor does not say)
    kv_blocks: int = 0  # blocks in its KV cache
    # the most drafts a request's num_draft_tokens may ask for (None: the executor checks it by a rule of its own)
    request_draft_len: int | None = None


SERVER_DIR_PREFIX = f"tritonserver-{os.getuid()}-{PID_NAMESPACE}-"  # then the tritonserver's pid


def server_dir(server_pid: int) -> Path:
    """Where the models of the tritonserver with this pid publish their limits (its launcher removes it)."""
    return Path(tempfile.gettempdir()) / f"{SERVER_DIR_PREFIX}{server_pid}"


def limits_dir(create: bool = False) -> Path:
    """This server's directory (created 0700 when `create`); OSError when it does not exist, or is not this user's
    private directory (another user could otherwise plant limits a request is checked against)."""
    directory = server_dir(os.getppid())  # a Python stub's parent is its tritonserver
    if create:
        directory.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{directory} is not a directory private to uid {os.getuid()}")
    return directory


def publish(model_name: str, limits: EngineLimits) -> Path:
    """Write the limits of `model_name` for the BLS (atomically: a reader sees the old file or the new one)."""
    path = limits_dir(create=True) / f"{model_name}.json"
    atomic_write(path, json.dumps(dataclasses.asdict(limits)))
    return path


def withdraw(model_name: str) -> None:
    """Remove what `publish` wrote (the model is unloading), and the directory once it is empty."""
    try:
        directory = limits_dir()
    except OSError:  # nothing published here
        return
    (directory / f"{model_name}.json").unlink(missing_ok=True)
    try:
        directory.rmdir()
    except OSError:  # another model's limits are still there
        pass


class PublishedLimits:
    """The limits `model_name` published, re-read when its file changes (the model was reloaded); None while there
    are none (the model is not loaded yet, or is served elsewhere)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._seen: tuple[int, int] | None = None
        self._limits: EngineLimits | None = None

    def get(self) -> EngineLimits | None:
        try:
            path = limits_dir() / f"{self.model_name}.json"
            st = path.stat()
        except OSError:
            self._seen, self._limits = None, None
            return None
        if (st.st_ino, st.st_mtime_ns) != self._seen:
            self._limits = EngineLimits(**json.loads(path.read_text()))
            self._seen = (st.st_ino, st.st_mtime_ns)
        return self._limits
