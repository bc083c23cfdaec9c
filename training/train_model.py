"""Train the project's small DeepSeek-V3 + MTP model with the runtime's own model code.

Loss = next-token CE + mtp_weight x MTP CE (the MTP layer sees the target's final hidden state
after model.norm and the embedding of the next token, and predicts the token after it; it shares
the embedding and the output head with the main model, as DeepSeek-V3 does).
Experts are balanced without an auxiliary loss, as DeepSeek-V3 does: after every step each MoE
gate's e_score_correction_bias moves by gamma * sign(mean load - expert load).

  python -m training.train_model --data_dir data --out_dir runs/mini --steps 3000
  python -m training.train_model --data_dir data --out_dir runs/mini --resume   # continue
"""

from __future__ import annotations

import argparse
import io
import json
import math
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from runtime.cli import interrupt_on_sigterm
from runtime.io.atomic import atomic_write, interrupts_held, os_error_text
from runtime.model.config import ConfigError, ModelConfig
from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM, Gate
from training.balance import ExpertBalancer
from training.cli import (Parser, add_training_flags, at_least_one, check_device, check_token_ids,
                          check_training_numbers, load_checkpoint, token_files)

# Every DeepSeek-V3 feature on, proportioned so one MTP step is cheap next to the 21-layer target.
# Head dims keep V3's proportions (nope 2 x rope, v = nope); every FP8 matrix dimension is below 128
# or a multiple of it, which transformers' FP8 loader assumes when it infers the block size.
MINI_CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
    vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
    num_hidden_layers=21, num_nextn_predict_layers=1, first_k_dense_replace=1, moe_layer_freq=1,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=64,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
    hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=512, beta_fast=32,
                      beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, attention_bias=False, torch_dtype="bfloat16",
)


def batches(tokens: np.ndarray, batch_size: int, length: int, gen: np.random.Generator) -> torch.Tensor:
    starts = gen.integers(0, len(tokens) - length, size=batch_size)
    return torch.from_numpy(np.stack([tokens[s : s + length] for s in starts]).astype(np.int64))


