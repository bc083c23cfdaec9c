"""The fixed-shape batches CUDA graphs replay, checked on CPU without capturing: padded batches give
the ragged batches' hidden states and cache writes, the MoE layer's sync-free paths give the
grouped path's sums, and an executor on padded batches gives the same greedy tokens.
(The capture itself needs a GPU: tests/test_cuda.py.)"""

from __future__ import annotations

import pytest
import torch

from runtime.model.config import ModelConfig
from runtime.core.cuda_graphs import CudaGraphRunner
from runtime.io.loading import load_engine
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.core.kv_cache import KVCache
from runtime.model.deepseek_v3 import Experts
from runtime.core.sampling_params import SamplingParams
from runtime.core.model_runner import ModelRunner

from conftest import tiny_config_dict

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model(spec_checkpoint):
    return load_engine(spec_checkpoint, cpu_kernels=False).model


def _runner(model, graphs: bool, seed: int = 0) -> ModelRunner:
    """A runner over a cache of random values (the same for the same seed), padding batches when `graphs`."""
    cache = KVCache(model.cfg, num_blocks=120, block_size=4)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=torch.Generator().manual_seed(seed)))
    return ModelRunner(model, cache, graphs=CudaGraphRunner(model, cache, capture=False) if graphs else None)


# (cached tokens, new tokens) per sequence: ragged query lengths, contexts across block boundaries,
# three sequences padded to four; prefill chunks beside decodes (two graphs, rows put back in order)
LAYOUTS = [[(9, 1)], [(5, 4), (13, 1), (2, 3)], [(0, 8), (7, 2)], [(3, 2), (3, 2), (22, 2), (1, 2), (6, 2)],
           [(0, 30), (5, 2), (0, 11), (9, 1)], [(2, 20)]]


