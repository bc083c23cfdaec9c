"""In-flight batching under load: plain decoding vs fixed-k MTP vs adaptive MTP, side by side.

Two sweeps over the same requests (held-out prompts, greedy, ignore_eos, output lengths drawn
uniformly from [--min_tokens, --max_tokens]), every mode on its own executor, modes interleaved
level by level so slow drift on the machine hits all of them alike:
- closed loop: C clients, each sending its next request when the previous one finishes, for
  C in --concurrency (N = max(--num_requests, --requests_per_client x C) requests per level, so
  the start-up burst and the drain at the end are a small part of each level), --rounds times with
  the modes' order reversed every other round, so no mode always runs first;
- open loop: Poisson arrivals at each QPS (like vLLM's serving table); by default the rates are
  fractions of the plain mode's best request throughput in the closed-loop sweep.
Reported per level and mode: mean/p50/p99 TPOT, mean/p99 TTFT, output tokens/s, request
throughput, acceptance, drafts per decode step; ratios against plain; a PNG plot. TTFT and TPOT are
vLLM's (benchmarks/benchmark_serving.py), taken on the client's clock: TTFT = first token - send,
TPOT = (latency - TTFT) / (output tokens - 1) per request (1-token requests left out), then averaged;
output tokens/s = the level's output tokens / its wall time (first send to last finish).

  python -m benchmarks.serving            # full run
  python -m benchmarks.serving --quick    # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import threading
import time
from typing import Any

from benchmarks.common import (add_common_args, check_minimums, closed_loop_clients, comma_list, engine_info,
                               load_prompts, machine_info, machine_md, md_table, mean, ms, parse_with_quick, percentile,
                               ratio, request_ttft_tpot, save_figure, set_threads, target_line, write_results)

from tqdm import tqdm

from runtime.io.loading import load_engine
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.executors.outputs import FAILED_REASONS, RequestOutput
from runtime.core.sampling_params import SamplingParams

MODE_ORDER = ("plain", "fixed", "adaptive")
QUICK_DEFAULTS = dict(concurrency="1,4", num_requests=4, requests_per_client=2, qps_fractions="0.5", qps_requests=4,
                      min_tokens=8, max_tokens=16)
CANCEL_WAIT_S = 30.0  # how long a timed-out Poisson level waits for its cancelled requests to end
Records = list[dict[str, Any] | None]  # a level's per-request records in request order; None: not finished


def make_requests(prompt_ids: list[list[int]], n: int, lo: int, hi: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [(prompt_ids[rng.randrange(len(prompt_ids))], rng.randint(lo, hi)) for _ in range(n)]


class _Collector:
    """Per-request records; first-token and finish times taken in the executor thread when the first
    output with tokens and the last output land (the client's clock, as vLLM's benchmark times them)."""

    def __init__(self, n: int, bar: tqdm | None):
        self.records: Records = [None] * n
        self.finished = threading.Event()
        self._left = n
        self._lock = threading.Lock()
        self._bar = bar

    def callback(self, i: int, submitted: float):
        first: list[float] = []

        def on_output(out: RequestOutput) -> None:
            now = time.perf_counter()
            if out.new_token_ids and not first:
                first.append(now)
            if not out.finished:
                return
            s = out.stats
            ttft, tpot = request_ttft_tpot(submitted, first[0] if first else None, now, s.output_tokens)
            self.records[i] = {"submitted": submitted, "finished": now,
                               "finish_reason": out.finish_reason, "prompt_tokens": s.prompt_tokens,
                               "output_tokens": s.output_tokens, "ttft_s": ttft, "tpot_s": tpot,
                               "num_steps": s.num_steps, "num_draft_tokens": s.num_draft_tokens,
                               "num_accepted_draft_tokens": s.num_accepted_draft_tokens}
            with self._lock:
                self._left -= 1
                if self._bar is not None:
                    self._bar.update(1)
                if self._left == 0:
                    self.finished.set()
        return on_output


def level_requests(args: argparse.Namespace, concurrency: int) -> int:
    return max(args.num_requests, args.requests_per_client * concurrency)


def closed_loop(ex: Executor, reqs: list[tuple[list[int], int]], concurrency: int, timeout: float,
                bar: tqdm | None) -> tuple[Records, list[str]]:
    """One round of a closed-loop level: its per-request records, timed from the round's start, and its errors."""
    col = _Collector(len(reqs), bar)
    errors: list[str] = []

    def send(i: int) -> bool:
        ids, n = reqs[i]
        handle = None
        try:
            handle = ex.submit(ids, SamplingParams(max_tokens=n, ignore_eos=True),
                               on_output=col.callback(i, time.perf_counter()))
            handle.result(timeout)
        except Exception as e:  # recorded; the level is marked incomplete
            errors.append(f"{type(e).__name__}: {e}")
            if handle is not None:  # timed out: it must not run on into the next level
                handle.cancel()
            return False
        return True

    t0 = time.perf_counter()
    closed_loop_clients(len(reqs), concurrency, send)
    return [None if r is None else r | {"submitted": r["submitted"] - t0, "finished": r["finished"] - t0}
            for r in col.records], errors


