"""An engine directory or a Hugging Face checkpoint, loaded straight into the model's final form.

The model is built on the meta device; where the CPU kernels run, their modules are swapped in first
(`runtime.model.kernels.modules.prepare`), and in a bfloat16 model on CUDA the FP8 modules
(`runtime.model.fp8_linear.prepare`), chosen by how each weight is stored. Then every tensor is read from its
file (no memory map) and goes once into its final form: FP8 codes and scales into those modules as they are,
everything else into its parameter (dequantized where a PyTorch module needs real values). No
copy of the whole model in another form ever exists: loading peaks at the kept weights plus one tensor.
A rank of a tensor-parallel run (`par`) reads its own rank file alone, into its part of the model
(`runtime.model.parallel`); a single process joins an engine's rank files here, tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import Tensor

from runtime.io.checkpoint import (FP8_CODE, SCALE_SUFFIX, TORCH_DTYPES, CheckpointError, HFCheckpoint, Scratch,
                                check_finite, check_stored_dtypes, read_tensor)
from runtime.model.config import ConfigError, ModelConfig
from runtime.io.engine_format import (DTYPES, ENGINE_JSON, BuildConfig, EngineError, EngineManifest, checkpoint_limits,
                            shard_index, shard_shape, split_dim, stored_per_head, stored_shape)
from runtime.model.fp8 import FP8_DTYPE, covering_blocks, dequantize_block_fp8, dequantize_tensor_fp8, scale_shape
from runtime.model import fp8_linear
from runtime.model.kernels import modules as kernel_modules
from runtime.model.deepseek_v3 import DeepseekV3ForCausalLM
from runtime.model.parallel import WHOLE, Parallel
from runtime.io.weights import parameter_shapes, to_internal, to_release

log = logging.getLogger(__name__)

Weight = tuple[str, "int | None", Tensor, "Tensor | None"]  # parameter, expert index, tensor as stored, FP8 scale


@dataclass
class LoadedEngine:
    model: DeepseekV3ForCausalLM  # eval mode, on its device, in build.dtype, requires_grad False
    model_config: ModelConfig
    build: BuildConfig  # as built, with dtype the one loaded
    path: Path  # the engine or checkpoint directory, its tokenizer's too
    built: bool = True  # False for a plain HF checkpoint: its limits are defaults, not build choices


def load_engine(path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
                *, verify: bool = True, cpu_kernels: bool = True, fp8_weights: bool | None = None,
                par: Parallel = WHOLE, manifest: EngineManifest | None = None) -> LoadedEngine:
    """Load an engine directory (engine.json) or a plain HF DeepSeek-V3 checkpoint directory.

    dtype overrides the engine's build dtype; verify=False skips hashing the files (big engines);
    cpu_kernels: on CPU in float32, run the C++ kernels with the weights as stored (runtime.model.kernels.modules);
    fp8_weights: in bfloat16, keep FP8-stored weights FP8 (runtime.model.fp8_linear) rather than dequantize them at
    load: None (default) where a fast FP8 product runs (GPUs of compute capability 8.9 or newer), True everywhere,
    False never;
    par: one rank of the engine's tp_size, which loads its rank file alone (default: the whole model);
    manifest: engine.json as the caller read it (read here when None).
    """
    path = Path(path)
    if par.size > 1:
        source = _RankSource(path, verify, par, manifest)
    elif (path / ENGINE_JSON).is_file():
        source = _EngineSource(path, verify, manifest)
    elif (path / "config.json").is_file():
        source = _CheckpointSource(path)
    else:
        raise EngineError(f"{path}: neither {ENGINE_JSON} nor config.json found, expected an engine directory "
                          "(from build_engine) or a Hugging Face DeepSeek-V3 checkpoint directory")
    build = _as_loaded(source.build, dtype)
    device = torch.device(device)
    kernels_here = cpu_kernels and kernel_modules.cpu_kernels_serve(device, build.torch_dtype)
    fp8_here = not kernels_here and fp8_linear.keeps_fp8(device, build.torch_dtype, fp8_weights)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(source.cfg, par)
        if fp8_here:  # its modules' buffers are allocated on the device, below
            fp8_linear.prepare(model, source.stored_dtype, build.torch_dtype)
    if kernels_here:
        kernel_modules.prepare(model, source.stored_dtype)
    _materialize(model, device, build.torch_dtype)
    model.eval().requires_grad_(False)
    try:
        fill(model, source.weights(), str(path))
    except (CheckpointError, ConfigError) as e:
        raise EngineError(str(e)) from e
    if kernels_here:
        kernel_modules.finish(model)
    if fp8_here:
        fp8_linear.finish(model, keep_all=fp8_weights is True)
    return LoadedEngine(model, source.cfg, build, path, built=source.built)


def _as_loaded(build: BuildConfig, dtype: str | torch.dtype | None) -> BuildConfig:
    """The build with the dtype the model is loaded in (the `dtype` argument overrides the built one)."""
    if dtype is None:
        return build
    name = {v: k for k, v in DTYPES.items()}.get(dtype, dtype)
    if name not in DTYPES:
        raise EngineError(f"dtype {dtype!r} is not supported, expected one of {', '.join(DTYPES)}")
    return dataclasses.replace(build, dtype=name)


def _materialize(model: DeepseekV3ForCausalLM, device: torch.device, dtype: torch.dtype) -> None:
    """Allocate the parameters left in PyTorch modules, uninitialized (the weights overwrite all of them), in
    `dtype` on `device`; buffers stay fp32.

    On CPU, matmul weights keep their [out, in] shape but are stored K-major (each [in, out] contiguous):
    F.linear then runs x @ W as a plain NN gemm, which MKL does faster for a few rows. Embedding tables
    stay row-major for their lookups. On CUDA every weight stays row-major, the layout cuBLAS and
    cuBLASLt are tuned for (measured: docs/gpu.md).
    """
    k_major = device.type == "cpu"
    for name, p in model.named_parameters():
        p.data = p.data.to(dtype)
        if k_major and p.dim() >= 2 and not name.endswith("embed_tokens.weight"):
            p.data = p.data.mT.contiguous().mT
    # meta tensors allocated empty (to_empty's empty_like takes torch's reference path for them, whose first use
    # imports sympy: seconds); the rest, RoPE's frequencies computed at build, moved as they are
    model._apply(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device) if t.is_meta
                 else t.to(device))


def fill(model: DeepseekV3ForCausalLM, weights: Iterable[Weight], source: str) -> None:
    """Put each weight into its place in its final form; every place must be filled exactly once."""
    cfg = model.cfg
    modules = dict(model.named_modules())
    linears, experts = _LINEARS_AS_STORED, _EXPERTS_AS_STORED
    as_stored = {n for n, m in modules.items() if isinstance(m, linears + experts)}  # they load their own tensors
    params = {n: p for n, p in [*model.named_parameters(), *model.named_buffers()]
              if n != "inv_freq" and n.rpartition(".")[0] not in as_stored}
    places = set(params) | {f"{n}.weight" for n, m in modules.items() if isinstance(m, linears)} | \
        {f"{n}.{p}" for n, m in modules.items() if isinstance(m, experts) for p in ("gate_proj", "up_proj", "down_proj")}
    filled: dict[str, int] = {}
    with torch.no_grad():
        for name, expert, tensor, scale in weights:
            owner, _, attr = name.rpartition(".")
            module = modules.get(owner)
            if name not in places:
                raise EngineError(f"{source}: unexpected tensor {to_release(name, cfg)!r}")
            if isinstance(module, linears):
                try:
                    module.load(tensor, scale)
                except ValueError as e:
                    raise EngineError(f"{source}: tensor {to_release(name, cfg)!r}: {e}") from None
            elif isinstance(module, experts):
                if scale is None:
                    raise EngineError(f"{source}: tensor {to_release(name, cfg)!r} is {tensor.dtype}, expected FP8 "
                                      "(its layer's experts are stored as FP8)")
                module.load(attr, expert, tensor, scale)
            else:
                value = tensor if scale is None else _dequantized(name, tensor, scale, source)
                target = params[name] if expert is None else params[name][expert]
                if tuple(target.shape) != tuple(value.shape):
                    raise EngineError(f"{source}: tensor {to_release(name, cfg)!r} has shape {list(value.shape)}, "
                                      f"expected {list(target.shape)}")
                target.copy_(value)
            filled[name] = filled.get(name, 0) + (1 if expert is not None else cfg.n_routed_experts
                                                  if name.endswith(_EXPERTS) else 1)
    for name in places:
        want = cfg.n_routed_experts if name.endswith(_EXPERTS) else 1
        if filled.get(name, 0) != want:
            raise EngineError(f"{source}: tensor {to_release(name, cfg)!r} is missing")


_EXPERTS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
_LINEARS_AS_STORED = (kernel_modules.PackedLinear, fp8_linear.FP8Linear)
_EXPERTS_AS_STORED = (kernel_modules.PackedExperts, fp8_linear.FP8Experts)


def _dequantized(name: str, t: Tensor, scale: Tensor, source: str) -> Tensor:
    """FP8 codes times their scales: per 128x128 block (per expert when stacked), or one per tensor (expert)."""
    try:
        if scale.dim() < t.dim():
            return dequantize_tensor_fp8(t, scale.view(*scale.shape, 1, 1))
        if t.dim() == 3:  # one expert at a time: a stack's fp32 temporaries would be 3x the stack
            return torch.stack([dequantize_block_fp8(q, s) for q, s in zip(t, scale)])
        return dequantize_block_fp8(t, scale)
    except (ValueError, RuntimeError) as e:
        raise EngineError(f"{source}: tensor {name + SCALE_SUFFIX!r} of shape {list(scale.shape)} does not fit "
                          f"{name!r} of shape {list(t.shape)} ({e})") from None


# ---- sources ------------------------------------------------------------------------------------------------
class _CheckpointSource:
    """A released checkpoint (HF layout), read shard by shard, with default limits."""

    built = False

    def __init__(self, path: Path):
        try:
            self.ckpt = HFCheckpoint(path)
            self.ckpt.validate()  # headers only: names, shapes, dtypes
        except (CheckpointError, ConfigError) as e:
            raise EngineError(str(e)) from e
        self.cfg, self.build = self.ckpt.config, checkpoint_limits(self.ckpt)

    def stored_dtype(self, name: str) -> torch.dtype | None:
        release = to_release(name, self.cfg)
        if release.endswith(_EXPERTS):
            prefix, _, proj = release.rpartition(".")
            release = f"{prefix}.0.{proj}.weight"
        names = self.ckpt.weight_map
        return TORCH_DTYPES[self.ckpt.tensor_info(release).dtype] if release in names else None

    def weights(self) -> Iterator[Weight]:
        for name, tensor, scale in self.ckpt.iter_weights():
            internal, expert = to_internal(name, self.cfg)
            yield internal, expert, tensor, scale


def _native_manifest(path: Path, manifest: EngineManifest | None) -> EngineManifest:
    """engine.json of a native engine with one weight file per rank (`manifest`, or read here)."""
    manifest = manifest or EngineManifest.read(path)
    if manifest.build.backend == "trtllm":
        raise EngineError(
            f"{path}: built with --backend trtllm; run it with the TensorRT-LLM backend "
            f"(trtllm-serve {path / 'hf'} --backend pytorch --extra_llm_api_options "
            f"{path / 'extra_llm_api_options.yaml'}) or rebuild with --backend native")
    ranks = [f"rank{r}.safetensors" for r in range(manifest.build.tp_size)]
    if list(manifest.weights) != ranks:  # a file's place in the list is its rank: the files carry no rank of their own
        raise EngineError(f"{path / ENGINE_JSON}: field 'weights' is {list(manifest.weights)}, expected {ranks} (one "
                          f"file per rank of tp_size {manifest.build.tp_size}, in rank order, as build_engine writes)")
    return manifest


class _RankSource:
    """One rank's file of an engine directory, its tensors as stored: FP8 pieces with their own block scales
    (the converter cuts every piece on its own 128x128 grid), the rest as they are."""

    built = True

    def __init__(self, path: Path, verify: bool, par: Parallel, manifest: EngineManifest | None):
        manifest = _native_manifest(path, manifest)
        self.cfg, self.build, rank = manifest.model_config, manifest.build, par.layout.rank
        if par.layout != self.build.layout(rank):
            raise EngineError(f"{path}: built for tp_size {self.build.tp_size}, ep_size {self.build.ep_size}; "
                              f"cannot run as rank {rank} of tp_size {par.layout.tp_size}, ep_size {par.layout.ep_size}")
        name = manifest.weights[rank]
        # rank 0 vouches for the files every rank shares (tokenizer); each rank for its own weights
        others = set(manifest.weights) - {name}
        headers = manifest.verify_files(path, hashes=verify, skip=others if rank == 0 else set(manifest.files) - {name})
        self.file, self.header = path / name, headers[name]
        self._scratch = Scratch()
        try:
            check_stored_dtypes(self.header, self.file)
        except CheckpointError as e:
            raise EngineError(str(e)) from None
        self.shapes = parameter_shapes(self.cfg)

    def stored_dtype(self, name: str) -> torch.dtype | None:
        info = self.header.get(name)
        return None if info is None else TORCH_DTYPES[info.dtype]

    def weights(self) -> Iterator[Weight]:
        for name, info in self.header.items():
            if name.endswith(SCALE_SUFFIX):
                continue
            if name not in self.shapes:
                raise EngineError(f"{self.file}: unexpected tensor {name!r}")
            tensor = check_finite(read_tensor(self.file, info, self._scratch), name, self.file)
            scale = None
            if info.dtype == FP8_CODE:  # its scale is there: check_stored_dtypes
                scale = check_finite(read_tensor(self.file, self.header[name + SCALE_SUFFIX]), name + SCALE_SUFFIX,
                                     self.file)
            if stored_per_head(name):
                tensor = tensor.flatten(0, 1)
            yield name, None, tensor, scale


class _EngineSource:
    """An engine directory: engine.json and one rank file per tensor-parallel rank, joined tensor by tensor."""

    built = True

    def __init__(self, path: Path, verify: bool, manifest: EngineManifest | None):
        manifest = _native_manifest(path, manifest)
        headers = manifest.verify_files(path, hashes=verify)
        self.cfg, self.build = manifest.model_config, manifest.build
        self.files = [path / f for f in manifest.weights]
        self.headers = [headers[f] for f in manifest.weights]
        self._scales: dict[str, Tensor | None] = {}  # the whole tensors' FP8 scales, once joined
        self._scratch = Scratch()  # each rank piece is read into it, then joined or consumed
        try:
            for header, file in zip(self.headers, self.files):
                check_stored_dtypes(header, file)
        except CheckpointError as e:
            raise EngineError(str(e)) from None
        self.shapes = parameter_shapes(self.cfg)

    def stored_dtype(self, name: str) -> torch.dtype | None:
        """How the tensor comes out of `weights`: as the rank files store it, except FP8 pieces whose block scales
        do not join into the whole tensor's, which come dequantized."""
        info = self.headers[0].get(name)
        if info is None:
            return None
        dtype = TORCH_DTYPES[info.dtype]
        if dtype != FP8_DTYPE:
            return dtype
        with torch.device("cpu"):  # asked while the model is built on the meta device: the scales are real
            return torch.float32 if self._whole_scale(name) is None else dtype

    def _full_shape(self, name: str) -> tuple[int, ...]:
        """The whole tensor's shape in the layout its rank pieces are stored in."""
        return stored_shape(name, self.shapes[name], self.cfg)

    def _ranks(self, name: str) -> range:
        return range(self.build.tp_size) if split_dim(name) is not None else range(1)

    def _whole_scale(self, name: str) -> Tensor | None:
        if name not in self._scales:
            self._scales[name] = self._join_scales(name)
        return self._scales[name]

    def _join_scales(self, name: str) -> Tensor | None:
        """The whole tensor's FP8 scales joined from its pieces': one per tensor (per expert) as every piece has
        it, or per 128x128 block where each piece's blocks lie on whole blocks of the whole tensor (it starts on
        one, or lies inside one) and pieces sharing a block agree on its scale; None where they do not join."""
        full = self._full_shape(name)
        lead = len(full) - 2
        scale = None
        for r in self._ranks(name):
            index = shard_index(name, full, self.build, r)
            piece = self._scale_piece(r, name, full)
            if piece.dim() == lead:  # per tensor (expert)
                scale = torch.empty(full[:lead]) if scale is None else scale
                scale[index[:lead]] = piece
                continue
            scale = torch.full((*full[:lead], *scale_shape(full[lead:])), float("nan")) if scale is None else scale
            blocks = [covering_blocks(i, n) for i, n in zip(index[lead:], full[lead:])]
            if None in blocks:
                return None  # a piece's block straddles two of the whole tensor's
            local = piece[(*[slice(None)] * lead, *(slice(0, b.stop - b.start) for b in blocks))]
            region = scale[(*index[:lead], *blocks)]
            if not torch.where(region.isnan(), local, region).equal(local):
                return None  # two pieces in one block of the whole tensor, with different scales
            scale[(*index[:lead], *blocks)] = local
        return scale

    def _scale_piece(self, rank: int, name: str, full: tuple[int, ...]) -> Tensor:
        """A rank's scale of `name`, checked to fit its piece: one per tensor (per expert), or one per block."""
        file, header = self.files[rank], self.headers[rank]
        info = header.get(name + SCALE_SUFFIX)
        if info is None:  # raw FP8 codes read as values would be a silently wrong model
            raise EngineError(f"{file}: FP8 tensor {name!r} has no {name + SCALE_SUFFIX!r}")
        scale = check_finite(read_tensor(file, info), name + SCALE_SUFFIX, file)
        shape = shard_shape(name, full, self.build)
        lead = shape[:-2]
        if tuple(scale.shape) not in (tuple(lead), (*lead, *scale_shape(shape[-2:]))):
            raise EngineError(f"{file}: tensor {name + SCALE_SUFFIX!r} of shape {list(scale.shape)} does not fit "
                              f"{name!r} of shape {list(shape)}")
        return scale

    def weights(self) -> Iterator[Weight]:
        for name in self.headers[0]:
            if name.endswith(SCALE_SUFFIX):
                continue
            if name not in self.shapes:
                raise EngineError(f"{self.files[0]}: unexpected tensor {name!r}")
            tensor, scale = self._joined(name)
            yield name, None, tensor, scale

    def _piece(self, rank: int, name: str, full: tuple[int, ...]) -> Tensor:
        file, info = self.files[rank], self.headers[rank].get(name)
        if info is None:
            raise EngineError(f"{file}: tensor {name!r} is missing from the rank files")
        want = shard_shape(name, full, self.build)
        if info.shape != want:
            raise EngineError(f"{file}: tensor {name!r} has shape {list(info.shape)}, expected {list(want)}")
        return check_finite(read_tensor(file, info, self._scratch), name, file)

    def _joined(self, name: str) -> tuple[Tensor, Tensor | None]:
        """The whole tensor from its rank pieces: FP8 codes with the whole tensor's scales where they join, else the
        values (dequantized piece by piece)."""
        full = self._full_shape(name)
        fp8 = self.headers[0][name].dtype == FP8_CODE
        scale = self._whole_scale(name) if fp8 else None
        if len(self._ranks(name)) == 1 and self.headers[0][name].shape == full and (scale is not None or not fp8):
            return self._piece(0, name, full).reshape(self.shapes[name]), scale  # whole already: no copy
        out = None
        for r in self._ranks(name):
            index = shard_index(name, full, self.build, r)
            t = self._piece(r, name, full)
            t = t[tuple(slice(0, i.stop - i.start) if i.start is not None else slice(None) for i in index)]
            if fp8 and scale is None:
                t = _dequantized(name, t, self._scale_piece(r, name, full), str(self.files[r]))
            if out is None:
                out = torch.empty(full, dtype=t.dtype)
            if t.dtype == FP8_DTYPE:  # copy_ knows no FP8: move the bytes
                out.view(torch.uint8)[index] = t.view(torch.uint8)
            else:
                out[index] = t
        if stored_per_head(name):
            out = out.reshape(self.shapes[name])
        return out, scale
