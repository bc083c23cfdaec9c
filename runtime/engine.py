"""Engine directories: what `build_engine` writes and what the runtime loads.

An engine directory holds `engine.json` (model config, build limits and options, hashes), one
`rank{N}.safetensors` per tensor-parallel rank with the runtime's own parameter names, and the
tokenizer files. The native runtime is one process, so `load_engine` merges the rank files into
one model; the split rule (`split_dim`, `shard_index`) lives here because the converter cuts
tensors with the same rule the loader glues them back with. A plain Hugging Face checkpoint
directory loads too, with default limits. See docs/engine-format.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from runtime import kernels
from runtime.checkpoint import SCALE_SUFFIX, CheckpointError, HFCheckpoint, check_finite  # FP8: `<name>` + `<name>_scale_inv`
from runtime.config import ConfigError, ModelConfig, is_int
from runtime.fp8 import dequantize_block_fp8, dequantize_tensor_fp8
from runtime.model import MLA, MLP, DecoderLayer, DeepseekV3ForCausalLM, MoE, MTPLayer, PackedLinear, RMSNorm, rope_inv_freq
from runtime.weights import WeightsError, load_weights

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ENGINE_JSON = "engine.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANT_ALGOS = (None, "FP8_BLOCK_SCALES", "FP8")
BACKENDS = ("native", "trtllm")
HF_MAX_SEQ_LEN = 4096  # cap on max_seq_len when a plain HF checkpoint is loaded
HF_MAX_DRAFT_LEN = 4  # draft length given to a plain HF checkpoint that has an MTP layer
MAX_DRAFT_LEN = 8  # cap when one MTP module is re-run per draft token (native runtime, TRT-LLM MTP Eagle)


class EngineError(ValueError):
    """An engine directory this runtime cannot or must not load; the message says why."""


@dataclass(frozen=True)
class BuildConfig:
    """Limits and options fixed at build time; the executor checks its own settings against them."""

    max_batch_size: int = 8
    max_seq_len: int = 1024
    max_num_tokens: int = 2048
    max_draft_len: int = 4
    dtype: str = "float32"  # CPU has no fast bf16, so float32 is the native default
    kv_block_size: int = 16
    tp_size: int = 1
    ep_size: int = 1
    quant_algo: str | None = None
    backend: str = "native"

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_seq_len", "max_num_tokens", "kv_block_size", "tp_size", "ep_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise EngineError(f"{name} is {value!r}, expected a positive integer")
        if self.kv_block_size & (self.kv_block_size - 1) or self.kv_block_size > self.max_seq_len:
            raise EngineError(f"kv_block_size is {self.kv_block_size}, expected a power of two (as TensorRT-LLM's "
                              f"tokens_per_block) at most max_seq_len ({self.max_seq_len})")
        if not isinstance(self.max_draft_len, int) or self.max_draft_len < 0:
            raise EngineError(f"max_draft_len is {self.max_draft_len!r}, expected an integer >= 0")
        if self.dtype not in DTYPES:
            raise EngineError(f"dtype is {self.dtype!r}, expected one of {', '.join(DTYPES)}")
        if self.quant_algo not in QUANT_ALGOS:
            raise EngineError(f"quant_algo is {self.quant_algo!r}, expected FP8_BLOCK_SCALES, FP8 or none")
        if self.backend not in BACKENDS:
            raise EngineError(f"backend is {self.backend!r}, expected one of {', '.join(BACKENDS)}")
        if self.tp_size % self.ep_size:
            raise EngineError(
                f"ep_size {self.ep_size} does not divide tp_size {self.tp_size}, expected a divisor "
                "(MoE ranks are moe_tp_size x moe_ep_size = tp_size)"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    # TensorRT-LLM's rank layout: tp_rank = moe_tp_rank * moe_ep_size + moe_ep_rank.
    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    def moe_ep_rank(self, rank: int) -> int:
        return rank % self.ep_size

    def moe_tp_rank(self, rank: int) -> int:
        return rank // self.ep_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str) -> "BuildConfig":
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
        if unknown:
            raise EngineError(f"{source}: unknown build field(s) {', '.join(unknown)}")
        try:
            return cls(**raw)
        except EngineError as e:
            raise EngineError(f"{source}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class LoadedEngine:
    model: DeepseekV3ForCausalLM  # eval mode, on its device, in build.dtype, requires_grad False
    model_config: ModelConfig
    build: BuildConfig  # as built, with dtype the one loaded
    tokenizer_dir: Path
    path: Path
    built: bool = True  # False for a plain HF checkpoint: its limits are defaults, not build choices


# ---- limits the model bounds (checked at build and again at load: engine.json can be edited) ---------
def check_model_limits(cfg: ModelConfig, build: BuildConfig, source: str, flag: str = "",
                       use_mtp_vanilla: bool = False) -> None:
    """EngineError naming the limit (as `flag` + field, "--" for build_engine's flags) the model cannot serve."""
    if build.max_seq_len > cfg.max_position_embeddings:
        raise EngineError(f"{flag}max_seq_len {build.max_seq_len} exceeds max_position_embeddings "
                          f"({cfg.max_position_embeddings}) of {source}")
    allowed, why = max_draft_len_allowed(cfg, build.backend, use_mtp_vanilla)
    if build.max_draft_len > allowed:
        raise EngineError(f"{flag}max_draft_len {build.max_draft_len} exceeds {allowed}, the most {source} allows: {why}")


def max_draft_len_allowed(cfg: ModelConfig, backend: str, use_mtp_vanilla: bool = False) -> tuple[int, str]:
    """Largest draft length and the rule behind it.

    native: the MTP module is re-run on its own output, so any k up to MAX_DRAFT_LEN once there is one.
    trtllm: MTP Eagle (one released MTP layer, not use_mtp_vanilla) re-runs it the same way; vanilla
    MTP runs the layers in sequence, so k <= num_nextn_predict_layers.
    """
    n = cfg.num_nextn_predict_layers
    if n == 0:
        return 0, "num_nextn_predict_layers is 0 (no MTP layer to draft with)"
    if backend == "trtllm" and (use_mtp_vanilla or n > 1):
        return n, f"TensorRT-LLM's vanilla MTP drafts one token per MTP layer (num_nextn_predict_layers {n})"
    return MAX_DRAFT_LEN, f"the MTP module is re-run per draft token, up to a cap of {MAX_DRAFT_LEN}"


# ---- how tensors are split across ranks (shared by the converter and the loader) -----------
_EXPERT_DIMS = {"experts.gate_proj": 1, "experts.up_proj": 1, "experts.down_proj": 2}
_ROWS = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight",  # vocabulary
         "q_b_proj.weight", "q_proj.weight", "kv_b_proj.weight",  # attention heads
         "gate_proj.weight", "up_proj.weight")  # dense MLP and shared experts, column parallel