def end_to_end(rounds: list[tuple[Records, list[str]]]) -> tuple[Records, list[str]]:
    """Rounds' records laid end to end, each round starting where the one before ended (its last
    request's end), so that summarize(records, 0.0, errors) pools them: wall times and tokens add up."""
    pooled: Records = []
    errors: list[str] = []
    offset = 0.0
    for records, errs in rounds:
        pooled += [None if r is None else r | {"submitted": r["submitted"] + offset, "finished": r["finished"] + offset}
                   for r in records]
        offset = max((r["finished"] for r in pooled if r is not None), default=offset)
        errors += errs
    return pooled, errors


def poisson_loop(ex: Executor, reqs: list[tuple[list[int], int]], qps: float, seed: int, timeout: float,
                 bar: tqdm | None) -> dict[str, Any]:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in reqs:
        arrivals.append(t)
        t += rng.expovariate(qps)
    col = _Collector(len(reqs), bar)
    t0 = time.perf_counter()
    handles = []
    for i, ((ids, n), at) in enumerate(zip(reqs, arrivals)):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        handles.append(ex.submit(ids, SamplingParams(max_tokens=n, ignore_eos=True),
                                 on_output=col.callback(i, time.perf_counter())))
    errors = []
    if not col.finished.wait(timeout):  # cut: what still runs is cancelled, not left to load the next level
        errors.append(f"timed out after {timeout} s")
        for h in handles:
            if not h.finished:
                h.cancel()
        col.finished.wait(CANCEL_WAIT_S)
    out = summarize(col.records, t0, errors) | _policy(ex)
    out["offered_qps"] = qps
    return out


def _policy(ex: Executor) -> dict[str, Any]:
    """The draft policy's state after a level (adaptive: its smoothed per-position acceptance)."""
    st = ex.stats()
    return {"policy_acceptance_estimate_end": st.acceptance_estimate, "policy_last_k": st.current_draft_len}


def summarize(records: Records, t0: float, errors: list[str]) -> dict[str, Any]:
    """A level's numbers from its per-request records (None: not finished; cancelled or failed ones do not
    count as completed) and its start time t0."""
    done = [r for r in records if r is not None and r["finish_reason"] not in FAILED_REASONS]
    if not done:
        return {"completed": 0, "requests": len(records), "errors": errors}
    wall = max(r["finished"] for r in done) - t0
    out_tokens = sum(r["output_tokens"] for r in done)
    drafted = sum(r["num_draft_tokens"] for r in done)
    accepted = sum(r["num_accepted_draft_tokens"] for r in done)
    decode_steps = sum(r["num_steps"] for r in done)  # token-emitting steps (each may carry drafts)
    tpots = [r["tpot_s"] for r in done]
    ttfts = [r["ttft_s"] for r in done]
    return {
        "requests": len(records), "completed": len(done), "errors": errors[:5],
        "wall_s": wall, "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall, "requests_per_s": len(done) / wall,
        "tpot_mean_s": mean(tpots), "tpot_p50_s": percentile(tpots, 50), "tpot_p99_s": percentile(tpots, 99),
        "ttft_mean_s": mean(ttfts), "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "latency_mean_s": mean(r["finished"] - r["submitted"] for r in done),
        "acceptance_rate": accepted / drafted if drafted else None,
        "drafts_per_decode_step": drafted / decode_steps if decode_steps else 0.0,
        "decode_tokens_per_step": out_tokens / decode_steps if decode_steps else None,
    }


