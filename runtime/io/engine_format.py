"""The engine format: what `build_engine` writes and what the runtime accepts, without any model code.

An engine directory holds `engine.json` (model config, build limits and options, hashes), one
`rank{N}.safetensors` per tensor-parallel rank with the runtime's own parameter names, and the
tokenizer files. The split rule (`split_dim`, `shard_index`) lives here because the converter cuts
tensors with the same rule the loader (runtime.io.loading) glues them back with, and so do the limits the
model bounds, checked at build and again at load. A plain Hugging Face checkpoint directory is served
too, with default limits. See docs/engine-format.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from runtime.io.checkpoint import (CheckpointError, HFCheckpoint, TensorInfo, is_local_name,
                                   read_safetensors_header)
from runtime.model.config import ConfigError, ModelConfig, is_int
from runtime.model.parallel import Layout, chunk

FORMAT_VERSION = 1
ENGINE_JSON = "engine.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANT_ALGOS = ("FP8_BLOCK_SCALES", "FP8", None)
BACKENDS = ("native", "trtllm")
MIN_SEQ_LEN = 2  # a prompt token and a generated one: less serves nothing
HF_MAX_SEQ_LEN = 4096  # cap on the default max_seq_len (a plain HF checkpoint, a build without the flag)
DEFAULT_MAX_DRAFT_LEN = 4  # an engine built without --max_draft_len, and a plain checkpoint with an MTP layer
LLM_API_OPTIONS = "extra_llm_api_options.yaml"  # a --backend trtllm engine's LLM-API options
HF_DIR = "hf"  # a --backend trtllm engine's checkpoint, in the layout TensorRT-LLM loads
MAX_DRAFT_LEN = 8  # cap when one MTP module is re-run per draft token (native runtime, TRT-LLM MTP Eagle)
# Defaults an engine's LLM-API options and the executor share (ExecutorConfig, RelaxedAcceptance), kept here so
# that the builder writes them without importing the executors
FREE_MEMORY_FRACTION = 0.9  # share of the memory free after loading that the KV cache may take
RELAXED_TOP_N = 1  # relaxed acceptance's candidates (upstream MTPDecodingConfig.relaxed_topk's default)
RELAXED_DELTA = 0.0  # relaxed acceptance's probability margin (upstream relaxed_delta's default)
GUIDED_DECODING_BACKENDS = ("xgrammar", "llguidance")  # llm_args.py: TorchLlmArgs.guided_decoding_backend
# speculative_config's draft length: upstream's name since 2026, and the older one every release reads
DRAFT_LEN_NAMES = ("max_draft_len", "num_nextn_predict_layers")


class EngineError(ValueError):
    """An engine directory this runtime cannot or must not load; the message says why."""


@dataclass(frozen=True)
class BuildConfig:
    """Limits and options fixed at build time; the executor checks its own settings against them."""

    max_batch_size: int = 8
    max_seq_len: int = 1024
    max_num_tokens: int = 2048
    max_draft_len: int = DEFAULT_MAX_DRAFT_LEN
    dtype: str = "float32"  # CPU has no fast bf16, so float32 is the native default
    kv_block_size: int = 16
    tp_size: int = 1
    ep_size: int = 1
    quant_algo: str | None = None
    backend: str = "native"

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_seq_len", "max_num_tokens", "kv_block_size", "tp_size", "ep_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise EngineError(f"{name} is {value!r}, expected a positive integer")
        if self.max_seq_len < MIN_SEQ_LEN:
            raise EngineError(f"max_seq_len is {self.max_seq_len}, expected at least {MIN_SEQ_LEN} (a prompt token and "
                              "a generated one)")
        if self.kv_block_size & (self.kv_block_size - 1) or self.kv_block_size > self.max_seq_len:
            raise EngineError(f"kv_block_size is {self.kv_block_size}, expected a power of two (as TensorRT-LLM's "
                              f"tokens_per_block) at most max_seq_len ({self.max_seq_len})")
        if not is_int(self.max_draft_len) or self.max_draft_len < 0:
            raise EngineError(f"max_draft_len is {self.max_draft_len!r}, expected an integer >= 0")
        if self.max_num_tokens < self.max_draft_len + 1:
            raise EngineError(f"max_num_tokens is {self.max_num_tokens}, expected at least max_draft_len + 1 "
                              f"({self.max_draft_len + 1}: a sequence's verification step runs its drafts and one more)")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise EngineError(f"dtype is {self.dtype!r}, expected one of {', '.join(DTYPES)}")
        if not isinstance(self.quant_algo, (str, type(None))) or self.quant_algo not in QUANT_ALGOS:
            raise EngineError(f"quant_algo is {self.quant_algo!r}, expected FP8_BLOCK_SCALES, FP8 or none")
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise EngineError(f"backend is {self.backend!r}, expected one of {', '.join(BACKENDS)}")
        if self.tp_size % self.ep_size:
            raise EngineError(
                f"ep_size {self.ep_size} does not divide tp_size {self.tp_size}, expected a divisor "
                "(MoE ranks are moe_tp_size x moe_ep_size = tp_size)"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def moe_tp_size(self) -> int:
        """How many ranks split each routed expert's features (Layout's rule; the same on every rank)."""
        return self.layout(0).moe_tp_size

    def layout(self, rank: int) -> Layout:
        """Rank `rank`'s place (TensorRT-LLM's rank order: rank = moe_tp_rank * moe_ep_size + moe_ep_rank)."""
        return Layout(self.tp_size, self.ep_size, rank)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str) -> "BuildConfig":
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
        if unknown:
            raise EngineError(f"{source}: unknown build field(s) {', '.join(unknown)}")
        missing = [name for name in cls.__dataclass_fields__ if name not in raw]  # build_engine writes every one
        if missing:
            raise EngineError(f"{source}: missing build field(s) {', '.join(missing)}; rebuild the engine")
        try:
            return cls(**raw)
        except EngineError as e:
            raise EngineError(f"{source}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
    layout = build.layout(rank)
    if name.endswith(tuple(_EXPERT_DIMS)):
        index[0] = layout.experts(shape[0])
        index[dim] = chunk(shape[dim], layout.moe_tp_size, layout.moe_tp_rank)
    else:
        index[dim] = chunk(shape[dim], build.tp_size, rank)
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


def stored_per_head(name: str) -> bool:
    """Whether a native engine stores parameter `name` per attention head: kv_b_proj, whose W_UK / W_UV split
    absorbed MLA reads head by head."""
    return name.endswith("kv_b_proj.weight")


def stored_shape(name: str, shape: Sequence[int], cfg: ModelConfig) -> tuple[int, ...]:
    """Shape a native engine stores parameter `name` of `shape` (whole or a rank's piece) in: kv_b_proj as
    [heads, nope + v, kv_lora], every other parameter as it is."""
    if not stored_per_head(name):
        return tuple(shape)
    per_head = cfg.qk_nope_head_dim + cfg.v_head_dim
    return shape[0] // per_head, per_head, shape[1]


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
        except (OSError, ValueError, RecursionError) as e:
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
        outside = [name for name in (*manifest.weights, *manifest.files) if not is_local_name(name)]
        if outside:
            raise EngineError(f"{path}: fields 'weights' / 'files' name {outside[0]!r}, not a file name inside "
                              f"{engine_dir}; expected a relative name without '..'")
        if raw.get("backend") != build.backend:
            raise EngineError(f"{path}: field 'backend' is {raw.get('backend')!r}, expected {build.backend!r} as in 'build'")
        if stored_hash != manifest.content_hash:
            raise EngineError(
                f"{path}: content_hash does not match the model_config, build and file hashes it lists; "
                "engine.json was edited or is corrupt, rebuild the engine"
            )
        check_model_limits(model_config, build, f"{path}: field 'model_config'")
        return manifest

    def verify_files(self, engine_dir: Path, hashes: bool = True, skip: set[str] = frozenset(),
                     hash_weights: bool = True) -> dict[str, dict[str, TensorInfo]]:
        """Every weight file present and holding every byte its safetensors header declares (a truncated copy is
        refused from its header, without reading the weights); with `hashes`, every listed file present with its
        recorded sha256 (the weights' only with `hash_weights`: hundreds of GB of a release take minutes); files in
        `skip` are left to another rank. Returns each checked weight file's header."""
        headers = {}
        for name in self.weights:
            if name in skip:
                continue
            if not (engine_dir / name).is_file():
                raise EngineError(
                    f"{engine_dir / name}: weight file missing, expected {len(self.weights)} "
                    f"({', '.join(self.weights)}) for tp_size {self.build.tp_size}"
                )
            try:
                headers[name] = read_safetensors_header(engine_dir / name)
            except CheckpointError as e:
                raise EngineError(f"{e}; rebuild the engine or copy the file again") from None
        if not hashes:
            return headers
        for name, digest in self.files.items():
            if name in skip:
                continue
            file = engine_dir / name
            if not file.is_file():
                raise EngineError(f"{file}: file missing, expected it as listed in {ENGINE_JSON}")
            if name in self.weights and not hash_weights:
                continue
            got = file_sha256(file)
            if got != digest:
                raise EngineError(
                    f"{file}: content hash mismatch (sha256 {got[:16]}..., expected {digest[:16]}... "
                    f"from {ENGINE_JSON}); the file changed or is corrupt, rebuild the engine"
                )
        return headers


def tokenizer_dir(path: str | Path) -> Path:
    """Where an engine directory (or a checkpoint) keeps its tokenizer: a --backend trtllm engine's is in its HF_DIR."""
    return Path(path) / HF_DIR if engine_backend(path) == "trtllm" else Path(path)


def read_manifest(path: str | Path) -> EngineManifest | None:
    """engine.json of an engine directory (EngineError where it is unreadable); None where there is none (a plain
    checkpoint, or no model)."""
    path = Path(path)
    return EngineManifest.read(path) if (path / ENGINE_JSON).is_file() else None


def engine_backend(path: str | Path) -> str | None:
    """The backend an engine directory was built for ("native" or "trtllm"); None for anything else (a plain
    checkpoint, an unreadable engine.json: loading it says what is wrong)."""
    try:
        manifest = read_manifest(path)
    except EngineError:
        return None
    return None if manifest is None else manifest.build.backend


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# ---- limits of a plain checkpoint -----------------------------------------------------------
def released_quant_algo(fp8_weights: bool) -> str | None:
    """The quant_algo of weights as DeepSeek releases them: FP8 ones are 128x128 block-scaled; None for wider ones."""
    return "FP8_BLOCK_SCALES" if fp8_weights else None


def default_max_seq_len(cfg: ModelConfig) -> int:
    """max_seq_len without a flag, for a plain checkpoint and a build alike: what the model allows, capped so that
    the KV cache of the default batch stays small."""
    return min(cfg.max_position_embeddings, HF_MAX_SEQ_LEN)


def checkpoint_limits(ckpt: HFCheckpoint) -> BuildConfig:
    """What a plain checkpoint is served with: default limits within what the model allows."""
    cfg = ckpt.config
    return BuildConfig(max_seq_len=default_max_seq_len(cfg),
                       max_draft_len=DEFAULT_MAX_DRAFT_LEN if cfg.num_nextn_predict_layers else 0,
                       quant_algo=released_quant_algo(ckpt.stored_fp8))


def read_limits(path: str | Path, manifest: EngineManifest | None = None) -> tuple[ModelConfig, BuildConfig]:
    """The model config and the limits an executor on `path` (engine directory or HF checkpoint) starts from,
    read without touching the weights (from `manifest` where engine.json was read already)."""
    path = Path(path)
    manifest = manifest or read_manifest(path)
    if manifest is not None:
        return manifest.model_config, manifest.build
    try:
        ckpt = HFCheckpoint(path)
    except (CheckpointError, ConfigError) as e:
        raise EngineError(str(e)) from e
    return ckpt.config, checkpoint_limits(ckpt)


def with_draft_len(spec: Mapping[str, Any], k: int) -> dict[str, Any]:
    """`spec` drafting k, under both names at one value: 2026's name, and the one 1.0 / 1.1 read (max_draft_len alone
    would draft one token there)."""
    return {**spec, **dict.fromkeys(DRAFT_LEN_NAMES, k)}
