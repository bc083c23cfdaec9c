"""Synthetic release-shaped checkpoints for the memory benchmarks, written from a child process. Torch-free: Linux
carries a parent's peak RSS into a forked child's ru_maxrss, so the processes that measure children stay small."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

_SYNTHETIC = """
import torch
from builder.hf_writer import write_hf_checkpoint
from runtime.io.checkpoint import expected_tensor_shapes
from runtime.model.config import ModelConfig
cfg = ModelConfig.from_dict({config!r})
g = torch.Generator().manual_seed(0)
tensors = ((n, torch.ones(s) if len(s) == 1 else 0.02 * torch.randn(s, generator=g))
           for n, s in expected_tensor_shapes(cfg).items())
write_hf_checkpoint({src!r}, cfg, tensors, fp8={fp8!r}, max_shard_bytes={shard_bytes!r}, tokenizer_dir={tokenizer!r})
"""


def write_synthetic_checkpoint(src: Path, config: dict[str, Any], *, fp8: bool = True,
                               shard_bytes: int = 100_000_000, tokenizer: Path | None = None) -> None:
    """A release-shaped checkpoint of `config` with random weights (norms 1), written by a child process, so the
    memory the writing takes stays out of the process that measures."""
    code = _SYNTHETIC.format(config=config, src=str(src), fp8=fp8, shard_bytes=shard_bytes,
                             tokenizer=None if tokenizer is None else str(tokenizer))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"writing the synthetic checkpoint failed (exit status {r.returncode}):\n{r.stderr[-3000:]}")
