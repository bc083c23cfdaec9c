"""FP8 weights kept FP8 with bf16 activations (`runtime.model.fp8_linear`) against the fp32 path, side by side.

Modes, each its own engine of the same model on the same device:
  fp32            weights dequantized to fp32 at load: the exact reference
  bf16            weights dequantized to bf16 at load
  fp8             bf16 activations, FP8 weights kept, each weight shape's GEMM path as the load probed it
  fp8_dequantize  the same, every product through the dequantize fallback
Per mode: the weights' bytes on the device and the peak memory after loading; logits against fp32's on held-out
prompts (max abs error, error norm over fp32's norm, top-1 agreement); batch-1 greedy TPOT at each k (CUDA graphs
on a GPU), all settings interleaved prompt by prompt, the order reversed every other round; the share of requests
whose greedy tokens equal fp32's, and whether each k > 0 gives its mode's k = 0 tokens.

On a GPU it also times single products at DeepSeek-V3's own weight shapes (the shipped model's are too small to
show anything but launch costs): each FP8 path against bf16 weights, for 1 to 2048 tokens, and a decode step's
(token, expert) pairs over one expert-parallel rank's 32 experts, each timed as 10 calls replayed from a CUDA graph.

  python -m benchmarks.fp8_gpu --device cuda --name fp8_h200
  python -m benchmarks.fp8_gpu --quick                 # smoke run (CPU)
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch
from tqdm import tqdm

from benchmarks.common import (add_common_args, comma_list, load_prompts, machine_info, machine_md, md_table, mean,
                               parse_with_quick, ratio, request_ttft_tpot, round_robin_by_source, save_figure,
                               set_threads, sync, timed_request, write_results)
from runtime.core.sampling_params import SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.io.loading import LoadedEngine, load_engine
from runtime.model.fp8 import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8
from runtime.model.fp8_linear import FP8Experts, FP8Linear, fp8_product, gemm_paths

MODES = {"fp32": ("float32", False), "bf16": ("bfloat16", False), "fp8": ("bfloat16", True),
         "fp8_dequantize": ("bfloat16", True)}


def load_mode(model: str, mode: str, device: str) -> tuple[LoadedEngine, dict[str, Any]]:
    """The mode's engine, with its bytes on the device and the peak memory its loading reached."""
    dtype, fp8 = MODES[mode]
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    engine = load_engine(model, device=device, dtype=dtype, fp8_weights=fp8)
    if mode == "fp8_dequantize":
        for m in engine.model.modules():
            if isinstance(m, FP8Linear):
                m.path = "dequantize"
            elif isinstance(m, FP8Experts):
                m.pairs_path, m.dense_paths = "dequantize", dict.fromkeys(m.dense_paths, "dequantize")
    tensors = {t.data_ptr(): t for t in [*engine.model.parameters(), *engine.model.buffers()]}
    info: dict[str, Any] = {"weight_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                            "gemm_paths": gemm_paths(engine.model)}
    if device == "cuda":
        sync(device)
        info["load_peak_bytes"] = torch.cuda.max_memory_allocated() - before
    return engine, info


@torch.inference_mode()
def logit_errors(engine: LoadedEngine, reference: LoadedEngine, prompts: list[list[int]], device: str) -> dict[str, float]:
    worst, err2, ref2, agree, n = 0.0, 0.0, 0.0, 0, 0
    for ids in prompts:
        x = torch.tensor(ids, device=device)[None]
        got = engine.model.logits(engine.model(x)).float()[0]
        want = reference.model.logits(reference.model(x)).float()[0]
        worst = max(worst, (got - want).abs().max().item())
        err2 += (got - want).pow(2).sum().item()
        ref2 += want.pow(2).sum().item()
        agree += (got.argmax(-1) == want.argmax(-1)).sum().item()
        n += len(ids)
    return {"max_abs_error": worst, "relative_error": (err2 / ref2) ** 0.5, "top1_agreement": agree / n}


V3_SHAPES = {"q_a_proj": (1536, 7168), "o_proj": (7168, 16384), "dense gate_proj": (18432, 7168),
             "expert gate_proj": (2048, 7168), "expert down_proj": (7168, 2048)}
GEMM_TOKENS = (1, 16, 64, 256, 2048)


def graph_time_us(fn: Callable[[], Any], calls: int = 10, replays: int = 5) -> float:
    """Microseconds per call of `fn`, `calls` of them captured in one CUDA graph and replayed (no launch costs)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def gemm_timings() -> dict[str, Any]:
    """Each product path at DeepSeek-V3's shapes: microseconds per product, and the weight's bytes per path."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = {}
    for name, (N, K) in V3_SHAPES.items():
        codes, scale = quantize_block_fp8(torch.randn(N, K, device="cuda", generator=gen))
        bf16 = dequantize_block_fp8(codes, scale, dtype=torch.bfloat16)
        for M in GEMM_TOKENS:
            x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
            row = {"bf16": graph_time_us(lambda: torch.nn.functional.linear(x, bf16))}
            for path in ("triton", "scaled_mm", "dequantize"):
                try:
                    row[path] = graph_time_us(lambda: fp8_product(path, x, codes, scale))
                except (RuntimeError, ValueError) as e:
                    row[path] = None
                    row[f"{path}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            from runtime.model.fp8_triton import fp8_gemm
            for block_n in (16, 64):  # the Triton GEMM's tile width against its default (32)
                row[f"triton_n{block_n}"] = graph_time_us(lambda: fp8_gemm(x, codes, scale, block_n=block_n))
            rows[f"{name} {N}x{K} M={M}"] = row
        del bf16
    E, (N, K), k = 32, V3_SHAPES["expert gate_proj"], 8
    stacks = [quantize_block_fp8(torch.randn(N, K, device="cuda", generator=gen)) for _ in range(E)]
    codes, scale = torch.stack([c for c, _ in stacks]), torch.stack([s for _, s in stacks])
    bf16 = dequantize_block_fp8(codes, scale, dtype=torch.bfloat16)
    from runtime.model.fp8_triton import fp8_pairs
    for T in (1, 4, 16):
        x = torch.randn(T * k, K, device="cuda", generator=gen).to(torch.bfloat16)
        e = torch.randint(0, E, (T * k,), device="cuda", generator=gen)
        rows[f"experts pairs {E}x{N}x{K} tokens={T} pairs={T * k}"] = {
            "bf16": graph_time_us(lambda: (x[:, None] @ bf16[e].mT)),
            "triton": graph_time_us(lambda: fp8_pairs(x, codes, scale, e)),
            **{f"triton_n{n}_w{w}": graph_time_us(lambda: fp8_pairs(x, codes, scale, e, block_n=n, num_warps=w))
               for n, w in ((32, 4), (128, 4), (128, 8))},
            "dequantize": graph_time_us(lambda: x[:, None] @ dequantize_block_fp8(
                codes.view(torch.uint8)[e].view(FP8_DTYPE), scale[e], dtype=torch.bfloat16).mT),
        }
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--ks", default="0,3", help="draft lengths (0: plain decoding)")
    p.add_argument("--num_prompts", type=int, default=6)
    p.add_argument("--max_tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--name", default="fp8_gpu")
    args = parse_with_quick(p, argv, dict(num_prompts=2, max_tokens=16, rounds=1))
    if args.dtype is not None:
        p.error(f"--dtype: each mode sets its own (--modes), got {args.dtype!r}")
    modes = comma_list(p, "--modes", args.modes, str, "mode names")
    if "fp32" not in modes or any(m not in MODES for m in modes):
        p.error(f"--modes: names of {', '.join(MODES)} including fp32 (the reference), got {args.modes!r}")
    ks = comma_list(p, "--ks", args.ks)
    set_threads(args.threads)
    info = machine_info()

    engines, memory = {}, {}
    for mode in tqdm(modes, desc="load"):
        engines[mode], memory[mode] = load_mode(args.model, mode, args.device)
    prompts = round_robin_by_source(load_prompts(args.model), args.num_prompts)
    executors = {(mode, k): Executor(engines[mode], ExecutorConfig(
        num_draft_tokens=k, speculation="fixed", max_batch_size=1, device=args.device))
        for mode in modes for k in ks}
    tok = executors[modes[0], ks[0]].tokenizer
    prompt_ids = [tok.encode(x["text"]) for x in prompts]
    errors = {mode: logit_errors(engines[mode], engines["fp32"], prompt_ids, args.device) for mode in modes}

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for ex in executors.values():  # warm-up: captures the graphs a run meets
        ex.submit(prompt_ids[0], params).result()
    settings = list(executors)
    tpots: dict[tuple[str, int], list[float]] = {s: [] for s in settings}
    tokens: dict[tuple[str, int], list[list[int]]] = {s: [] for s in settings}
    accepted: dict[tuple[str, int], list[float]] = {s: [] for s in settings}
    bar = tqdm(total=args.rounds * len(prompt_ids) * len(settings), desc="decode")
    for r in range(args.rounds):
        for ids in prompt_ids:
            for s in (settings if r % 2 == 0 else settings[::-1]):
                out, sent, first, last = timed_request(executors[s], ids, params)
                tpots[s].append(request_ttft_tpot(sent, first, last, len(out.token_ids))[1])
                if r == 0:
                    tokens[s].append(out.token_ids)
                    drafts = out.stats.num_draft_tokens
                    accepted[s].append(out.stats.num_accepted_draft_tokens / drafts if drafts else 0.0)
                bar.update()
    bar.close()
    for ex in executors.values():
        ex.shutdown()

    gemms = gemm_timings() if args.device == "cuda" and not args.quick else {}

    base = mean(tpots["fp32", 0])
    rows, results = [], {}
    for mode, k in settings:
        t = mean(tpots[mode, k])
        same_as_fp32 = mean(float(a == b) for a, b in zip(tokens[mode, k], tokens["fp32", k]))
        results[f"{mode}_k{k}"] = {
            "mode": mode, "k": k, "tpot_mean_s": t, "tpot_vs_fp32_k0": ratio(base, t),
            "acceptance": mean(accepted[mode, k]) if k else None,
            "greedy_equal_to_fp32_share": same_as_fp32,
            "greedy_equal_to_k0": tokens[mode, k] == tokens[mode, ks[0]],
        }
        res = results[f"{mode}_k{k}"]
        rows.append([mode, k, t * 1e3, res["tpot_vs_fp32_k0"], res["acceptance"], same_as_fp32,
                     "yes" if res["greedy_equal_to_k0"] else "no"])
    mem_rows = [[m, memory[m]["weight_bytes"] / 2**20, memory[m].get("load_peak_bytes", 0) / 2**20,
                 ", ".join(f"{p} {n}" for p, n in memory[m]["gemm_paths"].items()) or "-",
                 errors[m]["max_abs_error"], errors[m]["relative_error"], errors[m]["top1_agreement"]] for m in modes]
    payload = {"machine": info, "settings": vars(args) | {"modes": modes, "ks": ks}, "memory": memory,
               "logit_errors_vs_fp32": errors, "decode": results, "v3_shape_products_us": gemms}
    paths = ("bf16", "scaled_mm", "triton", "dequantize")
    variants = sorted({k for row in gemms.values() for k in row if k.startswith("triton_")})
    gemm_rows = [[name, *(row.get(p) for p in (*paths, *variants))] for name, row in gemms.items()]
    markdown = "\n\n".join([
        f"# FP8 weights with bf16 activations vs the fp32 path ({info.get('gpu', args.device)})",
        f"{len(prompt_ids)} held-out prompts x {args.max_tokens} tokens, greedy, batch 1, {args.rounds} rounds "
        "interleaved; logits over the same prompts' tokens.",
        md_table(["mode", "weights MiB", "load peak MiB", "FP8 GEMM paths (linears)", "max abs logit error",
                  "relative logit error", "top-1 agreement"], mem_rows, digits=4),
        md_table(["mode", "k", "TPOT ms", "speed vs fp32 k=0", "acceptance", "greedy = fp32's (share)",
                  "k>0 = k=0 tokens"], rows, digits=3),
        *(["## Single products at DeepSeek-V3's shapes (microseconds, CUDA graph replay)",
           md_table(["product", *paths, *variants], gemm_rows, digits=1)] if gemms else []),
        "## Machine\n\n" + machine_md(info)])
    write_results(args.out_dir, args.name, payload, markdown)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        width = 0.8 / len(ks)
        for i, k in enumerate(ks):
            ax.bar([j + i * width for j in range(len(modes))], [results[f"{m}_k{k}"]["tpot_mean_s"] * 1e3 for m in modes],
                   width, label=f"k={k}")
        ax.set_xticks([j + width * (len(ks) - 1) / 2 for j in range(len(modes))], modes)
        ax.set_ylabel("TPOT ms (batch 1)")
        ax.legend()
        save_figure(fig, args.out_dir / f"{args.name}.png")
    except ImportError:
        pass
    print(markdown)


if __name__ == "__main__":
    main()
