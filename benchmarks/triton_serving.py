"""TPOT, TTFT and output tokens/s through Triton (gRPC streaming to `ensemble`, or to `tensorrt_llm_bls` or the
legacy `tensorrt_llm` itself with --triton_model), plain vs MTP, at concurrency 1..32, next to the Python Session
at concurrency 1 (the serving overhead).

  python -m benchmarks.triton_serving [--quick] [--triton_model tensorrt_llm]

Each mode builds nothing new: one engine (build_engine from the shipped model), one filled model repository per
mode, one tritonserver per mode. Requests ignore eos (end_id -1) so every request streams exactly max_tokens
tokens; TTFT and TPOT are vLLM's, on the client's clock: TPOT = (last chunk - first chunk) / (max_tokens - 1),
the Session's likewise (when its handle yields the first and last outputs; same engine, prompts, max_tokens,
speculation and torch threads). At concurrency 1 the Session's requests and Triton's alternate, --rounds times,
so drift on the machine hits both alike. A request that fails is counted, its first error shown, and the script
exits 1 after writing the results.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import tritonclient.grpc as grpcclient

from benchmarks.common import (CpuTime, add_common_args, closed_loop_clients, comma_list, load_prompts,
                               machine_info, machine_md, md_table, mean, ms, parse_with_quick, ratio, request_ttft_tpot,
                               round_robin_by_source, run_tool, session_request, set_threads, target_line,
                               write_results)
from runtime.executors.session import Session
from runtime.io.tokenizer import Tokenizer
from serving.triton.client import text_inputs, token_id_inputs
from serving.triton.launcher import python_stubs, start_server
from serving.triton.model_repo import default_values, fill_model_repo

MODES = {"plain": dict(num_draft_tokens="0", speculation="off"),
         "mtp": dict(num_draft_tokens="3", speculation="adaptive")}
TRITON_MODELS = ("ensemble", "tensorrt_llm_bls", "tensorrt_llm")
Request = Callable[[str, int], dict[str, float]]  # (prompt, max_tokens) -> ttft_s, tpot_s, tokens


def response_times(url: str, model: str, inputs: list, output: str, timeout_s: float = 300.0) -> list[float]:
    """When each response with a non-empty `output` arrived (perf_counter), read in the gRPC stream's callback as
    C++ load generators (perf_analyzer, genai-perf) read it: the waiting thread wakes once a request rather than
    once a token, so the client takes less CPU from the server on a small machine. Raises RuntimeError with
    Triton's message."""
    times: list[float] = []
    errors: list[str] = []
    done = threading.Event()

    def on_response(result: grpcclient.InferResult | None, error: Any) -> None:
        at = time.perf_counter()
        if error is not None:
            errors.append(error.message())
            done.set()
            return
        values = result.as_numpy(output)
        if values is not None and values.size and (values.dtype != object or any(values.reshape(-1))):
            times.append(at)
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=on_response)
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        if not done.wait(timeout_s):
            raise RuntimeError(f"no final response within {timeout_s} s")
    finally:
        client.stop_stream()
        client.close()
    if errors:
        raise RuntimeError(errors[0])
    return times


def triton_request(url: str, model: str, tokenizer: Tokenizer) -> Request:
    """One streamed request to `model` (TTFT to the first response with text, or ids for tensorrt_llm, and TPOT
    after it: benchmarks.common.request_ttft_tpot); tensorrt_llm gets the ids preprocessing would make."""
    def send(prompt: str, max_tokens: int) -> dict[str, float]:
        sent = time.perf_counter()
        if model == "tensorrt_llm":
            times = response_times(url, model, token_id_inputs(tokenizer.encode(prompt), max_tokens, end_id=-1),
                                   "output_ids")
        else:
            times = response_times(url, model, text_inputs(prompt, max_tokens, end_id=-1), "text_output")
        if not times:
            raise RuntimeError(f"no tokens streamed for a {max_tokens}-token request")
        ttft, tpot = request_ttft_tpot(sent, times[0], times[-1], max_tokens)
        return {"ttft_s": ttft, "tpot_s": tpot, "tokens": max_tokens}
    return send


