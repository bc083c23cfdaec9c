"""Check the --backend trtllm path end to end on a GPU host with TensorRT-LLM.

    check_trtllm                       # build models/deepseek-v3-mini, executor + Triton
    check_trtllm --skip_triton --engine_dir /engines/dsv3-trt

1. builds the shipped model with `build_engine --backend trtllm` (a subprocess; --engine_dir skips it);
2. generates greedily with each draft length (default 0 and 3) through the executor
   (runtime.executors.trtllm.TrtllmExecutor, one request at a time) and checks that every draft
   length gives the same tokens as the first;
3. unless --skip_triton: writes the legacy model repository for the engine as make_model_repo does,
   starts tritonserver with serving/triton/launcher.py and sends the same prompts to `ensemble` over gRPC
   streaming (tritonclient), checking that the text equals the executor's;
4. prints TPOT (mean time per output token after the first) and the draft acceptance rate.

Exit status: 0 all outputs equal; 1 a mismatch or a failed step; 2 TensorRT-LLM (or tritonclient)
is not installed here: run it inside NVIDIA's TensorRT-LLM container or the Triton TensorRT-LLM
container (see docs/trtllm-backend.md).

Step 3 needs the Python backend's environment to import tensorrt_llm and this repository.
"""

from __future__ import annotations

import argparse
import json
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "deepseek-v3-mini"
FALLBACK_PROMPTS = ["def fib(n):", "In the beginning God created the heaven and the earth.",
                    "import os\nimport sys\n", "for i in range(10):"]


@dataclass
class Run:
    """One prompt's greedy output on one path."""

    prompt: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    tpot_s: float | None = None
    drafted: int = 0
    accepted: int = 0
    error: str | None = None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_dir", type=Path, default=DEFAULT_MODEL, help="HF checkpoint to build")
    p.add_argument("--engine_dir", type=Path, help="an existing --backend trtllm engine (skips the build)")
    p.add_argument("--work_dir", type=Path, help="where the engine, model repositories and server logs go "
                   "(default: a temp dir, removed when the check passes)")
    p.add_argument("--draft_lens", default="0,3", help="comma-separated draft lengths; the first is the reference")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--num_prompts", type=int, default=8)
    p.add_argument("--prompts_file", type=Path, help="JSON list of strings or of {'text': ...} "
                                                      "(default: <model_dir>/heldout_prompts.json)")
    p.add_argument("--max_seq_len", type=int, default=1024)
    p.add_argument("--tp_size", type=int, default=1)
    p.add_argument("--ep_size", type=int, default=1)
    p.add_argument("--free_gpu_memory_fraction", type=float, default=0.5,
                   help="kv_cache_config override for both paths (one engine at a time holds the GPU)")
    p.add_argument("--skip_triton", action="store_true")
    p.add_argument("--tritonserver", type=Path, help="tritonserver binary (default: the container's or pytriton's)")
    p.add_argument("--json_out", type=Path, help="write every output and timing here")
    args = p.parse_args(argv)
    try:
        args.draft_lens = [int(x) for x in args.draft_lens.split(",") if x.strip()]
    except ValueError:
        p.error(f"--draft_lens {args.draft_lens!r}: expected integers like 0,3")
    if not args.draft_lens or min(args.draft_lens) < 0:
        p.error("--draft_lens needs at least one integer >= 0")
    return args


def load_prompts(args: argparse.Namespace) -> list[str]:
    path = args.prompts_file or args.model_dir / "heldout_prompts.json"
    if not path.is_file():
        return FALLBACK_PROMPTS[: args.num_prompts]
    items = json.loads(path.read_text())
    texts = [x["text"] if isinstance(x, dict) else x for x in items]
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise SystemExit(f"{path}: expected a list of non-empty strings or of {{'text': ...}} objects")
    return texts[: args.num_prompts]


def build(args: argparse.Namespace, work: Path) -> Path:
    out = work / "engine"
    cmd = [sys.executable, "-m", "builder.cli", "--model_dir", str(args.model_dir), "--output_dir", str(out),
           "--backend", "trtllm", "--max_draft_len", str(max(args.draft_lens)), "--max_seq_len",
           str(args.max_seq_len), "--tp_size", str(args.tp_size), "--ep_size", str(args.ep_size), "--force"]
    print("+ " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True)
    print(f"built {out} in {time.monotonic() - t0:.1f} s", flush=True)
    return out


