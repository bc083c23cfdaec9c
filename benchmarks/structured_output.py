"""Structured output under MTP: acceptance and TPOT with and without a JSON schema, for k = 0 and k = 1..3.

For each draft length (--ks, speculation "fixed"; 0 = plain decoding) and concurrency (--concurrency) one
executor serves rounds of held-out prompts, `concurrency` requests at a time, under each setting in turn
(the order reversed every other round, so drift of the machine falls on all alike): `free` (no guide:
greedy, ignore_eos, --max_tokens new tokens), `free_banned` (the same text with bos banned, a token never
drawn: the path a guided request takes, drafts one MTP call at a time with their rows' bans, without the
grammar; `free` drafts k > 1 in one fused call) and `json_schema` (the SCHEMA below: every token masked by
the grammar, drafts drawn within it; the output ends where the schema does). Reported per setting: TPOT
(vLLM's, on the server's clock, mean over requests), its ratio to k = 0 of the same setting (the MTP
speed-up), acceptance, tokens per step, output tokens, and for the schema the share of outputs that
json.loads parses and that are identical for every k (greedy output under a grammar does not depend on k),
and the grammar's own time per step (masks of a verification's k + 1 rows, the advance by a kept token).

  python -m benchmarks.structured_output             # full run
  python -m benchmarks.structured_output --quick     # smoke run
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from benchmarks.common import (add_common_args, check_minimums, comma_list, drafting_summary, load_prompts,
                               machine_info, machine_md, md_table, mean, ms, parse_with_quick, ratio,
                               round_robin_by_source, set_threads, write_results)
from runtime.core.grammar import grammar_bitmasks
from runtime.core.sampling_params import GuidedDecodingParams, SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.executors.outputs import RequestOutput
from runtime.io.loading import load_engine

# a record with three verses: long enough (~100 tokens) to measure, bounded so that every output ends
VERSE = {"type": "object", "additionalProperties": False, "required": ["book", "chapter", "text"],
         "properties": {"book": {"type": "string", "maxLength": 16},
                        "chapter": {"type": "integer", "minimum": 1, "maximum": 150},
                        "text": {"type": "string", "maxLength": 60}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "verses"],
          "properties": {"title": {"type": "string", "maxLength": 40},
                         "verses": {"type": "array", "items": VERSE, "minItems": 3, "maxItems": 3}}}


def settings(max_tokens: int, never_drawn: int) -> dict[str, SamplingParams]:
    return {"free": SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            "free_banned": SamplingParams(max_tokens=max_tokens, ignore_eos=True, bad_token_ids=(never_drawn,)),
            "json_schema": SamplingParams(max_tokens=max_tokens, guided_decoding=GuidedDecodingParams(json=SCHEMA))}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def mask_cost(ex: Executor, output: list[int], k: int) -> dict[str, float]:
    """Microseconds the grammar takes per step along a schema output: the masks of k + 1 rows after k drafts (a
    verification's; the drafts are the output's next tokens) and the advance by the kept token."""
    matcher = ex.grammars.matcher(GuidedDecodingParams(json=SCHEMA))
    masks = advance = 0.0
    for i, token in enumerate(output):
        t0 = time.perf_counter()
        grammar_bitmasks([matcher], [output[i : i + k]], 0, k + 1)
        t1 = time.perf_counter()
        matcher.advance([token])
        masks, advance = masks + t1 - t0, advance + time.perf_counter() - t1
    return {"masks_us_per_step": masks / len(output) * 1e6, "advance_us_per_token": advance / len(output) * 1e6}


def summarize(outs: list[RequestOutput]) -> dict[str, Any]:
    return {**drafting_summary(outs), "tpot_mean_s": mean(o.stats.tpot_s for o in outs),
            "output_tokens_mean": mean(o.stats.output_tokens for o in outs),
            "parsed": sum(_parses(o.text) for o in outs) / len(outs)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--prompts", help="prompts JSON (default: <model>/heldout_prompts.json)")
    p.add_argument("--ks", default="0,1,2,3", help="draft lengths (0 = plain decoding)")
    p.add_argument("--concurrency", default="1,4", help="requests served together")
    p.add_argument("--max_tokens", type=int, default=160)
    p.add_argument("--rounds", type=int, default=3, help="rounds per setting (each round: one request per slot)")
    p.add_argument("--name", default="structured_output")
    args = parse_with_quick(p, argv, dict(rounds=1, ks="0,2", concurrency="1"))
    ks, levels = comma_list(p, "--ks", args.ks), comma_list(p, "--concurrency", args.concurrency)
    check_minimums(p, args, dict(max_tokens=2, rounds=1))
    set_threads(args.threads)
    engine = load_engine(args.model, device=args.device, dtype=args.dtype)
    texts = [x["text"] for x in round_robin_by_source(load_prompts(args.model, args.prompts), max(levels))]
    setting_params = settings(args.max_tokens, engine.model_config.bos_token_id)

    results: dict[str, Any] = {}
    outputs: dict[int, list[list[int]]] = {}  # per concurrency: the schema outputs of the first k
    costs: list[list[Any]] = []
    for k in ks:
        with Executor(engine, ExecutorConfig(num_draft_tokens=k, speculation="fixed",
                                             max_batch_size=max(levels), device=args.device)) as ex:
            ids = [ex.tokenizer.encode(t)[:64] for t in texts]
            for params in setting_params.values():  # warm-up (and the schema's compilation)
                ex.submit(ids[0], params).result()
            for c in levels:
                prompts = [ids[i % len(ids)] for i in range(c)]
                runs: dict[str, list[RequestOutput]] = {name: [] for name in setting_params}
                for r in range(args.rounds):
                    for name in (setting_params if r % 2 == 0 else reversed(setting_params)):
                        runs[name] += [h.result() for h in [ex.submit(p, setting_params[name]) for p in prompts]]
                summary = {name: summarize(v) for name, v in runs.items()}
                schema_ids = [x.token_ids for x in runs["json_schema"]]
                summary["json_schema"]["same_as_first_k"] = schema_ids == outputs.setdefault(c, schema_ids)
                summary["json_schema"].update(mask_cost(ex, schema_ids[0], k))
                results[f"k{k}_c{c}"] = summary
                print(f"k={k} c={c}: " + ", ".join(
                    f"{n} {ms(s['tpot_mean_s']):.2f} ms acc {s['acceptance_rate'] or 0:.2f}" for n, s in summary.items()))
                costs.append([k, c, summary["json_schema"]["masks_us_per_step"],
                              summary["json_schema"]["advance_us_per_token"]])
    rows = []
    for key, summary in results.items():
        k, c = (int(x[1:]) for x in key.split("_"))
        for name, s in summary.items():
            s["tpot_over_k0"] = ratio(s["tpot_mean_s"], results[f"k{ks[0]}_c{c}"][name]["tpot_mean_s"])
            rows.append([k, c, name, ms(s["tpot_mean_s"]), s["tpot_over_k0"], s["acceptance_rate"],
                         s["tokens_per_step"], s["output_tokens_mean"],
                         s["parsed"] if name == "json_schema" else "-",
                         s.get("same_as_first_k", "-")])
    info = machine_info()
    md = [f"# Structured output under MTP{' (quick smoke run)' if args.quick else ''}", "",
          f"Shipped model, greedy, prompts cut at 64 tokens, {args.rounds} rounds per setting (order reversed every "
          f"other round). `free`: no guide, ignore_eos, {args.max_tokens} new tokens. `free_banned`: the same text with "
          "bos banned (never drawn): the unfused drafting path guided requests take (each draft's mask depends on the "
          "draft before it), without a grammar. `json_schema`: the schema in "
          "benchmarks/structured_output.py (a title and three verses), every token masked by its grammar, drafts "
          "drawn within it; the output ends where the schema does.", "",
          f"'x k={ks[0]}' is the TPOT over k = {ks[0]}'s in the same setting and concurrency (below 1: MTP is faster). "
          "'parsed': share of outputs json.loads reads; 'same for every k': greedy output identical to the first k's.",
          "",
          md_table(["k", "concurrency", "setting", "TPOT ms", f"x k={ks[0]}", "acceptance", "tokens/step",
                    "output tokens", "parsed", "same for every k"], rows, 3),
          "",
          "The grammar's own cost per step along a schema output (llguidance on the host): the k + 1 masks of a "
          "verification after k drafts (as bool rows over the vocabulary), and the advance by a kept token.", "",
          md_table(["k", "concurrency", "masks us/step", "advance us/token"], costs, 1),
          "",
          machine_md(info)]
    write_results(args.out_dir, args.name, {"schema": SCHEMA, "results": results, "machine": info,
                                            "args": vars(args)}, "\n".join(md))


if __name__ == "__main__":
    main()
