"""Export a training checkpoint to the DeepSeek-V3 release layout (FP8 weights, shards, tokenizer).

  python -m training.export_model --ckpt runs/mini/ckpt.pt --tokenizer_dir data --out_dir models/deepseek-v3-mini
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from builder.hf_writer import write_hf_checkpoint
from runtime.io.atomic import OutputDirError, check_not_replacing, os_error_text
from runtime.model.config import ModelConfig, QuantizationConfig
from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM
from runtime.io.weights import release_tensors


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--tokenizer_dir", type=Path, required=True)
    p.add_argument("--out_dir", type=Path, required=True)
    p.add_argument("--max_shard_mb", type=_positive_float, default=12.0, help="shard size (the release has several shards)")
    p.add_argument("--bf16", action="store_true", help="write bf16 Linear weights instead of FP8 blocks")
    p.add_argument("--force", action="store_true")
    args = p.parse_args()
    if not args.ckpt.is_file():
        p.error(f"--ckpt {args.ckpt}: file not found")
    try:
        check_not_replacing(args.out_dir, "--out_dir", {"--ckpt": args.ckpt, "--tokenizer_dir": args.tokenizer_dir,
                                                         "the current directory": Path.cwd()})
    except OutputDirError as e:
        p.error(str(e))

    try:
        state = torch.load(args.ckpt, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises what its unpickler or zip reader does: no narrower base class
        p.error(f"--ckpt {args.ckpt}: not a checkpoint torch.load can read ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else 'no detail'})")
    missing = [key for key in ("config", "model", "step") if not isinstance(state, dict) or key not in state]
    if missing:
        p.error(f"--ckpt {args.ckpt}: not a checkpoint of training.train_model or training.distill_mtp "
                f"(no {', '.join(missing)})")
    cfg = ModelConfig.from_dict({**state["config"], "torch_dtype": "bfloat16"})
    if not args.bf16:
        cfg = ModelConfig.from_dict({**cfg.to_dict(), "quantization_config": vars(QuantizationConfig()) | {
            "weight_block_size": [128, 128]}})
    model = DeepseekV3ForCausalLM(cfg)
    model.load_state_dict(state["model"])
    try:  # the writer checks the output directory and the tokenizer before it reads a tensor
        write_hf_checkpoint(args.out_dir, cfg, release_tensors(model), fp8=not args.bf16,
                            max_shard_bytes=int(args.max_shard_mb * 2**20), tokenizer_dir=args.tokenizer_dir,
                            force=args.force)
    except (FileExistsError, FileNotFoundError) as e:
        p.error(str(e))
    except OSError as e:  # no space, no permission: the output is written whole or not at all
        p.error(f"{os_error_text(e)}; no checkpoint was written")
    print(f"step {state['step']} -> {args.out_dir}")


if __name__ == "__main__":
    main()