def executor_runs(engine: Path, k: int, prompts: list[str], args: argparse.Namespace) -> list[Run]:
    """Greedy, one request at a time (TPOT at batch 1), after one warm-up request."""
    from runtime.executors.base import ExecutorConfig
    from runtime.core.sampling_params import SamplingParams
    from runtime.executors.trtllm import TrtllmExecutor

    config = ExecutorConfig(num_draft_tokens=k, speculation="fixed")
    overrides = {"kv_cache_config": {"free_gpu_memory_fraction": args.free_gpu_memory_fraction}}
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    runs = []
    with TrtllmExecutor(engine, config, llm_overrides=overrides) as ex:
        ex.submit(ex.tokenizer.encode(prompts[0]), SamplingParams(max_tokens=8, ignore_eos=True)).result(600)
        for prompt in prompts:
            out = ex.submit(ex.tokenizer.encode(prompt), params).result(600)
            run = Run(prompt, out.token_ids, out.text, out.stats.tpot_s, out.stats.num_draft_tokens,
                      out.stats.num_accepted_draft_tokens)
            if out.finish_reason not in ("length", "stop"):
                run.error = f"finish_reason {out.finish_reason}"
            runs.append(run)
        if ex.reports_draft_stats is False and k:
            print("note: TensorRT-LLM reported no speculative-decoding metrics; acceptance shows as 0")
    return runs


