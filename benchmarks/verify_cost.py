"""What verifying q tokens costs over a 1-token forward, part by part (batch 1, CPU kernels, q = 1..5).

Each held-out prompt is prefilled and decoded greedily for --context tokens; then, at --positions places in that
continuation, the target's forward over the q tokens the model emitted there (what a verify of q - 1 accepted drafts
runs) is timed as the one call the step makes (all layers, then the final norm and lm_head) and part by part: each
kernel of each layer called on its own through its Python entry point, on the inputs the layer sees. Times are the
calling thread's CPU time with one kernel thread (what the other processes on a shared machine disturb least; how
two threads split the work is apart from this), medians over --reps calls and then over the positions. A part's
own call overhead is the same at every q, so its increase over q = 1 is the verify's extra cost in that part.

The MoE layers' routed experts: the router's choices give the distinct experts per layer at each q, and a least
squares fit of the MoE call's time over all positions and q, c + a x distinct experts + b x tokens, splits its
increase into the experts the extra tokens bring in (a: an expert's weights read and converted once) and the
tokens' own work (b: two experts' and the shared expert's arithmetic for one more row, its routing).

  python -m benchmarks.verify_cost               # 4 prompts x 2 positions, 30 reps
  python -m benchmarks.verify_cost --quick       # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch

from benchmarks.common import (add_common_args, check_minimums, load_prompts, machine_info, machine_md, md_table,
                               median_us, parse_with_quick, write_results)
from runtime.core.kv_cache import KVCache
from runtime.io.loading import load_engine
from runtime.io.tokenizer import Tokenizer
from runtime.model import kernels
from runtime.model.batch import PagedBatch

PARTS = [
    ("stack", "all layers, one call (the step's)"),
    ("lm_head", "final norm + lm_head"),
    ("norms", "RMSNorms (3 a layer)"),
    ("q_a", "q_a_proj"),
    ("q_b", "q_b_proj"),
    ("kv_a", "kv_a_proj_with_mqa"),
    ("mla_prepare", "MLA queries, latents to the cache"),
    ("mla_attention", "MLA over the cached context"),
    ("o", "o_proj"),
    ("residual", "residual adds"),
    ("dense_mlp", "dense MLP (layer 0)"),
    ("moe", "MoE call: routing, routed and shared experts"),
]
BLOCK = 16


def cpu_us(fn: Callable[[], Any], reps: int) -> float:
    """Median thread CPU time of fn() in microseconds, after one warm-up call."""
    return median_us(fn, reps, time.thread_time)


def greedy_context(model, tokens: list[int], extra: int, cache: KVCache, table: torch.Tensor) -> list[int]:
    """The prompt, prefilled into `cache`, followed by `extra` greedy tokens decoded one at a time."""
    ctx = list(tokens)
    h = model(torch.tensor(ctx), batch=PagedBatch.build([0], [len(ctx)], table, BLOCK, True), kv_cache=cache.tensor)
    nxt = int(model.logits(h[-1:]).argmax(-1))
    for _ in range(extra):
        ctx.append(nxt)
        h = model(torch.tensor([nxt]), batch=PagedBatch.build([len(ctx) - 1], [1], table, BLOCK, True),
                  kv_cache=cache.tensor)
        nxt = int(model.logits(h).argmax(-1))
    return ctx


def measure_verify(model, ids: torch.Tensor, start: int, table: torch.Tensor, kv: torch.Tensor, reps: int
                   ) -> tuple[dict[str, float], list[int]]:
    """Microseconds per part of the forward over `ids` at positions start.., and the distinct routed experts of
    each MoE layer."""
    layers, cfg = model.model.layers, model.cfg
    batch = PagedBatch.build([start], [len(ids)], table, BLOCK, True)
    rot = model.rope(batch.positions)
    x0 = model.model.embed_tokens(ids)
    t = dict.fromkeys((name for name, _ in PARTS), 0.0)
    t["stack"] = cpu_us(lambda: kernels.decoder_layers(layers.handle, x0, rot, kv, batch), reps)
    experts, x = [], x0
    for layer in layers:
        a = layer.self_attn
        cache = kv[a.cache_layer]
        h = layer.input_layernorm(x)
        qa = a.q_a_proj(h)
        qan = a.q_a_layernorm(qa)
        q = a.q_b_proj(qan)
        latent = a.kv_a_proj_with_mqa(h)
        w_uk, w_uv = a.absorbed
        prepare = lambda: kernels.mla_prepare(q, latent, rot, a.kv_a_layernorm.weight, a.kv_a_layernorm.eps, w_uk,
                                              cfg.softmax_scale, cache, batch.slot_mapping)
        queries = prepare()
        attend = lambda: kernels.mla_attention(queries, cache, batch.positions, batch.token_seq, batch.block_tables,
                                               batch.block_size, w_uv)
        heads = attend()
        out = a.o_proj(heads)
        y = x + out
        f = layer.post_attention_layernorm(y)
        t["norms"] += sum(cpu_us(lambda n=n, v=v: n(v), reps) for n, v in
                          ((layer.input_layernorm, x), (a.q_a_layernorm, qa), (layer.post_attention_layernorm, y)))
        t["q_a"] += cpu_us(lambda: a.q_a_proj(h), reps)
        t["q_b"] += cpu_us(lambda: a.q_b_proj(qan), reps)
        t["kv_a"] += cpu_us(lambda: a.kv_a_proj_with_mqa(h), reps)
        t["mla_prepare"] += cpu_us(prepare, reps)
        t["mla_attention"] += cpu_us(attend, reps)
        t["o"] += cpu_us(lambda: a.o_proj(heads), reps)
        mlp_out = layer.mlp(f)
        t["residual"] += cpu_us(lambda: x + out, reps) + cpu_us(lambda: y + mlp_out, reps)
        if hasattr(layer.mlp, "experts"):
            t["moe"] += cpu_us(lambda: layer.mlp(f), reps)
            experts.append(len(set(layer.mlp.gate(f)[1].flatten().tolist())))
        else:
            t["dense_mlp"] += cpu_us(lambda: layer.mlp(f), reps)
        x = y + mlp_out
    t["lm_head"] = cpu_us(lambda: model.lm_head(model.model.norm(x)), reps)
    return t, experts


def summarize(samples: list[dict[str, Any]], qs: list[int]) -> dict[str, Any]:
    """Medians per q and part, increases over q = 1, distinct experts, and the MoE fit (see the module docstring)."""
    per_q = {q: {name: statistics.median(s["us"][name] for s in samples if s["q"] == q) for name, _ in PARTS}
             for q in qs}
    over = {q: {name: per_q[q][name] - per_q[qs[0]][name] for name, _ in PARTS} for q in qs}
    experts = {q: statistics.mean(e for s in samples if s["q"] == q for e in s["experts"]) for q in qs}
    moe_layers = len(samples[0]["experts"])
    A = np.array([[1.0, statistics.mean(s["experts"]), s["q"]] for s in samples])
    c, per_expert, per_token = np.linalg.lstsq(A, np.array([s["us"]["moe"] / moe_layers for s in samples]), rcond=None)[0]
    return {"us": per_q, "over_q1_us": over, "distinct_experts_per_moe_layer": experts,
            "moe_fit_us_per_layer": {"constant": c, "per_distinct_expert": per_expert, "per_token": per_token},
            "moe_layers": moe_layers}


def markdown(args, res: dict[str, Any], qs: list[int]) -> str:
    s, q0 = res["summary"], qs[0]
    fit, layers = s["moe_fit_us_per_layer"], s["moe_layers"]
    rows = [[f"{name}: {what}"] + [s["us"][q][name] for q in qs] + [s["over_q1_us"][q][name] for q in qs[1:]]
            for name, what in PARTS]
    rows.append(["routed experts, distinct per MoE layer (router's choices)"]
                + [s["distinct_experts_per_moe_layer"][q] for q in qs] + [None] * (len(qs) - 1))
    moe_rows = [[f"q={q}", s["over_q1_us"][q]["moe"],
                 (s["distinct_experts_per_moe_layer"][q] - s["distinct_experts_per_moe_layer"][q0]) * fit["per_distinct_expert"] * layers,
                 (q - q0) * fit["per_token"] * layers] for q in qs[1:]]
    return f"""# What verifying q tokens costs, part by part

