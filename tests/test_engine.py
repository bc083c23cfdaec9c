"""load_engine: engine directories and plain HF checkpoints, the BuildConfig rules, the rank split
rule, and every refusal (newer format, trtllm backend, changed or missing files)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from builder.convert import convert_checkpoint
from builder.native_engine import build_engine
from conftest import tiny_config_dict, write_tiny_checkpoint
from runtime.model.config import ModelConfig
from runtime.io.engine_format import BuildConfig, EngineError, shard_index, shard_shape, split_dim
from runtime.io.loading import LoadedEngine, load_engine


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("src") / "hf")


@pytest.fixture(scope="module")
def built(hf, tmp_path_factory) -> Path:
    """A tp=2, ep=2 engine; tests copy it before breaking it."""
    root = tmp_path_factory.mktemp("engine")
    b = BuildConfig(max_seq_len=256, tp_size=2, ep_size=2)
    convert_checkpoint(hf, root / "ckpt", b, progress=False)
    return build_engine(root / "ckpt", root / "engine", b, progress=False)


@pytest.fixture
def engine(built, tmp_path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "engine"))


def test_load_engine_directory(built, hf):
    e = load_engine(built)
    assert isinstance(e, LoadedEngine) and e.path == built
    assert e.build == BuildConfig(max_seq_len=256, tp_size=2, ep_size=2)
    assert e.model_config.num_nextn_predict_layers == 1 and e.model_config.quantization_config is None
    assert not e.model.training and not any(p.requires_grad for p in e.model.parameters())
    assert {p.dtype for p in e.model.parameters()} == {torch.float32}
    for name, p in e.model.named_parameters():  # on CPU: matmul weights K-major (MKL's faster gemm), tables row-major
        assert (p.dim() < 2 or name.endswith("embed_tokens.weight")) == p.is_contiguous(), name
    ref = load_engine(hf).model
    for (name, p), (_, q) in zip(e.model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(p, q), name
    e16 = load_engine(built, dtype="bfloat16")
    assert e16.build.dtype == "bfloat16" and {p.dtype for p in e16.model.parameters()} == {torch.bfloat16}
    assert e16.model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    with pytest.raises(EngineError, match="dtype 'float16' is not supported, expected one of float32, bfloat16"):
        load_engine(built, dtype="float16")


def test_load_hf_checkpoint_defaults(hf, tiny_checkpoint):
    e = load_engine(hf, dtype=torch.bfloat16)
    assert e.path == hf
    assert e.build == BuildConfig(max_seq_len=256, max_draft_len=4, dtype="bfloat16")
    assert e.model.lm_head.weight.dtype == torch.bfloat16 and e.model.inv_freq.dtype == torch.float32
    no_mtp = load_engine(tiny_checkpoint("nomtp", tiny_config_dict(num_nextn_predict_layers=0, max_position_embeddings=8192)))
    assert no_mtp.build.max_draft_len == 0 and no_mtp.build.max_seq_len == 4096 and len(no_mtp.model.mtp) == 0
    fp8 = load_engine(tiny_checkpoint("fp8", fp8=True), cpu_kernels=False)  # packed for the kernels: test_kernels
    assert fp8.build.quant_algo == "FP8_BLOCK_SCALES" and fp8.model.lm_head.weight.dtype == torch.float32


def test_refuses_newer_format(engine):
    raw = json.loads((engine / "engine.json").read_text())
    raw["format_version"] = 2
    (engine / "engine.json").write_text(json.dumps(raw))
    with pytest.raises(EngineError) as e:
        load_engine(engine)
    assert str(e.value) == (f"{engine / 'engine.json'}: format_version 2 is newer than this runtime supports (1); "
                            "upgrade the runtime or rebuild the engine with this version's build_engine")
    for bad in (0, True, "1"):
        (engine / "engine.json").write_text(json.dumps({**raw, "format_version": bad}))
        with pytest.raises(EngineError) as e:
            load_engine(engine)
        assert str(e.value) == f"{engine / 'engine.json'}: field 'format_version' is {bad!r}, expected an integer >= 1"


def test_refuses_trtllm_backend(hf, tmp_path):
    from builder.trtllm_engine import build_trtllm_engine

    out = build_trtllm_engine(hf, tmp_path / "trt", BuildConfig(max_seq_len=256, backend="trtllm"), progress=False)
    with pytest.raises(EngineError) as e:
        load_engine(out)
    assert str(e.value).startswith(f"{out}: built with --backend trtllm; run it with the TensorRT-LLM backend (trtllm-serve ")
    assert str(e.value).endswith("or rebuild with --backend native")


def test_refuses_changed_file(engine):
    rank1 = engine / "rank1.safetensors"
    data = bytearray(rank1.read_bytes())
    data[-3] ^= 0x01
    rank1.write_bytes(bytes(data))
    with pytest.raises(EngineError, match=r"rank1\.safetensors: content hash mismatch .*the file changed or is corrupt"):
        load_engine(engine)
    load_engine(engine, verify=False)  # still a valid safetensors file: only the hash knows


def test_refuses_edited_engine_json(engine):
    raw = json.loads((engine / "engine.json").read_text())
    raw["build"]["max_batch_size"] = 64
    (engine / "engine.json").write_text(json.dumps(raw))
    with pytest.raises(EngineError) as e:
        load_engine(engine)
    assert str(e.value) == (f"{engine / 'engine.json'}: content_hash does not match the model_config, build and file "
                            "hashes it lists; engine.json was edited or is corrupt, rebuild the engine")


@pytest.mark.parametrize("edit", [{"build": None}, {"files": ["rank0.safetensors"]}, {"model_config": []},
                                  {"weights": None}], ids=["build", "files", "model_config", "weights"])
def test_refuses_malformed_engine_json_fields(engine, edit):
    raw = json.loads((engine / "engine.json").read_text())
    (engine / "engine.json").write_text(json.dumps({**raw, **edit}))
    with pytest.raises(EngineError) as e:
        load_engine(engine)
    assert str(e.value).startswith(f"{engine / 'engine.json'}: malformed field (")
    assert str(e.value).endswith("); rebuild the engine")


def test_refuses_missing_rank_file(engine):
    (engine / "rank1.safetensors").unlink()
    msg = (f"{engine / 'rank1.safetensors'}: weight file missing, expected 2 (rank0.safetensors, rank1.safetensors) "
           "for tp_size 2")
    with pytest.raises(EngineError) as e:
        load_engine(engine)
    assert str(e.value) == msg
    with pytest.raises(EngineError, match="weight file missing"):
        load_engine(engine, verify=False)


@pytest.fixture(scope="module")
def built_fp8(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    b = BuildConfig(max_seq_len=256, quant_algo="FP8_BLOCK_SCALES")
    convert_checkpoint(write_tiny_checkpoint(root / "hf", fp8=True), root / "ckpt", b, progress=False)
    return build_engine(root / "ckpt", root / "engine", b, progress=False)


@pytest.mark.parametrize("break_scale", ["drop", "reshape"])
def test_refuses_an_fp8_tensor_without_its_scale(built_fp8, tmp_path, break_scale):
    """Raw FP8 codes copied as values would load a silently wrong model, even unverified (an engine
    written by a broken build has matching hashes)."""
    from safetensors.torch import load_file, save_file

    engine = Path(shutil.copytree(built_fp8, tmp_path / "engine"))
    load_engine(engine)
    rank0 = engine / "rank0.safetensors"
    tensors = load_file(rank0)
    name = next(n for n, t in sorted(tensors.items()) if t.dtype == torch.float8_e4m3fn and t.dim() == 2)
    scale = tensors.pop(name + "_scale_inv")
    if break_scale == "reshape":
        tensors[name + "_scale_inv"] = scale.reshape(-1)[:-1].reshape(1, -1).clone()
    save_file(tensors, rank0, metadata={"format": "pt"})
    with pytest.raises(EngineError) as e:
        load_engine(engine, verify=False)
    if break_scale == "drop":
        assert str(e.value) == f"{rank0}: FP8 tensor {name!r} has no {name + '_scale_inv'!r}"
    else:
        assert str(e.value).startswith(f"{rank0}: tensor {name + '_scale_inv'!r} of shape "
                                       f"{[1, scale.numel() - 1]} does not fit {name!r} of shape ")


def test_refuses_other_directories(tmp_path):
    with pytest.raises(EngineError, match="neither engine.json nor config.json found"):
        load_engine(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config_dict()))
    with pytest.raises(EngineError, match=r"0 \*\.safetensors files and no model\.safetensors\.index\.json"):
        load_engine(tmp_path)


def test_build_config_rules():
    assert BuildConfig().to_dict() == {
        "max_batch_size": 8, "max_seq_len": 1024, "max_num_tokens": 2048, "max_draft_len": 4, "dtype": "float32",
        "kv_block_size": 16, "tp_size": 1, "ep_size": 1, "quant_algo": None, "backend": "native"}
    for kwargs, msg in [
        (dict(max_batch_size=0), "max_batch_size is 0, expected a positive integer"),
        # an engine of 1 position would serve nothing (build_engine --max_seq_len 1 --kv_block_size 1 built one)
        (dict(max_seq_len=1, kv_block_size=1), "max_seq_len is 1, expected at least 2 (a prompt token and a generated "
                                               "one)"),
        (dict(max_draft_len=-1), "max_draft_len is -1, expected an integer >= 0"),
        (dict(kv_block_size=24), "kv_block_size is 24, expected a power of two (as TensorRT-LLM's tokens_per_block) "
                                 "at most max_seq_len (1024)"),
        (dict(kv_block_size=2048), "kv_block_size is 2048, expected a power of two (as TensorRT-LLM's "
                                   "tokens_per_block) at most max_seq_len (1024)"),
        (dict(dtype="float16"), "dtype is 'float16', expected one of float32, bfloat16"),
        (dict(quant_algo="NVFP4"), "quant_algo is 'NVFP4', expected FP8_BLOCK_SCALES, FP8 or none"),
        (dict(backend="tensorrt"), "backend is 'tensorrt', expected one of native, trtllm"),
        (dict(tp_size=4, ep_size=3), "ep_size 3 does not divide tp_size 4, expected a divisor "
                                     "(MoE ranks are moe_tp_size x moe_ep_size = tp_size)"),
    ]:
        with pytest.raises(EngineError) as e:
            BuildConfig(**kwargs)
        assert str(e.value) == msg
    with pytest.raises(EngineError, match="engine.json: unknown build field"):
        BuildConfig.from_dict({"max_beam_width": 2}, "engine.json")
    # a field left out was its default (a bfloat16 engine loaded in float32), a boolean an integer
    whole = BuildConfig(dtype="bfloat16").to_dict()
    with pytest.raises(EngineError, match=r"^engine.json: missing build field\(s\) dtype; rebuild the engine$"):
        BuildConfig.from_dict({k: v for k, v in whole.items() if k != "dtype"}, "engine.json")
    with pytest.raises(EngineError, match=r"^engine.json: max_batch_size is True, expected a positive integer$"):
        BuildConfig.from_dict({**whole, "max_batch_size": True}, "engine.json")
    with pytest.raises(EngineError, match=r"^max_num_tokens is 4, expected at least max_draft_len \+ 1 \(5: "):
        BuildConfig(max_num_tokens=4, max_draft_len=4)
    with pytest.raises(EngineError, match=r"^engine.json: max_draft_len is True, expected an integer >= 0$"):
        BuildConfig.from_dict({**whole, "max_draft_len": True}, "engine.json")
    b = BuildConfig(tp_size=8, ep_size=4)
    assert b.moe_tp_size == 2 and (b.layout(5).moe_ep_rank, b.layout(5).moe_tp_rank) == (1, 1)


def test_split_rule():
    assert split_dim("model.layers.3.self_attn.q_b_proj.weight") == 0
    assert split_dim("model.layers.3.self_attn.o_proj.weight") == 1
    assert split_dim("model.layers.3.self_attn.kv_a_proj_with_mqa.weight") is None
    assert split_dim("model.layers.3.mlp.gate.weight") is None  # router: replicated
    assert split_dim("mtp.0.block.mlp.experts.down_proj") == 2
    assert split_dim("mtp.0.eh_proj.weight") is None
    assert split_dim("mtp.0.shared_head.head.weight") == 0
    b = BuildConfig(tp_size=4, ep_size=2)
    # experts [E=8, I=16, H=32]: rank 3 is moe_ep_rank 1 (experts 4..7), moe_tp_rank 1 (rows 8..15)
    assert shard_index("model.layers.1.mlp.experts.up_proj", (8, 16, 32), b, 3) == (slice(4, 8), slice(8, 16), slice(None))
    assert shard_shape("model.layers.1.mlp.experts.up_proj", (8, 16, 32), b) == (4, 8, 32)
    # a vocabulary of 66 over 4 ranks: 17 rows each, the last rank holds 15 real ones
    assert shard_index("lm_head.weight", (66, 32), b, 3) == (slice(51, 66), slice(None))
    assert shard_shape("lm_head.weight", (66, 32), b) == (17, 32)


def _rewrite_manifest(engine: Path, edit) -> None:
    """Edit engine.json and give it the matching content hash, as a determined editor would."""
    from runtime.io.engine_format import EngineManifest

    raw = json.loads((engine / "engine.json").read_text())
    edit(raw)
    raw["content_hash"] = EngineManifest(
        ModelConfig.from_dict(raw["model_config"]), BuildConfig.from_dict(raw["build"], "b"), tuple(raw["weights"]),
        raw["files"], raw["builder_version"]).content_hash
    (engine / "engine.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("field, value, message", [
    ("max_seq_len", 512, "max_seq_len 512 exceeds max_position_embeddings (256) of {src}"),
    ("max_draft_len", 9, "max_draft_len 9 exceeds 8, the most {src} allows: the MTP module is re-run per draft "
                         "token, up to a cap of 8"),
])
def test_loader_checks_limits_against_the_model(engine, field, value, message):
    """The build's limits are checked against the model at load too: a hash is no signature."""
    _rewrite_manifest(engine, lambda raw: raw["build"].__setitem__(field, value))
    with pytest.raises(EngineError) as e:
        load_engine(engine)
    assert str(e.value) == message.format(src=f"{engine / 'engine.json'}: field 'model_config'")


