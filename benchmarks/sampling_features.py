"""What logprobs, penalties and a logit bias cost under MTP, side by side, and the acceptance they leave.

For each draft length (--ks, speculation "fixed"; 0 = plain decoding) and concurrency (--concurrency) one
executor serves rounds of held-out prompts, `concurrency` requests at a time, under each setting in turn
(the order reversed every other round, so drift of the machine falls on all alike): `off` (no feature:
the plain greedy fast path), `logprobs` (top-5 raw logprobs of every output token), `penalties`
(repetition 1.1, presence 0.3, frequency 0.3), `both`, and `logit_bias` (-2 on 64 tokens; --settings picks
some). Greedy, ignore_eos, --max_tokens new tokens
each. Reported per setting: TPOT (vLLM's, on the server's clock, mean over requests), its ratio to `off`
in the same executor, acceptance, tokens per step, and the cost of a step over `off`'s (TPOT x tokens per
step: penalties change the text, and with it the acceptance).

  python -m benchmarks.sampling_features             # full run
  python -m benchmarks.sampling_features --quick     # smoke run
  python -m benchmarks.sampling_features --settings off,logit_bias --name sampling_features_bias
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.common import (add_common_args, check_minimums, comma_list, drafting_summary, load_prompts,
                               machine_info, machine_md, md_table, mean, ms, parse_with_quick, ratio,
                               round_robin_by_source, set_threads, write_results)
from runtime.core.sampling_params import SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.executors.outputs import RequestOutput
from runtime.io.loading import load_engine

SETTINGS: dict[str, dict[str, Any]] = {
    "off": {},
    "logprobs": dict(logprobs=5),
    "penalties": dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3),
    "both": dict(logprobs=5, repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3),
    "logit_bias": dict(logit_bias=dict.fromkeys(range(100, 164), -2.0)),
}
SETTING_TEXT = {"logprobs": "top-5", "penalties": str(SETTINGS["penalties"]), "both": "logprobs and penalties",
                "logit_bias": "-2 on tokens 100..163"}
TARGET_RATIO = 1.10  # the cost target: TPOT with a feature on at most 1.10x off


def summarize(outs: list[RequestOutput]) -> dict[str, Any]:
    return {**drafting_summary(outs), "tpot_mean_s": mean(o.stats.tpot_s for o in outs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--prompts", help="prompts JSON (default: <model>/heldout_prompts.json)")
    p.add_argument("--ks", default="0,3", help="draft lengths (0 = plain decoding)")
    p.add_argument("--concurrency", default="1,16", help="requests served together")
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4, help="rounds per setting (each round: one request per slot)")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"of {', '.join(SETTINGS)} (off among them)")
    p.add_argument("--name", default="sampling_features")
    args = parse_with_quick(p, None, dict(max_tokens=16, rounds=1, concurrency="1,4"))
    ks, levels = comma_list(p, "--ks", args.ks), comma_list(p, "--concurrency", args.concurrency)
    chosen = args.settings.split(",")
    if "off" not in chosen or not set(chosen) <= set(SETTINGS):
        p.error(f"--settings {args.settings}: a comma-separated list of {', '.join(SETTINGS)} with off among them")
    settings = {name: SETTINGS[name] for name in chosen}
    check_minimums(p, args, dict(max_tokens=2, rounds=1))
    set_threads(args.threads)
    engine = load_engine(args.model, device=args.device, dtype=args.dtype)
    texts = [x["text"] for x in round_robin_by_source(load_prompts(args.model, args.prompts), max(*levels, args.rounds))]

    results: dict[str, Any] = {}
    rows = []
    for k in ks:
        with Executor(engine, ExecutorConfig(num_draft_tokens=k, speculation="fixed",
                                             max_batch_size=max(levels), device=args.device)) as ex:
            ids = [ex.tokenizer.encode(t)[:64] for t in texts]
            ex.submit(ids[0], SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)).result()  # warm-up
            for c in levels:
                runs: dict[str, list[RequestOutput]] = {name: [] for name in settings}
                for r in range(args.rounds):
                    # each round its own prompts (the same for every setting): at concurrency 1 one prompt's
                    # acceptance would otherwise stand for all
                    prompts = [ids[(r * c + i) % len(ids)] for i in range(c)]
                    for name in (list(settings) if r % 2 == 0 else list(reversed(settings))):
                        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **settings[name])
                        runs[name] += [h.result() for h in [ex.submit(p, params) for p in prompts]]
                summary = {name: summarize(v) for name, v in runs.items()}
                base = summary["off"]["tpot_mean_s"]
                for name, s in summary.items():
                    s["tpot_over_off"] = ratio(s["tpot_mean_s"], base)
                    s["step_over_off"] = ratio(s["tpot_mean_s"] * s["tokens_per_step"],
                                               base * summary["off"]["tokens_per_step"])
                    rows.append([k, c, name, ms(s["tpot_mean_s"]), s["tpot_over_off"], s["acceptance_rate"],
                                 s["tokens_per_step"], s["step_over_off"]])
                if "logprobs" in runs:  # logprobs never change tokens: the same greedy outputs with and without them
                    summary["logprobs_keep_tokens"] = ([x.token_ids for x in runs["logprobs"]] ==
                                                       [x.token_ids for x in runs["off"]])
                results[f"k{k}_c{c}"] = summary
                print(f"k={k} c={c}: " + ", ".join(f"{n} {ms(s['tpot_mean_s']):.2f} ms ({s['tpot_over_off']:.3f}x)"
                                                   for n, s in summary.items() if isinstance(s, dict)))
    info = machine_info()
    md = [f"# Cost of {', '.join(n for n in settings if n != 'off')} under MTP"
          f"{' (quick smoke run)' if args.quick else ''}", "",
          f"Shipped model, greedy, {args.max_tokens} new tokens, prompts cut at 64 tokens, {args.rounds} rounds per "
          f"setting (order reversed every other round). "
          + "; ".join(f"`{n}`: {SETTING_TEXT[n]}" for n in settings if n != "off")
          + f". Target: TPOT with a feature on <= {TARGET_RATIO}x off.", "",
          "Penalties and a bias change the text, and with it the acceptance: 'step x off' (TPOT x tokens per step, "
          "over off's) is the cost of a step alone.", "",
          md_table(["k", "concurrency", "setting", "TPOT ms", "x off", "acceptance", "tokens/step", "step x off"], rows, 3),
          "",
          machine_md(info)]
    write_results(args.out_dir, args.name, {"settings": settings, "results": results, "machine": info,
                                            "args": vars(args)}, "\n".join(md))


if __name__ == "__main__":
    main()
