"""Configuration read once from a DeepSeek-V3 `config.json` into frozen dataclasses.

Every other module takes a `ModelConfig`; nobody else parses the JSON. Errors name the file and
the field, because a user with a 671B checkpoint needs to know which of 40 fields is wrong.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _warn_unread(source: str, fields: list[str]) -> None:
    """Fields the reader does not know: they may change the math, so they are named."""
    if fields:
        log.warning("%s: field(s) %s not read by this runtime; if they change the model's math, its output will be "
                    "wrong", source, ", ".join(fields))


class ConfigError(ValueError):
    """A config.json that is missing, unreadable or describes a model we cannot run."""


POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "n_shared_experts",
                 "moe_layer_freq", "max_position_embeddings")
NON_NEGATIVE_INTS = ("num_nextn_predict_layers", "first_k_dense_replace")
# Far above any DeepSeek release (V3: 61 layers, 256 experts, 1 MTP layer), low enough that the layout a config
# declares (every tensor's name, each rank's share) is listed in moments rather than growing without end
UPPER_BOUNDS = {"num_hidden_layers": 1024, "n_routed_experts": 4096, "num_nextn_predict_layers": 16}
POSITIVE_NUMBERS = ("routed_scaling_factor", "rms_norm_eps", "rope_theta")
# Fields that do not change what the model computes at inference: bookkeeping, training-only settings.
# Derived fields (head_dim, qk_head_dim, rope_interleave) are checked against what they derive from; any
# other field this reader does not know is named in a warning, since it may change the math.
NO_EFFECT = frozenset({"transformers_version", "_name_or_path", "auto_map", "use_cache", "initializer_range",
                       "attention_dropout", "pretraining_tp", "output_router_logits", "router_aux_loss_coef",
                       "aux_loss_alpha", "seq_aux", "pad_token_id", "dtype", "ep_size"})
# quantization_config keys that change nothing here: the weights' stored dtypes say which are FP8
# (modules_to_not_convert lists the wide ones), and `scale_fmt: ue8m0` (DeepSeek-V3.1) rounds the activations' FP8
# scales to powers of two in DeepSeek's kernels, where the CPU kernels keep activations unquantized and the GPU path
# scales them by their own maximum (docs/gpu.md)
QUANTIZATION_NO_EFFECT = frozenset({"modules_to_not_convert", "scale_fmt"})
# read into, or checked against, fields
DERIVED = ("rope_parameters", "head_dim", "qk_head_dim", "rope_interleave", "original_max_position_embeddings",
           "partial_rotary_factor")
# transformers' other names for fields (DeepseekV3Config.attribute_map): read as the field, refused where they differ
ALIASES = {"num_mtp_layers": "num_nextn_predict_layers", "num_local_experts": "n_routed_experts"}
# Keys of `rope_scaling` (transformers 4 and DeepSeek's release) and `rope_parameters` (transformers 5)
ROPE_KEYS = frozenset({"type", "rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                       "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate",
                       "partial_rotary_factor"})


def is_int(value: Any) -> bool:
    """Python and numpy integers; not bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_bool(value: Any) -> bool:
    """Python and numpy bools."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"))


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
    # A field config.json leaves out means what transformers' DeepseekV3Config makes of it (its defaults are
    # DeepSeek-V3's): the same file is the same model here, in transformers and in vLLM
    q_lora_rank: int | None = 1536
    num_nextn_predict_layers: int = 1
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 3
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

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Latent KV cache bytes a token takes: kv_lora_rank + qk_rope_head_dim elements in every cache layer."""
        return self.latent_dim * element_size * self.num_cache_layers

    @property
    def num_cache_layers(self) -> int:
        """Layers with a latent KV cache: the target's, then the MTP modules' (which attend over their own)."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

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
        missing = [n for n in required if n not in raw and n not in {ALIASES[a] for a in ALIASES if a in raw}]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
        kwargs: dict[str, Any] = {k: raw[k] for k in known if k in raw}
        given_as = {}  # field -> the alias the file names it by
        for alias, name in ALIASES.items():
            if alias in raw:
                if name in raw and raw[name] != raw[alias]:
                    raise ConfigError(f"{source}: fields {name!r} ({raw[name]!r}) and {alias!r} ({raw[alias]!r}) "
                                      f"disagree ({alias} is transformers' other name for {name}); give one")
                kwargs[name] = raw[alias]
                given_as[name] = alias
        for name in ("rope_scaling", "rope_parameters", "quantization_config"):
            if raw.get(name) is not None and not isinstance(raw[name], dict):
                raise ConfigError(f"{source}: field {name!r} must be an object or null, got {raw[name]!r}")
        kwargs["rope_scaling"], theta = _read_rope(raw, source)
        if theta is not None:
            kwargs["rope_theta"] = theta
        for name in POSITIVE_INTS + NON_NEGATIVE_INTS:
            low = 1 if name in POSITIVE_INTS else 0
            if name in kwargs and (not is_int(kwargs[name]) or kwargs[name] < low):
                raise ConfigError(f"{source}: field {given_as.get(name, name)!r} must be an integer >= {low}, got "
                                  f"{kwargs[name]!r}")
        for name in POSITIVE_NUMBERS:
            value = kwargs.get(name, 1.0)
            if not _is_positive_number(value):
                raise ConfigError(f"{source}: field {name!r} must be a number > 0, got {value!r}")
        if kwargs.get("q_lora_rank") is not None and not (is_int(kwargs["q_lora_rank"]) and kwargs["q_lora_rank"] > 0):
            raise ConfigError(f"{source}: field 'q_lora_rank' must be an integer >= 1 or null")
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
            if q.get("scale_fmt") not in (None, "ue8m0"):
                raise ConfigError(f"{source}: field 'quantization_config.scale_fmt' is {q['scale_fmt']!r}, expected "
                                  "'ue8m0' or null")
            _warn_unread(source, [f"quantization_config.{k}" for k in sorted(
                set(q) - set(QuantizationConfig.__dataclass_fields__) - QUANTIZATION_NO_EFFECT)])
            kwargs["quantization_config"] = QuantizationConfig(
                **{k: v for k, v in q.items() if k in QuantizationConfig.__dataclass_fields__}
            )
        if "architectures" in kwargs:
            archs = kwargs["architectures"]
            if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
                raise ConfigError(f"{source}: field 'architectures' must be a list of strings, got {archs!r}")
            kwargs["architectures"] = tuple(archs)
        if isinstance(kwargs.get("eos_token_id"), list):
            if not kwargs["eos_token_id"] or not all(map(is_int, kwargs["eos_token_id"])):
                raise ConfigError(f"{source}: field 'eos_token_id' must be a token id or a non-empty list of them")
            if len(set(kwargs["eos_token_id"])) > 1:  # transformers stops at any of them; this runtime has one eos
                raise ConfigError(f"{source}: field 'eos_token_id' is {kwargs['eos_token_id']!r}, expected one token "
                                  "id (give the others to requests as stop_token_ids)")
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        _check_derived(raw, source)
        kwargs["extra"] = {k: v for k, v in raw.items() if k not in known and k not in DERIVED and k not in ALIASES}
        _warn_unread(source, sorted(set(kwargs["extra"]) - NO_EFFECT))
        cfg = cls(**kwargs)
        cfg._validate(source)
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: file not found")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text ({e})") from None
        except (ValueError, RecursionError) as e:  # also: an integer too long to convert, arrays nested too deep
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
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

    def _validate(self, source: str) -> None:
        """from_dict's checks across fields, made on the constructed config."""
        def bad(field_name: str, expected: str) -> ConfigError:
            return ConfigError(f"{source}: field {field_name!r} is {getattr(self, field_name)!r}, expected {expected}")

        for name, most in UPPER_BOUNDS.items():
            if getattr(self, name) > most:
                raise bad(name, f"at most {most}")
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
        if self.moe_layer_freq != 1:  # DeepSeek's code reads it, transformers ignores it: a layout would be a guess
            raise bad("moe_layer_freq", "1 (every DeepSeek-V3 release; transformers ignores the field, DeepSeek's "
                      "own code reads it, so the layers' layout for another value depends on who saved them)")
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
        if not is_int(self.eos_token_id) or not 0 <= self.eos_token_id < self.vocab_size:
            raise bad("eos_token_id", f"a token id in [0, {self.vocab_size}) (vocab_size)")
        if self.bos_token_id is not None and not (is_int(self.bos_token_id) and 0 <= self.bos_token_id < self.vocab_size):
            raise bad("bos_token_id", f"a token id in [0, {self.vocab_size}) (vocab_size) or null")
        if self.num_key_value_heads is not None and not (is_int(self.num_key_value_heads) and self.num_key_value_heads > 0):
            raise bad("num_key_value_heads", "an integer >= 1 or null")
        rs = self.rope_scaling
        if rs is not None:
            for name in ("factor", "beta_fast", "beta_slow"):
                if not _is_positive_number(getattr(rs, name)):
                    raise ConfigError(f"{source}: field 'rope_scaling.{name}' must be a number > 0, got "
                                      f"{getattr(rs, name)!r}")
            for name in ("mscale", "mscale_all_dim"):  # 0, as null, leaves the scale alone (as transformers reads it)
                value = getattr(rs, name)
                if value is not None and not (is_number(value) and 0 <= value < math.inf):
                    raise ConfigError(f"{source}: field 'rope_scaling.{name}' must be a number >= 0 or null, got "
                                      f"{value!r}")
            if not (is_int(rs.original_max_position_embeddings) and rs.original_max_position_embeddings > 0):
                raise ConfigError(f"{source}: field 'rope_scaling.original_max_position_embeddings' must be an "
                                  f"integer >= 1, got {rs.original_max_position_embeddings!r}")
        q = self.quantization_config
        if q is not None and (q.fmt, q.activation_scheme) != ("e4m3", "dynamic"):
            raise ConfigError(f"{source}: field 'quantization_config' has fmt {q.fmt!r} and activation_scheme "
                              f"{q.activation_scheme!r}, expected 'e4m3' and 'dynamic' (the release's FP8)")
        if q is not None and tuple(q.weight_block_size) != (128, 128):
            raise ConfigError(f"{source}: field 'quantization_config.weight_block_size' is "
                              f"{list(q.weight_block_size)}, expected [128, 128] (the release's FP8 block scales; "
                              "TensorRT-LLM's FP8_BLOCK_SCALES)")


