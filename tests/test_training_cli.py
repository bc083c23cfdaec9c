"""The training commands (training.prepare_data, train_model, distill_mtp, export_model) as a careless user meets
them: existing outputs are kept unless --force, inputs are never replaced, bad input is one line naming the flag, and
an interrupted command leaves nothing behind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

import training.distill_mtp as distill
import training.export_model as export
import training.prepare_data as prepare
import training.train_model as train_model
from runtime.model.config import ModelConfig
from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM

ROOT = Path(__file__).resolve().parents[1]


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


def test_a_full_disk_names_the_out_dir(tmp_path, tiny_sources, monkeypatch, capsys):
    """A write that fails for want of space names no file, and prepare_data and export_model then named nothing: the
    message names --out_dir."""
    import errno
    import os

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(prepare, "make_prompts", full_disk)
    out = tmp_path / "data"
    with pytest.raises(SystemExit) as e:
        prepare.main(["--out_dir", str(out), "--vocab_size", "300", "--n_prompts", "2"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (  # after the progress bars
        f"python -m training.prepare_data: error: {out}: No space left on device; no output directory was written")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A tiny model's training checkpoint (run/ckpt.pt, the keys training.train_model saves) and a token corpus."""
    cfg = json.loads((ROOT / "models" / "deepseek-v3-mini" / "config.json").read_text())
    cfg.pop("quantization_config")
    cfg.update(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
               q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    np.random.default_rng(0).integers(2, 64, size=2000).astype(np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "val.bin").write_bytes((tmp_path / "train.bin").read_bytes())
    config = ModelConfig.from_dict(cfg)
    model = DeepseekV3ForCausalLM(config)
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters())
    (tmp_path / "run").mkdir()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": 3, "rng": {}, "elapsed_s": 1.0,
                "config": config.to_dict(), "args": {}}, tmp_path / "run" / "ckpt.pt")
    return tmp_path / "run"


def distill_args(run: Path, out: Path, *extra: object) -> list[str]:
    return [str(a) for a in ("--ckpt", run / "ckpt.pt", "--out", out, "--data_dir", run.parent, "--batch_size", 1,
                             "--seq_len", 16, "--eval_batches", 1, "--eval_depth", 2, "--threads", 1, *extra)]


def test_distill_refuses_an_out_it_cannot_or_must_not_write(run, capsys):
    """--out equal to --ckpt overwrote the training checkpoint (train_model --resume then failed with KeyError
    'opt'); an --out that is a directory, or below a file, failed only after the whole time budget."""
    before = (run / "ckpt.pt").read_bytes()
    (run / "notes").write_text("a file")
    prog = "python -m training.distill_mtp: error:"
    for out, message in (
            (run / "ckpt.pt", f"--out {run / 'ckpt.pt'} is --ckpt; writing it would replace the training checkpoint "
                              "(train_model --resume needs it); choose another path"),
            (run, f"--out {run}: is a directory, expected a file path"),
            (run / "notes" / "ckpt.pt", f"--out {run / 'notes' / 'ckpt.pt'}: {run / 'notes'} is not a directory")):
        assert error(capsys, distill.main, *distill_args(run, out, "--time_budget_min", 30)) == (2, f"{prog} {message}")
    assert error(capsys, distill.main, *distill_args(run, run.parent / "d.pt", "--seq_len", 0)) == (
        2, f"{prog} --seq_len must be >= 1, got 0")
    # a window longer than the corpus was numpy's "high <= 0" traceback (train_model checked it, distill did not)
    assert error(capsys, distill.main, *distill_args(run, run.parent / "d.pt", "--seq_len", 5000)) == (
        2, f"{prog} --data_dir {run.parent}: train.bin holds 2000 tokens; a window of --seq_len 5000 needs more")
    # numpy maps neither an empty file nor half a token: tracebacks
    odd = run.parent / "odd"
    odd.mkdir()
    for size, message in ((0, "holds 0 tokens; a window of --seq_len 16 needs more"),
                          (3, "is 3 bytes, not whole 2-byte tokens")):
        (odd / "train.bin").write_bytes(b"\0" * size)
        (odd / "val.bin").write_bytes((run.parent / "val.bin").read_bytes())
        assert error(capsys, distill.main, *distill_args(run, run.parent / "d.pt"), "--data_dir", odd) == (
            2, f"{prog} --data_dir {odd}: train.bin {message}")
    assert (run / "ckpt.pt").read_bytes() == before
    assert sorted(p.name for p in run.iterdir()) == ["ckpt.pt", "notes"]


