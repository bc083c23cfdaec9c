"""Prefix caching (runtime.core.prefix_cache): exact, with MTP, under batching, chunked prefill, eviction,
preemption, cancellation and adaptive drafting; and the block pool it rests on.

Every output with reuse is compared token for token with the same request served without it, and so are the
draft and accepted counts under a fixed draft length: the drafts come from the MTP layer's cache, so a reused
block with wrong MTP rows can change acceptance, though not greedy text. The tiny model's drafts depend little on
attention (zeroed MTP rows left its greedy drafts as they were), so seeded sampling, where the drafts decide the
tokens, is the sharper check (zeroed rows changed them).
After each test every KV block is back in the pool, free or cached (`assert_all_free`).
"""

from __future__ import annotations

import random
import threading

import pytest

from runtime.core.kv_cache import BlockAllocator, OutOfBlocks
from runtime.core.prefix_cache import block_key
from runtime.core.sampling_params import SamplingParams
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.executors.outputs import RequestOutput
from runtime.io.loading import load_engine

from executor_util import assert_all_free, hold_inbox_until  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

BLOCK = 16  # the tiny checkpoint's kv_block_size (BuildConfig's default)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(spec_checkpoint):
    eng = load_engine(spec_checkpoint)
    assert eng.build.kv_block_size == BLOCK
    return eng


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4000) for _ in range(n)]


SYSTEM = tokens(1, 3 * BLOCK + 5)  # a shared prefix that ends mid-block
PROMPTS = [SYSTEM + tokens(10 + i, n) for i, n in enumerate((3, 11, 20, 1, 29))]


def executor(engine, k: int, reuse: bool = True, speculation: str = "fixed", **kw) -> Executor:
    return Executor(engine, ExecutorConfig(num_draft_tokens=k, speculation=speculation,
                                           enable_block_reuse=reuse, **kw))


def serve(ex: Executor, prompts: list[list[int]], params: SamplingParams = GREEDY, batched: bool = False
          ) -> list[RequestOutput]:
    """One at a time, or all submitted together (joining the scheduler in the same step)."""
    if not batched:
        return [ex.submit(p, params).result(120) for p in prompts]
    go = threading.Event()
    hold_inbox_until(ex, go)
    handles = [ex.submit(p, params) for p in prompts]
    go.set()
    return [h.result(120) for h in handles]


def drafts(outs: list[RequestOutput]) -> list[tuple[int, int]]:
    return [(o.stats.num_draft_tokens, o.stats.num_accepted_draft_tokens) for o in outs]


def reused(outs: list[RequestOutput]) -> list[int]:
    return [o.stats.num_reused_blocks for o in outs]


# ---- the block pool ------------------------------------------------------------------------------
def test_freed_registered_blocks_stay_cached_until_evicted_least_recently_used() -> None:
    a = BlockAllocator(6)
    x = a.allocate(3)
    keys = [block_key(b"", [i]) for i in range(3)]
    for block, key in zip(x, keys):
        a.register(block, key)
    a.register(x[0], block_key(b"", [9]))  # a block keeps its first key
    assert [a.lookup(k) for k in keys] == x and a.lookup(block_key(b"", [9])) is None and a.num_cached == 3
    a.free(x)
    assert a.num_free == 6 and a.num_cached == 3 and a.all_free()
    # blocks caching nothing go first, then cached ones, the table's tail first
    y = a.allocate(4)
    assert set(y[:3]).isdisjoint(x) and y[3] == x[2]
    assert a.lookup(keys[2]) is None and [a.lookup(k) for k in keys[:2]] == x[:2], "only the evicted block is gone"
    # a cached free block is taken back as is, shared by a second holder, and counted out of the free ones
    assert a.free_after_taking([x[0], x[1]]) == 0
    a.take([x[0]])
    a.take([x[0]])
    assert a.num_free == 1
    with pytest.raises(OutOfBlocks):
        a.allocate(2)
    a.free([x[0]])
    assert a.num_free == 1, "still held by its second holder"
    a.free([x[0]] + y)
    assert a.all_free() and a.num_cached == 2
    with pytest.raises(RuntimeError, match=f"KV block {x[0]} freed while no sequence holds it"):
        a.free([x[0]])


