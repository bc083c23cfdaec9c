"""Export a training checkpoint to the DeepSeek-V3 release layout (FP8 weights, shards, tokenizer).

  python -m training.export_model --ckpt runs/mini/ckpt.pt --tokenizer_dir data --out_dir models/deepseek-v3-mini
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from builder.hf_writer import write_hf_checkpoint
from runtime.io.atomic import OutputDirError, check_not_replacing, check_output_dir, os_error_text, release_owned
from runtime.model.config import ModelConfig
from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM
from runtime.io.weights import release_tensors
from runtime.cli import interrupt_on_sigterm
from training.cli import Parser, load_checkpoint


def _shard_mb(text: str) -> float:
    """A shard size in MB that is a whole number of bytes >= 1 (inf overflowed int(), 1e-9 made shards of 0 bytes)."""
    value = float(text)
    if not (math.isfinite(value) and value * 2**20 >= 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite size of at least one byte (1/1048576 MB)")
    return value


def main(argv: list[str] | None = None) -> None:
    p = Parser("export_model", __doc__)
    p.add_argument("--ckpt", type=Path, required=True, help="checkpoint of training.train_model or distill_mtp")
    p.add_argument("--tokenizer_dir", type=Path, required=True, help="directory of the tokenizer.json to ship")
    p.add_argument("--out_dir", type=Path, required=True, help="release directory to write")
    p.add_argument("--max_shard_mb", type=_shard_mb, default=12.0, help="shard size (the release has several shards)")
    p.add_argument("--bf16", action="store_true", help="write bf16 Linear weights instead of FP8 blocks")
    p.add_argument("--force", action="store_true", help="replace an existing --out_dir")
    args = p.parse_args(argv)
    try:
        check_output_dir(args.out_dir, args.force)
        check_not_replacing(args.out_dir, "--out_dir", {"--ckpt": args.ckpt, "--tokenizer_dir": args.tokenizer_dir,
                                                         "the current directory": Path.cwd()})
    except OutputDirError as e:
        p.error(str(e))
    state = load_checkpoint(p, "--ckpt", args.ckpt, ("config", "model", "step"))
    if not (args.tokenizer_dir / "tokenizer.json").is_file():
        p.error(f"--tokenizer_dir {args.tokenizer_dir}: no tokenizer.json")
    cfg = ModelConfig.from_dict({**state["config"], "torch_dtype": "bfloat16"})
    model = DeepseekV3ForCausalLM(cfg)
    model.load_state_dict(state["model"])
    interrupt_on_sigterm()
    try:
        write_hf_checkpoint(args.out_dir, cfg, release_tensors(model), fp8=not args.bf16,
                            max_shard_bytes=int(args.max_shard_mb * 2**20), tokenizer_dir=args.tokenizer_dir,
                            force=args.force)
    except KeyboardInterrupt:
        release_owned()
        print(f"{p.prog}: interrupted; no output directory was written", file=sys.stderr)
        sys.exit(130)
    except OSError as e:  # no space, no permission, an --out_dir made meanwhile: written whole or not at all
        p.error(f"{os_error_text(e, args.out_dir)}; no checkpoint was written")
    print(f"step {state['step']} -> {args.out_dir}")


if __name__ == "__main__":
    main()
