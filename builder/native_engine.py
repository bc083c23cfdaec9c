"""TensorRT-LLM checkpoint -> native engine directory, with the build-time work done once.

Per rank, the fused TensorRT-LLM tensors are cut back into the runtime's parameters (fused_a ->
q_a_proj + kv_a_proj_with_mqa, expert mlp.fc -> up_proj + gate_proj stacked [E, out, in], ...),
kv_b_proj is stored per head as [heads, nope + v, kv_lora] (the W_UK / W_UV split of absorbed
MLA is then a view), FP8 weights keep their scales, and engine.json records the model, the
limits and the hashes. Rank files stay separate: `runtime.io.loading.load_engine` merges them.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from tqdm import tqdm

from builder.validation import BuildError, copy_tokenizer, quant_algo_flag, validate_build
from builder.rank_file import RankFileWriter
from builder.trtllm_layout import (DEVICE_LIMITED, DEVICE_LIMITED_RENORM, NORMALIZATION_MODES, TensorLayout,
                                   rank_layout, trtllm_config)
from runtime.io.atomic import new_output_dir
from runtime.io.checkpoint import SAFETENSORS_CODES, SCALE_CODE, SCALE_SUFFIX, read_safetensors_header
from runtime.model.config import ModelConfig, is_int
from runtime.io.engine_format import QUANT_ALGOS, BuildConfig, EngineError, EngineManifest, stored_shape

BUILDER_VERSION = importlib.metadata.version("dsv3-mtp")


@dataclass(frozen=True)
class TrtllmCheckpoint:
    """A TensorRT-LLM checkpoint directory as `builder.convert` writes it."""

    path: Path
    model_config: ModelConfig
    build: BuildConfig  # dtype, tp_size, ep_size, quant_algo and max_draft_len it was converted with

    @property
    def rank_files(self) -> list[Path]:
        return [self.path / f"rank{r}.safetensors" for r in range(self.build.tp_size)]

    @classmethod
    def read(cls, path: str | Path) -> "TrtllmCheckpoint":
        """Parse config.json and check every rank file's header against the layout it implies."""
        path = Path(path)
        source = path / "config.json"
        if not source.is_file():
            raise BuildError(f"{source}: file not found, expected a TensorRT-LLM checkpoint directory")
        try:
            raw = json.loads(source.read_text())
        except (ValueError, RecursionError) as e:
            raise BuildError(f"{source}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise BuildError(f"{source}: expected a JSON object")
        for name in ("mapping", "quantization", "moe", "speculative_decoding"):
            if raw.get(name) is not None and not isinstance(raw[name], dict):
                raise BuildError(f"{source}: field {name!r} must be an object, got {raw[name]!r}")
        cfg = model_config_from_trtllm(raw, str(source))
        mapping, quant = raw.get("mapping") or {}, raw.get("quantization") or {}
        tp, ep, moe_tp = mapping.get("tp_size", 1), mapping.get("moe_ep_size", 1), mapping.get("moe_tp_size", 1)
        for name, value in (("tp_size", tp), ("moe_ep_size", ep), ("moe_tp_size", moe_tp)):
            if not is_int(value) or value < 1:
                raise BuildError(f"{source}: field 'mapping.{name}' is {value!r}, expected a positive integer")
        if mapping.get("world_size", 1) != tp or mapping.get("pp_size", 1) != 1 or moe_tp * ep != tp:
            raise BuildError(
                f"{source}: field 'mapping' is {mapping}, expected world_size = tp_size, pp_size 1 "
                "and moe_tp_size * moe_ep_size = tp_size"
            )
        algo = quant.get("quant_algo")
        if algo not in QUANT_ALGOS:  # BuildConfig's check too, here naming the field as this file spells it
            raise BuildError(f"{source}: unsupported quantization: quant_algo {algo!r}, expected "
                             f"{', '.join(a for a in QUANT_ALGOS if a)} or null")
        try:
            build = BuildConfig(dtype=raw["dtype"], tp_size=tp, ep_size=ep, quant_algo=algo,
                                max_draft_len=(raw.get("speculative_decoding") or {}).get("max_draft_len", 0))
        except KeyError as e:
            raise BuildError(f"{source}: missing field {e}") from None
        except EngineError as e:
            raise BuildError(f"{source}: {e}") from None
        check_unread_fields(raw, cfg, build, str(source))
        ckpt = cls(path, cfg, build)
        ckpt.check_rank_files()
        return ckpt

    def check_rank_files(self) -> None:
        """Each rank file present, readable, and holding exactly the tensors, dtypes and shapes expected."""
        layout = rank_layout(self.model_config, self.build)
        expected = {}
        for t in layout:
            expected[t.tensor.name] = (SAFETENSORS_CODES[t.dtype], t.shape)
            if t.scale_shape is not None:
                expected[t.tensor.scale_name] = (SCALE_CODE, t.scale_shape)
        for file in self.rank_files:
            if not file.is_file():
                raise BuildError(
                    f"{file}: rank file missing, expected {self.build.tp_size} rank files for tp_size {self.build.tp_size}"
                )
            header = read_safetensors_header(file)
            for name, (dtype, shape) in expected.items():
                if name not in header:
                    raise BuildError(f"{file}: tensor {name!r} is missing, expected {dtype} {list(shape)}")
                got = header[name]
                if (got.dtype, got.shape) != (dtype, shape):
                    raise BuildError(
                        f"{file}: tensor {name!r} is {got.dtype} {list(got.shape)}, expected {dtype} {list(shape)}"
                    )
            extra = sorted(set(header) - set(expected))
            if extra:
                raise BuildError(f"{file}: unexpected tensor(s) {', '.join(extra[:5])}")


def model_config_from_trtllm(raw: dict[str, Any], source: str) -> ModelConfig:
    """ModelConfig back from a TensorRT-LLM config.json (the inverse of `convert.trtllm_config`)."""
    if raw.get("architecture") != "DeepseekV3ForCausalLM":
        raise BuildError(f"{source}: field 'architecture' is {raw.get('architecture')!r}, expected 'DeepseekV3ForCausalLM'")
    try:
        moe, spec = raw["moe"], raw["speculative_decoding"]
        fields = {
            "model_type": "deepseek_v3",
            "architectures": [raw["architecture"]],
            "torch_dtype": raw["dtype"],
            "n_routed_experts": moe["num_experts"],
            "num_experts_per_tok": moe["top_k"],
            "n_group": moe["device_limited_n_group"],
            "topk_group": moe["device_limited_topk_group"],
            "routed_scaling_factor": moe["device_limited_routed_scaling_factor"],
            "norm_topk_prob": moe["norm_topk_prob"],
            "scoring_func": moe["scoring_func"],
            "topk_method": moe["topk_method"],
            "moe_intermediate_size": raw["moe_inter_size"],
            "n_shared_experts": shared_experts(moe["shared_expert_intermediate_size"], raw["moe_inter_size"], source),
            "rms_norm_eps": raw["norm_epsilon"],
            "rope_theta": raw["rotary_base"],
            "rope_scaling": raw["rotary_scaling"],
            "num_nextn_predict_layers": spec["num_nextn_predict_layers"],
        }
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "first_k_dense_replace", "moe_layer_freq", "max_position_embeddings",
                     "bos_token_id", "eos_token_id"):
            fields[name] = raw[name]
    except KeyError as e:
        raise BuildError(f"{source}: missing field {e}, expected a DeepSeek-V3 TensorRT-LLM checkpoint config") from None
    except TypeError as e:
        raise BuildError(f"{source}: malformed field ({e}), expected a DeepSeek-V3 TensorRT-LLM checkpoint config") from None
    return ModelConfig.from_dict(fields, source=source)


