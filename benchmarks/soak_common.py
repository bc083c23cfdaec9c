"""What the soak tests of the Triton deployment (benchmarks/soak_test.py) and of dsv3-serve
(benchmarks/soak_openai.py) share: the closed-loop load of weighted request kinds with priming, the memory and KV
samples taken during it, the checks that tell a memory plateau from a leak, the per-kind summaries and the tables
of the report. Each soak brings its own request kinds, server and end checks.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from benchmarks.common import fmt, load_prompts, machine_md, md_table, ms, percentile, round_robin_by_source
from runtime.executors.lifetime import status_kb
from runtime.io.tokenizer import Tokenizer

RSS_GROWTH_LIMIT = 0.10  # of a process's resident memory, from the warm-up sample to the end
MIN_SLOPE_SAMPLES = 3  # samples in the second half of the load needed to fit a growth rate
CANCEL_TOKENS = 512  # a cancelled or disconnected request asks for this many (eos ignored): it is still running
PROBE_TOKENS = 48


class Unexpected(Exception):
    """The server answered, but not as it should have (wrong refusal, broken text, a hang)."""


@dataclass
class Result:
    outcome: str  # ok | expected_refusal | cancelled | disconnected | mismatch
    ttft_s: float | None = None
    message: str | None = None


# name -> (weight, request); weights are relative (about percentages)
Kinds = dict[str, tuple[int, Callable[[Any, random.Random], Result]]]


@dataclass
class Watched:
    """What the load loop reads of the server: its processes (pid -> name), whether it still runs, and its gauges
    ({"kv_used", "active"}: KV blocks in use, requests running or waiting)."""

    name: str
    pids: dict[int, str]
    alive: Callable[[], bool]
    gauges: Callable[[], dict[str, float]]


@dataclass(slots=True)
class Record:
    kind: str
    outcome: str  # ok | expected_refusal | cancelled | disconnected | mismatch | unexpected_error
    latency_s: float
    ttft_s: float | None
    message: str | None


def add_soak_args(p: argparse.ArgumentParser, minutes: float, concurrency: int, sample_every_s: float) -> None:
    """The flags both soaks take (their defaults: a full run's; samples often enough for the second half's rate to
    rest on several, not on one transient peak)."""
    p.add_argument("--minutes", type=float, default=minutes)
    p.add_argument("--concurrency", type=int, default=concurrency)
    p.add_argument("--warmup_s", type=float, default=120.0, help="load before the 'start' memory sample "
                   "(at most a quarter of the run)")
    p.add_argument("--sample_every_s", type=float, default=sample_every_s)
    p.add_argument("--prime_rounds", type=int, default=1, help="before the timed load, every kind is sent this many "
                   "times by each client, all clients at once (0: no priming)")
    p.add_argument("--request_timeout_s", type=float, default=120.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads of the runtime (0: its default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", type=lambda v: v.split(","), help="comma-separated subset of the request kinds to send "
                   "(default: all, by their weights), to find which traffic a failed check comes from")


def check_soak_args(p: argparse.ArgumentParser, args: argparse.Namespace, kinds: Kinds) -> None:
    """argparse's error (exit status 2) naming the first flag out of its range."""
    for flag in ("minutes", "warmup_s", "sample_every_s", "request_timeout_s"):
        if not getattr(args, flag) > 0:
            p.error(f"--{flag}: must be > 0, got {getattr(args, flag)}")
    unknown = [k for k in args.kinds or [] if k not in kinds]
    if unknown:
        p.error(f"--kinds: unknown kind(s) {', '.join(unknown)}; expected some of {', '.join(kinds)}")
    if args.concurrency < 1:
        p.error(f"--concurrency: must be >= 1, got {args.concurrency}")
    if args.prime_rounds < 0:
        p.error(f"--prime_rounds: must be >= 0, got {args.prime_rounds}")


