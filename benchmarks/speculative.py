"""MTP speculative decoding at batch 1 (CPU, or --device cuda): our runtime at k = 0..4 and HF transformers, side by side.

For every held-out prompt (greedy, ignore_eos, the same number of new tokens everywhere) the
runs are interleaved: our executor at each k (speculation "fixed", one executor per k, each
warmed up first), then HF `generate()` plain and with `use_mtp=True`. Reported per setting:
decode tokens/s (1 / TPOT), end-to-end tokens/s, TPOT, TTFT, acceptance, tokens per step, and
whether the greedy tokens equal those of plain decoding. TTFT and TPOT are timed the same way for both
(vLLM's definitions, on the client's clock): TTFT = first token - send, TPOT = (last token - first token) /
(output tokens - 1). The draft cost c (one MTP step over one
target decode step) is measured directly on the paged path at batch 1, and from timers around the
runner's methods (RunnerClock); the ideal speed-up is E(k) / (1 + k c), E(k) = (1 - a^(k+1)) / (1 - a).

  python -m benchmarks.speculative                     # full run (8 prompts x 256 tokens)
  python -m benchmarks.speculative --quick             # smoke run
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (Timer, add_common_args, check_minimums, comma_list, engine_info, load_prompts,
                               machine_info, machine_md, md_table, mean, parse_with_quick, percentile, ratio,
                               request_ttft_tpot, round_robin_by_source, set_threads, sync, target_line, timed_request,
                               write_results)

import torch
from tqdm import tqdm

from runtime.io.loading import load_engine
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.core.cuda_graphs import CudaGraphRunner
from runtime.core.kv_cache import KVCache
from runtime.core.sampling_params import SamplingParams
from runtime.core.model_runner import ModelRunner

TARGETS = {"k1_vs_k0": 1.6, "best_vs_k0": 2.0, "k0_vs_hf": 3.0}
FORMULA = ("ideal(k) = E(k) / (1 + k * c), with E(k) = (1 - a^(k+1)) / (1 - a) the expected tokens per "
           "target forward for i.i.d. per-position acceptance a (a = the measured k=1 acceptance rate) "
           "and c = t_MTP / t_target, one MTP step over one target decode step (batch 1, measured). "
           "It ignores the extra cost of verifying k+1 tokens instead of 1; the 'cost-model' column "
           "uses the measured verify cost: E(k) / ((t_target(k+1) + k * t_MTP) / t_target(1)). The 'free drafts' "
           "column is what k could give if drafting and the runner cost nothing: the measured tokens per step over "
           "t_target(k+1) / t_target(1); no drafter, however cheap, beats it on this model and machine.")


# ---- draft cost, measured directly --------------------------------------------------------------
@torch.inference_mode()
def measure_step_costs(model, max_k: int, context: int, repeats: int, block_size: int = 16) -> dict[str, Any]:
    """Median seconds of one target forward + lm_head over q = 1..max_k+1 new tokens, and of one
    MTP forward (layer + shared head) over 1 token, at batch 1 with `context` cached tokens, through
    the runner's forwards the runtime decodes with (CUDA graphs on a GPU). Calls are interleaved round by round."""
    cfg = model.cfg
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    blocks = -(-(context + max_k + 2) // block_size)
    cache = KVCache(cfg, num_blocks=blocks + 1, block_size=block_size, dtype=dtype, device=device)
    tables = [cache.allocator.allocate(blocks)]
    runner = ModelRunner(model, cache, graphs=CudaGraphRunner(model, cache) if device.type == "cuda" else None)
    cache.tensor.normal_()  # context values do not change the cost, but keep them non-degenerate
    gen = torch.Generator().manual_seed(0)

    def target(q: int):
        ids = torch.randint(0, cfg.vocab_size, (q,), generator=gen).tolist()
        return model.logits(runner.forward_target(tables, [context], [q], ids))

    hidden = torch.randn(1, cfg.hidden_size, generator=gen).to(device, dtype)

    def mtp():
        ids = torch.randint(0, cfg.vocab_size, (1,), generator=gen).to(device)
        return runner.proposer.forward_mtp(tables, [context], [1], ids, hidden)

    fns = {f"target_q{q}": (lambda q=q: target(q)) for q in range(1, max_k + 2)}
    fns["mtp"] = mtp
    for fn in fns.values():  # warm-up
        for _ in range(3):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            samples[name].append(time.perf_counter() - t0)
    med = {k: percentile(v, 50) for k, v in samples.items()}
    return {
        "context_tokens": context,
        "repeats": repeats,
        "target_s": {q: med[f"target_q{q}"] for q in range(1, max_k + 2)},
        "mtp_s": med["mtp"],
        "draft_cost_c": med["mtp"] / med["target_q1"],
        "verify_cost_ratio": {q: med[f"target_q{q}"] / med["target_q1"] for q in range(1, max_k + 2)},
    }


def expected_tokens(a: float, k: int) -> float:
    a = min(a, 0.999999)
    return (1 - a ** (k + 1)) / (1 - a)


# ---- HF transformers ----------------------------------------------------------------------------
class _StepRecorder:
    """A generate() streamer that time-stamps every put after the prompt."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.sizes: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.sizes.append(int(value.numel()))

    def end(self) -> None:
        pass


def _checkpoint_tensors(model_dir: Path, names) -> dict[str, torch.Tensor]:
    """Stored tensors (dequantized to fp32 with the release's padded 128x128 blocks)."""
    from runtime.io.checkpoint import HFCheckpoint

    wanted = set(names)
    return dict(HFCheckpoint(model_dir).iter_tensors(lambda n: n in wanted, dequantize=True, dtype=torch.float32))


@torch.no_grad()
def _fix_fp8_dequantization(model, model_dir: Path) -> dict[str, Any]:
    """transformers 5.x dequantizes FP8 on CPU with a block size derived from the scale grid
    (rows // scale_rows), which is wrong when a dimension is not a multiple of 128 (the release
    pads edge blocks): e.g. a [192, 128] q_b_proj gets 96-row blocks. Re-dequantize every 2-D
    FP8 weight HF holds under its checkpoint name; report fused ones that could not be checked."""
    from runtime.io.checkpoint import HFCheckpoint
    from runtime.model.fp8 import BLOCK

    ckpt = HFCheckpoint(model_dir)
    fp8 = [n[: -len("_scale_inv")] for n in ckpt.tensor_names if n.endswith("_scale_inv")]
    params = dict(model.named_parameters())
    fixed, max_err, unchecked = [], 0.0, []
    for name, w in _checkpoint_tensors(model_dir, [n for n in fp8 if n in params]).items():
        p = params[name]
        if p.shape != w.shape:
            unchecked.append(name)
            continue
        err = (p.float() - w).abs().max().item()
        if err > 0:
            fixed.append(name)
            max_err = max(max_err, err)
            p.copy_(w.to(p.dtype))
    mtp_prefixes = tuple(f"model.layers.{i}." for i in range(model.config.num_hidden_layers,
                                                          model.config.num_hidden_layers + 8))
    for n in fp8:
        if n not in params and not n.startswith(mtp_prefixes):
            shape = ckpt.tensor_info(n).shape
            if any(d % b for d, b in zip(shape, BLOCK)):
                unchecked.append(n)
    return {"fp8_weights_redequantized": len(fixed), "fp8_max_abs_error_fixed": max_err,
            "fp8_examples": fixed[:4], "fp8_unchecked_non_multiple_of_block": unchecked[:8]}


def _patch_mtp_loading(model, model_dir: Path, n_layers: int, own_embed_head: bool, meta: dict[str, Any]) -> None:
    """HF builds its MTP layer (MtpModel.from_pretrained) inside every generate(use_mtp=True).
    Hook it to (1) re-dequantize the MTP block's FP8 weights with padded 128x128 blocks (same HF
    bug as the main model), and (2) when `own_embed_head` and this checkpoint's MTP embedding /
    head copies differ from the main model's (HF ties them, as DeepSeek-V3 shares them), give HF's
    MTP the checkpoint's own copies, as our runtime uses them."""
    from torch import nn
    from transformers import modeling_layers

    from runtime.io.checkpoint import HFCheckpoint

    prefix = f"model.layers.{n_layers}."
    names = {"mtp_embed": prefix + "embed_tokens.weight", "mtp_head": prefix + "shared_head.head.weight",
             "embed": "model.embed_tokens.weight", "head": "lm_head.weight"}
    ckpt = HFCheckpoint(model_dir)
    fp8 = [n[: -len("_scale_inv")] for n in ckpt.tensor_names if n.endswith("_scale_inv") and n.startswith(prefix)]
    t = _checkpoint_tensors(model_dir, list(names.values()) + fp8)
    embed = head = None
    if names["mtp_embed"] in t and names["mtp_head"] in t:
        d_embed = (t[names["mtp_embed"]] - t[names["embed"]]).abs().max().item()
        d_head = (t[names["mtp_head"]] - t[names["head"]]).abs().max().item()
        meta |= {"mtp_embed_max_abs_diff_vs_main": d_embed, "mtp_head_max_abs_diff_vs_main": d_head}
        if own_embed_head and (d_embed or d_head):
            embed = nn.Embedding.from_pretrained(t[names["mtp_embed"]].float(), freeze=True)
            head = nn.Linear(*reversed(t[names["mtp_head"]].shape), bias=False).requires_grad_(False)
            head.weight.data.copy_(t[names["mtp_head"]].float())
    meta["mtp_embed_head_patched"] = embed is not None
    original = modeling_layers.MtpModel.from_pretrained.__func__

    @torch.no_grad()
    def from_pretrained(cls, main_model, *args, **kwargs):
        mtp = original(cls, main_model, *args, **kwargs)
        if main_model is not model:
            return mtp
        params = dict(mtp.named_parameters())
        fixed, err = 0, 0.0
        for name in fp8:
            rest = name[len(prefix):]
            p = params.get("layers.0.mtp_block." + rest)
            p = params.get("layers.0." + rest) if p is None else p
            if p is not None and p.shape == t[name].shape:
                ref = t[name].to(p.device)  # HF now builds the MTP layer on the main model's device
                e = (p.float() - ref).abs().max().item()
                if e > 0:
                    fixed, err = fixed + 1, max(err, e)
                    p.copy_(ref.to(p.dtype))
        meta["mtp_fp8_weights_redequantized"], meta["mtp_fp8_max_abs_error_fixed"] = fixed, err
        if embed is not None:
            mtp.embed_tokens, mtp.shared_head = embed, head
        return mtp.to(next(model.parameters()).device)  # older HF builds it on the CPU

    modeling_layers.MtpModel.from_pretrained = classmethod(from_pretrained)


def load_hf(model_dir: Path, tie_mtp: bool = False, device: str = "cpu"):
    """DeepseekV3ForCausalLM.from_pretrained in fp32, with the class-level MTP ignore pattern
    pointed at this checkpoint's MTP layer index (transformers hard-codes 61)."""
    import json

    from transformers import DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds

    cfg = json.loads((model_dir / "config.json").read_text())
    n, m = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers", 0)
    patterns = [rf"model\.layers\.{i}\..*" for i in range(n, n + m)] or [r"model\.layers\.61.*"]
    saved = hf_ds.DeepseekV3PreTrainedModel._keys_to_ignore_on_load_unexpected
    hf_ds.DeepseekV3PreTrainedModel._keys_to_ignore_on_load_unexpected = patterns
    # FP8 checkpoints are dequantized on CPU (needs `accelerate`); Linear weights land in fp32
    # but the bf16-stored tensors (embeddings, norms) keep bf16, hence the .float().
    extra = {}
    if device != "cpu" and "quantization_config" in cfg:  # with a GPU present, HF would keep FP8 layers
        from transformers import FineGrainedFP8Config
        extra["quantization_config"] = FineGrainedFP8Config(dequantize=True)
    model = DeepseekV3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **extra)
    model = model.float().eval()
    model.config.dtype = torch.float32  # MtpModel.from_pretrained builds its layers in config.dtype
    model.generation_config.eos_token_id = None
    meta: dict[str, Any] = {"mtp_ignore_pattern": patterns, "replaced_pattern": saved,
                            "num_mtp_layers": getattr(model.config, "num_mtp_layers", None)}
    try:
        import accelerate
        meta["accelerate_version"] = accelerate.__version__
    except ImportError:
        meta["accelerate_version"] = None
    if "quantization_config" in cfg:
        meta |= _fix_fp8_dequantization(model, model_dir)
    if m:
        _patch_mtp_loading(model, model_dir, n, own_embed_head=not tie_mtp, meta=meta)
    return model.to(device), meta


@torch.inference_mode()
def hf_generate(model, prompt_ids: list[int], max_new_tokens: int, use_mtp: bool) -> dict[str, Any]:
    ids = torch.tensor([prompt_ids], device=model.device)
    rec = _StepRecorder()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, use_mtp=use_mtp, eos_token_id=None,
                         pad_token_id=model.config.eos_token_id, streamer=rec)
    t1 = time.perf_counter()
    new = out[0, len(prompt_ids):].tolist()
    n = len(new)
    ttft, tpot = request_ttft_tpot(t0, rec.times[0] if rec.times else None, rec.times[-1] if rec.times else None, n)
    steps = len(rec.times)
    return {"token_ids": new, "output_tokens": n, "latency_s": t1 - t0, "ttft_s": ttft, "tpot_s": tpot,
            "num_steps": steps,
            # every step emits the verified token plus the accepted drafts (HF drafts 1 per MTP layer)
            "decode_tokens_per_step": (n - 1) / (steps - 1) if steps > 1 else None}


