"""HF DeepSeek-V3 checkpoint -> TensorRT-LLM checkpoint directory, streamed tensor by tensor.

The target is what TensorRT-LLM's DeepSeek-V2 converter writes (config.json plus one
`rank{N}.safetensors` per rank, `transformer.*` names, fused `attention.fused_a` and expert `mlp.fc`),
extended with the MTP module as a draft layer under `transformer.mtp_layers.{j}.`.

Memory: a rank file's header (every name, dtype, shape and offset) follows from the config and
the build options alone, so `RankFileWriter` writes it first and then drops each tensor's bytes at
its offset as the tensor streams by. No rank's tensors are ever accumulated; the process holds
the source shard being read (memory-mapped) plus one tensor and its shards. docs/engine-format.md
has the names, the sharding rules and the measured peak memory.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from runtime.io.atomic import atomic_dir
from runtime.io.checkpoint import FP8_CODE, SCALE_SUFFIX, HFCheckpoint
from runtime.io.tokenizer import TOKENIZER_FILES
from runtime.model.config import ModelConfig
from runtime.io.engine_format import BuildConfig, EngineError, check_model_limits, shard_index, shard_shape
from runtime.model.fp8 import BLOCK, FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8, quantize_tensor_fp8, scale_shape
from runtime.io.weights import parameter_shapes, to_internal

MTP_PREFIX = "transformer.mtp_layers"
TRT_SCALE = "weights_scaling_factor"  # `<module>.weights_scaling_factor` next to `<module>.weight`
# Linear weights the FP8 algorithms quantize (runtime names). kv_b_proj stays unquantized, as
# upstream: absorbed MLA splits it per head. eh_proj, the router, embeddings and heads are not listed.
QUANTIZED = ("q_a_proj.weight", "q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight", "o_proj.weight",
             "gate_proj.weight", "up_proj.weight", "down_proj.weight",
             "experts.gate_proj", "experts.up_proj", "experts.down_proj")
EXCLUDE_MODULES = ["*kv_b_proj*", "*eh_proj*", "*router*", "*shared_head*", "lm_head"]
FLOAT32 = ("mlp.gate.weight", "e_score_correction_bias")  # the router runs in fp32
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", FP8_DTYPE: "F8_E4M3"}


class BuildError(ValueError):
    """Inputs or options a build cannot proceed with; the message names the file or flag."""


NO_QUANT = "NO_QUANT"  # --quant_algo's spelling of "not quantized" (quant_algo None)


def quant_algo_flag(quant_algo: str | None) -> str:
    """A quant_algo as --quant_algo spells it."""
    return NO_QUANT if quant_algo is None else quant_algo


# ---- validation shared by convert, engine and trtllm builds -----------------------------------
def validate_build(cfg: ModelConfig, build: BuildConfig, source: str, use_mtp_vanilla: bool = False) -> None:
    """Check the build options against the model before any work is done."""
    validate_sharding(cfg, build, source)
    try:
        check_model_limits(cfg, build, source, flag="--", use_mtp_vanilla=use_mtp_vanilla)
    except EngineError as e:
        raise BuildError(str(e)) from None


def memory_notes(cfg: ModelConfig, build: BuildConfig) -> list[str]:
    """What the limits ask of memory, against this machine's (its RAM, or its largest GPU's memory if larger):
    a rank's weights plus the KV cache of one max_seq_len sequence must fit where the engine is served, and
    max_batch_size such sequences are held only where memory allows (the runtime sizes its cache to free
    memory). The build machine need not be the serving one, so these are warnings, naming the flags."""
    weights = sum(math.prod(t.shape) * t.dtype.itemsize + (math.prod(t.scale_shape) * 4 if t.scale_shape else 0)
                  for t in rank_layout(cfg, build))
    per_token = cfg.latent_dim * build.torch_dtype.itemsize * cfg.num_cache_layers
    one = build.max_seq_len * per_token
    machine = max([os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")] +
                  [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())])
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


# ---- names ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrtTensor:
    """One TensorRT-LLM weight and the runtime parameters it holds, concatenated along dim -2."""

    name: str
    parts: tuple[str, ...]

    @property
    def scale_name(self) -> str:
        return self.name.removesuffix("weight") + TRT_SCALE


def trtllm_tensors(cfg: ModelConfig) -> list[TrtTensor]:
    """Every TensorRT-LLM weight of the model, MTP draft layers last."""
    out = [TrtTensor("transformer.vocab_embedding.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.num_hidden_layers):
        out += _layer_tensors(cfg, i, f"model.layers.{i}.", f"transformer.layers.{i}.")
    out += [TrtTensor("transformer.ln_f.weight", ("model.norm.weight",)), TrtTensor("lm_head.weight", ("lm_head.weight",))]
    for j in range(cfg.num_nextn_predict_layers):
        src, dst = f"mtp.{j}.", f"{MTP_PREFIX}.{j}."
        out += [TrtTensor(dst + "vocab_embedding.weight", (src + "embed_tokens.weight",))]
        out += [TrtTensor(dst + n, (src + n,)) for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight")]
        out += _layer_tensors(cfg, cfg.num_hidden_layers + j, src + "block.", dst)
        out += [TrtTensor(dst + "shared_head_norm.weight", (src + "shared_head.norm.weight",)),
                TrtTensor(dst + "shared_head.weight", (src + "shared_head.head.weight",))]
    return out


def _layer_tensors(cfg: ModelConfig, layer: int, src: str, dst: str) -> list[TrtTensor]:
    a, m = src + "self_attn.", src + "mlp."
    pairs: list[tuple[str, tuple[str, ...]]] = [("input_layernorm.weight", (src + "input_layernorm.weight",))]
    if cfg.q_lora_rank is None:
        pairs += [("attention.fused_a.weight", (a + "kv_a_proj_with_mqa.weight",)),
                  ("attention.q_proj.weight", (a + "q_proj.weight",))]
    else:
        pairs += [("attention.fused_a.weight", (a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight")),
                  ("attention.q_a_layernorm.weight", (a + "q_a_layernorm.weight",)),
                  ("attention.q_b_proj.weight", (a + "q_b_proj.weight",))]
    pairs += [("attention.kv_a_layernorm.weight", (a + "kv_a_layernorm.weight",)),
              ("attention.kv_b_proj.weight", (a + "kv_b_proj.weight",)),
              ("attention.dense.weight", (a + "o_proj.weight",)),
              ("post_layernorm.weight", (src + "post_attention_layernorm.weight",))]
    if cfg.is_moe_layer(layer):
        pairs += [("mlp.router.weight", (m + "gate.weight",)),
                  ("mlp.e_score_correction_bias", (m + "gate.e_score_correction_bias",)),
                  ("mlp.fc.weight", (m + "experts.up_proj", m + "experts.gate_proj")),
                  ("mlp.proj.weight", (m + "experts.down_proj",))]
        if cfg.n_shared_experts:
            s = m + "shared_experts."
            pairs += [("mlp.shared_expert.fc.weight", (s + "up_proj.weight", s + "gate_proj.weight")),
                      ("mlp.shared_expert.proj.weight", (s + "down_proj.weight",))]
    else:
        pairs += [("mlp.fc.weight", (m + "gate_proj.weight",)), ("mlp.gate.weight", (m + "up_proj.weight",)),
                  ("mlp.proj.weight", (m + "down_proj.weight",))]
    return [TrtTensor(dst + name, parts) for name, parts in pairs]


def is_quantized(name: str, quant_algo: str | None) -> bool:
    return quant_algo is not None and name.endswith(QUANTIZED)


def stored_dtype(name: str, build: BuildConfig) -> torch.dtype:
    if is_quantized(name, build.quant_algo):
        return FP8_DTYPE
    return torch.float32 if name.endswith(FLOAT32) else build.torch_dtype


# ---- the layout of one rank ----------------------------------------------------------------------
@dataclass(frozen=True)
class PartLayout:
    """Where one runtime parameter's shard sits inside a (possibly fused) rank tensor."""

    name: str
    shape: tuple[int, ...]  # this rank's shard, lead dims (local experts) first
    row: int  # first row (dim -2) of the part in the fused tensor
    scale_shape: tuple[int, ...] | None  # None: not quantized
    scale_row: int  # first row of its block grid, or its index among the parts (per-tensor FP8)