def _read_rope(raw: dict[str, Any], source: str) -> tuple[RopeScaling | None, Any]:
    """(YaRN parameters or None, rope_theta or None) from `rope_scaling` (transformers 4, the release) or
    `rope_parameters` (transformers 5, which moves rope_theta in there); both present must agree."""
    found = {}
    if raw.get("partial_rotary_factor", 1) != 1:
        raise ConfigError(f"{source}: field 'partial_rotary_factor' is {raw['partial_rotary_factor']!r}, expected 1 "
                          "(DeepSeek-V3 rotates qk_rope_head_dim whole)")
    for name in ("rope_scaling", "rope_parameters"):
        rope = raw.get(name)
        if not rope:  # null or {}: no scaling, as transformers reads them
            continue
        unknown = sorted(set(rope) - ROPE_KEYS)
        if unknown:
            raise ConfigError(f"{source}: field '{name}.{unknown[0]}' is not supported, expected only "
                              f"{', '.join(sorted(ROPE_KEYS))}")
        if name == "rope_scaling" and "type" not in rope and "rope_type" not in rope:
            raise ConfigError(f"{source}: field 'rope_scaling' has no type (or rope_type): expected 'yarn' "
                              "(DeepSeek-V3's) or 'default'; transformers reads it as 'default', DeepSeek's code as "
                              "'yarn'")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if rope.get("type", kind) != kind:
            raise ConfigError(f"{source}: fields '{name}.type' ({rope['type']!r}) and '{name}.rope_type' "
                              f"({kind!r}) disagree")
        if kind not in ("yarn", "default"):
            raise ConfigError(f"{source}: field '{name}.rope_type' is {kind!r}, expected 'yarn' or 'default'")
        # Values that change the math in ways this runtime does not implement are refused, not ignored.
        for key, neutral in (("attention_factor", None), ("truncate", True), ("partial_rotary_factor", 1)):
            if rope.get(key, neutral) != neutral:
                raise ConfigError(f"{source}: field '{name}.{key}' is {rope[key]!r}, expected {neutral!r} "
                                  "(DeepSeek-V3's YaRN)")
        scaling = None
        if kind == "yarn":
            keys = {k: v for k, v in rope.items() if k in RopeScaling.__dataclass_fields__ and k != "type"}
            outer = raw.get("original_max_position_embeddings")
            inner = keys.get("original_max_position_embeddings")
            if outer is not None and inner is not None and outer != inner:
                raise ConfigError(f"{source}: fields 'original_max_position_embeddings' ({outer!r}) and "
                                  f"'{name}.original_max_position_embeddings' ({inner!r}) disagree; give one")
            if inner is None and outer is not None:  # transformers 5 reads the top-level one
                keys["original_max_position_embeddings"] = outer
            value = keys.get("original_max_position_embeddings")
            if is_number(value) and not is_int(value) and float(value).is_integer():
                keys["original_max_position_embeddings"] = int(value)  # 4096.0, as transformers takes it
            missing = [k for k in ("factor", "original_max_position_embeddings") if k not in keys]
            if missing:
                raise ConfigError(f"{source}: field '{name}' (yarn) has no {' or '.join(missing)}: expected the "
                                  "scaling factor and the context length before scaling (DeepSeek-V3: 40 and 4096)")
            scaling = RopeScaling(**keys)
        found[name] = (scaling, rope.get("rope_theta"))
    theta = raw.get("rope_theta")
    thetas = {v[1] for v in found.values() if v[1] is not None} | ({theta} if theta is not None else set())
    if len(thetas) > 1:
        raise ConfigError(f"{source}: fields 'rope_theta' and 'rope_parameters.rope_theta' disagree "
                          f"({', '.join(map(repr, sorted(thetas)))})")
    if len({v[0] for v in found.values()}) > 1:
        raise ConfigError(f"{source}: fields 'rope_scaling' and 'rope_parameters' describe different RoPE "
                          "scaling; give one of them")
    scaling = next(iter(found.values()))[0] if found else None
    return scaling, next(iter(thetas)) if thetas else None


def _check_derived(raw: dict[str, Any], source: str) -> None:
    """Fields transformers derives and saves: a value other than the derived one describes another model."""
    nope, rope = raw.get("qk_nope_head_dim"), raw.get("qk_rope_head_dim")
    for name, want, why in (("head_dim", rope, "qk_rope_head_dim, the RoPE width transformers reads it as"),
                            ("qk_head_dim", nope + rope if is_int(nope) and is_int(rope) else None,
                             "qk_nope_head_dim + qk_rope_head_dim"),
                            ("rope_interleave", True, "DeepSeek-V3's interleaved RoPE pairs")):
        if name in raw and raw[name] != want:
            raise ConfigError(f"{source}: field {name!r} is {raw[name]!r}, expected {want!r} ({why})")


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