def closed_loop(send: Request, prompts: list[str], concurrency: int, n_requests: int, max_tokens: int) -> dict:
    """`concurrency` clients, each sending its next request when the last one finishes; a failed
    request is recorded (its error kept) and its client goes on with the next one."""
    results: list[dict[str, float]] = []
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            results.append(send(prompts[i % len(prompts)], max_tokens))
        except Exception as e:  # the server's message, e.g. an invalid parameter or a crashed model
            errors.append(f"request {i}: {type(e).__name__}: {e}")

    t0 = time.perf_counter()
    closed_loop_clients(n_requests, concurrency, one)
    wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": n_requests, "completed": len(results), "errors": errors[:5],
            "tpot_s": mean(r["tpot_s"] for r in results), "ttft_s": mean(r["ttft_s"] for r in results),
            "output_tok_s": sum(r["tokens"] for r in results) / wall, "wall_s": wall}


def merged(runs: list[dict]) -> dict:
    """Closed-loop runs of one level as one: means weighted by completed requests, throughput over all walls."""
    done = sum(r["completed"] for r in runs)

    def weighted(key: str) -> float | None:
        return sum(r[key] * r["completed"] for r in runs if r["completed"]) / done if done else None

    wall = sum(r["wall_s"] for r in runs)
    return {"concurrency": runs[0]["concurrency"], "requests": sum(r["requests"] for r in runs), "completed": done,
            "errors": [e for r in runs for e in r["errors"]][:5], "tpot_s": weighted("tpot_s"),
            "ttft_s": weighted("ttft_s"), "output_tok_s": sum(r["output_tok_s"] * r["wall_s"] for r in runs) / wall,
            "wall_s": wall}


def at_concurrency_1(send: Request, session: Session, prompts: list[str], rounds: int, max_tokens: int,
                     server_processes: dict[str, list[int]]) -> tuple[dict, float | None, dict[str, dict[str, float]]]:
    """Triton's closed loop at concurrency 1 and the Session's TPOT on the same prompts, alternating (the Session
    first in even rounds, Triton first in odd ones), and the CPU time each side used per streamed token: the
    Session's process; `server_processes`' and this one (the client) while Triton streamed."""
    runs, tpots = [], []
    cpu = CpuTime()
    for r in range(rounds):
        for side in (("session", "triton") if r % 2 == 0 else ("triton", "session")):
            if side == "triton":
                with cpu.span(side, server_processes, this_process="client"):
                    runs.append(closed_loop(send, prompts, 1, len(prompts), max_tokens))
            else:
                with cpu.span(side):
                    tpots += [session_request(session, p, max_tokens)[1] for p in prompts]
    return merged(runs), mean(tpots), cpu.per_token_us(rounds * len(prompts) * max_tokens)


