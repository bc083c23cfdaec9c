"""The native runtime on CUDA: same logits as on CPU, speculative greedy output equal to plain, CUDA graphs
equal to eager forwards, and FP8 weights kept FP8 with bf16 activations."""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from runtime.core.cuda_graphs import CUBLASLT_MAX_TOKENS
from runtime.io.loading import load_engine
from runtime.executors.base import ExecutorConfig
from runtime.executors.native import Executor
from runtime.core.sampling_params import GuidedDecodingParams, SamplingParams
from runtime.io.tokenizer import Tokenizer
from runtime.model.fp8 import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8
from runtime.model.fp8_linear import ACTIVATION_BLOCK, FP8Experts, FP8Linear, gemm_paths

from executor_util import assert_first_tokens_follow_the_target, seeded_params, seeded_requests_take_rejection_sampling

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODEL = Path(__file__).resolve().parents[1] / "models" / "deepseek-v3-mini"
BU, THE = 674, 274  # " bu" (the first token the logit-bias request below samples without its bias), " the"


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


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_cuda_speculative_greedy_equals_plain(temperature):
    """Greedy output, and seeded sampled output (the race), are plain decoding's on the GPU too, where the verify
    forward's GEMMs have other shapes than a one-token step's."""
    prompts = [p["text"] for p in json.loads((MODEL / "heldout_prompts.json").read_text())[:8]]
    outputs = {}
    for k in (0, 3):
        config = ExecutorConfig(num_draft_tokens=k, speculation="fixed", device="cuda", dtype="float32")
        with Executor(MODEL, config) as ex:
            handles = [ex.submit(ex.tokenizer.encode(p), SamplingParams(max_tokens=48, ignore_eos=True,
                                                                        temperature=temperature, seed=i))
                       for i, p in enumerate(prompts)]
            outputs[k] = [h.result(timeout=300) for h in handles]
    assert [o.token_ids for o in outputs[3]] == [o.token_ids for o in outputs[0]]
    assert sum(o.stats.num_accepted_draft_tokens for o in outputs[3]) > 0


def test_cuda_every_sampling_feature_with_drafts_is_plain_decodings_output():
    """Seeded sampled requests with every feature of a row's distribution (temperature, top-k, top-p, min-p,
    penalties, bans, logit bias, min_tokens, logprobs, a regex guide's masks) give plain decoding's tokens with
    3 drafts a step on the GPU, and logprobs within 1e-4 (the verify forward's GEMMs sum in another order)."""
    params = [*seeded_params(),
              SamplingParams(temperature=1.0, min_p=0.05, seed=16, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=17, logit_bias={BU: -100.0, THE: 6.0}, logprobs=3, max_tokens=40,
                             ignore_eos=True),
              SamplingParams(temperature=0.8, seed=18, max_tokens=40,
                             guided_decoding=GuidedDecodingParams(regex="[a-z][a-z ]{10,80}[.]"))]
    prompts = [p["text"] for p in json.loads((MODEL / "heldout_prompts.json").read_text())[:len(params)]]
    outputs = {}
    for k in (0, 3):
        config = ExecutorConfig(num_draft_tokens=k, speculation="fixed", device="cuda", dtype="float32")
        with Executor(MODEL, config) as ex:
            handles = [ex.submit(ex.tokenizer.encode(p), sp) for p, sp in zip(prompts, params)]
            outputs[k] = [h.result(timeout=300) for h in handles]
            assert ex.stats().kv_blocks_used == 0
    worst = 0.0
    for i, (got, want) in enumerate(zip(outputs[3], outputs[0])):
        assert got.token_ids == want.token_ids, f"request {i}: tokens differ"
        assert (got.logprobs is None) == (want.logprobs is None), i
        for x, y in zip(got.logprobs or [], want.logprobs or []):
            assert (x.token_id, x.rank, [t for t, _ in x.top]) == (y.token_id, y.rank, [t for t, _ in y.top]), i
            worst = max(worst, abs(x.logprob - y.logprob), *(abs(a - b) for (_, a), (_, b) in zip(x.top, y.top)))
    assert worst <= 1e-4, worst
    assert BU not in outputs[0][6].token_ids and outputs[0][6].token_ids.count(THE) > 3
    guided = outputs[0][7]
    assert guided.text[-1] == "." and guided.text[:-1].replace(" ", "").isalpha(), guided.text
    assert sum(o.stats.num_accepted_draft_tokens for o in outputs[3]) > 0
    print(f"largest logprob difference, 3 drafts against plain: {worst:.2e}")


def test_cuda_rejection_sampling_follows_the_target(monkeypatch):
    """Sampled requests that take rejection sampling (drafts accepted with probability min(1, p / q), the residual
    max(0, p - q) sampled on rejection) give the target's distribution on the GPU: over 2000 requests drafting 2
    tokens, the first token follows the target softmax and the second its marginal given the first."""
    seeded_requests_take_rejection_sampling(monkeypatch)
    prompt = Tokenizer.from_dir(MODEL).encode("    return")
    n = 2000
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    config = ExecutorConfig(num_draft_tokens=2, speculation="fixed", device="cuda", dtype="float32")
    with Executor(MODEL, config) as ex:
        outs = [h.result(timeout=300) for h in [ex.submit(prompt, sp) for sp in params]]
        stats = ex.stats()
        assert stats.draft_tokens >= 2 * n and stats.accepted_draft_tokens > 0.1 * stats.draft_tokens, stats
        assert_first_tokens_follow_the_target(ex.engine.model, prompt, outs, 1.0)