# ---- our runtime --------------------------------------------------------------------------------
class RunnerClock:
    """Seconds an executor's runner spends drafting (in its proposer), in the rest of its general step, and in its
    step in one kernel call: their methods wrapped on the instances, so the runtime itself carries no timers. Each
    part ends waiting for the device (the steps end in host reads of their tokens; the drafts are synchronized here),
    so on CUDA they time its work, not the launches."""

    def __init__(self, runner: ModelRunner):
        self.seconds = {"draft": 0.0, "step": 0.0, "one_call": 0.0}
        self.sync = runner.inputs.device.type == "cuda"
        for owner, method, part in ((runner.proposer, "propose", "draft"), (runner, "step", "step"),
                                    (runner, "_step_in_one_call", "one_call")):
            setattr(owner, method, self._timed(getattr(owner, method), part))

    def _timed(self, method: Any, part: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                out = method(*args, **kwargs)
                if part == "draft" and self.sync:
                    torch.cuda.synchronize()
                return out
            finally:
                self.seconds[part] += time.perf_counter() - t0
        return timed

    def parts(self) -> dict[str, float]:
        s = self.seconds
        return {"draft": s["draft"], "target": s["step"] - s["draft"] - s["one_call"], "one_call": s["one_call"]}


def run_ours(ex: Executor, clock: RunnerClock, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """One request; TTFT and TPOT from the times its first and last outputs with tokens reached the callback,
    on the same clock as hf_generate times HF's streamer."""
    before = clock.parts()
    out, t0, first, last = timed_request(ex, prompt_ids, params)
    latency = time.perf_counter() - t0
    s = out.stats
    ttft, tpot = request_ttft_tpot(t0, first, last, s.output_tokens)
    return {"token_ids": out.token_ids, "output_tokens": s.output_tokens, "latency_s": latency,
            "ttft_s": ttft, "tpot_s": tpot, "num_steps": s.num_steps,
            "num_draft_tokens": s.num_draft_tokens, "num_accepted_draft_tokens": s.num_accepted_draft_tokens,
            "finish_reason": out.finish_reason,
            **{f"{part}_s": seconds - before[part] for part, seconds in clock.parts().items()}}


def summarize(runs: list[dict[str, Any]], reference: list[list[int]] | None) -> dict[str, Any]:
    out_tokens = sum(r["output_tokens"] for r in runs)
    steps = sum(r["num_steps"] for r in runs)
    s: dict[str, Any] = {
        "requests": len(runs),
        "output_tokens": out_tokens,
        "tpot_mean_s": mean(r["tpot_s"] for r in runs),
        "tpot_p50_s": percentile([r["tpot_s"] for r in runs], 50),
        "ttft_mean_s": mean(r["ttft_s"] for r in runs),
        "latency_mean_s": mean(r["latency_s"] for r in runs),
        "e2e_tokens_per_s": out_tokens / sum(r["latency_s"] for r in runs),
        "num_steps": steps,
        # ours: every step that emits may already draft (the prompt's prefill emits nothing);
        # HF: the first token comes from a plain prefill step, assisted steps emit the rest
        "decode_tokens_per_step": (out_tokens / steps if "num_draft_tokens" in runs[0] else
                                   (out_tokens - len(runs)) / (steps - len(runs)) if steps > len(runs) else None),
    }
    s["decode_tokens_per_s"] = 1 / s["tpot_mean_s"] if s["tpot_mean_s"] else None
    if "num_draft_tokens" in runs[0]:
        drafted = sum(r["num_draft_tokens"] for r in runs)
        accepted = sum(r["num_accepted_draft_tokens"] for r in runs)
        decode_steps = steps  # steps that emitted tokens; the runner timers also hold the prefill steps
        s |= {"draft_tokens": drafted, "accepted_draft_tokens": accepted,
              "acceptance_rate": accepted / drafted if drafted else None,
              "runner_draft_s_per_decode_step": sum(r["draft_s"] for r in runs) / max(decode_steps, 1),
              "runner_target_s_per_decode_step": sum(r["target_s"] for r in runs) / max(decode_steps, 1),
              "runner_one_call_s_per_decode_step": sum(r.get("one_call_s", 0.0) for r in runs) / max(decode_steps, 1)}
        s["runner_draft_over_target"] = ratio(s["runner_draft_s_per_decode_step"], s["runner_target_s_per_decode_step"])
    elif s["decode_tokens_per_step"] is not None:
        s["acceptance_rate_implied"] = s["decode_tokens_per_step"] - 1  # HF drafts one token per step
    if reference is not None:
        same = [r["token_ids"] == ref for r, ref in zip(runs, reference)]
        prefix = [_common_prefix(r["token_ids"], ref) for r, ref in zip(runs, reference)]
        s["outputs_equal_reference"] = sum(same)
        s["mean_common_prefix_tokens"] = mean(prefix)
    return s


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---- main ---------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--prompts", help="prompts JSON (default: <model>/heldout_prompts.json)")
    p.add_argument("--num_prompts", type=int, default=8)
    p.add_argument("--max_tokens", type=int, default=256, help="new tokens per request (ignore_eos)")
    p.add_argument("--ks", default="0,1,2,3,4", help="draft lengths to run (0 = plain decoding)")
    p.add_argument("--no_hf", action="store_true", help="skip HF transformers generate()")
    p.add_argument("--hf_mtp_tied", action="store_true",
                   help="HF use_mtp exactly as shipped: MTP embedding/head tied to the main model's even when the "
                        "checkpoint's MTP copies differ (default: give HF's MTP the checkpoint's own copies)")
    p.add_argument("--cost_repeats", type=int, default=60, help="rounds of the direct draft-cost measurement")
    p.add_argument("--name", default="speculative")
    args = parse_with_quick(p, None, dict(num_prompts=2, max_tokens=24, cost_repeats=5, ks="0,1,2"))
    ks = sorted(set(comma_list(p, "--ks", args.ks)))
    set_threads(args.threads)
    if 0 not in ks or min(ks) < 0:
        p.error(f"--ks: draft lengths >= 0 that include 0 (the baseline), got {args.ks!r}")
    check_minimums(p, args, dict(num_prompts=1, max_tokens=2, cost_repeats=1))  # TPOT needs 2 tokens

    prompts = round_robin_by_source(load_prompts(args.model, args.prompts), args.num_prompts)
    engine = load_engine(args.model, device=args.device, dtype=args.dtype)
    eng_info = engine_info(engine)
    model_dir = Path(args.model)
    info = machine_info()
    print(f"model {args.model}: {eng_info['parameters_target'] / 1e6:.2f}M target + "
          f"{eng_info['parameters_mtp'] / 1e6:.2f}M MTP params; torch threads {info['torch_threads']}")

    executors: dict[int, Executor] = {}
    clocks: dict[int, RunnerClock] = {}
    for k in ks:
        executors[k] = Executor(engine, ExecutorConfig(num_draft_tokens=k, speculation="fixed",
                                                       max_batch_size=1, device=args.device))
        clocks[k] = RunnerClock(executors[k].runner)
    tok = executors[0].tokenizer
    prompt_ids = [tok.encode(x["text"]) for x in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    too_long = [len(i) for i in prompt_ids if len(i) + args.max_tokens > executors[0].limits.max_seq_len]
    if too_long:
        raise SystemExit(f"prompt of {too_long[0]} tokens + {args.max_tokens} exceeds max_seq_len")

    hf, hf_meta, hf_error = None, {}, None
    if not args.no_hf:
        if not (model_dir / "config.json").is_file():
            hf_error = f"{model_dir} has no config.json (engine directory): HF comparison skipped"
        else:
            try:
                with Timer() as t:
                    hf, hf_meta = load_hf(model_dir, tie_mtp=args.hf_mtp_tied, device=args.device)
                hf_meta["load_s"] = t.seconds
            except Exception as e:  # report, keep our numbers
                hf_error = f"HF load failed: {type(e).__name__}: {e}"
        if hf_error:
            print(hf_error)

    # Warm-up: one full-length request per executor (on a GPU it captures the graphs a run meets), one
    # short generate per HF mode.
    warm = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for k, ex in executors.items():
        ex.submit(prompt_ids[0], warm).result()
    hf_modes = [] if hf is None else [("hf_plain", False), ("hf_mtp", True)]
    for name, use_mtp in list(hf_modes):
        try:
            hf_generate(hf, prompt_ids[0], min(16, args.max_tokens), use_mtp)
        except Exception as e:  # e.g. use_mtp unsupported: keep the other numbers
            hf_modes.remove((name, use_mtp))
            hf_meta[f"{name}_error"] = f"{type(e).__name__}: {e}"
            print(f"{name} failed in warm-up: {hf_meta[f'{name}_error']}")
    if hf is not None and "hf_plain" not in dict(hf_modes):
        hf_modes = []

    # Draft cost c, measured directly (context ~ a prompt plus half the generation).
    context = int(mean(len(i) for i in prompt_ids) + args.max_tokens // 2)
    costs = measure_step_costs(engine.model, max(ks), context, args.cost_repeats, engine.build.kv_block_size)
    print(f"draft cost c = t_mtp / t_target = {costs['mtp_s'] * 1e3:.2f} / {costs['target_s'][1] * 1e3:.2f} ms "
          f"= {costs['draft_cost_c']:.3f}")

    settings = [f"k{k}" for k in ks] + [m for m, _ in hf_modes]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
    bar = tqdm(total=len(prompts) * len(settings), desc="speculative", dynamic_ncols=True)
    for i, ids in enumerate(prompt_ids):
        for k in ks:
            runs[f"k{k}"].append(run_ours(executors[k], clocks[k], ids, params))
            bar.update(1)
        for name, use_mtp in hf_modes:
            runs[name].append(hf_generate(hf, ids, args.max_tokens, use_mtp))
            bar.update(1)
        bar.set_postfix(k0_tpot_ms=f"{mean(r['tpot_s'] for r in runs['k0']) * 1e3:.1f}")
    bar.close()
    for ex in executors.values():
        ex.shutdown()

    ref = [r["token_ids"] for r in runs["k0"]]
    summary = {s: summarize(runs[s], ref) for s in settings}
    if hf_modes:
        for m, _ in hf_modes:
            hf_ref = [r["token_ids"] for r in runs["hf_plain"]]
            summary[m]["outputs_equal_hf_plain"] = sum(r["token_ids"] == x for r, x in zip(runs[m], hf_ref))

    # Speed-ups (TPOT ratios) and the ideal model.
    t0 = summary["k0"]["tpot_mean_s"]
    a = summary["k1"]["acceptance_rate"] if "k1" in summary else None
    c = costs["draft_cost_c"]
    for k in ks:
        s = summary[f"k{k}"]
        s["speedup_tpot_vs_k0"] = ratio(t0, s["tpot_mean_s"])
        s["speedup_e2e_vs_k0"] = ratio(s["e2e_tokens_per_s"], summary["k0"]["e2e_tokens_per_s"])
        if a is not None:
            s["expected_tokens_per_step"] = expected_tokens(a, k)
            s["ideal_speedup"] = expected_tokens(a, k) / (1 + k * c)
            verify = costs["target_s"][k + 1] + k * costs["mtp_s"]
            s["cost_model_speedup"] = expected_tokens(a, k) / (verify / costs["target_s"][1])
        s["free_draft_bound"] = s["decode_tokens_per_step"] / costs["verify_cost_ratio"][k + 1]
    best_k = max((k for k in ks if k), key=lambda k: summary[f"k{k}"]["speedup_tpot_vs_k0"] or 0, default=None)
    ratios = {
        "k1_tpot_speedup_vs_k0": summary["k1"]["speedup_tpot_vs_k0"] if "k1" in summary else None,
        "best_k": best_k,
        "best_k_tpot_speedup_vs_k0": summary[f"k{best_k}"]["speedup_tpot_vs_k0"] if best_k else None,
        "k0_tpot_speedup_vs_hf_plain": ratio(summary["hf_plain"]["tpot_mean_s"], t0) if hf_modes else None,
        "k0_e2e_speedup_vs_hf_plain": ratio(summary["k0"]["e2e_tokens_per_s"],
                                            summary["hf_plain"]["e2e_tokens_per_s"]) if hf_modes else None,
        "k1_tpot_speedup_vs_hf_mtp": ratio(summary["hf_mtp"]["tpot_mean_s"], summary["k1"]["tpot_mean_s"])
        if "hf_mtp" in summary and "k1" in summary else None,
        "hf_mtp_tpot_speedup_vs_hf_plain": ratio(summary["hf_plain"]["tpot_mean_s"], summary["hf_mtp"]["tpot_mean_s"])
        if "hf_mtp" in summary else None,
    }
    targets = [
        target_line("our k=1 vs our k=0 (TPOT)", ratios["k1_tpot_speedup_vs_k0"], TARGETS["k1_vs_k0"]),
        target_line(f"our best k (k={best_k}) vs our k=0 (TPOT)", ratios["best_k_tpot_speedup_vs_k0"],
                    TARGETS["best_vs_k0"]),
        target_line("our k=0 vs HF plain generate (TPOT)", ratios["k0_tpot_speedup_vs_hf_plain"], TARGETS["k0_vs_hf"]),
    ]

    results = {
        "benchmark": "speculative",
        "quick": args.quick,
        "settings": {"num_prompts": len(prompts), "max_tokens": args.max_tokens, "ks": ks, "greedy": True,
                     "ignore_eos": True, "batch_size": 1, "speculation": "fixed",
                     "prompt_tokens": [len(i) for i in prompt_ids],
                     "prompt_sources": [x["source"] for x in prompts]},
        "machine": info,
        "engine": eng_info,
        "hf": {"error": hf_error, **{k: v for k, v in hf_meta.items()}} if not args.no_hf else None,
        "draft_cost": costs,
        "formula": FORMULA,
        "summary": summary,
        "ratios": ratios,
        "targets": targets,
        "per_request": {s: [{k: v for k, v in r.items() if k != "token_ids"} for r in runs[s]] for s in settings},
    }

    md = [f"# MTP speculative decoding, batch 1, {args.device.upper()}{' (quick smoke run)' if args.quick else ''}", "",
          f"Model `{args.model}` ({eng_info['parameters_target'] / 1e6:.2f}M target + "
          f"{eng_info['parameters_mtp'] / 1e6:.2f}M MTP parameters, {eng_info['dtype']}); "
          f"{len(prompts)} held-out prompts ({', '.join(sorted({x['source'] for x in prompts}))}), "
          f"{args.max_tokens} new tokens each, greedy, ignore_eos; runs interleaved per prompt; "
          "speed-ups are TPOT ratios (mean over prompts).", "",
          "## Our runtime (speculation fixed, one executor per k)", ""]
    rows = []
    for k in ks:
        s = summary[f"k{k}"]
        rows.append([k, s["decode_tokens_per_s"], s["e2e_tokens_per_s"], s["tpot_mean_s"] * 1e3,
                     s["ttft_mean_s"] * 1e3 if s["ttft_mean_s"] else None,
                     s["acceptance_rate"] if k else None, s["decode_tokens_per_step"], s["speedup_tpot_vs_k0"],
                     s.get("ideal_speedup"), s.get("cost_model_speedup"), s["free_draft_bound"],
                     f"{s['outputs_equal_reference']}/{s['requests']}"])
    md.append(md_table(["k", "decode tok/s", "e2e tok/s", "TPOT ms", "TTFT ms", "acceptance", "tokens/step",
                        "speed-up vs k=0", "ideal", "cost-model", "free drafts", "output == k=0"], rows))
    md += ["", "## Draft cost", "",
           f"Measured directly at batch 1 on the paged path, {costs['context_tokens']} cached tokens, median of "
           f"{costs['repeats']} interleaved rounds: one MTP step (layer + shared head) "
           f"{costs['mtp_s'] * 1e3:.2f} ms, one target decode step (forward + lm_head) "
           f"{costs['target_s'][1] * 1e3:.2f} ms: **c = {c:.3f}**.", "",
           md_table(["new target tokens q"] + [str(q) for q in costs["target_s"]],
                    [["target forward ms"] + [v * 1e3 for v in costs["target_s"].values()],
                     ["relative to q=1"] + list(costs["verify_cost_ratio"].values())]), "",
           "In the runner (timers around its methods, per token-emitting step, including MTP catch-up, sampling and "
           "acceptance; the prompt's prefill step is included in 'target'; greedy steps that ran in one kernel call "
           "count in 'one call' alone, as the call does not split them):", "",
           md_table(["k", "draft ms/step", "target+verify ms/step", "draft / target", "one call ms/step"],
                    [[k, summary[f"k{k}"]["runner_draft_s_per_decode_step"] * 1e3,
                      summary[f"k{k}"]["runner_target_s_per_decode_step"] * 1e3,
                      summary[f"k{k}"]["runner_draft_over_target"],
                      summary[f"k{k}"]["runner_one_call_s_per_decode_step"] * 1e3] for k in ks]), "",
           f"Ideal speed-up: {FORMULA}", ""]
    if a is not None:
        md.append(f"Measured a (k=1 acceptance) = {a:.3f}, c = {c:.3f}.")
    md += ["", "## HF transformers generate() on the same checkpoint", ""]
    if hf_modes:
        rows = []
        for m, _ in hf_modes:
            s = summary[m]
            rows.append([m, s["decode_tokens_per_s"], s["e2e_tokens_per_s"], s["tpot_mean_s"] * 1e3,
                         s["ttft_mean_s"] * 1e3, s["decode_tokens_per_step"], s.get("acceptance_rate_implied"),
                         f"{s['outputs_equal_hf_plain']}/{s['requests']}",
                         f"{s['outputs_equal_reference']}/{s['requests']}"])
        md.append(md_table(["mode", "decode tok/s", "e2e tok/s", "TPOT ms", "TTFT ms", "tokens/step",
                            "acceptance (implied)", "output == HF plain", "output == our k=0"], rows))
        md += ["", f"fp32, greedy, `eos_token_id=None`; `use_mtp=True` drafts one token per step with the "
               f"checkpoint's MTP layer (class ignore pattern set to `{hf_meta['mtp_ignore_pattern']}` before "
               "`from_pretrained`); TTFT of `use_mtp=True` includes loading the MTP layer, which HF does per "
               "`generate()` call."]
        if hf_meta.get("fp8_weights_redequantized"):
            md.append(f"- HF's CPU FP8 dequantization derives the block size from the scale grid, wrong for dims that "
                      f"are not multiples of 128: {hf_meta['fp8_weights_redequantized']} weights (e.g. "
                      f"`{hf_meta['fp8_examples'][0]}`) were re-dequantized with the release's padded 128x128 blocks "
                      f"(max abs correction {hf_meta['fp8_max_abs_error_fixed']:.3g}).")
        if hf_meta.get("mtp_fp8_weights_redequantized"):
            md.append(f"- same for HF's MTP layer (hooked MtpModel.from_pretrained): "
                      f"{hf_meta['mtp_fp8_weights_redequantized']} weights re-dequantized.")
        if hf_meta.get("fp8_unchecked_non_multiple_of_block"):
            md.append(f"- not re-checked (fused by HF, dims not multiples of 128): "
                      f"{hf_meta['fp8_unchecked_non_multiple_of_block']}")
        if "mtp_embed_max_abs_diff_vs_main" in hf_meta:
            md.append(f"- the checkpoint's MTP embedding / head differ from the main model's (max abs diff "
                      f"{hf_meta['mtp_embed_max_abs_diff_vs_main']:.3g} / {hf_meta['mtp_head_max_abs_diff_vs_main']:.3g}); "
                      "HF ties its MTP layer to the main ones (DeepSeek-V3 shares them); "
                      + ("HF's MTP was given the checkpoint's own copies, as our runtime uses them."
                         if hf_meta.get("mtp_embed_head_patched") else "HF ran as shipped (tied)."))
    else:
        md.append(hf_error or ("skipped (--no_hf)" if args.no_hf else "no HF mode ran"))
    md += [f"- {k}: {v}" for k, v in hf_meta.items() if k.endswith("_error")]
    md += ["", "## Ratios and targets", "",
           md_table(["ratio", "value"], [[k, v] for k, v in ratios.items()], digits=3), "",
           *[f"- {t['text']}" for t in targets], "", "## Machine", "", machine_md(info)]
    js, mdp = write_results(args.out_dir, args.name, results, "\n".join(md))
    print("\n".join(md[md.index("## Our runtime (speculation fixed, one executor per k)"):][:len(ks) + 4]))
    for t in targets:
        print(t["text"])
    print(f"wrote {js} and {mdp}")


if __name__ == "__main__":
    main()