# ---- server side: memory, metrics ------------------------------------------------------------------
def rss_kb(pids: dict[int, str], field: str = "VmRSS") -> dict[int, int | None]:
    """VmRSS (or another /proc/<pid>/status field in kB: RssShmem, the shared memory in it) of each pid in kB
    (None: the process is gone)."""
    return {pid: status_kb(pid, field) for pid in pids}


def read_metrics(url: str) -> dict[str, float]:
    """The server's Prometheus metrics; none when it does not answer (it crashed: the checks then fail, results are
    kept)."""
    try:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    except OSError:
        return {}
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(v for key, v in values.items() if key.split("{")[0] == name
               and all(f'{k}="{val}"' in key for k, val in labels.items()))


def wait_drained(gauges: Callable[[], dict[str, float]], timeout_s: float) -> bool:
    """Wait until the server has no active request and no used KV block."""
    deadline = time.monotonic() + timeout_s
    while True:
        g = gauges()
        if g.get("active") == 0 and g.get("kv_used") == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


# ---- the load ---------------------------------------------------------------------------------------
def run_one(kinds: Kinds, ctx: Any, kind: str, rng: random.Random) -> Record:
    sent = time.perf_counter()
    try:
        r = kinds[kind][1](ctx, rng)
        outcome, ttft, message = r.outcome, r.ttft_s, r.message
    except Exception as e:  # Unexpected, or a client-side failure (connection refused, timeout, bad JSON)
        outcome, ttft, message = "unexpected_error", None, f"{type(e).__name__}: {e}"[:500]
    return Record(kind, outcome, time.perf_counter() - sent, ttft, message)


