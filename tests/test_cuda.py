"""The native runtime on CUDA: same logits as on CPU, speculative greedy output equal to plain, and
CUDA graphs equal to eager forwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime.core.cuda_graphs import CUBLASLT_MAX_TOKENS
from runtime.io.loading import load_engine
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.core.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODEL = Path(__file__).resolve().parents[1] / "models" / "deepseek-v3-mini"


def test_cuda_logits_match_cpu():
    ids = torch.arange(5, 40)[None]
    cpu = load_engine(MODEL, device="cpu", dtype="float32").model
    gpu = load_engine(MODEL, device="cuda", dtype="float32").model
    with torch.no_grad():
        diff = (cpu.logits(cpu(ids)) - gpu.logits(gpu(ids.cuda())).cpu()).abs().max().item()
    assert diff < 1e-3, diff


def test_cuda_weights_row_major():
    """On CUDA every weight stays [out, in] row-major (cuBLAS's layout); the CPU's K-major storage is for MKL."""
    model = load_engine(MODEL, device="cuda", dtype="float32").model
    assert all(p.is_contiguous() for p in model.parameters())


def test_cuda_capture_leaves_the_blas_choice_as_it_was():
    """Graphs are recorded with cuBLASLt's or cuBLAS's GEMMs by their token count; the process's own
    choice is back in place once the executor has captured both kinds."""
    before = torch.backends.cuda.preferred_blas_library()
    config = ExecutorConfig(num_draft_tokens=1, speculation="fixed", max_batch_size=32, device="cuda", dtype="float32")
    with Executor(MODEL, config) as ex:
        tokens = {B * Q for _, B, Q, _ in ex.runner.graphs.graphs}
        assert min(tokens) <= CUBLASLT_MAX_TOKENS < max(tokens)
    assert torch.backends.cuda.preferred_blas_library() == before


def test_cuda_speculative_greedy_equals_plain():
    prompts = [p["text"] for p in json.loads((MODEL / "heldout_prompts.json").read_text())[:8]]
    outputs = {}
    for k in (0, 3):
        config = ExecutorConfig(num_draft_tokens=k, speculation="fixed" if k else "off", device="cuda", dtype="float32")
        with Executor(MODEL, config) as ex:
            handles = [ex.submit(ex.tokenizer.encode(p), SamplingParams(max_tokens=48, ignore_eos=True)) for p in prompts]
            outputs[k] = [h.result(timeout=300) for h in handles]
    assert [o.token_ids for o in outputs[3]] == [o.token_ids for o in outputs[0]]
    assert sum(o.stats.num_accepted_draft_tokens for o in outputs[3]) > 0


@pytest.mark.parametrize("k", [0, 3])
def test_cuda_graphs_equal_eager(k):
    """Captured graphs replay what the eager forwards compute: the same greedy tokens for a batch of
    mixed prompt lengths, and the steps did replay graphs."""
    prompts = [p["text"] for p in json.loads((MODEL / "heldout_prompts.json").read_text())[:6]]
    outputs = {}
    for graphs in (False, True):
        config = ExecutorConfig(num_draft_tokens=k, speculation="fixed" if k else "off", device="cuda",
                                dtype="float32", cuda_graphs=graphs)
        with Executor(MODEL, config) as ex:
            handles = [ex.submit(ex.tokenizer.encode(p), SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts]
            outputs[graphs] = [h.result(timeout=300).token_ids for h in handles]
            assert bool(ex.runner.graphs and ex.runner.graphs.graphs) == graphs
            assert ex.stats().kv_blocks_used == 0
    assert outputs[True] == outputs[False]
