"""HF -> TensorRT-LLM checkpoint -> engine on tiny models: same logits as the HF checkpoint, rank
files holding only their shard, config.json fields, every build_engine error and atomic output,
and the files of --backend trtllm."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import builder.convert as convert
import builder.trtllm_layout as trtllm_layout
import builder.validation as validation
from runtime.io.atomic import owned_tempdir, remove_stale
import builder.native_engine as engine_builder
from builder.cli import main
from builder.validation import BuildError
from builder.convert import _Source, _stored_piece, convert_checkpoint
from builder.trtllm_layout import rank_layout
from builder.native_engine import TrtllmCheckpoint, build_engine, model_config_from_trtllm
from conftest import tiny_config_dict, write_tiny_checkpoint
from runtime.io.checkpoint import HFCheckpoint
from runtime.model.config import ModelConfig
from runtime.io.engine_format import BuildConfig, EngineError, checkpoint_limits, default_max_seq_len
from runtime.io.loading import load_engine
from runtime.model.fp8 import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8

ROOT = Path(__file__).resolve().parents[1]
LIMITS = dict(max_seq_len=256)  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("src") / "hf")


@pytest.fixture(scope="module")
def hf_fp8(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("src") / "hf_fp8", fp8=True)


def outputs(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense-forward logits and MTP logits of an engine or checkpoint, on a fixed batch."""
    model = load_engine(path).model
    ids = torch.arange(14).view(2, 7) * 5 % 64
    with torch.no_grad():
        hidden = model(ids)
        return model.logits(hidden), model.mtp_forward(0, ids, hidden)[0]


def build(src: Path, out: Path, **kw) -> Path:
    b = BuildConfig(**LIMITS, **kw)
    convert_checkpoint(src, out / "ckpt", b, progress=False)
    return build_engine(out / "ckpt", out / "engine", b, progress=False)


def cli(*args: str) -> int:
    """build_engine's exit code; argparse's own errors exit through SystemExit."""
    try:
        return main([str(a) for a in args])
    except SystemExit as e:
        return e.code


# ---- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("tp,ep", [(2, 2), (4, 2)])
def test_roundtrip_same_logits(hf, tmp_path, tp, ep):
    engine = build(hf, tmp_path, tp_size=tp, ep_size=ep)
    (want, want_mtp), (got, got_mtp) = outputs(hf), outputs(engine)
    assert (got - want).abs().max() <= 1e-5
    assert (got_mtp - want_mtp).abs().max() <= 1e-5


