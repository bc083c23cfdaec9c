"""The README's main job: build an FP8 engine from the shipped model, serve it with Triton and stream one
request over gRPC, then serve it with the OpenAI-compatible server (dsv3-serve) and stream one chat completion
through the `openai` client; print each text with its MTP acceptance, stop each server."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from serving.openai_server.process import start_dsv3_serve
from serving.triton.client import stream_generate
from serving.triton.launcher import start_server
from serving.triton.model_repo import default_values, fill_model_repo

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model_dir", type=Path, default=ROOT / "models" / "deepseek-v3-mini")
    p.add_argument("--engine_dir", type=Path, default=ROOT / "engines" / "deepseek-v3-mini")
    p.add_argument("--prompt", default="def fibonacci(n):\n")
    p.add_argument("--max_tokens", type=int, default=96)
    p.add_argument("--num_draft_tokens", type=int, default=3)
    args = p.parse_args()

    print(f"== build_engine {args.model_dir} -> {args.engine_dir}", flush=True)
    subprocess.run([Path(sys.executable).with_name("build_engine"), "--model_dir", args.model_dir, "--output_dir",
                    args.engine_dir, "--max_draft_len", str(args.num_draft_tokens), "--force"], check=True)
    repo = args.engine_dir.parent / "triton_repo"
    shutil.rmtree(repo, ignore_errors=True)
    fill_model_repo(repo, default_values(args.engine_dir.resolve(), num_draft_tokens=str(args.num_draft_tokens),
                                         speculation="fixed"))
    print(f"== tritonserver --model-repository={repo}", flush=True)
    t0 = time.perf_counter()
    with start_server(repo, log_file=args.engine_dir.parent / "tritonserver.log") as server:
        print(f"ready in {time.perf_counter() - t0:.1f} s: gRPC {server.grpc_url}, HTTP {server.http_url}, "
              f"metrics {server.metrics_url}", flush=True)
        print(f"== streaming {args.max_tokens} tokens over gRPC\n{args.prompt}", end="", flush=True)
        stats, n = {}, 0
        for chunk in stream_generate(server.grpc_url, args.prompt, args.max_tokens, perf_metrics=True):
            print(chunk.text, end="", flush=True)
            stats, n = chunk.stats or stats, n + 1
        print(f"\n== MTP: {int(stats.get('total_accepted_draft_tokens', 0))} of "
              f"{int(stats.get('total_draft_tokens', 0))} draft tokens accepted "
              f"(acceptance {stats.get('acceptance_rate', 0):.2f}); {n} streamed responses")
    print("== server stopped")
    openai_server(args)
    return 0


def openai_server(args: argparse.Namespace) -> None:
    """dsv3-serve on the same engine, one streamed chat completion through the official client."""
    import openai

    print(f"== dsv3-serve {args.engine_dir}", flush=True)
    server = start_dsv3_serve(args.engine_dir, "--num_draft_tokens", str(args.num_draft_tokens), "--speculation",
                              "fixed", "--log_level", "warning")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        messages = [{"role": "user", "content": args.prompt}]
        print(f"== streaming a chat completion of {args.max_tokens} tokens through the openai client\n", end="")
        usage = None
        for chunk in client.chat.completions.create(model=args.engine_dir.name, messages=messages,
                                                    max_tokens=args.max_tokens, temperature=0, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices:
                print(chunk.choices[0].delta.content or "", end="", flush=True)
            usage = chunk.usage or usage
        spec = usage.model_extra["speculative_decoding"]
        print(f"\n== MTP: {spec['total_accepted_draft_tokens']} of {spec['total_draft_tokens']} draft tokens accepted "
              f"(acceptance {spec['acceptance_rate']:.2f}); {usage.completion_tokens} tokens in "
              f"{spec['decode_steps']} steps")
    finally:
        server.stop()
    print("== server stopped")


if __name__ == "__main__":
    sys.exit(main())
