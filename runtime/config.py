"""Configuration read once from a DeepSeek-V3 `config.json` into frozen dataclasses.

Every other module takes a `ModelConfig`; nobody else parses the JSON. Errors name the file and
the field, because a user with a 671B checkpoint needs to know which of 40 fields is wrong.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that is missing, unreadable or describes a model we cannot run."""


POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "n_shared_experts",
                 "moe_layer_freq", "max_position_embeddings")
NON_NEGATIVE_INTS = ("num_nextn_predict_layers", "first_k_dense_replace")
POSITIVE_NUMBERS = ("routed_scaling_factor", "rms_norm_eps", "rope_theta")


def is_int(value: Any) -> bool:
    """Python and numpy integers; not bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """Python and numpy reals; not bools."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_positive_number(value: Any) -> bool:
    return is_number(value) and 0 < value < math.inf


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (`rope_scaling` in config.json). Both mscale keys matter."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None  # None when config.json leaves the key out (it changes the cos/sin scale)
    mscale_all_dim: float | None = None
    type: str = "yarn"


@dataclass(frozen=True)
class QuantizationConfig:
    """`quantization_config` of the FP8 release: e4m3 weights with 128x128 block scales."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] = (128, 128)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    q_lora_rank: int | None = None
    num_nextn_predict_layers: int = 0
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    quantization_config: QuantizationConfig | None = None
    model_type: str = "deepseek_v3"
    architectures: tuple[str, ...] = ("DeepseekV3ForCausalLM",)
    torch_dtype: str = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    # ---- derived quantities -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: normalized c_kv plus the roped shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """192^-0.5 times mscale^2 for YaRN (mscale from mscale_all_dim), as DeepSeek and HF do."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

    # ---- JSON ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        if raw.get("model_type") != "deepseek_v3":
            raise ConfigError(
                f"{source}: field 'model_type' is {raw.get('model_type')!r}, expected 'deepseek_v3'"
            )
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        required = [
            n for n, f in cls.__dataclass_fields__.items()
            if f.default is MISSING and f.default_factory is MISSING
        ]
        missing = [n for n in required if n not in raw]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
        kwargs: dict[str, Any] = {k: raw[k] for k in known if k in raw}
        for name in POSITIVE_INTS + NON_NEGATIVE_INTS:
            low = 1 if name in POSITIVE_INTS else 0
            if name in kwargs and (not is_int(kwargs[name]) or kwargs[name] < low):
                raise ConfigError(f"{source}: field {name!r} must be an integer >= {low}, got {kwargs[name]!r}")
        for name in POSITIVE_NUMBERS:
            value = kwargs.get(name, 1.0)
            if not _is_positive_number(value):
                raise ConfigError(f"{source}: field {name!r} must be a number > 0, got {value!r}")
        if kwargs.get("q_lora_rank") is not None and not (is_int(kwargs["q_lora_rank"]) and kwargs["q_lora_rank"] > 0):
            raise ConfigError(f"{source}: field 'q_lora_rank' must be an integer >= 1 or null")
        for name in ("rope_scaling", "quantization_config"):
            if raw.get(name) is not None and not isinstance(raw[name], dict):
                raise ConfigError(f"{source}: field {name!r} must be an object or null, got {raw[name]!r}")
        if raw.get("rope_scaling") is not None:
            rs = dict(raw["rope_scaling"])
            rs_type = rs.pop("type", rs.pop("rope_type", "yarn"))
            if rs_type != "yarn":
                raise ConfigError(f"{source}: field 'rope_scaling.type' is {rs_type!r}, expected 'yarn'")
            allowed = RopeScaling.__dataclass_fields__
            try:
                kwargs["rope_scaling"] = RopeScaling(type=rs_type, **{k: v for k, v in rs.items() if k in allowed})
            except TypeError as e:
                raise ConfigError(f"{source}: field 'rope_scaling': {e}") from None
        if raw.get("quantization_config") is not None:
            q = dict(raw["quantization_config"])
            if q.get("quant_method") != "fp8":
                raise ConfigError(
                    f"{source}: field 'quantization_config.quant_method' is {q.get('quant_method')!r}, "
                    "expected 'fp8'"
                )
            block = q.get("weight_block_size", [128, 128])
            if not (isinstance(block, list) and len(block) == 2 and all(is_int(b) and b > 0 for b in block)):
                raise ConfigError(f"{source}: field 'quantization_config.weight_block_size' must be two integers "
                                  f">= 1, got {block!r}")
            q["weight_block_size"] = tuple(block)
            kwargs["quantization_config"] = QuantizationConfig(
                **{k: v for k, v in q.items() if k in QuantizationConfig.__dataclass_fields__}
            )
        if "architectures" in kwargs:
            archs = kwargs["architectures"]
            if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
                raise ConfigError(f"{source}: field 'architectures' must be a list of strings, got {archs!r}")
            kwargs["architectures"] = tuple(archs)
        if isinstance(kwargs.get("eos_token_id"), list):
            if not kwargs["eos_token_id"]:
                raise ConfigError(f"{source}: field 'eos_token_id' must be a token id or a non-empty list of them")
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        kwargs["extra"] = {k: v for k, v in raw.items() if k not in known}
        cfg = cls(**kwargs)
        cfg.validate(source)
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: file not found")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        extra = out.pop("extra")
        out["architectures"] = list(self.architectures)
        if self.rope_scaling is None:
            out["rope_scaling"] = None
        if self.quantization_config is not None:
            out["quantization_config"]["weight_block_size"] = list(self.quantization_config.weight_block_size)
        else:
            out.pop("quantization_config")
        if out["num_key_value_heads"] is None:
            out["num_key_value_heads"] = self.num_attention_heads
        return {**extra, **out}

    def validate(self, source: str = "config.json") -> None:
        def bad(field_name: str, expected: str) -> ConfigError:
            return ConfigError(f"{source}: field {field_name!r} is {getattr(self, field_name)!r}, expected {expected}")

        if self.scoring_func != "sigmoid":
            raise bad("scoring_func", "'sigmoid'")
        if self.topk_method != "noaux_tc":
            raise bad("topk_method", "'noaux_tc'")
        if self.n_routed_experts % self.n_group:
            raise bad("n_group", f"a divisor of n_routed_experts ({self.n_routed_experts})")
        if self.n_routed_experts // self.n_group < 2:
            raise bad("n_group", "at most n_routed_experts / 2 (each group needs 2 experts)")
        if not 1 <= self.topk_group <= self.n_group:
            raise bad("topk_group", f"between 1 and n_group ({self.n_group})")
        if not 1 <= self.num_experts_per_tok <= self.topk_group * self.n_routed_experts // self.n_group:
            raise bad("num_experts_per_tok", "at most the experts in the selected groups")
        if self.qk_rope_head_dim % 2:
            raise bad("qk_rope_head_dim", "an even number")
        if self.num_nextn_predict_layers < 0:
            raise bad("num_nextn_predict_layers", ">= 0")
        # fields the model reads but does not vary on: any other value would be silently ignored
        for name in ("norm_topk_prob", "tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")
        if self.hidden_act != "silu":
            raise bad("hidden_act", "'silu'")
        if self.tie_word_embeddings:
            raise bad("tie_word_embeddings", "false (DeepSeek-V3's lm_head is a weight of its own)")
        if self.attention_bias:
            raise bad("attention_bias", "false (DeepSeek-V3's attention has no biases)")
        if not is_int(self.eos_token_id):
            raise bad("eos_token_id", "a token id")
        if self.bos_token_id is not None and not is_int(self.bos_token_id):
            raise bad("bos_token_id", "a token id or null")
        if self.num_key_value_heads is not None and not (is_int(self.num_key_value_heads) and self.num_key_value_heads > 0):
            raise bad("num_key_value_heads", "an integer >= 1 or null")
        rs = self.rope_scaling
        if rs is not None:
            for name in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
                value = getattr(rs, name)
                if value is None and name.startswith("mscale"):
                    continue
                if not _is_positive_number(value):
                    raise ConfigError(f"{source}: field 'rope_scaling.{name}' must be a number > 0, got {value!r}")
            if not (is_int(rs.original_max_position_embeddings) and rs.original_max_position_embeddings > 0):
                raise ConfigError(f"{source}: field 'rope_scaling.original_max_position_embeddings' must be an "
                                  f"integer >= 1, got {rs.original_max_position_embeddings!r}")
        q = self.quantization_config
        if q is not None and (q.fmt, q.activation_scheme) != ("e4m3", "dynamic"):
            raise ConfigError(f"{source}: field 'quantization_config' has fmt {q.fmt!r} and activation_scheme "
                              f"{q.activation_scheme!r}, expected 'e4m3' and 'dynamic' (the release's FP8)")


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
