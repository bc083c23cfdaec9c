"""The OpenAI server's overhead: TPOT and TTFT through dsv3-serve (streamed /v1/completions) next to the
Python Session on the same model and settings, at concurrency 1, plain and MTP, side by side.

  python -m benchmarks.openai_serving [--quick]

The server runs with its executor in a process of its own ("server", --engine_process, the default on CUDA
devices) and with executor and HTTP server in one process ("one-process server", --no-engine_process, the
default on CPU), to show what the split buys. Each round runs every mode's Session requests and both servers'
back to back, in an order rotated every round, so drift on the machine hits all three alike. Requests ignore eos, so each streams exactly
max_tokens tokens; TTFT and TPOT are vLLM's, on the client's clock (the Session's: when its handle yields
the first and last outputs; the server's: when the client reads the first and last chunks).
"""

from __future__ import annotations

import argparse
import http.client
import importlib.metadata
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (CpuTime, add_common_args, load_prompts, machine_info, machine_md, md_table, mean,
                               ms, parse_with_quick, ratio, request_ttft_tpot, round_robin_by_source, save_figure,
                               session_request, set_threads, target_line, write_results)
from runtime.executors.lifetime import live_descendants
from runtime.executors.session import Session
from serving.openai_server.process import start_dsv3_serve

MODES = {"plain": ["--num_draft_tokens", "0"], "mtp": ["--num_draft_tokens", "3", "--speculation", "adaptive"]}
GOAL = 1.10  # server TPOT / Session TPOT at concurrency 1


