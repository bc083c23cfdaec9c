"""Held-out perplexity and MTP acceptance of the FP8 engine vs the unquantized BF16 export, on the shipped model.

  python -m training.export_model --ckpt runs/mini-chain4/ckpt.pt --tokenizer_dir data --out_dir /tmp/mini-bf16 --bf16
  python -m benchmarks.fp8 --bf16_model /tmp/mini-bf16 [--val_bin data/val.bin]

Both engines come from build_engine (FP8_BLOCK_SCALES as shipped; NO_QUANT from the BF16 export of
the same training checkpoint, its weights stored as fp32) and run in fp32 on CPU, so the only
difference is the weights' values: FP8 block-quantized or the BF16 ones.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.common import (add_common_args, check_minimums, load_prompts, machine_info, machine_md, md_table,
                               parse_with_quick, round_robin_by_source, run_tool, set_threads, weight_bytes_in_memory,
                               write_results)
from benchmarks.acceptance import teacher_forced, val_windows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--bf16_model", type=Path, required=True, help="BF16 export of the same training checkpoint")
    p.add_argument("--val_bin", type=Path, default=Path("data/val.bin"))
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--max_windows", type=int, default=64)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max_tokens", type=int, default=96)
    p.add_argument("--name", default="fp8")
    args = parse_with_quick(p, None, dict(max_windows=4, prompts=4, max_tokens=16))
    if args.device != "cpu":
        p.error(f"--device: this benchmark runs both engines on the CPU (fp32 compute), got {args.device!r}")
    if args.dtype not in (None, "float32"):
        p.error(f"--dtype: this benchmark computes in fp32 (the weights' values are what differs), got {args.dtype!r}")
    check_minimums(p, args, dict(window=1, max_windows=1, prompts=1, max_tokens=1))
    if not args.val_bin.is_file():
        p.error(f"--val_bin: no such file: {args.val_bin}")
    if not (args.bf16_model / "config.json").is_file():
        p.error(f"--bf16_model: {args.bf16_model} has no config.json (expected an HF checkpoint directory)")
    set_threads(args.threads)
    from runtime import SamplingParams, Session  # noqa: WPS433
    from runtime.io.loading import load_engine  # noqa: WPS433

    windows = val_windows(args.val_bin, args.window, 8, args.window * args.max_windows)
    if not windows:
        raise SystemExit(f"--val_bin {args.val_bin}: fewer than --window + 2 = {args.window + 2} tokens")
    prompts = [x["text"] for x in round_robin_by_source(load_prompts(args.model), args.prompts)]
    work = Path(tempfile.mkdtemp(prefix="bench-fp8-"))
    rows, results = [], {}
    try:
        for name, src, quant in (("FP8 (block 128x128)", args.model, "FP8_BLOCK_SCALES"),
                                 ("BF16 export, unquantized (fp32)", args.bf16_model, "NO_QUANT")):
            engine = work / quant
            run_tool([Path(sys.executable).with_name("build_engine"), "--model_dir", src, "--output_dir", engine,
                      "--quant_algo", quant, "--max_draft_len", "1"])
            size = sum(f.stat().st_size for f in engine.glob("*.safetensors"))
            model = load_engine(engine).model
            resident = weight_bytes_in_memory(model)
            losses = teacher_forced(model, windows, name)
            with Session(engine, num_draft_tokens=1) as s:
                outs = s.generate(prompts, SamplingParams(max_tokens=args.max_tokens,
                                                          ignore_eos=True))
            drafted = sum(o.stats.num_draft_tokens for o in outs)
            accepted = sum(o.stats.num_accepted_draft_tokens for o in outs)
            results[name] = {**losses, "acceptance_k1": accepted / drafted, "weight_bytes": size, "weight_bytes_in_memory": resident,
                             "outputs": [o.token_ids for o in outs]}
            rows.append([name, losses["main_loss"], losses["main_ppl"], losses["mtp_loss"], accepted / drafted,
                         size / 2**20, resident / 2**20])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fp8, bf16 = results.values()
    same = sum(a == b for a, b in zip(fp8["outputs"], bf16["outputs"]))
    info = machine_info()
    md = "\n\n".join([
        "# FP8 engine vs the unquantized BF16 export (shipped model, fp32 compute on CPU)",
        f"Held-out tokens: {fp8['tokens']} from `{args.val_bin}` in windows of {args.window}; MTP acceptance at "
        f"k=1 over {len(prompts)} held-out prompts, greedy.",
        md_table(["engine", "val loss", "perplexity", "MTP loss", "MTP acceptance (k=1)", "weights MiB (files)",
                  "weights MiB (loaded on CPU)"], rows, 3),
        f"Greedy outputs identical between the two engines for {same} of {len(prompts)} prompts.",
        "## Machine", machine_md(info)])
    for r in results.values():
        r.pop("outputs")
    js, mdp = write_results(args.out_dir, args.name, {"results": results, "identical_outputs": same,
                                                      "prompts": len(prompts), "machine": info}, md)
    print(md)
    print(f"wrote {js} and {mdp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
