"""Reading and writing the released HF layout on a tiny FP8 checkpoint, and every error a broken
checkpoint should give (file + tensor/field + what was expected)."""

from __future__ import annotations

import dataclasses
import json
import re
import logging
import struct
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import runtime.io.checkpoint as checkpoint
from builder.hf_writer import write_hf_checkpoint
from runtime.io.checkpoint import (
    INDEX_NAME,
    CheckpointError,
    HFCheckpoint,
    check_finite,
    expected_tensor_shapes,
    is_fp8_quantized,
    is_mtp_tensor,
    layer_of,
)
from runtime.model.config import ConfigError, ModelConfig

from conftest import TINY_CONFIG

TINY_ROPE = {k: v for k, v in TINY_CONFIG["rope_scaling"].items() if k != "type"}

SHARD_BYTES = 20_000  # the tiny model is ~89 KB stored: 5 shards


@pytest.fixture
def make_ckpt(tmp_path, tiny_cfg, tiny_weights):
    """make_ckpt(drop=..., replace=..., **writer kwargs, config overrides via cfg=) -> (path, cfg, originals)."""

    def make(cfg: dict | None = None, *, drop=(), replace=None, name="ckpt", **kwargs):
        config = ModelConfig.from_dict(cfg or tiny_cfg())
        originals = dict(tiny_weights(config, 0))
        stream = ((n, (replace or {}).get(n, t)) for n, t in originals.items() if n not in drop)
        kwargs.setdefault("max_shard_bytes", SHARD_BYTES)
        return write_hf_checkpoint(tmp_path / name, config, stream, **kwargs), config, originals

    return make