def test_one_content_is_cached_once_per_next_token_its_mtp_rows_read() -> None:
    """Branches that split right after a block compute it each with MTP rows for their own next token: the cache
    keeps one block per next token, a lookup prefers the one for the sequence's own, and a block without valid MTP
    rows gives way to one with them."""
    a = BlockAllocator(6)
    key = block_key(b"", [1, 2])
    x, y, z, w = a.allocate(4)
    a.register(x, key)
    assert a.lookup(key, 7) == x and a.mtp_next(x) is None
    a.register(y, key)  # the same content computed again: one target-only copy is enough
    a.mark_mtp(y, key, 7)  # y has MTP rows: it replaces x, target-only
    assert a.lookup(key) == a.lookup(key, 7) == y and a.num_cached == 1
    a.register(z, key)
    a.mark_mtp(z, key, 8)  # another branch: both stay
    a.mark_mtp(w, key, 7)  # a copy for a next token already cached stays out
    assert (a.lookup(key, 7), a.lookup(key, 8), a.lookup(key, 9) in (y, z)) == (y, z, True) and a.num_cached == 2
    assert (a.mtp_next(y), a.mtp_next(z), a.mtp_next(w)) == (7, 8, None)
    a.free([x, w, y, z])
    assert a.all_free() and a.num_cached == 2
    held = a.allocate(4)
    assert set(held) == {x, w, 4, 5}, "x and w cache nothing: handed out first"
    held += a.allocate(1)
    assert held[-1] == z and a.lookup(key, 7) == a.lookup(key, 8) == y and a.num_cached == 1
    a.free(held)
    assert a.all_free()


def test_block_keys_chain_over_the_prefix() -> None:
    root = block_key(b"", [1, 2])
    assert block_key(b"", [1, 2]) == root and block_key(b"", [2, 1]) != root
    assert block_key(root, [3]) != block_key(block_key(b"", [1, 5]), [3]), "the same block after another prefix"