_COLS = ("o_proj.weight", "down_proj.weight")  # row parallel


def split_dim(name: str) -> int | None:
    """Dimension of parameter `name` (runtime naming, experts stacked [E, out, in]) that tensor
    parallelism splits; None when every rank holds all of it. Routed experts are also split by
    expert index (dim 0) over moe_ep_size; the returned dim is their moe_tp split."""
    for suffix, dim in _EXPERT_DIMS.items():
        if name.endswith(suffix):
            return dim
    if name.endswith(_ROWS):
        return 0
    if name.endswith(_COLS):
        return 1
    return None


def shard_index(name: str, shape: Sequence[int], build: BuildConfig, rank: int) -> tuple[slice, ...]:
    """The part of full parameter `name` (of `shape`) that `rank` holds.

    Each split dim is cut into equal chunks of ceil(n / parts); only the vocabulary may not
    divide evenly, and the slice is clipped to the real rows (rank files pad it with zeros).
    """
    index = [slice(None)] * len(shape)
    dim = split_dim(name)
    if dim is None:
        return tuple(index)
    if name.endswith(tuple(_EXPERT_DIMS)):
        index[0] = _chunk(shape[0], build.ep_size, build.moe_ep_rank(rank))
        index[dim] = _chunk(shape[dim], build.moe_tp_size, build.moe_tp_rank(rank))
    else:
        index[dim] = _chunk(shape[dim], build.tp_size, rank)
    return tuple(index)


