"""What the training commands share: their argument parser (one-line errors, defaults in --help), a signal handler
that lets SIGTERM clean up like Ctrl-C, and the checks of the files they read and write."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from runtime.cli import show_defaults


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, `python -m training.<name>: error: <message>`, exit status 2 (as
    build_engine's), not the usage text followed by the message."""

    def __init__(self, name: str, description: str | None) -> None:
        super().__init__(prog=f"python -m training.{name}", description=description,
                         formatter_class=argparse.RawDescriptionHelpFormatter)

    def parse_args(self, *args, **kwargs):  # type: ignore[override]
        show_defaults(self)
        return super().parse_args(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def add_training_flags(p: Parser, lr: float, warmup: int, eval_every: int, eval_batches: int,
                       at_evaluations: str = "") -> None:
    """The flags train_model and distill_mtp share (data, windows, schedule, load balancing, evaluation, threads),
    each command with its own defaults where they differ, and what else it does at an evaluation."""
    p.add_argument("--data_dir", type=Path, default=Path("data"), help="train.bin and val.bin of training.prepare_data")
    p.add_argument("--batch_size", type=int, default=16, help="windows a step")
    p.add_argument("--seq_len", type=int, default=256, help="tokens a window")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    p.add_argument("--min_lr_ratio", type=float, default=0.1, help="final learning rate / --lr")
    p.add_argument("--warmup", type=int, default=warmup, help="warm-up steps")
    p.add_argument("--bias_gamma", type=float, default=1e-3, help="step of the experts' load-balancing bias")
    p.add_argument("--eval_every", type=int, default=eval_every, help=f"steps between evaluations{at_evaluations}")
    p.add_argument("--eval_batches", type=int, default=eval_batches, help="batches an evaluation")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def at_least_one(p: Parser, args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """A parser error for the first of `names` (integer flags) below 1."""
    for name in names:
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")


def check_training_numbers(p: Parser, args: argparse.Namespace, at_least_zero: tuple[str, ...] = ()) -> None:
    """A parser error for the first of the shared flags (`add_training_flags`) or of `at_least_zero` (float flags) out
    of range, NaN or infinite: a NaN weight trains a NaN checkpoint, a negative learning rate ascends the loss, and
    torch's own refusals are tracebacks."""
    bounds = {"lr": (0.0, False, math.inf), "min_lr_ratio": (0.0, True, 1.0), "bias_gamma": (0.0, True, math.inf),
              **{name: (0.0, True, math.inf) for name in at_least_zero}}
    for name, (low, low_allowed, high) in bounds.items():
        value = getattr(args, name)
        if not (math.isfinite(value) and (value > low or low_allowed and value == low) and value <= high):
            p.error(f"--{name} must be a finite number {'>=' if low_allowed else '>'} {low:g}"
                    f"{f' and <= {high:g}' if high < math.inf else ''}, got {value}")
    if args.threads < 0:
        p.error(f"--threads must be >= 0 (0: torch's default), got {args.threads}")


def check_device(p: Parser, device: str) -> None:
    """A parser error unless torch can compute on `device` here."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        p.error(f"--device {device!r} is not a torch device (cpu, cuda or cuda:N)")
    if kind == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {device}: this torch sees no CUDA device (use --device cpu)")
    if kind not in ("cpu", "cuda"):
        p.error(f"--device {device}: training runs on cpu or cuda")


def check_token_ids(p: Parser, data_dir: Path, tokens: dict[str, np.ndarray], vocab_size: int, source: str) -> None:
    """A parser error when a token file holds an id outside the model's vocabulary (an embedding lookup's IndexError
    after the run directory was written, otherwise)."""
    for name, ids in tokens.items():
        top = int(ids.max())
        if top >= vocab_size:
            p.error(f"--data_dir {data_dir}: {name} holds token id {top}, outside the vocabulary of {source} "
                    f"(vocab_size {vocab_size})")


def token_files(p: Parser, data_dir: Path, window: int, shown: str) -> tuple[np.ndarray, np.ndarray]:
    """data_dir's train.bin and val.bin (what training.prepare_data writes) as token arrays, or a parser error naming
    --data_dir: a file missing, or too short for one training window of `window` tokens (`shown`: the flags that set
    it), which numpy's random window start refused with a traceback."""
    arrays = []
    for name in ("train.bin", "val.bin"):
        path = data_dir / name
        if not path.is_file():
            p.error(f"--data_dir {data_dir}: no {name} (training.prepare_data writes train.bin and val.bin)")
        size = path.stat().st_size  # numpy maps neither an empty file nor a half token
        if size % 2:
            p.error(f"--data_dir {data_dir}: {name} is {size} bytes, not whole 2-byte tokens")
        if size // 2 <= window:
            p.error(f"--data_dir {data_dir}: {name} holds {size // 2} tokens; a window of {shown} needs more")
        arrays.append(np.memmap(path, dtype=np.uint16, mode="r"))
    return arrays[0], arrays[1]


def load_checkpoint(p: Parser, flag: str, path: Path, keys: tuple[str, ...], device: str = "cpu",
                    made_by: str = "training.train_model or training.distill_mtp") -> dict:
    """The checkpoint at path, or a parser error naming flag and path: missing, unreadable by torch.load, or without
    one of `keys` (those `made_by` writes)."""
    if not path.is_file():
        p.error(f"{flag} {path}: file not found")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # torch.load raises what its unpickler or zip reader does: no narrower base class
        p.error(f"{flag} {path}: not a checkpoint torch.load can read ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else 'no detail'})")
    missing = [key for key in keys if not isinstance(state, dict) or key not in state]
    if missing:
        p.error(f"{flag} {path}: not a checkpoint of {made_by} (no {', '.join(missing)})")
    return state


def check_writable_file(p: Parser, flag: str, path: Path) -> None:
    """A parser error unless a file can be written at path: not a directory, and its nearest existing ancestor a
    directory this process can create files in (checked by making one, which also holds for root)."""
    if path.is_dir():
        p.error(f"{flag} {path}: is a directory, expected a file path")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        p.error(f"{flag} {path}: {parent} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=parent)
    except OSError as e:
        p.error(f"{flag} {path}: cannot write in {parent} ({e.strerror})")
    os.close(fd)
    os.unlink(probe)