def prime(kinds: Kinds, ctx: Any, names: list[str], args: argparse.Namespace, server: Watched) -> list[Record]:
    """Every kind, in turn, sent by all clients at once, --prime_rounds times: each kind's peak of concurrent
    requests (and of memory they hold at once) is reached before the memory baseline is taken."""
    records: list[Record] = []
    lock = threading.Lock()

    def client(kind: str, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(args.prime_rounds):
            rec = run_one(kinds, ctx, kind, rng)
            with lock:
                records.append(rec)

    for n, kind in enumerate(names):
        threads = [threading.Thread(target=client, args=(kind, -(args.seed * 1000 + n * args.concurrency + i) - 1),
                                    daemon=True) for i in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(args.prime_rounds * (args.request_timeout_s + 30))
        if not server.alive():
            break
    return records


def run_load(kinds: Kinds, ctx: Any, args: argparse.Namespace, server: Watched) -> dict[str, Any]:
    """Priming, then the closed loop, with the main thread sampling memory and gauges; returns records (priming's
    apart) and samples."""
    names = args.kinds or list(kinds)
    weights = [kinds[k][0] for k in names]
    pids = server.pids
    idle = {"phase": "idle", "rss_kb": rss_kb(pids), "kv_used": server.gauges().get("kv_used")}
    t_prime = time.perf_counter()
    primed = prime(kinds, ctx, names, args, server) if args.prime_rounds else []
    prime_s = time.perf_counter() - t_prime
    records: list[Record] = []
    lock = threading.Lock()
    t0 = time.perf_counter()
    end = t0 + args.minutes * 60

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.perf_counter() < end and server.alive():  # a dead server fails fast
            rec = run_one(kinds, ctx, rng.choices(names, weights)[0], rng)
            with lock:
                records.append(rec)

    samples = [{**idle, "at_s": round(-prime_s, 1)},
               {"phase": "primed", "at_s": 0.0, "rss_kb": rss_kb(pids), "kv_used": server.gauges().get("kv_used")}]
    threads = [threading.Thread(target=client, args=(args.seed * 1000 + i,), daemon=True)
               for i in range(args.concurrency)]
    for t in threads:
        t.start()
    warmup = min(args.warmup_s, args.minutes * 60 / 4)
    marks = sorted({warmup, *np.arange(args.sample_every_s, args.minutes * 60, args.sample_every_s).tolist()})
    start_index = None
    for mark in marks:
        time.sleep(max(0.0, t0 + mark - time.perf_counter()))
        g, rss = server.gauges(), rss_kb(pids)
        samples.append({"phase": "load", "at_s": round(time.perf_counter() - t0, 1), "rss_kb": rss,
                        "shmem_kb": rss_kb(pids, "RssShmem"), "kv_used": g.get("kv_used"), "active": g.get("active")})
        start_index = len(samples) - 1 if mark == warmup else start_index
        with lock:
            counts = Counter(r.outcome for r in records)
        gone = [pids[pid] for pid, kb in rss.items() if kb is None]
        print(f"[{samples[-1]['at_s']:7.1f} s] {sum(counts.values())} requests {dict(counts)}; KV blocks used "
              f"{fmt(g.get('kv_used'), 0)}; server RSS {sum(kb or 0 for kb in rss.values()) / 1024:.0f} MB"
              + (f"; GONE: {', '.join(gone)}" if gone else ""), flush=True)
        if not server.alive():
            print(f"{server.name} exited", flush=True)
            break
    load_end = time.perf_counter() + args.request_timeout_s + 30
    for t in threads:
        t.join(max(0.0, load_end - time.perf_counter()))
    hung = sum(t.is_alive() for t in threads)
    wall = time.perf_counter() - t0
    with lock:
        records = list(records)
    return {"records": records, "primed": primed, "prime_s": prime_s, "samples": samples, "pids": pids,
            "hung_clients": hung, "wall_s": wall,
            "start_index": len(samples) - 1 if start_index is None else start_index}  # None: the server died first


# ---- summaries and checks ---------------------------------------------------------------------------
def summarize_kinds(kinds: Kinds, records: list[Record]) -> dict[str, Any]:
    by_kind: dict[str, list[Record]] = {}
    for r in records:
        by_kind.setdefault(r.kind, []).append(r)
    out = {}
    for kind in kinds:
        rs = by_kind.get(kind, [])
        out[kind] = {"weight": kinds[kind][0], "requests": len(rs), "outcomes": dict(Counter(r.outcome for r in rs)),
                     **latency_stats(rs)}
    return out


def latency_stats(rs: list[Record]) -> dict[str, float | None]:
    lat, ttft = [r.latency_s for r in rs], [r.ttft_s for r in rs]
    return {"latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99)}


def errors_by_kind(records: list[Record], outcome: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in records:
        if r.outcome == outcome:
            e = out.setdefault(r.kind, {"count": 0, "examples": []})
            e["count"] += 1
            if len(e["examples"]) < 3 and r.message not in e["examples"]:
                e["examples"].append(r.message)
    return out


def growth_rate_kb_h(samples: list[dict[str, Any]], pid: int, from_s: float) -> float | None:
    """Least-squares slope (kB per hour) of a process's VmRSS over the load's samples from `from_s` on; None
    with fewer than MIN_SLOPE_SAMPLES (or the process gone): a rate needs points to stand on."""
    points = [(x["at_s"] / 3600, x["rss_kb"].get(pid)) for x in samples if x["phase"] == "load" and x["at_s"] >= from_s]
    points = [(t, kb) for t, kb in points if kb is not None]
    if len(points) < MIN_SLOPE_SAMPLES:
        return None
    return float(np.polyfit([t for t, _ in points], [kb for _, kb in points], 1)[0])


def rss_table(pids: dict[int, str], samples: list[dict[str, Any]], start_index: int, end: dict[int, int | None],
              end_shmem: dict[int, int | None], load_s: float) -> list[dict[str, Any]]:
    """Per process: VmRSS idle, after priming, at the start (after the warm-up), at the end; growth from start
    to end; the rate fitted over the load's second half, and the growth that rate gives over start to end. Also
    the shared memory within VmRSS at the start and the end (RssShmem: a Python backend stub's region, which
    Triton maps again, keeping the old mapping, when a large request body does not fit it)."""
    idle, primed, start = (samples[0]["rss_kb"], samples[1]["rss_kb"], samples[start_index]["rss_kb"])
    window_h = max(0.0, load_s - samples[start_index]["at_s"]) / 3600
    rows = []
    for pid, name in sorted(pids.items(), key=lambda x: x[1]):
        s, e = start.get(pid), end.get(pid)
        growth = None if not s or e is None else (e - s) / s
        rate = growth_rate_kb_h(samples, pid, load_s / 2)
        rate_growth = None if not s or rate is None or e is None else rate * window_h / s
        rows.append({"pid": pid, "process": name, "idle_kb": idle.get(pid), "primed_kb": primed.get(pid),
                     "start_kb": s, "end_kb": e, "start_shmem_kb": samples[start_index]["shmem_kb"].get(pid),
                     "end_shmem_kb": end_shmem.get(pid), "growth": growth, "second_half_kb_per_h": rate,
                     "second_half_rate_growth": rate_growth, "alive": e is not None,
                     "over_limit": growth is not None and growth > RSS_GROWTH_LIMIT,
                     "still_growing": rate_growth is not None and rate_growth > RSS_GROWTH_LIMIT})
    return rows


def rss_checks(rows: list[dict[str, Any]]) -> dict[str, bool | None]:
    """The two memory checks; the rate's is None (reported, neither passed nor failed) when a live process has too
    few samples in the second half to fit a rate (a short run)."""
    rates_known = all(r["second_half_rate_growth"] is not None for r in rows if r["alive"])
    return {f"rss_growth_within_{RSS_GROWTH_LIMIT:.0%}": not any(r["over_limit"] for r in rows),
            f"rss_second_half_rate_within_{RSS_GROWTH_LIMIT:.0%}": not any(r["still_growing"] for r in rows)
            if rates_known else None}


def rss_results(load: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's memory section: the table, the limit, and every sample with its processes named."""
    samples, pids = load["samples"], load["pids"]
    return {"processes": rows, "limit": RSS_GROWTH_LIMIT, "start_at_s": samples[load["start_index"]]["at_s"],
            "samples": [{**s, "rss_kb": {f"{pids[pid]} ({pid})": kb for pid, kb in s["rss_kb"].items()}}
                        for s in samples]}


def make_prompts(model: str | Path, tok: Tokenizer, max_seq_len: int) -> tuple[list[str], list[str], list[str]]:
    """Short prompts (held-out texts cut to 300 characters), 4 probe prompts, and 4 long prompts: held-out
    texts joined to max_seq_len - 136 tokens (room for 64 new tokens and re-tokenizing at the cut)."""
    texts = [x["text"] for x in round_robin_by_source(load_prompts(model), 64)]
    short = [t[:300] for t in texts]
    target = max(16, max_seq_len - 136)
    long = []
    for i in range(4):
        ids: list[int] = []
        j = i
        while len(ids) < target:
            ids += tok.encode(texts[j % len(texts)] + "\n\n", add_bos=False)
            j += 1
        long.append(tok.decode(ids[:target]))
    return short, short[:4], long


# ---- report -----------------------------------------------------------------------------------------
def report_md(r: dict[str, Any], title: str, *, max_seq_len: str, end: list[str], title_more: str = "",
              served_by: str = "", requests_more: str = "") -> str:
    """A soak's report from its results `r`: `title` (then quick, `title_more` and the verdict), the load (`served_by`
    before the clients, `requests_more` after the outcomes, `max_seq_len` where the context was set), the priming,
    checks, kinds, errors and memory, the `end` sections (each soak's own), the machine."""
    s, req, lat, pr = r["settings"], r["requests"], r["latency"], r["priming"]
    return "\n\n".join([
        f"# {title}{' (quick smoke run)' if r['quick'] else ''}{title_more}: {'PASSED' if r['passed'] else 'FAILED'}",
        f"{served_by}{s['concurrency']} closed-loop clients for {s['minutes']:g} min ({r['load_wall_s']:.0f} s with the "
        f"last requests) on {s['host']}: {req['total']} requests ({req['per_s']:.1f}/s), {req['served']} served, "
        f"outcomes {req['by_outcome']}{requests_more}. Latency all requests p50 {fmt(ms(lat['all']['latency_p50_s']))} "
        f"ms, p99 {fmt(ms(lat['all']['latency_p99_s']))} ms; served p50 {fmt(ms(lat['served']['latency_p50_s']))} ms, "
        f"p99 {fmt(ms(lat['served']['latency_p99_s']))} ms. {max_seq_len}, long prompts {s['long_prompt_tokens']} "
        "tokens, adaptive MTP speculation.",
        f"Before it, priming: every kind sent {s['prime_rounds']} time(s) by each of the {s['concurrency']} clients "
        f"at once, kind after kind: {pr['requests']} requests in {pr['wall_s']:.0f} s, outcomes {pr['by_outcome']}."
        if s["prime_rounds"] else "No priming (--prime_rounds 0).",
        "## Checks", checks_md(r["checks"]),
        "## Requests by kind (latency and TTFT in ms)", kinds_md(r["kinds"]),
        "## Errors by kind", errors_md(r),
        rss_md(r["rss"]),
        *end,
        "## Machine", machine_md(r["machine"])])


def kinds_md(kinds: dict[str, Any]) -> str:
    rows = [[k, v["weight"], v["requests"], v["outcomes"].get("ok", 0), v["outcomes"].get("expected_refusal", 0),
             v["outcomes"].get("cancelled", 0) + v["outcomes"].get("disconnected", 0),
             v["outcomes"].get("unexpected_error", 0) + v["outcomes"].get("mismatch", 0),
             ms(v["latency_p50_s"]), ms(v["latency_p99_s"]), ms(v["ttft_p50_s"]), ms(v["ttft_p99_s"])]
            for k, v in kinds.items()]
    return md_table(["kind", "weight", "requests", "ok", "refused as expected", "cancelled/disconnected",
                     "errors/mismatches", "p50", "p99", "TTFT p50", "TTFT p99"], rows, digits=1)


def errors_md(r: dict[str, Any]) -> str:
    return "\n".join(f"- {k}: {v['count']} x, e.g. `{v['examples'][0]}`"
                     for k, v in {**r["unexpected_errors"], **r["mismatches"]}.items()) or "none"


def checks_md(checks: dict[str, bool | None]) -> str:
    return "\n".join(f"- {c}: {'not measured' if ok is None else 'ok' if ok else 'FAILED'}" for c, ok in checks.items())


def rss_md(rss: dict[str, Any]) -> str:
    rows = [[p["process"], p["pid"], kb_mb(p["idle_kb"]), kb_mb(p["primed_kb"]), kb_mb(p["start_kb"]),
             kb_mb(p["end_kb"]), f"{fmt(kb_mb(p['start_shmem_kb']), 1)} -> {fmt(kb_mb(p['end_shmem_kb']), 1)}",
             pct(p["growth"]), kb_mb(p["second_half_kb_per_h"]), pct(p["second_half_rate_growth"]),
             "GONE" if not p["alive"]
             else ", ".join(["OVER"] * p["over_limit"] + ["STILL GROWING"] * p["still_growing"]) or "ok"]
            for p in rss["processes"]]
    return "\n\n".join([
        f"## Resident memory (MB; start = after priming and {rss['start_at_s']:.0f} s of load, end = drained; "
        f"limit +{rss['limit']:.0%} from start to end, and for the second half's fitted rate over the same window)",
        md_table(["process", "pid", "idle", "primed", "start", "end", "of which shared (start -> end)", "growth",
                  "2nd half MB/h", "2nd-half rate over start-end", ""], rows, digits=1)])


def kb_mb(kb: float | None) -> float | None:
    return None if kb is None else kb / 1024


def pct(x: float | None) -> str | None:
    return None if x is None else f"{x:+.1%}"
