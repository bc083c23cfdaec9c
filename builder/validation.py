"""What a build checks before it does any work: the options against the model (sharding, limits, memory) and the
tokenizer files. (Where its output goes: runtime.io.atomic.)"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.io.checkpoint import HFCheckpoint
from runtime.io.engine_format import BuildConfig, EngineError, check_model_limits
from runtime.io.tokenizer import TOKENIZER_FILES, Tokenizer
from runtime.model.config import ModelConfig
from builder.trtllm_layout import rank_layout


class BuildError(ValueError):
    """Inputs or options a build cannot proceed with; the message names the file or flag."""


NO_QUANT = "NO_QUANT"  # --quant_algo's spelling of "not quantized" (quant_algo None)


def quant_algo_flag(quant_algo: str | None) -> str:
    """A quant_algo as --quant_algo spells it."""
    return NO_QUANT if quant_algo is None else quant_algo


def quant_algo_of_flag(flag: str) -> str | None:
    """--quant_algo's value as BuildConfig takes it (quant_algo_flag's inverse)."""
    return None if flag == NO_QUANT else flag


# ---- validation shared by convert, engine and trtllm builds -----------------------------------
def validate_build(cfg: ModelConfig, build: BuildConfig, source: str, use_mtp_vanilla: bool = False) -> None:
    """Check the build options against the model before any work is done."""
    validate_sharding(cfg, build, source)
    try:
        check_model_limits(cfg, build, source, flag="--", use_mtp_vanilla=use_mtp_vanilla)
    except EngineError as e:
        raise BuildError(str(e)) from None


@dataclass(frozen=True)
class Plan:
    """What serving an engine of a build asks of each rank, from the model config alone."""

    rank_weight_bytes: int  # one rank file's tensors as stored (FP8 codes and scales, BF16, float32)
    kv_bytes_per_token: int  # on every rank: the latent cache is replicated (runtime.model.deepseek_v3)

    def tokens_fit(self, memory_bytes: int, fraction: float) -> int:
        """KV cache tokens a rank holds in `fraction` of `memory_bytes` of device memory, after its weights."""
        return max(0, int(memory_bytes * fraction) - self.rank_weight_bytes) // self.kv_bytes_per_token


def plan(cfg: ModelConfig, build: BuildConfig) -> Plan:
    weights = sum(math.prod(t.shape) * t.dtype.itemsize + (math.prod(t.scale_shape) * 4 if t.scale_shape else 0)
                  for t in rank_layout(cfg, build))
    return Plan(weights, cfg.kv_bytes_per_token(build.torch_dtype.itemsize))


def machine_memory() -> int:
    """This machine's RAM, or its largest GPU's memory if larger."""
    return max([os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")] +
               [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())])


def plan_text(cfg: ModelConfig, build: BuildConfig, source: str, memory_bytes: int, fraction: float) -> str:
    """`build_engine --dry_run`'s report: per-rank weights, KV bytes per token, tokens that fit."""
    p, gib = plan(cfg, build), 2**30
    tokens = p.tokens_fit(memory_bytes, fraction)
    return "\n".join([
        f"plan for {source}: tp_size {build.tp_size}, ep_size {build.ep_size} (moe_tp_size {build.moe_tp_size} x "
        f"moe_ep_size {build.ep_size}), quant_algo {build.quant_algo}, dtype {build.dtype}",
        f"weights per rank: {p.rank_weight_bytes / gib:.2f} GiB ({p.rank_weight_bytes} bytes); all {build.tp_size} "
        f"ranks: {p.rank_weight_bytes * build.tp_size / gib:.2f} GiB",
        f"KV cache per token, on every rank (the latent is replicated): {p.kv_bytes_per_token} bytes "
        f"({cfg.latent_dim} values x {cfg.num_cache_layers} layers x {build.torch_dtype.itemsize} bytes)",
        f"per rank in {fraction} of {memory_bytes / gib:.1f} GiB: {tokens} tokens of KV cache "
        f"({tokens // build.max_seq_len} sequences of --max_seq_len {build.max_seq_len})",
    ])