def losses(model: DeepseekV3ForCausalLM, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chunk [B, S+2] -> (main CE, MTP CE, MTP top-1 agreement with the true token t+2)."""
    x, y, y2 = chunk[:, :-2], chunk[:, 1:-1], chunk[:, 2:]
    hidden = model(x)
    main = F.cross_entropy(model.logits(hidden).flatten(0, 1), y.flatten())
    mtp_logits, _ = model.mtp_forward(0, y, hidden)
    mtp = F.cross_entropy(mtp_logits.flatten(0, 1), y2.flatten())
    acc = (mtp_logits.argmax(-1) == y2).float().mean()
    return main, mtp, acc


@torch.no_grad()
def evaluate(model: DeepseekV3ForCausalLM, val: np.ndarray, args: argparse.Namespace) -> dict[str, float]:
    model.eval()
    gen = np.random.default_rng(1234)
    out = np.zeros(3)
    for _ in range(args.eval_batches):
        out += [t.item() for t in losses(model, batches(val, args.batch_size, args.seq_len + 2, gen).to(args.device))]
    model.train()
    main, mtp, acc = out / args.eval_batches
    return {"val_loss": main, "val_mtp_loss": mtp, "val_mtp_acc": acc}


def progress(step: int, elapsed_s: float, args: argparse.Namespace) -> float:
    """Fraction of training done: by steps, or by wall-clock time when a budget is set."""
    by_steps = step / args.steps
    return max(by_steps, elapsed_s / (60 * args.time_budget_min)) if args.time_budget_min else by_steps


def lr_at(step: int, done: float, args: argparse.Namespace) -> float:
    """Linear warm-up over the first warmup / steps of training, then a cosine over the rest down to
    min_lr_ratio. Both are measured in `done`, so with a time budget the warm-up is a share of the
    time and the cosine starts at its peak where the warm-up ends (no jump)."""
    warm = min(1.0, args.warmup / args.steps)
    if done < warm:
        return args.lr * min(1.0, max((step + 1) / args.warmup, done / warm))
    t = min(1.0, max(0.0, (done - warm) / (1 - warm)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def save(path: Path, state: dict) -> None:
    """torch.save through runtime/io/atomic's atomic_write: a crash or a full disk leaves the previous checkpoint,
    never a partial one, and the new one is on disk (fsync) before it replaces the old."""
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write(path, buf.getvalue())


def main(argv: list[str] | None = None) -> None:
    p = Parser("train_model", __doc__)
    add_training_flags(p, lr=2e-3, warmup=100, eval_every=200, eval_batches=4, at_evaluations=" (and checkpoints)")
    p.add_argument("--out_dir", type=Path, default=Path("runs/mini"), help="run directory: config.json, ckpt.pt, log.jsonl")
    p.add_argument("--config", type=Path, help="config.json to train (default: the built-in mini config; with "
                                               "--resume, the checkpoint's)")
    p.add_argument("--steps", type=int, default=3000, help="optimizer steps of the schedule")
    p.add_argument("--time_budget_min", type=float, default=0.0,
                   help="finish the schedule after this many minutes of training (resumes included) even if steps "
                        "remain; 0: no budget")
    p.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay of the matrices")
    p.add_argument("--mtp_weight", type=float, default=0.3, help="weight of the MTP loss")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--resume", action="store_true", help="continue from --out_dir's ckpt.pt")
    p.add_argument("--force", action="store_true", help="start over in an --out_dir that holds a checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the training windows")
    args = p.parse_args(argv)
    at_least_one(p, args, ("steps", "batch_size", "seq_len", "warmup", "eval_every", "eval_batches"))
    check_training_numbers(p, args, ("time_budget_min", "weight_decay", "mtp_weight"))
    check_device(p, args.device)
    if args.resume and args.force:
        p.error("--resume continues --out_dir's checkpoint and --force starts over; give one of them")
    train_tokens, val = token_files(p, args.data_dir, args.seq_len + 2, f"--seq_len {args.seq_len} + 2")
    try:
        cfg = ModelConfig.from_json(args.config) if args.config else ModelConfig.from_dict(MINI_CONFIG)
    except ConfigError as e:
        p.error(f"--config {e}")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        p.error(f"--out_dir {args.out_dir}: not a directory")
    ckpt_path = args.out_dir / "ckpt.pt"
    state = None
    if args.resume:
        if not ckpt_path.exists():
            p.error(f"--resume: no checkpoint to continue at {ckpt_path}")
        state = load_checkpoint(p, "--resume", ckpt_path, ("model", "opt", "step", "elapsed_s", "rng", "config"),
                                args.device, made_by="training.train_model")
        try:
            trained = ModelConfig.from_dict(state["config"], source=f"--resume {ckpt_path}: its config")
        except ConfigError as e:
            p.error(str(e))
        if args.config is not None:  # the model resumed is the one trained: another config would not hold its weights
            given, saved = cfg.to_dict(), trained.to_dict()
            differ = [f"{k} ({given.get(k)!r}, the checkpoint's {saved.get(k)!r})"
                      for k in sorted(given.keys() | saved.keys()) if given.get(k) != saved.get(k)]
            if differ:
                p.error(f"--config {args.config} differs from the config of --resume {ckpt_path} in "
                        f"{', '.join(differ)}; leave --config out to continue with the checkpoint's")
        cfg = trained
    elif ckpt_path.exists() and not args.force:
        p.error(f"--out_dir {args.out_dir} holds a checkpoint ({ckpt_path}); pass --resume to continue it or --force "
                "to start over")
    check_token_ids(p, args.data_dir, {"train.bin": train_tokens, "val.bin": val}, cfg.vocab_size,
                    f"--resume {ckpt_path}" if args.resume else f"--config {args.config}" if args.config else
                    "the built-in mini config")
    if args.threads:
        torch.set_num_threads(args.threads)
    interrupt_on_sigterm()
    try:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(args.out_dir / "config.json", json.dumps(cfg.to_dict(), indent=2))
        step = train(args, cfg, state, train_tokens, val)
    except KeyboardInterrupt:  # before the first step: nothing to save
        print(f"{p.prog}: interrupted before the first step; {ckpt_path} was not written", file=sys.stderr)
        sys.exit(130)
    except OSError as e:  # no space, no permission: save() leaves the last whole checkpoint, or none
        kept = "keeps the last checkpoint written whole" if ckpt_path.exists() else "was not written"
        p.error(f"{os_error_text(e, args.out_dir)}; {ckpt_path} {kept}")
    if step is not None:
        print(f"{p.prog}: interrupted at step {step}; saved it to {ckpt_path} (--resume continues it)",
              file=sys.stderr)
        sys.exit(130)


def train(args: argparse.Namespace, cfg: ModelConfig, state: dict | None, train_tokens: np.ndarray,
          val: np.ndarray) -> int | None:
    """Train (from `state`, a checkpoint, if given) until the schedule is done, saving every --eval_every steps; on
    Ctrl-C or SIGTERM save the steps done and return their number (None when the schedule finished)."""
    ckpt_path = args.out_dir / "ckpt.pt"
    torch.manual_seed(args.seed)
    model = DeepseekV3ForCausalLM(cfg).to(args.device)
    model.init_weights(seed=args.seed)
    for mtp in model.mtp:  # DeepSeek-V3 shares the embedding and output head with its MTP modules;
        mtp.embed_tokens.weight = model.model.embed_tokens.weight  # the release stores copies
        mtp.shared_head.head.weight = model.lm_head.weight
    decay = [p_ for n, p_ in model.named_parameters() if p_.dim() >= 2 and "embed" not in n]
    no_decay = [p_ for n, p_ in model.named_parameters() if not (p_.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    step, gen, elapsed_before = 0, np.random.default_rng(args.seed), 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, elapsed_before = state["step"], state["elapsed_s"]
        gen.bit_generator.state = state["rng"]
        print(f"resumed at step {step}")
    rng = gen.bit_generator.state  # the windows' generator after the steps done: what a checkpoint resumes from

    def checkpoint(elapsed: float) -> dict:
        return {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "rng": rng, "elapsed_s": elapsed,
                "config": cfg.to_dict(), "args": vars(args) | {"data_dir": str(args.data_dir),
                                                              "out_dir": str(args.out_dir), "config": str(args.config)}}

    balancer = ExpertBalancer([m for m in model.modules() if isinstance(m, Gate)], args.bias_gamma)

    log = (args.out_dir / "log.jsonl").open("a" if args.resume else "w")
    model.train()
    t0, tokens_seen = time.time(), 0
    bar = tqdm(total=args.steps, initial=step, desc="train", dynamic_ncols=True)
    try:
        # a finished run resumes to nothing
        while (done := progress(step, elapsed_before + time.time() - t0, args)) < 1.0:
            lr = lr_at(step, done, args)
            for group in opt.param_groups:
                group["lr"] = lr
            chunk = batches(train_tokens, args.batch_size, args.seq_len + 2, gen).to(args.device)
            main_loss, mtp_loss, _ = losses(model, chunk)
            loss = main_loss + args.mtp_weight * mtp_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with interrupts_held():  # a step is applied whole or not at all: an interrupt saves the steps done
                opt.step()
                balancer.step()
                step += 1
                rng = gen.bit_generator.state
            tokens_seen += chunk.numel()
            bar.update(1)
            bar.set_postfix(loss=f"{main_loss.item():.3f}", mtp=f"{mtp_loss.item():.3f}",
                            tok_s=f"{tokens_seen / (time.time() - t0):.0f}")
            elapsed = elapsed_before + time.time() - t0
            done = progress(step, elapsed, args)
            record = {"step": step, "loss": main_loss.item(), "mtp_loss": mtp_loss.item(), "lr": lr,
                      "elapsed_s": elapsed}
            if step % args.eval_every == 0 or done >= 1.0:
                record |= evaluate(model, val, args)
                tqdm.write(json.dumps(record))
                save(ckpt_path, checkpoint(elapsed))
            log.write(json.dumps(record) + "\n")
            log.flush()
    except KeyboardInterrupt:
        with interrupts_held():  # a second interrupt waits for the checkpoint, then is dropped: this one is handled
            save(ckpt_path, checkpoint(elapsed_before + time.time() - t0))
            while signal.sigtimedwait((signal.SIGINT, signal.SIGTERM), 0):  # taken off the pending set, unhandled
                pass
        return step
    finally:
        bar.close()
        log.close()
        balancer.remove()
    return None

if __name__ == "__main__":
    main()