@dataclass(frozen=True)
class TensorLayout:
    tensor: TrtTensor
    dtype: torch.dtype
    shape: tuple[int, ...]
    scale_shape: tuple[int, ...] | None
    parts: tuple[PartLayout, ...]


def rank_layout(cfg: ModelConfig, build: BuildConfig) -> list[TensorLayout]:
    """Names, dtypes and shapes of every tensor of a rank file; the same for every rank."""
    shapes = parameter_shapes(cfg)
    block = build.quant_algo == "FP8_BLOCK_SCALES"
    out = []
    for tt in trtllm_tensors(cfg):
        parts, row, scale_row = [], 0, 0
        for i, name in enumerate(tt.parts):
            shape = shard_shape(name, shapes[name], build)
            sshape = _scale_shape(shape, build.quant_algo) if is_quantized(name, build.quant_algo) else None
            parts.append(PartLayout(name, shape, row, sshape, scale_row if block else i))
            if len(shape) > 1:  # fused parts stack along dim -2, and so do their block grids
                row += shape[-2]
                scale_row += sshape[-2] if block and sshape is not None else 0
        first = parts[0]
        shape = first.shape if len(parts) == 1 else (*first.shape[:-2], row, first.shape[-1])
        sshape = None
        if first.scale_shape is not None:
            lead = first.shape[:-2]
            sshape = (*lead, scale_row, first.scale_shape[-1]) if block else (*lead, len(parts))
        out.append(TensorLayout(tt, stored_dtype(first.name, build), shape, sshape, tuple(parts)))
    return out