# Fields of the converter's config.json that the build does not read back but that say what the math (or the
# rank layout) is, with why the converter writes what it does; the value is checked, not ignored.
_UNREAD_FIELDS: dict[str, Callable[[ModelConfig], str]] = {
    "moe.normalization_mode": lambda c: (f"TensorRT-LLM's {NORMALIZATION_MODES[DEVICE_LIMITED_RENORM]}: the top-k "
                                         "weights renormalized, as moe.norm_topk_prob true says" if c.norm_topk_prob
                                         else f"TensorRT-LLM's {NORMALIZATION_MODES[DEVICE_LIMITED]}: the top-k "
                                         "weights as scored, as moe.norm_topk_prob false says"),
    "topk_method": lambda c: "moe.topk_method",
    "scoring_func": lambda c: "moe.scoring_func",
    "hidden_act": lambda c: "DeepSeek-V3's SiLU-gated MLP",
    "position_embedding_type": lambda c: "DeepSeek-V3's rotary embedding",
    "head_size": lambda c: "kv_lora_rank + qk_rope_head_dim",
    "logits_dtype": lambda c: "the logits computed in float32",
    "use_parallel_embedding": lambda c: "the embedding split across ranks",
    "embedding_sharding_dim": lambda c: "the embedding split by vocabulary rows",
    "quantization.kv_cache_quant_algo": lambda c: "the KV cache stored unquantized",
    "quantization.group_size": lambda c: "FP8 blocks of 128x128",
    "quantization.exclude_modules": lambda c: "the modules kept unquantized",
    "speculative_decoding.decoding_type": lambda c: f"num_nextn_predict_layers {c.num_nextn_predict_layers}",
    "speculative_decoding.draft_layer_prefix": lambda c: "the MTP layers' tensor names",
}


def check_unread_fields(raw: dict[str, Any], cfg: ModelConfig, build: BuildConfig, source: str) -> None:
    """Each field in `_UNREAD_FIELDS` that config.json holds must be what `trtllm_config` writes for the model and
    build read from it: a contradiction (moe.normalization_mode against moe.norm_topk_prob, a hidden_act other than
    DeepSeek-V3's) is refused rather than built as DeepSeek-V3's math without a word."""
    written = trtllm_config(cfg, build)
    for field, why in _UNREAD_FIELDS.items():
        *outer, name = field.split(".")
        got = (raw.get(outer[0]) or {}) if outer else raw  # a field left out contradicts nothing
        want = written[outer[0]] if outer else written
        if name in got and got[name] != want[name]:
            raise BuildError(f"{source}: field {field!r} is {got[name]!r}, expected {want[name]!r} ({why(cfg)})")


