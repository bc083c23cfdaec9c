"""Peak memory of the HF -> TensorRT-LLM checkpoint converter against the largest input shard.

Writes a synthetic sharded checkpoint of a few hundred MB (wide hidden size, few layers, random
weights), converts it in a child process that reports its own peak RSS (ru_maxrss), and compares
that with a child that only imports the converter (the Python + torch baseline). This process
imports no torch and writes the checkpoint from a child too: Linux carries a parent's peak RSS
into a forked child's ru_maxrss, so the parent must stay small (it imports torch, for the machine record, only
after the children ran). Writes docs/benchmarks/<name>.json and .md.

    python -m benchmarks.convert_memory [--tp_size 2 --ep_size 2 --fp8 --shard_mb 160] [--name convert_memory]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import ROOT
from benchmarks.synthetic import write_synthetic_checkpoint

CONFIG = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 4096, "moe_intermediate_size": 512,
    "num_hidden_layers": 4, "num_nextn_predict_layers": 1, "first_k_dense_replace": 1,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 512, "kv_lora_rank": 256,
    "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "max_position_embeddings": 4096,
}

CHILD = """
import resource, time
from pathlib import Path
from builder.convert import convert_checkpoint
from runtime.io.engine_format import BuildConfig
if {convert!r}:
    t = time.time()
    convert_checkpoint(Path({src!r}), Path({dst!r}), BuildConfig(**{build!r}), progress=False)
    print("seconds", time.time() - t)
print("maxrss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

def child(code: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return {k: float(v) for k, v in (line.split() for line in out.splitlines())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp_size", type=int, default=2)
    p.add_argument("--ep_size", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--fp8", action="store_true", help="FP8 source, converted with FP8_BLOCK_SCALES (pass-through)")
    p.add_argument("--shard_mb", type=int, default=160)
    p.add_argument("--out_dir", type=Path, default=ROOT / "docs" / "benchmarks")
    p.add_argument("--name", default="convert_memory", help="the result files' base name")
    args = p.parse_args()

    build = {"tp_size": args.tp_size, "ep_size": args.ep_size, "dtype": args.dtype,
             "quant_algo": "FP8_BLOCK_SCALES" if args.fp8 else None, "max_seq_len": 4096}
    with tempfile.TemporaryDirectory() as work:
        src, dst = Path(work) / "hf", Path(work) / "trtllm"
        write_synthetic_checkpoint(src, CONFIG, fp8=args.fp8, shard_bytes=args.shard_mb * 2**20)
        shards = sorted(src.glob("model-*.safetensors"))
        largest = max(f.stat().st_size for f in shards)
        measure = dict(src=str(src), dst=str(dst), build=build)
        baseline = child(CHILD.format(convert=False, **measure))["maxrss_kib"] * 1024
        run = child(CHILD.format(convert=True, **measure))
        peak = run["maxrss_kib"] * 1024
        result = {
            "build": build,
            "checkpoint_bytes": sum(f.stat().st_size for f in shards),
            "num_shards": len(shards),
            "largest_shard_bytes": largest,
            "output_bytes": sum(f.stat().st_size for f in dst.glob("rank*.safetensors")),
            "peak_rss_bytes": peak,
            "baseline_rss_bytes": baseline,
            "peak_over_baseline_bytes": peak - baseline,
            "peak_rss_over_largest_shard": peak / largest,
            "peak_over_baseline_over_largest_shard": (peak - baseline) / largest,
            "seconds": run["seconds"],
        }
    mb = 2**20
    print(f"checkpoint {result['checkpoint_bytes'] / mb:.0f} MiB in {len(shards)} shards, largest {largest / mb:.0f} MiB; "
          f"converted in {result['seconds']:.1f} s")
    print(f"peak RSS {peak / mb:.0f} MiB = {result['peak_rss_over_largest_shard']:.2f} x largest shard "
          f"(Python + torch baseline {baseline / mb:.0f} MiB; above it {(peak - baseline) / mb:.0f} MiB "
          f"= {result['peak_over_baseline_over_largest_shard']:.2f} x)")
    from benchmarks.common import machine_info, machine_md, write_results  # imports torch: after the children

    result["machine"] = machine_info()
    markdown = (f"# Converter peak memory\n\n{machine_md(result['machine'])}\n\n"
                f"| checkpoint | largest shard | peak RSS | Python + torch baseline | peak above baseline |\n"
                f"|---|---|---|---|---|\n"
                f"| {result['checkpoint_bytes'] / mb:.0f} MiB in {len(shards)} shards | {largest / mb:.0f} MiB | "
                f"{peak / mb:.0f} MiB ({result['peak_rss_over_largest_shard']:.2f}x) | {baseline / mb:.0f} MiB | "
                f"{(peak - baseline) / mb:.0f} MiB ({result['peak_over_baseline_over_largest_shard']:.2f}x the "
                f"largest shard) |\n")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    js, md = write_results(args.out_dir, args.name, result, markdown)
    print(f"wrote {js} and {md}")


if __name__ == "__main__":
    main()
