"""Where a batch-1 step's time goes (greedy, k = 0..4), and whether the one-call step pays.

Our executor runs held-out prompts one at a time (greedy, ignore_eos, speculation fixed, one executor per k).
Timers (perf_counter around coarse regions, installed by wrapping the methods and kernel calls below) split each
step of the step loop into: the target's kernels (all decoder layers in one call, lm_head), the MTP kernels
(catch-up and drafts), or the whole step in one kernel call (`ModelRunner.greedy_step`); and the host work around
them: the runner's batch building, embedding, rope and final norm, draft and verify bookkeeping (argmax,
acceptance, results), the scheduler's plan and update, detokenizing and stop checks, the output callback, the rest
of the loop's step, and the loop's gap between steps. Every request also runs without timers, in alternating
order, so the timers' own cost shows as the TPOT ratio between the two.

For every k both paths run side by side, request by request in alternating order: 'general' (the runner's Python
draft -> verify -> accept) and 'one_call' (the greedy step in one kernel call); k = 0 on the general path is the
baseline of the ratios.

  python -m benchmarks.step_profile                # full run (8 prompts x 128 tokens, 2 rounds)
  python -m benchmarks.step_profile --quick        # smoke run
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any, Callable

from benchmarks.common import (add_common_args, check_minimums, comma_list, engine_info, load_prompts, machine_info,
                               machine_md, md_table, parse_with_quick, percentile, request_ttft_tpot,
                               round_robin_by_source, set_threads, timed_request, write_results)

from runtime.core.sampling_params import SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.executors.requests import RequestTracker
from runtime.io.loading import load_engine
from runtime.model import kernels

PATHS = ("general", "one_call")
# Per decode step: what each timed region holds once the regions inside it are taken out.
PARTS = [
    ("target_kernels", "target's layers (one call) + lm_head"),
    ("mtp_kernels", "MTP catch-up + drafts (kernels)"),
    ("one_call_kernel", "whole step in one kernel call"),
    ("target_host", "target batch, embedding, rope, final norm"),
    ("draft_host", "catch-up inputs, draft argmax/tolist"),
    ("verify_host", "verify rows, argmax, acceptance, results (1-call: all the runner's host work)"),
    ("schedule", "scheduler plan"),
    ("detok_stop", "detokenize + stop checks"),
    ("update", "scheduler update"),
    ("callback", "report + output callback"),
    ("step_rest", "rest of the loop's step"),
    ("loop_gap", "loop between steps"),
]
KERNEL_PARTS = ("target_kernels", "mtp_kernels", "one_call_kernel")


class StepClock:
    """Seconds per region for each step of one executor's loop, from perf_counter pairs around wrapped calls."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._cur: dict[str, float] = defaultdict(float)
        self._last_end: float | None = None
        self._in_step = False
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, region: str, counts_emitted: bool = False) -> None:
        """Time owner.name (an instance's method, a class's or a module's function) into `region`; with
        counts_emitted, also record the tokens its results (StepResults) emitted."""
        fn, own = getattr(owner, name), name in vars(owner)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                self._cur[region] += time.perf_counter() - t0
                self._cur["calls"] += 1
            if counts_emitted:
                self._cur["emitted"] = sum(len(r.new_token_ids) for r in result)
            return result

        setattr(owner, name, timed)
        self._undo.append((lambda: setattr(owner, name, fn)) if own else (lambda: delattr(owner, name)))

    def wrap_step(self, ex: Executor) -> None:
        """Time the loop's step as a whole, with the loop's time since the step before, and start a new record."""
        fn = ex._step

        def timed() -> None:
            self._in_step, self._cur = True, defaultdict(float)
            t0 = time.perf_counter()
            try:
                fn()
            finally:
                self._in_step = False
            t1 = time.perf_counter()
            self._cur["calls"] += 1
            if self._cur.get("runner"):  # a step that ran the model (not an idle wait)
                self._cur["step"] = t1 - t0
                self._cur["loop_gap"] = t0 - self._last_end if self._last_end is not None else 0.0
                self.steps.append(self._cur)
                self._last_end = t1
            else:
                self._last_end = None  # idle: the next step's gap is waiting, not loop work

        ex._step = timed
        self._undo.append(lambda: delattr(ex, "_step"))

    def install(self, ex: Executor) -> None:
        runner, model = ex.runner, ex.runner.model
        self.wrap_step(ex)
        self.wrap(ex.scheduler, "schedule", "schedule")
        self.wrap(ex.scheduler, "update_from_output", "update")
        self.wrap(RequestTracker, "consume", "detok_stop")
        self.wrap(RequestTracker, "report", "callback")
        self.wrap(runner, "step", "runner", counts_emitted=True)
        self.wrap(runner.proposer, "propose", "draft")
        self.wrap(runner, "forward_target", "forward_target")
        self.wrap(model, "logits", "logits")
        self.wrap(kernels, "decoder_layers", "layers_kernel")
        self.wrap(kernels, "mtp_layer", "mtp_kernel")
        self.wrap(kernels, "mtp_greedy_drafts", "mtp_kernel")
        self.wrap(kernels, "greedy_step", "one_call_kernel")

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def take(self) -> list[dict[str, float]]:
        """The steps recorded, once the loop has left the step under way (a request's last output reaches its
        caller from inside the step that emitted it)."""
        while self._in_step and self._cur.get("runner"):  # an idle step next is no wait
            time.sleep(0.0002)
        steps, self.steps, self._last_end = self.steps, [], None
        return steps