def shard_shape(name: str, shape: Sequence[int], build: BuildConfig) -> tuple[int, ...]:
    """Shape every rank file stores for parameter `name` of full `shape` (padded vocabulary)."""
    out = list(shape)
    dim = split_dim(name)
    if dim is not None:
        if name.endswith(tuple(_EXPERT_DIMS)):
            out[0] = math.ceil(shape[0] / build.ep_size)
            out[dim] = math.ceil(shape[dim] / build.moe_tp_size)
        else:
            out[dim] = math.ceil(shape[dim] / build.tp_size)
    return tuple(out)


def _chunk(n: int, parts: int, i: int) -> slice:
    size = math.ceil(n / parts)
    return slice(min(i * size, n), min((i + 1) * size, n))


# ---- engine.json ------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineManifest:
    """engine.json: the model, the build, the files it needs and the hashes that vouch for them."""

    model_config: ModelConfig
    build: BuildConfig
    weights: tuple[str, ...]  # weight files, relative to the engine directory, rank order
    files: dict[str, str]  # every file the engine needs (weights, tokenizer, ...) -> sha256
    builder_version: str
    format_version: int = FORMAT_VERSION

    @property
    def content_hash(self) -> str:
        """sha256 over the model config, the build and each file's sha256."""
        payload = {"model_config": self.model_config.to_dict(), "build": self.build.to_dict(),
                   "weights": list(self.weights), "files": self.files}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    @classmethod
    def create(cls, engine_dir: Path, model_config: ModelConfig, build: BuildConfig, weights: Sequence[str],
               files: Sequence[str], builder_version: str) -> "EngineManifest":
        """Hash `files` (weights included) as they lie in engine_dir now."""
        hashes = {f: file_sha256(engine_dir / f) for f in sorted(set(weights) | set(files))}
        return cls(model_config, build, tuple(weights), hashes, builder_version)

    def write(self, engine_dir: Path) -> None:
        raw = {
            "format_version": self.format_version,
            "builder_version": self.builder_version,
            "backend": self.build.backend,
            "model_config": self.model_config.to_dict(),
            "build": self.build.to_dict(),
            "weights": list(self.weights),
            "files": self.files,
            "content_hash": self.content_hash,
        }
        (engine_dir / ENGINE_JSON).write_text(json.dumps(raw, indent=2) + "\n")

    @classmethod
    def read(cls, engine_dir: Path) -> "EngineManifest":
        """Parse engine.json, refusing a newer format before reading anything else."""
        path = engine_dir / ENGINE_JSON
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise EngineError(f"{path}: cannot read engine.json ({e})") from None
        version = raw.get("format_version") if isinstance(raw, dict) else None
        if not is_int(version) or version < 1:
            raise EngineError(f"{path}: field 'format_version' is {version!r}, expected an integer >= 1")
        if version > FORMAT_VERSION:
            raise EngineError(
                f"{path}: format_version {version} is newer than this runtime supports ({FORMAT_VERSION}); "
                "upgrade the runtime or rebuild the engine with this version's build_engine"
            )
        try:
            build = BuildConfig.from_dict(raw["build"], source=f"{path}: field 'build'")
            model_config = ModelConfig.from_dict(raw["model_config"], source=f"{path}: field 'model_config'")
            manifest = cls(model_config, build, tuple(raw["weights"]), dict(raw["files"]),
                           raw["builder_version"], version)
            stored_hash = raw["content_hash"]
        except KeyError as e:
            raise EngineError(f"{path}: missing field {e}") from None
        except ConfigError as e:
            raise EngineError(str(e)) from None
        except EngineError:
            raise
        except (TypeError, ValueError, AttributeError) as e:
            raise EngineError(f"{path}: malformed field ({e}); rebuild the engine") from None
        if raw.get("backend") != build.backend:
            raise EngineError(f"{path}: field 'backend' is {raw.get('backend')!r}, expected {build.backend!r} as in 'build'")
        if stored_hash != manifest.content_hash:
            raise EngineError(
                f"{path}: content_hash does not match the model_config, build and file hashes it lists; "
                "engine.json was edited or is corrupt, rebuild the engine"
            )
        check_model_limits(model_config, build, f"{path}: field 'model_config'")
        return manifest

    def verify_files(self, engine_dir: Path, hashes: bool = True) -> None:
        """Every weight file present; with `hashes`, every listed file with its recorded sha256."""
        for name in self.weights:
            if not (engine_dir / name).is_file():
                raise EngineError(
                    f"{engine_dir / name}: weight file missing, expected {len(self.weights)} "
                    f"({', '.join(self.weights)}) for tp_size {self.build.tp_size}"
                )
        if not hashes:
            return
        for name, digest in self.files.items():
            file = engine_dir / name
            if not file.is_file():
                raise EngineError(f"{file}: file missing, expected it as listed in {ENGINE_JSON}")
            got = file_sha256(file)
            if got != digest:
                raise EngineError(
                    f"{file}: content hash mismatch (sha256 {got[:16]}..., expected {digest[:16]}... "
                    f"from {ENGINE_JSON}); the file changed or is corrupt, rebuild the engine"
                )


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# ---- loading ----------------------------------------------------------------------------------
def load_engine(path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
                *, verify: bool = True, cpu_kernels: bool = True) -> LoadedEngine:
    """Load an engine directory (engine.json) or a plain HF DeepSeek-V3 checkpoint directory.

    dtype overrides the engine's build dtype; verify=False skips hashing the files (big engines);
    cpu_kernels: on CPU in float32, run the C++ kernels and keep FP8 weights FP8 (`use_cpu_kernels`).
    """
    loaded = _load(Path(path), device, dtype, verify)
    if cpu_kernels:
        use_cpu_kernels(loaded.model)
    return loaded