def test_distill_interrupted_writes_what_it_has(run, monkeypatch, capsys):
    """Ctrl-C (or SIGTERM) during distillation was a traceback and nothing written: it stops and writes the
    checkpoint it has, whole (through atomic_write: nothing else is left beside it)."""
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", interrupted)
    out = run.parent / "distilled" / "ckpt.pt"
    distill.main(distill_args(run, out, "--time_budget_min", 30))
    assert "interrupted at step 0" in capsys.readouterr().out
    assert sorted(p.name for p in out.parent.iterdir()) == ["ckpt.pt"]
    state = torch.load(out, weights_only=True)
    assert state["step"] == 3 and state["distill"]["steps"] == 0


def test_train_model_keeps_a_run_it_was_not_told_to_replace(run, capsys):
    """A rerun without --resume overwrote the run's checkpoint (and appended to its log); --resume without a
    checkpoint quietly started over; a missing --data_dir, a bad --config or --batch_size 0 failed only after
    config.json was written into a new --out_dir. Each is now one line before anything is written."""
    (run / "log.jsonl").write_text("{}\n")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    data, prog = run.parent, "python -m training.train_model: error:"
    (data / "bad.json").write_text("{not json")
    fresh = data / "fresh"
    for argv, message in (
            (("--out_dir", run), f"--out_dir {run} holds a checkpoint ({run / 'ckpt.pt'}); pass --resume to continue "
                                 "it or --force to start over"),
            (("--out_dir", fresh, "--resume"), f"--resume: no checkpoint to continue at {fresh / 'ckpt.pt'}"),
            (("--out_dir", fresh, "--data_dir", data / "nowhere"),
             f"--data_dir {data / 'nowhere'}: no train.bin (training.prepare_data writes train.bin and val.bin)"),
            (("--out_dir", fresh, "--batch_size", 0), "--batch_size must be >= 1, got 0"),
            (("--out_dir", fresh, "--seq_len", 5000),
             f"--data_dir {data}: train.bin holds 2000 tokens; a window of --seq_len 5000 + 2 needs more"),
            (("--out_dir", fresh, "--config", data / "bad.json"), f"--config {data / 'bad.json'}: not valid JSON (")):
        status, err = error(capsys, train_model.main, "--data_dir", data, "--config", data / "config.json", *argv)
        assert status == 2 and err.startswith(f"{prog} {message}"), err
    assert not fresh.exists()
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


@pytest.mark.parametrize("flags, message", [
    (("--lr", "nan"), "--lr must be a finite number > 0, got nan"),
    (("--lr", "-1"), "--lr must be a finite number > 0, got -1.0"),
    (("--min_lr_ratio", "-5"), "--min_lr_ratio must be a finite number >= 0 and <= 1, got -5.0"),
    (("--mtp_weight", "nan"), "--mtp_weight must be a finite number >= 0, got nan"),
    (("--weight_decay", "inf"), "--weight_decay must be a finite number >= 0, got inf"),
    (("--threads", "-3"), "--threads must be >= 0 (0: torch's default), got -3"),
    (("--device", "bogus"), "--device 'bogus' is not a torch device (cpu, cuda or cuda:N)"),
    (("--device", "meta"), "--device meta: training runs on cpu or cuda"),
])
def test_train_model_refuses_numbers_that_train_nothing_sensible(run, capsys, flags, message):
    """NaN weights trained to a checkpoint of NaN tensors (exit 0), a negative --min_lr_ratio ascended the loss late
    in the schedule, and --lr nan, --threads -3, --device bogus were tracebacks after config.json was written."""
    out = run.parent / "fresh"
    assert error(capsys, train_model.main, "--data_dir", run.parent, "--out_dir", out, "--config",
                 run.parent / "config.json", "--steps", 2, "--seq_len", 16, "--batch_size", 1, *flags) == (
        2, f"python -m training.train_model: error: {message}")
    assert not out.exists()


