"""Stream text over gRPC, the way TensorRT-LLM's Triton clients do, from `tensorrt_llm_bls` by default: with
Triton 2.51 (the newest server a package registry offers here) a cancelled or disconnected `ensemble` stream
does not reach the engine, which generates on to max_tokens; the BLS passes cancellation on.

  triton_client --url 127.0.0.1:8001 --max_tokens 64 "def fibonacci(n):"
"""

from __future__ import annotations

import argparse
import queue
import sys
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import tritonclient.grpc as grpcclient

STREAM_TIMEOUT_S = 300.0  # the longest wait for a response of a stream

@dataclass
class StreamChunk:
    text: str  # this response's text delta
    stats: dict[str, float] = field(default_factory=dict)  # acceptance_rate, total_*_draft_tokens


def _input(name: str, value: np.ndarray, dtype: str) -> grpcclient.InferInput:
    i = grpcclient.InferInput(name, list(value.shape), dtype)
    i.set_data_from_numpy(value)
    return i


def text_inputs(prompt: str, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                end_id: int | None = None, perf_metrics: bool = False) -> list[grpcclient.InferInput]:
    """A streamed request of the text models (`ensemble`, `tensorrt_llm_bls`): end_id -1 ignores eos, as
    TensorRT-LLM's clients do; perf_metrics asks for the MTP drafting stats with each response."""
    inputs = [
        _input("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
        _input("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
        _input("stream", np.array([[True]]), "BOOL"),
        _input("temperature", np.array([[temperature]], dtype=np.float32), "FP32"),
    ]
    if temperature > 0:  # TensorRT-LLM decodes greedily unless top_k or top_p is set: sample from all tokens
        inputs.append(_input("top_p", np.array([[1.0]], dtype=np.float32), "FP32"))
    if seed is not None:
        inputs.append(_input("seed", np.array([[seed]], dtype=np.uint64), "UINT64"))
    if end_id is not None:
        inputs.append(_input("end_id", np.array([[end_id]], dtype=np.int32), "INT32"))
    if perf_metrics:
        inputs.append(_input("return_perf_metrics", np.array([[True]]), "BOOL"))
    return inputs


def token_id_inputs(prompt_ids: list[int], max_tokens: int, end_id: int | None = None) -> list[grpcclient.InferInput]:
    """A streamed greedy request of the legacy `tensorrt_llm` model itself: token ids in and out."""
    inputs = [
        _input("input_ids", np.array([prompt_ids], dtype=np.int32), "INT32"),
        _input("input_lengths", np.array([[len(prompt_ids)]], dtype=np.int32), "INT32"),
        _input("request_output_len", np.array([[max_tokens]], dtype=np.int32), "INT32"),
        _input("streaming", np.array([[True]]), "BOOL"),
    ]
    if end_id is not None:
        inputs.append(_input("end_id", np.array([[end_id]], dtype=np.int32), "INT32"))
    return inputs


def stream_generate(url: str, prompt: str, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                    model: str = "tensorrt_llm_bls", perf_metrics: bool = False) -> Iterator[StreamChunk]:
    """Yield the streamed responses of one request (`text_inputs`); raises RuntimeError with Triton's message."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model, text_inputs(prompt, max_tokens, temperature, seed, perf_metrics=perf_metrics),
                                  enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=STREAM_TIMEOUT_S)
            if error is not None:
                raise RuntimeError(error.message())
            text = result.as_numpy("text_output")
            stats = {k: result.as_numpy(k).item() for k in
                     ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
                     if result.as_numpy(k) is not None}
            chunk = b"".join(text.reshape(-1)).decode() if text is not None else ""
            if chunk or stats:
                yield StreamChunk(chunk, stats)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return
    finally:
        client.stop_stream()
        client.close()


def seed(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**64:  # Triton's seed input is uint64
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2^64), got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt")
    p.add_argument("--url", default="127.0.0.1:8001")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=seed, default=None, help="the sampling seed, in [0, 2^64) (with --temperature above 0)")
    p.add_argument("--model", default="tensorrt_llm_bls", help="tensorrt_llm_bls (default) or ensemble")
    args = p.parse_args(argv)
    stats: dict[str, float] = {}
    for chunk in stream_generate(args.url, args.prompt, args.max_tokens, args.temperature, args.seed, model=args.model,
                                 perf_metrics=True):
        print(chunk.text, end="", flush=True)
        stats = chunk.stats or stats
    print()
    if stats:
        print(f"[MTP] acceptance {stats.get('acceptance_rate', 0):.2f}: "
              f"{int(stats.get('total_accepted_draft_tokens', 0))} of {int(stats.get('total_draft_tokens', 0))} "
              "draft tokens accepted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