def assert_close_to_stored(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """FP8 weights within e4m3 rounding of their (single, <=128x128) block; the rest within bf16's."""
    if is_fp8_quantized(name):
        bound = want.abs() * 2**-4 + want.abs().max() / 448 * 2**-10
    elif name.endswith("e_score_correction_bias"):
        bound = torch.zeros_like(want)
    else:
        bound = want.abs() * 2**-8
    assert got.shape == want.shape, name
    assert ((got - want).abs() <= bound * (1 + 1e-5)).all(), name


def test_tensor_classification():
    assert is_fp8_quantized("model.layers.0.self_attn.q_a_proj.weight")
    assert is_fp8_quantized("model.layers.5.self_attn.q_proj.weight")
    assert is_fp8_quantized("model.layers.0.mlp.down_proj.weight")
    assert is_fp8_quantized("model.layers.3.mlp.experts.7.up_proj.weight")
    assert is_fp8_quantized("model.layers.61.mlp.shared_experts.gate_proj.weight")
    for name in [
        "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
        "model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
        "model.layers.0.self_attn.q_a_layernorm.weight", "model.layers.61.eh_proj.weight",
        "model.layers.61.shared_head.head.weight", "model.layers.61.embed_tokens.weight",
        "model.layers.0.self_attn.q_a_proj.weight_scale_inv",
    ]:
        assert not is_fp8_quantized(name), name
    assert layer_of("model.layers.12.mlp.gate.weight") == 12
    assert layer_of("lm_head.weight") is None


def test_expected_shapes(tiny_cfg):
    cfg = ModelConfig.from_dict(tiny_cfg())
    shapes = expected_tensor_shapes(cfg)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (64, 32)  # dense layer 0
    assert "model.layers.0.mlp.gate.weight" not in shapes
    assert shapes["model.layers.1.self_attn.q_b_proj.weight"] == (4 * 12, 24)
    assert shapes["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == (16 + 4, 32)
    assert shapes["model.layers.1.self_attn.kv_b_proj.weight"] == (4 * 16, 16)
    assert shapes["model.layers.2.mlp.experts.7.down_proj.weight"] == (32, 16)
    assert shapes["model.layers.3.eh_proj.weight"] == (32, 64)
    assert shapes["model.layers.3.mlp.shared_experts.up_proj.weight"] == (16, 32)
    assert not any(layer_of(n) == 3 for n in expected_tensor_shapes(cfg, include_mtp=False))
    no_lora = expected_tensor_shapes(ModelConfig.from_dict(tiny_cfg(q_lora_rank=None)))
    assert no_lora["model.layers.0.self_attn.q_proj.weight"] == (48, 32)
    assert "model.layers.0.self_attn.q_a_proj.weight" not in no_lora


def test_sharded_fp8_roundtrip(make_ckpt):
    path, cfg, originals = make_ckpt()
    ck = HFCheckpoint(path)
    assert ck.config == cfg and ck.quantized
    n = len(ck.shard_files)
    assert n >= 3
    assert [f.name for f in ck.shard_files] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    expected = expected_tensor_shapes(cfg)
    scales = {name + "_scale_inv" for name in expected if is_fp8_quantized(name)}
    assert set(ck.tensor_names) == set(expected) | scales
    ck.validate()

    index = json.loads((path / INDEX_NAME).read_text())
    stored = dict(ck.iter_tensors(dequantize=False, dtype=None))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    for name, t in stored.items():
        if is_fp8_quantized(name):
            want = torch.float8_e4m3fn
        elif name.endswith(("_scale_inv", "e_score_correction_bias")):
            want = torch.float32
        else:
            want = torch.bfloat16
        assert t.dtype == want, name

    loaded = dict(ck.iter_tensors())
    assert loaded.keys() == expected.keys()
    for name, t in loaded.items():
        assert t.dtype == torch.float32
        assert_close_to_stored(name, t, originals[name])
    name = "model.layers.2.self_attn.o_proj.weight"
    torch.testing.assert_close(ck.get(name), loaded[name], rtol=0, atol=0)
    assert ck.get(name, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_mtp_tensors_told_apart(make_ckpt):
    path, cfg, originals = make_ckpt()
    ck = HFCheckpoint(path)
    mtp = {n for n, _ in ck.iter_tensors(names=lambda n: is_mtp_tensor(n, cfg))}
    assert mtp == {n for n in expected_tensor_shapes(cfg) if layer_of(n) == 3}
    assert "model.layers.3.enorm.weight" in mtp and not is_mtp_tensor("model.layers.2.mlp.gate.weight", cfg)

    part_only, _, _ = make_ckpt(name="part", drop={"model.layers.3.embed_tokens.weight"})
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(part_only).validate()
    assert str(e.value) == f"{part_only / INDEX_NAME}: tensor 'model.layers.3.embed_tokens.weight' is missing, expected shape [64, 32]"


def test_config_with_mtp_and_files_without_loads_without_mtp(make_ckpt, caplog):
    """What transformers' save_pretrained writes for a fine-tuned DeepSeek-V3: config.json keeps its MTP layer,
    the files carry none. The target model is whole: it opens (with a warning) as a model without MTP."""
    cfg = ModelConfig.from_dict(TINY_CONFIG)
    path, _, _ = make_ckpt(name="target", drop={n for n in expected_tensor_shapes(cfg) if is_mtp_tensor(n, cfg)})
    with caplog.at_level(logging.WARNING, logger="runtime.io.checkpoint"):
        ck = HFCheckpoint(path)
    assert [r.getMessage() for r in caplog.records] == [
        f"{path / 'config.json'}: the config declares 1 MTP layer(s) ('num_nextn_predict_layers', 1 where the file "
        "leaves it out, as transformers reads it) but no MTP tensor (model.layers.3.*) is stored; loading the model "
        "without MTP (no speculative drafting)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="runtime.io.checkpoint"):
        HFCheckpoint(path)  # a build opens it again: said once
    assert caplog.records == []
    assert ck.config.num_nextn_predict_layers == 0 and ck.mtp_missing
    ck.validate()
    assert {n for n, _ in ck.iter_tensors()} == set(expected_tensor_shapes(ck.config))


def test_single_file_checkpoint(make_ckpt):
    path, cfg, originals = make_ckpt(max_shard_bytes=2**30)
    (only,) = path.glob("*.safetensors")
    only.rename(path / "model.safetensors")
    (path / INDEX_NAME).unlink()
    ck = HFCheckpoint(path)
    assert ck.shard_files == [path / "model.safetensors"]
    ck.validate()
    for name, t in ck.iter_tensors():
        assert_close_to_stored(name, t, originals[name])


def test_several_files_without_index(make_ckpt):
    path, _, _ = make_ckpt()
    (path / INDEX_NAME).unlink()
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(path)
    assert str(e.value).startswith(f"{path}: 5 *.safetensors files and no {INDEX_NAME}, expected an index")


def test_bf16_checkpoint(make_ckpt):
    path, cfg, originals = make_ckpt(fp8=False)
    ck = HFCheckpoint(path)
    assert not ck.quantized and "quantization_config" not in json.loads((path / "config.json").read_text())
    assert not any(n.endswith("_scale_inv") for n in ck.tensor_names)
    ck.validate()
    assert ck.tensor_info("model.layers.0.self_attn.q_a_proj.weight").dtype == "BF16"
    name = "model.layers.1.mlp.experts.3.gate_proj.weight"
    torch.testing.assert_close(ck.get(name), originals[name].bfloat16().float(), rtol=0, atol=0)


def test_writer_copies_tokenizer(tmp_path, tiny_cfg):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": {}}')
    (tok / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    cfg = ModelConfig.from_dict(tiny_cfg())
    path = write_hf_checkpoint(tmp_path / "c", cfg, [("model.norm.weight", torch.ones(32))], tokenizer_dir=tok)
    for fname in ("tokenizer.json", "tokenizer_config.json"):
        assert (path / fname).read_text() == (tok / fname).read_text()
    # every file of the checkpoint has the mode a new file gets here (safetensors wrote its shards 0600)
    assert {p.name: p.stat().st_mode & 0o777 for p in path.iterdir()} == \
        dict.fromkeys((p.name for p in path.iterdir()), (path / "config.json").stat().st_mode & 0o777)


def test_scale_in_another_shard(tmp_path, tiny_cfg):
    """A weight and its scale split across shards, as a shard boundary may fall between them."""
    cfg = ModelConfig.from_dict(tiny_cfg())
    name = "model.layers.0.self_attn.q_a_proj.weight"
    w = 0.05 * torch.randn(24, 32)
    path = write_hf_checkpoint(tmp_path / "c", cfg, [(name, w)], max_shard_bytes=w.numel())  # fp8: 1 byte each
    ck = HFCheckpoint(path)
    assert ck.weight_map[name] != ck.weight_map[name + "_scale_inv"]
    assert_close_to_stored(name, dict(ck.iter_tensors())[name], w)
    assert_close_to_stored(name, ck.get(name), w)


def test_passthrough_copy(make_ckpt, tmp_path):
    path, cfg, _ = make_ckpt()
    src = HFCheckpoint(path)
    copy = HFCheckpoint(write_hf_checkpoint(tmp_path / "copy", cfg, src.iter_tensors(dequantize=False, dtype=None)))
    for name in src.tensor_names:
        torch.testing.assert_close(copy.get(name, dequantize=False, dtype=None), src.get(name, dequantize=False, dtype=None), rtol=0, atol=0)


@pytest.mark.parametrize("dequantize", [False, True])
def test_iter_tensors_streams(make_ckpt, monkeypatch, dequantize):
    """Tensors read from disk and still alive never exceed one shard, and every stored byte is read once, into
    memory of its own (no memory map keeps a shard resident)."""
    path, _, _ = make_ckpt()
    ck = HFCheckpoint(path)
    stats = {"live": 0, "peak": 0, "read": 0}
    real_read = checkpoint.read_tensor

    def release(nbytes: int) -> None:
        stats["live"] -= nbytes

    def tracked_read(file, info, scratch=None):
        t = real_read(file, info, scratch)
        nbytes = t.numel() * t.element_size()
        stats["live"] += nbytes
        stats["read"] += nbytes
        stats["peak"] = max(stats["peak"], stats["live"])
        weakref.finalize(t, release, nbytes)
        return t

    monkeypatch.setattr(checkpoint, "read_tensor", tracked_read)
    for _, t in ck.iter_tensors(dequantize=dequantize):
        del t
    total = json.loads((path / INDEX_NAME).read_text())["metadata"]["total_size"]
    largest_shard = max(f.stat().st_size for f in ck.shard_files)
    assert stats["read"] == total  # nothing was read around the tracked path, nothing twice
    assert stats["live"] == 0
    assert stats["peak"] <= largest_shard <= total / 3


def test_writer_refuses_existing_dir(make_ckpt, tmp_path):
    """The commands' one check (a dangling link counts as there: the writer missed it)."""
    from runtime.io.atomic import OutputDirError

    (tmp_path / "ckpt").symlink_to(tmp_path / "nowhere")
    with pytest.raises(OutputDirError, match=re.escape(f"{tmp_path / 'ckpt'}: output directory already exists")):
        make_ckpt()
    (tmp_path / "ckpt").unlink()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "old.txt").write_text("old")
    with pytest.raises(OutputDirError, match=re.escape(f"{tmp_path / 'ckpt'}: output directory already exists")):
        make_ckpt()
    path, _, _ = make_ckpt(force=True)
    assert not (path / "old.txt").exists()
    HFCheckpoint(path).validate()


def test_writer_failure_leaves_nothing(tmp_path, tiny_cfg, tiny_weights):
    cfg = ModelConfig.from_dict(tiny_cfg())

    def failing():
        for i, item in enumerate(tiny_weights(cfg, 0)):
            if i == 60:  # after a few shards were flushed
                raise RuntimeError("boom")
            yield item

    with pytest.raises(RuntimeError, match="boom"):
        write_hf_checkpoint(tmp_path / "ckpt", cfg, failing(), max_shard_bytes=SHARD_BYTES)
    assert list(tmp_path.iterdir()) == []

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        write_hf_checkpoint(tmp_path / "ckpt", cfg, failing(), max_shard_bytes=SHARD_BYTES, force=True)
    assert list(tmp_path.iterdir()) == [tmp_path / "ckpt"]
    assert (tmp_path / "ckpt" / "old.txt").read_text() == "old"


def test_writer_checks_its_arguments_before_writing(tmp_path, tiny_cfg):
    """A missing tokenizer or a shard size below one byte is refused before any tensor is read."""
    cfg = ModelConfig.from_dict(tiny_cfg())

    def never():
        raise AssertionError("tensors were read")
        yield

    with pytest.raises(FileNotFoundError) as e:
        write_hf_checkpoint(tmp_path / "ckpt", cfg, never(), tokenizer_dir=tmp_path)
    assert str(e.value) == f"{tmp_path / 'tokenizer.json'}: not found, expected the tokenizer to copy"
    with pytest.raises(ValueError) as e:
        write_hf_checkpoint(tmp_path / "ckpt", cfg, never(), max_shard_bytes=0)
    assert str(e.value) == "max_shard_bytes must be >= 1, got 0"
    assert list(tmp_path.iterdir()) == []


# ---- broken checkpoints: each error names the file, the tensor or field, and what was expected ----
def test_error_missing_shard(make_ckpt):
    path, _, _ = make_ckpt()
    shard = "model-00002-of-00005.safetensors"
    (path / shard).unlink()
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(path)
    assert str(e.value) == f"{path / INDEX_NAME}: shard '{shard}' named in weight_map does not exist, expected {path / shard}"


@pytest.mark.parametrize("where", ["../elsewhere/{shard}", "/tmp/{shard}", ""])
def test_error_shard_named_outside_the_directory(make_ckpt, tmp_path, where):
    """A shard the index names outside the checkpoint's directory is refused before anything is read (it was
    opened: any readable file's first bytes showed up in the header error)."""
    path, _, _ = make_ckpt()
    shard = "model-00002-of-00005.safetensors"
    name = where.format(shard=shard)
    (tmp_path / "elsewhere").mkdir(exist_ok=True)
    (path / shard).rename(tmp_path / "elsewhere" / shard)  # a real shard, so only its name is wrong
    index = json.loads((path / INDEX_NAME).read_text())
    index["weight_map"] = {k: name if v == shard else v for k, v in index["weight_map"].items()}
    (path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(path)
    assert str(e.value) == (f"{path / INDEX_NAME}: shard {name!r} named in weight_map is not a file name inside "
                            f"{path}; expected a relative name without '..'")


def test_error_missing_tensor(make_ckpt):
    path, _, _ = make_ckpt(drop={"model.layers.1.mlp.gate.weight"})
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(path).validate()
    assert str(e.value) == f"{path / INDEX_NAME}: tensor 'model.layers.1.mlp.gate.weight' is missing, expected shape [8, 32]"


def test_error_wrong_shape(make_ckpt):
    name = "model.layers.2.self_attn.o_proj.weight"
    path, _, _ = make_ckpt(replace={name: torch.randn(32, 16)})
    ck = HFCheckpoint(path)
    with pytest.raises(CheckpointError) as e:
        ck.validate()
    assert str(e.value) == f"{path / ck.weight_map[name]}: tensor '{name}' has shape [32, 16], expected [32, 32]"


def test_error_fp8_weight_without_scale(make_ckpt):
    path, _, _ = make_ckpt()
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    index = json.loads((path / INDEX_NAME).read_text())
    shard = path / index["weight_map"].pop(name + "_scale_inv")
    tensors = load_file(shard)
    del tensors[name + "_scale_inv"]
    save_file(tensors, shard)
    (path / INDEX_NAME).write_text(json.dumps(index))

    ck = HFCheckpoint(path)
    want = (
        f"{path / ck.weight_map[name]}: float8_e4m3fn tensor '{name}' has no '{name}_scale_inv', "
        "expected its float32 block scale"
    )
    with pytest.raises(CheckpointError) as e:
        ck.validate()
    assert str(e.value) == want
    with pytest.raises(CheckpointError) as e:
        ck.get(name)
    assert str(e.value) == want


@pytest.mark.parametrize("overrides, message", [
    (dict(n_group=0), "field 'n_group' must be an integer >= 1, got 0"),
    (dict(moe_layer_freq=0), "field 'moe_layer_freq' must be an integer >= 1, got 0"),
    (dict(n_shared_experts=0), "field 'n_shared_experts' must be an integer >= 1, got 0"),
    (dict(num_attention_heads=True), "field 'num_attention_heads' must be an integer >= 1, got True"),
    (dict(first_k_dense_replace=-1), "field 'first_k_dense_replace' must be an integer >= 0, got -1"),
    (dict(rms_norm_eps="1e-6"), "field 'rms_norm_eps' must be a number > 0, got '1e-6'"),
    (dict(rope_theta=0), "field 'rope_theta' must be a number > 0, got 0"),
    (dict(rope_scaling="yarn"), "field 'rope_scaling' must be an object or null, got 'yarn'"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": 128}),
     "field 'quantization_config.weight_block_size' must be two integers >= 1, got 128"),
    (dict(quantization_config={"quant_method": "fp8", "fmt": "e5m2"}),
     "field 'quantization_config' has fmt 'e5m2' and activation_scheme 'dynamic', expected 'e4m3' and 'dynamic' "
     "(the release's FP8)"),
    (dict(rope_scaling={"type": "yarn", "factor": "4", "original_max_position_embeddings": 64}),
     "field 'rope_scaling.factor' must be a number > 0, got '4'"),
    (dict(rope_scaling={"type": "yarn", "factor": -4, "original_max_position_embeddings": 64}),
     "field 'rope_scaling.factor' must be a number > 0, got -4"),
    (dict(rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 0}),
     "field 'rope_scaling.original_max_position_embeddings' must be an integer >= 1, got 0"),
    (dict(eos_token_id=[]), "field 'eos_token_id' must be a token id or a non-empty list of them"),
    (dict(eos_token_id="x"), "field 'eos_token_id' is 'x', expected a token id in [0, 64) (vocab_size)"),
    (dict(eos_token_id=64), "field 'eos_token_id' is 64, expected a token id in [0, 64) (vocab_size)"),
    (dict(bos_token_id=-1), "field 'bos_token_id' is -1, expected a token id in [0, 64) (vocab_size) or null"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                           "attention_factor": 1.2}),
     "field 'rope_parameters.attention_factor' is 1.2, expected None (DeepSeek-V3's YaRN)"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                           "truncate": False}),
     "field 'rope_parameters.truncate' is False, expected True (DeepSeek-V3's YaRN)"),
    (dict(rope_scaling=None, rope_parameters={"rope_type": "linear", "factor": 4.0}),
     "field 'rope_parameters.rope_type' is 'linear', expected 'yarn' or 'default'"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "low_freq_factor": 1}),
     "field 'rope_scaling.low_freq_factor' is not supported, expected only attention_factor, beta_fast, beta_slow, "
     "factor, mscale, mscale_all_dim, original_max_position_embeddings, partial_rotary_factor, rope_theta, "
     "rope_type, truncate, type"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
     "fields 'rope_theta' and 'rope_parameters.rope_theta' disagree (10000.0, 50000.0)"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
     "fields 'rope_scaling' and 'rope_parameters' describe different RoPE scaling; give one of them"),
    (dict(rope_scaling={"type": "yarn", "rope_type": "default", "factor": 4.0, "original_max_position_embeddings": 64}),
     "fields 'rope_scaling.type' ('yarn') and 'rope_scaling.rope_type' ('default') disagree"),
    (dict(head_dim=8), "field 'head_dim' is 8, expected 4 (qk_rope_head_dim, the RoPE width transformers reads it as)"),
    (dict(qk_head_dim=8), "field 'qk_head_dim' is 8, expected 12 (qk_nope_head_dim + qk_rope_head_dim)"),
    (dict(rope_interleave=False),
     "field 'rope_interleave' is False, expected True (DeepSeek-V3's interleaved RoPE pairs)"),
    (dict(architectures="DeepseekV3ForCausalLM"),
     "field 'architectures' must be a list of strings, got 'DeepseekV3ForCausalLM'"),
    (dict(num_key_value_heads="4"), "field 'num_key_value_heads' is '4', expected an integer >= 1 or null"),
    (dict(norm_topk_prob="false"), "field 'norm_topk_prob' is 'false', expected true or false"),
    (dict(hidden_act="gelu"), "field 'hidden_act' is 'gelu', expected 'silu'"),
    (dict(tie_word_embeddings=True),
     "field 'tie_word_embeddings' is True, expected false (DeepSeek-V3's lm_head is a weight of its own)"),
    (dict(attention_bias=True), "field 'attention_bias' is True, expected false (DeepSeek-V3's attention has no biases)"),
    # forms that loaded as another model, silently, or were refused in Python's words
    (dict(rope_scaling={"factor": 4.0, "original_max_position_embeddings": 64}),
     "field 'rope_scaling' has no type (or rope_type): expected 'yarn' (DeepSeek-V3's) or 'default'; transformers "
     "reads it as 'default', DeepSeek's code as 'yarn'"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0}),
     "field 'rope_scaling' (yarn) has no original_max_position_embeddings: expected the scaling factor and the "
     "context length before scaling (DeepSeek-V3: 40 and 4096)"),
    (dict(original_max_position_embeddings=32),
     "fields 'original_max_position_embeddings' (32) and 'rope_scaling.original_max_position_embeddings' (64) "
     "disagree; give one"),
    (dict(partial_rotary_factor=0.5),
     "field 'partial_rotary_factor' is 0.5, expected 1 (DeepSeek-V3 rotates qk_rope_head_dim whole)"),
    (dict(moe_layer_freq=2),
     "field 'moe_layer_freq' is 2, expected 1 (every DeepSeek-V3 release; transformers ignores the field, DeepSeek's "
     "own code reads it, so the layers' layout for another value depends on who saved them)"),
    (dict(eos_token_id=[1, 5]),
     "field 'eos_token_id' is [1, 5], expected one token id (give the others to requests as stop_token_ids)"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [192, 192]}),
     "field 'quantization_config.weight_block_size' is [192, 192], expected [128, 128] (the release's FP8 block "
     "scales; TensorRT-LLM's FP8_BLOCK_SCALES)"),
    (dict(eos_token_id=[[1]]), "field 'eos_token_id' must be a token id or a non-empty list of them"),
    (dict(num_mtp_layers=2),
     "fields 'num_nextn_predict_layers' (1) and 'num_mtp_layers' (2) disagree (num_mtp_layers is transformers' "
     "other name for num_nextn_predict_layers); give one"),
    # listing the layout of 10**9 layers or experts grew memory without end before any tensor was compared
    (dict(num_hidden_layers=10**9), "field 'num_hidden_layers' is 1000000000, expected at most 1024"),
    (dict(n_routed_experts=10**9), "field 'n_routed_experts' is 1000000000, expected at most 4096"),
    (dict(num_nextn_predict_layers=10**9), "field 'num_nextn_predict_layers' is 1000000000, expected at most 16"),
])
def test_error_config_field_types(tiny_cfg, overrides, message):
    """Malformed fields are refused when config.json is read, naming the field (no ZeroDivisionError
    or TypeError later, no model that only fails when it runs)."""
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(tiny_cfg(**overrides), source="c.json")
    assert str(e.value) == f"c.json: {message}"