def _scale_shape(shape: tuple[int, ...], quant_algo: str) -> tuple[int, ...]:
    """Block FP8: one scale per 128x128 block (per expert); per-tensor FP8: one per weight (per expert)."""
    if quant_algo == "FP8_BLOCK_SCALES":
        return (*shape[:-2], *scale_shape(shape[-2:]))
    return tuple(shape[:-2])


# ---- streaming safetensors writer ----------------------------------------------------------------
class RankFileWriter:
    """A safetensors file laid out up front: the header is written when the file is opened, and
    `write` fills each tensor's bytes, in any order and in pieces, without holding them."""

    def __init__(self, path: Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        self.path, self.specs = path, specs
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        self._offsets: dict[str, int] = {}
        end = 0
        for name, (dtype, shape) in specs.items():
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [end, end + nbytes]}
            self._offsets[name] = end
            end += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._data_start = 8 + len(raw)
        self._written = dict.fromkeys(specs, 0)
        self._file = open(path, "wb")
        self._file.write(len(raw).to_bytes(8, "little") + raw)
        self._file.truncate(self._data_start + end)

    def write(self, name: str, tensor: Tensor, offset: int = 0) -> None:
        """Write `tensor` as elements offset.. of `name` (row-major)."""
        dtype, shape = self.specs[name]
        if tensor.dtype != dtype or offset + tensor.numel() > math.prod(shape):
            raise BuildError(
                f"{self.path}: tensor {name!r} piece of {tensor.dtype} x {tensor.numel()} at {offset} does not fit "
                f"{dtype} {list(shape)}"
            )
        self._file.seek(self._data_start + self._offsets[name] + offset * dtype.itemsize)
        self._file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._written[name] += tensor.numel()

    def __enter__(self) -> "RankFileWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close the file; after a clean exit, every tensor must have been written exactly once."""
        self._file.close()
        if exc_type is None:
            for name, (_, shape) in self.specs.items():
                if self._written[name] != math.prod(shape):
                    raise BuildError(f"{self.path}: tensor {name!r} got {self._written[name]} of {math.prod(shape)} elements")


