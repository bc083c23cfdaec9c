"""Whether drafting step n + 1 beside step n's verification could pay on this CPU (batch 1, CPU kernels, k = 1..4).

The pipelined form of a speculative step (DeepSeek's DSpark, TensorRT-LLM's overlap scheduler) drafts step n + 1
while step n is verified, assuming step n's drafts are all accepted, and drops the early drafts when they are not. On a
CPU the drafter can only run beside the verification on cores of its own, taken from the verification's kernels. So
the step's forwards are timed at one thread and at --threads (alternating rounds, on the engine's own forwards at
--context cached tokens): the verification, the target over k + 1 tokens, and the drafting of the next step under full
acceptance, the MTP catch-up over k + 1 positions and k - 1 more MTP steps along the draft chain.

  serial step    = verify(k + 1 tokens, all threads) + drafting(k, all threads)    what the runtime runs
  pipelined step = max(verify(k + 1 tokens, 1 thread), drafting(k, 1 thread))      each on a core of its own

The pipelined figure is a bound in its favour: every early draft kept, no time for the two to share memory
bandwidth and caches, no hand-off between them. On a 2-core machine a serial / pipelined ratio below 1 means the form
loses even so. Wall-clock medians over --reps calls, each forward at both thread counts back to back (in alternating
order), then the median over --rounds rounds.

  python -m benchmarks.draft_overlap              # 11 rounds x 30 calls
  python -m benchmarks.draft_overlap --quick      # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any, Callable

import torch

from benchmarks.common import (add_common_args, check_minimums, machine_info, machine_md, md_table, median_us,
                               parse_with_quick, ratio, write_results)
from runtime.core.kv_cache import KVCache
from runtime.core.model_runner import ModelRunner
from runtime.io.loading import load_engine
from runtime.model import kernels

MAX_K = 4
BLOCK = 16


def forwards(model: Any, context: int) -> dict[str, Callable[[], Any]]:
    """The target over q = 1..MAX_K + 1 new tokens (with lm_head) and the MTP layer over q new positions, at batch 1
    after `context` cached tokens, through the runner's forwards (random ids and cache: the values do not change the
    arithmetic)."""
    cfg = model.cfg
    blocks = -(-(context + MAX_K + 2) // BLOCK)
    cache = KVCache(cfg, num_blocks=blocks + 1, block_size=BLOCK, dtype=torch.float32, device="cpu")
    tables = [cache.allocator.allocate(blocks)]
    runner = ModelRunner(model, cache)
    cache.tensor.normal_()
    g = torch.Generator().manual_seed(0)
    calls: dict[str, Callable[[], Any]] = {}
    for q in range(1, MAX_K + 2):
        ids = torch.randint(0, cfg.vocab_size, (q,), generator=g)
        hidden = torch.randn(q, cfg.hidden_size, generator=g)
        calls[f"target_q{q}"] = lambda ids=ids.tolist(), q=q: model.logits(
            runner.forward_target(tables, [context], [q], ids))
        calls[f"mtp_q{q}"] = lambda ids=ids, hidden=hidden, q=q: runner.proposer.forward_mtp(
            tables, [context], [q], ids, hidden)
    return calls


def step_times(us: dict[str, float], k: int) -> tuple[float, float]:
    """(verification, drafting of the next step under full acceptance) of a step with k drafts, in us."""
    return us[f"target_q{k + 1}"], us[f"mtp_q{k + 1}"] + (k - 1) * us["mtp_q1"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, threads_help="threads to compare with one (0: torch's default)")
    p.add_argument("--context", type=int, default=128, help="cached tokens before the step")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--name", default="draft_overlap")
    args = parse_with_quick(p, argv, dict(rounds=1, reps=2, context=16))
    check_minimums(p, args, {"rounds": 1, "reps": 1, "threads": 0, "context": 1})
    if args.device != "cpu":
        p.error(f"--device: this benchmark measures CPU threads, got {args.device!r}")
    if kernels.cpu_kernels() is None:
        print("the CPU kernels do not run on this machine: nothing to measure", file=sys.stderr)
        return 1
    many = args.threads or torch.get_num_threads()
    engine = load_engine(args.model, dtype=args.dtype)
    calls = forwards(engine.model, args.context)
    with torch.inference_mode():
        for fn in calls.values():  # warm-up
            fn()
        times: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            for name, fn in calls.items():  # each forward at both counts back to back: the same load on the machine
                for threads in ((1, many) if r % 2 == 0 else (many, 1)):
                    torch.set_num_threads(threads)
                    times.setdefault((name, threads), []).append(median_us(fn, args.reps))
    torch.set_num_threads(many)
    us = {t: {name: statistics.median(times[(name, t)]) for name in calls} for t in (1, many)}
    results, rows = [], []
    for k in range(1, MAX_K + 1):
        verify_all, draft_all = step_times(us[many], k)
        verify_one, draft_one = step_times(us[1], k)
        serial, pipelined = verify_all + draft_all, max(verify_one, draft_one)
        results.append({"k": k, "verify_us_1_thread": round(verify_one, 1), f"verify_us_{many}_threads":
                        round(verify_all, 1), "draft_us_1_thread": round(draft_one, 1),
                        f"draft_us_{many}_threads": round(draft_all, 1), "serial_us": round(serial, 1),
                        "pipelined_bound_us": round(pipelined, 1), "serial_over_pipelined": ratio(serial, pipelined)})
        rows.append([k, round(verify_one, 1), round(verify_all, 1), round(draft_one, 1), round(draft_all, 1),
                     round(serial, 1), round(pipelined, 1), ratio(serial, pipelined)])
    info = machine_info()
    md = "\n\n".join([
        f"# Drafting beside verification: one thread each vs {many} threads in turn",
        f"Batch 1, {args.context} cached tokens; wall-clock medians in microseconds ({args.reps} calls a round, median "
        f"over {args.rounds} rounds, each forward at both thread counts back to back). Verify: the target over k + 1 tokens with lm_head. "
        "Draft: the next step's drafting under full acceptance (MTP catch-up over k + 1 positions, k - 1 chain steps). "
        f"Serial = verify + draft at {many} threads; pipelined bound = max(verify, draft) at one thread each. "
        "A ratio above 1 is what the pipelined form could gain at most; below 1 it loses even with every early draft "
        "kept.",
        md_table(["k", "verify, 1 thread", f"verify, {many} threads", "draft, 1 thread", f"draft, {many} threads",
                  "serial", "pipelined bound", "serial / pipelined"], rows),
        "## Machine", machine_md(info)])
    js, mdp = write_results(args.out_dir, args.name, {
        "results": results, "us_per_forward": {str(t): v for t, v in us.items()}, "threads": many,
        "context": args.context, "rounds": args.rounds, "reps": args.reps, "machine": info}, md)
    print(md)
    print(f"wrote {js} and {mdp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
