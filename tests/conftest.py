"""Shared test helpers: a tiny DeepSeek-V3 config and random weights for it, and the Triton tests' fixtures.

The config keeps every feature of the real one (q LoRA, yarn, grouped routing with a bias,
a dense first layer, a shared expert, one MTP layer, FP8 quantization config) at toy sizes.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from runtime.io.checkpoint import expected_tensor_shapes
from runtime.io.loading import fill
from runtime.io.tokenizer import CONFIG_FILE, TOKENIZER_FILE
from runtime.io.weights import to_internal
from runtime.model.config import ModelConfig


def load_release_tensors(model: torch.nn.Module, tensors, source: str = "tensors") -> None:
    """Fill a model from release-named (name, tensor) pairs: reference models built in tests."""
    fill(model, ((*to_internal(name, model.cfg), t, None) for name, t in tensors), source)


TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_nextn_predict_layers": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}


def tiny_config_dict(**overrides: Any) -> dict[str, Any]:
    """config.json contents of the tiny model, with top-level fields replaced by `overrides`."""
    return {**copy.deepcopy(TINY_CONFIG), **overrides}


def random_tensors(cfg: ModelConfig, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, float32 tensor) for every tensor of the release layout, MTP included; deterministic."""
    g = torch.Generator().manual_seed(seed)
    for name, shape in expected_tensor_shapes(cfg).items():
        if name.endswith("e_score_correction_bias"):
            t = 0.01 * torch.randn(shape, generator=g)
        elif len(shape) == 1:  # norms
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = 0.05 * torch.randn(shape, generator=g)
        yield name, t


@pytest.fixture
def tiny_cfg() -> Callable[..., dict[str, Any]]:
    """Factory: tiny_cfg(**overrides) -> config.json dict (see tiny_config_dict)."""
    return tiny_config_dict


@pytest.fixture
def tiny_weights() -> Callable[..., Iterator[tuple[str, torch.Tensor]]]:
    """Factory: tiny_weights(cfg, seed) -> (name, tensor) stream (see random_tensors)."""
    return random_tensors


def write_tiny_checkpoint(path, cfg_dict: dict[str, Any] | None = None, *, fp8: bool = False, seed: int = 0,
                          max_shard_bytes: int = 20_000):
    """A sharded tiny HF checkpoint with a real (word-level, 64-token) tokenizer.json; returns its path."""
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers

    from builder.hf_writer import write_hf_checkpoint

    cfg = ModelConfig.from_dict(cfg_dict or tiny_config_dict())
    path = write_hf_checkpoint(Path(path), cfg, random_tensors(cfg, seed), fp8=fp8, max_shard_bytes=max_shard_bytes)
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture
def tiny_checkpoint(tmp_path) -> Callable[..., Any]:
    """Factory: tiny_checkpoint(name="hf", cfg_dict=None, fp8=False, seed=0) -> path under tmp_path."""

    def make(name: str = "hf", cfg_dict: dict[str, Any] | None = None, **kwargs: Any):
        return write_tiny_checkpoint(tmp_path / name, cfg_dict, **kwargs)

    return make


# ---- runtime tests (test_speculative / test_executor / test_session) ------------------------------
import os  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
# DSV3_TEST_MODEL points the shipped-model tests at another checkpoint (e.g. a partial export)
SHIPPED_MODEL_DIR = Path(os.environ.get("DSV3_TEST_MODEL", REPO_ROOT / "models" / "deepseek-v3-mini"))


def project_tokenizer_dir() -> Path | None:
    """The project's 4096-token tokenizer: from the shipped model (present in CI), else data/."""
    for d in (SHIPPED_MODEL_DIR, REPO_ROOT / "data"):
        if all((d / f).is_file() for f in (TOKENIZER_FILE, CONFIG_FILE)):
            return d
    return None