@pytest.mark.parametrize("name, stored, message", [
    ("model.embed_tokens.weight", torch.zeros(64, 32, dtype=torch.int64), "is I64, expected one of BF16, F16, F32, F8_E4M3"),
    ("model.layers.1.self_attn.q_b_proj.weight_scale_inv", torch.ones(1, 1, dtype=torch.bfloat16),
     "is BF16, expected F32 (block scales)"),
])
def test_error_tensor_dtypes(make_ckpt, name, stored, message):
    path, _, _ = make_ckpt(fp8=True)
    index = json.loads((path / INDEX_NAME).read_text())
    shard = path / index["weight_map"][name]
    tensors = load_file(shard)
    assert tensors[name].shape == stored.shape
    tensors[name] = stored
    save_file(tensors, shard)
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(path).validate()
    assert str(e.value) == f"{shard}: tensor {name!r} {message}"


def test_error_expert_past_n_routed_experts(make_ckpt):
    """A stray expert index is an unexpected tensor, as any other name the config does not have."""
    path, cfg, _ = make_ckpt(fp8=False)
    index = json.loads((path / INDEX_NAME).read_text())
    src = "model.layers.1.mlp.experts.0.up_proj.weight"
    shard = path / index["weight_map"][src]
    tensors = load_file(shard)
    stray = f"model.layers.1.mlp.experts.{cfg.n_routed_experts}.up_proj.weight"
    tensors[stray] = tensors[src].clone()
    save_file(tensors, shard)
    index["weight_map"][stray] = index["weight_map"][src]
    (path / INDEX_NAME).write_text(json.dumps(index))
    from runtime.io.engine_format import EngineError
    from runtime.io.loading import load_engine

    with pytest.raises(EngineError) as e:
        load_engine(path)
    assert str(e.value) == f"{shard}: unexpected tensor {stray!r}, not part of a DeepSeek-V3 model with this config.json"


