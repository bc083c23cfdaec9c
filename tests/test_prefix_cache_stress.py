"""Randomized checks of the prefix cache with MTP: the block allocator's index under random operations against a
model of what each block holds, and an executor on the shipped model serving random waves of requests (prefixes
around block boundaries, branches splitting at them, repeats and next turns, per-request draft lengths, seeded
sampling, n = 2, cancellations) in a cache small enough to evict and preempt, every output compared with the same
request served without reuse, and each request then served alone drafting and accepting as without reuse."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from runtime.core.kv_cache import BlockAllocator, OutOfBlocks
from runtime.core.sampling_params import SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.io.loading import load_engine

from executor_util import assert_all_free, hold_inbox_until  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

KEYS = [bytes([i]) * 4 for i in range(5)]  # few keys: collisions between blocks of equal content are frequent
TOKENS = [7, 8, 9]


class Truth:
    """What each block really holds and who holds it, kept beside the allocator to check its index against."""

    def __init__(self, n: int):
        self.refs = [0] * n
        self.content: list[bytes | None] = [None] * n  # the key the block's target KV really hashes to
        self.mtp: list[int | None] = [None] * n  # the next token its MTP rows really read (None: not valid)


def check(a: BlockAllocator, m: Truth, where: str) -> None:
    n = a.num_blocks
    assert all(r >= 0 for r in a._refs), where
    assert a._refs == m.refs, (where, a._refs, m.refs)
    # a block is in the free pool iff no sequence holds it, and at most once
    assert set(a._free) == {b for b in range(n) if a._refs[b] == 0}, where
    assert a.num_free + a.num_used == n, where
    indexed = [(k, t, b) for k, blocks in a._cached.items() for t, b in blocks.items()]
    for k, blocks in a._cached.items():
        assert blocks, (where, "empty entry for a key")
        assert None not in blocks or len(blocks) == 1, (where, "target-only entry beside others", blocks)
    for k, t, b in indexed:
        assert a._hash[b] == k and a._mtp_next[b] == t, (where, "index disagrees with the block", k, t, b)
        # the index's claim is true of the block's real content
        assert m.content[b] == k, (where, "indexed block holds other content", b)
        if t is not None:
            assert m.mtp[b] == t, (where, "indexed MTP rows read another next token", b, t, m.mtp[b])
    assert len({b for _, _, b in indexed}) == len(indexed), (where, "a block indexed twice")
    for b in range(n):
        if a._hash[b] is not None:
            assert (a._hash[b], a._mtp_next[b], b) in indexed, (where, "block claims a key it is not indexed under")
    assert a.num_cached == len(indexed) == sum(h is not None for h in a._hash), where
    # free order: blocks caching nothing before cached ones
    order = list(a._free)
    first_cached = next((i for i, b in enumerate(order) if a._hash[b] is not None), len(order))
    assert all(a._hash[b] is not None for b in order[first_cached:]), (where, "uncached free block after a cached one")
    if not any(a._refs):
        assert a.all_free(), where


def random_ops(seed: int, steps: int = 400, n: int = 8) -> None:
    rng = random.Random(seed)
    a, m = BlockAllocator(n), Truth(n)
    holders: list[list[int]] = []  # "sequences": the blocks each holds (a block table)
    for step in range(steps):
        op = rng.choice(["alloc", "alloc", "register", "register", "mark", "mark", "take", "free", "free", "lookup"])
        where = f"seed {seed} step {step} {op}"
        if op == "alloc":
            k = rng.randint(1, 3)
            before_free = list(a._free)
            try:
                got = a.allocate(k)
            except OutOfBlocks:
                assert k > len(before_free), where
                continue
            assert got == before_free[:k], (where, "not handed out in free order")
            for b in got:
                assert a._hash[b] is None, (where, "handed out a block still in the index")
                m.refs[b] = 1
                m.content[b] = rng.choice(KEYS) if rng.random() < 0.9 else None  # None: not filled yet
                m.mtp[b] = None
            holders.append(got)
        elif op == "register":
            held = [b for b in range(n) if m.refs[b] and m.content[b] is not None]
            if not held:
                continue
            b = rng.choice(held)
            key_before = a._hash[b]
            had = m.content[b] in a._cached
            a.register(b, m.content[b])
            if key_before is None and not had:
                assert a._hash[b] == m.content[b] and a._mtp_next[b] is None, where
        elif op == "mark":
            held = [b for b in range(n) if m.refs[b] and m.content[b] is not None]
            if not held:
                continue
            b = rng.choice(held)
            # a block's MTP rows are computed once, by its owner, with the next token its owner had: a block
            # already marked keeps its rows
            t = m.mtp[b] if m.mtp[b] is not None else rng.choice(TOKENS)
            m.mtp[b] = t
            k = m.content[b]
            a.mark_mtp(b, k, t)
            assert None not in a._cached.get(k, {}), (where, "target-only copy survives a mark_mtp")
            assert t in a._cached[k], (where, "no block cached for the marked next token")
        elif op == "take":
            if rng.random() < 0.7:
                k, t = rng.choice(KEYS), rng.choice(TOKENS + [None])
                b = a.lookup(k, t)
                if b is None:
                    continue
                got = [b]
            else:
                held = [b for b in range(n) if m.refs[b]]
                if not held:
                    continue
                got = [rng.choice(held)]
            a.take(got)
            for b in got:
                m.refs[b] += 1
            holders.append(got)
        elif op == "free":
            if not holders:
                continue
            blocks = holders.pop(rng.randrange(len(holders)))
            a.free(blocks)
            for b in blocks:
                m.refs[b] -= 1
        elif op == "lookup":
            k, t = rng.choice(KEYS), rng.choice(TOKENS + [None])
            b = a.lookup(k, t)
            if b is not None:
                assert m.content[b] == k, (where, "lookup returned a block of other content")
                assert a._hash[b] == k, where
                if t is not None and t in {tt for tt in a._cached[k]}:
                    assert a.mtp_next(b) == t, (where, "lookup missed the block for its next token")
                if a.mtp_next(b) is not None:
                    assert m.mtp[b] == a.mtp_next(b), where
            else:
                assert k not in a._cached, where
        check(a, m, where)
    while holders:
        a.free(holders.pop())
    m.refs = [0] * n
    check(a, m, f"seed {seed} end")
    assert a.all_free()




def test_the_allocators_index_holds_under_random_operations() -> None:
    for seed in range(100):
        random_ops(seed)


B = 16  # the shipped model's kv_block_size
LENGTHS = [15, 16, 17, 31, 32, 33, 47, 48, 49]


@pytest.fixture(scope="module")
def shipped(shipped_model_dir):
    from runtime.io.tokenizer import Tokenizer

    eng = load_engine(shipped_model_dir)
    assert eng.build.kv_block_size == B
    tok = Tokenizer.from_dir(shipped_model_dir)
    texts = [tok.encode(x["text"]) for x in json.loads((shipped_model_dir / "heldout_prompts.json").read_text())]
    return eng, [t for t in texts if len(t) >= 60][:3]


def make_requests(rng: random.Random, bases: list[list[int]], n: int, k_max: int, seen: list) -> list[tuple]:
    """seen: earlier (prompt, params) pairs with their reuse-off output: repeated, or continued as a chat's next
    turn (prompt + output + a few tokens), so whole chains and decode-filled blocks get reused too."""
    reqs = []
    for _ in range(n):
        base = rng.choice(bases)
        L = rng.choice(LENGTHS)
        prompt = base[:L] + [rng.choice([101, 202]) for _ in range(rng.choice([0, 0, 1, 2, 3]))]
        if seen and rng.random() < 0.3:
            (p, _), out = rng.choice(seen)
            prompt = list(p) if rng.random() < 0.5 else list(p) + list(out) + [rng.choice([101, 202])] * rng.randint(1, 3)
        k = rng.choice([None, 0, 1, 2, 3])
        if k is not None and k > k_max:
            k = k_max
        max_tokens = rng.choice([1, 2, 5, 9, 14, 20])
        if rng.random() < 0.1:  # several outputs: siblings held until the leader's prompt (and MTP rows) are cached
            params = dict(max_tokens=max_tokens, ignore_eos=True, num_draft_tokens=k, temperature=1.0,
                          seed=rng.randrange(100), n=2)
        elif rng.random() < 0.25:
            params = dict(max_tokens=max_tokens, ignore_eos=True, num_draft_tokens=k, temperature=1.0,
                          seed=rng.randrange(100))
        else:
            params = dict(max_tokens=max_tokens, ignore_eos=True, num_draft_tokens=k)
        cancel_after = rng.choice([None] * 4 + [1, 3]) if max_tokens >= 5 else None
        reqs.append((tuple(prompt), tuple(sorted(params.items())), cancel_after))
    return reqs


def stress(eng, bases: list[list[int]], seed: int, waves: int, pool: int, mnt: int | None, speculation: str,
           k_exec: int = 3) -> list[str]:
    """What differs from the reuse-off outputs, or leaks, over random waves of requests (empty: nothing)."""
    rng = random.Random(seed)
    cfg = dict(num_draft_tokens=k_exec, speculation=speculation, kv_cache_tokens=pool * B, max_seq_len=96,
               max_num_tokens=mnt)
    problems: list[str] = []
    ref: dict = {}
    all_waves = []
    with Executor(eng, ExecutorConfig(enable_block_reuse=False, **cfg)) as off:
        for _ in range(waves):
            wave = make_requests(rng, bases, rng.randint(3, 6), k_exec,
                                 [(key, o[0].token_ids) for key, o in ref.items()])
            all_waves.append(wave)
            for prompt, params, _ in wave:
                if (prompt, params) not in ref:
                    ref[(prompt, params)] = off.submit(list(prompt), SamplingParams(**dict(params))).results(120)
    with Executor(eng, ExecutorConfig(enable_block_reuse=True, **cfg)) as ex:
        for w, wave in enumerate(all_waves):
            go = threading.Event()
            hold_inbox_until(ex, go)
            handles = [ex.submit(list(p), SamplingParams(**dict(sp))) for p, sp, _ in wave]
            cancellers = []
            for h, (_, _, c) in zip(handles, wave):
                if c is not None:
                    def cancel(h=h, c=c):
                        for out in h:
                            if len(out.token_ids) >= c:
                                h.cancel()
                                break
                    th = threading.Thread(target=cancel)
                    th.start()
                    cancellers.append(th)
            go.set()
            outs = [h.results(120) for h in handles]
            for th in cancellers:
                th.join(60)
            for i, o, base, (p, sp, c) in ((i, o, b, r) for i, (os_, r) in enumerate(zip(outs, wave))
                                             for o, b in zip(os_, ref[r[:2]])):
                tag = f"seed {seed} wave {w} req {i} len {len(p)} params {dict(sp)} cancel {c}"
                if o.finish_reason == "cancelled":
                    if list(o.token_ids) != list(base.token_ids[: len(o.token_ids)]):
                        problems.append(f"{tag}: cancelled output {o.token_ids} not a prefix of {base.token_ids}")
                elif list(o.token_ids) != list(base.token_ids):
                    problems.append(f"{tag}: tokens {o.token_ids} != reuse-off {base.token_ids} "
                                    f"(reused {o.stats.num_reused_blocks})")
            try:
                time.sleep(0.05)
                assert_all_free(ex)
            except AssertionError as e:
                problems.append(f"seed {seed} wave {w}: not all free: {e}")
        # the docs' claim: a request served alone drafts and accepts as without reuse (fixed draft length)
        for (p, sp), bases_ in ref.items():
            # several outputs are several sequences at once: under a tiny pool the reuse-off run's siblings compete
            # for blocks (drafts cut, preemption) where the reuse-on ones share the prompt, so drafts differ there
            check_drafts = cfg["speculation"] == "fixed" and dict(sp).get("n", 1) == 1
            for o, base in zip(ex.submit(list(p), SamplingParams(**dict(sp))).results(120), bases_):
                tag = f"seed {seed} alone len {len(p)} params {dict(sp)}"
                if list(o.token_ids) != list(base.token_ids):
                    problems.append(f"{tag}: tokens {o.token_ids} != reuse-off {base.token_ids} "
                                    f"(reused {o.stats.num_reused_blocks})")
                d, db = ((o.stats.num_draft_tokens, o.stats.num_accepted_draft_tokens),
                         (base.stats.num_draft_tokens, base.stats.num_accepted_draft_tokens))
                if d != db and check_drafts:
                    problems.append(f"{tag}: drafts/accepted {d} != reuse-off {db} (reused {o.stats.num_reused_blocks})")
                if o.stats.num_steps != base.stats.num_steps and check_drafts:
                    problems.append(f"{tag}: steps {o.stats.num_steps} != reuse-off {base.stats.num_steps}")
        try:
            assert_all_free(ex)
        except AssertionError as e:
            problems.append(f"seed {seed} end: not all free: {e}")
    return problems




@pytest.mark.parametrize("seed, pool, max_num_tokens, speculation", [
    (0, 8, None, "fixed"), (1, 8, None, "fixed"), (2, 12, 24, "fixed"), (3, 10, None, "adaptive")])
def test_random_waves_serve_what_reuse_off_serves(shipped, seed, pool, max_num_tokens, speculation) -> None:
    problems = stress(*shipped, seed, 8, pool, max_num_tokens, speculation)
    assert not problems, "\n".join(problems)
