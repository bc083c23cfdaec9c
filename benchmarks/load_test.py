"""Load test of the in-flight batching executor: many requests of random prompt and output lengths
at high concurrency must all complete, give exactly the greedy tokens of a request run alone,
and leave every KV block free. Exits non-zero on any failure; bounded by --timeout.

1. reference: every request alone on a separate plain executor (k 0, max_batch_size 1);
2. for each mode (plain / fixed-k MTP / adaptive MTP): all requests through C closed-loop
   clients on an executor with max_batch_size C and a small max_num_tokens (so prompts are
   prefilled in chunks next to running decodes); compare tokens and finish reasons with the
   reference; check the executor is empty and its KV blocks all free.

  python -m benchmarks.load_test                 # 200 requests at concurrency 32
  python -m benchmarks.load_test --quick         # smoke run
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from typing import Any

from benchmarks.common import (add_common_args, check_minimums, closed_loop_clients, engine_info, load_prompts,
                               machine_info, machine_md, md_table, mean, parse_with_quick, percentile, set_threads,
                               write_results)

import torch
from tqdm import tqdm

from runtime.io.loading import load_engine
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.core.sampling_params import SamplingParams


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(self.end - time.monotonic(), 0.0)

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.end


def make_requests(texts: list[dict[str, str]], tok, n: int, max_prompt: int, max_output: int,
                  seed: int) -> list[dict[str, Any]]:
    """Prompts: the start of a shuffled concatenation of held-out texts, 1..max_prompt tokens
    (bos first); outputs: 1..max_output tokens; half of them stop at EOS or at a newline (a stop
    string, so speculative steps that emit several tokens past it are cut), half run to max_tokens."""
    rng = random.Random(seed)
    pieces = [tok.encode(x["text"]) for x in texts]
    bos = tok.bos_token_id
    reqs = []
    for i in range(n):
        order = rng.sample(range(len(pieces)), len(pieces))
        stream = [t for j in order for t in pieces[j] if t != bos]
        length = rng.randint(1, max_prompt)
        ids = ([bos] if bos is not None else []) + stream[: length - (bos is not None)]
        reqs.append({"id": i, "prompt_ids": ids[:max(length, 1)], "max_tokens": rng.randint(1, max_output),
                     "stops": rng.random() < 0.5})
    return reqs


def params_of(r: dict[str, Any]) -> SamplingParams:
    return SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=not r["stops"],
                          stop=("\n",) if r["stops"] else ())


def run_reference(engine, reqs: list[dict[str, Any]], deadline: Deadline,
                  device: str = "cpu") -> tuple[list[dict] | None, str | None]:
    out: list[dict] = []
    with Executor(engine, ExecutorConfig(num_draft_tokens=0, speculation="off", max_batch_size=1, device=device)) as ex:
        for r in tqdm(reqs, desc="reference (one at a time)", dynamic_ncols=True):
            try:
                o = ex.submit(r["prompt_ids"], params_of(r)).result(timeout=deadline.left())
            except TimeoutError:
                return None, f"timed out in the reference pass after {len(out)} requests"
            out.append({"token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason})
    return out, None


def run_mode(engine, name: str, cfg: ExecutorConfig, reqs: list[dict[str, Any]], concurrency: int,
             deadline: Deadline) -> dict[str, Any]:
    results: list[Any] = [None] * len(reqs)
    errors: list[str] = []
    bar = tqdm(total=len(reqs), desc=f"{name} (C={concurrency})", dynamic_ncols=True)
    ex = Executor(engine, cfg)
    peak = {"kv_blocks_used": 0, "running": 0}
    stop_sampling = threading.Event()

    def sampler() -> None:
        while not stop_sampling.wait(0.05):
            s = ex.stats()
            peak["kv_blocks_used"] = max(peak["kv_blocks_used"], s.kv_blocks_used)
            peak["running"] = max(peak["running"], s.running)

    def send(i: int) -> bool:
        if deadline.passed:
            return False
        try:
            t0 = time.perf_counter()
            o = ex.submit(reqs[i]["prompt_ids"], params_of(reqs[i])).result(timeout=deadline.left())
            results[i] = (o, time.perf_counter() - t0)
        except Exception as e:
            errors.append(f"request {i}: {type(e).__name__}: {e}")
        bar.update(1)
        return True

    mon = threading.Thread(target=sampler, daemon=True)
    mon.start()
    t0 = time.perf_counter()
    closed_loop_clients(len(reqs), concurrency, send, join_until=time.perf_counter() + deadline.left() + 5)
    wall = time.perf_counter() - t0
    stop_sampling.set()
    bar.close()
    time.sleep(0.2)  # let the step loop drain its inbox (cancelled/finished bookkeeping)
    end = ex.stats()
    blocks_total = ex.cache.allocator.num_blocks
    free_list_intact = ex.cache.allocator.all_free()
    ex.shutdown()
    return {"results": results, "errors": errors, "wall_s": wall, "peak": peak,
            "end_stats": {"running": end.running, "queued": end.queued, "kv_blocks_used": end.kv_blocks_used,
                          "kv_blocks_free": end.kv_blocks_free, "kv_blocks_total": blocks_total,
                          "free_list_intact": free_list_intact,
                          "requests_finished": end.requests_finished, "generated_tokens": end.generated_tokens,
                          "draft_tokens": end.draft_tokens, "accepted_draft_tokens": end.accepted_draft_tokens}}


@torch.inference_mode()
def divergence_margin(model, prompt: list[int], ref: list[int], got: list[int]) -> dict[str, Any]:
    """Where two greedy outputs part, and how close the reference's choice was (dense forward,
    teacher-forced on the shared prefix): a tiny logit gap means a numerical near-tie."""
    j = 0
    while j < min(len(ref), len(got)) and ref[j] == got[j]:
        j += 1
    info: dict[str, Any] = {"first_divergence": j, "reference_len": len(ref), "got_len": len(got)}
    if j < len(ref) and j < len(got):
        ids = torch.tensor([prompt + ref[:j]], device=next(model.parameters()).device)
        logits = model.logits(model(ids))[0, -1].float()
        top = logits.topk(2)
        info |= {"reference_token": ref[j], "got_token": got[j],
                 "logit_reference": logits[ref[j]].item(), "logit_got": logits[got[j]].item(),
                 "top2_gap": (top.values[0] - top.values[1]).item(),
                 "dense_argmax": int(top.indices[0])}
    return info


MODES = ("plain", "fixed", "adaptive")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (argparse's one-line error naming the flag, exit status 2); adds .modes_list."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--prompts", help="prompts JSON (default: <model>/heldout_prompts.json)")
    p.add_argument("--num_requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--modes", default="plain,fixed,adaptive",
                   help=f"executors under load (comma-separated, of {', '.join(MODES)})")
    p.add_argument("--k", type=int, default=3, help="draft length of the fixed mode")
    p.add_argument("--adaptive_k", type=int, default=4)
    p.add_argument("--max_prompt_tokens", type=int, default=320)
    p.add_argument("--max_output_tokens", type=int, default=128)
    p.add_argument("--max_num_tokens", type=int, default=256,
                   help="token budget per step under load (small: long prompts prefill in chunks beside decodes)")
    p.add_argument("--kv_cache_tokens", type=int, default=None,
                   help="KV capacity under load (small values force preemption and recompute)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds for the whole test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="load_test")
    args = parse_with_quick(p, argv, dict(num_requests=12, concurrency=4, max_prompt_tokens=96, max_output_tokens=16,
                                          max_num_tokens=48))
    args.modes_list = [m for m in args.modes.split(",") if m]
    if not args.modes_list or any(m not in MODES for m in args.modes_list):
        p.error(f"--modes: expected comma-separated modes of {', '.join(MODES)}, got {args.modes!r}")
    drafting = {flag: 1 for flag, mode in (("k", "fixed"), ("adaptive_k", "adaptive")) if mode in args.modes_list}
    cache = {"kv_cache_tokens": 1} if args.kv_cache_tokens is not None else {}
    check_minimums(p, args, dict(num_requests=1, concurrency=1, max_prompt_tokens=1, max_output_tokens=1,
                                 max_num_tokens=1, **cache, **drafting))
    if not args.timeout > 0:
        p.error(f"--timeout: must be > 0 seconds, got {args.timeout}")
    return args


def main() -> int:
    args = parse_args()
    set_threads(args.threads)
    deadline = Deadline(args.timeout)
    t_start = time.perf_counter()
    modes = args.modes_list

    engine = load_engine(args.model, device=args.device, dtype=args.dtype)
    texts = load_prompts(args.model, args.prompts)
    from runtime.io.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(engine.path)
    reqs = make_requests(texts, tok, args.num_requests, args.max_prompt_tokens, args.max_output_tokens, args.seed)
    info = machine_info()
    failures: list[str] = []

    reference, err = run_reference(engine, reqs, deadline, args.device)
    if err:
        failures.append(err)
    t_ref = time.perf_counter() - t_start

    configs = {"plain": dict(num_draft_tokens=0, speculation="off"),
               "fixed": dict(num_draft_tokens=args.k, speculation="fixed"),
               "adaptive": dict(num_draft_tokens=args.adaptive_k, speculation="adaptive")}
    mode_results: dict[str, Any] = {}
    for m in modes if reference is not None else []:
        if deadline.passed:
            failures.append(f"{m}: not run, the --timeout of {args.timeout} s had passed")
            continue
        cfg = ExecutorConfig(**configs[m], max_batch_size=args.concurrency, max_num_tokens=args.max_num_tokens,
                             kv_cache_tokens=args.kv_cache_tokens, device=args.device)
        run = run_mode(engine, m, cfg, reqs, args.concurrency, deadline)
        mism, incomplete, bad_reason = [], [], []
        for r, res, ref in zip(reqs, run["results"], reference):
            if res is None:
                incomplete.append(r["id"])
                continue
            o, _ = res
            if o.finish_reason not in ("stop", "length"):
                bad_reason.append({"id": r["id"], "finish_reason": o.finish_reason})
            if o.token_ids != ref["token_ids"] or o.text != ref["text"] or o.finish_reason != ref["finish_reason"]:
                d = divergence_margin(engine.model, r["prompt_ids"], ref["token_ids"], o.token_ids)
                mism.append({"id": r["id"], "prompt_tokens": len(r["prompt_ids"]), "max_tokens": r["max_tokens"],
                             "finish_reason": o.finish_reason, "reference_finish_reason": ref["finish_reason"], **d})
        done = [res for res in run["results"] if res is not None]
        stats = [o.stats for o, _ in done]
        es = run["end_stats"]
        checks = {
            "all_completed": not incomplete and not run["errors"],
            "outputs_equal_reference": not mism,
            "finish_reasons_ok": not bad_reason,
            "kv_blocks_all_free": es["kv_blocks_used"] == 0 and es["kv_blocks_free"] == es["kv_blocks_total"]
                                  and es["free_list_intact"],
            "executor_empty": es["running"] == 0 and es["queued"] == 0,
        }
        for c, ok in checks.items():
            if not ok:
                failures.append(f"{m}: {c} failed")
        drafted = sum(s.num_draft_tokens for s in stats)
        out_tokens = sum(s.output_tokens for s in stats)
        mode_results[m] = {
            "config": {**configs[m], "max_batch_size": args.concurrency, "max_num_tokens": args.max_num_tokens,
                       "kv_cache_tokens": args.kv_cache_tokens},
            "checks": checks, "completed": len(done), "incomplete": incomplete, "errors": run["errors"][:20],
            "mismatches": mism, "bad_finish_reasons": bad_reason, "wall_s": run["wall_s"],
            "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / run["wall_s"] if run["wall_s"] else None,
            "tpot_mean_s": mean(s.tpot_s for s in stats), "ttft_mean_s": mean(s.ttft_s for s in stats),
            "ttft_p99_s": percentile([s.ttft_s for s in stats], 99),
            "latency_p99_s": percentile([lat for _, lat in done], 99),
            "acceptance_rate": sum(s.num_accepted_draft_tokens for s in stats) / drafted if drafted else None,
            "peak": run["peak"], "end_stats": es}
        print(f"{m}: {len(done)}/{len(reqs)} completed, {len(mism)} mismatches, end KV blocks used "
              f"{es['kv_blocks_used']}/{es['kv_blocks_total']}, {run['wall_s']:.1f} s")

    ok = not failures
    results = {
        "benchmark": "load_test", "quick": args.quick, "passed": ok, "failures": failures,
        "settings": {"num_requests": args.num_requests, "concurrency": args.concurrency, "modes": modes,
                     "fixed_k": args.k, "adaptive_k": args.adaptive_k, "max_prompt_tokens": args.max_prompt_tokens,
                     "max_output_tokens": args.max_output_tokens, "max_num_tokens": args.max_num_tokens,
                     "kv_cache_tokens": args.kv_cache_tokens, "timeout_s": args.timeout, "seed": args.seed,
                     "greedy": True,
                     "prompt_tokens_mean": mean(len(r["prompt_ids"]) for r in reqs),
                     "max_tokens_mean": mean(r["max_tokens"] for r in reqs),
                     "stopping_fraction": mean(float(r["stops"]) for r in reqs)},
        "reference": {"executor": "plain (k 0), max_batch_size 1, one request at a time", "seconds": t_ref,
                      "finish_reasons": {fr: sum(1 for x in reference or [] if x["finish_reason"] == fr)
                                         for fr in ("stop", "length")}},
        "modes": mode_results, "total_seconds": time.perf_counter() - t_start,
        "machine": info, "engine": engine_info(engine)}

    finish = results["reference"]["finish_reasons"]
    mode_names = [{"plain": "plain", "fixed": f"fixed k={args.k}", "adaptive": f"adaptive k<={args.adaptive_k}"}[m]
                  for m in modes]
    rows = [[m, f"{r['completed']}/{args.num_requests}", len(r["mismatches"]), r["checks"]["kv_blocks_all_free"],
             r["checks"]["executor_empty"], r["peak"]["kv_blocks_used"], r["peak"]["running"], r["wall_s"],
             r["output_tokens_per_s"], r["tpot_mean_s"] * 1e3 if r["tpot_mean_s"] else None,
             r["ttft_p99_s"], r["acceptance_rate"]] for m, r in mode_results.items()]
    md = [f"# Load test{' (quick smoke run)' if args.quick else ''}: {'PASSED' if ok else 'FAILED'}", "",
          f"{args.num_requests} greedy requests, prompts 1-{args.max_prompt_tokens} tokens (mean "
          f"{results['settings']['prompt_tokens_mean']:.0f}), outputs 1-{args.max_output_tokens} tokens (half may "
          f"stop at EOS or a newline stop string; in the reference {finish['stop']} stopped, {finish['length']} ran to "
          f"max_tokens), {args.concurrency} closed-loop clients, max_num_tokens {args.max_num_tokens} per step; every "
          f"output compared token for token (and text) with the same request run alone on a plain executor "
          f"(max_batch_size 1, {t_ref:.0f} s). Modes: {', '.join(mode_names)}. KV blocks all free: every block on "
          f"the free list exactly once.", "",
          md_table(["mode", "completed", "mismatches", "KV blocks all free", "executor empty", "peak KV blocks",
                    "peak running", "wall s", "output tok/s", "TPOT ms", "TTFT p99 s", "acceptance"], rows)]
    for m, r in mode_results.items():
        if r["mismatches"]:
            md += ["", f"Mismatches in {m} (top-2 logit gap at the divergence, dense teacher-forced forward):", "",
                   md_table(["id", "prompt", "diverges at", "ref token", "got token", "top-2 gap", "finish/ref"],
                            [[x["id"], x["prompt_tokens"], x["first_divergence"], x.get("reference_token"),
                              x.get("got_token"), x.get("top2_gap"), f"{x['finish_reason']}/{x['reference_finish_reason']}"]
                             for x in r["mismatches"][:20]], digits=5)]
    if failures:
        md += ["", "## Failures", "", *[f"- {f}" for f in failures]]
    md += ["", f"Total {results['total_seconds']:.0f} s (timeout {args.timeout:.0f} s).", "", "## Machine", "",
           machine_md(info)]
    js, mdp = write_results(args.out_dir, args.name, results, "\n".join(md))
    print("\n".join(md[:5]))
    print(("PASSED" if ok else "FAILED: " + "; ".join(failures)) + f"  ({js}, {mdp})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
