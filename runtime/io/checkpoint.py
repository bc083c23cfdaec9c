"""Read DeepSeek-V3/R1 Hugging Face checkpoints exactly as released, one shard at a time.

A 671B checkpoint is ~690 GB in 163 shards, so nothing here holds more than one shard's tensors
(plus a block scale that may sit in another shard). Problems are found when the directory is
opened (missing shards, truncated or corrupt files) or by `validate` (missing tensors, wrong
shapes, FP8 weights without scales), with messages that name the file and the tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open

from runtime.model.config import ModelConfig
from runtime.model.fp8 import FP8_DTYPE, dequantize_block_fp8, scale_shape

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
FP8_CODE = "F8_E4M3"  # safetensors' name for float8_e4m3fn
SCALE_CODE = "F32"  # safetensors' name for float32, the dtype of FP8 block scales
FLOAT_CODES = ("BF16", "F16", "F32", FP8_CODE)  # what a release tensor may be stored as

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_PROJ = r"(gate_proj|up_proj|down_proj)"
_FP8_RE = re.compile(
    r"^model\.layers\.\d+\.("
    r"self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    rf"|mlp\.({_PROJ}|experts\.\d+\.{_PROJ}|shared_experts\.{_PROJ})"
    r")\.weight$"
)


_EXPERT_RE = re.compile(rf"^model\.layers\.(\d+)\.mlp\.experts\.\d+\.{_PROJ}\.weight$")
_FUSED_EXPERTS_RE = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)(_scale_inv)?$")  # transformers 5's


class CheckpointError(ValueError):
    """A checkpoint directory that is incomplete, corrupt or does not match its config.json."""


@dataclass(frozen=True)
class TensorInfo:
    """What a shard's header says about one tensor; read without touching the data."""

    dtype: str  # safetensors dtype code: "BF16", "F32", "F8_E4M3", ...
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int


TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, FP8_CODE: torch.float8_e4m3fn,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool, "F64": torch.float64}
SAFETENSORS_CODES = {dtype: code for code, dtype in TORCH_DTYPES.items()}


class Scratch:
    """One buffer that tensors are read into in turn, grown to the largest: reading a model tensor by tensor then
    leaves no freed buffers behind for the allocator to keep resident. A tensor read into it lives until the next."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def take(self, nbytes: int) -> torch.Tensor:
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(0, dtype=torch.uint8)  # the old one goes before the new one comes
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self.buffer[:nbytes]


def read_tensor(file: Path, info: TensorInfo, scratch: Scratch | None = None) -> torch.Tensor:
    """One tensor's bytes read into memory of its own, or into `scratch` (no memory map: a mapped shard's pages
    stay resident while anything of it is in use, which would double the memory of loading)."""
    out = torch.empty(info.nbytes, dtype=torch.uint8) if scratch is None else scratch.take(info.nbytes)
    with open(file, "rb", buffering=0) as f:
        f.seek(info.offset)
        if f.readinto(out.numpy()) != info.nbytes:
            raise CheckpointError(f"{file}: file ended inside tensor data")
    return out.view(TORCH_DTYPES[info.dtype]).view(info.shape)


# ---- names and shapes of the release layout ---------------------------------------------------
def expected_tensor_shapes(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor of the release layout with its logical (dequantized) shape, in release order:
    embedding, target layers, final norm, lm_head, then the MTP layers (the last shards)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for layer in range(cfg.num_hidden_layers):
        shapes.update(_layer_shapes(cfg, layer))
    shapes["model.norm.weight"] = (H,)
    shapes["lm_head.weight"] = (V, H)
    if include_mtp:
        first = cfg.num_hidden_layers
        for layer in range(first, first + cfg.num_nextn_predict_layers):
            p = f"model.layers.{layer}."
            shapes[p + "embed_tokens.weight"] = (V, H)
            shapes[p + "enorm.weight"] = (H,)
            shapes[p + "hnorm.weight"] = (H,)
            shapes[p + "eh_proj.weight"] = (H, 2 * H)
            shapes.update(_layer_shapes(cfg, layer))
            shapes[p + "shared_head.norm.weight"] = (H,)
            shapes[p + "shared_head.head.weight"] = (V, H)
    return shapes


def _layer_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    p, H, heads = f"model.layers.{layer}.", cfg.hidden_size, cfg.num_attention_heads
    s: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (H,)}
    a = p + "self_attn."
    if cfg.q_lora_rank is not None:
        s[a + "q_a_proj.weight"] = (cfg.q_lora_rank, H)
        s[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        s[a + "q_b_proj.weight"] = (heads * cfg.qk_head_dim, cfg.q_lora_rank)
    else:
        s[a + "q_proj.weight"] = (heads * cfg.qk_head_dim, H)
    s[a + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)
    s[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    s[a + "kv_b_proj.weight"] = (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    s[a + "o_proj.weight"] = (H, heads * cfg.v_head_dim)
    s[p + "post_attention_layernorm.weight"] = (H,)
    if cfg.is_moe_layer(layer):
        s[p + "mlp.gate.weight"] = (cfg.n_routed_experts, H)
        s[p + "mlp.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
        for e in range(cfg.n_routed_experts):
            s.update(_mlp_shapes(p + f"mlp.experts.{e}.", H, cfg.moe_intermediate_size))
        if cfg.n_shared_experts:
            s.update(_mlp_shapes(p + "mlp.shared_experts.", H, cfg.n_shared_experts * cfg.moe_intermediate_size))
    else:
        s.update(_mlp_shapes(p + "mlp.", H, cfg.intermediate_size))
    return s


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (inter, hidden),
        prefix + "up_proj.weight": (inter, hidden),
        prefix + "down_proj.weight": (hidden, inter),
    }


_warned: set[str] = set()


def _warn_once(message: str, *args: object) -> None:
    """A checkpoint's warning, once per process: a build opens the same checkpoint several times."""
    text = message % args
    if text not in _warned:
        _warned.add(text)
        log.warning(text)