def test_refuses_weight_files_named_outside_the_engine(engine, tmp_path):
    """engine.json names files inside its directory: a rank file moved elsewhere and named by its absolute path was
    loaded (with its hash recomputed), and so would any file the process can read."""
    moved = tmp_path / "rank0.safetensors"
    (engine / "rank0.safetensors").rename(moved)

    def point_outside(raw: dict) -> None:
        raw["weights"] = [str(moved) if w == "rank0.safetensors" else w for w in raw["weights"]]
        raw["files"] = {(str(moved) if k == "rank0.safetensors" else k): v for k, v in raw["files"].items()}

    _rewrite_manifest(engine, point_outside)
    with pytest.raises(EngineError) as e:
        load_engine(engine)
    assert str(e.value) == (f"{engine / 'engine.json'}: fields 'weights' / 'files' name {str(moved)!r}, not a file "
                            f"name inside {engine}; expected a relative name without '..'")


@pytest.mark.parametrize("weights", [["rank1.safetensors", "rank0.safetensors"],
                                     ["rank0.safetensors", "rank0.safetensors"], ["rank0.safetensors"]])
def test_refuses_weight_files_out_of_rank_order(engine, weights):
    """A rank file's place in engine.json's list is its rank (the files carry none): a list reordered or with a
    file twice, its hash recomputed, loaded a tp 2 engine silently wrong."""
    _rewrite_manifest(engine, lambda raw: raw.__setitem__("weights", weights))
    with pytest.raises(EngineError) as e:
        load_engine(engine)
    assert str(e.value) == (f"{engine / 'engine.json'}: field 'weights' is {weights}, expected ['rank0.safetensors', "
                            "'rank1.safetensors'] (one file per rank of tp_size 2, in rank order, as build_engine "
                            "writes)")


