"""The legacy tensorrt_llm model's settings, read from its config.pbtxt parameters in one place: by the model when it
loads and by make_model_repo on the repository it writes, so a value the model would refuse is refused before a
server tries to load it. (A module of its own: the executor's settings import torch, which the text models'
stubs do without.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from runtime.executors.base import ExecutorConfig
from serving.triton.fill_template import UPSTREAM_ONLY
from serving.triton.parameters import (QUEUE_SIZE, TritonConfig, boolean, integer, launcher_world_size, number,
                                       parameter, queue_bound, settings)


@dataclass(frozen=True)
class EngineParameters:
    """What the legacy tensorrt_llm model's parameters set: its executor, its Triton settings and whether responses
    leave out the prompt by default."""

    executor: ExecutorConfig
    triton: TritonConfig
    exclude_input_in_output: bool


# parameter: (field, cast), for the executor's settings and the Triton ones
EXECUTOR_PARAMETERS = {
    "num_draft_tokens": ("num_draft_tokens", integer), "speculation": ("speculation", str),
    "executor_max_batch_size": ("max_batch_size", integer), "executor_max_seq_len": ("max_seq_len", integer),
    "max_tokens_in_paged_kv_cache": ("kv_cache_tokens", integer),
    "kv_cache_free_gpu_mem_fraction": ("free_memory_fraction", number),
    "enable_kv_cache_reuse": ("enable_block_reuse", boolean),  # TensorRT-LLM's legacy name
    QUEUE_SIZE: ("max_queued_requests", lambda value: queue_bound(integer(value))), "device": ("device", str)}
PARAMETER_OF = {field: name for name, (field, _) in EXECUTOR_PARAMETERS.items()}  # an executor setting's parameter
SETTING_NAMES = {field: name for field, name in PARAMETER_OF.items() if field != name}  # those named otherwise
TRITON_PARAMETERS = {
    name: (name, cast) for name, cast in (
        ("torch_threads", integer), ("engine_process", boolean), ("cancellation_check_period_ms", integer),
        ("stats_check_period_ms", integer), ("watchdog_timeout_s", number))}


OTHER_PARAMETERS = ("gpt_model_path", "exclude_input_in_output")  # where the engine is, the response's content
PYTHON_BACKEND_PARAMETERS = frozenset({"EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS"})  # Triton's own


def engine_parameters(model_config: dict, decoupled: bool) -> EngineParameters:
    """The legacy tensorrt_llm model's settings from its config.pbtxt parameters and the launcher's --world_size, read
    once: by the model when it loads and by make_model_repo on the repository it writes. ValueError naming the model
    and the parameter; a parameter neither read here nor one of upstream's (UPSTREAM_ONLY, taken and not used) is
    refused, since a misspelt one would leave its setting at the default without a word."""
    known = {*EXECUTOR_PARAMETERS, *TRITON_PARAMETERS, *OTHER_PARAMETERS}
    unknown = sorted(map(str, set(model_config.get("parameters") or {}) - known - UPSTREAM_ONLY
                         - PYTHON_BACKEND_PARAMETERS))
    if unknown:
        raise ValueError(f"model {model_config.get('name', '?')}: unknown parameter(s) {', '.join(unknown)} (its "
                         f"parameters: {', '.join(sorted(known))}; see triton_repo/README.md)")

    def read(cls: Callable[..., Any], parameters: dict[str, tuple[str, Callable[[str], Any]]], **given: Any) -> Any:
        values = {name: parameter(model_config, name, cast) for name, (_, cast) in parameters.items()}
        for name, value in values.items():  # each value alone, so an out-of-range one is named by its parameter
            try:
                settings(cls, **{parameters[name][0]: value})
            except ValueError as e:  # "<field> must be ...": said of the parameter
                reason = str(e).removeprefix(f"{parameters[name][0]} ")
                raise ValueError(f"model {model_config.get('name', '?')}: parameter {name}: {reason}") from None
        return settings(cls, **given, **{parameters[name][0]: value for name, value in values.items()})

    return EngineParameters(read(ExecutorConfig, EXECUTOR_PARAMETERS, world_size=launcher_world_size()),
                            read(TritonConfig, TRITON_PARAMETERS, decoupled=decoupled),
                            parameter(model_config, "exclude_input_in_output", boolean, default=False))