def triton_runs(engine: Path, k: int, prompts: list[str], n_tokens: list[int], work: Path,
                args: argparse.Namespace) -> list[Run]:
    """The prompts through `ensemble` over gRPC streaming, one at a time."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from serving.triton.launcher import start_server
    from serving.triton.model_repo import default_values, fill_model_repo

    repo = work / f"triton_repo_k{k}"
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    fill_model_repo(repo, default_values(engine, triton_max_batch_size="8", num_draft_tokens=str(k),
                                         speculation="fixed", bls_instance_count="1",
                                         cancellation_check_period_ms="20", stats_check_period_ms="100"))

    def inputs(prompt: str) -> list:
        arrays = {"text_input": np.array([[prompt.encode()]], dtype=object),
                  "max_tokens": np.array([[args.max_tokens]], np.int32), "stream": np.array([[True]]),
                  "exclude_input_in_output": np.array([[True]]), "end_id": np.array([[-1]], np.int32)}
        kinds = {np.dtype(object): "BYTES", np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL"}
        out = []
        for name, arr in arrays.items():
            i = grpcclient.InferInput(name, list(arr.shape), kinds[arr.dtype])
            i.set_data_from_numpy(arr)
            out.append(i)
        return out

    runs = []
    log = work / f"tritonserver_k{k}.log"
    print(f"starting tritonserver on {repo} (log {log})", flush=True)
    with start_server(repo, log_file=log, tritonserver=args.tritonserver, ready_timeout_s=1800) as server:
        for prompt, n in zip(prompts, n_tokens):
            client = grpcclient.InferenceServerClient(server.grpc_url)
            responses: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: responses.put((result, error, time.perf_counter())))
            run, chunks, times = Run(prompt), [], []
            try:
                client.async_stream_infer("ensemble", inputs(prompt), enable_empty_final_response=True)
                while True:
                    result, error, at = responses.get(timeout=600)
                    if error is not None:
                        run.error = error.message()
                        break
                    text = result.as_numpy("text_output")
                    if text is not None and text.size:
                        chunks += [t for t in text.reshape(-1)]
                        times.append(at)
                    for name, attr in (("total_draft_tokens", "drafted"), ("total_accepted_draft_tokens", "accepted")):
                        if result.as_numpy(name) is not None:
                            setattr(run, attr, int(result.as_numpy(name).item()))
                    if result.get_response().parameters["triton_final_response"].bool_param:
                        break
            finally:
                client.stop_stream()
                client.close()
            run.text = b"".join(c if isinstance(c, bytes) else str(c).encode() for c in chunks).decode("utf-8", "replace")
            if len(times) > 1 and n > 1:
                run.tpot_s = (times[-1] - times[0]) / (n - 1)
            runs.append(run)
    return runs


def first_difference(a: list[Any] | str, b: list[Any] | str) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def summary(name: str, runs: list[Run]) -> dict[str, Any]:
    tpots = [r.tpot_s for r in runs if r.tpot_s is not None]
    drafted, accepted = sum(r.drafted for r in runs), sum(r.accepted for r in runs)
    s = {"path": name, "tpot_ms": 1000 * sum(tpots) / len(tpots) if tpots else None,
         "acceptance_rate": accepted / drafted if drafted else None, "draft_tokens": drafted,
         "accepted_draft_tokens": accepted, "errors": sum(1 for r in runs if r.error)}
    tpot = f"{s['tpot_ms']:.2f} ms" if s["tpot_ms"] is not None else "n/a"
    acc = f"{s['acceptance_rate']:.3f} ({accepted}/{drafted})" if drafted else "n/a (no drafts reported)"
    print(f"{name:<22} TPOT {tpot:>10}   acceptance {acc}   errors {s['errors']}", flush=True)
    return s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from runtime.executors.trtllm_api import TensorRTLLMUnavailable, import_tensorrt_llm

    try:
        trtllm = import_tensorrt_llm()
    except TensorRTLLMUnavailable as e:
        print(f"check_trtllm: {e}", file=sys.stderr)
        return 2
    if not args.skip_triton:
        try:
            import tritonclient.grpc  # noqa: F401
        except ImportError:
            print("check_trtllm: tritonclient is not installed (pip install 'tritonclient[grpc]'), "
                  "or pass --skip_triton", file=sys.stderr)
            return 2
    print(f"tensorrt_llm {getattr(trtllm, '__version__', '?')}", flush=True)

    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        return check(args, args.work_dir)
    work = Path(tempfile.mkdtemp(prefix="check_trtllm-"))
    status = 1
    try:
        status = check(args, work)
    finally:
        if status == 0:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"check_trtllm: kept {work} (engine, model repositories, server logs) for inspection", file=sys.stderr)
    return status


def check(args: argparse.Namespace, work: Path) -> int:
    """Build (unless --engine_dir), run every path and compare; 0 when all agree. `work` holds what it writes."""
    try:
        engine = args.engine_dir or build(args, work)
    except subprocess.CalledProcessError as e:
        print(f"check_trtllm: build_engine failed with status {e.returncode}", file=sys.stderr)
        return 1
    prompts = load_prompts(args)
    print(f"{len(prompts)} prompts, greedy, {args.max_tokens} tokens each, draft lengths {args.draft_lens}", flush=True)

    ok = True
    results: dict[str, Any] = {"engine": str(engine), "draft_lens": args.draft_lens, "paths": {}, "summary": []}
    executor: dict[int, list[Run]] = {}
    for k in args.draft_lens:
        try:
            executor[k] = executor_runs(engine, k, prompts, args)
        except Exception as e:  # report and go on to what else can be checked
            print(f"check_trtllm: the executor with k={k} failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        results["summary"].append(summary(f"executor k={k}", executor[k]))
        results["paths"][f"executor_k{k}"] = [r.__dict__ for r in executor[k]]
        ok &= not any(r.error for r in executor[k])

    ref_k = args.draft_lens[0]
    ref_tpot = results["summary"][0]["tpot_ms"]
    for s in results["summary"][1:]:
        if ref_tpot and s["tpot_ms"]:
            print(f"TPOT {s['path']} vs executor k={ref_k}: {ref_tpot / s['tpot_ms']:.2f}x faster", flush=True)
    for k in args.draft_lens[1:]:
        for ref, run in zip(executor[ref_k], executor[k]):
            if run.token_ids != ref.token_ids:
                ok = False
                i = first_difference(ref.token_ids, run.token_ids)
                print(f"MISMATCH executor k={k} vs k={ref_k} at output token {i} for prompt {run.prompt[:40]!r}")
    if len(args.draft_lens) > 1:
        print(f"greedy equal across draft lengths (executor): {ok}", flush=True)

    if not args.skip_triton:
        for k in args.draft_lens:
            try:
                runs = triton_runs(engine, k, prompts, [len(r.token_ids) for r in executor[k]], work, args)
            except Exception as e:
                print(f"check_trtllm: Triton with k={k} failed: {type(e).__name__}: {e}", file=sys.stderr)
                return 1
            results["summary"].append(summary(f"triton ensemble k={k}", runs))
            results["paths"][f"triton_k{k}"] = [r.__dict__ for r in runs]
            for ref, run in zip(executor[k], runs):
                if run.error or run.text != ref.text:
                    ok = False
                    where = run.error or f"first differing character {first_difference(ref.text, run.text)}"
                    print(f"MISMATCH triton k={k} vs executor k={k} for prompt {run.prompt[:40]!r}: {where}")
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