def memory_notes(cfg: ModelConfig, build: BuildConfig) -> list[str]:
    """What the limits ask of memory, against this machine's (`machine_memory`): a rank's weights plus the KV
    cache of one max_seq_len sequence must fit where the engine is served, and max_batch_size such sequences
    are held only where memory allows (the runtime sizes its cache to free memory). The build machine need
    not be the serving one, so these are warnings, naming the flags."""
    p = plan(cfg, build)
    weights, one = p.rank_weight_bytes, build.max_seq_len * p.kv_bytes_per_token
    machine = machine_memory()
    gib = 2**30
    notes = []
    if weights + one > machine:
        notes.append(f"warning: --max_seq_len {build.max_seq_len}: a rank's weights ({weights / gib:.1f} GiB) and the "
                     f"KV cache of one such sequence ({one / gib:.1f} GiB) exceed this machine's {machine / gib:.1f} "
                     "GiB; the engine will not load here")
    elif weights + build.max_batch_size * one > machine:
        fits = (machine - weights) // one
        notes.append(f"note: --max_batch_size {build.max_batch_size} sequences of --max_seq_len {build.max_seq_len} "
                     f"need {build.max_batch_size * one / gib:.1f} GiB of KV cache; the runtime sizes its cache to "
                     f"free memory, so here at most {fits} such sequences run at once")
    return notes


def validate_sharding(cfg: ModelConfig, build: BuildConfig, source: str) -> None:
    """tp_size and ep_size must split heads, MLP widths and experts evenly (the vocabulary is padded)."""
    dense = any(not cfg.is_moe_layer(i) for i in range(cfg.num_cache_layers))
    divides = [
        ("--tp_size", build.tp_size, "num_attention_heads", cfg.num_attention_heads),
        *([("--tp_size", build.tp_size, "intermediate_size", cfg.intermediate_size)] if dense else []),
        ("--tp_size", build.tp_size, "n_shared_experts * moe_intermediate_size", cfg.n_shared_experts * cfg.moe_intermediate_size),
        ("--ep_size", build.ep_size, "n_routed_experts", cfg.n_routed_experts),
        ("--tp_size / --ep_size", build.moe_tp_size, "moe_intermediate_size", cfg.moe_intermediate_size),
    ]
    for flag, value, field, total in divides:
        if total % value:
            raise BuildError(f"{flag} {value} does not divide {field} ({total}) of {source}")


def check_tokenizer(src: Path, vocab_size: int | None = None) -> list[str]:
    """The tokenizer files present in src; tokenizer.json is required, the JSON ones must be JSON, and (given the
    model's vocab_size) no token id may be past the model's vocabulary: every request using one would be refused."""
    tok = Path(src) / "tokenizer.json"
    if tok.exists() and not tok.is_file():
        raise BuildError(f"{tok}: not a file, expected the tokenizer's tokenizer.json")
    if not tok.is_file():
        raise BuildError(f"{tok}: tokenizer file not found, expected tokenizer.json next to the weights (or --tokenizer_dir)")
    present = [name for name in TOKENIZER_FILES if (Path(src) / name).is_file()]
    for name in (n for n in present if n.endswith(".json")):
        try:
            json.loads((Path(src) / name).read_text())
        except (ValueError, RecursionError) as e:
            raise BuildError(f"{Path(src) / name}: not valid JSON ({e})") from None
    try:  # as the runtime loads it, so that no engine is built that the runtime refuses to load
        tokenizer = Tokenizer.from_dir(src)
    except (OSError, ValueError) as e:
        raise BuildError(str(e)) from None
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise BuildError(f"{tok}: its token ids reach {tokenizer.vocab_size - 1}, past the model's vocab_size "
                         f"{vocab_size}; use the model's own tokenizer")
    return present


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer files (after `check_tokenizer`); returns their names."""
    names = check_tokenizer(src)
    for name in names:
        shutil.copy2(Path(src) / name, dst / name)
    return names


def open_hf_checkpoint(model: str | Path | HFCheckpoint, build: BuildConfig) -> tuple[HFCheckpoint, ModelConfig]:
    """Open an HF checkpoint (unless given open: its shards' headers are read once) and validate it (headers only)
    against the build options."""
    ckpt = model if isinstance(model, HFCheckpoint) else HFCheckpoint(model)
    cfg = ckpt.config
    ckpt.validate()
    validate_sharding(cfg, build, str(ckpt.path / "config.json"))
    return ckpt, cfg
