"""The training commands (training.prepare_data, train_model, distill_mtp, export_model) as a careless user meets
them: existing outputs are kept unless --force, inputs are never replaced, bad input is one line naming the flag, and
an interrupted command leaves nothing behind."""

from __future__ import annotations

from typing import Callable

import pytest

import training.prepare_data as prepare


def error(capsys: pytest.CaptureFixture, main: Callable[[list[str]], object], *argv: object) -> tuple[int, str]:
    """(exit status, stderr) of a command that exits; stderr must be one line."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return e.value.code, err.strip()


@pytest.fixture
def tiny_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare_data's sources replaced by a few documents (the real ones take minutes to read)."""
    docs = [(f"doc/{i}", f"def f{i}(x):\n    return x + {i}  # the quick brown fox\n" * 20) for i in range(40)]
    monkeypatch.setattr(prepare, "load_stdlib", lambda: prepare.Source("python_stdlib", "PSF-2.0", docs))
    for name in ("load_usr_share_doc", "load_kjv", "load_site_packages"):
        monkeypatch.setattr(prepare, name, lambda: None)


def test_prepare_data_keeps_an_existing_out_dir(tmp_path, monkeypatch, capsys):
    """The default --out_dir (./data) or `--out_dir .` was renamed aside and deleted without asking: an existing
    output is refused without --force, and the current directory or one holding the inputs even with it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.txt").write_text("kept")
    assert error(capsys, prepare.main) == (
        2, "python -m training.prepare_data: error: data: output directory already exists; pass --force to replace it")
    assert error(capsys, prepare.main, "--out_dir", ".", "--force") == (
        2, f"python -m training.prepare_data: error: --out_dir . is or contains the current directory ({tmp_path}); "
           "replacing it would delete that; choose another directory")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["data", "mine.txt"]


def test_prepare_data_vocab_size_is_an_error(capsys):
    """An out-of-range --vocab_size was an AssertionError traceback (and skipped under python -O)."""
    assert error(capsys, prepare.main, "--vocab_size", "5") == (
        2, "python -m training.prepare_data: error: --vocab_size must be in 6..65536 (ids are stored as uint16 and 5 "
           "are special tokens), got 5")


def test_prepare_data_interrupted_leaves_nothing(tmp_path, tiny_sources, monkeypatch, capsys):
    """Ctrl-C or SIGTERM while writing left .data.tmp-<pid> beside the output: now the temporary is removed and the
    old output stays whole; a finished run with --force replaces it."""
    out = tmp_path / "data"
    out.mkdir()
    (out / "old.txt").write_text("kept")

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    make_prompts = prepare.make_prompts
    monkeypatch.setattr(prepare, "make_prompts", interrupted)
    with pytest.raises(SystemExit) as e:
        prepare.main(["--out_dir", str(out), "--force", "--vocab_size", "300", "--n_prompts", "2"])
    assert e.value.code == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m training.prepare_data: interrupted; no output directory was written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"] and (out / "old.txt").read_text() == "kept"

    monkeypatch.setattr(prepare, "make_prompts", make_prompts)
    prepare.main(["--out_dir", str(out), "--force", "--vocab_size", "300", "--n_prompts", "2"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    assert {"tokenizer.json", "train.bin", "val.bin", "meta.json"} <= {p.name for p in out.iterdir()}
    assert not (out / "old.txt").exists()