@pytest.mark.parametrize("policy_drafts", [True, False])
def test_admission_recomputes_a_tail_without_mtp_rows_unless_the_policy_would_not_draft(engine, policy_drafts) -> None:
    """Three cached blocks, MTP rows on the first only: a drafting sequence starts after block 0 and keeps drafting
    while the policy drafts; when it would not, the sequence starts after all three and stops drafting. One
    that never drafts starts after all three either way."""
    from runtime.core.draft_policy import DraftPolicy
    from runtime.core.kv_cache import KVCache
    from runtime.core.prefix_cache import PrefixCache
    from runtime.core.scheduler import Scheduler, ServingLimits
    from runtime.core.sequence import Sequence

    class Policy(DraftPolicy):
        def drafts_at(self, batch_size: int) -> bool:
            return policy_drafts

    cache = KVCache(engine.model_config, num_blocks=16, block_size=4)
    prefix = PrefixCache(cache.allocator, 4, mtp=True)
    sched = Scheduler(ServingLimits(max_batch_size=8, max_num_tokens=64, max_seq_len=64), cache,
                      Policy("fixed", 3), prefix)
    prompt = list(range(10, 24))
    owner = Sequence("owner", prompt, len(prompt), SamplingParams(max_tokens=8), seed=0,
                     block_table=cache.allocator.allocate(4), num_cached=13, num_mtp=4)
    prefix.commit(owner)  # blocks 0-2 registered (12 positions), MTP rows for block 0
    assert cache.allocator.num_cached == 3 and owner.num_mtp_blocks == 1
    cache.release(owner.block_table)
    for name, num_draft_tokens in (("drafting", None), ("plain", 0)):
        seq = Sequence(name, prompt + [7], len(prompt) + 1, SamplingParams(max_tokens=8), seed=1,
                       mtp_dropped=num_draft_tokens == 0)
        sched.add(seq)
        sched.schedule()
        expect = 4 if name == "drafting" and policy_drafts else 12
        assert (seq.num_cached, seq.num_reused_blocks) == (expect, expect // 4)
        assert seq.mtp_dropped == (name == "plain" or not policy_drafts)
        assert seq.num_mtp == (4 if name == "drafting" and policy_drafts else 0)
        sched.remove(seq)
    assert cache.allocator.all_free()


# ---- exactness ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def without_reuse(engine) -> dict[int, list[RequestOutput]]:
    """PROMPTS served one at a time without reuse, per draft length."""
    out = {}
    for k in range(5):
        with executor(engine, k, reuse=False) as ex:
            out[k] = serve(ex, PROMPTS)
            assert reused(out[k]) == [0] * len(PROMPTS) and ex.stats().kv_blocks_cached == 0
    return out


@pytest.mark.parametrize("k", range(5))
def test_reuse_is_exact_alone_and_batched(engine, without_reuse, k: int) -> None:
    base = without_reuse[k]
    with executor(engine, k) as ex:
        alone = serve(ex, PROMPTS)
        assert [o.token_ids for o in alone] == [o.token_ids for o in without_reuse[0]]
        assert drafts(alone) == drafts(base), "drafts from reused MTP rows differ from recomputed ones"
        assert reused(alone) == [0] + [3] * (len(PROMPTS) - 1), "the shared 3 full blocks of SYSTEM"
        assert [o.stats.num_missed_blocks for o in alone] == [ex.cache.blocks_for(len(p)) - r
                                                              for p, r in zip(PROMPTS, reused(alone))]
        assert alone[1].stats.kv_cache_hit_rate == 3 / ex.cache.blocks_for(len(PROMPTS[1]))
        stats = ex.stats()
        assert (stats.kv_reused_blocks, stats.kv_missed_blocks) == (sum(reused(alone)),
                                                                    sum(o.stats.num_missed_blocks for o in alone))
        # every prompt again, together: each now reuses its own full blocks, its last token left to compute
        again = serve(ex, PROMPTS, batched=True)
        assert [o.token_ids for o in again] == [o.token_ids for o in without_reuse[0]]
        assert drafts(again) == drafts(base)
        assert reused(again) == [(len(p) - 1) // BLOCK for p in PROMPTS]
        assert_all_free(ex)


def test_seeded_sampling_with_drafts_is_exact(engine) -> None:
    """With sampling, which tokens come out depends on the drafts too: wrong MTP rows change the text."""
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    with executor(engine, 3, reuse=False) as ex:
        base = serve(ex, PROMPTS, params)
    with executor(engine, 3) as ex:
        outs = serve(ex, PROMPTS, params)
        assert reused(outs)[1:] == [3] * (len(PROMPTS) - 1)
        assert_all_free(ex)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base] and drafts(outs) == drafts(base)


def test_a_drafting_request_reuses_only_blocks_whose_mtp_rows_it_can_use(engine) -> None:
    """A request that ends before it drafts leaves its blocks' MTP rows uncomputed: a drafting request does not
    reuse them (it recomputes the prefix), one that never drafts does. The MTP row at a block's last position
    reads the next token: a request diverging right after a block does not reuse that block's MTP rows."""
    prefix = tokens(2, 2 * BLOCK)
    first, other = prefix + tokens(3, 9), prefix + tokens(4, 9)
    with executor(engine, 3) as ex:
        ex.submit(first, SamplingParams(max_tokens=1)).result(60)  # no drafting step: target KV only
        plain = ex.submit(other, SamplingParams(max_tokens=4, ignore_eos=True, num_draft_tokens=0)).result(60)
        assert plain.stats.num_reused_blocks == 2 and plain.stats.num_draft_tokens == 0
        drafting = ex.submit(other, GREEDY).result(60)
        assert drafting.stats.num_reused_blocks == 0 and drafting.stats.num_draft_tokens > 0
        # `other`'s own blocks now have MTP rows read with other[2 * BLOCK]; `first` differs there
        again = ex.submit(first, GREEDY).result(60)
        assert again.stats.num_reused_blocks == 1
        assert_all_free(ex)
    with executor(engine, 3, reuse=False) as ex:
        base = serve(ex, [other, first])
    assert [drafting.token_ids, again.token_ids] == [o.token_ids for o in base]
    assert drafts([drafting, again]) == drafts(base)


def test_a_branch_split_at_a_block_boundary_is_reused_like_the_first(engine) -> None:
    """Two conversations share a prefix that ends right at a block boundary. The second's blocks carry MTP rows
    read with its own next token, so its identical repeat and its next turn reuse as many blocks while drafting
    as they do where the first conversation never ran; the output, drafts and acceptance are those served without
    reuse."""
    shared = tokens(2, 2 * BLOCK)
    a, b = shared + tokens(3, 5), shared + tokens(4, 5)

    def conversation(ex: Executor, other_first: bool) -> list[RequestOutput]:
        """b, b again, its next turn, that turn again."""
        if other_first:
            ex.submit(a, GREEDY).result(60)
        first = ex.submit(b, GREEDY).result(60)
        turn = b + first.token_ids + tokens(5, 7)
        outs = [first] + serve(ex, [b, turn, turn])
        assert_all_free(ex)
        return outs

    with executor(engine, 3) as ex:
        outs = conversation(ex, other_first=True)
    with executor(engine, 3) as ex:
        alone = conversation(ex, other_first=False)
    with executor(engine, 3, reuse=False) as ex:
        base = conversation(ex, other_first=False)
    full = (len(b) + GREEDY.max_tokens + 7 - 1) // BLOCK
    assert reused(alone) == [0, 2, 2, full] and reused(outs) == [1, 2, 2, full], "the first block serves both"
    assert [o.token_ids for o in outs] == [o.token_ids for o in base] and drafts(outs) == drafts(base)


@pytest.mark.parametrize("k", [0, 3])
def test_a_drafting_request_computes_the_token_before_its_last(engine, k: int) -> None:
    """A prompt of two blocks and one token, served twice. Its first decode step drafts from the MTP layer's output
    at the token before the last, which reads the target's hidden state there: a drafting request recomputes the
    block holding it rather than start on its last token and skip that step's drafts. The drafts, acceptance and
    steps are those without reuse."""
    prompt = tokens(6, 2 * BLOCK + 1)
    with executor(engine, k) as ex:
        outs = serve(ex, [prompt, prompt])
        assert_all_free(ex)
    with executor(engine, k, reuse=False) as ex:
        base = serve(ex, [prompt, prompt])
    assert [o.token_ids for o in outs] == [o.token_ids for o in base] and drafts(outs) == drafts(base)
    assert [o.stats.num_steps for o in outs] == [o.stats.num_steps for o in base]
    assert reused(outs) == [0, 1 if k else 2]


def test_single_token_requests_reuse_the_prompt_under_drafting(engine) -> None:
    """A request of one token never drafts (its token comes from the prefill), so it needs no MTP rows: the n
    outputs of one share the prompt their leader computed, and a repeated one reuses the first's blocks (with
    drafting on, each recomputed the whole prompt: scoring requests, echo with max_tokens 0, ran 8x slower at n 8).
    The tokens are the same as without reuse."""
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=5, n=4)
    with executor(engine, 3) as ex:
        outs = ex.submit(PROMPTS[2], params).results(60)
        shared = ex.stats().kv_reused_blocks
        again = ex.submit(PROMPTS[2], SamplingParams(max_tokens=1)).result(60)
        assert_all_free(ex)
    full = (len(PROMPTS[2]) - 1) // BLOCK
    # the three others took the leader's blocks; each output reports what its request found in the cache (none)
    assert shared == 3 * full and reused(outs) == [0] * 4 and again.stats.num_reused_blocks == full
    with executor(engine, 3, reuse=False) as ex:
        base = ex.submit(PROMPTS[2], params).results(60)
        alone = ex.submit(PROMPTS[2], SamplingParams(max_tokens=1)).result(60)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base] and again.token_ids == alone.token_ids


