"""Tensor-parallel ranks on CPU: tp 2 against tp 1 decode TPOT and throughput at batch 1 and 16, the bytes
each rank receives per step, and each rank's peak memory while loading its rank file of a synthetic FP8
checkpoint, against that file's bytes.

TPOT: the shipped model built at tp 2 (FP8) runs as its rank files joined in one process (world_size 1, all
the machine's threads) and as two ranks (a process each, half the threads each), plain greedy decoding
(k = 0, ignore_eos); the HF checkpoint in one process (fused CPU kernels) is the single-process reference.
Two ranks on two cores are not two GPUs: every step adds two gathers per layer over loopback, and a model
this small gains nothing from splitting. Communication is counted where it happens (runtime.model.parallel
counts the gathers' bytes, runtime.executors.ranks the broadcast calls).

Memory: each rank's load in a child process of its own (peak VmHWM after imports, the meta model and the
kernels: the baseline; then after loading), the synthetic checkpoint built at tp 2 with build_engine.

    python -m benchmarks.parallel [--quick] [--out_dir docs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import ROOT, load_memory
from benchmarks.synthetic import write_synthetic_checkpoint

SHIPPED = ROOT / "models" / "deepseek-v3-mini"

CONFIG = {**load_memory.CONFIG, "num_hidden_layers": 8}  # about 1 GB as an FP8 release: 8 MoE layers of 64 experts

LOAD = """
import os
import torch
from benchmarks.common import weight_bytes_in_memory
from runtime.executors.lifetime import rss_bytes
from runtime.io.engine_format import EngineManifest
from runtime.io.loading import load_engine
from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM
from runtime.model.kernels import cpu_kernels
from runtime.model.parallel import Parallel
from pathlib import Path
manifest = EngineManifest.read(Path({path!r}))
par = Parallel(manifest.build.layout({rank})) if {rank} >= 0 else Parallel()
cpu_kernels()
with torch.device("meta"):
    DeepseekV3ForCausalLM(manifest.model_config, par)