def add_ratios_vs_plain(results: dict[str, Any], modes: list[str]) -> None:
    """Every mode's output tok/s over plain's and plain's mean TPOT over its, at the same level (row)."""
    for row in results["concurrency_sweep"] + results["qps_sweep"]:
        if "plain" in row:
            for m in modes:
                row[m]["tok_s_vs_plain"] = ratio(row[m].get("output_tokens_per_s"), row["plain"].get("output_tokens_per_s"))
                row[m]["tpot_speedup_vs_plain"] = ratio(row["plain"].get("tpot_mean_s"), row[m].get("tpot_mean_s"))


def serving_targets(results: dict[str, Any], modes: list[str]) -> list[dict[str, Any]]:
    """The target lines (after add_ratios_vs_plain); a level or rate without a number counts as 0."""
    conc = {row["concurrency"]: row for row in results["concurrency_sweep"]}
    targets = []
    if 1 in conc and 16 in conc:
        for m in modes:
            targets.append(target_line(f"{m}: output tok/s at concurrency 16 vs 1",
                                       ratio(conc[16][m].get("output_tokens_per_s"), conc[1][m].get("output_tokens_per_s")), 6.0))
    if "adaptive" in modes and "plain" in modes:
        worst = min((conc[c]["adaptive"]["tok_s_vs_plain"] or 0 for c in conc), default=None)
        low = [conc[c]["adaptive"]["tok_s_vs_plain"] or 0 for c in conc if c <= 4]
        targets.append(target_line("adaptive vs plain output tok/s, worst concurrency level", worst, 1.0))
        if low:
            targets.append(target_line("adaptive vs plain output tok/s, worst level at concurrency <= 4", min(low), 1.3))
        if results["qps_sweep"]:
            targets.append(target_line("adaptive vs plain TPOT speed-up, worst Poisson rate (info)",
                                       min(r["adaptive"]["tpot_speedup_vs_plain"] or 0 for r in results["qps_sweep"]), 1.0))
    return targets