def test_prompt_logprobs_are_not_skipped(engine) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    with executor(engine, 2) as ex:
        ex.submit(PROMPTS[0], GREEDY).result(60)
        out = ex.submit(PROMPTS[1], params).result(60)
        assert out.stats.num_reused_blocks == 0
        assert_all_free(ex)
    with executor(engine, 2, reuse=False) as ex:
        base = ex.submit(PROMPTS[1], params).result(60)
    assert out.prompt_logprobs == base.prompt_logprobs and out.token_ids == base.token_ids


def test_nothing_is_reused_where_nothing_matches_or_reuse_is_off(engine) -> None:
    short = SYSTEM[:BLOCK]  # one block: its last token must be computed, so nothing is reused
    with executor(engine, 2) as ex:
        outs = serve(ex, [short, short, tokens(5, 40), SYSTEM[1:]])
        assert reused(outs) == [0, 0, 0, 0]
        assert_all_free(ex)
    with executor(engine, 2, reuse=False) as ex:
        outs = serve(ex, PROMPTS + PROMPTS)
        assert reused(outs) == [0] * 2 * len(PROMPTS) and all(o.stats.kv_cache_hit_rate == 0 for o in outs)
        assert ex.stats().kv_blocks_cached == 0
        assert_all_free(ex)