def test_token_ids_past_the_vocabulary_are_refused_before_anything_is_written(run, capsys):
    """A corpus of ids up to 4095 and a --config of vocab_size 64 was an IndexError traceback from the embedding
    after config.json and log.jsonl were written; distill_mtp likewise against its checkpoint's vocabulary."""
    data = run.parent / "big"
    data.mkdir()
    np.arange(4096, dtype=np.uint16).tofile(data / "train.bin")
    np.arange(100, dtype=np.uint16).tofile(data / "val.bin")
    out = run.parent / "fresh"
    assert error(capsys, train_model.main, "--data_dir", data, "--out_dir", out, "--config", run.parent / "config.json",
                 "--seq_len", 16) == (
        2, f"python -m training.train_model: error: --data_dir {data}: train.bin holds token id 4095, outside the "
           f"vocabulary of --config {run.parent / 'config.json'} (vocab_size 64)")
    assert not out.exists()
    argv = distill_args(run, run.parent / "d.pt")
    argv[argv.index("--data_dir") + 1] = str(data)
    assert error(capsys, distill.main, *argv) == (
        2, f"python -m training.distill_mtp: error: --data_dir {data}: train.bin holds token id 4095, outside the "
           f"vocabulary of --ckpt {run / 'ckpt.pt'} (vocab_size 64)")


def test_train_model_resume_names_what_is_not_its_checkpoint(run, capsys):
    """distill_mtp's output has no optimizer state: --resume from it was a KeyError traceback."""
    state = torch.load(run / "ckpt.pt", weights_only=True)
    del state["opt"]
    torch.save(state, run / "ckpt.pt")
    assert error(capsys, train_model.main, "--data_dir", run.parent, "--out_dir", run, "--resume") == (
        2, f"python -m training.train_model: error: --resume {run / 'ckpt.pt'}: not a checkpoint of "
           "training.train_model (no opt)")
    state["opt"], state["config"]["hidden_size"] = {}, 0  # the config it resumes is read as --config is
    torch.save(state, run / "ckpt.pt")
    assert error(capsys, train_model.main, "--data_dir", run.parent, "--out_dir", run, "--resume") == (
        2, f"python -m training.train_model: error: --resume {run / 'ckpt.pt'}: its config: field 'hidden_size' must "
           "be an integer >= 1, got 0")


def test_train_model_resume_takes_the_checkpoints_config(run, capsys):
    """--resume trained on with --config's model whatever the checkpoint's was: another rope_theta was taken (and
    config.json replaced), another size was a load_state_dict traceback, and so was leaving --config out for a
    checkpoint not of the built-in mini config. A --config that differs is refused naming the fields; without one the
    checkpoint's config is resumed."""
    data, run = run.parent, run.parent / "tiny"
    cfg = json.loads((data / "config.json").read_text())
    (data / "other.json").write_text(json.dumps(cfg | {"rope_theta": 5000.0, "hidden_size": 64}))
    argv = ("--data_dir", data, "--out_dir", run, "--batch_size", 1, "--seq_len", 16, "--eval_batches", 1,
            "--threads", 1)
    train_model.main([str(a) for a in (*argv, "--config", data / "config.json", "--steps", 2)])
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    argv = (*argv, "--resume", "--steps", 4)
    capsys.readouterr()
    assert error(capsys, train_model.main, *argv, "--config", data / "other.json") == (
        2, f"python -m training.train_model: error: --config {data / 'other.json'} differs from the config of --resume "
           f"{run / 'ckpt.pt'} in hidden_size (64, the checkpoint's 32), rope_theta (5000.0, the checkpoint's 10000.0); "
           "leave --config out to continue with the checkpoint's")
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    train_model.main([str(a) for a in argv])
    state = torch.load(run / "ckpt.pt", weights_only=True)
    assert state["step"] == 4 and state["config"] == ModelConfig.from_dict(cfg).to_dict()