def is_fp8_quantized(name: str) -> bool:
    """True for the tensors the FP8 release stores as float8_e4m3fn plus `<name>_scale_inv`:
    the 2-D Linear weights of attention and of every MLP/expert (MTP block included). Embeddings,
    lm_head, norms, the router, eh_proj and shared_head stay bf16."""
    return _FP8_RE.match(name) is not None


def layer_of(name: str) -> int | None:
    """Decoder layer index of a tensor name, None for top-level tensors."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def is_mtp_tensor(name: str, cfg: ModelConfig) -> bool:
    """MTP modules are stored as layers num_hidden_layers.. after the target's layers."""
    layer = layer_of(name)
    return layer is not None and layer >= cfg.num_hidden_layers


# ---- safetensors headers ----------------------------------------------------------------------
# safetensors' own bound on a header (safetensors/src/tensor.rs: `const MAX_HEADER_SIZE: usize = 100_000_000;`,
# read_metadata refuses a larger one with HeaderTooLarge), so no file safetensors wrote or reads is refused here.
MAX_HEADER_BYTES = 100_000_000


def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """Tensors of one safetensors file in data order, from its header only.

    Also checks that the file holds every byte the header declares, so a truncated download
    fails when the checkpoint is opened rather than hours into a conversion.
    """
    size = file.stat().st_size
    with open(file, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{file}: file is {size} bytes, expected a safetensors file (8-byte header length first)")
        n = int.from_bytes(prefix, "little")
        if n > size - 8:
            raise CheckpointError(
                f"{file}: invalid safetensors header: declares {n} header bytes, expected at most {size - 8} (the file size less 8)"
            )
        if n > MAX_HEADER_BYTES:  # refused before reading: a corrupt length would read up to the whole shard
            raise CheckpointError(f"{file}: invalid safetensors header: declares {n} header bytes, expected at most "
                                  f"{MAX_HEADER_BYTES} (safetensors' limit)")
        try:
            header = json.loads(fh.read(n))
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise CheckpointError(f"{file}: invalid safetensors header: not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: invalid safetensors header: {type(header).__name__}, expected a JSON object")
    header.pop("__metadata__", None)
    try:
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        infos = {name: TensorInfo(e["dtype"], tuple(e["shape"]), 8 + n + e["data_offsets"][0],
                                  e["data_offsets"][1] - e["data_offsets"][0]) for name, e in entries}
        data_len = max((e["data_offsets"][1] for _, e in entries), default=0)
    except (TypeError, KeyError, IndexError) as e:
        raise CheckpointError(f"{file}: invalid safetensors header: bad tensor entry ({e!r})") from None
    need = 8 + n + data_len
    if size < need:
        raise CheckpointError(
            f"{file}: file is truncated: {size} bytes, expected {need} (8 + {n}-byte header + {data_len} bytes of data)"
        )
    try:  # let safetensors check what we did not (dtypes, overlapping offsets, ...)
        with safe_open(file, "pt"):
            pass
    except SafetensorError as e:
        raise CheckpointError(f"{file}: invalid safetensors file ({e})") from None
    return infos


# ---- the checkpoint ---------------------------------------------------------------------------
class HFCheckpoint:
    """A DeepSeek-V3 checkpoint directory: config.json plus sharded (indexed) or single safetensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory, expected a checkpoint directory")
        self.config = ModelConfig.from_json(self.path / "config.json")
        index = self.path / INDEX_NAME
        if index.is_file():
            self._source = index  # where a tensor is expected to be listed, for error messages
            weight_map = _read_index(index)
            self._headers = {shard: read_safetensors_header(self.path / shard) for shard in sorted(set(weight_map.values()))}
            for name, shard in weight_map.items():
                if name not in self._headers[shard]:
                    raise CheckpointError(f"{self.path / shard}: tensor {name!r} is not in this shard, expected there by {INDEX_NAME}")
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if len(files) != 1:
                raise CheckpointError(
                    f"{self.path}: {len(files)} *.safetensors files and no {INDEX_NAME}, "
                    "expected an index or a single model.safetensors"
                )
            self._source = files[0]
            self._headers = {files[0].name: read_safetensors_header(files[0])}
            weight_map = {name: files[0].name for name in self._headers[files[0].name]}
        self._weight_map = weight_map
        cfg = self.config
        if cfg.num_nextn_predict_layers and not any(is_mtp_tensor(n, cfg) for n in weight_map):
            # What transformers' save_pretrained writes for a fine-tuned model: the config keeps the MTP layer,
            # the files do not. The target model is whole, so it loads, without drafting.
            _warn_once("%s: the config declares %d MTP layer(s) ('num_nextn_predict_layers', 1 where the file leaves "
                       "it out, as transformers reads it) but no MTP tensor (model.layers.%d.*) is stored; loading the "
                       "model without MTP (no speculative drafting)", self.path / "config.json",
                       cfg.num_nextn_predict_layers, cfg.num_hidden_layers)
            self.config = dataclasses.replace(cfg, num_nextn_predict_layers=0)
            self.mtp_missing = True
        else:
            self.mtp_missing = False
        if self.quantized and not self.stored_fp8:
            _warn_once("%s: field 'quantization_config' declares FP8 weights but the files store none (a BF16 copy of "
                       "an FP8 release with the release's config.json?): the weights are read as stored; remove "
                       "quantization_config from config.json to say so", self.path / "config.json")

    @property
    def quantized(self) -> bool:
        return self.config.quantization_config is not None

    @property
    def wide_weights(self) -> list[str]:
        """Weights an FP8 release stores as FP8 (`is_fp8_quantized`) that these files store in a wider float type
        (all of them in a BF16 checkpoint; in an FP8 one, those its `modules_to_not_convert` keeps)."""
        return [n for n in self._weight_map if is_fp8_quantized(n) and self.tensor_info(n).dtype != FP8_CODE]

    @functools.cached_property
    def stored_fp8(self) -> bool:
        """Whether the weights are FP8 as stored: a config declaring FP8 over files holding none is read as stored."""
        return self.quantized and any(is_fp8_quantized(n) and self.tensor_info(n).dtype == FP8_CODE
                                      for n in self._weight_map)

    @property
    def weight_map(self) -> Mapping[str, str]:
        """Stored tensor name -> shard file name."""
        return MappingProxyType(self._weight_map)

    @property
    def tensor_names(self) -> list[str]:
        """Every stored tensor, `*_scale_inv` included."""
        return list(self._weight_map)

    @property
    def shard_files(self) -> list[Path]:
        return [self.path / shard for shard in self._headers]

    def tensor_info(self, name: str) -> TensorInfo:
        """Stored dtype and shape, from the header."""
        return self._headers[self._shard_of(name)][name]

    def iter_tensors(
        self,
        names: Callable[[str], bool] | None = None,
        dequantize: bool = True,
        dtype: torch.dtype | None = torch.float32,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) shard by shard, in data order, holding one tensor at a time.

        dequantize=True: FP8 weights come out as q * scale_inv in `dtype` (float32 when dtype is
        None) and the `*_scale_inv` tensors are not yielded. dequantize=False: tensors exactly as
        stored, for passthrough conversion. `dtype=None` keeps the stored dtype; `names` filters
        on the stored name.
        """
        for shard, header in self._headers.items():
            wanted = [
                n for n in header
                if self._weight_map.get(n) == shard
                and (names is None or names(n))
                and not (dequantize and n.endswith(SCALE_SUFFIX))
            ]
            if not wanted:
                continue
            for name in wanted:
                yield name, self._load(name, dequantize, dtype)

    def get(self, name: str, dequantize: bool = True, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """One tensor, read from its shard (same conventions as iter_tensors)."""
        return self._load(name, dequantize, dtype)

    def validate(self) -> None:
        """Check, from headers only, that the files hold exactly the release layout of config.json (its MTP
        layers included, unless none is stored): every tensor with its shape and a float dtype, FP8 weights
        with float32 block scales, no scale without an FP8 weight and no tensor the model does not have.
        build_engine and the runtime both open a checkpoint through this check."""
        expected = expected_tensor_shapes(self.config)
        fused = next((n for n in self._weight_map if _FUSED_EXPERTS_RE.search(n)), None)
        if fused is not None:
            raise CheckpointError(f"{self.path / self._weight_map[fused]}: tensor {fused!r} holds a layer's routed "
                                  "experts fused, as transformers 5 saves them with save_original_format=False; "
                                  "expected one tensor per expert as DeepSeek releases them (save_pretrained's default)")
        for name, shape in expected.items():
            if name not in self._weight_map:
                raise CheckpointError(f"{self._source}: tensor {name!r} is missing, expected shape {list(shape)}")
            self._check_shape(name, shape)
            dtype = self.tensor_info(name).dtype
            if dtype not in FLOAT_CODES:
                raise CheckpointError(f"{self.path / self._shard_of(name)}: tensor {name!r} is {dtype}, "
                                      f"expected one of {', '.join(FLOAT_CODES)}")
            if dtype == FP8_CODE:
                if len(shape) != 2:
                    wider = ", ".join(c for c in FLOAT_CODES if c != FP8_CODE)
                    raise CheckpointError(f"{self.path / self._shard_of(name)}: tensor {name!r} is {dtype} with shape "
                                          f"{list(shape)}, expected one of {wider} (FP8 block scales are for 2-D "
                                          "weights)")
                scale = self._scale_of(name)
                self._check_shape(scale, scale_shape(shape))
                if self.tensor_info(scale).dtype != SCALE_CODE:
                    raise CheckpointError(f"{self.path / self._shard_of(scale)}: tensor {scale!r} is "
                                          f"{self.tensor_info(scale).dtype}, expected {SCALE_CODE} (block scales)")
        stacks: dict[tuple[str, str], tuple[str, str]] = {}  # (layer, projection) -> (a routed expert, its dtype)
        for name in expected:
            if (m := _EXPERT_RE.match(name)) is None:
                continue
            first, dtype = stacks.setdefault(m.groups(), (name, self.tensor_info(name).dtype))
            if self.tensor_info(name).dtype != dtype:  # a layer's experts are held as one stack, in one dtype
                raise CheckpointError(f"{self.path / self._shard_of(name)}: tensor {name!r} is "
                                      f"{self.tensor_info(name).dtype} but {first!r} is {dtype}, expected one dtype "
                                      "for a layer's routed experts (as DeepSeek's releases store them)")
        for name in self._weight_map:
            weight = name.removesuffix(SCALE_SUFFIX)
            if weight not in expected:
                raise CheckpointError(f"{self.path / self._weight_map[name]}: unexpected tensor {name!r}, not part of "
                                      f"a DeepSeek-V3 model with this config.json")
            if name != weight and self.tensor_info(weight).dtype != FP8_CODE:
                raise CheckpointError(f"{self.path / self._shard_of(weight)}: tensor {weight!r} is "
                                      f"{self.tensor_info(weight).dtype} but has {name!r}, expected {FP8_CODE} (a "
                                      f"block scale multiplies FP8 codes)")

    # ---- internals ----------------------------------------------------------------------------
    def _shard_of(self, name: str) -> str:
        shard = self._weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"{self._source}: no tensor {name!r}")
        return shard

    def _scale_of(self, weight: str) -> str:
        """Name of the block scale that every float8 weight needs."""
        scale = weight + SCALE_SUFFIX
        if scale not in self._weight_map:
            raise CheckpointError(
                f"{self.path / self._weight_map[weight]}: float8_e4m3fn tensor {weight!r} has no {scale!r}, "
                "expected its float32 block scale"
            )
        return scale

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        shard = self._shard_of(name)
        got = self._headers[shard][name].shape
        if got != shape:
            raise CheckpointError(f"{self.path / shard}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")

    def read(self, name: str, scratch: Scratch | None = None) -> torch.Tensor:
        """One stored tensor as stored (into `scratch` when given), checked finite."""
        shard = self._shard_of(name)
        return check_finite(read_tensor(self.path / shard, self._headers[shard][name], scratch), name, self.path / shard)

    def _load(self, name: str, dequantize: bool, dtype: torch.dtype | None) -> torch.Tensor:
        t = self.read(name)
        if not (dequantize and t.dtype == FP8_DTYPE):
            return t if dtype is None else t.to(dtype)
        return dequantize_block_fp8(t, self.read(self._scale_of(name)), dtype=dtype or torch.float32)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
        """(name, tensor as stored, its FP8 scale or None) for every weight, shard by shard: an FP8 weight comes
        with its scale, read from wherever the release put it (the same shard or another). Each lives only until
        the next is read (they share one buffer)."""
        scratch = Scratch()
        for shard, header in self._headers.items():
            for name in header:
                if self._weight_map.get(name) != shard or name.endswith(SCALE_SUFFIX):
                    continue
                t = self.read(name, scratch)
                yield name, t, self.read(self._scale_of(name)) if t.dtype == FP8_DTYPE else None


def check_finite(t: torch.Tensor, name: str, file: Path) -> torch.Tensor:
    """`t` itself, if it holds no NaN or infinity (an FP8 tensor: no NaN code, e4m3fn has no infinity); else
    CheckpointError naming the tensor. One pass over each tensor as it streams: a corrupt or badly converted
    weight would otherwise load and produce NaN logits, i.e. empty output."""
    if t.numel() == 0:
        return t
    if t.dtype == FP8_DTYPE:  # the NaN codes 0x7F and 0xFF are the largest int8 and uint8: two reductions of views
        bad = t.view(torch.uint8).max() == 0xFF or t.view(torch.int8).max() == 0x7F
    elif t.is_floating_point():  # min and max carry any NaN or infinity: one reduction, nothing allocated
        lo, hi = torch.aminmax(t)
        bad = not (torch.isfinite(lo) and torch.isfinite(hi))
    else:
        return t
    if bad:
        raise CheckpointError(f"{file}: tensor {name!r} holds NaN or infinite values")
    return t


def check_stored_dtypes(header: Mapping[str, TensorInfo], file: Path) -> None:
    """A rank file's dtypes as the converter writes them: every tensor a float type, each FP8 weight with a float32
    block scale beside it and no scale without one (other dtypes read as values would be a silently wrong model)."""
    for name, info in header.items():
        if info.dtype not in FLOAT_CODES:
            raise CheckpointError(f"{file}: tensor {name!r} is {info.dtype}, expected one of {', '.join(FLOAT_CODES)}")
        weight = name.removesuffix(SCALE_SUFFIX)
        if name != weight:
            if info.dtype != SCALE_CODE:
                raise CheckpointError(f"{file}: tensor {name!r} is {info.dtype}, expected {SCALE_CODE} (block scales)")
            if weight not in header or header[weight].dtype != FP8_CODE:
                raise CheckpointError(f"{file}: tensor {name!r} scales no {FP8_CODE} weight {weight!r}")
        elif info.dtype == FP8_CODE and name + SCALE_SUFFIX not in header:
            raise CheckpointError(f"{file}: FP8 tensor {name!r} has no {name + SCALE_SUFFIX!r}")


def is_local_name(name: str) -> bool:
    """A file name a checkpoint index or an engine manifest may list: relative, inside its directory (no "..",
    not absolute). The file itself may be a symlink, as a hub cache's shards are."""
    path = Path(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts and "\\" not in name


def _read_index(index: Path) -> dict[str, str]:
    """The index's weight_map, after checking that every shard it names exists."""
    try:
        raw = json.loads(index.read_text())
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{index}: not valid JSON ({e})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: field 'weight_map' is missing or malformed, expected {{tensor name: shard file}}")
    for shard in sorted(set(weight_map.values())):
        if not is_local_name(shard):
            raise CheckpointError(f"{index}: shard {shard!r} named in weight_map is not a file name inside "
                                  f"{index.parent}; expected a relative name without '..'")
        if not (index.parent / shard).is_file():
            raise CheckpointError(f"{index}: shard {shard!r} named in weight_map does not exist, expected {index.parent / shard}")
    return weight_map