def server_request(port: int, model: str, prompt: str, max_tokens: int) -> tuple[float | None, float | None]:
    """One streamed /v1/completions request, read as a load generator reads it (raw SSE lines, one JSON parse a
    chunk): the openai client's per-chunk objects would take the CPU from the server on a small machine."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    sent = time.perf_counter()
    first = last = None
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"dsv3-serve answered {response.status}: {response.read()[:300]!r}")
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
    finally:
        conn.close()
    return request_ttft_tpot(sent, first, last, max_tokens)


def uvicorn_stack() -> str:
    """What the server's uvicorn runs on (uvloop where installed, else asyncio; h11, which dsv3-serve sets)."""
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None
    loop = f"uvloop {version('uvloop')}" if version("uvloop") else "asyncio"
    return f"uvicorn {version('uvicorn')}, {loop}, h11 {version('h11')}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=8, help="requests per mode, path and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--name", default="openai_serving")
    args = parse_with_quick(p, None, dict(max_tokens=16, requests=2, rounds=2))
    if args.max_tokens < 2:
        p.error(f"--max_tokens: must be >= 2 (TPOT needs a token after the first), got {args.max_tokens}")
    set_threads(args.threads)
    prompts = [x["text"] for x in round_robin_by_source(load_prompts(args.model), args.requests)]
    model = Path(args.model)
    results: dict[str, dict[str, list]] = {}
    for mode, flags in MODES.items():
        k = 0 if mode == "plain" else 3
        common = ["--device", args.device, "--log_level", "warning", *flags,
                  *(["--torch_threads", str(args.threads)] if args.threads else []),
                  *(["--dtype", args.dtype] if args.dtype else [])]
        servers = {"server": start_dsv3_serve(model, *common, "--engine_process"),
                   "one_process": start_dsv3_serve(model, *common, "--no-engine_process")}
        try:
            with Session(model, num_draft_tokens=k, speculation="adaptive", device=args.device,
                         dtype=args.dtype) as session:
                paths = {"session": lambda pr: session_request(session, pr, args.max_tokens),
                         **{name: (lambda pr, port=server.port: server_request(port, model.name, pr, args.max_tokens))
                            for name, server in servers.items()}}
                for run in paths.values():  # warm-up
                    run(prompts[0])
                processes = {name: {"server": [server.process.pid, *live_descendants(server.process.pid)]}
                             for name, server in servers.items()}
                got: dict[str, list] = {name: [] for name in paths}
                cpu = CpuTime()
                for r in range(args.rounds):
                    names = list(paths)
                    for name in names[r % len(names):] + names[:r % len(names)]:  # each path in each place
                        with cpu.span(name, processes.get(name), "this process" if name == "session" else "client"):
                            got[name] += [paths[name](pr) for pr in prompts]
            results[mode] = {"requests": got,
                             "cpu_us_per_token": cpu.per_token_us(args.rounds * len(prompts) * args.max_tokens)}
        finally:
            for server in servers.values():
                server.stop()

    rows, targets, summary = [], [], {}
    for mode, r in results.items():
        s = {name: {"ttft_s": mean(t for t, _ in v), "tpot_s": mean(t for _, t in v)}
             for name, v in r["requests"].items()}
        s["cpu_us_per_token"] = r["cpu_us_per_token"]
        s["server_over_session_tpot"] = ratio(s["server"]["tpot_s"], s["session"]["tpot_s"])
        s["one_process_over_session_tpot"] = ratio(s["one_process"]["tpot_s"], s["session"]["tpot_s"])
        summary[mode] = s
        rows.append([mode, ms(s["session"]["tpot_s"]), ms(s["server"]["tpot_s"]), s["server_over_session_tpot"],
                     ms(s["one_process"]["tpot_s"]), s["one_process_over_session_tpot"],
                     ms(s["session"]["ttft_s"]), ms(s["server"]["ttft_s"])])
        targets.append(target_line(f"{mode}: Session TPOT / server TPOT at concurrency 1 (server <= {GOAL}x Session)",
                                   ratio(s["session"]["tpot_s"], s["server"]["tpot_s"]), round(1 / GOAL, 3)))
    plot(summary, args.out_dir / f"{args.name}.png")
    info = {**machine_info(), "uvicorn": uvicorn_stack()}
    md = "\n\n".join([
        "# OpenAI server (dsv3-serve) vs Session at concurrency 1",
        f"{args.max_tokens} tokens per request (eos ignored), {args.requests} requests x {args.rounds} rounds per "
        "mode and path, streamed /v1/completions read as raw SSE; means in ms on the client's clock. MTP: adaptive, "
        "up to 3 drafts.",
        md_table(["mode", "Session TPOT ms", "server TPOT ms", "server / Session", "one-process server TPOT ms",
                  "one-process / Session", "Session TTFT ms", "server TTFT ms"], rows),
        f"![TPOT]({args.name}.png)",
        "## CPU time per streamed token (us)",
        "User + system time of each side while it streamed, divided by the tokens: the Session's process; each "
        "server's processes (the one-process server's one, the server's and its engine process) and this one (the "
        "client). A forward that takes every core shares them with the rest.",
        md_table(["mode", "Session", "server", "its client", "one-process server", "its client"],
                 [[m, c["session"]["this process"], c["server"]["server"], c["server"]["client"],
                   c["one_process"]["server"], c["one_process"]["client"]]
                  for m, c in ((m, s["cpu_us_per_token"]) for m, s in summary.items())], digits=0),
        "## Targets", "\n".join(f"- {t['text']}" for t in targets), "## Machine", machine_md(info)])
    js, mdp = write_results(args.out_dir, args.name, {"results": summary, "targets": targets,
                                                      "max_tokens": args.max_tokens, "machine": info}, md)
    print(md)
    print(f"wrote {js} and {mdp}")
    return 0


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    modes = list(summary)
    labels = {"session": "Session", "server": "dsv3-serve", "one_process": "dsv3-serve, one process"}
    for i, name in enumerate(labels):
        ax.bar([m + (i - 1) * 0.27 for m in range(len(modes))], [ms(summary[m][name]["tpot_s"]) for m in modes],
               0.27, label=labels[name])
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel("TPOT (ms)")
    ax.set_title("TPOT at concurrency 1")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