def use_cpu_kernels(model: DeepseekV3ForCausalLM) -> int:
    """Switch a float32 CPU model to the C++ kernels where this machine can run them: paged attention
    in `kernels.mla_attention` (latent sizes multiples of 16), and every linear weight kept in the form
    the release stores it: exactly 128x128-block FP8 values (stacked experts included) as FP8, a
    quarter of the float32 bytes; other exactly-BF16 weights (heads, eh_proj) as BF16, half. kv_b_proj
    (read per head by absorbed attention) and the router stay float32; nothing is rounded. Layers and
    MTP modules whose parts are all on the kernels then run as one call each (`kernels.decoder_layer`,
    `kernels.mtp_layer`), and the model's layers all in one when each is (`kernels.decoder_layers`).
    Returns how many weights were packed."""
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32 or kernels.cpu_kernels() is None:
        return 0
    cfg = model.cfg
    model.kernel_attention = all(n % kernels.PANEL == 0 for n in (cfg.kv_lora_rank, cfg.latent_dim, cfg.v_head_dim))
    packed = 0
    if cfg.hidden_size % kernels.PANEL == cfg.moe_intermediate_size % kernels.PANEL == 0 and \
            cfg.n_shared_experts > 0 and cfg.n_routed_experts <= kernels.MAX_EXPERTS and cfg.n_group <= kernels.MAX_GROUPS:
        for moe in [m for m in model.modules() if isinstance(m, MoE) and m.packed is None]:
            mlp = moe.shared_experts
            if not all(isinstance(lin, torch.nn.Linear) for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
                continue  # an earlier call left these experts unpacked and packed the shared expert alone
            routed = [kernels.pack_fp8(w.data) for w in (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj)]
            shared = [kernels.pack_fp8(lin.weight.data) for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
            if all(w is not None for w in routed + shared):
                moe.packed = kernels.PackedMoE(tuple(routed), tuple(shared))
                moe.gate.weight.data = moe.gate.weight.data.contiguous()  # row per expert, as the kernel reads it
                del moe.experts, moe.shared_experts
                packed += 6
    for module in list(model.modules()):
        if isinstance(module, RMSNorm):
            module.kernel = True
        if isinstance(module, MLA) and model.kernel_attention:
            module.use_kernel()
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and child.bias is None and name != "kv_b_proj":
                weight = kernels.pack_fp8(child.weight.data) or kernels.pack_bf16(child.weight.data)
                if weight is not None:
                    setattr(module, name, PackedLinear(weight))
                    packed += 1
    left = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("kv_b_proj")]
    log.info("CPU kernels: %d weights packed (FP8 or BF16 as stored), %d linear layers left in float32%s", packed,
             len(left), f" (e.g. {left[0]})" if left else "")
    for mtp in model.mtp:  # the release stores the MTP head as a copy of lm_head: one copy, warm in cache for both
        head = mtp.shared_head.head
        if isinstance(head, PackedLinear) and isinstance(model.lm_head, PackedLinear) and \
                torch.equal(head.packed.panels, model.lm_head.packed.panels) and \
                torch.equal(head.packed.scale, model.lm_head.packed.scale):
            head.packed = model.lm_head.packed
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        layer.fused = _fused_layer(layer)
    fused = [layer.fused for layer in model.model.layers]
    model.fused = kernels.cpu_kernels().stack_layers(fused) if all(f is not None for f in fused) else None
    for mtp in model.mtp:
        mtp.fused = _fused_mtp(mtp)
    log.info("CPU kernels: %d of %d decoder layers and %d of %d MTP modules run as one call each",
             sum(la.fused is not None for la in layers), len(layers), sum(m.fused is not None for m in model.mtp),
             len(model.mtp))
    return packed


def _fused_mtp(mtp: MTPLayer) -> object | None:
    """The MTP module's weights gathered for `kernels.mtp_layer`, or None where a part is not on the kernels."""
    eh, head = mtp.eh_proj, mtp.shared_head.head
    if mtp.block.fused is None or not isinstance(eh, PackedLinear) or not isinstance(head, PackedLinear):
        return None
    return kernels.cpu_kernels().make_mtp(
        mtp.embed_tokens.weight, mtp.enorm.weight, mtp.hnorm.weight, mtp.shared_head.norm.weight, mtp.enorm.eps,
        eh.packed.panels, eh.packed.scale, head.packed.panels, head.packed.scale, head.packed.out_features,
        mtp.block.fused)


def _fused_layer(layer: DecoderLayer) -> object | None:
    """The layer's weights gathered for `kernels.decoder_layer`, or None where some part of the layer is not
    on the kernels (a float32 linear, attention without the kernel, no q LoRA, an unpacked MoE)."""
    attn, ffn = layer.self_attn, layer.mlp
    linears = [getattr(attn, name, None) for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")]
    if isinstance(ffn, MLP):
        linears += [ffn.gate_proj, ffn.up_proj, ffn.down_proj]
    elif not isinstance(ffn, MoE) or ffn.packed is None:
        return None
    if attn.absorbed is None or not all(isinstance(lin, PackedLinear) for lin in linears):
        return None
    w = [lin.packed for lin in linears]
    cfg = attn.cfg
    moe = isinstance(ffn, MoE)
    return kernels.cpu_kernels().make_layer(
        attn.cache_layer, layer.input_layernorm.weight, attn.q_a_layernorm.weight, attn.kv_a_layernorm.weight,
        layer.post_attention_layernorm.weight, layer.input_layernorm.eps, attn.q_a_layernorm.eps,
        attn.kv_a_layernorm.eps, *[[p.panels, p.scale] for p in w[:4]], [p.out_features for p in w],
        *attn.absorbed, cfg.softmax_scale,
        ffn.gate.weight if moe else None, ffn.gate.e_score_correction_bias if moe else None, cfg.n_group,
        cfg.topk_group, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.routed_scaling_factor,
        list(ffn.packed.tensors) if moe else [], [t for p in w[4:] for t in (p.panels, p.scale)])


def _load(path: Path, device: str | torch.device, dtype: str | torch.dtype | None, verify: bool) -> LoadedEngine:
    if (path / ENGINE_JSON).is_file():
        manifest = EngineManifest.read(path)
        if manifest.build.backend == "trtllm":
            raise EngineError(
                f"{path}: built with --backend trtllm; run it with the TensorRT-LLM backend "
                f"(trtllm-serve {path / 'hf'} --backend pytorch --extra_llm_api_options "
                f"{path / 'extra_llm_api_options.yaml'}) or rebuild with --backend native"
            )
        if len(manifest.weights) != manifest.build.tp_size:
            raise EngineError(
                f"{path / ENGINE_JSON}: lists {len(manifest.weights)} weight files, expected one per rank "
                f"(tp_size {manifest.build.tp_size})"
            )
        manifest.verify_files(path, hashes=verify)
        cfg, build = manifest.model_config, _as_loaded(manifest.build, dtype)
        model = _empty_model(cfg, device, build.torch_dtype)
        _load_ranks(model, path, manifest.weights, build)
        return LoadedEngine(model, cfg, build, path, path)
    if (path / "config.json").is_file():
        return _load_hf(path, device, dtype)
    raise EngineError(
        f"{path}: neither {ENGINE_JSON} nor config.json found, expected an engine directory "
        "(from build_engine) or a Hugging Face DeepSeek-V3 checkpoint directory"
    )


def _load_hf(path: Path, device: str | torch.device, dtype: str | torch.dtype | None) -> LoadedEngine:
    """A released checkpoint, dequantized as it streams in, with default limits."""
    try:
        ckpt = HFCheckpoint(path)
        cfg = ckpt.config
        ckpt.validate()  # headers only: names, shapes, dtypes
        build = _as_loaded(_checkpoint_limits(ckpt), dtype)
        model = _empty_model(cfg, device, build.torch_dtype)
        load_weights(model, ckpt.iter_tensors(dequantize=True, dtype=None), source=str(path))
    except (CheckpointError, ConfigError, WeightsError) as e:
        raise EngineError(str(e)) from e
    return LoadedEngine(model, cfg, build, path, path, built=False)


def _checkpoint_limits(ckpt: HFCheckpoint) -> BuildConfig:
    """What a plain checkpoint is served with: default limits within what the model allows."""
    cfg = ckpt.config
    return BuildConfig(max_seq_len=min(cfg.max_position_embeddings, HF_MAX_SEQ_LEN),
                       max_draft_len=HF_MAX_DRAFT_LEN if cfg.num_nextn_predict_layers else 0,
                       quant_algo="FP8_BLOCK_SCALES" if ckpt.quantized else None)


def read_limits(path: str | Path) -> tuple[ModelConfig, BuildConfig]:
    """The model config and the limits an executor on `path` (engine directory or HF checkpoint) starts from,
    read without touching the weights."""
    path = Path(path)
    if (path / ENGINE_JSON).is_file():
        manifest = EngineManifest.read(path)
        return manifest.model_config, manifest.build
    try:
        ckpt = HFCheckpoint(path)
    except (CheckpointError, ConfigError) as e:
        raise EngineError(str(e)) from e
    return ckpt.config, _checkpoint_limits(ckpt)


def _as_loaded(build: BuildConfig, dtype: str | torch.dtype | None) -> BuildConfig:
    """The build with the dtype the model is loaded in (the `dtype` argument overrides the built one)."""
    if dtype is None:
        return build
    name = {v: k for k, v in DTYPES.items()}.get(dtype, dtype)
    if name not in DTYPES:
        raise EngineError(f"dtype {dtype!r} is not supported, expected one of {', '.join(DTYPES)}")
    return dataclasses.replace(build, dtype=name)


def _empty_model(cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype) -> DeepseekV3ForCausalLM:
    """Uninitialized parameters in `dtype` on `device` (weights overwrite all of them); buffers stay fp32.

    On CPU, matmul weights keep their [out, in] shape but are stored K-major (each [in, out] contiguous):
    F.linear then runs x @ W as a plain NN gemm, which MKL does faster for 2..128 rows (on the shipped
    model a batch-16 decode step ~6%, a 63-token prefill ~12%, batch 1 within noise). Embedding tables
    stay row-major for their lookups. On CUDA every weight stays row-major, the layout cuBLAS and
    cuBLASLt are tuned for: with the GEMMs the graphs record (cuda_graphs.CUBLASLT_MAX_TOKENS), a decode
    step on an H100 took 2.60 / 3.54 ms for 1 / 16 sequences, against 2.83 / 4.07 ms with K-major weights.
    """
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    k_major = torch.device(device).type == "cpu"
    for name, p in model.named_parameters():
        p.data = p.data.to(dtype)
        if k_major and p.dim() >= 2 and not name.endswith("embed_tokens.weight"):
            p.data = p.data.mT.contiguous().mT
    model.to_empty(device=device)
    model.inv_freq.copy_(rope_inv_freq(cfg)[0])
    return model.eval().requires_grad_(False)


def _load_ranks(model: DeepseekV3ForCausalLM, engine_dir: Path, files: Sequence[str], build: BuildConfig) -> None:
    """Copy each rank's slices into the full parameters; replicated tensors come from rank 0."""
    cfg = model.cfg
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    params.pop("inv_freq")
    filled = dict.fromkeys(params, 0)
    with torch.no_grad():
        for rank, fname in enumerate(files):
            file = engine_dir / fname
            try:
                with safe_open(file, "pt") as f:
                    keys = set(f.keys())
                    for name in f.keys():
                        if name.endswith(SCALE_SUFFIX) or (rank > 0 and split_dim(name) is None):
                            continue
                        if name not in params:
                            raise EngineError(f"{file}: unexpected tensor {name!r}")
                        full = params[name]
                        if name.endswith("kv_b_proj.weight"):  # stored per head [heads, nope+v, kv_lora]
                            full = full.view(cfg.num_attention_heads, -1, cfg.kv_lora_rank)
                        filled[name] += _copy_shard(file, f, keys, name, full, build, rank)
            except SafetensorError as e:
                raise EngineError(f"{file}: invalid safetensors file ({e})") from None
            except CheckpointError as e:
                raise EngineError(str(e)) from None
    for name, p in params.items():
        if filled[name] != p.numel():
            raise EngineError(f"{engine_dir}: tensor {name!r} is missing from the rank files")


def _copy_shard(file: Path, f, keys: set[str], name: str, full: Tensor, build: BuildConfig, rank: int) -> int:
    """Copy rank's stored piece of `name` into its slice of `full` (dequantized); return elements filled."""
    target = full[shard_index(name, full.shape, build, rank)]
    stored = f.get_slice(name).get_shape()
    want = shard_shape(name, full.shape, build)
    if tuple(stored) != want:
        raise EngineError(f"{file}: tensor {name!r} has shape {list(stored)}, expected {list(want)}")
    t = check_finite(f.get_tensor(name), name, file)
    if target.shape != t.shape:  # the padded tail of the vocabulary
        t = t[tuple(slice(0, n) for n in target.shape)]
    scale = f.get_tensor(name + SCALE_SUFFIX) if name + SCALE_SUFFIX in keys else None
    if scale is not None:
        check_finite(scale, name + SCALE_SUFFIX, file)
    if scale is None:
        if t.dtype == torch.float8_e4m3fn:  # raw FP8 codes read as values would be a silently wrong model
            raise EngineError(f"{file}: FP8 tensor {name!r} has no {name + SCALE_SUFFIX!r}")
        target.copy_(t)
        return target.numel()
    try:
        if scale.dim() < t.dim():  # per-tensor: one scale per weight (per expert when stacked)
            target.copy_(dequantize_tensor_fp8(t, scale.view(*scale.shape, 1, 1)))
        elif t.dim() == 3:  # stacked experts: one block grid per expert
            for e in range(t.shape[0]):
                target[e].copy_(dequantize_block_fp8(t[e], scale[e]))
        else:
            target.copy_(dequantize_block_fp8(t, scale))
    except (ValueError, RuntimeError) as e:
        raise EngineError(f"{file}: tensor {name + SCALE_SUFFIX!r} of shape {list(scale.shape)} does not fit "
                          f"{name!r} of shape {list(t.shape)} ({e})") from None
    return target.numel()