print("baseline", rss_bytes(os.getpid(), peak=True))
engine = load_engine({path!r}, par=par, verify=False)
print("peak", rss_bytes(os.getpid(), peak=True))
print("kept", weight_bytes_in_memory(engine.model))
"""


def memory(work: Path, config: dict) -> dict:
    """Peak RSS of loading each rank of a tp-2 synthetic FP8 engine, and of the whole engine joined in one process."""
    src, engine = work / "synthetic", work / "synthetic-tp2"
    from benchmarks.common import run_tool

    write_synthetic_checkpoint(src, config, tokenizer=SHIPPED)
    run_tool([Path(sys.executable).with_name("build_engine"), "--model_dir", src, "--output_dir", engine,
              "--max_seq_len", "1024", "--tp_size", "2"])
    weights = json.loads((engine / "engine.json").read_text())["weights"]
    out = {"release_mib": sum(f.stat().st_size for f in src.glob("*.safetensors")) / 2**20, "ranks": {}}
    for rank in (0, 1, -1):
        r = load_memory.child(LOAD.format(path=str(engine), rank=rank))
        files = [engine / w for w in weights] if rank < 0 else [engine / weights[rank]]
        shard = sum(f.stat().st_size for f in files)
        out["ranks"]["joined (world_size 1)" if rank < 0 else f"rank {rank}"] = {
            "file_mib": shard / 2**20, "kept_mib": r["kept"] / 2**20, "baseline_mib": r["baseline"] / 2**20,
            "peak_mib": r["peak"] / 2**20, "peak_over_baseline_per_file_byte": (r["peak"] - r["baseline"]) / shard}
    return out


def tpot(engine: Path, world: int | None, threads: int, batches: list[int], max_tokens: int) -> dict:
    """Decode TPOT and throughput at each batch size, and the bytes each rank receives per step."""
    import torch

    from benchmarks.common import load_prompts, mean
    from runtime.core.sampling_params import SamplingParams
    from runtime.executors.base import ExecutorConfig
    from runtime.executors.native import Executor

    torch.set_num_threads(threads)
    ex = Executor(engine, ExecutorConfig(num_draft_tokens=0, speculation="off", world_size=world,
                                         max_batch_size=max(batches), kv_cache_tokens=max(batches) * 256))
    try:
        tok = ex.tokenizer
        prompts = [tok.encode(p["text"])[:32] for p in load_prompts(SHIPPED)]
        steps = [0]
        step = ex.runner.step

        def counted(items):
            steps[0] += 1
            return step(items)

        ex.runner.step = counted
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ex.submit(prompts[0], SamplingParams(max_tokens=8, ignore_eos=True)).result()  # warm up
        par = ex.engine.model.par
        per_rank = ex.ranks.threads if ex.ranks else torch.get_num_threads()  # rank 0's step loop runs on its share
        out = {"world_size": ex.stats().world_size, "threads_per_rank": per_rank, "batches": {}}
        for b in batches:
            steps[0], gathered, calls = 0, par.received_bytes, ex.ranks.sent_bytes if ex.ranks else 0
            t0 = time.perf_counter()
            results = [h.result() for h in [ex.submit(prompts[i % len(prompts)], params) for i in range(b)]]
            wall = time.perf_counter() - t0
            n = steps[0]
            out["batches"][b] = {
                "tpot_ms": 1e3 * mean(r.stats.tpot_s for r in results),
                "tokens_per_s": sum(r.stats.output_tokens for r in results) / wall,
                "steps": n,
                "gathered_bytes_per_step_per_rank": (par.received_bytes - gathered) / n,
                "call_bytes_per_step": ((ex.ranks.sent_bytes if ex.ranks else 0) - calls) / n,
            }
        out["rank_rss_mib"] = [m / 2**20 for m in ex.stats().rank_memory_bytes]
        return out
    finally:
        ex.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", type=Path, default=ROOT / "docs" / "benchmarks")
    p.add_argument("--name", default="parallel")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads of one process; each of 2 ranks gets half")
    p.add_argument("--quick", action="store_true", help="smoke run: a ~130 MB synthetic model, 16 tokens")
    args = p.parse_args(argv)
    config = dict(CONFIG)
    if args.quick:
        args.name += "_quick"
        args.max_tokens = 16
        config.update(num_hidden_layers=1, n_routed_experts=16)
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        mem = memory(work, config)
        from benchmarks.common import machine_info, machine_md, md_table, run_tool, write_results

        info = machine_info()  # before the cases, which set this process's torch threads

        engine = work / "shipped-tp2"
        run_tool([Path(sys.executable).with_name("build_engine"), "--model_dir", SHIPPED, "--output_dir", engine,
                  "--max_seq_len", "512", "--max_batch_size", "16", "--tp_size", "2"])
        cases = {"HF checkpoint, 1 process": tpot(SHIPPED, None, args.threads, [1, 16], args.max_tokens),
                 "tp-2 engine joined, 1 process": tpot(engine, 1, args.threads, [1, 16], args.max_tokens),
                 "tp-2 engine, 2 ranks": tpot(engine, None, args.threads, [1, 16], args.max_tokens)}
    rows = [(name, c["world_size"], c["threads_per_rank"], b, r["tpot_ms"], r["tokens_per_s"],
             r["gathered_bytes_per_step_per_rank"] / 1024, r["call_bytes_per_step"] / 1024)
            for name, c in cases.items() for b, r in c["batches"].items()]
    mem_rows = [(name, r["file_mib"], r["kept_mib"], r["baseline_mib"], r["peak_mib"], r["peak_over_baseline_per_file_byte"])
                for name, r in mem["ranks"].items()]
    markdown = "\n\n".join([
        "# Tensor-parallel ranks on CPU (gloo): tp 2 against tp 1",
        machine_md(info),
        f"## Decode, greedy, k = 0, {args.max_tokens} tokens per request (the shipped model)",
        md_table(["case", "world size", "threads per rank", "batch", "TPOT ms", "tokens/s",
                  "gathers KiB per step per rank", "call KiB per step (rank 0 -> each rank)"], rows),
        f"## Loading a synthetic FP8 checkpoint ({mem['release_mib']:.0f} MiB as released) built at tp 2",
        md_table(["load", "rank file MiB", "kept MiB", "baseline MiB", "peak MiB", "(peak - baseline) / file bytes"],
                 mem_rows),
    ])
    write_results(args.out_dir, args.name, {"machine": info, "decode": cases, "memory": mem}, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
