"""Helpers shared by the executor tests: ordering the step loop against the test's thread, outputs of a fresh
executor, the end-of-test check that every KV block came back, seeded requests with every sampling feature, and the
statistical check that sampled tokens follow the target's distribution (CPU and CUDA tests alike)."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Callable

import pytest
import torch

from runtime.core.sampling_params import SamplingParams
from runtime.core.step_inputs import StepInputs
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.executors.outputs import RequestOutput

from conftest import chi2_pvalue

P_MIN = 1e-3  # a correct sampler passes the chi-square check at this level (the draws are seeded)


def seeded_requests_take_rejection_sampling(mp: pytest.MonkeyPatch) -> None:
    """Seeded sampled requests race (runtime.core.sampling); the others, whose seeds a test cannot choose, take
    rejection sampling: this gives seeded requests the others' path, for tests of it."""
    mp.setattr(StepInputs, "raced_rows", lambda self, seqs: [])


def hold_inbox_until(ex: Executor, event: threading.Event) -> None:
    """Make the step loop wait for `event` before it next takes submitted requests: everything submitted
    meanwhile joins the scheduler in one step, however slowly the test's thread runs on a loaded machine."""
    drain = ex._drain_inbox

    def held() -> None:
        event.wait(30)
        ex._drain_inbox = drain  # once: a test that fails before setting the event waits 30 s, not at every step
        drain()

    ex._drain_inbox = held


def assert_all_free(ex: Executor) -> None:
    s = ex.stats()
    assert s.kv_blocks_used == 0 and s.kv_blocks_free == ex.cache.allocator.num_blocks, s
    assert s.running == 0 and s.queued == 0, s
    assert ex.cache.allocator.all_free(), "a block is missing from the free list or is on it twice"


def run_fresh(engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], k: int, *,
              alone: bool = False, speculation: str = "fixed", max_seq_len: int = 256, **config) -> list[RequestOutput]:
    """Outputs on a fresh executor drafting k tokens (0: plain), all submitted together or one at a time; every
    KV block back at the end."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    cfg = ExecutorConfig(num_draft_tokens=k, speculation=speculation, max_seq_len=max_seq_len,
                         **config)
    with Executor(engine, cfg) as ex:
        if alone:
            outs = [ex.submit(p, sp).result(120) for p, sp in zip(prompts, params)]
        else:
            outs = [h.result(120) for h in [ex.submit(p, sp) for p, sp in zip(prompts, params)]]
        assert_all_free(ex)
    return outs


def seeded_params() -> list[SamplingParams]:
    """Sampled, seeded requests with every feature a row's distribution has: temperature, top-k, top-p,
    penalties, bans, min_tokens, logprobs (n > 1 runs sequences seeded seed + i: tests/test_n_best_of.py)."""
    return [SamplingParams(temperature=1.0, seed=11, max_tokens=56, ignore_eos=True),
            SamplingParams(temperature=0.7, top_p=0.9, seed=12, logprobs=2, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.2, top_k=20, seed=2**40 + 3, repetition_penalty=1.2, max_tokens=32,
                           ignore_eos=True),
            SamplingParams(temperature=0.9, seed=14, presence_penalty=0.5, frequency_penalty=0.3,
                           bad_token_ids=(5, 6, 7), max_tokens=16, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=15, min_tokens=30, max_tokens=40, stop_token_ids=(1, 2))]


def assert_first_tokens_follow_the_target(model, prompt: list[int], outs: list[RequestOutput], temperature: float,
                                          p_min: float = P_MIN) -> None:
    """Over many sampled requests of one prompt drafting 2 tokens, the first generated token (decided against two MTP
    drafts) follows the target softmax at the prompt's last position, and the second token the target's marginal
    given the first; each check has power (the draft's distribution, and conditioning on the wrong first token, are
    rejected)."""
    n = len(outs)
    device = next(model.parameters()).device
    first = torch.tensor([o.token_ids[0] for o in outs])
    with torch.inference_mode():
        h = model(torch.tensor([prompt], device=device))[0]
        probs = (model.logits(h[-1]).double() / temperature).softmax(-1).cpu()
        q_logits, _ = model.mtp_forward(0, torch.tensor([prompt[1:]], device=device), h[None, :-1])
        q = (q_logits[0, -1].double() / temperature).softmax(-1).cpu()
    top = probs.argsort(descending=True)[:25]
    top = top[probs[top] * n >= 10]
    assert len(top) >= 8, "the model's distribution is too peaked at this prompt for this test"
    counts = torch.cat([torch.bincount(first, minlength=probs.numel())[top].double(),
                        torch.tensor([float((~torch.isin(first, top)).sum())])])
    pv = chi2_pvalue(counts, torch.cat([probs[top], (1 - probs[top].sum())[None]]))
    assert pv > p_min, f"first-token distribution differs from the target (p-value {pv:.2e})"
    assert chi2_pvalue(counts, torch.cat([q[top], (1 - q[top].sum())[None]])) < 1e-6, \
        "the draft distribution is too close to the target's for the check to have power"

    # The second token (accepted draft 2, a residual sample or a bonus token) follows the target given the first:
    # the randomized probability integral transform u = F(t2-) + w p(t2) under p(. | prompt, t1), tokens ordered by
    # probability, must be uniform (20 equal bins).
    first_ids = first.unique()
    with torch.inference_mode():
        ids = torch.cat([torch.tensor(prompt).expand(len(first_ids), -1), first_ids[:, None]], dim=1).to(device)
        p2 = (model.logits(model(ids)[:, -1]).double() / temperature).softmax(-1).cpu()  # [unique t1, V]
    row = torch.searchsorted(first_ids, first)
    second = torch.tensor([o.token_ids[1] for o in outs])

    def pit_pvalue(cond: torch.Tensor) -> tuple[float, torch.Tensor]:
        sorted_p, order = cond.sort(-1, descending=True)
        rank = (order == second[:, None]).float().argmax(-1)
        before = (sorted_p.cumsum(-1) - sorted_p).gather(1, rank[:, None]).squeeze(1)
        w = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        u = before + w * cond.gather(1, second[:, None]).squeeze(1)
        bins = torch.bincount((u * 20).long().clamp(max=19), minlength=20)
        return chi2_pvalue(bins, torch.full((20,), 1 / 20)), bins

    pv2, bins = pit_pvalue(p2[row])
    assert pv2 > p_min, f"second token is not distributed as the target given the first (p-value {pv2:.2e}): {bins}"
    assert pit_pvalue(p2[(row + 1) % len(first_ids)])[0] < 1e-6, "conditioning on the wrong first token passed"


def assert_a_refusal_frees_its_callers(refuse: Callable[[], object], refusal: str, wait_s: float = 0.0) -> None:
    """`refuse()` raises ValueError with `refusal` in it; then, with the garbage collector off, nothing keeps its
    callers' objects alive (wait_s: how long another thread may still hold the refusal): no reference cycle holds the
    refusal's traceback. In a Triton stub such a cycle kept the server's request objects until the stub's exit,
    after its connection was gone, where their destructors crashed it."""
    class Held:
        pass

    def caller(held: Held) -> None:
        refuse()

    held = Held()
    ref = weakref.ref(held)
    gc.disable()
    try:
        try:
            caller(held)
            pytest.fail("it was taken")
        except ValueError as e:  # unlike pytest.raises, keeps no reference to the exception past this block
            assert refusal in str(e), str(e)
        del held
        deadline = time.monotonic() + wait_s
        while ref() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ref() is None, "a reference cycle keeps the refusal's callers alive until a garbage collection"
    finally:
        gc.enable()