def plot(results: dict[str, Any], modes: list[str], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = results["concurrency_sweep"]
    qps = results["qps_sweep"]
    panels = 3 if qps else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    for m in modes:
        cs = [row["concurrency"] for row in conc]
        axes[0].plot(cs, [row[m].get("output_tokens_per_s") for row in conc], marker="o", label=m)
        axes[1].plot(cs, [ms(row[m].get("tpot_mean_s")) for row in conc], marker="o", label=m)
        if qps:
            axes[2].plot([row["qps"] for row in qps], [ms(row[m].get("tpot_mean_s")) for row in qps],
                         marker="o", label=m)
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (closed loop)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title("throughput vs concurrency")
    axes[1].set_ylabel("mean TPOT (ms)")
    axes[1].set_title("TPOT vs concurrency")
    if qps:
        axes[2].set_xlabel("offered QPS (Poisson)")
        axes[2].set_ylabel("mean TPOT (ms)")
        axes[2].set_title("TPOT vs request rate")
        axes[2].grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(results["title"], fontsize=10)
    save_figure(fig, path)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (argparse's one-line error naming the flag, exit status 2); adds .modes_list,
    .levels (concurrency levels), .rates (the --qps numbers; [] for 'auto' and 'none') and .fractions
    (the --qps_fractions numbers for 'auto'; else [])."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--prompts", help="prompts JSON (default: <model>/heldout_prompts.json)")
    p.add_argument("--modes", default="plain,fixed,adaptive", help=f"comma-separated, of {', '.join(MODE_ORDER)}")
    p.add_argument("--fixed_k", type=int, default=1, help="draft length of the fixed-k MTP mode")
    p.add_argument("--adaptive_k", type=int, default=4, help="largest draft length adaptive MTP may pick")
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--num_requests", type=int, default=16, help="requests per concurrency level (at least "
                   "--requests_per_client x C)")
    p.add_argument("--requests_per_client", type=int, default=4,
                   help="at least this many requests per client at each concurrency level")
    p.add_argument("--rounds", type=int, default=1,
                   help="closed-loop rounds per level; the order of the modes is reversed every other round and a "
                        "level's numbers pool its rounds (more rounds: less noise and no bias from the order)")
    p.add_argument("--qps", default="auto",
                   help="comma-separated Poisson rates (req/s), 'auto' (fractions of plain's best closed-loop "
                        "request throughput) or 'none'")
    p.add_argument("--qps_fractions", default="0.25,0.5,0.75,1.0")
    p.add_argument("--qps_requests", type=int, default=24, help="requests per QPS level")
    p.add_argument("--min_tokens", type=int, default=64)
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds a closed-loop request, or a whole Poisson level, may take before it is cut")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="serving")
    args = parse_with_quick(p, argv, QUICK_DEFAULTS)
    asked = [m for m in args.modes.split(",") if m]
    unknown = [m for m in asked if m not in MODE_ORDER]
    if unknown or not asked:
        p.error(f"--modes: expected comma-separated modes of {', '.join(MODE_ORDER)}, got {args.modes!r}")
    args.modes_list = [m for m in MODE_ORDER if m in asked]
    args.levels = comma_list(p, "--concurrency", args.concurrency)
    if min(args.levels) < 1:
        p.error(f"--concurrency: levels must be >= 1, got {args.concurrency}")
    args.rates = [] if args.qps in ("none", "auto") else comma_list(p, "--qps", args.qps, float, "rates, 'auto' or 'none'")
    if args.rates and min(args.rates) <= 0:
        p.error(f"--qps: rates must be > 0 requests/s (or 'none' to skip the sweep), got {args.qps}")
    args.fractions = comma_list(p, "--qps_fractions", args.qps_fractions, float, "numbers") if args.qps == "auto" else []
    if args.fractions and min(args.fractions) <= 0:
        p.error(f"--qps_fractions: fractions must be > 0, got {args.qps_fractions}")
    drafting = {flag: 1 for flag, mode in (("fixed_k", "fixed"), ("adaptive_k", "adaptive")) if mode in args.modes_list}
    check_minimums(p, args, dict(num_requests=1, requests_per_client=1, rounds=1, qps_requests=1, min_tokens=1,
                                 **drafting))
    if args.max_tokens < args.min_tokens:
        p.error(f"--max_tokens: must be >= --min_tokens ({args.min_tokens}), got {args.max_tokens}")
    if not args.timeout > 0:
        p.error(f"--timeout: must be > 0 seconds, got {args.timeout}")
    return args


def main() -> None:
    args = parse_args()
    set_threads(args.threads)
    modes, levels = args.modes_list, args.levels
    max_c = max(levels)

    texts = load_prompts(args.model, args.prompts)
    engine = load_engine(args.model, device=args.device, dtype=args.dtype)
    eng_info = engine_info(engine)
    configs = {
        "plain": ExecutorConfig(num_draft_tokens=0, speculation="off", max_batch_size=max_c),
        "fixed": ExecutorConfig(num_draft_tokens=args.fixed_k, speculation="fixed", max_batch_size=max_c),
        "adaptive": ExecutorConfig(num_draft_tokens=args.adaptive_k, speculation="adaptive", max_batch_size=max_c),
    }
    executors: dict[str, Executor] = {}
    max_seq_len = min(engine.build.max_seq_len, 1024)
    for m in modes:
        t = time.perf_counter()
        executors[m] = Executor(engine, dataclasses.replace(configs[m], max_batch_size=max_c, max_seq_len=max_seq_len,
                                                            device=args.device))
        print(f"{m}: executor ready in {time.perf_counter() - t:.1f} s"
              f"{' (profiled step costs for adaptive)' if m == 'adaptive' else ''}")
    tok = executors[modes[0]].tokenizer
    prompt_ids = [tok.encode(x["text"]) for x in texts]
    info = machine_info()

    # Warm-up: a burst at every concurrency level on every executor (allocator, batch shapes, and on a GPU
    # the graphs of those shapes, captured here rather than inside a measured level).
    for c in levels:
        hi = args.max_tokens if args.device != "cpu" else 8
        warm = make_requests(prompt_ids, c, min(4, hi), hi, seed=args.seed + 999 + c)
        for m in modes:
            closed_loop(executors[m], warm, c, args.timeout, None)

    title = (f"{args.model}: {eng_info['parameters_target'] / 1e6:.1f}M target params, "
             f"{info['torch_threads']} torch threads, {info['cpu_count']} CPUs, {args.device}; fixed k={args.fixed_k}, "
             f"adaptive k<={args.adaptive_k}")
    results: dict[str, Any] = {
        "benchmark": "serving", "quick": args.quick, "title": title,
        "settings": {"modes": modes, "fixed_k": args.fixed_k, "adaptive_k": args.adaptive_k,
                     "concurrency": levels, "num_requests": args.num_requests,
                     "requests_per_client": args.requests_per_client, "rounds": args.rounds,
                     "output_tokens": [args.min_tokens, args.max_tokens],
                     "qps_requests": args.qps_requests, "greedy": True, "ignore_eos": True,
                     "max_batch_size": max_c, "max_seq_len": max_seq_len,
                     "prompts": len(prompt_ids), "prompt_tokens_mean": mean(len(i) for i in prompt_ids)},
        "machine": info, "engine": eng_info, "concurrency_sweep": [], "qps_sweep": []}
    n_total = sum(level_requests(args, c) for c in levels) * len(modes) * args.rounds
    bar = tqdm(total=n_total, desc="closed loop", dynamic_ncols=True)
    for c in levels:
        reqs = make_requests(prompt_ids, level_requests(args, c), args.min_tokens, args.max_tokens,
                             seed=args.seed + c)
        rounds: dict[str, list[tuple[Records, list[str]]]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for m in modes if r % 2 == 0 else modes[::-1]:
                bar.set_postfix(c=c, mode=m, round=r + 1)
                rounds[m].append(closed_loop(executors[m], reqs, c, args.timeout, bar))
        row: dict[str, Any] = {"concurrency": c}
        for m in modes:
            records, errors = end_to_end(rounds[m])
            row[m] = summarize(records, 0.0, errors) | _policy(executors[m])
        results["concurrency_sweep"].append(row)
    bar.close()

    if args.qps == "none":
        rates = []
    elif args.qps == "auto":
        base = "plain" if "plain" in modes else modes[0]
        cap = max(row[base].get("requests_per_s", 0) for row in results["concurrency_sweep"])
        rates = [round(cap * f, 3) for f in args.fractions]
        results["settings"]["qps_auto_capacity_req_s"] = cap
        if min(rates) <= 0:  # no request of the base mode completed (or a rate rounds to 0): no Poisson sweep
            print(f"no Poisson sweep: 'auto' rates from {base}'s closed-loop throughput {cap} req/s are {rates}")
            rates = []
    else:
        rates = args.rates
    results["settings"]["qps"] = rates
    if rates:
        bar = tqdm(total=len(rates) * len(modes) * args.qps_requests, desc="poisson", dynamic_ncols=True)
        for j, q in enumerate(rates):
            reqs = make_requests(prompt_ids, args.qps_requests, args.min_tokens, args.max_tokens,
                                 seed=args.seed + 10_000 + j)
            row = {"qps": q}
            for m in modes:
                bar.set_postfix(qps=q, mode=m)
                row[m] = poisson_loop(executors[m], reqs, q, args.seed + j, args.timeout, bar)
            results["qps_sweep"].append(row)
        bar.close()
    for ex in executors.values():
        ex.shutdown()

    # Ratios against plain and the targets.
    add_ratios_vs_plain(results, modes)
    targets = serving_targets(results, modes)
    results["targets"] = targets
    png = args.out_dir / f"{args.name}.png"
    try:
        plot(results, modes, png)
        results["plot"] = png.name
    except Exception as e:  # matplotlib missing: the tables still stand
        results["plot_error"] = f"{type(e).__name__}: {e}"
        print(f"no plot: {results['plot_error']}")

    md = [f"# In-flight batching: plain vs fixed-k MTP vs adaptive MTP{' (quick smoke run)' if args.quick else ''}",
          "", f"Model `{args.model}` ({eng_info['parameters_target'] / 1e6:.2f}M target + "
          f"{eng_info['parameters_mtp'] / 1e6:.2f}M MTP parameters); {len(prompt_ids)} held-out prompts "
          f"(~{results['settings']['prompt_tokens_mean']:.0f} tokens), output {args.min_tokens}-{args.max_tokens} "
          f"tokens (uniform, ignore_eos), greedy; plain = k 0, fixed = k {args.fixed_k} every step, adaptive = "
          f"k 0..{args.adaptive_k} chosen per step from the batch size, measured acceptance and profiled step "
          "costs. Modes run on separate executors, interleaved per level. Ratios are against plain "
          "at the same level (tok/s: output tokens/s; TPOT: plain TPOT / mode TPOT).", ""]
    md += ["## Closed loop (C clients, next request when one finishes)", "",
           f"max({args.num_requests}, {args.requests_per_client} x C) requests per level"
           + (f", run {args.rounds} times: the modes' order is reversed every other round and a level's numbers "
              "pool its rounds (wall times and tokens add up)." if args.rounds > 1 else "."), ""]
    headers = ["C", "mode", "output tok/s", "req/s", "TPOT mean ms", "TPOT p99 ms", "TTFT mean ms", "TTFT p99 ms",
               "acceptance", "drafts/step", "tok/s vs plain", "TPOT vs plain", "done"]

    def rows_of(sweep: list[dict[str, Any]], key: str) -> list[list[Any]]:
        rows = []
        for row in sweep:
            for m in modes:
                s = row[m]
                rows.append([row[key], m, s.get("output_tokens_per_s"), s.get("requests_per_s"),
                             ms(s.get("tpot_mean_s")), ms(s.get("tpot_p99_s")), ms(s.get("ttft_mean_s")),
                             ms(s.get("ttft_p99_s")), s.get("acceptance_rate"), s.get("drafts_per_decode_step"),
                             s.get("tok_s_vs_plain"), s.get("tpot_speedup_vs_plain"),
                             f"{s.get('completed')}/{s.get('requests')}"])
        return rows

    md.append(md_table(headers, rows_of(results["concurrency_sweep"], "concurrency")))
    if results["qps_sweep"]:
        md += ["", "## Poisson arrivals (open loop)", "",
               f"{args.qps_requests} requests per rate; rates "
               + (f"= {args.qps_fractions} x plain's best closed-loop request throughput "
                  f"({results['settings']['qps_auto_capacity_req_s']:.3f} req/s)" if args.qps == "auto" else "as given")
               + ". With this few requests per rate, a level's wall time is mostly the time to drain its last "
               "requests, so the tok/s and req/s columns measure tail latency rather than capacity: compare TPOT "
               "and TTFT here.", "", md_table(["QPS"] + headers[1:], rows_of(results["qps_sweep"], "qps"))]
    md += ["", "## Targets", "", *[f"- {t['text']}" for t in targets]]
    if "plot" in results:
        md += ["", f"![serving]({results['plot']})"]
    md += ["", "## Machine", "", machine_md(info)]
    js, mdp = write_results(args.out_dir, args.name, results, "\n".join(md))
    print("\n".join(md[md.index("## Closed loop (C clients, next request when one finishes)"):]))
    print(f"wrote {js}, {mdp}" + (f", {png}" if "plot" in results else ""))


if __name__ == "__main__":
    main()
