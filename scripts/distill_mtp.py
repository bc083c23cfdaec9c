"""Fine-tune only the MTP module on the target model's own predictions (self-distillation).

Drafts are accepted when they match what the target would emit, not what the corpus says next,
so after joint training the MTP layer is trained further on KL(target(t+1) || MTP(t)): the target
model is frozen and only run forward; the MTP layer sees the target's final hidden state at t and
the token t+1, and learns the target's distribution for t+2. Its embedding and output head are
frozen and stay equal to the main model's, as DeepSeek-V3 shares them. Writes a checkpoint in the
training format, which `export_model.py` turns into a release.

Drafts after the first re-run the layer on its own hidden state, so each window is also trained the
way the second draft runs (`--depth2_weight`): at t+1 the layer gets its own hidden from t and the
token t+2 and attends to the first-draft entries before t+1 and to itself, as the paged cache holds
them while drafting; it learns the target's distribution for t+3. The token is the window's own,
because the target's distribution for t+3 is conditioned on it (when drafting, an accepted first
draft is the token the target continues from).

  python scripts/distill_mtp.py --ckpt runs/mini/ckpt.pt --out runs/mini-distill/ckpt.pt --time_budget_min 35
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from train_model import batches, save  # scripts/ is on sys.path when run as a script

from runtime.config import ModelConfig
from runtime.model import DeepseekV3ForCausalLM, Gate


def chained_rows(ids: torch.Tensor, hidden: torch.Tensor, own: torch.Tensor, next_ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """First-draft rows at positions 0..n-1 (ids [B, n] the token after each position, hidden [B, n]
    the target's) followed by second-draft rows at 1..n-1 (next_ids [B, n-1] the token after each,
    own [B, n] the layer's hidden from the first draft one position back) -> (ids, hidden, positions,
    mask) for one dense MTP forward that sees what the paged cache holds while drafting."""
    n = ids.shape[1]
    ones = torch.ones(2 * n - 1, 2 * n - 1, dtype=torch.bool, device=ids.device)
    mask = torch.zeros_like(ones)
    mask[:n, :n] = ones[:n, :n].tril()  # first drafts: causal among themselves
    mask[n:, :n] = ones[n:, :n].tril()  # the second draft at p: the first drafts before p ...
    mask[n:, n:] = torch.eye(n - 1, dtype=torch.bool, device=ids.device)  # ... and itself
    positions = torch.cat([torch.arange(n), torch.arange(1, n)]).to(ids.device)
    return torch.cat([ids, next_ids], dim=1), torch.cat([hidden, own[:, :-1]], dim=1), positions, mask


def distill_loss(model: DeepseekV3ForCausalLM, x: torch.Tensor, depth2_weight: float) -> dict[str, torch.Tensor]:
    """x [B, S] -> KL(target || MTP) and argmax agreement, for the first draft and, when
    depth2_weight > 0, the second draft chained on the first; "loss" weighs the two KLs."""
    with torch.no_grad():
        hidden = model(x)
        teacher = F.log_softmax(model.logits(hidden[:, 1:]), dim=-1)  # [B, n]: target's view of t+2 at t+1
    n = x.shape[1] - 1
    ids, hid, targets, positions, mask = x[:, 1:], hidden[:, :-1], teacher, None, None
    if depth2_weight > 0:
        with torch.no_grad():
            _, own = model.mtp_forward(0, ids, hid)
        ids, hid, positions, mask = chained_rows(ids, hid, own, ids[:, 1:])
        targets = torch.cat([teacher, teacher[:, 1:]], dim=1)  # the second draft at p predicts t+3
    student, _ = model.mtp_forward(0, ids, hid, positions=positions, mask=mask)
    student = F.log_softmax(student, dim=-1)
    kl = F.kl_div(student, targets, log_target=True, reduction="none").sum(-1)  # [B, rows]
    agree = (student.argmax(-1) == targets.argmax(-1)).float()
    out = {"kl": kl[:, :n].mean(), "agree": agree[:, :n].mean()}
    if depth2_weight > 0:
        out |= {"kl2": kl[:, n:].mean(), "agree2": agree[:, n:].mean()}
    out["loss"] = out["kl"] + depth2_weight * out.get("kl2", 0.0)
    return out


@torch.no_grad()
def evaluate(model: DeepseekV3ForCausalLM, val: np.ndarray, args: argparse.Namespace) -> dict[str, float]:
    gen = np.random.default_rng(1234)
    sums: dict[str, float] = {}
    for _ in range(args.eval_batches):
        for k, v in distill_loss(model, batches(val, args.batch_size, args.seq_len, gen), 1.0).items():
            sums[k] = sums.get(k, 0.0) + v.item()
    return {f"val_{k}": v / args.eval_batches for k, v in sums.items() if k != "loss"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", type=Path, required=True, help="training checkpoint (train_model.py)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data_dir", type=Path, default=Path("data"))
    p.add_argument("--time_budget_min", type=float, default=30.0)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--min_lr_ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--depth2_weight", type=float, default=1.0,
                   help="weight of the chained second draft's KL (0: train the first draft only)")
    p.add_argument("--bias_gamma", type=float, default=1e-3)
    p.add_argument("--eval_every", type=int, default=100)
    p.add_argument("--eval_batches", type=int, default=8)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    state = torch.load(args.ckpt, map_location="cpu", weights_only=False)
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
    gate = next(m for m in mtp.modules() if isinstance(m, Gate))
    load = {}
    gate.register_forward_hook(lambda mod, inp, out: load.__setitem__(
        "v", torch.bincount(out[1].flatten(), minlength=cfg.n_routed_experts).float()))

    train = np.memmap(args.data_dir / "train.bin", dtype=np.uint16, mode="r")
    val = np.memmap(args.data_dir / "val.bin", dtype=np.uint16, mode="r")
    gen = np.random.default_rng(args.seed)
    log = [{"step": 0} | evaluate(model, val, args)]
    tqdm.write(json.dumps(log[-1]))
    budget, t0, step = 60 * args.time_budget_min, time.time(), 0
    bar = tqdm(total=round(budget), desc="distill (s)", dynamic_ncols=True)
    while (elapsed := time.time() - t0) < budget:
        done = elapsed / budget
        cos = 0.5 * (1 + math.cos(math.pi * done))
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)
        for group in opt.param_groups:
            group["lr"] = lr
        losses = distill_loss(model, batches(train, args.batch_size, args.seq_len, gen), args.depth2_weight)
        opt.zero_grad(set_to_none=True)
        losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        with torch.no_grad():  # auxiliary-loss-free balancing of the MTP layer's experts
            gate.e_score_correction_bias += args.bias_gamma * torch.sign(load["v"].mean() - load["v"])
        step += 1
        bar.update(round(time.time() - t0) - bar.n)
        bar.set_postfix(step=step, **{k: f"{v.item():.3f}" for k, v in losses.items() if k != "loss"})
        if step % args.eval_every == 0:
            log.append({"step": step, "lr": lr} | evaluate(model, val, args))
            tqdm.write(json.dumps(log[-1]))
    bar.close()
    log.append({"step": step} | evaluate(model, val, args))
    tqdm.write(json.dumps(log[-1]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(args.out, {"model": model.state_dict(), "step": state["step"], "config": state["config"],
                    "args": state["args"], "distill": {"args": vars(args) | {"ckpt": str(args.ckpt), "out": str(args.out),
                                                                           "data_dir": str(args.data_dir)},
                                                        "steps": step, "log": log}})


if __name__ == "__main__":
    main()