def test_error_model_type(tmp_path, tiny_cfg):
    (tmp_path / "config.json").write_text(json.dumps(tiny_cfg(model_type="llama")))
    with pytest.raises(ConfigError) as e:
        HFCheckpoint(tmp_path)
    assert str(e.value) == f"{tmp_path / 'config.json'}: field 'model_type' is 'llama', expected 'deepseek_v3'"


def test_error_mtp_tensors_without_mtp_layers_in_config(make_ckpt, tiny_cfg):
    """The reverse of a fine-tuned save: files with an MTP layer that config.json does not declare."""
    path, _, _ = make_ckpt()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(path).validate()
    assert str(e.value).endswith(": unexpected tensor 'model.layers.3.embed_tokens.weight', not part of a DeepSeek-V3 "
                                 "model with this config.json")


def test_error_truncated_shard(make_ckpt):
    path, _, _ = make_ckpt()
    shard = path / "model-00003-of-00005.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(path)
    assert str(e.value).startswith(f"{shard}: file is truncated: {size - 10} bytes, expected {size} (")


@pytest.mark.parametrize(
    "garbage, detail",
    [
        (b"not a safetensors file at all" * 10, "declares"),  # header length decodes to ~10^18
        (struct.pack("<Q", 12) + b"\xffgarbage!!!\x00" + bytes(100), "not JSON"),
    ],
)
def test_error_corrupt_header(make_ckpt, garbage: bytes, detail: str):
    path, _, _ = make_ckpt()
    shard = path / "model-00001-of-00005.safetensors"
    shard.write_bytes(garbage)
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(path)
    assert str(e.value).startswith(f"{shard}: invalid safetensors header: {detail}")