def check_output_dir(out_dir: Path, force: bool) -> None:
    if (Path(out_dir).exists() or Path(out_dir).is_symlink()) and not force:  # a dangling link too
        raise BuildError(f"{out_dir}: output directory already exists; pass --force to replace it")


@contextlib.contextmanager
def build_output(out_dir: Path, force: bool) -> Iterator[Path]:
    """A build's output, made atomically (runtime.io.atomic) once out_dir is known to be free or forced."""
    check_output_dir(out_dir, force)
    try:
        with atomic_dir(out_dir, force) as tmp:
            yield tmp
    except FileExistsError as e:
        raise BuildError(str(e)) from None


def check_tokenizer(src: Path) -> list[str]:
    """The tokenizer files present in src; tokenizer.json is required, and each must be JSON."""
    tok = Path(src) / "tokenizer.json"
    if tok.exists() and not tok.is_file():
        raise BuildError(f"{tok}: not a file, expected the tokenizer's tokenizer.json")
    if not tok.is_file():
        raise BuildError(f"{tok}: tokenizer file not found, expected tokenizer.json next to the weights (or --tokenizer_dir)")
    present = [name for name in TOKENIZER_FILES if (Path(src) / name).is_file()]
    for name in present:
        try:
            json.loads((Path(src) / name).read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise BuildError(f"{Path(src) / name}: not valid JSON ({e})") from None
    return present


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer files (after `check_tokenizer`); returns their names."""
    names = check_tokenizer(src)
    for name in names:
        shutil.copy2(Path(src) / name, dst / name)
    return names


# ---- the converter -------------------------------------------------------------------------------
def trtllm_config(cfg: ModelConfig, build: BuildConfig) -> dict[str, Any]:
    """config.json of the TensorRT-LLM checkpoint (DeepSeek-V2 converter field names)."""
    rs = cfg.rope_scaling
    return {
        "architecture": "DeepseekV3ForCausalLM",
        "dtype": build.dtype,
        "logits_dtype": "float32",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads or cfg.num_attention_heads,
        "head_size": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
        "hidden_act": "swiglu",
        "intermediate_size": cfg.intermediate_size,
        "norm_epsilon": cfg.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": cfg.max_position_embeddings,
        "use_parallel_embedding": True,
        "embedding_sharding_dim": 0,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": cfg.moe_layer_freq,
        "moe_inter_size": cfg.moe_intermediate_size,
        "topk_method": cfg.topk_method,
        "scoring_func": cfg.scoring_func,
        "rotary_base": cfg.rope_theta,
        "rotary_scaling": None if rs is None else {
            "type": rs.type, "factor": rs.factor, "original_max_position_embeddings": rs.original_max_position_embeddings,
            "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow, "mscale": rs.mscale, "mscale_all_dim": rs.mscale_all_dim,
        },
        "moe": {
            "num_experts": cfg.n_routed_experts,
            "top_k": cfg.num_experts_per_tok,
            "shared_expert_intermediate_size": cfg.n_shared_experts * cfg.moe_intermediate_size,
            "normalization_mode": 4 if cfg.norm_topk_prob else 3,  # DEVICE_LIMITED_RENORM / DEVICE_LIMITED
            "norm_topk_prob": cfg.norm_topk_prob,
            "device_limited_n_group": cfg.n_group,
            "device_limited_topk_group": cfg.topk_group,
            "device_limited_routed_scaling_factor": cfg.routed_scaling_factor,
            "topk_method": cfg.topk_method,
            "scoring_func": cfg.scoring_func,
        },
        "mapping": {"world_size": build.tp_size, "tp_size": build.tp_size, "pp_size": 1,
                    "moe_tp_size": build.moe_tp_size, "moe_ep_size": build.ep_size},
        "quantization": {
            "quant_algo": build.quant_algo,
            "kv_cache_quant_algo": None,
            "group_size": BLOCK[1],
            "exclude_modules": EXCLUDE_MODULES if build.quant_algo else None,
        },
        "speculative_decoding": {
            "decoding_type": "MTP" if cfg.num_nextn_predict_layers else None,
            "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
            "max_draft_len": build.max_draft_len,
            "draft_layer_prefix": MTP_PREFIX + ".",
        },
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }


def convert_checkpoint(model_dir: str | Path, output_dir: str | Path, build: BuildConfig, *,
                       force: bool = False, progress: bool = True) -> Path:
    """Write the TensorRT-LLM checkpoint of the HF checkpoint in model_dir; return output_dir."""
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    ckpt, cfg = open_hf_checkpoint(model_dir, build)
    layout = rank_layout(cfg, build)
    where = {p.name: (t, p) for t in layout for p in t.parts}
    shapes = parameter_shapes(cfg)
    names = [n for n in ckpt.tensor_names if not n.endswith(SCALE_SUFFIX)]
    split = blocks_split(ckpt, cfg, build, where, shapes)
    if split:
        print(f"note: tp_size {build.tp_size} cuts through the 128x128 FP8 blocks of {len(split)} "
              f"tensors (e.g. {split[0]}); their rank pieces are quantized again on their own grid, so the "
              "engine is close to, not bit-identical with, the release (docs/engine-format.md)", file=sys.stderr)
    with build_output(output_dir, force) as tmp:
        (tmp / "config.json").write_text(json.dumps(trtllm_config(cfg, build), indent=2) + "\n")
        specs = {}
        for t in layout:
            specs[t.tensor.name] = (t.dtype, t.shape)
            if t.scale_shape is not None:
                specs[t.tensor.scale_name] = (torch.float32, t.scale_shape)
        with contextlib.ExitStack() as stack:
            writers = [stack.enter_context(RankFileWriter(tmp / f"rank{r}.safetensors", specs))
                       for r in range(build.tp_size)]
            bar = stack.enter_context(tqdm(total=len(names), desc="convert", unit="tensor", disable=not progress))
            for name, tensor, scale in ckpt.iter_weights():
                source = _Source(tensor, scale)
                internal, expert = to_internal(name, cfg)
                if internal not in where:
                    raise BuildError(f"{ckpt.path}: unexpected tensor {name!r}, not part of a DeepSeek-V3 model with this config.json")
                tensor, part = where[internal]
                for rank, writer in enumerate(writers):
                    _write_shard(writer, tensor, part, source, shapes[internal], expert, build, rank)
                del source, tensor, scale  # before the next tensor is read
                bar.update()
        if (model_dir / "tokenizer.json").is_file():
            copy_tokenizer(model_dir, tmp)
    return output_dir


def open_hf_checkpoint(model_dir: Path, build: BuildConfig) -> tuple[HFCheckpoint, ModelConfig]:
    """Open and validate (headers only) an HF checkpoint against the build options."""
    ckpt = HFCheckpoint(model_dir)
    cfg = ckpt.config
    if ckpt.quantized and tuple(ckpt.block) != BLOCK:
        raise BuildError(
            f"{model_dir / 'config.json'}: unsupported quantization: weight_block_size {list(ckpt.block)}, "
            f"expected {list(BLOCK)} (FP8_BLOCK_SCALES)"
        )
    ckpt.validate()
    validate_sharding(cfg, build, str(model_dir / "config.json"))
    return ckpt, cfg


class _Source:
    """One logical tensor as read: plain, or FP8 with its block scale; derived forms made once."""

    def __init__(self, tensor: Tensor, scale: Tensor | None = None):
        self.tensor, self.scale = tensor, scale

    @cached_property
    def dequantized(self) -> Tensor:
        return self.tensor if self.scale is None else dequantize_block_fp8(self.tensor, self.scale)

    @cached_property
    def per_tensor(self) -> tuple[Tensor, Tensor]:
        return quantize_tensor_fp8(self.dequantized)


def _write_shard(writer: RankFileWriter, tensor: TensorLayout, part: PartLayout, source: _Source,
                 full_shape: tuple[int, ...], expert: int | None, build: BuildConfig, rank: int) -> None:
    """Cut rank's piece of one logical tensor, store it in its dtype and write it at its offset."""
    index = shard_index(part.name, full_shape, build, rank)
    local = 0
    if expert is not None:  # one expert of a stacked parameter: is it this rank's?
        if not index[0].start <= expert < index[0].stop:
            return
        local, index = expert - index[0].start, index[1:]
    rows, cols = tensor.shape[-2:] if len(tensor.shape) > 1 else (1, tensor.shape[-1])
    data, scale = _stored_piece(source, index, part, build)
    writer.write(tensor.tensor.name, data, ((local * rows + part.row) * cols) if data.dim() > 1 else 0)
    if scale is not None:
        if build.quant_algo == "FP8_BLOCK_SCALES":
            srows, scols = tensor.scale_shape[-2:]
            writer.write(tensor.tensor.scale_name, scale, (local * srows + part.scale_row) * scols)
        else:
            writer.write(tensor.tensor.scale_name, scale.reshape(1), local * len(tensor.parts) + part.scale_row)


def _stored_piece(source: _Source, index: tuple[slice, ...], part: PartLayout,
                  build: BuildConfig) -> tuple[Tensor, Tensor | None]:
    """Rank's piece in its stored form: (data, scale or None).

    Block FP8 sources keep their bytes and block scales whenever every 128x128 block of the piece
    lies inside one source block (split at a multiple of 128, or the piece within one block);
    otherwise the piece is dequantized and quantized again on its own 128x128 grid, which is also
    how BF16/FP32 sources are quantized. Per-tensor FP8 quantizes the whole tensor once, so all
    ranks share its scale.
    """
    if not is_quantized(part.name, build.quant_algo):
        dtype = torch.float32 if part.name.endswith(FLOAT32) else build.torch_dtype
        piece = source.dequantized[index].to(dtype)
        want = part.shape[-piece.dim():]
        if tuple(piece.shape) != want:  # the padded tail of the vocabulary
            piece = F.pad(piece, (0, 0, 0, want[0] - piece.shape[0]))
        return piece, None
    if build.quant_algo == "FP8":
        q, scale = source.per_tensor
        return q[index], scale
    if source.scale is not None:
        grid = _source_grid(index, source.tensor.shape)
        if grid is not None:
            return source.tensor[index], source.scale[grid]
    return quantize_block_fp8(source.dequantized[index])


def blocks_split(ckpt: HFCheckpoint, cfg: ModelConfig, build: BuildConfig,
                 where: dict[str, tuple[TensorLayout, PartLayout]], shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Block-FP8 tensors of the checkpoint whose rank pieces `_stored_piece` must quantize again."""
    if build.quant_algo != "FP8_BLOCK_SCALES" or not ckpt.quantized:
        return []
    split = []
    for name in ckpt.tensor_names:
        internal, expert = to_internal(name, cfg)
        if (internal not in where or ckpt.tensor_info(name).dtype != FP8_CODE
                or not is_quantized(where[internal][1].name, build.quant_algo)):
            continue
        part = where[internal][1].name
        for rank in range(build.tp_size):
            index = shard_index(part, shapes[internal], build, rank)
            if _source_grid(index[1:] if expert is not None else index, ckpt.tensor_info(name).shape) is None:
                split.append(name)
                break
    return split


def _source_grid(index: tuple[slice, ...], shape: Sequence[int]) -> tuple[slice, ...] | None:
    """The source block scales of a piece, if each 128x128 block of it lies in one source block."""
    grid = tuple(_block_slice(s, n) for s, n in zip(index, shape))
    return None if None in grid else grid


def _block_slice(s: slice, n: int) -> slice | None:
    """Source block rows (or columns) covering s, if each block of the piece lies in one of them."""
    start, stop, b = s.start or 0, n if s.stop is None else s.stop, BLOCK[0]
    if start % b == 0 or start // b == (stop - 1) // b:
        return slice(start // b, (stop - 1) // b + 1)
    return None