def test_padded_vocabulary_roundtrip(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint(cfg_dict=tiny_config_dict(vocab_size=66))
    engine = build(src, tmp_path, tp_size=4, ep_size=1)
    with safe_open(tmp_path / "ckpt" / "rank3.safetensors", "pt") as f:
        emb = f.get_tensor("transformer.vocab_embedding.weight")
    assert emb.shape == (17, 32) and emb[15:].abs().sum() == 0  # 66 rows padded to 68
    (want, _), (got, _) = outputs(src), outputs(engine)
    assert (got - want).abs().max() <= 1e-5


def test_fp8_passthrough_equals_hf(hf_fp8, tmp_path):
    engine = build(hf_fp8, tmp_path, tp_size=2, ep_size=2, quant_algo="FP8_BLOCK_SCALES")
    (want, want_mtp), (got, got_mtp) = outputs(hf_fp8), outputs(engine)
    assert torch.equal(got, want) and torch.equal(got_mtp, want_mtp)
    # the released bytes and scales pass through unchanged (expert 5 sits on rank 1 as local expert 1)
    ck = HFCheckpoint(hf_fp8)
    with safe_open(tmp_path / "ckpt" / "rank1.safetensors", "pt") as f:
        fc, scale = f.get_tensor("transformer.layers.1.mlp.fc.weight"), f.get_tensor("transformer.layers.1.mlp.fc.weights_scaling_factor")
        assert f.get_tensor("transformer.layers.1.attention.kv_b_proj.weight").dtype == torch.float32
        assert f.get_tensor("transformer.mtp_layers.0.eh_proj.weight").dtype == torch.float32
    up = "model.layers.1.mlp.experts.5.up_proj.weight"
    assert fc.dtype == FP8_DTYPE and fc.shape == (4, 32, 32)
    assert torch.equal(fc[1, :16].view(torch.uint8), ck.get(up, dequantize=False, dtype=None).view(torch.uint8))
    assert torch.equal(scale[1, :1], ck.get(up + "_scale_inv", dequantize=False, dtype=None))


@pytest.mark.parametrize("algo", ["FP8_BLOCK_SCALES", "FP8"])
def test_fp8_from_fp32_source(hf, tmp_path, algo):
    engine = build(hf, tmp_path, tp_size=2, ep_size=1, quant_algo=algo)
    want = dict(load_engine(hf, cpu_kernels=False).model.named_parameters())
    for name, got in load_engine(engine, cpu_kernels=False).model.named_parameters():
        if trtllm_layout.is_quantized(name, algo):  # within e4m3 rounding (3 mantissa bits)
            assert (got - want[name]).norm() <= 0.05 * want[name].norm(), name
        else:
            assert torch.equal(got, want[name]), name
    with safe_open(tmp_path / "ckpt" / "rank0.safetensors", "pt") as f0, \
            safe_open(tmp_path / "ckpt" / "rank1.safetensors", "pt") as f1:
        name = "transformer.layers.0.attention.fused_a.weights_scaling_factor"
        if algo == "FP8":  # one scale per released weight, computed before splitting: shared by all ranks
            assert f0.get_tensor(name).shape == (2,) and torch.equal(f0.get_tensor(name), f1.get_tensor(name))
        else:  # q_a_proj and kv_a_proj_with_mqa each on their own 128x128 grid
            assert f0.get_tensor(name).shape == (2, 1)


def test_block_split_inside_a_block_requantizes():
    """A split at a row that is not a multiple of 128 and crosses a block boundary is requantized."""
    w = torch.randn(300, 256) * torch.linspace(0.1, 10, 300)[:, None]
    q, s = quantize_block_fp8(w)
    source = _Source(q, s)
    part = trtllm_layout.PartLayout("model.layers.0.self_attn.q_b_proj.weight", (150, 256), 0, (2, 2), 0)
    b = BuildConfig(quant_algo="FP8_BLOCK_SCALES")
    head, head_scale = _stored_piece(source, (slice(0, 150), slice(None)), part, b)
    assert torch.equal(head.view(torch.uint8), q[:150].view(torch.uint8)) and torch.equal(head_scale, s[:2])
    tail, tail_scale = _stored_piece(source, (slice(150, 300), slice(None)), part, b)
    assert tail_scale.shape == (2, 2)
    deq = dequantize_block_fp8(tail, tail_scale)
    assert ((deq - w[150:]).abs() <= w[150:].abs().max() / 448 * 2 + w[150:].abs() / 8).all()


# ---- rank files and config.json ------------------------------------------------------------------
def test_blocks_split_names_the_tensors_that_are_quantized_again(shipped_model_dir, hf_fp8):
    """The shipped model's 384 q_b_proj rows split at 192 for tp 2 (not a multiple of 128): those
    tensors are quantized again, and build_engine says so; tp 1 and the tiny model (pieces inside one
    block) keep the release bytes."""
    from builder.convert import blocks_split
    from runtime.io.weights import parameter_shapes

    def split(path: Path, tp: int) -> list[str]:
        ckpt = HFCheckpoint(path)
        build = BuildConfig(tp_size=tp, max_seq_len=256, quant_algo="FP8_BLOCK_SCALES")
        where = {p.name: (t, p) for t in rank_layout(ckpt.config, build) for p in t.parts}
        return blocks_split(ckpt, ckpt.config, build, where, parameter_shapes(ckpt.config))

    assert split(shipped_model_dir, 1) == []
    at_tp2 = split(shipped_model_dir, 2)
    assert len(at_tp2) == 22 and "model.layers.0.self_attn.q_b_proj.weight" in at_tp2
    assert all(n.endswith(("q_b_proj.weight", "kv_b_proj.weight")) for n in at_tp2)
    assert split(hf_fp8, 2) == []


def test_rank_files_hold_only_their_shard(hf, tmp_path):
    b = BuildConfig(**LIMITS, tp_size=4, ep_size=2)  # moe_tp_size 2
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", b, progress=False)
    src = dict(HFCheckpoint(hf).iter_tensors())
    layout = {t.tensor.name: t.shape for t in rank_layout(ModelConfig.from_dict(tiny_config_dict()), b)}
    for rank in range(4):
        t = load_file(ckpt / f"rank{rank}.safetensors")
        assert {n: tuple(v.shape) for n, v in t.items()} == layout
        ep, mtp = rank % 2, rank // 2
        L = "transformer.layers.1."
        assert t[L + "attention.q_b_proj.weight"].shape == (12, 24)  # 1 of 4 heads
        assert torch.equal(t[L + "attention.dense.weight"], src["model.layers.1.self_attn.o_proj.weight"][:, rank * 8:(rank + 1) * 8])
        assert torch.equal(t["transformer.layers.0.mlp.fc.weight"], src["model.layers.0.mlp.gate_proj.weight"][rank * 16:(rank + 1) * 16])
        assert t[L + "mlp.fc.weight"].shape == (4, 16, 32)  # 4 of 8 experts, [up; gate] each 8 of 16 rows
        e = 4 * ep + 3
        assert torch.equal(t[L + "mlp.fc.weight"][3, :8], src[f"model.layers.1.mlp.experts.{e}.up_proj.weight"][mtp * 8:(mtp + 1) * 8])
        assert torch.equal(t[L + "mlp.fc.weight"][3, 8:], src[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"][mtp * 8:(mtp + 1) * 8])
        assert torch.equal(t[L + "mlp.proj.weight"][3], src[f"model.layers.1.mlp.experts.{e}.down_proj.weight"][:, mtp * 8:(mtp + 1) * 8])
        assert torch.equal(t[L + "attention.fused_a.weight"], torch.cat([src["model.layers.1.self_attn.q_a_proj.weight"],
                                                                          src["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]]))
        assert torch.equal(t["transformer.mtp_layers.0.shared_head.weight"], src["model.layers.3.shared_head.head.weight"][rank * 16:(rank + 1) * 16])
        assert t["transformer.mtp_layers.0.mlp.router.weight"].dtype == torch.float32


def test_trtllm_config_fields(hf, tmp_path):
    b = BuildConfig(**LIMITS, tp_size=2, ep_size=2, quant_algo="FP8_BLOCK_SCALES", dtype="bfloat16", max_draft_len=3)
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", b, progress=False)
    c = json.loads((ckpt / "config.json").read_text())
    assert c["architecture"] == "DeepseekV3ForCausalLM" and c["dtype"] == "bfloat16" and c["logits_dtype"] == "float32"
    assert (c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]) == (64, 32, 3, 4)
    assert (c["kv_lora_rank"], c["q_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]) == (16, 24, 8, 4, 8)
    assert (c["first_k_dense_replace"], c["moe_layer_freq"], c["rotary_base"]) == (1, 1, 10000.0)
    assert c["rotary_scaling"]["type"] == "yarn" and c["rotary_scaling"]["mscale_all_dim"] == 1.0
    assert c["moe"] == {"num_experts": 8, "top_k": 2, "shared_expert_intermediate_size": 16, "normalization_mode": 4,
                        "norm_topk_prob": True, "device_limited_n_group": 2, "device_limited_topk_group": 1,
                        "device_limited_routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    assert c["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1, "moe_tp_size": 1, "moe_ep_size": 2}
    assert c["quantization"]["quant_algo"] == "FP8_BLOCK_SCALES" and c["quantization"]["group_size"] == 128
    assert "*kv_b_proj*" in c["quantization"]["exclude_modules"] and "*eh_proj*" in c["quantization"]["exclude_modules"]
    assert c["speculative_decoding"] == {"decoding_type": "MTP", "num_nextn_predict_layers": 1, "max_draft_len": 3,
                                         "draft_layer_prefix": "transformer.mtp_layers."}
    back = model_config_from_trtllm(c, "config.json")
    orig = HFCheckpoint(hf).config.to_dict()
    orig.pop("quantization_config", None)
    assert back.to_dict() | {"torch_dtype": orig["torch_dtype"]} == orig


# ---- build_engine: happy paths and atomic output -------------------------------------------------
def test_cli_model_dir_and_checkpoint_dir(hf, tmp_path, capsys):
    assert cli("--model_dir", hf, "--output_dir", tmp_path / "e1", "--max_seq_len", 256, "--tp_size", 2, "--ep_size", 2) == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the temporary checkpoint is gone
    manifest = json.loads((tmp_path / "e1" / "engine.json").read_text())
    assert manifest["build"]["max_draft_len"] == 4 and manifest["build"]["tp_size"] == 2
    assert sorted(manifest["files"]) == ["rank0.safetensors", "rank1.safetensors", "tokenizer.json"]
    convert_checkpoint(hf, tmp_path / "ckpt", BuildConfig(**LIMITS, tp_size=2), progress=False)
    assert cli("--checkpoint_dir", tmp_path / "ckpt", "--output_dir", tmp_path / "e2", "--max_seq_len", 256,
               "--tokenizer_dir", hf) == 0
    e2 = load_engine(tmp_path / "e2")
    assert e2.build == BuildConfig(max_seq_len=256, tp_size=2)
    assert (tmp_path / "e2" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    assert cli("--checkpoint_dir", tmp_path / "ckpt", "--output_dir", tmp_path / "e2", "--max_seq_len", 128,
               "--tokenizer_dir", hf, "--force") == 0
    assert load_engine(tmp_path / "e2").build.max_seq_len == 128


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failed_build_leaves_nothing(hf, tmp_path, monkeypatch, exc):
    """No output, no temporary engine or checkpoint, and none of the directories the build made above --output_dir
    (`keep/a/b/out` left `keep/a/b`); the directory that was there stays."""
    calls = []

    def failing(*args):
        calls.append(args)
        if len(calls) == 2:
            raise exc

    monkeypatch.setattr(engine_builder, "_build_rank", failing)
    (tmp_path / "keep").mkdir()
    out = tmp_path / "keep" / "a" / "b" / "out"
    args = ["--model_dir", hf, "--output_dir", out, "--max_seq_len", 256, "--tp_size", 2]
    if isinstance(exc, KeyboardInterrupt):
        assert cli(*args) == 130
    else:
        with pytest.raises(RuntimeError, match="disk full"):
            cli(*args)
    assert len(calls) == 2
    assert list(tmp_path.rglob("*")) == [tmp_path / "keep"]


def test_a_full_disk_or_a_read_only_location_names_the_output_dir(hf, tmp_path, monkeypatch, capsys):
    """The file system's refusals name --output_dir, as the user gave it: a full disk while the conversion wrote named
    no file at all (a write names none), a read-only location named the build's internal lock file, and a file of the
    engine was named in its temporary directory (deleted since). Exit status 2 and nothing left."""
    import errno

    import builder.rank_file as rank_file
    import runtime.io.atomic as atomic

    out, flags = tmp_path / "out", ("--max_seq_len", 256)

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_disk_at_tokenizer(src: Path, dst: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst / "tokenizer.json"))

    def read_only(prefix: str = "", suffix: str = "", dir: str = "") -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.join(dir, f"{prefix}k2x9{suffix}"))

    for target, name, fake, shown, reason in (
            (rank_file.RankFileWriter, "write", full_disk, out, "No space left on device"),
            (engine_builder, "copy_tokenizer", full_disk_at_tokenizer, out / "tokenizer.json", "No space left on device"),
            (atomic.tempfile, "mkstemp", read_only, out, "Read-only file system")):
        with monkeypatch.context() as m:
            m.setattr(target, name, fake)
            assert error(capsys, "--model_dir", hf, "--output_dir", out, *flags) == (
                f"build_engine: error: {shown}: {reason}; no output directory was written")
        assert list(tmp_path.iterdir()) == []


def test_interrupted_conversion_leaves_nothing(hf, tmp_path, monkeypatch):
    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "_write_shard", interrupt)
    assert cli("--model_dir", hf, "--output_dir", tmp_path / "out", "--max_seq_len", 256) == 130
    assert list(tmp_path.iterdir()) == []


def test_sigterm_cleans_up_like_ctrl_c(hf, tmp_path):
    """kill / docker stop / a scheduler's time limit send SIGTERM: no hidden temporaries stay."""
    import signal
    import subprocess
    import sys
    import time

    work = tmp_path / "w"
    work.mkdir()
    # the build is caught mid-way: a rank file waits for the signal (a fixed delay would leave a test process
    # slower than it, on a loaded machine, to signal a build that had already finished)
    code = ("import sys, time, builder.native_engine as e; orig = e._build_rank\n"
            "def slow(*a):\n    time.sleep(60)\n    return orig(*a)\n"
            "e._build_rank = slow\nfrom builder.cli import main\nsys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", code, "--model_dir", str(hf), "--output_dir", str(work / "out"),
                             "--max_seq_len", "256", "--tp_size", "2"], cwd=Path(__file__).resolve().parents[1], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(work.glob(".out.*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted; no output directory was written" in err
    assert list(work.iterdir()) == []


def test_an_interrupt_before_the_with_block_leaves_nothing(tmp_path):
    """A SIGTERM landing after `with owned_tempdir(...)`'s entry returned but before its block started skipped the
    exit that removes the temporary and its lock (a CI run of the test above left the lock): build_engine's interrupt
    handler removes what this process still owns (`release_owned`)."""
    from runtime.io.atomic import release_owned

    context = owned_tempdir(tmp_path, ".out.ckpt-")
    tmp = context.__enter__()  # and the interrupt: no __exit__
    assert tmp.is_dir() and len(list(tmp_path.iterdir())) == 2
    release_owned()
    assert list(tmp_path.iterdir()) == []
    with owned_tempdir(tmp_path, ".out.ckpt-") as tmp:  # a block that ends as usual is not released twice
        release_owned()
    assert list(tmp_path.iterdir()) == []


def test_force_replaces_atomically_and_never_deletes_inputs(hf, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert cli("--model_dir", hf, "--output_dir", out, "--max_seq_len", 256) == 0
    old = sorted(p.name for p in out.iterdir())
    # interrupted after the new engine is complete but before it replaces the old one: the old stays whole
    import runtime.io.atomic as atomic

    def interrupted_rename(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.os, "rename", interrupted_rename)
    assert cli("--model_dir", hf, "--output_dir", out, "--max_seq_len", 128, "--force") == 130
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == old and load_engine(out).build.max_seq_len == 256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # an output directory that is or contains an input is refused, even with --force
    inside = tmp_path / "models"
    shutil.copytree(hf, inside / "hf")
    assert error(capsys, "--model_dir", inside / "hf", "--output_dir", inside, "--force") == (
        f"build_engine: error: --output_dir {inside} is or contains --model_dir ({inside / 'hf'}); "
        "replacing it would delete that; choose another directory")
    monkeypatch.chdir(inside)
    assert error(capsys, "--model_dir", inside / "hf", "--output_dir", ".", "--force") == (
        f"build_engine: error: --output_dir . is or contains --model_dir ({inside / 'hf'}); "
        "replacing it would delete that; choose another directory")
    assert (inside / "hf" / "config.json").is_file()


def test_export_model_refuses_to_replace_its_training_run(tmp_path, monkeypatch, capsys):
    """export_model --force with --out_dir the run directory deleted ckpt.pt and everything beside it: refused as
    build_engine refuses an output that contains its input, before the checkpoint is read."""
    import training.export_model as export

    run = tmp_path / "run"
    run.mkdir()
    for name in ("ckpt.pt", "tokenizer.json", "notes.txt"):
        (run / name).write_text("kept")
    monkeypatch.setattr(sys, "argv", ["export_model", "--ckpt", str(run / "ckpt.pt"), "--tokenizer_dir", str(run),
                                      "--out_dir", str(run), "--force"])
    with pytest.raises(SystemExit) as e:
        export.main()
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m training.export_model: error: --out_dir {run} is or contains --ckpt ({run / 'ckpt.pt'}); replacing it would delete "
        "that; choose another directory")
    assert sorted(p.name for p in run.iterdir()) == ["ckpt.pt", "notes.txt", "tokenizer.json"]



def test_export_model_refuses_what_is_not_a_training_checkpoint(tmp_path, monkeypatch, capsys):
    """A --ckpt that torch.load cannot read, or a torch file without the training run's keys, is one line naming the
    flag (torch.load's and a KeyError's tracebacks before), and nothing is written."""
    import training.export_model as export

    (tmp_path / "notes.pt").write_text("not a checkpoint")
    torch.save({"weights": torch.zeros(1)}, tmp_path / "other.pt")
    for name, message in (("notes.pt", "not a checkpoint torch.load can read ("),
                          ("other.pt", "not a checkpoint of training.train_model or training.distill_mtp "
                                       "(no config, model, step)")):
        monkeypatch.setattr(sys, "argv", ["export_model", "--ckpt", str(tmp_path / name), "--tokenizer_dir",
                                          str(tmp_path), "--out_dir", str(tmp_path / "out")])
        with pytest.raises(SystemExit) as e:
            export.main()
        assert e.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1].startswith(
            f"python -m training.export_model: error: --ckpt {tmp_path / name}: {message}")
    assert not (tmp_path / "out").exists()

def test_output_that_appears_during_the_build_is_not_replaced(hf, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    orig = engine_builder._build_rank

    def meanwhile(*args):
        out.mkdir(exist_ok=True)
        (out / "precious.txt").write_text("x")
        return orig(*args)

    monkeypatch.setattr(engine_builder, "_build_rank", meanwhile)
    assert error(capsys, "--model_dir", hf, "--output_dir", out, "--max_seq_len", 256) == (
        f"build_engine: error: {out}: appeared while the output was being written; not replaced (--force replaces it)")
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_loaded_engine_limits_are_hard(hf, tmp_path):
    """An engine directory's limits are build choices: loading marks it built (a plain checkpoint is not)."""
    engine = build(hf, tmp_path)
    assert load_engine(engine).built is True
    assert load_engine(hf).built is False


# ---- build_engine: user errors -------------------------------------------------------------------
def error(capsys, *args: str) -> str:
    """Run build_engine expecting a user error: exit code 2, one message line, no traceback."""
    capsys.readouterr()
    assert cli(*args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_error_missing_and_corrupt_inputs(hf, tmp_path, capsys):
    out = tmp_path / "out"
    assert error(capsys, "--model_dir", tmp_path / "nope", "--output_dir", out) == (
        f"build_engine: error: {tmp_path / 'nope'}: not a directory, expected a checkpoint directory")
    broken = tmp_path / "broken"
    shutil.copytree(hf, broken)
    shard = sorted(broken.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    assert error(capsys, "--model_dir", broken, "--output_dir", out).startswith(
        f"build_engine: error: {shard}: file is truncated: ")
    shutil.copytree(hf, tmp_path / "notok")
    (tmp_path / "notok" / "tokenizer.json").unlink()
    assert error(capsys, "--model_dir", tmp_path / "notok", "--output_dir", out, "--max_seq_len", 256) == (
        f"build_engine: error: {tmp_path / 'notok' / 'tokenizer.json'}: tokenizer file not found, "
        "expected tokenizer.json next to the weights (or --tokenizer_dir)")
    (tmp_path / "notok" / "tokenizer.json").mkdir()
    assert error(capsys, "--model_dir", tmp_path / "notok", "--output_dir", out, "--max_seq_len", 256) == (
        f"build_engine: error: {tmp_path / 'notok' / 'tokenizer.json'}: not a file, expected the tokenizer's "
        "tokenizer.json")
    # flags that would change nothing were taken without a word
    assert error(capsys, "--model_dir", hf, "--output_dir", out, "--device_memory_gib", 80) == (
        "build_engine: error: --device_memory_gib sizes --dry_run's plan; a build reads no device memory (leave it out)")
    assert error(capsys, "--model_dir", hf, "--output_dir", out, "--backend", "trtllm", "--max_draft_len", 0,
                 "--use_relaxed_acceptance_for_thinking") == (
        "build_engine: error: --use_relaxed_acceptance_for_thinking and --use_mtp_vanilla change how drafts are made "
        "or accepted; --max_draft_len 0 drafts none")
    # a tokenizer with ids past the model's vocabulary: every request using one would be refused (it built)
    vocab, shipped = json.loads((hf / "config.json").read_text())["vocab_size"], ROOT / "models" / "deepseek-v3-mini"
    assert vocab < 4096 and error(capsys, "--model_dir", hf, "--output_dir", out, "--max_seq_len", 256,
                                  "--tokenizer_dir", shipped) == (
        f"build_engine: error: {shipped / 'tokenizer.json'}: its token ids reach 4095, past the model's vocab_size "
        f"{vocab}; use the model's own tokenizer")
    # a tokenizer the runtime would refuse to load is refused at build, as it loads it
    (tmp_path / "notok" / "tokenizer.json").rmdir()
    (tmp_path / "notok" / "tokenizer.json").write_text("{}")
    assert error(capsys, "--model_dir", tmp_path / "notok", "--output_dir", out, "--max_seq_len", 256).startswith(
        f"build_engine: error: cannot read tokenizer file {tmp_path / 'notok' / 'tokenizer.json'}: Model missing")
    shutil.copy(hf / "tokenizer.json", tmp_path / "notok" / "tokenizer.json")
    (tmp_path / "notok" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<nope>"}))
    assert error(capsys, "--model_dir", tmp_path / "notok", "--output_dir", out, "--max_seq_len", 256) == (
        f"build_engine: error: {tmp_path / 'notok' / 'tokenizer_config.json'}: bos_token '<nope>' is not in the "
        "tokenizer's vocabulary")
    assert error(capsys, "--model_dir", hf, "--output_dir", out, "--max_seq_len", 256, "--kv_block_size", 24) == (
        "build_engine: error: kv_block_size is 24, expected a power of two (as TensorRT-LLM's tokens_per_block) "
        "at most max_seq_len (256)")
    assert error(capsys, "--checkpoint_dir", hf / "nope", "--output_dir", out) == (
        f"build_engine: error: {hf / 'nope' / 'config.json'}: file not found, expected a TensorRT-LLM checkpoint directory")
    assert not out.exists()


def test_error_wrong_shapes(tiny_checkpoint, hf, tmp_path, capsys):
    src = tiny_checkpoint("bad")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    shard = src / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = torch.zeros(10, 16, dtype=torch.bfloat16)
    save_file(tensors, shard, metadata={"format": "pt"})
    assert error(capsys, "--model_dir", src, "--output_dir", tmp_path / "o") == (
        f"build_engine: error: {shard}: tensor {name!r} has shape [10, 16], expected [64, 16]")
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", BuildConfig(**LIMITS, tp_size=2), progress=False)
    rank1 = load_file(ckpt / "rank1.safetensors")
    rank1["transformer.layers.0.attention.dense.weight"] = torch.zeros(32, 32)
    save_file(rank1, ckpt / "rank1.safetensors")
    assert error(capsys, "--checkpoint_dir", ckpt, "--output_dir", tmp_path / "o", "--tokenizer_dir", hf) == (
        f"build_engine: error: {ckpt / 'rank1.safetensors'}: tensor 'transformer.layers.0.attention.dense.weight' "
        "is F32 [32, 32], expected F32 [32, 16]")
    (ckpt / "rank1.safetensors").unlink()
    assert error(capsys, "--checkpoint_dir", ckpt, "--output_dir", tmp_path / "o", "--tokenizer_dir", hf) == (
        f"build_engine: error: {ckpt / 'rank1.safetensors'}: rank file missing, expected 2 rank files for tp_size 2")
    # malformed config.json fields named, not a TypeError's traceback
    config = json.loads((ckpt / "config.json").read_text())
    for edit, message in ((("mapping", "moe_tp_size", None), "field 'mapping.moe_tp_size' is None, expected a positive "
                           "integer"),
                          ((None, "dtype", ["float32"]), "dtype is ['float32'], expected one of ")):
        broken = json.loads(json.dumps(config))
        section, key, value = edit
        (broken[section] if section else broken)[key] = value
        (ckpt / "config.json").write_text(json.dumps(broken))
        assert error(capsys, "--checkpoint_dir", ckpt, "--output_dir", tmp_path / "o", "--tokenizer_dir", hf
                     ).startswith(f"build_engine: error: {ckpt / 'config.json'}: {message}")


def test_error_unsupported_quantization(tiny_checkpoint, hf, tmp_path, capsys):
    out = tmp_path / "out"
    assert error(capsys, "--model_dir", hf, "--output_dir", out, "--quant_algo", "NVFP4") == (
        "build_engine: error: argument --quant_algo: invalid choice: 'NVFP4' (choose from 'FP8_BLOCK_SCALES', 'FP8', 'NO_QUANT')")
    src = tiny_checkpoint("b64", tiny_config_dict(), fp8=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (src / "config.json").write_text(json.dumps(cfg))
    assert error(capsys, "--model_dir", src, "--output_dir", out, "--max_seq_len", 256) == (
        f"build_engine: error: {src / 'config.json'}: field 'quantization_config.weight_block_size' is [64, 64], "
        "expected [128, 128] (the release's FP8 block scales; TensorRT-LLM's FP8_BLOCK_SCALES)")
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", BuildConfig(**LIMITS), progress=False)
    c = json.loads((ckpt / "config.json").read_text())
    c["quantization"]["quant_algo"] = "W4A8_AWQ"
    (ckpt / "config.json").write_text(json.dumps(c))
    assert error(capsys, "--checkpoint_dir", ckpt, "--output_dir", out) == (
        f"build_engine: error: {ckpt / 'config.json'}: unsupported quantization: quant_algo 'W4A8_AWQ', "
        "expected FP8_BLOCK_SCALES, FP8 or null")
    assert not out.exists()


def test_error_parallelism(tiny_checkpoint, hf, tmp_path, capsys):
    out = tmp_path / "out"
    assert error(capsys, "--model_dir", hf, "--output_dir", out, "--tp_size", 3) == (
        f"build_engine: error: --tp_size 3 does not divide num_attention_heads (4) of {hf / 'config.json'}")
    assert error(capsys, "--model_dir", hf, "--output_dir", out, "--ep_size", 2) == (
        "build_engine: error: ep_size 2 does not divide tp_size 1, expected a divisor "
        "(MoE ranks are moe_tp_size x moe_ep_size = tp_size)")
    src = tiny_checkpoint("e6", tiny_config_dict(n_routed_experts=6))
    assert error(capsys, "--model_dir", src, "--output_dir", out, "--tp_size", 4, "--ep_size", 4) == (
        f"build_engine: error: --ep_size 4 does not divide n_routed_experts (6) of {src / 'config.json'}")
    assert error(capsys, "--model_dir", hf, "--output_dir", out, "--tp_size", 0) == (
        "build_engine: error: argument --tp_size: '0' is not a positive integer")
    # written as .nan into the LLM-API options, or a traceback, before
    assert error(capsys, "--model_dir", hf, "--output_dir", out, "--backend", "trtllm", "--relaxed_delta", "nan") == (
        "build_engine: error: argument --relaxed_delta: 'nan' is not in [0, 1]")
    assert error(capsys, "--model_dir", hf, "--dry_run", "--device_memory_gib", "-1") == (
        "build_engine: error: argument --device_memory_gib: '-1' is not a positive number of GiB")
    assert not out.exists()


def test_dry_run_refuses_what_the_build_refuses(hf, tmp_path, capsys):
    """--dry_run ran only the sharding check: it planned (exit 0) a --max_seq_len past max_position_embeddings, a
    draft length past the rule and LLM-API options on the native backend, all of which the build refuses. Each
    is now refused in the same words; --force, which replaces an output a dry run never writes, is refused."""
    cfg = hf / "config.json"
    refused = {
        ("--max_seq_len", 100000): f"--max_seq_len 100000 exceeds max_position_embeddings (256) of {cfg}",
        ("--max_seq_len", 256, "--max_draft_len", 99): f"--max_draft_len 99 exceeds 8, the most {cfg} allows: the MTP "
                                                       "module is re-run per draft token, up to a cap of 8",
        ("--max_seq_len", 256, "--backend", "trtllm", "--use_mtp_vanilla", "--max_draft_len", 2):
            f"--max_draft_len 2 exceeds 1, the most {cfg} allows: TensorRT-LLM's vanilla MTP drafts one token per MTP "
            "layer (num_nextn_predict_layers 1)",
        ("--max_seq_len", 256, "--enable_attention_dp"): "the LLM API options (--enable_attention_dp, "
                                                         "--kv_cache_dtype, ...) apply to --backend trtllm only",
        ("--max_seq_len", 256, "--max_draft_len", 0, "--backend", "trtllm", "--use_mtp_vanilla"):
            "--use_relaxed_acceptance_for_thinking and --use_mtp_vanilla change how drafts are made or accepted; "
            "--max_draft_len 0 drafts none",
    }
    for flags, message in refused.items():
        assert error(capsys, "--model_dir", hf, "--output_dir", tmp_path / "out", *flags) == f"build_engine: error: {message}"
        assert error(capsys, "--model_dir", hf, "--dry_run", *flags) == f"build_engine: error: {message}"
    assert error(capsys, "--model_dir", hf, "--dry_run", "--force") == (
        "build_engine: error: --force replaces an existing --output_dir; --dry_run writes nothing (leave it out)")
    assert cli("--model_dir", hf, "--dry_run", "--output_dir", tmp_path / "out", "--max_seq_len", 256,
               "--device_memory_gib", 1) == 0
    assert not (tmp_path / "out").exists()


def test_error_existing_output(hf, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert error(capsys, "--model_dir", hf, "--output_dir", tmp_path / "out") == (
        f"build_engine: error: {tmp_path / 'out'}: output directory already exists; pass --force to replace it")


def test_error_draft_len(tiny_checkpoint, hf, tmp_path, capsys):
    out, cfg = tmp_path / "out", hf / "config.json"
    assert error(capsys, "--model_dir", hf, "--output_dir", out, "--max_seq_len", 256, "--max_draft_len", 9) == (
        f"build_engine: error: --max_draft_len 9 exceeds 8, the most {cfg} allows: "
        "the MTP module is re-run per draft token, up to a cap of 8")
    src = tiny_checkpoint("nomtp", tiny_config_dict(num_nextn_predict_layers=0))
    assert error(capsys, "--model_dir", src, "--output_dir", out, "--max_seq_len", 256, "--max_draft_len", 1) == (
        f"build_engine: error: --max_draft_len 1 exceeds 0, the most {src / 'config.json'} allows: "
        "num_nextn_predict_layers is 0 (no MTP layer to draft with)")
    assert error(capsys, "--model_dir", hf, "--output_dir", out, "--max_seq_len", 256, "--backend", "trtllm",
                 "--use_mtp_vanilla", "--max_draft_len", 2) == (
        f"build_engine: error: --max_draft_len 2 exceeds 1, the most {cfg} allows: "
        "TensorRT-LLM's vanilla MTP drafts one token per MTP layer (num_nextn_predict_layers 1)")
    assert error(capsys, "--model_dir", hf, "--output_dir", out, "--max_seq_len", 512) == (
        f"build_engine: error: --max_seq_len 512 exceeds max_position_embeddings (256) of {cfg}")
    assert cli("--model_dir", src, "--output_dir", out, "--max_seq_len", 256) == 0  # default k is 0 without MTP
    assert load_engine(out).build.max_draft_len == 0


def test_default_max_seq_len_is_what_the_checkpoint_is_served_with(hf, tmp_path, capsys):
    """Without --max_seq_len the build took 1024 and refused every model with max_position_embeddings below it
    ("--max_seq_len 1024 exceeds max_position_embeddings (256)") for a flag the user never gave. The default is now
    the one a plain checkpoint is served with: min(max_position_embeddings, 4096)."""
    assert cli("--model_dir", hf, "--output_dir", tmp_path / "native") == 0
    assert load_engine(tmp_path / "native").build.max_seq_len == 256 == checkpoint_limits(HFCheckpoint(hf)).max_seq_len
    assert cli("--model_dir", hf, "--output_dir", tmp_path / "trt", "--backend", "trtllm") == 0
    assert yaml.safe_load((tmp_path / "trt" / "extra_llm_api_options.yaml").read_text())["max_seq_len"] == 256
    b = BuildConfig(**LIMITS, quant_algo="FP8")
    convert_checkpoint(hf, tmp_path / "ckpt", b, progress=False)
    assert cli("--checkpoint_dir", tmp_path / "ckpt", "--output_dir", tmp_path / "e", "--tokenizer_dir", hf) == 0
    assert load_engine(tmp_path / "e").build.max_seq_len == 256
    capsys.readouterr()
    assert cli("--model_dir", hf, "--dry_run", "--device_memory_gib", 1) == 0
    assert "sequences of --max_seq_len 256)" in capsys.readouterr().out
    v3 = ModelConfig.from_json(ROOT / "tests" / "data" / "hf_configs" / "deepseek-v3.json")
    assert default_max_seq_len(v3) == 4096  # max_position_embeddings 163840, capped as a served checkpoint is


def test_checkpoint_declaring_mtp_without_its_weights(tiny_checkpoint, tmp_path, capsys):
    """A fine-tuned model as transformers saves it (config with MTP, files without): it builds without MTP by
    default, and an explicit draft length is refused naming the reason."""
    src = tiny_checkpoint("saved", tiny_config_dict(num_nextn_predict_layers=0))
    (src / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()),
                                                  "num_nextn_predict_layers": 1}))
    out = tmp_path / "out"
    assert error(capsys, "--model_dir", src, "--output_dir", out, "--max_seq_len", 256, "--max_draft_len", 2) == (
        f"build_engine: error: --max_draft_len 2: {src} stores no MTP weights although its config.json declares MTP "
        "layers (as transformers' save_pretrained leaves a fine-tuned model), so there is nothing to draft with; build "
        "with --max_draft_len 0")
    assert cli("--model_dir", src, "--output_dir", out, "--max_seq_len", 256) == 0
    loaded = load_engine(out)
    assert loaded.build.max_draft_len == 0 and loaded.model_config.num_nextn_predict_layers == 0


def test_trtllm_checkpoint_without_max_draft_len(hf, tmp_path):
    """A speculative_decoding section without max_draft_len reads as k = 0 (it was a KeyError traceback)."""
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", BuildConfig(**LIMITS), progress=False)
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["speculative_decoding"]["max_draft_len"]
    (ckpt / "config.json").write_text(json.dumps(raw))
    assert TrtllmCheckpoint.read(ckpt).build.max_draft_len == 0


def test_tp_size_ignores_intermediate_size_without_dense_layers(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("alldense0", tiny_config_dict(first_k_dense_replace=0, intermediate_size=50))
    assert cli("--model_dir", src, "--output_dir", tmp_path / "out", "--max_seq_len", 256, "--tp_size", 4) == 0


def test_error_flags_against_checkpoint(hf, tmp_path, capsys):
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", BuildConfig(**LIMITS, tp_size=2), progress=False)
    out = tmp_path / "out"
    assert error(capsys, "--checkpoint_dir", ckpt, "--output_dir", out, "--max_seq_len", 256, "--tokenizer_dir", hf,
                 "--dtype", "bfloat16") == (
        f"build_engine: error: --dtype bfloat16 differs from the checkpoint's float32 ({ckpt / 'config.json'}); "
        "convert again or leave it out")
    assert error(capsys, "--checkpoint_dir", ckpt, "--output_dir", out, "--backend", "trtllm") == (
        "build_engine: error: --backend trtllm needs --model_dir: TensorRT-LLM's PyTorch backend loads the HF layout")
    assert error(capsys, "--model_dir", hf, "--output_dir", out, "--enable_attention_dp") == (
        "build_engine: error: the LLM API options (--enable_attention_dp, --kv_cache_dtype, ...) apply to --backend trtllm only")
    assert error(capsys, "--model_dir", hf, "--output_dir", out, "--backend", "trtllm", "--max_seq_len", 256,
                 "--quant_algo", "FP8") == (
        f"build_engine: error: --quant_algo FP8 with --backend trtllm: TensorRT-LLM loads the weights as released, "
        f"which are NO_QUANT ({hf / 'config.json'}); leave --quant_algo out")
    # flags are checked against the checkpoint before BuildConfig's own rules, which would name the mix
    assert error(capsys, "--checkpoint_dir", ckpt, "--output_dir", out, "--tokenizer_dir", hf, "--tp_size", 1) == (
        f"build_engine: error: --tp_size 1 differs from the checkpoint's 2 ({ckpt / 'config.json'}); "
        "convert again or leave it out")
    assert error(capsys, "--checkpoint_dir", ckpt, "--output_dir", out, "--tokenizer_dir", hf,
                 "--quant_algo", "FP8_BLOCK_SCALES") == (
        f"build_engine: error: --quant_algo FP8_BLOCK_SCALES differs from the checkpoint's NO_QUANT "
        f"({ckpt / 'config.json'}); convert again or leave it out")


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw["mapping"].clear() or ["tp"], "field 'mapping' must be an object, got ['tp']"),
    (lambda raw: None, "expected a JSON object"),
    (lambda raw: {**raw, "speculative_decoding": None},
     "malformed field ('NoneType' object is not subscriptable), expected a DeepSeek-V3 TensorRT-LLM checkpoint config"),
    (lambda raw: {**raw, "moe": {**raw["moe"], "shared_expert_intermediate_size": 5}},
     "field 'moe.shared_expert_intermediate_size' is 5, expected a positive multiple of moe_inter_size (16)"),
])
def test_error_malformed_trtllm_checkpoint_config(hf, tmp_path, capsys, edit, message):
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", BuildConfig(**LIMITS), progress=False)
    raw = json.loads((ckpt / "config.json").read_text())
    edited = edit(raw)
    edited = [] if edited is None else {**raw, "mapping": edited} if isinstance(edited, list) else edited
    (ckpt / "config.json").write_text(json.dumps(edited))
    assert error(capsys, "--checkpoint_dir", ckpt, "--output_dir", tmp_path / "out", "--tokenizer_dir", hf) == (
        f"build_engine: error: {ckpt / 'config.json'}: {message}")


def _set(raw: dict, field: str, value) -> dict:
    """raw with one (dotted) field set."""
    *outer, name = field.split(".")
    (raw[outer[0]] if outer else raw)[name] = value
    return raw


@pytest.mark.parametrize("field, value, expected", [
    ("moe.normalization_mode", 3, "4 (TensorRT-LLM's DEVICE_LIMITED_RENORM: the top-k weights renormalized, as "
                                  "moe.norm_topk_prob true says)"),
    ("moe.normalization_mode", 1, "4 (TensorRT-LLM's DEVICE_LIMITED_RENORM: the top-k weights renormalized, as "
                                  "moe.norm_topk_prob true says)"),
    ("topk_method", "greedy", "'noaux_tc' (moe.topk_method)"),
    ("scoring_func", "softmax", "'sigmoid' (moe.scoring_func)"),
    ("hidden_act", "gelu", "'swiglu' (DeepSeek-V3's SiLU-gated MLP)"),
    ("position_embedding_type", "rope_gptj", "'rope_gpt_neox' (DeepSeek-V3's rotary embedding)"),
    ("head_size", 64, "20 (kv_lora_rank + qk_rope_head_dim)"),
    ("logits_dtype", "float16", "'float32' (the logits computed in float32)"),
    ("use_parallel_embedding", False, "True (the embedding split across ranks)"),
    ("embedding_sharding_dim", 1, "0 (the embedding split by vocabulary rows)"),
    ("quantization.kv_cache_quant_algo", "FP8", "None (the KV cache stored unquantized)"),
    ("speculative_decoding.decoding_type", None, "'MTP' (num_nextn_predict_layers 1)"),
])
def test_error_trtllm_checkpoint_field_contradicting_the_model(hf, tmp_path, capsys, field, value, expected):
    """A field that changes the math but that the build does not read was ignored: a checkpoint whose
    moe.normalization_mode contradicts moe.norm_topk_prob, or whose hidden_act is not DeepSeek-V3's, built the
    DeepSeek-V3 math without a word. Each must be what the converter writes for the model, or is refused."""
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", BuildConfig(**LIMITS), progress=False)
    raw = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(_set(raw, field, value)))
    assert error(capsys, "--checkpoint_dir", ckpt, "--output_dir", tmp_path / "out", "--tokenizer_dir", hf) == (
        f"build_engine: error: {ckpt / 'config.json'}: field {field!r} is {value!r}, expected {expected}")


def test_trtllm_checkpoint_normalization_mode_follows_norm_topk_prob(tiny_checkpoint, tmp_path, capsys):
    """norm_topk_prob false: DEVICE_LIMITED (3) is what the converter writes and builds; 4 is refused."""
    src = tiny_checkpoint("nonorm", tiny_config_dict(norm_topk_prob=False))
    ckpt = convert_checkpoint(src, tmp_path / "ckpt", BuildConfig(**LIMITS), progress=False)
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["moe"]["normalization_mode"] == 3
    assert cli("--checkpoint_dir", ckpt, "--output_dir", tmp_path / "out", "--tokenizer_dir", src) == 0
    (ckpt / "config.json").write_text(json.dumps(_set(raw, "moe.normalization_mode", 4)))
    assert error(capsys, "--checkpoint_dir", ckpt, "--output_dir", tmp_path / "out2", "--tokenizer_dir", src) == (
        f"build_engine: error: {ckpt / 'config.json'}: field 'moe.normalization_mode' is 4, expected 3 (TensorRT-LLM's "
        "DEVICE_LIMITED: the top-k weights as scored, as moe.norm_topk_prob false says)")


def test_error_file_system_refusals(hf, tmp_path, capsys):
    """The file system's own errors (a file in the way, no permission, no space) are one clear line."""
    (tmp_path / "afile").write_text("x")
    assert error(capsys, "--model_dir", hf, "--output_dir", tmp_path / "afile" / "engine", "--max_seq_len", 256) == (
        f"build_engine: error: {tmp_path / 'afile'}: File exists; no output directory was written")
    # a dangling link counts as an existing output, before any work is done
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    assert error(capsys, "--model_dir", hf, "--output_dir", tmp_path / "link") == (
        f"build_engine: error: {tmp_path / 'link'}: output directory already exists; pass --force to replace it")


def _killed_owner(parent: Path, prefix: str, rename_aside: Path | None = None) -> None:
    """A process that makes an owned temporary (and optionally renames an output aside, as atomic_dir does
    while replacing it) and dies by SIGKILL inside it, as a build killed mid-way."""
    code = (f"import os, signal\nfrom pathlib import Path\nfrom runtime.io.atomic import owned_tempdir\n"
            f"with owned_tempdir(Path({str(parent)!r}), {prefix!r}) as tmp:\n"
            f"    (tmp / 'rank0.safetensors').write_bytes(b'x' * 1000)\n"
            + (f"    os.rename({str(rename_aside)!r}, str(tmp) + '.old')\n" if rename_aside else "")
            + "    os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT)
    assert done.returncode == -signal.SIGKILL


def test_temporaries_of_a_killed_build_are_removed(hf, tmp_path, capsys):
    """SIGKILL leaves hidden temporaries behind; the next build removes those it can prove stale (nobody holds
    their lock), leaves a build in progress alone, and only reports what it cannot prove."""
    out = tmp_path / "out"
    _killed_owner(tmp_path, ".out.tmp-")
    _killed_owner(tmp_path, ".out.ckpt-")
    killed = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(killed) == 2
    (tmp_path / ".out.tmp-abc123").mkdir()  # an older version's leftover: no lock file
    with owned_tempdir(tmp_path, ".out.tmp-") as live:  # a concurrent build's
        capsys.readouterr()
        assert cli("--model_dir", hf, "--output_dir", out, "--max_seq_len", 256) == 0
        err = capsys.readouterr().err
        assert live.is_dir()
    for leftover in killed:
        assert f"build_engine: removed {leftover}, left by a killed build" in err and not leftover.exists()
    assert (f"build_engine: {tmp_path / '.out.tmp-abc123'} was left by an interrupted build without a lock to prove "
            "it stale; delete it to free its space") in err
    assert str(live) not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.tmp-abc123", "out"]


def test_output_renamed_aside_by_a_killed_build_is_restored(hf, tmp_path, capsys):
    """Killed between moving the old output aside and moving the new one in: the old output comes back."""
    out = tmp_path / "out"
    assert cli("--model_dir", hf, "--output_dir", out, "--max_seq_len", 256) == 0
    before = (out / "engine.json").read_text()
    _killed_owner(tmp_path, ".out.tmp-", rename_aside=out)
    assert not out.exists()
    (aside,) = tmp_path.glob(".out.tmp-*.old")
    tmp = aside.with_name(aside.name.removesuffix(".old"))
    assert remove_stale(out) == [f"{out} was renamed aside to {aside.name} by a killed build; restored it",
                                 f"removed {tmp}, left by a killed build"]
    assert (out / "engine.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_error_trtllm_backend_fp8_weights_without_quantization_config(hf_fp8, tmp_path, capsys):
    src = Path(shutil.copytree(hf_fp8, tmp_path / "src"))
    raw = json.loads((src / "config.json").read_text())
    del raw["quantization_config"]
    (src / "config.json").write_text(json.dumps(raw))
    err = error(capsys, "--model_dir", src, "--output_dir", tmp_path / "out", "--backend", "trtllm", "--max_seq_len", 256)
    assert err.startswith(f"build_engine: error: {src / 'config.json'}: no 'quantization_config', but tensor ")
    assert err.endswith("is float8_e4m3fn; add the release's quantization_config (fp8, e4m3, 128x128 blocks)")
    assert not (tmp_path / "out").exists()


# ---- --backend trtllm ----------------------------------------------------------------------------
def test_trtllm_backend_files(hf_fp8, tmp_path):
    out = tmp_path / "trt"
    assert cli("--model_dir", hf_fp8, "--output_dir", out, "--backend", "trtllm", "--max_seq_len", 256,
               "--tp_size", 4, "--ep_size", 2, "--max_draft_len", 3, "--max_batch_size", 16, "--max_num_tokens", 512,
               "--kv_block_size", 32, "--enable_attention_dp", "--kv_cache_dtype", "fp8",
               "--free_gpu_memory_fraction", "0.8", "--no-enable_block_reuse", "--use_relaxed_acceptance_for_thinking",
               "--relaxed_topk", 10, "--relaxed_delta", "0.6") == 0
    opts = yaml.safe_load((out / "extra_llm_api_options.yaml").read_text())
    assert opts == {
        "dtype": "bfloat16", "tensor_parallel_size": 4, "moe_expert_parallel_size": 2, "enable_attention_dp": True,
        "max_batch_size": 16, "max_num_tokens": 512, "max_seq_len": 256,
        "kv_cache_config": {"dtype": "fp8", "free_gpu_memory_fraction": 0.8, "enable_block_reuse": False,
                            "tokens_per_block": 32},
        "cuda_graph_config": {"enable_padding": True, "max_batch_size": 16},
        "speculative_config": {"decoding_type": "MTP", "max_draft_len": 3, "num_nextn_predict_layers": 3,
                               "use_relaxed_acceptance_for_thinking": True, "relaxed_topk": 10, "relaxed_delta": 0.6},
    }
    manifest = json.loads((out / "engine.json").read_text())
    assert manifest["backend"] == "trtllm" and manifest["build"]["quant_algo"] == "FP8_BLOCK_SCALES"
    shards = sorted(p.name for p in hf_fp8.glob("model-*.safetensors"))
    assert manifest["weights"] == [f"hf/{s}" for s in shards]
    for name in shards + ["config.json", "model.safetensors.index.json", "tokenizer.json"]:
        assert (out / "hf" / name).read_bytes() == (hf_fp8 / name).read_bytes()
    assert os.stat(out / "hf" / shards[0]).st_ino == os.stat(hf_fp8 / shards[0]).st_ino  # hard link
    with safe_open(out / "hf" / shards[0], "pt") as f:
        assert any(k.endswith("weight_scale_inv") for k in f.keys())
    with pytest.raises(EngineError, match="built with --backend trtllm; run it with the TensorRT-LLM backend"):
        load_engine(out)


def test_trtllm_backend_defaults(hf, tmp_path):
    assert cli("--model_dir", hf, "--output_dir", tmp_path / "t", "--backend", "trtllm", "--max_seq_len", 256) == 0
    opts = yaml.safe_load((tmp_path / "t" / "extra_llm_api_options.yaml").read_text())
    assert opts["speculative_config"] == {"decoding_type": "MTP", "max_draft_len": 4, "num_nextn_predict_layers": 4}
    assert opts["kv_cache_config"] == {"dtype": "auto", "free_gpu_memory_fraction": 0.9, "enable_block_reuse": True,
                                       "tokens_per_block": 16}
    assert (opts["tensor_parallel_size"], opts["moe_expert_parallel_size"], opts["enable_attention_dp"]) == (1, 1, False)


def test_trtllm_backend_links_what_symlinks_point_at(hf, tmp_path):
    """A Hugging Face hub cache's snapshot holds relative symlinks (snapshots/rev/<file> -> ../../blobs/<sha>);
    hard-linking the symlink itself left hf/ with links that point nowhere. An index naming shards in a
    subdirectory keeps it (the loaders read sub/<shard>); trtllm dropped the directory."""
    snapshot = tmp_path / "hub" / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (tmp_path / "hub" / "blobs").mkdir()
    for i, f in enumerate(sorted(hf.iterdir())):
        shutil.copy(f, tmp_path / "hub" / "blobs" / str(i))
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", str(i)))
    out = tmp_path / "from_hub"
    assert cli("--model_dir", snapshot, "--output_dir", out, "--backend", "trtllm", "--max_seq_len", 256) == 0
    for name in ["config.json", "model.safetensors.index.json"] + sorted(p.name for p in hf.glob("*.safetensors")):
        assert not (out / "hf" / name).is_symlink() and (out / "hf" / name).read_bytes() == (hf / name).read_bytes()
    nested = tmp_path / "nested"
    shutil.copytree(hf, nested)
    (nested / "sub").mkdir()
    index = json.loads((nested / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        (nested / shard).rename(nested / "sub" / shard)
    index["weight_map"] = {name: f"sub/{shard}" for name, shard in index["weight_map"].items()}
    (nested / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "from_nested"
    assert cli("--model_dir", nested, "--output_dir", out, "--backend", "trtllm", "--max_seq_len", 256) == 0
    shards = sorted(set(index["weight_map"].values()))
    assert json.loads((out / "engine.json").read_text())["weights"] == [f"hf/{s}" for s in shards]
    assert HFCheckpoint(out / "hf").weight_map == index["weight_map"]


def test_trtllm_checkpoint_reads_back(hf, tmp_path):
    b = BuildConfig(**LIMITS, tp_size=2, ep_size=2, quant_algo="FP8", dtype="bfloat16", max_draft_len=2)
    ckpt = TrtllmCheckpoint.read(convert_checkpoint(hf, tmp_path / "ckpt", b, progress=False))
    assert ckpt.build == BuildConfig(tp_size=2, ep_size=2, quant_algo="FP8", dtype="bfloat16", max_draft_len=2)
    with pytest.raises(BuildError, match="max_seq_len 512 exceeds"):
        build_engine(ckpt.path, tmp_path / "e", BuildConfig(max_seq_len=512, tp_size=2, ep_size=2, quant_algo="FP8",
                                                            dtype="bfloat16"), tokenizer_dir=hf, progress=False)


def test_limits_the_memory_cannot_hold_are_named_at_build(hf, tmp_path, capsys):
    """max_batch_size 100000000 built silently and died at load; the build now says what the limits ask of memory
    against this machine's, naming the flags (warnings: the build machine need not be the serving one)."""
    assert cli("--model_dir", hf, "--output_dir", tmp_path / "out", "--max_seq_len", 256,
               "--max_batch_size", 10**8) == 0
    err = capsys.readouterr().err
    assert "build_engine: note: --max_batch_size 100000000 sequences of --max_seq_len 256 need " in err
    assert "GiB of KV cache; the runtime sizes its cache to free memory, so here at most " in err
    v3 = ModelConfig.from_json(Path(__file__).parent / "data" / "hf_configs" / "deepseek-v3.json")
    notes = validation.memory_notes(v3, BuildConfig(max_seq_len=163840, quant_algo="FP8_BLOCK_SCALES"))
    assert len(notes) == 1 and notes[0].startswith("warning: --max_seq_len 163840: a rank's weights (")
    assert notes[0].endswith("GiB; the engine will not load here")
    weights = float(notes[0].split("weights (")[1].split(" GiB")[0])
    assert 600 < weights < 700  # DeepSeek-V3's 671B parameters, mostly FP8, plus its MTP layer


RELEASE_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                        "weight_block_size": [128, 128]}


def test_a_bf16_copy_with_the_releases_fp8_config_is_built_as_stored(hf, tmp_path, caplog, capsys):
    """A BF16 copy of an FP8 release that kept the release's config.json (DeepSeek's fp8_cast_bf16.py output): the
    session read the weights as stored and build_engine quantized them to FP8 without a word. Both read them as
    stored now, and say why."""
    src = tmp_path / "bf16"
    shutil.copytree(hf, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": RELEASE_QUANTIZATION}))
    with caplog.at_level(logging.WARNING, logger="runtime.io.checkpoint"):
        assert checkpoint_limits(HFCheckpoint(src)).quant_algo is None  # what a session on the directory serves
    assert f"{src / 'config.json'}: field 'quantization_config' declares FP8 weights but the files store none" in (
        caplog.text)
    assert cli("--model_dir", src, "--output_dir", tmp_path / "engine", "--max_seq_len", 256) == 0
    assert load_engine(tmp_path / "engine").build.quant_algo is None
    (want, want_mtp), (got, got_mtp) = outputs(hf), outputs(tmp_path / "engine")
    assert (got - want).abs().max() <= 1e-5 and (got_mtp - want_mtp).abs().max() <= 1e-5
    # TensorRT-LLM reads config.json's quantization_config itself: refused, naming it
    capsys.readouterr()
    assert cli("--model_dir", src, "--output_dir", tmp_path / "trt", "--max_seq_len", 256, "--backend", "trtllm") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"build_engine: error: {src / 'config.json'}: field 'quantization_config' declares FP8 weights but the files "
        "store none; remove it from config.json (TensorRT-LLM would load the weights as FP8)")


def test_wide_weights_of_an_fp8_checkpoint_are_named_when_the_engine_quantizes_them(hf_fp8, tmp_path, capsys):
    """An FP8 checkpoint keeping one linear weight wide (as `modules_to_not_convert` lists it): an FP8 engine stores
    every linear weight in FP8 blocks, so build_engine says which ones it quantized."""
    src = tmp_path / "mixed"
    shutil.copytree(hf_fp8, src)
    ckpt = HFCheckpoint(src)
    name, kept = "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight"
    index = json.loads((src / "model.safetensors.index.json").read_text())
    dequantized = {wide: ckpt.get(wide) for wide in (name, kept)}  # an FP8 engine keeps kv_b_proj wide: not named
    for wide, tensor in dequantized.items():
        shard = src / ckpt.weight_map[wide]
        tensors = load_file(shard)
        tensors[wide] = tensor
        del tensors[wide + "_scale_inv"]
        save_file(tensors, shard)
        del index["weight_map"][wide + "_scale_inv"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert sorted(HFCheckpoint(src).wide_weights) == [kept, name]
    capsys.readouterr()
    assert cli("--model_dir", src, "--output_dir", tmp_path / "engine", "--max_seq_len", 256) == 0
    assert (f"build_engine: 1 weight(s) of {src} stored wider than FP8 ({name}) are quantized to FP8 blocks, as an "
            "FP8 engine stores them (the session on the checkpoint reads them as stored); --quant_algo NO_QUANT keeps "
            "every weight unquantized") in capsys.readouterr().err
    assert load_engine(tmp_path / "engine").build.quant_algo == "FP8_BLOCK_SCALES"


def test_every_option_says_its_default_in_help() -> None:
    """As vLLM's and trtllm-serve's --help: an option with a default shows it (build_engine's limits showed none)."""
    import argparse

    from builder.cli import parser
    from runtime.cli import show_defaults

    p = show_defaults(parser())
    shown = [a for a in p._actions if a.option_strings and a.default not in (None, False, argparse.SUPPRESS, "")]
    assert shown and all("default" in (a.help or "") for a in shown), [a.dest for a in shown if "default" not in a.help]
    assert "default: 2048" in p.format_help()  # --max_num_tokens


def test_the_trtllm_builder_imports_no_executor_or_model_core() -> None:
    """builder/ imports runtime's format and I/O, never its executors or core (torch's scheduler, the draft policy):
    TrtllmOptions' defaults come from runtime.io.engine_format, and are the executor's and relaxed acceptance's own."""
    from builder.trtllm_engine import TrtllmOptions
    from runtime.core.sampling_params import RelaxedAcceptance
    from runtime.executors.base import ExecutorConfig

    code = ("import sys, builder.trtllm_engine\n"
            "print(sorted(m for m in sys.modules if m.startswith(('runtime.executors', 'runtime.core'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    options = TrtllmOptions()
    assert options.free_gpu_memory_fraction == ExecutorConfig.free_memory_fraction
    assert (options.relaxed_topk, options.relaxed_delta) == (RelaxedAcceptance.top_n, RelaxedAcceptance.delta)
