"""TPOT, TTFT and output tokens/s through Triton (gRPC streaming to `ensemble`), plain vs MTP,
at concurrency 1..32, next to the Python session at concurrency 1 (the serving overhead).

  python -m benchmarks.triton_serving [--quick]

Each mode builds nothing new: one engine (build_engine from the shipped model), one filled model
repository per mode, one tritonserver per mode. Requests ignore eos (end_id -1) so every request
streams exactly max_tokens tokens; TTFT and TPOT are vLLM's, on the client's clock: TPOT =
(last chunk - first chunk) / (max_tokens - 1). A request that fails is counted, its first error
shown, and the script exits 1 after writing the results.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (add_common_args, closed_loop_clients, comma_list, load_prompts, machine_info, machine_md,
                               md_table, mean, ms, parse_with_quick, ratio, request_ttft_tpot, round_robin_by_source,
                               run_tool, set_threads, target_line, write_results)
from serving.launcher import start_server
from serving.model_repo import default_values, fill_model_repo
from serving.client import stream_generate

MODES = {"plain": dict(num_draft_tokens="0", speculation="off"),
         "mtp": dict(num_draft_tokens="3", speculation="adaptive")}


def one_request(url: str, prompt: str, max_tokens: int) -> dict[str, float]:
    """TTFT to the first text chunk and TPOT after it (benchmarks.common.request_ttft_tpot)."""
    sent = time.perf_counter()
    chunks = [c for c in stream_generate(url, prompt, max_tokens, end_id=-1, model="ensemble") if c.text]
    if not chunks:
        raise RuntimeError(f"no text streamed for a {max_tokens}-token request")
    ttft, tpot = request_ttft_tpot(sent, chunks[0].at, chunks[-1].at, max_tokens)
    return {"ttft_s": ttft, "tpot_s": tpot, "tokens": max_tokens}


def closed_loop(url: str, prompts: list[str], concurrency: int, n_requests: int, max_tokens: int) -> dict:
    """`concurrency` clients, each sending its next request when the last one finishes; a failed
    request is recorded (its error kept) and its client goes on with the next one."""
    results: list[dict[str, float]] = []
    errors: list[str] = []

    def send(i: int) -> None:
        try:
            results.append(one_request(url, prompts[i % len(prompts)], max_tokens))
        except Exception as e:  # the server's message, e.g. an invalid parameter or a crashed model
            errors.append(f"request {i}: {type(e).__name__}: {e}")

    t0 = time.perf_counter()
    closed_loop_clients(n_requests, concurrency, send)
    wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": n_requests, "completed": len(results), "errors": errors[:5],
            "tpot_s": mean(r["tpot_s"] for r in results), "ttft_s": mean(r["ttft_s"] for r in results),
            "output_tok_s": sum(r["tokens"] for r in results) / wall}



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
    p.add_argument("--name", default="triton")
    p.add_argument("--engine_process", choices=("true", "false"),
                   help="the tensorrt_llm model's engine_process (default: the model's, on CUDA devices only)")
    args = parse_with_quick(p, None, dict(concurrency="1,2", max_tokens=16))
    if args.dtype is not None:
        p.error(f"--dtype: the Triton models run the engine in its build dtype; not settable here, got {args.dtype!r}")
    levels = sorted(set(comma_list(p, "--concurrency", args.concurrency)))
    if levels[0] != 1:
        p.error(f"--concurrency: levels must be >= 1 and include 1 (the session comparison), got {args.concurrency}")
    if args.max_tokens < 2:
        p.error(f"--max_tokens: must be >= 2 (TPOT needs a token after the first), got {args.max_tokens}")
    if args.requests_per_level < 0:
        p.error(f"--requests_per_level: must be >= 0 (0: max(8, 2 x concurrency)), got {args.requests_per_level}")
    set_threads(args.threads)
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
                **({"device": args.device} if args.device != "cpu" else {}),
                **({"engine_process": args.engine_process} if args.engine_process else {})))
            with start_server(repo, log_file=work / f"{mode}.log") as server:
                one_request(server.grpc_url, prompts[0], 8)  # warm-up
                results[mode] = {"levels": [closed_loop(server.grpc_url, prompts, c,
                                                        args.requests_per_level or max(8, 2 * c), args.max_tokens)
                                            for c in levels]}
            at_c1 = args.requests_per_level or max(8, 2 * levels[0])  # the prompts Triton ran at the first level
            results[mode]["session_tpot_s"] = session_tpot(engine, [prompts[i % len(prompts)] for i in range(at_c1)],
                                                           args.max_tokens, int(values["num_draft_tokens"]), args.device)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows, targets = [], []
    for mode, r in results.items():
        for lv in r["levels"]:
            rows.append([mode, lv["concurrency"], ms(lv["tpot_s"]), ms(lv["ttft_s"]), lv["output_tok_s"],
                         f"{lv['completed']}/{lv['requests']}"])
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
        f"{args.max_tokens} tokens per request (eos ignored), closed loop; TPOT and TTFT are means in ms.",
        md_table(["mode", "concurrency", "TPOT ms", "TTFT ms", "output tok/s", "done"], rows),
        "## MTP vs plain", md_table(["concurrency", "TPOT speed-up", "throughput ratio"], speedups),
        "## Serving overhead at concurrency 1 (Triton TPOT / session TPOT; target <= 1.15)",
        md_table(["mode", "session TPOT ms", "Triton TPOT ms", "ratio"],
                 [[m, ms(r["session_tpot_s"]), ms(r["levels"][0]["tpot_s"]), r["triton_over_session_tpot_c1"]]
                  for m, r in results.items()]),
        "## Targets", "\n".join(f"- {t['text']}" for t in targets), "## Machine", machine_md(info)])
    js, mdp = write_results(args.out_dir, args.name, {"results": results, "speedups": speedups, "targets": targets,
                                                      "max_tokens": args.max_tokens, "machine": info}, md)
    print(md)
    print(f"wrote {js} and {mdp}")
    failed = [(mode, lv) for mode, r in results.items() for lv in r["levels"] if lv["completed"] < lv["requests"]]
    for mode, lv in failed:
        print(f"{mode}, concurrency {lv['concurrency']}: {lv['requests'] - lv['completed']} of {lv['requests']} "
              f"requests failed; first: {lv['errors'][0]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