def parts_of(r: dict[str, float]) -> dict[str, float]:
    """One step's regions as the disjoint parts of PARTS (seconds)."""
    g = r.get
    runner = g("runner", 0.0)
    outer = g("schedule", 0.0) + g("detok_stop", 0.0) + g("update", 0.0) + g("callback", 0.0)
    return {
        "target_kernels": g("layers_kernel", 0.0) + g("logits", 0.0),
        "mtp_kernels": g("mtp_kernel", 0.0),
        "one_call_kernel": g("one_call_kernel", 0.0),
        "target_host": g("forward_target", 0.0) - g("layers_kernel", 0.0),
        "draft_host": g("draft", 0.0) - g("mtp_kernel", 0.0),
        "verify_host": runner - g("draft", 0.0) - g("forward_target", 0.0) - g("logits", 0.0)
        - g("one_call_kernel", 0.0),
        "schedule": g("schedule", 0.0),
        "detok_stop": g("detok_stop", 0.0),
        "update": g("update", 0.0),
        "callback": g("callback", 0.0),
        "step_rest": g("step", 0.0) - runner - outer,
        "loop_gap": g("loop_gap", 0.0),
    }


def timer_cost_s(calls: int = 200_000) -> float:
    """Seconds one wrapped call adds over a bare call (the wrapper and its two clock reads)."""
    clock = StepClock()

    class Box:
        @staticmethod
        def f() -> None:
            return None

    bare = Box.f
    t0 = time.perf_counter()
    for _ in range(calls):
        bare()
    t1 = time.perf_counter()
    clock.wrap(Box, "f", "x")
    wrapped = Box.f
    for _ in range(calls):
        wrapped()
    t2 = time.perf_counter()
    return max((t2 - t1) - (t1 - t0), 0.0) / calls


