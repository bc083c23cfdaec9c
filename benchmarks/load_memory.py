"""Peak memory of loading a model (runtime.io.loading.load_engine) against the bytes its weights keep.

Each load runs in a child process that reports its peak RSS (ru_maxrss) after its imports (the Python,
torch and kernels baseline, with torch's meta-device machinery, which its first use loads) and after loading, and the bytes the loaded weights occupy in their kept form
(FP8 and BF16 packs, float32 parameters). Cases: the shipped model as released (HF directory) and as an
FP8 engine, and a synthetic FP8 checkpoint of about 500 MB (random weights, the release layout) and its
engine. This process imports no torch: Linux carries a parent's peak RSS into a forked child's ru_maxrss.

    python -m benchmarks.load_memory [--out docs/benchmarks/load_memory]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import ROOT
from benchmarks.synthetic import write_synthetic_checkpoint

CONFIG = {  # about 500 MB as an FP8 release: 4 MoE layers (the MTP one included) of 64 experts
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 4096, "moe_intermediate_size": 512,
    "num_hidden_layers": 4, "num_nextn_predict_layers": 1, "first_k_dense_replace": 1,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 512, "kv_lora_rank": 256,
    "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
    "n_routed_experts": 64, "num_experts_per_tok": 6, "n_group": 8, "topk_group": 4, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "max_position_embeddings": 4096,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}

LOAD = """
import resource, time
import torch
from benchmarks.common import weight_bytes_in_memory
from runtime.io.engine_format import read_limits
from runtime.model.kernels import cpu_kernels
from runtime.io.loading import load_engine
from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM
cpu_kernels()
with torch.device("meta"):  # torch's meta-device machinery, loaded on first use (a meta model allocates nothing)
    DeepseekV3ForCausalLM(read_limits({path!r})[0])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.time()
engine = load_engine({path!r})
print("seconds", time.time() - t)
print("baseline_kib", before)
print("peak_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
print("kept_bytes", weight_bytes_in_memory(engine.model))
"""

def child(code: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return {k: float(v) for k, v in (line.split() for line in out.splitlines() if len(line.split()) == 2)}


def measure(path: Path) -> dict[str, float]:
    r = child(LOAD.format(path=str(path)))
    kept, baseline, peak = r["kept_bytes"], r["baseline_kib"] * 1024, r["peak_kib"] * 1024
    return {"kept_mib": kept / 2**20, "baseline_mib": baseline / 2**20, "peak_mib": peak / 2**20,
            "load_mib": (peak - baseline) / 2**20, "load_over_kept": (peak - baseline) / kept, "seconds": r["seconds"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "load_memory")
    args = p.parse_args(argv)
    shipped = ROOT / "models" / "deepseek-v3-mini"
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        write_synthetic_checkpoint(work / "synthetic", CONFIG, tokenizer=shipped)
        for src, name in ((shipped, "shipped"), (work / "synthetic", "synthetic")):
            subprocess.run([Path(sys.executable).with_name("build_engine"), "--model_dir", src, "--output_dir",
                            work / f"{name}-engine", "--max_seq_len", "1024"], check=True, capture_output=True)
        cases = {"shipped model, HF directory": shipped, "shipped model, FP8 engine": work / "shipped-engine",
                 "synthetic ~500 MB, HF directory": work / "synthetic",
                 "synthetic ~500 MB, FP8 engine": work / "synthetic-engine"}
        results = {name: {"files_mib": sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20,
                          **measure(path)} for name, path in cases.items()}
    # imports torch: after the children
    from benchmarks.common import machine_info, machine_md, md_table, write_json, write_text

    info = machine_info()
    write_json(args.out.with_suffix(".json"), {"machine": info, "cases": results})
    rows = [(name, r["files_mib"], r["kept_mib"], r["load_mib"], r["load_over_kept"], r["baseline_mib"], r["seconds"])
            for name, r in results.items()]
    write_text(args.out.with_suffix(".md"), "# Peak memory of loading, against the weights' kept bytes\n\n"
               + machine_md(info) + "\n\n" + md_table(
        ["case", "weight files MiB", "kept MiB", "peak over baseline MiB", "over kept", "baseline MiB", "seconds"],
        rows) + "\n")
    print(md_table(["case", "files MiB", "kept MiB", "peak - baseline MiB", "/ kept", "baseline MiB", "s"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
