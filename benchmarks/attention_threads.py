"""How the MLA kernels of one decode token scale with threads (batch 1, CPU kernels): `mla_prepare` (the absorbed
queries, W_UK per head) and `mla_attention` (over the cached context, W_UV per head) at DeepSeek-V3's shapes
(128 heads, latent 512 + 64, nope and v 128) and at the shipped model's, each at one thread and at --threads,
alternating, with random weights and cache (the arithmetic does not depend on the values). Wall-clock medians
over --reps calls per round, then the median over rounds.

  python -m benchmarks.attention_threads            # 2 contexts x 2 shapes, 5 rounds
  python -m benchmarks.attention_threads --quick    # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.common import (DEFAULT_OUT_DIR, check_minimums, comma_list, machine_info, machine_md, md_table,
                               median_us, parse_with_quick, ratio, write_results)
from runtime.model import kernels

# heads, nope, rope, latent rank, v: MLA's per-head sizes
SHAPES = {"DeepSeek-V3": (128, 128, 64, 512, 128), "shipped model": (4, 64, 32, 64, 64)}
BLOCK = 64  # the latent cache's block size here


def kernel_calls(shape: tuple[int, ...], context: int) -> dict[str, Callable[[], Any]]:
    """One decode token's mla_prepare and mla_attention over `context` cached positions."""
    heads, nope, rope, rank, v = shape
    g = torch.Generator().manual_seed(0)
    width = rank + rope
    blocks = -(-context // BLOCK)
    cache = torch.randn(blocks * BLOCK, width, generator=g)
    tables = torch.arange(blocks).view(1, -1)
    q = torch.randn(1, heads * (nope + rope), generator=g)
    kv = torch.randn(1, width, generator=g)
    rot = torch.polar(torch.ones(1, rope // 2), torch.rand(1, rope // 2, generator=g))
    w_uk = torch.randn(heads, nope, rank, generator=g) * 0.05
    w_uv = torch.randn(heads, rank, v, generator=g) * 0.05
    norm, slot = torch.ones(rank), torch.tensor([context - 1])
    queries = kernels.mla_prepare(q, kv, rot, norm, 1e-6, w_uk, 0.1, cache, slot)
    position, seq = torch.tensor([context - 1]), torch.tensor([0])
    return {"mla_prepare": lambda: kernels.mla_prepare(q, kv, rot, norm, 1e-6, w_uk, 0.1, cache, slot),
            "mla_attention": lambda: kernels.mla_attention(queries, cache, position, seq, tables, BLOCK, w_uv)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=0, help="threads to compare with one (0: torch's default)")
    p.add_argument("--out_dir", type=Path, default=Path(DEFAULT_OUT_DIR))
    p.add_argument("--quick", action="store_true", help="smoke run: tiny settings, results still written")
    p.add_argument("--contexts", default="256,2048", help="cached positions the token attends to")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--name", default="attention_threads")
    args = parse_with_quick(p, argv, dict(contexts="64", rounds=1, reps=2))
    check_minimums(p, args, {"rounds": 1, "reps": 1, "threads": 0})
    contexts = comma_list(p, "--contexts", args.contexts)
    if min(contexts) < 1:
        p.error(f"--contexts: each must be >= 1, got {args.contexts}")
    if kernels.cpu_kernels() is None:
        print("the CPU kernels do not run on this machine: nothing to measure", file=sys.stderr)
        return 1
    many = args.threads or torch.get_num_threads()
    calls = {(name, c): kernel_calls(shape, c) for name, shape in SHAPES.items() for c in contexts}
    times: dict[tuple[str, int, str, int], list[float]] = {}
    for r in range(args.rounds):
        for threads in ((1, many) if r % 2 == 0 else (many, 1)):
            torch.set_num_threads(threads)
            for (name, c), fns in calls.items():
                for kernel, fn in fns.items():
                    times.setdefault((name, c, kernel, threads), []).append(median_us(fn, args.reps))
    torch.set_num_threads(many)
    rows, results = [], []
    for (name, c), fns in calls.items():
        for kernel in fns:
            one = statistics.median(times[(name, c, kernel, 1)])
            all_ = statistics.median(times[(name, c, kernel, many)])
            results.append({"shape": name, "context": c, "kernel": kernel, "us_1_thread": round(one, 1),
                            f"us_{many}_threads": round(all_, 1), "speedup": ratio(one, all_)})
            rows.append([name, c, kernel, round(one, 1), round(all_, 1), ratio(one, all_)])
    info = machine_info()
    md = "\n\n".join([
        "# MLA kernels of one decode token: one thread vs " + str(many),
        f"Wall-clock medians in microseconds ({args.reps} calls a round, median over {args.rounds} rounds, "
        "alternating the thread counts); random weights and cache at each model's shapes.",
        md_table(["shape", "context", "kernel", "us, 1 thread", f"us, {many} threads", "speed-up"], rows),
        "## Machine", machine_md(info)])
    js, mdp = write_results(args.out_dir, args.name, {"results": results, "threads": many, "rounds": args.rounds,
                                                      "reps": args.reps, "machine": info}, md)
    print(md)
    print(f"wrote {js} and {mdp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