def shared_experts(shared_intermediate_size: Any, moe_inter_size: Any, source: str) -> int:
    """n_shared_experts back from moe.shared_expert_intermediate_size (their product) and moe_inter_size."""
    if not (is_int(shared_intermediate_size) and is_int(moe_inter_size) and moe_inter_size > 0
            and shared_intermediate_size > 0 and shared_intermediate_size % moe_inter_size == 0):
        raise BuildError(f"{source}: field 'moe.shared_expert_intermediate_size' is {shared_intermediate_size!r}, "
                         f"expected a positive multiple of moe_inter_size ({moe_inter_size!r})")
    return shared_intermediate_size // moe_inter_size


def check_matches_checkpoint(ckpt: TrtllmCheckpoint, given: dict[str, Any]) -> None:
    """dtype, tp_size, ep_size and quant_algo are fixed by the conversion: `given` values must be the checkpoint's."""
    for name, got in given.items():
        want = getattr(ckpt.build, name)
        if got != want:
            shown = (quant_algo_flag(got), quant_algo_flag(want)) if name == "quant_algo" else (got, want)
            raise BuildError(f"--{name} {shown[0]} differs from the checkpoint's {shown[1]} ({ckpt.path / 'config.json'}); "
                             "convert again or leave it out")


def build_engine(checkpoint_dir: str | Path, output_dir: str | Path, build: BuildConfig, *,
                 tokenizer_dir: str | Path | None = None, force: bool = False, progress: bool = True) -> Path:
    """Write the native engine for a TensorRT-LLM checkpoint; return output_dir.

    dtype, tp_size, ep_size and quant_algo are the checkpoint's: `build` must agree with them.
    """
    ckpt = TrtllmCheckpoint.read(checkpoint_dir)
    source = str(ckpt.path / "config.json")
    check_matches_checkpoint(ckpt, {name: getattr(build, name) for name in ("dtype", "tp_size", "ep_size", "quant_algo")})
    if build.backend != "native":
        raise BuildError(f"--backend {build.backend}: a TensorRT-LLM checkpoint builds native engines only; "
                         "use --model_dir for --backend trtllm")
    validate_build(ckpt.model_config, build, source)
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else ckpt.path
    layout = rank_layout(ckpt.model_config, build)
    cfg = ckpt.model_config
    with new_output_dir(Path(output_dir), force) as tmp:
        tokenizer_files = copy_tokenizer(tokenizer_dir, tmp)
        weights = []
        for rank, file in enumerate(tqdm(ckpt.rank_files, desc="build", unit="rank", disable=not progress)):
            weights.append(f"rank{rank}.safetensors")
            _build_rank(file, tmp / weights[-1], layout, cfg)
        manifest = EngineManifest.create(tmp, dataclasses.replace(cfg, torch_dtype=build.dtype), build, weights,
                                         tokenizer_files, BUILDER_VERSION)
        manifest.write(tmp)
    return Path(output_dir)


def _build_rank(src: Path, dst: Path, layout: list[TensorLayout], cfg: ModelConfig) -> None:
    """Cut one TensorRT-LLM rank file into runtime parameters, one (expert) slice at a time."""
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for t in layout:
        for p in t.parts:
            specs[p.name] = (t.dtype, stored_shape(p.name, p.shape, cfg))
            if p.scale_shape is not None:
                specs[p.name + SCALE_SUFFIX] = (torch.float32, p.scale_shape)
    with safe_open(src, "pt") as f, RankFileWriter(dst, specs) as writer:
        for t in layout:
            data, scale = f.get_slice(t.tensor.name), f.get_slice(t.tensor.scale_name) if t.scale_shape is not None else None
            if len(t.shape) == 3:  # stacked experts
                for e in range(t.shape[0]):
                    _write_parts(writer, t, data[e], None if scale is None else scale[e], e)
            else:
                _write_parts(writer, t, data[:], None if scale is None else scale[:], 0)


def _write_parts(writer: RankFileWriter, t: TensorLayout, data: torch.Tensor, scale: torch.Tensor | None,
                 local: int) -> None:
    """Write each part of fused `data` (one expert's, for stacked tensors) at its runtime parameter."""
    for p in t.parts:
        per_expert = p.shape[1:] if len(t.shape) == 3 else p.shape
        piece = data if data.dim() == 1 else data[p.row:p.row + per_expert[-2]]
        writer.write(p.name, piece, local * piece.numel())
        if scale is not None:
            if scale.dim() >= 2:  # block grid rows of this part
                s = scale[p.scale_row:p.scale_row + p.scale_shape[-2]]
            else:  # per-tensor: one scale per part
                s = scale[p.scale_row]
            writer.write(p.name + SCALE_SUFFIX, s, local * s.numel())
