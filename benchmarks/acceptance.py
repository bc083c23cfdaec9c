"""How well the MTP layer drafts for the main model, on held-out text only (numbers for the model card).

1. free-running: greedy generation from the held-out prompts with MTP drafting at k=1 (speculation
   fixed): acceptance rate = accepted drafts / drafts, tokens per step; per source; and on the
   half of the requests whose output repeats itself least (repetition inflates acceptance);
2. held-out prompt texts: main CE (next token) and MTP CE (token after next), teacher-forced;
3. with --val_bin (uint16 token files from prepare_data, e.g. data/val.bin or data/val_*.bin):
   main and MTP CE, main top-1 accuracy, MTP top-1 accuracy against the true token t+2, and the
   teacher-forced MTP agreement with the main model's greedy choice at t+2 (the acceptance the
   MTP would get if the context were the true text).

  python -m benchmarks.acceptance --val_bin data/val.bin
  python -m benchmarks.acceptance --quick
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (add_common_args, check_minimums, comma_list, engine_info, load_prompts, machine_info,
                               machine_md, md_table, mean, parse_with_quick, round_robin_by_source, set_threads,
                               write_results)

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from runtime.io.loading import load_engine
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.core.sampling_params import SamplingParams


def repeated_ngram_fraction(context: list[int], output: list[int], n: int = 4) -> float:
    """Fraction of the output's n-grams already seen earlier in prompt + output."""
    seq = context + output
    seen, rep, total = set(), 0, 0
    for i in range(len(seq) - n + 1):
        g = tuple(seq[i:i + n])
        if i + n > len(context):
            total += 1
            rep += g in seen
        seen.add(g)
    return rep / total if total else 0.0