def test_error_header_length_past_safetensors_limit(make_ckpt):
    """A corrupt header length within the file's size was read and decoded whole (a 4 GB shard's worth) before the
    refusal; safetensors itself refuses a header over 100,000,000 bytes, and so does this, before reading it."""
    path, _, _ = make_ckpt()
    shard = path / "model-00001-of-00005.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(200_000_016)  # sparse: no disk used
        f.write(struct.pack("<Q", 200_000_000))
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(path)
    assert str(e.value) == (f"{shard}: invalid safetensors header: declares 200000000 header bytes, expected at most "
                            "100000000 (safetensors' limit)")


def test_error_config_not_json(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3",')
    with pytest.raises(ConfigError) as e:
        HFCheckpoint(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: not valid JSON (")
    (tmp_path / "config.json").write_bytes(b'{"model_type": "deepseek_v3\xff"}')
    with pytest.raises(ConfigError) as e:
        HFCheckpoint(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: not UTF-8 text (")
    # arrays nested past the parser's recursion, an integer too long to convert: a traceback before
    for text in ('{"model_type": "deepseek_v3", "x": ' + "[" * 100000 + "]" * 100000 + "}",
                 '{"model_type": "deepseek_v3", "hidden_size": ' + "9" * 5000 + "}"):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(ConfigError) as e:
            HFCheckpoint(tmp_path)
        assert str(e.value).startswith(f"{tmp_path / 'config.json'}: not valid JSON (")


HF_CONFIGS = Path(__file__).parent / "data" / "hf_configs"


@pytest.mark.parametrize("saved_by", ["transformers-4.57.1", "transformers-5.23.0"])
def test_configs_as_transformers_saves_them(saved_by):
    """The same model's config as transformers 4 (`rope_scaling`, top-level `rope_theta`) and 5
    (`rope_parameters` holding both) write it reads as the same model: YaRN and all. The files were
    written by each version's `DeepseekV3Config(...).save_pretrained` (tests/data/hf_configs/README.md)."""
    saved = ModelConfig.from_json(HF_CONFIGS / f"{saved_by}.json")
    source = ModelConfig.from_json(HF_CONFIGS / "source.json")
    assert dataclasses.replace(saved, quantization_config=None) == dataclasses.replace(source, quantization_config=None)
    assert saved.rope_scaling is not None and saved.rope_scaling.factor == 4.0


def test_a_field_left_out_means_what_it_means_to_transformers():
    """A config.json without a field is the model transformers (and vLLM, which reads configs through it) makes of
    it: routed_scaling_factor left out was read as 1.0 here and 2.5 there, and the logits differed with no error."""
    from transformers import DeepseekV3Config
    full = json.loads((HF_CONFIGS / "source.json").read_text())
    skip = {"rope_scaling", "architectures", "torch_dtype", "quantization_config", "extra",  # tested apart
            "model_type",  # required here (test_error_model_type)
            "num_key_value_heads"}  # MLA has no KV heads: the math never reads it
    checked, differ = [], {}
    for f in dataclasses.fields(ModelConfig):
        raw = {k: v for k, v in full.items() if k != f.name}
        reference = DeepseekV3Config(**raw)
        if f.default is dataclasses.MISSING or f.name in skip or not hasattr(reference, f.name):
            continue
        checked.append(f.name)
        ours = getattr(ModelConfig.from_dict(raw), f.name)
        if ours != getattr(reference, f.name):
            differ[f.name] = (ours, getattr(reference, f.name))
    assert "routed_scaling_factor" in checked and "first_k_dense_replace" in checked
    assert differ == {}


def test_transformers_5_yarn_without_rope_scaling_key(tiny_cfg):
    """transformers 5 may write `rope_scaling: null` next to `rope_parameters`: YaRN still applies."""
    raw = tiny_cfg(rope_scaling=None, rope_parameters={**TINY_ROPE, "rope_type": "yarn", "rope_theta": 10000.0})
    raw.pop("rope_theta")
    assert ModelConfig.from_dict(raw) == ModelConfig.from_dict(tiny_cfg())


def test_unknown_config_field_is_named_in_a_warning(tiny_cfg, caplog):
    with caplog.at_level(logging.WARNING, logger="runtime.model.config"):
        ModelConfig.from_dict(tiny_cfg(sliding_window=128, use_cache=True), source="c.json")
    assert [r.getMessage() for r in caplog.records] == [
        "c.json: field(s) sliding_window not read by this runtime; if they change the model's math, its output "
        "will be wrong"]


def test_quantization_config_keys_not_read_are_named_in_a_warning(tiny_cfg, caplog):
    """Inside quantization_config too (they were dropped without a word); DeepSeek-V3.1's `scale_fmt: ue8m0` and
    `modules_to_not_convert` change nothing here and pass quietly, another scale_fmt is refused."""
    release = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    with caplog.at_level(logging.WARNING, logger="runtime.model.config"):
        ModelConfig.from_dict(tiny_cfg(quantization_config={**release, "scale_fmt": "ue8m0",
                                                            "modules_to_not_convert": ["lm_head"]}), source="c.json")
        assert caplog.records == []
        ModelConfig.from_dict(tiny_cfg(quantization_config={**release, "ignored_layers": ["x"]}), source="c.json")
    assert [r.getMessage() for r in caplog.records] == [
        "c.json: field(s) quantization_config.ignored_layers not read by this runtime; if they change the model's "
        "math, its output will be wrong"]
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(tiny_cfg(quantization_config={**release, "scale_fmt": "e8m0fnu"}), source="c.json")
    assert str(e.value) == "c.json: field 'quantization_config.scale_fmt' is 'e8m0fnu', expected 'ue8m0' or null"


def _restore(path: Path, name: str, tensor: torch.Tensor, beside: str | None = None) -> Path:
    """Store `tensor` as `name` (new or replacing) in the shard of `beside` (default: `name`, or the weight
    of a scale); returns the shard."""
    index = json.loads((path / INDEX_NAME).read_text())
    beside = beside or (name if name in index["weight_map"] else name.removesuffix("_scale_inv"))
    shard = path / index["weight_map"][beside]
    tensors = load_file(shard)
    tensors[name] = tensor
    save_file(tensors, shard)
    index["weight_map"][name] = shard.name
    (path / INDEX_NAME).write_text(json.dumps(index))
    return shard


def test_scale_next_to_a_weight_that_is_not_fp8_is_refused(make_ckpt):
    """An fp16 weight with a weight_scale_inv beside it: dequantizing would ignore the scale and produce garbage.
    build_engine and the runtime open checkpoints through the same validate, so both refuse it."""
    path, _, _ = make_ckpt(fp8=False)
    name = "model.layers.1.self_attn.q_b_proj.weight"
    shard = _restore(path, name, load_file(path / json.loads((path / INDEX_NAME).read_text())["weight_map"][name])[name].half())
    _restore(path, name + "_scale_inv", torch.ones(1, 1))
    want = f"{shard}: tensor {name!r} is F16 but has {name + '_scale_inv'!r}, expected F8_E4M3 (a block scale multiplies FP8 codes)"
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(path).validate()
    assert str(e.value) == want
    from runtime.io.engine_format import EngineError
    from runtime.io.loading import load_engine

    with pytest.raises(EngineError) as e:
        load_engine(path)
    assert str(e.value) == want


def test_fp8_codes_on_a_tensor_that_is_not_2d_are_refused(make_ckpt):
    """A norm weight stored as FP8 with a scale beside it raised a bare IndexError (no file, no tensor named)."""
    path, _, originals = make_ckpt(fp8=False)
    name = "model.layers.0.input_layernorm.weight"
    shard = _restore(path, name, originals[name].to(torch.float8_e4m3fn))
    _restore(path, name + "_scale_inv", torch.ones(1))
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(path).validate()
    assert str(e.value) == (f"{shard}: tensor {name!r} is F8_E4M3 with shape [{originals[name].numel()}], expected one "
                            "of BF16, F16, F32 (FP8 block scales are for 2-D weights)")


def test_transformers_5_fused_experts_are_named(make_ckpt):
    """transformers 5 can save a layer's experts as one gate_up_proj / down_proj: refused saying so (the error named
    the first per-expert tensor as missing)."""
    path, _, _ = make_ckpt()
    name = "model.layers.1.mlp.experts.down_proj"
    shard = _restore(path, name, torch.zeros(8, 32, 16), beside="model.layers.1.mlp.gate.weight")
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(path).validate()
    assert str(e.value) == (f"{shard}: tensor {name!r} holds a layer's routed experts fused, as transformers 5 saves "
                            "them with save_original_format=False; expected one tensor per expert as DeepSeek "
                            "releases them (save_pretrained's default)")


def test_unexpected_tensor_is_refused(make_ckpt):
    path, _, _ = make_ckpt()
    shard = _restore(path, "model.layers.1.self_attn.rotary_emb.inv_freq", torch.ones(4),
                     beside="model.layers.1.self_attn.q_b_proj.weight")
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(path).validate()
    assert str(e.value) == (f"{shard}: unexpected tensor 'model.layers.1.self_attn.rotary_emb.inv_freq', not part of "
                            "a DeepSeek-V3 model with this config.json")


@pytest.mark.parametrize("name, fp8", [
    ("model.layers.1.mlp.experts.2.up_proj.weight", True),  # FP8 codes: a NaN byte
    ("model.layers.1.mlp.experts.2.up_proj.weight_scale_inv", True),  # its block scale
    ("model.norm.weight", False),  # a bf16 tensor
])
def test_non_finite_values_are_refused_as_they_stream(make_ckpt, name, fp8):
    path, _, _ = make_ckpt(fp8=fp8)
    index = json.loads((path / INDEX_NAME).read_text())
    shard = path / index["weight_map"][name]
    tensors = load_file(shard)
    t = tensors[name]
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).view(-1)[5] = 0x7F
    else:
        t.view(-1)[-1] = float("inf") if name.endswith("scale_inv") else float("nan")
    save_file(tensors, shard)
    ck = HFCheckpoint(path)
    ck.validate()  # headers are fine
    want = f"{shard}: tensor {name!r} holds NaN or infinite values"
    for dequantize in (True, False):  # the runtime's path and build_engine's
        with pytest.raises(CheckpointError) as e:
            list(ck.iter_tensors(dequantize=dequantize))
        assert str(e.value) == want


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32])
def test_check_finite_finds_every_non_finite_value_anywhere(dtype, tmp_path):
    """Each NaN code (FP8: 0x7F and 0xFF) and each infinity, at the first, a middle and the last element, is found;
    the largest finite values, negative zero and an empty tensor pass."""
    base = (torch.linspace(-1, 1, 4099) * (448 if dtype == torch.float8_e4m3fn else 1e4)).to(dtype)
    extremes = [448.0, -448.0] if dtype == torch.float8_e4m3fn else [torch.finfo(dtype).max, torch.finfo(dtype).min]
    check_finite(torch.tensor(extremes + [-0.0]).to(dtype), "w", tmp_path)
    check_finite(base[:0], "w", tmp_path)
    if dtype == torch.float8_e4m3fn:
        bad = [lambda t, i, code=code: t.view(torch.uint8).__setitem__(i, code) for code in (0x7F, 0xFF)]
    else:
        bad = [lambda t, i, v=v: t.__setitem__(i, v) for v in (float("nan"), float("inf"), float("-inf"))]
    for put in bad:
        for i in (0, 2049, 4098):
            t = base.clone()
            put(t, i)
            with pytest.raises(CheckpointError, match=r"tensor 'w' holds NaN or infinite values$"):
                check_finite(t, "w", tmp_path)
    check_finite(base, "w", tmp_path)


def test_the_release_config_reads_without_unknown_fields(caplog):
    with caplog.at_level(logging.WARNING, logger="runtime.model.config"):
        cfg = ModelConfig.from_json(HF_CONFIGS / "deepseek-v3.json")
    assert caplog.records == [] and cfg.rope_scaling.factor == 40 and cfg.num_nextn_predict_layers == 1


def test_transformers_other_field_names_are_read(tiny_cfg):
    """transformers' aliases (DeepseekV3Config.attribute_map) are the fields: a config giving only num_mtp_layers
    declared no MTP layer here, and its MTP tensors were refused as unexpected."""
    raw = tiny_cfg()
    raw["num_mtp_layers"] = raw.pop("num_nextn_predict_layers")
    raw["num_local_experts"] = raw.pop("n_routed_experts")
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.num_nextn_predict_layers, cfg.n_routed_experts) == (1, tiny_cfg()["n_routed_experts"])
    assert cfg.extra == {} and cfg == ModelConfig.from_dict(tiny_cfg())
    raw["num_mtp_layers"] = "x"  # refused by the name the file gives it
    with pytest.raises(ConfigError, match=r"^c.json: field 'num_mtp_layers' must be an integer >= 0, got 'x'$"):
        ModelConfig.from_dict(raw, source="c.json")


def test_a_layers_routed_experts_share_one_dtype(make_ckpt):
    """A layer whose routed experts mix FP8 and BF16 loaded without the CPU kernels and was refused with them, naming
    an internal stacked tensor: every path refuses it when the checkpoint is opened, naming the stored tensors."""
    path, _, _ = make_ckpt(fp8=True, max_shard_bytes=1 << 30)
    index = json.loads((path / INDEX_NAME).read_text())
    name = "model.layers.1.mlp.experts.3.gate_proj.weight"
    shard = path / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = HFCheckpoint(path).get(name).to(torch.bfloat16)
    del tensors[name + "_scale_inv"], index["weight_map"][name + "_scale_inv"]
    save_file(tensors, shard)
    (path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        HFCheckpoint(path).validate()
    assert str(e.value) == (f"{shard}: tensor {name!r} is BF16 but 'model.layers.1.mlp.experts.0.gate_proj.weight' is "
                            "F8_E4M3, expected one dtype for a layer's routed experts (as DeepSeek's releases store them)")
