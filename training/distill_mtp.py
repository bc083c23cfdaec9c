"""Fine-tune only the MTP module on the target model's own predictions (self-distillation).

Drafts are accepted when they match what the target would emit, not what the corpus says next,
so after joint training the MTP layer is trained further on KL(target(t+1) || MTP(t)): the target
model is frozen and only run forward; the MTP layer sees the target's final hidden state at t and
the token t+1, and learns the target's distribution for t+2. Its embedding and output head are
frozen and stay equal to the main model's, as DeepSeek-V3 shares them. Writes a checkpoint in the
training format, which `training.export_model` turns into a release.

Drafts after the first re-run the layer on its own hidden state, so each window is also trained the
way drafts 2..D run (`--chain_depth D`): draft d at position p gets the layer's own hidden from
draft d-1 at p-1 and the token after p, and attends to the first-draft entries up to p-d+1, to the
entries drafts 2..d-1 left at the positions in between and to itself, as the paged cache holds them
while drafting; it learns the target's distribution for the token after next. The token is the
window's own, because that distribution is conditioned on it (when drafting, an accepted draft is
the token the target continues from).

  python -m training.distill_mtp --ckpt runs/mini/ckpt.pt --out runs/mini-distill/ckpt.pt --time_budget_min 35
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from runtime.io.atomic import os_error_text
from runtime.model.config import ModelConfig
from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM, Gate
from runtime.cli import interrupt_on_sigterm
from training.balance import ExpertBalancer
from training.cli import (Parser, add_training_flags, at_least_one, check_token_ids, check_training_numbers,
                          check_writable_file, load_checkpoint, token_files)
from training.train_model import batches, save


def draft_rows(ids: torch.Tensor, hidden: torch.Tensor, owns: list[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of drafts 1..D for one dense MTP forward that sees what the paged cache holds while drafting.

    ids [B, n]: the token after each position 0..n-1; hidden [B, n]: the target's hidden there;
    owns[d-1]: the layer's hidden out of the draft-d rows (positions d-1..n-1), for d = 1..D-1.
    Draft d has a row at each position p = d-1..n-1. Returns (ids, hidden, positions, mask [rows, rows]).
    """
    n, depth = ids.shape[1], len(owns) + 1
    rows_ids = torch.cat([ids[:, d - 1:] for d in range(1, depth + 1)], dim=1)
    rows_hidden = torch.cat([hidden] + [own[:, :-1] for own in owns], dim=1)
    draft = torch.cat([torch.full((n - d + 1,), d) for d in range(1, depth + 1)]).to(ids.device)
    positions = torch.cat([torch.arange(d - 1, n) for d in range(1, depth + 1)]).to(ids.device)
    first = (positions - draft + 1)[:, None]  # the last first-draft entry row r's chain starts from
    col_draft, col_pos = draft[None], positions[None]
    mask = ((col_draft == 1) & (col_pos <= first)) | (
        (col_draft > 1) & (col_draft <= draft[:, None]) & (col_pos == first + col_draft - 1))
    return rows_ids, rows_hidden, positions, mask


def chained_logits(model: DeepseekV3ForCausalLM, ids: torch.Tensor, hidden: torch.Tensor, depth: int
                   ) -> list[torch.Tensor]:
    """MTP logits of drafts 1..depth at every position they reach (see `draft_rows`): the hidden
    states each draft leaves for the next come from forwards without gradient, the last forward
    (all drafts) keeps it."""
    owns: list[torch.Tensor] = []
    for d in range(1, depth + 1):
        with torch.set_grad_enabled(torch.is_grad_enabled() and d == depth):
            rows_ids, rows_hidden, positions, mask = draft_rows(ids, hidden, owns)
            logits, own = model.mtp_forward(0, rows_ids, rows_hidden, positions=positions, mask=mask)
        sizes = [ids.shape[1] - j + 1 for j in range(1, d + 1)]
        owns.append(own.split(sizes, dim=1)[-1])
    return list(logits.split(sizes, dim=1))


def distill_loss(model: DeepseekV3ForCausalLM, x: torch.Tensor, depth: int) -> dict[str, torch.Tensor]:
    """x [B, S] -> KL(target || MTP) and argmax agreement of drafts 1..depth; "loss" sums the KLs."""
    with torch.no_grad():
        hidden = model(x)
        teacher = F.log_softmax(model.logits(hidden[:, 1:]), dim=-1)  # [B, S-1]: target's view of t+2 at t+1
    out: dict[str, torch.Tensor] = {}
    for d, logits in enumerate(chained_logits(model, x[:, 1:], hidden[:, :-1], depth), start=1):
        student, target = F.log_softmax(logits, dim=-1), teacher[:, d - 1:]  # draft d at p predicts p+2
        out[f"kl{d}"] = F.kl_div(student, target, log_target=True, reduction="none").sum(-1).mean()
        out[f"agree{d}"] = (student.argmax(-1) == target.argmax(-1)).float().mean()
    out["loss"] = sum(out[f"kl{d}"] for d in range(1, depth + 1))
    return out