def _retype(file: Path, tensor: str, dtype: str) -> None:
    """Declare another dtype for a tensor in a safetensors header, its bytes unchanged."""
    import struct

    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header[tensor]["dtype"] = dtype
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


@pytest.mark.parametrize("tensor, dtype, message", [
    ("model.layers.1.self_attn.o_proj.weight", "U8",
     "tensor 'model.layers.1.self_attn.o_proj.weight' is U8, expected one of BF16, F16, F32, F8_E4M3"),
    ("model.layers.1.self_attn.o_proj.weight", "F8_E5M2",
     "tensor 'model.layers.1.self_attn.o_proj.weight' is F8_E5M2, expected one of BF16, F16, F32, F8_E4M3"),
    ("model.layers.1.self_attn.o_proj.weight_scale_inv", "I32",
     "tensor 'model.layers.1.self_attn.o_proj.weight_scale_inv' is I32, expected one of BF16, F16, F32, F8_E4M3"),
])
def test_refuses_rank_files_with_other_dtypes(shipped_model_dir, tmp_path, tensor, dtype, message):
    """A rank file's dtypes are the converter's: other ones (of the same width, so the file stays well formed) were
    read as values, a silently wrong model, or failed with a bare KeyError; refused naming the file and tensor."""
    b = BuildConfig(max_seq_len=256, quant_algo="FP8_BLOCK_SCALES")
    convert_checkpoint(shipped_model_dir, tmp_path / "ckpt", b, progress=False)
    engine = build_engine(tmp_path / "ckpt", tmp_path / "engine", b, progress=False)
    rank0 = engine / "rank0.safetensors"
    _retype(rank0, tensor, dtype)
    with pytest.raises(EngineError) as e:
        load_engine(engine, verify=False)
    assert str(e.value) == f"{rank0}: {message}"


def test_refuses_non_finite_weights_in_rank_files(engine):
    from safetensors.torch import load_file, save_file

    rank1 = engine / "rank1.safetensors"
    tensors = load_file(rank1)
    name = "lm_head.weight"  # split over ranks, so rank 1 holds a piece
    tensors[name][0, 0] = float("nan")
    save_file(tensors, rank1, metadata={"format": "pt"})
    with pytest.raises(EngineError) as e:
        load_engine(engine, verify=False)
    assert str(e.value) == f"{rank1}: tensor {name!r} holds NaN or infinite values"


def test_loading_a_model_imports_neither_torch_dynamo_nor_sympy():
    """Building the model under the meta device and allocating it run no op through torch's reference
    implementations (normal_, arange, empty_like of a meta tensor), whose first use imports torch._dynamo or
    sympy: seconds and ~90 MB in every process that loads an engine (each rank, the Triton model, each Session)."""
    shipped = Path(__file__).resolve().parents[1] / "models" / "deepseek-v3-mini"
    code = (f"import sys; from runtime.io.loading import load_engine; load_engine({str(shipped)!r}); "
            "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