@pytest.mark.parametrize("k", [0, 3])
def test_cuda_graphs_equal_eager(k):
    """Captured graphs replay what the eager forwards compute: the same greedy tokens for a batch of
    mixed prompt lengths, and the steps did replay graphs."""
    prompts = [p["text"] for p in json.loads((MODEL / "heldout_prompts.json").read_text())[:6]]
    outputs = {}
    for graphs in (False, True):
        config = ExecutorConfig(num_draft_tokens=k, speculation="fixed", device="cuda",
                                dtype="float32", cuda_graphs=graphs)
        with Executor(MODEL, config) as ex:
            handles = [ex.submit(ex.tokenizer.encode(p), SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts]
            outputs[graphs] = [h.result(timeout=300).token_ids for h in handles]
            assert bool(ex.runner.graphs and ex.runner.graphs.graphs) == graphs
            assert ex.stats().kv_blocks_used == 0
    assert outputs[True] == outputs[False]


def test_cuda_fp8_weights_stay_fp8_and_each_product_is_the_dequantized_ones():
    """A bf16 engine asked to keep FP8-stored weights FP8 on the GPU; every weight shape's product, by whichever
    path the load probed (torch._scaled_mm, Triton or dequantizing), is what the dequantized weight gives on the
    same quantized activations, for 1 to 40 tokens."""
    engine = load_engine(MODEL, device="cuda", dtype="bfloat16", fp8_weights=True)
    linears = [m for m in engine.model.modules() if isinstance(m, FP8Linear)]
    assert len(linears) == 154 and all(m.weight.is_cuda and m.weight.dtype == FP8_DTYPE for m in linears)
    shapes = {(m.out_features, m.in_features): m for m in linears}
    gen = torch.Generator(device="cuda").manual_seed(1)
    for m in shapes.values():
        for tokens in (1, 2, 4, 16, 17, 40):
            x = torch.randn(tokens, m.in_features, device="cuda", generator=gen).to(torch.bfloat16)
            q, s = quantize_block_fp8(x, ACTIVATION_BLOCK)
            want = torch.nn.functional.linear(dequantize_block_fp8(q, s, ACTIVATION_BLOCK),
                                              dequantize_block_fp8(m.weight, m.weight_scale_inv))
            got = m(x).float()
            assert (got - want).abs().max() <= 0.02 * want.abs().max(), (m.path, tokens)
    print("FP8 GEMM paths:", gemm_paths(engine.model))


def test_cuda_fp8_logits_close_to_fp32():
    """FP8 weights with bf16 activations stay close to the fp32 path: relative error of the logits under 10%, the
    same top-1 token at 85% of positions or more (a scale on the wrong block gives errors of order 1;
    benchmarks/fp8_gpu.py reports the measured values)."""
    ids = torch.arange(5, 300, device="cuda")[None] % 4096
    fp32 = load_engine(MODEL, device="cuda", dtype="float32").model
    fp8 = load_engine(MODEL, device="cuda", dtype="bfloat16", fp8_weights=True).model
    with torch.no_grad():
        want = fp32.logits(fp32(ids)).float()
        got = fp8.logits(fp8(ids)).float()
    assert ((got - want).norm() / want.norm()).item() < 0.1
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.85


def test_cuda_fp8_graphs_run_and_free_every_block():
    """The FP8 engine decodes through captured graphs, speculative and plain, and gives its blocks back."""
    prompts = [p["text"] for p in json.loads((MODEL / "heldout_prompts.json").read_text())[:4]]
    for k in (0, 3):
        config = ExecutorConfig(num_draft_tokens=k, speculation="fixed", device="cuda", dtype="bfloat16",
                                fp8_weights=True)
        with Executor(MODEL, config) as ex:
            assert any(isinstance(m, FP8Linear) for m in ex.engine.model.modules())
            handles = [ex.submit(ex.tokenizer.encode(p), SamplingParams(max_tokens=32, ignore_eos=True)) for p in prompts]
            outs = [h.result(timeout=300) for h in handles]
            assert all(len(o.token_ids) == 32 for o in outs) and ex.runner.graphs and ex.runner.graphs.graphs
            assert ex.stats().kv_blocks_used == 0


def test_cuda_fp8_experts_run_their_kernels_and_match_the_dequantized_experts():
    """Where Triton is installed a decode step's (token, expert) pairs run the Triton pairs kernel, longer batches each
    projection by the path its shape probed; both give what the dequantized experts give, within the activations'
    FP8 rounding (two quantized activations in a row)."""
    engine = load_engine(MODEL, device="cuda", dtype="bfloat16", fp8_weights=True)
    stacks = [m for m in engine.model.modules() if isinstance(m, FP8Experts)]
    assert len(stacks) == 21
    assert {m.pairs_path for m in stacks} == ({"triton"} if find_spec("triton") else {"dequantize"})
    experts = stacks[3]
    fast = experts.pairs_path, dict(experts.dense_paths)
    assert set(fast[1].values()) != {"dequantize"}
    E, _, H = experts.gate_proj.shape
    gen = torch.Generator(device="cuda").manual_seed(2)
    for T in (1, 3, 40):  # pairs (T * 2 <= E), then every expert over every token
        x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:2] for _ in range(T)])
        weights = torch.rand(T, 2, device="cuda", generator=gen).to(torch.bfloat16)
        got = experts(x, weights, idx).float()
        experts.pairs_path, experts.dense_paths = "dequantize", dict.fromkeys(fast[1], "dequantize")
        want = experts(x, weights, idx).float()
        experts.pairs_path, experts.dense_paths = fast
        assert (got - want).abs().max() <= 0.1 * want.abs().max(), T
