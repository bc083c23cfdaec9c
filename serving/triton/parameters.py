"""A Triton model's `parameters` (its config.pbtxt), read once in `initialize` the way TensorRT-LLM's
backend reads them: a parameter left empty or as an unfilled `${...}` template value is unset, and a
value that does not parse is an error naming the model and the parameter, so the model fails to load
with that message rather than running on a silently wrong setting."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from runtime.executors.lifetime import MAX_TORCH_THREADS
from runtime.io.yaml_file import shown
from serving.watchdog import STALL_TIMEOUT_S

T = TypeVar("T")
# the launcher's --world_size, for the engine models' executors (ExecutorConfig.world_size): `launcher_world_size`
WORLD_SIZE_ENV = "DSV3_WORLD_SIZE"
# TensorRT-LLM's name, in both flavours, for the executor's max_queued_requests (`queue_bound`)
QUEUE_SIZE = "max_queue_size"

TRUE_VALUES = ("1", "true", "yes", "t", "y", "on")
FALSE_VALUES = ("0", "false", "no", "f", "n", "off")


def boolean(value: str) -> bool:
    if value.strip().lower() in TRUE_VALUES:
        return True
    if value.strip().lower() in FALSE_VALUES:
        return False
    raise ValueError(f"expected true or false, got {shown(value)}")


# decimal numbers in ASCII, as a config.pbtxt is written: Python's int() and float() also read other scripts' digits,
# underscores between digits, NaN and infinity
_INTEGER = re.compile(r"[ \t]*[+-]?[0-9]+[ \t]*")
_NUMBER = re.compile(r"[ \t]*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?[ \t]*")


def integer(value: str) -> int:
    try:
        if _INTEGER.fullmatch(value):
            return int(value)
    except ValueError:  # past Python's 4300 digits
        pass
    raise ValueError(f"expected an integer, got {shown(value)}")


def queue_bound(value: Any) -> int | None:
    """max_queue_size as the executor's max_queued_requests (requests allowed to wait for a batch place); 0 is no
    bound, as upstream's."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"must be an integer >= 0 (0: no bound), got {shown(value)}")
    return value or None


def launcher_world_size() -> int | None:
    """The launcher's --world_size (None when not given), for an engine model's ExecutorConfig.world_size."""
    value = os.environ.get(WORLD_SIZE_ENV, "")
    try:
        return integer(value) if value else None
    except ValueError as e:
        raise ValueError(f"{WORLD_SIZE_ENV}: {e}") from None


def number(value: str) -> float:
    if not _NUMBER.fullmatch(value) or not math.isfinite(float(value)):  # 1e999 reads as infinity
        raise ValueError(f"expected a number, got {shown(value)}")
    return float(value)


@dataclass(frozen=True)
class TritonConfig:
    """What both Triton engine models take besides the executor's settings: upstream llmapi's `triton_config` keys
    (max_batch_size, decoupled, cancellation_check_period_ms) and this runtime's (stats_check_period_ms,
    watchdog_timeout_s, torch_threads, engine_process); the legacy model reads them from its parameters."""

    max_batch_size: int = 0
    decoupled: bool = False
    cancellation_check_period_ms: int = 100
    stats_check_period_ms: int = 100
    watchdog_timeout_s: float = STALL_TIMEOUT_S
    torch_threads: int | None = None
    engine_process: bool | None = None  # the executor in a process of its own (None: on CUDA devices only)

    def __post_init__(self) -> None:
        """ValueError naming the setting whose value cannot work: each is bounded by what the server's threads and
        torch can take (a watchdog that cannot see a step finish, periods past an hour, more threads than cores)."""
        for name, low, high in (("cancellation_check_period_ms", 1, 3_600_000), ("stats_check_period_ms", 1, 3_600_000),
                                ("watchdog_timeout_s", 0.001, 86_400), ("torch_threads", 1, MAX_TORCH_THREADS)):
            value = getattr(self, name)
            if value is None and name == "torch_threads":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")


def named_as_deployed(message: str, names: Mapping[str, str]) -> str:
    """An executor's message about its settings (ExecutorConfig's names) under the names the deployment's file sets
    them by: each whole name, not part of a flag (`--max_seq_len`), a dotted key or a word ("device(s)"), nor the
    engine's own limit ("the engine's max_seq_len")."""
    if not names:
        return message
    pattern = r"(?<![\w.-])(?<!engine's )(" + "|".join(map(re.escape, names)) + r")(?![\w.(])"
    return re.sub(pattern, lambda m: names[m.group(1)], message)


def settings(cls: Callable[..., T], **given: Any) -> T:
    """`cls` (a settings dataclass) from the values a deployment gives, None meaning not given: the others keep
    the dataclass's defaults, so no reader of a config file repeats them."""
    return cls(**{name: value for name, value in given.items() if value is not None})


def parameter(model_config: dict, name: str, cast: Callable[[str], Any] = str, default: Any = None) -> Any:
    """The parameter's value through `cast`, or `default` when it is unset."""
    value = model_config.get("parameters", {}).get(name, {}).get("string_value", "")
    if value == "" or value.startswith("${"):
        return default
    try:
        return cast(value)
    except ValueError as e:
        raise ValueError(f"model {model_config.get('name', '?')}: parameter {name}: {e}") from None


def check_one_instance(model_config: dict) -> None:
    """ValueError unless the engine model runs one instance: its executor batches every request in flight, and a
    second instance would load the model and a KV cache of its own, while a `stop` request and the model's metrics
    reach one instance only (a stop landing on the other did nothing)."""
    count = sum(int(group.get("count", 1)) * (len(group.get("gpus") or [0]) if group.get("kind") == "KIND_GPU" else 1)
                for group in model_config.get("instance_group") or [{}])  # KIND_GPU: count instances on each GPU
    if count != 1:
        raise ValueError(f"model {model_config.get('name', '?')}: instance_group count {count}: one instance serves "
                         "every request, batched in flight by its executor (more would each load the model and a KV "
                         "cache, and a stop request or the metrics would reach one of them); set count: 1 in "
                         "config.pbtxt")


def model_path(model_config: dict, name: str, model_dir: str) -> Path:
    """A required path parameter; a relative one is relative to the model's own directory (`args["model_repository"]`
    in `initialize`), so a repository can name its engine without showing clients the server's absolute paths."""
    value = parameter(model_config, name)
    if value is None:
        raise ValueError(f"model {model_config.get('name', '?')}: parameter {name} is not set")
    return Path(model_dir) / value


def read_model_config(directory: Path) -> dict:
    """The name and parameters of the model in `directory`, read from its config.pbtxt in the shape of
    `args["model_config"]`."""
    text = (directory / "config.pbtxt").read_text()
    pairs = re.findall(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"', text)
    return {"name": directory.name, "parameters": {k: {"string_value": v} for k, v in pairs}}


def sibling_config(model_dir: str, model: str) -> tuple[dict, str]:
    """Another model of the same repository's config (`read_model_config`) and its directory: for a model that takes
    settings its sibling already has."""
    directory = Path(model_dir).parent / model
    return read_model_config(directory), str(directory)