def bigram_tensors(cfg: ModelConfig, seed: int = 0, head_scale: float = 0.5, embed_scale: float = 5.0,
                   h_noise: float = 0.05) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights (random_tensors) reshaped so the MTP module is a decent draft model.

    Large embeddings make every hidden state close to its own token's embedding, so the target is
    roughly a bigram model; the MTP layer shares the embedding and the head and its eh_proj passes
    the embedding of the next token through, so it predicts roughly what the target will say one
    position later. Acceptance lands around 0.3-0.7: both accepted and rejected drafts occur.
    head_scale sets the logit spread (0.5: entropy ~6 nats over 4096 tokens, top-1 ~0.04).
    """
    ts = dict(random_tensors(cfg, seed))
    g = torch.Generator().manual_seed(seed + 12345)
    H, mtp = cfg.hidden_size, f"model.layers.{cfg.num_hidden_layers}."
    ts["model.embed_tokens.weight"] = ts["model.embed_tokens.weight"] * embed_scale
    ts["lm_head.weight"] = ts["lm_head.weight"] * (head_scale / 0.05)
    if cfg.num_nextn_predict_layers:
        ts[mtp + "embed_tokens.weight"] = ts["model.embed_tokens.weight"].clone()
        ts[mtp + "shared_head.head.weight"] = ts["lm_head.weight"].clone()
        eh = torch.zeros(H, 2 * H)
        eh[:, :H] = torch.eye(H)
        eh[:, H:] = h_noise * torch.randn(H, H, generator=g)
        ts[mtp + "eh_proj.weight"] = eh
    yield from ts.items()


def write_spec_checkpoint(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny fp32 HF checkpoint with the project tokenizer (vocab 4096) and a usable MTP draft."""
    from builder.hf_writer import write_hf_checkpoint

    tok = project_tokenizer_dir()
    if tok is None:
        pytest.skip("the project tokenizer (models/deepseek-v3-mini or data/) is not present")
    cfg = ModelConfig.from_dict(tiny_config_dict(**{"vocab_size": 4096, **overrides}))
    return write_hf_checkpoint(out_dir, cfg, bigram_tensors(cfg, seed), fp8=False, tokenizer_dir=tok, force=True)


@pytest.fixture(scope="session")
def spec_checkpoint(tmp_path_factory) -> Path:
    """Session-wide tiny checkpoint for the runtime tests (see write_spec_checkpoint)."""
    return write_spec_checkpoint(tmp_path_factory.mktemp("spec") / "tiny")


@pytest.fixture(scope="session")
def shipped_model_dir() -> Path:
    """models/deepseek-v3-mini (committed; the trained model), skipped where it is absent."""
    if not (SHIPPED_MODEL_DIR / "config.json").is_file():
        pytest.skip(f"{SHIPPED_MODEL_DIR} is not present")
    return SHIPPED_MODEL_DIR


@pytest.fixture(scope="module")
def shipped_engine(shipped_model_dir):
    """The shipped model loaded in float32, where a sequence's logits are the same alone and in any batch."""
    from runtime.io.loading import load_engine

    return load_engine(shipped_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def shipped_tokenizer(shipped_engine):
    from runtime.io.tokenizer import Tokenizer

    return Tokenizer.from_dir(shipped_engine.path)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test that `counts` were drawn from `probs`.

    Cells of zero probability must be empty (else the p-value is 0); cells with expected count
    below 5 are pooled into one.
    """
    counts, probs = counts.double(), probs.double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    n = counts.sum()
    expected = n * probs
    big = expected >= 5
    obs = torch.cat([counts[big], counts[(~big) & (probs > 0)].sum()[None]])
    exp = torch.cat([expected[big], expected[(~big) & (probs > 0)].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="module")
def torch_one_thread() -> Iterator[None]:
    """One intra-op thread for a module's tests, restored afterwards. The runtime's tiny batches
    gain nothing from two threads, and on a loaded 2-core machine OpenMP's spin barriers make
    them 5-30x slower (adaptive profiling: 0.15 s with one thread, 3-7 s with two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- the Triton tests' model (test_triton*.py; their helpers are tests/triton_util.py) -------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random DeepSeek-V3 + MTP checkpoint whose tokenizer splits characters across tokens."""
    from triton_util import make_tiny_checkpoint  # it imports this module

    return make_tiny_checkpoint(tmp_path_factory.mktemp("triton") / "tiny")


@pytest.fixture(scope="module")
def session(checkpoint: Path) -> Iterator[Any]:
    """An in-process Session on `checkpoint`, what the Triton models' outputs are compared with."""
    from runtime.executors.session import Session

    with Session(checkpoint, num_draft_tokens=3, speculation="fixed") as s:
        yield s


@pytest.fixture(scope="module")
def expected(session: Any) -> dict[str, Any]:
    """The session's greedy result of TOKENS tokens for every prompt of PROMPTS (tests/triton_util.py)."""
    from runtime.core.sampling_params import SamplingParams
    from triton_util import PROMPTS, TOKENS

    return dict(zip(PROMPTS, session.generate(PROMPTS, SamplingParams(max_tokens=TOKENS))))