def server_processes(server_pid: int) -> dict[str, list[int]]:
    """tritonserver's pid and its Python backend stubs' by model (the instance name without `_<i>_<device>`)."""
    groups: dict[str, list[int]] = {"tritonserver": [server_pid]}
    for pid, instance in python_stubs(server_pid).items():
        groups.setdefault(f"{instance.rsplit('_', 2)[0]} stub", []).append(pid)
    return groups


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--requests_per_level", type=int, default=0, help="0: max(8, 2 x concurrency)")
    p.add_argument("--name", default="triton")
    p.add_argument("--engine_process", choices=("true", "false"),
                   help="the tensorrt_llm model's engine_process (default: the model's, on CUDA devices only)")
    p.add_argument("--triton_model", choices=TRITON_MODELS, default="ensemble",
                   help="the model the clients call (tensorrt_llm: token ids in and out, no text processing)")
    p.add_argument("--rounds", type=int, default=3,
                   help="concurrency 1: rounds of the Session's requests and Triton's, alternating")
    args = parse_with_quick(p, None, dict(concurrency="1,2", max_tokens=16, rounds=1))
    if args.dtype is not None:
        p.error(f"--dtype: the Triton models run the engine in its build dtype; not settable here, got {args.dtype!r}")
    levels = sorted(set(comma_list(p, "--concurrency", args.concurrency)))
    if levels[0] != 1:
        p.error(f"--concurrency: levels must be >= 1 and include 1 (the session comparison), got {args.concurrency}")
    if args.max_tokens < 2:
        p.error(f"--max_tokens: must be >= 2 (TPOT needs a token after the first), got {args.max_tokens}")
    if args.requests_per_level < 0:
        p.error(f"--requests_per_level: must be >= 0 (0: max(8, 2 x concurrency)), got {args.requests_per_level}")
    if args.rounds < 1:
        p.error(f"--rounds: must be >= 1, got {args.rounds}")
    set_threads(args.threads)
    prompts = [x["text"] for x in round_robin_by_source(load_prompts(args.model), 16)]

    def level_prompts(c: int) -> list[str]:
        return [prompts[i % len(prompts)] for i in range(args.requests_per_level or max(8, 2 * c))]

    work = Path(tempfile.mkdtemp(prefix="bench-triton-"))
    try:
        engine = work / "engine"
        run_tool([Path(sys.executable).with_name("build_engine"), "--model_dir", args.model, "--output_dir",
                  engine, "--max_batch_size", str(max(levels)), "--max_draft_len", "3", "--max_seq_len", "1024"])
        tokenizer = Tokenizer.from_dir(engine)
        results: dict[str, dict] = {}
        for mode, values in MODES.items():
            repo = fill_model_repo(work / f"repo-{mode}", default_values(
                engine, **values, **({"torch_threads": str(args.threads)} if args.threads else {}),
                **({"device": args.device} if args.device != "cpu" else {}),
                **({"engine_process": args.engine_process} if args.engine_process else {})))
            with Session(engine, num_draft_tokens=int(values["num_draft_tokens"]), speculation="adaptive",
                         device=args.device) as session, start_server(repo, log_file=work / f"{mode}.log") as server:
                send = triton_request(server.grpc_url, args.triton_model, tokenizer)
                send(prompts[0], 8)  # warm-ups
                session_request(session, prompts[0], 8)
                first, session_tpot, cpu = at_concurrency_1(send, session, level_prompts(1), args.rounds,
                                                            args.max_tokens, server_processes(server.process.pid))
                results[mode] = {"levels": [first] + [closed_loop(send, level_prompts(c), c, len(level_prompts(c)),
                                                                  args.max_tokens) for c in levels[1:]],
                                 "session_tpot_s": session_tpot, "cpu_us_per_token_c1": cpu}
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
    cpu_columns = sorted(results["plain"]["cpu_us_per_token_c1"]["triton"], key=lambda c: (c == "client", c))
    info = machine_info()
    md = "\n\n".join([
        f"# Triton (gRPC streaming, {args.triton_model}): plain vs MTP (adaptive, up to 3 drafts)",
        f"{args.max_tokens} tokens per request (eos ignored), closed loop; TPOT and TTFT are means in ms. "
        f"Concurrency 1: {args.rounds} rounds of the Session's requests and Triton's, alternating.",
        md_table(["mode", "concurrency", "TPOT ms", "TTFT ms", "output tok/s", "done"], rows),
        "## MTP vs plain", md_table(["concurrency", "TPOT speed-up", "throughput ratio"], speedups),
        "## Serving overhead at concurrency 1 (Triton TPOT / session TPOT; target <= 1.15)",
        md_table(["mode", "session TPOT ms", "Triton TPOT ms", "ratio"],
                 [[m, ms(r["session_tpot_s"]), ms(r["levels"][0]["tpot_s"]), r["triton_over_session_tpot_c1"]]
                  for m, r in results.items()]),
        "## CPU time per streamed token at concurrency 1 (us)",
        "User + system time over the concurrency-1 rounds, divided by the tokens streamed: the Session's process "
        "while it generated; each Triton process and this one (the client) while Triton streamed. A forward that "
        "takes every core shares them with the rest.",
        md_table(["mode", "Session", *cpu_columns, "Triton total"],
                 [[m, r["cpu_us_per_token_c1"]["session"]["this process"],
                   *(r["cpu_us_per_token_c1"]["triton"][c] for c in cpu_columns),
                   sum(r["cpu_us_per_token_c1"]["triton"].values())] for m, r in results.items()], digits=0),
        "## Targets", "\n".join(f"- {t['text']}" for t in targets), "## Machine", machine_md(info)])
    js, mdp = write_results(args.out_dir, args.name, {"results": results, "speedups": speedups, "targets": targets,
                                                      "max_tokens": args.max_tokens, "triton_model": args.triton_model,
                                                      "rounds": args.rounds, "machine": info}, md)
    print(md)
    print(f"wrote {js} and {mdp}")
    failed = [(mode, lv) for mode, r in results.items() for lv in r["levels"] if lv["completed"] < lv["requests"]]
    for mode, lv in failed:
        print(f"{mode}, concurrency {lv['concurrency']}: {lv['requests'] - lv['completed']} of {lv['requests']} "
              f"requests failed; first: {lv['errors'][0]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