def test_train_model_on_a_full_disk_is_one_line(run, monkeypatch, capsys):
    """A checkpoint that could not be written (no space) ended training in a traceback: one line naming --out_dir,
    exit 2, the last checkpoint written whole left as it was."""
    import errno
    import os

    data = run.parent
    argv = [str(a) for a in ("--data_dir", data, "--config", data / "config.json", "--batch_size", 1, "--seq_len", 16,
                             "--eval_every", 2, "--eval_batches", 1, "--threads", 1, "--out_dir", data / "full")]
    train_model.main([*argv, "--steps", "2"])
    saved = (data / "full" / "ckpt.pt").read_bytes()

    def full_disk(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(train_model, "save", full_disk)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train_model.main([*argv, "--steps", "4", "--resume"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (  # after the progress bar
        f"python -m training.train_model: error: {data / 'full'}: No space left on device; "
        f"{data / 'full' / 'ckpt.pt'} keeps the last checkpoint written whole")
    assert (data / "full" / "ckpt.pt").read_bytes() == saved


def test_train_model_names_the_out_dir_it_cannot_write(run, monkeypatch, capsys):
    """An --out_dir that cannot be made was a traceback (exit 1), and a file that cannot be written in it was named by
    atomic_write's temporary (deleted since): one line naming what the user gave, exit 2."""
    import errno
    import os
    import tempfile

    data = run.parent
    (data / "afile").write_text("")
    argv = ["--data_dir", data, "--config", data / "config.json", "--steps", 2, "--batch_size", 1, "--seq_len", 16]
    out = data / "afile" / "run"
    assert error(capsys, train_model.main, *argv, "--out_dir", out) == (
        2, f"python -m training.train_model: error: {out}: Not a directory; {out / 'ckpt.pt'} was not written")

    def read_only(prefix: str = "", suffix: str = "", dir: str = "") -> tuple[int, str]:  # as a read-only mount
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.join(dir, f"{prefix}k2x9{suffix}"))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    out = data / "fresh"
    assert error(capsys, train_model.main, *argv, "--out_dir", out) == (
        2, f"python -m training.train_model: error: {out / 'config.json'}: Read-only file system; {out / 'ckpt.pt'} "
           "was not written")


@pytest.mark.parametrize("where", ["forward", "optimizer step"])
def test_train_model_sigterm_saves_the_steps_done(run, monkeypatch, capsys, where):
    """SIGTERM (a scheduler's time limit, docker stop) killed the run and lost every step since the last checkpoint
    (Ctrl-C: a traceback, the same loss): it saves the steps done, says so in one line, exits 130, and --resume
    continues to the weights of a run never interrupted, whether the signal came in a step's forward or while the
    optimizer moved the weights (a step is applied whole). A second SIGTERM while it saves waits for the checkpoint
    and changes nothing (it reached the top level as an interrupt 'before the first step')."""
    import signal

    data = run.parent
    argv = ["--data_dir", data, "--config", data / "config.json", "--steps", 6, "--batch_size", 1, "--seq_len", 16,
            "--eval_every", 100, "--eval_batches", 1, "--threads", 1]
    train_model.main([str(a) for a in ["--out_dir", data / "whole", *argv]])
    calls = []
    losses, optimizer_step, save = train_model.losses, torch.optim.AdamW.step, train_model.save

    def forward(*args: object) -> object:
        calls.append(args)
        if len(calls) == 4 and where == "forward":  # its window drawn, the weights not yet updated
            signal.raise_signal(signal.SIGTERM)
        return losses(*args)

    def step(*args: object, **kwargs: object) -> object:
        out = optimizer_step(*args, **kwargs)
        if len(calls) == 4 and where == "optimizer step":  # the weights moved, the step not yet counted
            signal.raise_signal(signal.SIGTERM)
        return out

    def saved_under_a_second_sigterm(*args: object) -> None:
        signal.raise_signal(signal.SIGTERM)
        save(*args)

    def unhandled(signum: int, frame: object) -> None:  # what the process would do: die (here, fail the test)
        raise AssertionError("SIGTERM was not handled")

    handler = signal.signal(signal.SIGTERM, unhandled)
    try:
        with monkeypatch.context() as m:
            m.setattr(train_model, "losses", forward)
            m.setattr(torch.optim.AdamW, "step", step)
            m.setattr(train_model, "save", saved_under_a_second_sigterm)
            with pytest.raises(SystemExit) as e:
                train_model.main([str(a) for a in ["--out_dir", data / "cut", *argv]])
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert e.value.code == 130
    done = 3 if where == "forward" else 4
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m training.train_model: interrupted at step {done}; saved it to {data / 'cut' / 'ckpt.pt'} "
        "(--resume continues it)")
    assert torch.load(data / "cut" / "ckpt.pt", weights_only=True)["step"] == done
    train_model.main([str(a) for a in ["--out_dir", data / "cut", "--resume", *argv]])
    whole, cut = (torch.load(data / d / "ckpt.pt", weights_only=True) for d in ("whole", "cut"))
    assert cut["step"] == whole["step"] == 6
    assert all(torch.equal(cut["model"][k], v) for k, v in whole["model"].items())

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(train_model, "DeepseekV3ForCausalLM", interrupted)  # while the model is made: nothing to save
    with pytest.raises(SystemExit) as e:
        train_model.main([str(a) for a in ["--out_dir", data / "cut", "--resume", "--data_dir", data, "--steps", 8,
                                           *argv[6:]]])
    assert e.value.code == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m training.train_model: interrupted before the first step; {data / 'cut' / 'ckpt.pt'} was not "
        "written")
    assert torch.load(data / "cut" / "ckpt.pt", weights_only=True)["step"] == 6


