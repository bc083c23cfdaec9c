"""Seeded sampled requests race, others take rejection sampling: what each costs in acceptance and time.

A sampled request with a seed picks each token by an exponential race that its drafts run too (runtime.core.sampling),
so its output is plain decoding's at every draft length; one without a seed takes lossless rejection sampling
(Leviathan et al.), whose acceptance is the most any coupling of draft and target can have. Both are exact in
distribution, so only the acceptance and the time per token differ. This serves the held-out prompts (cut at 64
tokens) sampled and seeded per prompt, for each temperature and draft length (speculation fixed), once with the race
and once with rejection sampling (seeded too, so the run repeats: the runner is told no row races), in alternating
order over --rounds, and reports the acceptance, tokens per step, time per output token of each, and how many outputs equal
k = 0's (the race's: all of them, or it is broken).

  python -m benchmarks.sampling_coupling --threads 1
  python -m benchmarks.sampling_coupling --quick
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tqdm import tqdm

from benchmarks.common import (add_common_args, check_minimums, comma_list, drafting_summary, load_prompts,
                               machine_info, machine_md, md_table, mean, parse_with_quick, ratio, round_robin_by_source,
                               set_threads, write_results)
from runtime.core.sampling_params import SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.io.loading import load_engine

COUPLINGS = ("race", "rejection")


def serve(engine: Any, k: int, coupling: str, prompts: list[list[int]], params: list[SamplingParams],
          device: str) -> tuple[list[Any], float]:
    """Each prompt with its params, one request at a time (batch 1, where speculation pays most); the outputs and
    the mean over requests of their time per output token in seconds (prefill included)."""
    config = ExecutorConfig(num_draft_tokens=k, speculation="fixed", max_batch_size=1, device=device)
    with Executor(engine, config) as ex:
        if coupling == "rejection":
            ex.runner.inputs.raced_rows = lambda seqs: []  # type: ignore[method-assign]
        outs, tpots = [], []
        for p, sp in zip(prompts, params):
            t0 = time.perf_counter()
            out = ex.submit(p, sp).result()
            outs.append(out)
            tpots.append((time.perf_counter() - t0) / len(out.token_ids))
    return outs, mean(tpots)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--prompts", help="prompts JSON (default: <model>/heldout_prompts.json)")
    p.add_argument("--num_prompts", type=int, default=16)
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("--ks", default="1,3", help="draft lengths (speculation fixed)")
    p.add_argument("--temperatures", default="0.6,1.0")
    p.add_argument("--rounds", type=int, default=2, help="rounds, the two couplings in alternating order")
    p.add_argument("--name", default="sampling_coupling")
    args = parse_with_quick(p, None, dict(num_prompts=2, max_tokens=16, ks="2", temperatures="1.0", rounds=1))
    ks = comma_list(p, "--ks", args.ks)
    temperatures = comma_list(p, "--temperatures", args.temperatures, float, "numbers")
    check_minimums(p, args, dict(num_prompts=1, max_tokens=2, rounds=1))
    if 0 in ks or any(t <= 0 for t in temperatures):
        p.error("--ks: draft lengths of 1 or more; --temperatures: above 0 (both couplings decode greedily at 0)")
    set_threads(args.threads)
    engine = load_engine(args.model, device=args.device, dtype=args.dtype)
    texts = [x["text"] for x in round_robin_by_source(load_prompts(args.model, args.prompts), args.num_prompts)]
    with Executor(engine, ExecutorConfig(num_draft_tokens=0, speculation="off", device=args.device)) as ex:
        prompts = [ex.tokenizer.encode(t)[:64] for t in texts]

    results: dict[str, Any] = {}
    runs = [(t, k, c) for t in temperatures for k in ks for c in COUPLINGS]
    with tqdm(total=len(temperatures) * (1 + len(ks) * 2 * args.rounds), desc="sampling_coupling",
              dynamic_ncols=True) as bar:
        for t in temperatures:
            params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=t, seed=i)
                      for i in range(len(prompts))]
            plain, _ = serve(engine, 0, "race", prompts, params, args.device)
            bar.update()
            for r in range(args.rounds):
                order = [(k, c) for k in ks for c in (COUPLINGS if r % 2 == 0 else COUPLINGS[::-1])]
                for k, c in order:
                    outs, tpot = serve(engine, k, c, prompts, params, args.device)
                    # seeded at a fixed k, every round decodes the same tokens: acceptance from the first
                    entry = results.setdefault(f"T{t}_k{k}", {}).setdefault(c, drafting_summary(outs) | {"tpot_ms": []})
                    entry["tpot_ms"].append(1e3 * tpot)
                    # the race's tokens are plain decoding's, whatever the drafts; rejection sampling's are others
                    entry["output_equals_k0"] = sum(o.token_ids == q.token_ids for o, q in zip(outs, plain))
                    bar.update()
    rows = []
    for t, k, c in runs:
        entry = results[f"T{t}_k{k}"][c]
        entry["tpot_ms_mean"] = mean(entry["tpot_ms"])
        rows.append([t, k, c, entry["acceptance_rate"], entry["tokens_per_step"], entry["tpot_ms_mean"],
                     f"{entry['output_equals_k0']}/{len(prompts)}"])
    verdicts = []
    for t in temperatures:
        for k in ks:
            race, rejection = (results[f"T{t}_k{k}"][c] for c in COUPLINGS)
            results[f"T{t}_k{k}"]["race_over_rejection"] = {
                "acceptance": ratio(race["acceptance_rate"], rejection["acceptance_rate"]),
                "tokens_per_step": ratio(race["tokens_per_step"], rejection["tokens_per_step"]),
                "time_per_token": ratio(race["tpot_ms_mean"], rejection["tpot_ms_mean"])}
            v = results[f"T{t}_k{k}"]["race_over_rejection"]
            verdicts.append(f"- temperature {t}, k = {k}: the race accepts {v['acceptance']:.3f}x rejection "
                            f"sampling's rate, {v['tokens_per_step']:.3f}x its tokens per step, "
                            f"{v['time_per_token']:.3f}x its time per token.")
    info = machine_info()
    md = [f"# Seeded sampling: the race against rejection sampling{' (quick smoke run)' if args.quick else ''}", "",
          f"Shipped model, {len(prompts)} held-out prompts cut at 64 tokens, {args.max_tokens} new tokens, ignore_eos, "
          f"one request at a time, seed = prompt index, speculation fixed at k, {args.rounds} round(s) in "
          f"alternating order (ms/token: each request's time over its tokens, prefill included; mean over requests and "
          f"rounds). Acceptance and tokens per step do not depend on timing. "
          f"'output == k=0': outputs equal to plain decoding's with the same seed.", "",
          md_table(["temperature", "k", "coupling", "acceptance", "tokens/step", "ms/token", "output == k=0"], rows, 3),
          "", *verdicts, "", machine_md(info)]
    write_results(args.out_dir, args.name, {"results": results, "machine": info, "args": vars(args)}, "\n".join(md))


if __name__ == "__main__":
    main()