Model `{args.model}`; {args.num_prompts} held-out prompts, each prefilled and decoded greedily for {args.context} tokens,
the forward over the q tokens the model emitted at {args.positions} places in that continuation; one kernel thread,
the calling thread's CPU time in microseconds, median of {args.reps} calls, then median over the
{args.num_prompts * args.positions} places. Parts are the kernels called one by one through their Python entry points
(each with its own call overhead, the same at every q), 'stack' the one call the step makes.

{md_table(["part (us per forward)"] + [f"q={q}" for q in qs] + [f"+ at q={q}" for q in qs[1:]], rows, digits=1)}

The stack's cost over q = 1: {", ".join(f"{s['us'][q]['stack'] / s['us'][q0]['stack']:.2f}x at q={q}" for q in qs[1:])}.

## The MoE layers' increase: experts brought in vs the tokens' own work

Fit over all places and q of the MoE call's time per layer: {fit['constant']:.2f} us
+ {fit['per_distinct_expert']:.2f} us per distinct routed expert + {fit['per_token']:.2f} us per token.

{md_table(["q", "MoE increase over q=1 (us)", "from more distinct experts (fit)", "from more tokens (fit)"], moe_rows, digits=1)}

## Machine

{machine_md(res['machine'])}
"""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, threads_help="kernel threads (default 1: per-part CPU time of one thread)")
    p.add_argument("--prompts", help="prompts JSON (default: <model>/heldout_prompts.json)")
    p.add_argument("--num_prompts", type=int, default=4)
    p.add_argument("--prompt_tokens", type=int, default=200, help="prompt tokens kept (the rest cut)")
    p.add_argument("--context", type=int, default=80, help="greedy tokens decoded after the prompt")
    p.add_argument("--positions", type=int, default=2, help="places per prompt where the verify is timed")
    p.add_argument("--max_q", type=int, default=5, help="tokens verified: 1..max_q")
    p.add_argument("--reps", type=int, default=30, help="timed calls per part and place")
    p.add_argument("--name", default="verify_cost")
    args = parse_with_quick(p, argv, {"num_prompts": 1, "context": 12, "positions": 1, "max_q": 2, "reps": 2})
    check_minimums(p, args, {"num_prompts": 1, "context": 6, "positions": 1, "max_q": 2, "reps": 1})
    if args.device != "cpu" or args.dtype is not None:
        p.error(f"--device / --dtype: this benchmark times the CPU kernels on the engine's own weights, got "
                f"--device {args.device!r} --dtype {args.dtype!r}")
    torch.set_num_threads(args.threads or 1)
    if kernels.cpu_kernels() is None:
        p.error("the CPU kernels do not run on this machine; nothing to measure")
    engine = load_engine(args.model)
    model, tokenizer = engine.model, Tokenizer.from_dir(engine.path)
    qs = list(range(1, args.max_q + 1))
    samples = []
    with torch.inference_mode():
        for n, prompt in enumerate(load_prompts(args.model, args.prompts)[: args.num_prompts]):
            cache = KVCache(model.cfg, num_blocks=-(-(args.prompt_tokens + args.context) // BLOCK), block_size=BLOCK)
            table = torch.tensor([cache.allocator.allocate(cache.allocator.num_free)])
            tokens = tokenizer.encode(prompt["text"])[: args.prompt_tokens]
            ctx = greedy_context(model, tokens, args.context, cache, table)
            for j in range(args.positions):
                start = len(tokens) + (j + 1) * (args.context - args.max_q) // (args.positions + 1)
                for q in qs if (n + j) % 2 == 0 else qs[::-1]:
                    us, experts = measure_verify(model, torch.tensor(ctx[start:start + q]), start, table, cache.tensor,
                                                 args.reps)
                    samples.append({"prompt": n, "start": start, "q": q, "us": us, "experts": experts})
    results = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()}, "samples": samples,
               "summary": summarize(samples, qs)}
    js, md = write_results(args.out_dir, args.name, results, markdown(args, results, qs))
    print(md.read_text())
    print(f"wrote {js} and {md}")


if __name__ == "__main__":
    main()