def test_export_model_on_a_full_disk_names_the_out_dir(run, monkeypatch, capsys):
    """As prepare_data's: a write that names no file named nothing."""
    import errno
    import os

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    (run / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(export, "write_hf_checkpoint", full_disk)
    out = run.parent / "release"
    assert error(capsys, export.main, "--ckpt", run / "ckpt.pt", "--tokenizer_dir", run, "--out_dir", out) == (
        2, f"python -m training.export_model: error: {out}: No space left on device; no checkpoint was written")


@pytest.mark.parametrize("size", ["inf", "1e-9", "0", "nan"])
def test_export_model_refuses_a_shard_size_of_no_bytes_or_no_end(run, capsys, size):
    """--max_shard_mb inf was an OverflowError traceback and 1e-9 the writer's ValueError (0-byte shards)."""
    (run / "tokenizer.json").write_text("{}")
    status, err = error(capsys, export.main, "--ckpt", run / "ckpt.pt", "--tokenizer_dir", run, "--out_dir",
                        run.parent / "release", "--max_shard_mb", size)
    assert (status, err) == (2, f"python -m training.export_model: error: argument --max_shard_mb: {size!r} is not a "
                                "finite size of at least one byte (1/1048576 MB)")
    assert not (run.parent / "release").exists()


def test_export_model_errors_name_its_flags(run, capsys):
    """An existing --out_dir was refused with writer's "(or force=True)", and a --tokenizer_dir without
    tokenizer.json with a message naming neither the flag nor the directory."""
    (run / "out").mkdir()
    prog = "python -m training.export_model: error:"
    assert error(capsys, export.main, "--ckpt", run / "ckpt.pt", "--tokenizer_dir", run, "--out_dir", run / "out") == (
        2, f"{prog} {run / 'out'}: output directory already exists; pass --force to replace it")
    assert error(capsys, export.main, "--ckpt", run / "ckpt.pt", "--tokenizer_dir", run, "--out_dir",
                 run.parent / "new") == (2, f"{prog} --tokenizer_dir {run}: no tokenizer.json")
    assert not (run.parent / "new").exists()


def test_expert_balancer_moves_each_gate_towards_its_underloaded_experts(run):
    """train_model's and distill_mtp's one auxiliary-loss-free balancing: after a forward, step() moves each gate's
    bias by gamma up for the experts that took fewer tokens than the mean and down for the others; removed, it counts
    no more."""
    from runtime.model.deepseek_v3 import Gate
    from training.balance import ExpertBalancer

    state = torch.load(run / "ckpt.pt", weights_only=False)
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(state["config"]))
    model.load_state_dict(state["model"])
    gates = [m for m in model.modules() if isinstance(m, Gate)]
    balancer = ExpertBalancer(gates, 0.5)
    with torch.no_grad():
        train_model.losses(model, torch.randint(2, 64, (1, 18)))  # the main model's and the MTP layer's forwards
    assert set(balancer.loads) == set(gates) and len(gates) >= 2
    before = {g: g.e_score_correction_bias.clone() for g in gates}
    balancer.step()
    for g, load in balancer.loads.items():
        assert int(load.sum()) == 16 * model.cfg.num_experts_per_tok
        assert torch.equal(g.e_score_correction_bias - before[g], 0.5 * torch.sign(load.mean() - load))
    balancer.remove()
    balancer.loads.clear()
    with torch.no_grad():
        train_model.losses(model, torch.randint(2, 64, (1, 18)))
    assert not balancer.loads
