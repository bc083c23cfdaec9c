"""The engine's limits as tensorrt_llm publishes them for the BLS: read back as written, re-read when the model is
reloaded, gone once it unloads, and never read from (or written to) a directory another user could have made."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from serving.triton.engine_limits import EngineLimits, PublishedLimits, publish, server_dir, withdraw


@pytest.fixture(autouse=True)
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_published_limits_are_read_until_withdrawn() -> None:
    published = PublishedLimits("tensorrt_llm")
    assert published.get() is None  # not loaded yet
    publish("tensorrt_llm", EngineLimits(vocab_size=512, max_seq_len=1024, max_batch_size=8))
    assert published.get() == EngineLimits(512, 1024, 8)
    publish("tensorrt_llm", EngineLimits(vocab_size=512, max_seq_len=256, max_batch_size=8))  # reloaded
    assert published.get() == EngineLimits(512, 256, 8)
    assert PublishedLimits("other").get() is None
    withdraw("tensorrt_llm")
    assert published.get() is None
    assert not any(Path(tempfile.gettempdir()).iterdir())  # the directory too, once empty


def test_a_directory_others_can_write_is_refused(private_tmp: Path) -> None:
    directory = server_dir(os.getppid())
    directory.mkdir(mode=0o777)
    directory.chmod(0o777)
    with pytest.raises(OSError, match=f"is not a directory private to uid {os.getuid()}"):
        publish("tensorrt_llm", EngineLimits(512, 1024, 8))
    assert PublishedLimits("tensorrt_llm").get() is None
    withdraw("tensorrt_llm")  # nothing of ours there: left alone
    assert directory.is_dir()


def test_a_symlink_in_place_of_the_directory_is_refused(private_tmp: Path) -> None:
    (private_tmp / "elsewhere").mkdir(mode=0o700)
    server_dir(os.getppid()).symlink_to(private_tmp / "elsewhere")
    with pytest.raises(OSError, match="is not a directory private to uid"):
        publish("tensorrt_llm", EngineLimits(512, 1024, 8))