def _sequences(layout: list[tuple[int, int]]) -> tuple[list[list[int]], list[int], list[int]]:
    """Disjoint block tables for the layout's sequences, and its starts and lengths."""
    tables, first = [], 0
    for s, q in layout:
        n = -(-(s + q) // 4) + 1  # one block more than needed, as the scheduler reserves room for drafts
        tables.append(list(range(first + n - 1, first - 1, -1)))
        first += n
    return tables, [s for s, _ in layout], [q for _, q in layout]


def _assert_same_writes(model, padded: ModelRunner, eager: ModelRunner) -> None:
    """Every slot but the scratch block's holds what the eager forward wrote, and something was written."""
    owned = eager.cache.scratch_block * eager.cache.block_size
    torch.testing.assert_close(padded.cache.tensor[:, :owned], eager.cache.tensor[:, :owned], atol=1e-5, rtol=1e-5)
    assert not torch.equal(padded.cache.tensor[:, :owned], _runner(model, graphs=False).cache.tensor[:, :owned])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padded_target_forward_equals_ragged(model, layout) -> None:
    eager, padded = _runner(model, graphs=False), _runner(model, graphs=True)
    seqs, starts, lens = _sequences(layout)
    ids = torch.randint(model.cfg.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        want = eager.forward_target(seqs, starts, lens, ids)
        got = padded.forward_target(seqs, starts, lens, ids)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    _assert_same_writes(model, padded, eager)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padded_mtp_forward_equals_ragged(model, layout) -> None:
    eager, padded = _runner(model, graphs=False), _runner(model, graphs=True)
    seqs, starts, lens = _sequences(layout)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(model.cfg.vocab_size, (sum(lens),), generator=gen)
    hidden = torch.randn(sum(lens), model.cfg.hidden_size, generator=gen)
    with torch.inference_mode():
        want = eager.proposer.forward_mtp(seqs, starts, lens, ids, hidden)
        got = padded.proposer.forward_mtp(seqs, starts, lens, ids, hidden)
    for g, w in zip(got, want):
        assert g.shape == w.shape == (len(layout), g.shape[1])
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    _assert_same_writes(model, padded, eager)


def test_one_graph_per_shape(model) -> None:
    """Batches of 3 and 4 sequences share the 4-sequence shape; tables are at least MIN_CONTEXT (256)
    tokens wide, a longer context widens them to a power of two."""
    runner = _runner(model, graphs=True)
    with torch.inference_mode():
        for layout in ([(3, 2)] * 3, [(5, 2)] * 4, [(3, 2)] * 2, [(40, 2)] * 2, [(300, 2)]):
            runner.forward_target(*_sequences(layout), [5] * 2 * len(layout))
    assert sorted(runner.graphs.graphs) == [("target", 1, 2, 128), ("target", 2, 2, 64), ("target", 4, 2, 64)]


@pytest.mark.parametrize("tokens", [1, 3, 4, 9])
def test_experts_paths_agree(tokens) -> None:
    """Gathered pairs (T * top-k <= E), every expert (CUDA's sync-free path) and grouped by expert
    all give the per-token sum of routing weight x expert MLP."""
    cfg = ModelConfig.from_dict(tiny_config_dict())
    experts = Experts(cfg)
    gen = torch.Generator().manual_seed(tokens)
    for p in experts.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    x = torch.randn(tokens, cfg.hidden_size, generator=gen)
    idx = torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[: cfg.num_experts_per_tok]
                       for _ in range(tokens)])
    weights = torch.rand(idx.shape, generator=gen)
    want = torch.stack([sum(w * torch.nn.functional.linear(experts._mlp(e, x[t]), experts.down_proj[e])
                            for e, w in zip(idx[t].tolist(), weights[t])) for t in range(tokens)])
    paths = [experts._dense, experts._grouped] + ([experts._pairs] if tokens * idx.shape[1] <= cfg.n_routed_experts else [])
    for path in paths:
        torch.testing.assert_close(path(x, weights, idx), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(experts(x, weights, idx), want, atol=1e-5, rtol=1e-5)


def test_decode_shapes_made_up_front_write_only_the_scratch_block(model) -> None:
    """What an executor captures before serving: every decode shape, on batches of padding sequences whose
    cache writes all land in the scratch block."""
    runner = _runner(model, graphs=True)
    graphs, cache = runner.graphs, runner.cache
    before = cache.tensor.clone()
    made = graphs.capture_decodes(max_batch_size=3, max_query=3, max_seq_len=300, mtp=True)
    # B 1, 2, 4; Q 1..3; block size 4: tables at least 64 blocks (MIN_CONTEXT), 300 tokens -> 75 -> widths 64, 128
    assert made == len(graphs.graphs) == 2 * 3 * 3 * 2
    assert sorted(graphs.graphs) == sorted(graphs.decode_shapes(3, 3, 300, mtp=True))
    assert {key[3] for key in graphs.graphs} == {64, 128}
    owned = cache.scratch_block * cache.block_size
    assert torch.equal(cache.tensor[:, :owned], before[:, :owned])
    assert not torch.equal(cache.tensor[:, owned:], before[:, owned:])  # the padding tokens did write, there
    assert graphs.capture_decodes(3, 3, 300, mtp=True) == 0  # nothing left to make


@pytest.mark.parametrize("k", [0, 3])
def test_executor_on_padded_batches_equals_eager(spec_checkpoint, k) -> None:
    """Prompts of different lengths in one batch (short last prefill chunks take the padded path too); every
    decode step finds its shape among those made before serving, as an executor on CUDA makes them."""
    engine = load_engine(spec_checkpoint, cpu_kernels=False)
    prompts = [[5 + i] * n for i, n in enumerate((3, 11, 6, 17, 2))]
    outputs = []
    for graphs in (False, True):
        with Executor(engine, ExecutorConfig(num_draft_tokens=k, speculation="fixed",
                                             max_num_tokens=24, max_seq_len=64)) as ex:
            if graphs:
                ex.runner.graphs = CudaGraphRunner(engine.model, ex.cache, capture=False)
                ex.runner.graphs.capture_decodes(ex.limits.max_batch_size, k + 1, ex.limits.max_seq_len, mtp=k > 0)
                made = set(ex.runner.graphs.graphs)
            handles = [ex.submit(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in prompts]
            outputs.append([h.result(60).token_ids for h in handles])
            if graphs:
                used_later = set(ex.runner.graphs.graphs) - made
                assert used_later, "no prefill chunk took the padded path"
                # only prompt work: prefill chunks and the MTP layer's catch-up over a prompt
                assert all(q > k + 1 for _, _, q, _ in used_later), used_later
                assert ex.stats().kv_blocks_used == 0
    assert outputs[1] == outputs[0]
