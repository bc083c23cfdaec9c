"""TPOT, TTFT and output tokens/s through Triton (gRPC streaming to `ensemble`), plain vs MTP,
at concurrency 1..32, next to the Python session at concurrency 1 (the serving overhead).

  python scripts/benchmark_triton.py [--quick]

Each mode builds nothing new: one engine (build_engine from the shipped model), one filled model
repository per mode, one tritonserver per mode. Requests ignore eos (end_id -1) so every request
streams exactly max_tokens tokens; TPOT = (last chunk - first chunk) / (max_tokens - 1).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (ROOT, add_common_args, closed_loop_clients, comma_list, load_prompts,  # noqa: E402
                          machine_info, machine_md, md_table, mean, ratio, round_robin_by_source,
                          run_tool, set_threads, target_line, write_results)
from launch_triton_server import start_server  # noqa: E402
from make_model_repo import default_values, fill_model_repo  # noqa: E402
from triton_client import stream_generate  # noqa: E402

MODES = {"plain": dict(num_draft_tokens="0", speculation="off"),
         "mtp": dict(num_draft_tokens="3", speculation="adaptive")}


def one_request(url: str, prompt: str, max_tokens: int) -> dict[str, float]:
    """TTFT to the first text chunk; TPOT over the tokens after it, as the runtime's stats count them
    (the first chunk holds 1 + its accepted drafts when one step emitted several tokens)."""
    sent = time.perf_counter()
    chunks = [c for c in stream_generate(url, prompt, max_tokens, end_id=-1) if c.text]
    after_first = max_tokens - 1 - int(chunks[0].stats.get("total_accepted_draft_tokens", 0))
    return {"ttft_s": chunks[0].at - sent, "tpot_s": (chunks[-1].at - chunks[0].at) / after_first,
            "tokens": max_tokens}


def closed_loop(url: str, prompts: list[str], concurrency: int, n_requests: int, max_tokens: int) -> dict:
    """`concurrency` clients, each sending its next request when the last one finishes."""
    results: list[dict[str, float]] = []
    t0 = time.perf_counter()
    closed_loop_clients(n_requests, concurrency,
                        lambda i: results.append(one_request(url, prompts[i % len(prompts)], max_tokens)))
    wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": len(results), "tpot_s": mean(r["tpot_s"] for r in results),
            "ttft_s": mean(r["ttft_s"] for r in results), "output_tok_s": sum(r["tokens"] for r in results) / wall}


def session_tpot(engine_dir: Path, prompts: list[str], max_tokens: int, k: int, device: str = "cpu") -> float:
    from runtime import SamplingParams, Session  # noqa: WPS433

    with Session(engine_dir, num_draft_tokens=k, speculation="adaptive", device=device) as s:
        s.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        return mean(s.generate([p], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].stats.tpot_s
                    for p in prompts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--requests_per_level", type=int, default=0, help="0: max(8, 2 x concurrency)")
    args = p.parse_args()
    if args.dtype is not None:
        p.error(f"--dtype: the Triton models run the engine in its build dtype; not settable here, got {args.dtype!r}")
    levels = [1, 2] if args.quick else sorted(set(comma_list(p, "--concurrency", args.concurrency)))
    if levels[0] != 1:
        p.error(f"--concurrency: levels must be >= 1 and include 1 (the session comparison), got {args.concurrency}")
    if args.max_tokens < 2:
        p.error(f"--max_tokens: must be >= 2 (TPOT needs a token after the first), got {args.max_tokens}")
    if args.requests_per_level < 0:
        p.error(f"--requests_per_level: must be >= 0 (0: max(8, 2 x concurrency)), got {args.requests_per_level}")
    set_threads(args.threads)
    max_tokens = 16 if args.quick else args.max_tokens
    prompts = [x["text"] for x in round_robin_by_source(load_prompts(args.model), 16)]

    work = Path(tempfile.mkdtemp(prefix="bench-triton-"))
    try:
        engine = work / "engine"
        run_tool([Path(sys.executable).with_name("build_engine"), "--model_dir", args.model, "--output_dir",
                  engine, "--max_batch_size", str(max(levels)), "--max_draft_len", "3"])
        results: dict[str, dict] = {}
        for mode, values in MODES.items():
            repo = fill_model_repo(work / f"repo-{mode}", default_values(
                engine, **values, **({"torch_threads": str(args.threads)} if args.threads else {}),
                **({"device": args.device} if args.device != "cpu" else {})))
            with start_server(repo, log_file=work / f"{mode}.log") as server:
                one_request(server.grpc_url, prompts[0], 8)  # warm-up
                results[mode] = {"levels": [closed_loop(server.grpc_url, prompts, c,
                                                        args.requests_per_level or max(8, 2 * c), max_tokens)
                                            for c in levels]}
            at_c1 = args.requests_per_level or max(8, 2 * levels[0])  # the prompts Triton ran at the first level
            results[mode]["session_tpot_s"] = session_tpot(engine, [prompts[i % len(prompts)] for i in range(at_c1)],
                                                           max_tokens, int(values["num_draft_tokens"]), args.device)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows, targets = [], []
    for mode, r in results.items():
        for lv in r["levels"]:
            rows.append([mode, lv["concurrency"], lv["tpot_s"] * 1e3, lv["ttft_s"] * 1e3, lv["output_tok_s"]])
        overhead = ratio(r["levels"][0]["tpot_s"], r["session_tpot_s"])
        r["triton_over_session_tpot_c1"] = overhead
        targets.append(target_line(f"{mode}: session TPOT / Triton TPOT at concurrency 1 (Triton <= 1.15x session)",
                                   ratio(r["session_tpot_s"], r["levels"][0]["tpot_s"]), round(1 / 1.15, 3)))
    speedups = [[c, ratio(results["plain"]["levels"][i]["tpot_s"], results["mtp"]["levels"][i]["tpot_s"]),
                 ratio(results["mtp"]["levels"][i]["output_tok_s"], results["plain"]["levels"][i]["output_tok_s"])]
                for i, c in enumerate(levels)]
    info = machine_info()
    md = "\n\n".join([
        "# Triton (gRPC streaming, ensemble): plain vs MTP (adaptive, up to 3 drafts)",
        f"{max_tokens} tokens per request (eos ignored), closed loop; TPOT and TTFT are means in ms.",
        md_table(["mode", "concurrency", "TPOT ms", "TTFT ms", "output tok/s"], rows),
        "## MTP vs plain", md_table(["concurrency", "TPOT speed-up", "throughput ratio"], speedups),
        "## Serving overhead at concurrency 1 (Triton TPOT / session TPOT; target <= 1.15)",
        md_table(["mode", "session TPOT ms", "Triton TPOT ms", "ratio"],
                 [[m, r["session_tpot_s"] * 1e3, r["levels"][0]["tpot_s"] * 1e3, r["triton_over_session_tpot_c1"]]
                  for m, r in results.items()]),
        "## Targets", "\n".join(f"- {t['text']}" for t in targets), "## Machine", machine_md(info)])
    name = "triton_quick" if args.quick else "triton"
    js, mdp = write_results(args.out_dir, name, {"results": results, "speedups": speedups, "targets": targets,
                                                 "max_tokens": max_tokens, "machine": info}, md)
    print(md)
    print(f"wrote {js} and {mdp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