@torch.no_grad()
def evaluate(model: DeepseekV3ForCausalLM, val: np.ndarray, args: argparse.Namespace) -> dict[str, float]:
    gen = np.random.default_rng(1234)
    sums: dict[str, float] = {}
    for _ in range(args.eval_batches):
        for k, v in distill_loss(model, batches(val, args.batch_size, args.seq_len, gen), args.eval_depth).items():
            sums[k] = sums.get(k, 0.0) + v.item()
    return {f"val_{k}": v / args.eval_batches for k, v in sums.items() if k != "loss"}


def main(argv: list[str] | None = None) -> None:
    p = Parser("distill_mtp", __doc__)
    p.add_argument("--ckpt", type=Path, required=True, help="training checkpoint (training.train_model)")
    p.add_argument("--out", type=Path, required=True, help="checkpoint to write (not --ckpt)")
    add_training_flags(p, lr=5e-4, warmup=20, eval_every=100, eval_batches=8)
    p.add_argument("--time_budget_min", type=float, default=30.0, help="minutes of distillation")
    p.add_argument("--chain_depth", type=int, default=2, help="train drafts 1..D, each chained on the one before")
    p.add_argument("--eval_depth", type=int, default=4, help="report drafts 1..D on validation windows")
    p.add_argument("--seed", type=int, default=0, help="seed of the training windows")
    args = p.parse_args(argv)
    at_least_one(p, args, ("batch_size", "seq_len", "warmup", "eval_every", "eval_batches", "chain_depth",
                           "eval_depth"))
    check_training_numbers(p, args, ("time_budget_min",))
    if args.out.resolve() == args.ckpt.resolve():
        p.error(f"--out {args.out} is --ckpt; writing it would replace the training checkpoint (train_model "
                "--resume needs it); choose another path")
    check_writable_file(p, "--out", args.out)
    train, val = token_files(p, args.data_dir, args.seq_len, f"--seq_len {args.seq_len}")
    state = load_checkpoint(p, "--ckpt", args.ckpt, ("config", "model", "step", "args"))
    check_token_ids(p, args.data_dir, {"train.bin": train, "val.bin": val}, state["config"]["vocab_size"],
                    f"--ckpt {args.ckpt}")
    if args.threads:
        torch.set_num_threads(args.threads)
    interrupt_on_sigterm()
    try:
        distill(args, state, train, val)
    except KeyboardInterrupt:
        print(f"{p.prog}: interrupted; --out {args.out} was not written", file=sys.stderr)
        sys.exit(130)
    except OSError as e:  # no space, no permission: atomic_write leaves no partial file
        p.error(f"{os_error_text(e)}; --out {args.out} was not written")


def distill(args: argparse.Namespace, state: dict, train: np.ndarray, val: np.ndarray) -> None:
    """Train the MTP layer of state's model for --time_budget_min (less if interrupted) and write --out."""
    cfg = ModelConfig.from_dict(state["config"])
    model = DeepseekV3ForCausalLM(cfg)
    model.load_state_dict(state["model"])
    model.eval()  # no dropout anywhere; eval() only documents that the target is frozen
    mtp = model.mtp[0]
    copies = {id(mtp.embed_tokens.weight), id(mtp.shared_head.head.weight)}  # of the main model's
    trained = [q for q in mtp.parameters() if id(q) not in copies]
    for q in model.parameters():
        q.requires_grad_(False)
    for q in trained:
        q.requires_grad_(True)
    opt = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    balancer = ExpertBalancer([next(m for m in mtp.modules() if isinstance(m, Gate))], args.bias_gamma)

    gen = np.random.default_rng(args.seed)
    log = [{"step": 0} | evaluate(model, val, args)]
    tqdm.write(json.dumps(log[-1]))
    budget, t0, step = 60 * args.time_budget_min, time.time(), 0
    bar = tqdm(total=round(budget), desc="distill (s)", dynamic_ncols=True)
    try:  # Ctrl-C or SIGTERM ends the distillation early: what it has is written
        while (elapsed := time.time() - t0) < budget:
            done = elapsed / budget
            cos = 0.5 * (1 + math.cos(math.pi * done))
            lr = args.lr * min(1.0, (step + 1) / args.warmup) * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)
            for group in opt.param_groups:
                group["lr"] = lr
            losses = distill_loss(model, batches(train, args.batch_size, args.seq_len, gen), args.chain_depth)
            opt.zero_grad(set_to_none=True)
            losses["loss"].backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            opt.step()
            balancer.step()  # the MTP layer's experts
            step += 1
            bar.update(round(time.time() - t0) - bar.n)
            bar.set_postfix(step=step, **{k: f"{v.item():.3f}" for k, v in losses.items() if k != "loss"})
            if step % args.eval_every == 0:
                log.append({"step": step, "lr": lr} | evaluate(model, val, args))
                tqdm.write(json.dumps(log[-1]))
    except KeyboardInterrupt:
        tqdm.write(f"interrupted at step {step}; writing {args.out} (a second interrupt stops without writing)")
    bar.close()
    log.append({"step": step} | evaluate(model, val, args))
    tqdm.write(json.dumps(log[-1]))
    save(args.out, {"model": model.state_dict(), "step": state["step"], "config": state["config"],
                    "args": state["args"], "distill": {"args": vars(args) | {"ckpt": str(args.ckpt), "out": str(args.out),
                                                                           "data_dir": str(args.data_dir)},
                                                        "steps": step, "log": log}})


if __name__ == "__main__":
    main()
