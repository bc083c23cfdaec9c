"""Penalized or unpenalized drafts: which does a penalized request accept more of?

A request with repetition / presence / frequency penalties is verified against the penalized target (row j with
the counts of its own prefix, drafts before it included). Its drafts may come from the penalized MTP distribution
(the runtime's rule: draft j penalized with the output and drafts 1..j-1) or from the MTP's own, unpenalized one;
both are exact (greedy: the target rows decide every token; sampled with a seed: the target rows' races decide
them, runtime.core.sampling), so only the acceptance differs. This measures it: for each draft length (--ks,
speculation fixed) and for greedy and sampled requests (temperature --temperature, seeded per prompt), the
held-out prompts are served with penalized drafts and with unpenalized ones, and the acceptance, tokens per
step and the output tokens are compared, the latter with k = 0's.

Unpenalized drafting is not an option of the runtime; this benchmark gets it by hiding each sequence's penalties
from the MTP proposer's `propose` (its target rows still see them). Both variants run the general step path (the
greedy step in one kernel call drafts penalized, as the general path does, and tests check the two agree), so they
differ in the drafts alone. Acceptance does not depend on timing: this can run beside other work.

  python -m benchmarks.penalized_drafts
  python -m benchmarks.penalized_drafts --quick
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

from tqdm import tqdm

from benchmarks.common import (add_common_args, check_minimums, comma_list, drafting_summary, load_prompts,
                               machine_info, machine_md, md_table, parse_with_quick, round_robin_by_source, set_threads,
                               write_results)
from runtime.core.model_runner import ModelRunner
from runtime.core.sampling_params import SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.io.loading import load_engine

PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3)  # sampling_features' setting
NO_PENALTIES = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
DRAFTS = ("penalized", "unpenalized")


def unpenalized_draft(draft: Callable) -> Callable:
    """`MtpProposer.propose` with each sequence's penalties hidden while it drafts (put back after)."""

    def run(items: list) -> Any:
        saved = [(it.seq, it.seq.params, it.seq.penalty) for it in items]
        for it in items:
            it.seq.params, it.seq.penalty = dataclasses.replace(it.seq.params, **NO_PENALTIES), None
        try:
            return draft(items)
        finally:
            for seq, params, penalty in saved:
                seq.params, seq.penalty = params, penalty

    return run


def serve(engine: Any, k: int, drafts: str, texts: list[str], params: list[SamplingParams], device: str) -> list[Any]:
    """Each prompt (its first 64 tokens) with its params, all at once."""
    config = ExecutorConfig(num_draft_tokens=k, speculation="fixed", max_batch_size=len(texts),
                            device=device)
    with Executor(engine, config) as ex:
        runner: ModelRunner = ex.runner
        runner.greedy_step = None  # the general path for both variants
        if drafts == "unpenalized":
            runner.proposer.propose = unpenalized_draft(runner.proposer.propose)
        prompts = [ex.tokenizer.encode(t)[:64] for t in texts]
        return [h.result() for h in [ex.submit(p, sp) for p, sp in zip(prompts, params)]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--prompts", help="prompts JSON (default: <model>/heldout_prompts.json)")
    p.add_argument("--num_prompts", type=int, default=8)
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("--ks", default="1,3", help="draft lengths (speculation fixed)")
    p.add_argument("--temperature", type=float, default=0.8, help="of the sampled requests")
    p.add_argument("--name", default="penalized_drafts")
    args = parse_with_quick(p, None, dict(num_prompts=2, max_tokens=16, ks="2"))
    ks = comma_list(p, "--ks", args.ks)
    check_minimums(p, args, dict(num_prompts=1, max_tokens=2, temperature=0.0))
    if 0 in ks:
        p.error("--ks: draft lengths of 1 or more (k = 0 drafts nothing; it is run for the greedy reference)")
    set_threads(args.threads)
    engine = load_engine(args.model, device=args.device, dtype=args.dtype)
    texts = [x["text"] for x in round_robin_by_source(load_prompts(args.model, args.prompts), args.num_prompts)]
    modes = {"greedy": [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **PENALTIES)] * len(texts),
             "sampled": [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=args.temperature,
                                        seed=i, **PENALTIES) for i in range(len(texts))]}
    reference = {mode: [o.token_ids for o in serve(engine, 0, "penalized", texts, params, args.device)]
                 for mode, params in modes.items()}

    results: dict[str, Any] = {}
    rows = []
    runs = [(k, mode, d) for k in ks for mode in modes for d in DRAFTS]
    for k, mode, d in tqdm(runs, desc="penalized_drafts", dynamic_ncols=True):
        outs = serve(engine, k, d, texts, modes[mode], args.device)
        s = drafting_summary(outs)
        # the target rows decide every token (greedy: argmaxes; seeded sampling: races): drafts must not change them
        s["output_equals_k0"] = sum(o.token_ids == r for o, r in zip(outs, reference[mode]))
        results.setdefault(f"k{k}", {}).setdefault(mode, {})[d] = s
        rows.append([k, mode, d, s["acceptance_rate"], s["tokens_per_step"], f"{s['output_equals_k0']}/{len(texts)}"])
    verdicts = []
    for k in ks:
        for mode in modes:
            pen, unpen = (results[f"k{k}"][mode][d]["acceptance_rate"] for d in DRAFTS)
            better = "penalized" if pen > unpen else "unpenalized" if unpen > pen else "neither"
            results[f"k{k}"][mode]["more_accepted"] = better
            verdicts.append(f"- k = {k}, {mode}: {better} drafts accept more ({pen:.3f} penalized vs {unpen:.3f}).")
    info = machine_info()
    md = [f"# Penalized or unpenalized drafts{' (quick smoke run)' if args.quick else ''}", "",
          f"Shipped model, {len(texts)} held-out prompts cut at 64 tokens, {args.max_tokens} new tokens, ignore_eos, "
          f"penalties {PENALTIES}; sampled at temperature {args.temperature}, seed = prompt index. Speculation fixed at "
          f"k; both variants on the general step path. 'output == k=0': outputs equal to plain decoding's with the "
          f"same penalties (and seed).", "",
          md_table(["k", "requests", "drafts", "acceptance", "tokens/step", "output == k=0"], rows, 3), "",
          *verdicts, "", machine_md(info)]
    write_results(args.out_dir, args.name, {"penalties": PENALTIES, "results": results, "machine": info,
                                            "args": vars(args)}, "\n".join(md))


if __name__ == "__main__":
    main()