def free_running(engine, prompts: list[dict[str, str]], k: int, max_tokens: int, batch: int,
                 ignore_eos: bool, device: str = "cpu") -> dict[str, Any]:
    with Executor(engine, ExecutorConfig(num_draft_tokens=k, speculation="fixed", max_batch_size=batch,
                                         device=device)) as ex:
        ids = [ex.tokenizer.encode(p["text"]) for p in prompts]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        bar = tqdm(total=len(ids), desc=f"free-running k={k}", dynamic_ncols=True)
        handles = [ex.submit(i, params, on_output=lambda o: o.finished and bar.update(1)) for i in ids]
        outs = [h.result() for h in handles]
        bar.close()
    per = []
    for p, i, o in zip(prompts, ids, outs):
        s = o.stats
        per.append({"source": p["source"], "prompt_tokens": len(i), "output_tokens": s.output_tokens,
                    "draft_tokens": s.num_draft_tokens, "accepted": s.num_accepted_draft_tokens,
                    "acceptance_rate": s.acceptance_rate, "num_steps": s.num_steps,
                    "repeated_4gram_fraction": repeated_ngram_fraction(i, o.token_ids),
                    "finish_reason": o.finish_reason})

    def agg(rows: list[dict[str, Any]]) -> dict[str, Any]:
        d = sum(r["draft_tokens"] for r in rows)
        a = sum(r["accepted"] for r in rows)
        out = sum(r["output_tokens"] for r in rows)
        steps = sum(r["num_steps"] for r in rows)
        return {"requests": len(rows), "draft_tokens": d, "accepted_draft_tokens": a,
                "acceptance_rate": a / d if d else None,
                "decode_tokens_per_step": out / steps if steps else None,  # steps that emitted tokens
                "repeated_4gram_fraction": mean(r["repeated_4gram_fraction"] for r in rows)}

    by_rep = sorted(per, key=lambda r: r["repeated_4gram_fraction"])
    sources = sorted({r["source"] for r in per})
    return {"k": k, "max_tokens": max_tokens, "ignore_eos": ignore_eos, "overall": agg(per),
            "least_repetitive_half": agg(by_rep[: max(len(by_rep) // 2, 1)]),
            "most_repetitive_half": agg(by_rep[len(by_rep) // 2:]) if len(by_rep) > 1 else None,
            "by_source": {s: agg([r for r in per if r["source"] == s]) for s in sources},
            "per_request": per}


@torch.inference_mode()
def teacher_forced(model, windows: list[torch.Tensor], desc: str) -> dict[str, Any]:
    """windows: [B, S+2] token chunks. Sums over every position, then token-weighted means.

    Both heads are scored on the same targets t_2..t_S of each window (the main model at positions
    1..S-1, the MTP layer at 0..S-2), so their losses and accuracies compare; the first target of a
    window (right after its start) is the hardest and only the main model could be scored on it.
    """
    sums = dict(main_nll=0.0, mtp_nll=0.0, main_correct=0, mtp_correct=0, agree=0)
    n = 0
    device = next(model.parameters()).device
    for chunk in tqdm(windows, desc=desc, dynamic_ncols=True):
        chunk = chunk.to(device)
        x, y = chunk[:, :-2], chunk[:, 1:-1]
        hidden = model(x)
        logits = model.logits(hidden).float()[:, 1:]
        mtp_logits = model.mtp_forward(0, y, hidden)[0].float()[:, :-1]
        target = chunk[:, 2:-1]
        sums["main_nll"] += F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum").item()
        sums["mtp_nll"] += F.cross_entropy(mtp_logits.flatten(0, 1), target.flatten(), reduction="sum").item()
        main_pred, mtp_pred = logits.argmax(-1), mtp_logits.argmax(-1)
        sums["main_correct"] += (main_pred == target).sum().item()
        sums["mtp_correct"] += (mtp_pred == target).sum().item()
        # MTP at i drafts t_{i+2}; the main model decides t_{i+2} at position i+1 (true prefix).
        sums["agree"] += (mtp_pred == main_pred).sum().item()
        n += target.numel()
    if n == 0:
        raise SystemExit(f"{desc}: no window of at least 4 tokens to score")
    return {"tokens": n,
            "main_loss": sums["main_nll"] / n, "mtp_loss": sums["mtp_nll"] / n,
            "main_ppl": math.exp(sums["main_nll"] / n),
            "main_top1_accuracy": sums["main_correct"] / n,
            "mtp_top1_accuracy": sums["mtp_correct"] / n,
            "mtp_agreement_with_main": sums["agree"] / n}


def val_windows(path: Path, seq_len: int, batch: int, max_tokens: int) -> list[torch.Tensor]:
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    if max_tokens:
        tokens = tokens[: max_tokens + 2]
    n = (len(tokens) - 2) // seq_len
    rows = [torch.from_numpy(np.array(tokens[i * seq_len: i * seq_len + seq_len + 2], dtype=np.int64)) for i in range(n)]
    return [torch.stack(rows[i:i + batch]) for i in range(0, len(rows), batch)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--prompts", help="prompts JSON (default: <model>/heldout_prompts.json)")
    p.add_argument("--num_prompts", type=int, default=40)
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("--ks", default="1", help="draft lengths for the free-running measurement (k=1 is the headline)")
    p.add_argument("--batch", type=int, default=8, help="executor max_batch_size (acceptance does not depend on it)")
    p.add_argument("--stop_at_eos", action="store_true", help="let generation stop at EOS (default: ignore_eos)")
    p.add_argument("--val_bin", type=Path, nargs="*", default=[], help="uint16 validation token files")
    p.add_argument("--val_tokens", type=int, default=0, help="evaluate at most this many tokens per file (0: all)")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--eval_batch", type=int, default=8)
    p.add_argument("--name", default="acceptance")
    args = parse_with_quick(p, None, dict(num_prompts=4, max_tokens=16, val_tokens=1024, seq_len=128))
    ks = comma_list(p, "--ks", args.ks)
    if min(ks) < 1:
        p.error(f"--ks: draft lengths must be >= 1 (acceptance needs drafts), got {args.ks!r}")
    check_minimums(p, args, dict(num_prompts=1, max_tokens=1, batch=1, seq_len=2, eval_batch=1, val_tokens=0))
    set_threads(args.threads)
    t_start = time.perf_counter()
    prompts = round_robin_by_source(load_prompts(args.model, args.prompts), args.num_prompts)
    engine = load_engine(args.model, device=args.device, dtype=args.dtype)
    if engine.model_config.num_nextn_predict_layers == 0:
        raise SystemExit(f"{args.model} has no MTP layer")
    info = machine_info()
    model = engine.model

    free = {f"k{k}": free_running(engine, prompts, k, args.max_tokens, args.batch, not args.stop_at_eos, args.device)
            for k in ks}

    from runtime.io.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(engine.path)
    text_windows = [torch.tensor([tok.encode(x["text"])]) for x in prompts]
    heldout = teacher_forced(model, [w for w in text_windows if w.shape[1] >= 4], "held-out prompt texts")

    val = {}
    for path in args.val_bin:
        if not path.is_file():
            raise SystemExit(f"--val_bin {path}: no such file")
        windows = val_windows(path, args.seq_len, args.eval_batch, args.val_tokens)
        if not windows:
            raise SystemExit(f"--val_bin {path}: fewer than --seq_len + 2 = {args.seq_len + 2} tokens"
                             + (f" in its first --val_tokens {args.val_tokens} + 2" if args.val_tokens else ""))
        val[str(path)] = teacher_forced(model, windows, f"teacher-forced {path.name}")
        val[str(path)]["seq_len"] = args.seq_len

    head = free[f"k{ks[0]}"]["overall"]
    headline_val = {}
    if val:  # the first --val_bin file is the headline
        f, v = next(iter(val.items()))
        headline_val = {"val_file": f, "val_main_loss": v["main_loss"], "val_mtp_loss": v["mtp_loss"],
                        "val_mtp_top1_accuracy": v["mtp_top1_accuracy"],
                        "val_mtp_agreement_with_main": v["mtp_agreement_with_main"]}
    results = {
        "benchmark": "acceptance", "quick": args.quick,
        "mtp_acceptance_rate": head["acceptance_rate"], "mtp_acceptance_k": ks[0],
        "decode_tokens_per_step": head["decode_tokens_per_step"],
        "heldout_main_loss": heldout["main_loss"], "heldout_mtp_loss": heldout["mtp_loss"],
        **headline_val,
        "settings": {"num_prompts": len(prompts), "max_tokens": args.max_tokens, "ks": ks, "greedy": True,
                     "ignore_eos": not args.stop_at_eos, "batch": args.batch, "val_tokens": args.val_tokens,
                     "seq_len": args.seq_len},
        "free_running": free, "heldout_texts": heldout, "val": val,
        "seconds": time.perf_counter() - t_start, "machine": info, "engine": engine_info(engine)}

    md = [f"# MTP acceptance on held-out text{' (quick smoke run)' if args.quick else ''}", "",
          f"Model `{args.model}`; {len(prompts)} held-out prompts, {args.max_tokens} greedy tokens each "
          f"({'ignore_eos' if not args.stop_at_eos else 'stop at EOS'}), speculation fixed.", "",
          "## Free-running acceptance", "",
          md_table(["k", "slice", "requests", "acceptance", "tokens/step", "repeated 4-grams"],
                   [[f["k"], name, f[key]["requests"], f[key]["acceptance_rate"], f[key]["decode_tokens_per_step"],
                     f[key]["repeated_4gram_fraction"]]
                    for f in free.values()
                    for name, key in (("all", "overall"), ("least repetitive half", "least_repetitive_half"),
                                      ("most repetitive half", "most_repetitive_half")) if f[key]], digits=3), "",
          md_table(["k", "source", "requests", "acceptance", "tokens/step"],
                   [[f["k"], s, v["requests"], v["acceptance_rate"], v["decode_tokens_per_step"]]
                    for f in free.values() for s, v in f["by_source"].items()], digits=3), "",
          "## Teacher-forced (true text as context)", "",
          md_table(["text", "tokens", "main CE", "MTP CE", "main top-1", "MTP top-1 (t+2)", "MTP = main greedy"],
                   [["held-out prompt texts", heldout["tokens"], heldout["main_loss"], heldout["mtp_loss"],
                     heldout["main_top1_accuracy"], heldout["mtp_top1_accuracy"], heldout["mtp_agreement_with_main"]]]
                   + [[Path(f).name, v["tokens"], v["main_loss"], v["mtp_loss"], v["main_top1_accuracy"],
                       v["mtp_top1_accuracy"], v["mtp_agreement_with_main"]] for f, v in val.items()], digits=3), "",
          "CE in nats per token. 'MTP = main greedy': the MTP's argmax for t+2 (from the true t+1 and the "
          "main model's hidden state at t) equals the main model's argmax at t+1, i.e. the draft would be "
          "accepted under greedy verification if the context were the true text.", "",
          f"Total {results['seconds']:.0f} s.", "", "## Machine", "", machine_md(info)]
    js, mdp = write_results(args.out_dir, args.name, results, "\n".join(md))
    summary = {k: v for k, v in results.items()
               if k.startswith(("mtp_", "decode_", "heldout_", "val_")) and not isinstance(v, dict)}
    for k, v in summary.items():
        print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    print(f"wrote {js} and {mdp}")


if __name__ == "__main__":
    main()
