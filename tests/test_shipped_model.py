"""The shipped model is laid out exactly like the DeepSeek-V3 release and HF transformers reads it
the way our runtime does; the training script's loss goes down."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from runtime.io.checkpoint import HFCheckpoint, is_fp8_quantized
from runtime.io.loading import load_engine

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "deepseek-v3-mini"


@pytest.fixture(scope="module")
def ckpt() -> HFCheckpoint:
    return HFCheckpoint(MODEL)


def test_release_layout(ckpt: HFCheckpoint):
    cfg = ckpt.config
    raw = json.loads((MODEL / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v3" and raw["num_nextn_predict_layers"] == 1
    assert raw["quantization_config"]["quant_method"] == "fp8"
    assert raw["quantization_config"]["weight_block_size"] == [128, 128]
    # Every DeepSeek-V3 feature on, in proportions like the real model.
    assert cfg.q_lora_rank and cfg.rope_scaling.factor > 1 and cfg.first_k_dense_replace >= 1
    assert cfg.n_group >= 2 and cfg.n_shared_experts >= 1 and cfg.n_routed_experts >= 8
    assert cfg.num_experts_per_tok >= 2 and cfg.num_hidden_layers >= 12
    assert 4096 <= cfg.vocab_size <= 8192
    assert len(ckpt.shard_files) >= 2 and (MODEL / "model.safetensors.index.json").is_file()
    assert (MODEL / "tokenizer.json").is_file() and (MODEL / "tokenizer_config.json").is_file()
    assert sum(f.stat().st_size for f in MODEL.iterdir()) < 40 * 2**20
    ckpt.validate()
    assert ckpt.config.num_nextn_predict_layers == 1
    N = cfg.num_hidden_layers
    for own in ("embed_tokens.weight", "shared_head.head.weight", "eh_proj.weight", "enorm.weight", "hnorm.weight"):
        assert f"model.layers.{N}.{own}" in ckpt.tensor_names
    for name in ckpt.tensor_names:
        if name.endswith("_scale_inv"):
            continue
        dtype = ckpt.tensor_info(name).dtype
        if is_fp8_quantized(name):
            assert dtype == "F8_E4M3" and f"{name}_scale_inv" in ckpt.tensor_names, name
        elif name.endswith("e_score_correction_bias"):
            assert dtype == "F32", name
        else:
            assert dtype == "BF16", name


def test_transformers_logits_match_runtime():
    """transformers dequantizes the FP8 checkpoint itself; fp32 logits agree within 1e-4."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # it lists the MTP tensors it ignores
    try:
        hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
            MODEL, dtype=torch.float32, attn_implementation="eager").float().eval()
    finally:
        transformers.logging.set_verbosity(verbosity)
    ours = load_engine(MODEL, dtype="float32").model
    prompts = json.loads((MODEL / "heldout_prompts.json").read_text())[:2]
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(MODEL / "tokenizer.json"))
    for p in prompts:
        ids = torch.tensor([[0] + tok.encode(p["text"])])
        with torch.no_grad():
            diff = (hf(ids).logits - ours.logits(ours(ids))).abs().max().item()
        assert diff <= 1e-4, diff


def test_training_loss_goes_down(tmp_path: Path):
    """A short run of training/train_model.py on a tiny config and a repetitive corpus."""
    rng = np.random.default_rng(0)
    phrase = rng.integers(5, 64, size=40)
    tokens = np.concatenate([np.concatenate([[0], phrase, [1]]) for _ in range(400)]).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    tokens.tofile(tmp_path / "val.bin")
    cfg = json.loads((MODEL / "config.json").read_text())
    cfg.pop("quantization_config")
    cfg.update(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
               q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "training.train_model", "--data_dir", str(tmp_path), "--out_dir", str(out),
           "--config", str(tmp_path / "config.json"), "--steps", "40", "--batch_size", "4", "--seq_len", "32",
           "--warmup", "5", "--eval_every", "20", "--eval_batches", "2", "--device", "cpu", "--threads", "1"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    evals = [r for r in log if "val_loss" in r]
    assert len(evals) == 2 and evals[-1]["val_loss"] < evals[0]["val_loss"] < log[0]["loss"]
    assert evals[-1]["val_mtp_loss"] < log[0]["mtp_loss"]
    # Aux-loss-free balancing moved the router biases away from zero.
    state = torch.load(out / "ckpt.pt", weights_only=True)  # tensors and plain values only: nothing to execute
    biases = [v for k, v in state["model"].items() if k.endswith("e_score_correction_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases)
    resumed = subprocess.run([*cmd[:cmd.index("--steps") + 1], "44", *cmd[cmd.index("--steps") + 2:], "--resume"],
                             check=True, capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert "resumed at step 40" in resumed.stdout
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 44