# ---- with the scheduler's other paths -----------------------------------------------------------
@pytest.mark.parametrize("k", [0, 3])
def test_chunked_prefill_shares_blocks_of_a_prompt_still_being_prefilled(engine, k: int) -> None:
    """max_num_tokens 24: the long prompt takes every step's budget until its last chunk, in whose step the second
    request is admitted on the shared blocks the first has filled so far: their target KV. A drafting request
    needs their MTP rows too, which the first computes only once it drafts, so with k = 3 it recomputes them."""
    long = SYSTEM + tokens(6, 60)
    with executor(engine, k, max_num_tokens=24) as ex:
        outs = serve(ex, [long, PROMPTS[2]], batched=True)
        assert reused(outs) == [0, 3 if k == 0 else 0]
        assert ex.submit(PROMPTS[3], GREEDY).result(60).stats.num_reused_blocks == 3  # now with MTP rows
        assert_all_free(ex)
    with executor(engine, k, reuse=False) as ex:
        base = serve(ex, [long, PROMPTS[2]])
    assert [o.token_ids for o in outs] == [o.token_ids for o in base] and drafts(outs) == drafts(base)


@pytest.mark.parametrize("k", [0, 3])
def test_eviction_and_preemption_under_a_small_pool(engine, k: int) -> None:
    """A pool of 12 blocks for prompts of 4-5 blocks each: cached blocks are evicted for new content, and
    concurrent requests preempt each other; every output is still the one served without reuse."""
    prompts = PROMPTS + [tokens(20 + i, 50) for i in range(3)] + PROMPTS[:2]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with executor(engine, k, reuse=False, kv_cache_tokens=12 * BLOCK) as ex:
        base = serve(ex, prompts, params)
    with executor(engine, k, kv_cache_tokens=12 * BLOCK) as ex:
        outs = serve(ex, prompts, params)
        assert reused(outs)[1:5] == [3] * 4
        assert reused(outs)[-2:] == [0, 3], "evicted by the unrelated prompts, then cached again"
        together = serve(ex, prompts, params, batched=True)
        assert ex.scheduler.preemptions > 0
        assert_all_free(ex)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base] == [o.token_ids for o in together]


def test_cancelled_requests_leave_their_filled_blocks_cached(engine) -> None:
    stream = SamplingParams(max_tokens=150, ignore_eos=True)
    with executor(engine, 3) as ex:
        handle = ex.submit(PROMPTS[4], stream)
        for out in handle:
            if len(out.token_ids) >= 8:
                handle.cancel()
        assert handle.result(60).finish_reason == "cancelled"
        later = ex.submit(PROMPTS[4], GREEDY).result(60)
        assert later.stats.num_reused_blocks == (len(PROMPTS[4]) - 1) // BLOCK
        assert_all_free(ex)
    with executor(engine, 3, reuse=False) as ex:
        base = ex.submit(PROMPTS[4], GREEDY).result(60)
    assert later.token_ids == base.token_ids and drafts([later]) == drafts([base])


def test_adaptive_drafting_with_reuse_is_exact(engine, without_reuse) -> None:
    with executor(engine, 3, speculation="adaptive") as ex:
        outs = serve(ex, PROMPTS) + serve(ex, PROMPTS, batched=True)
        assert sum(reused(outs)) > 0
        assert_all_free(ex)
    assert [o.token_ids for o in outs] == 2 * [o.token_ids for o in without_reuse[0]]
