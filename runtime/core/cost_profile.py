"""The step cost table adaptive speculation prices drafts with: target forwards over q tokens per sequence and MTP
forwards, timed on this machine at start-up at a few batch sizes (runtime.core.draft_policy reads it)."""

from __future__ import annotations

import time
from typing import Callable

import torch

from runtime.core.draft_policy import StepCosts
from runtime.core.model_runner import ModelRunner


@torch.inference_mode()
def profile_step_costs(runner: ModelRunner, max_batch_size: int, max_k: int, context: int = 64, repeats: int = 5,
                       warmup: int = 2) -> StepCosts:
    """Medians after `warmup` untimed calls (which take a fresh model's first-touch costs and start the kernels'
    threads), at batch sizes up to what the free cache holds; costs forced non-decreasing in q, as they are, so
    noise cannot invert them. The blocks it borrows go back."""
    model, cache = runner.model, runner.cache
    device = cache.tensor.device
    fits = cache.allocator.num_free // cache.blocks_for(context + max_k + 1)
    largest = max(1, min(max_batch_size, fits))
    context = min(context, cache.allocator.num_free * cache.block_size // largest - max_k - 1)
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < largest] + [largest]
    tables = [cache.allocator.allocate(cache.blocks_for(context + max_k + 1)) for _ in range(sizes[-1])]
    sync = torch.cuda.synchronize if cache.tensor.is_cuda else (lambda: None)  # time the GPU's work, not its queueing

    def timed(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return sorted(times)[repeats // 2]

    try:
        # random tokens, so sequences route to different experts as real ones do (one id for all would send every
        # token to the same experts and under-price large batches)
        gen = torch.Generator().manual_seed(0)
        vocab = model.cfg.vocab_size
        target: dict[int, list[float]] = {q: [] for q in range(1, max_k + 2)}
        mtp = []
        for b in sizes:
            for q in target:
                ids = torch.randint(vocab, (b * q,), generator=gen).tolist()
                target[q].append(timed(lambda: model.logits(
                    runner.forward_target(tables[:b], [context] * b, [q] * b, ids))))
            ids = torch.randint(vocab, (b,), generator=gen).to(device)
            hidden = torch.randn(b, model.cfg.hidden_size, generator=gen).to(cache.tensor.dtype).to(device)
            mtp.append(timed(lambda: runner.proposer.forward_mtp(tables[:b], [context] * b, [1] * b, ids, hidden)))
    finally:
        for t in tables:
            cache.allocator.free(t)
    for q in range(2, max_k + 2):
        target[q] = [max(a, b) for a, b in zip(target[q], target[q - 1])]
    return StepCosts(sizes, target, mtp)