def run_one(ex: Executor, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    """One request: TPOT from the times its first and last outputs with tokens reached the callback."""
    out, t0, first, last = timed_request(ex, prompt, params)
    s = out.stats
    _, tpot = request_ttft_tpot(t0, first, last, s.output_tokens)
    return {"token_ids": out.token_ids, "tpot_s": tpot, "output_tokens": s.output_tokens, "num_steps": s.num_steps}


def median(xs) -> float | None:
    return percentile(list(xs), 50)


def summarize(runs: list[dict[str, Any]], steps: list[dict[str, float]]) -> dict[str, Any]:
    """Median TPOT over requests; over the decode steps (those that emitted tokens) the median of each part, of the
    kernels, of the host work (the rest) and of the step's wall time (step + loop gap; medians: other processes on
    the machine preempt some steps), and the mean tokens per step."""
    s: dict[str, Any] = {"requests": len(runs), "tpot_median_s": median(r["tpot_s"] for r in runs)}
    decode = [parts_of(r) | {"wall": r["step"] + r["loop_gap"], "emitted": r["emitted"]} for r in steps
              if r.get("emitted")]
    if decode:
        for r in decode:
            r["kernels"] = sum(r[k] for k in KERNEL_PARTS)
        s |= {"decode_steps": len(decode), "tokens_per_step": sum(r["emitted"] for r in decode) / len(decode),
              "parts_s_per_step": {name: median(r[name] for r in decode) for name, _ in PARTS},
              "kernels_s_per_step": median(r["kernels"] for r in decode),
              "host_s_per_step": median(r["wall"] - r["kernels"] for r in decode),
              "step_wall_s": median(r["wall"] for r in decode)}
    return s


def paired(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float | None:
    """Median over requests of TPOT(a) / TPOT(b), request by request (the same prompt, run side by side)."""
    return median(x["tpot_s"] / y["tpot_s"] for x, y in zip(a, b) if x["tpot_s"] and y["tpot_s"])


def bounds(s: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    """Speed-ups over k = 0 per token: measured from the step wall times, and what each part's removal allows."""
    if not s["step_wall_s"] or not base["step_wall_s"]:
        return {}
    E, E0 = s["tokens_per_step"], base["tokens_per_step"]
    p, p0 = s["parts_s_per_step"], base["parts_s_per_step"]
    kern, kern0 = s["kernels_s_per_step"], base["kernels_s_per_step"]
    host, host0 = s["host_s_per_step"], base["host_s_per_step"]
    return {
        "measured": ((kern0 + host0) / E0) / ((kern + host) / E),
        # the step's host work no more than plain decoding's: speculation's own Python gone
        "host_as_k0": ((kern0 + host0) / E0) / ((kern + host0) / E),
        # no host work at all, in either (kernels only)
        "no_host": (kern0 / E0) / (kern / E),
        # no host work and free drafts: the verification forward alone (general path only: it times it apart)
        "free_drafts": (p0["target_kernels"] / E0) / (p["target_kernels"] / E) if p["target_kernels"] else None,
        "host_share_of_step": host / (kern + host),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--prompts", help="prompts JSON (default: <model>/heldout_prompts.json)")
    p.add_argument("--num_prompts", type=int, default=8)
    p.add_argument("--max_tokens", type=int, default=128, help="new tokens per request (ignore_eos)")
    p.add_argument("--rounds", type=int, default=2, help="passes over the prompts, the order reversed each pass")
    p.add_argument("--ks", default="0,1,2,3,4", help="draft lengths (0 = plain decoding, the baseline)")
    p.add_argument("--name", default="step_profile")
    args = parse_with_quick(p, None, dict(num_prompts=2, max_tokens=24, rounds=1, ks="0,1,3"))
    ks = sorted(set(comma_list(p, "--ks", args.ks)))
    if 0 not in ks or min(ks) < 0:
        p.error(f"--ks: draft lengths >= 0 that include 0 (the baseline), got {args.ks!r}")
    check_minimums(p, args, dict(num_prompts=1, max_tokens=4, rounds=1))
    set_threads(args.threads)

    prompts = round_robin_by_source(load_prompts(args.model, args.prompts), args.num_prompts)
    engine = load_engine(args.model, device=args.device, dtype=args.dtype)
    executors = {k: Executor(engine, ExecutorConfig(num_draft_tokens=k, speculation="fixed",
                                                    max_batch_size=1, device=args.device)) for k in ks}
    one_call = {k: ex.runner.greedy_step for k, ex in executors.items()}
    paths = {k: [p for p in PATHS if p == "general" or one_call[k] is not None] for k in ks}
    ids = [executors[0].tokenizer.encode(x["text"]) for x in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for k, ex in executors.items():  # warm-up: a full-length request per path
        for path in paths[k]:
            ex.runner.greedy_step = one_call[k] if path == "one_call" else None
            run_one(ex, ids[0], params)

    settings = [(k, path, timed) for k in ks for path in paths[k] for timed in (True, False)]
    runs: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    steps: dict[tuple, list[dict[str, float]]] = defaultdict(list)
    clock = StepClock()
    n = 0
    for rnd in range(args.rounds):
        for i, prompt in enumerate(ids if rnd % 2 == 0 else ids[::-1]):
            order = settings if n % 2 == 0 else settings[::-1]  # each setting early and late in turn
            n += 1
            for k, path, timed in order:
                ex = executors[k]
                ex.runner.greedy_step = one_call[k] if path == "one_call" else None
                if timed:
                    clock.install(ex)
                try:
                    runs[(k, path, timed)].append(run_one(ex, prompt, params))
                finally:
                    if timed:
                        steps[(k, path, timed)] += clock.take()
                        clock.uninstall()
        print(f"round {rnd + 1}/{args.rounds} done")
    for ex in executors.values():
        ex.shutdown()

    reference = runs[(0, "general", False)]
    summary: dict[str, Any] = {}
    for k, path, timed in settings:
        s = summarize(runs[(k, path, timed)], steps[(k, path, timed)] if timed else [])
        s["outputs_equal_k0"] = sum(r["token_ids"] == ref["token_ids"]
                                    for r, ref in zip(runs[(k, path, timed)], reference))
        summary[f"k{k}_{path}_{'timed' if timed else 'untimed'}"] = s
    base = summary["k0_general_timed"]
    for k in ks:
        for path in paths[k]:
            s = summary[f"k{k}_{path}_timed"]
            s["bounds"] = bounds(s, base)
            s["timer_distortion"] = paired(runs[(k, path, True)], runs[(k, path, False)])
            s["speedup_tpot_untimed_vs_k0"] = paired(runs[(0, "general", False)], runs[(k, path, False)])
    one_call_vs_general = {
        k: {"tpot_general_over_one_call": paired(runs[(k, "general", False)], runs[(k, "one_call", False)]),
            "tpot_general_over_one_call_timed": paired(runs[(k, "general", True)], runs[(k, "one_call", True)]),
            "step_wall_general_over_one_call": summary[f"k{k}_general_timed"]["step_wall_s"]
            / summary[f"k{k}_one_call_timed"]["step_wall_s"]}
        for k in ks if "one_call" in paths[k]}
    per_call = timer_cost_s()
    calls = {k: median(r["calls"] for r in steps[(k, "general", True)] if r.get("emitted")) for k in ks}
    results = {
        "benchmark": "step_profile",
        "quick": args.quick,
        "settings": {"num_prompts": len(prompts), "max_tokens": args.max_tokens, "rounds": args.rounds, "ks": ks,
                     "paths": paths, "greedy": True, "ignore_eos": True, "batch_size": 1,
                     "prompt_tokens": [len(i) for i in ids]},
        "machine": machine_info(),
        "engine": engine_info(engine),
        "parts": dict(PARTS),
        "timer_cost_s_per_call": per_call,
        "timer_calls_per_step": calls,
        "summary": summary,
        "one_call_vs_general": one_call_vs_general,
    }
    js, mdp = write_results(args.out_dir, args.name, results, markdown(args, results, ks, paths))
    print(markdown(args, results, ks, paths).split("## Machine")[0])
    print(f"wrote {js} and {mdp}")


def markdown(args, results: dict[str, Any], ks: list[int], paths: dict[int, list[str]]) -> str:
    summary, info = results["summary"], results["machine"]
    cols = [(k, path) for k in ks for path in paths[k]]
    name = {"general": "", "one_call": " 1-call"}
    head = ["part (ms per decode step)"] + [f"k={k}{name[path]}" for k, path in cols]
    rows = []
    for part, what in PARTS:
        vals = [summary[f"k{k}_{path}_timed"]["parts_s_per_step"].get(part) for k, path in cols]
        if any(vals):
            rows.append([f"{part}: {what}"] + [v * 1e3 if v is not None else None for v in vals])
    get = lambda key, scale=1.0: [(summary[f"k{k}_{path}_timed"].get(key) or 0) * scale for k, path in cols]
    rows += [["**kernels**"] + get("kernels_s_per_step", 1e3),
             ["**host (wall - kernels)**"] + get("host_s_per_step", 1e3),
             ["**step wall (step + loop gap)**"] + get("step_wall_s", 1e3),
             ["tokens per step (mean)"] + get("tokens_per_step"),
             ["**(kernels + host) per token**"] + [(c + h) / t if t else None for c, h, t in
                                                   zip(get("kernels_s_per_step", 1e3), get("host_s_per_step", 1e3),
                                                       get("tokens_per_step"))]]
    b = lambda key: [summary[f"k{k}_{path}_timed"]["bounds"].get(key) for k, path in cols]
    brows = [["measured ((kernels + host) per token)"] + b("measured"),
             ["host work as plain decoding's"] + b("host_as_k0"),
             ["no host work (kernels only)"] + b("no_host"),
             ["no host work, free drafts"] + b("free_drafts"),
             ["host share of the step"] + b("host_share_of_step"),
             ["TPOT untimed, speed-up vs k=0 (paired)"] + [summary[f"k{k}_{path}_timed"]["speedup_tpot_untimed_vs_k0"]
                                                   for k, path in cols],
             ["timers' distortion (TPOT timed / untimed, paired)"] + [summary[f"k{k}_{path}_timed"]["timer_distortion"]
                                                              for k, path in cols],
             ["output == k=0 (timed, untimed)"] + [f"{summary[f'k{k}_{path}_timed']['outputs_equal_k0']}, "
                                                    f"{summary[f'k{k}_{path}_untimed']['outputs_equal_k0']}"
                                                    for k, path in cols]]
    s = results["settings"]
    md = [f"# Where a batch-1 speculative step's time goes{' (quick smoke run)' if args.quick else ''}", "",
          f"Model `{args.model}`; {s['num_prompts']} held-out prompts x {s['rounds']} rounds, {s['max_tokens']} new "
          "tokens each, greedy, ignore_eos, batch 1, speculation fixed (one executor per k). Medians over the decode "
          "steps (the steps that emitted tokens) of the timed requests (other processes preempt some steps; a part's "
          "median is of that part alone, so the parts need not add up to the medians of kernels, host and wall); "
          "each request also ran untimed, in alternating order; TPOT ratios are medians of request-by-request "
          "ratios. 'k=N 1-call' is the greedy step in one kernel call (`ModelRunner.greedy_step`), run side by side "
          "with the general path.", "",
          "## Per decode step", "", md_table(head, rows, digits=3), "",
          "## Speed-up over k=0 per token, and the bound each part puts on it", "", md_table(["over k=0"] + head[1:], brows),
          "", "'host work as plain decoding's': the k step's kernels plus k=0's host time; 'no host work': kernels only "
          "in both; 'free drafts': the target's kernels alone (the general path times them apart).", "",
          f"Timers: {results['timer_cost_s_per_call'] * 1e9:.0f} ns per wrapped call over a bare call, "
          "wrapped calls per decode step (general path): "
          + ", ".join(f"k={k} {n:.1f}" for k, n in results["timer_calls_per_step"].items()) + ".", ""]
    if results["one_call_vs_general"]:
        md += ["## The greedy step in one kernel call vs the general path (side by side)", "",
               md_table(["k", "TPOT general / one call (untimed)", "TPOT general / one call (timed)",
                         "step wall general / one call (timed, medians)"],
                        [[k, v["tpot_general_over_one_call"], v["tpot_general_over_one_call_timed"],
                          v["step_wall_general_over_one_call"]]
                         for k, v in results["one_call_vs_general"].items()], digits=3), ""]
    md += ["## Machine", "", machine_md(info)]
    return "\n".join(md)


if __name__ == "__main__":
    main()
