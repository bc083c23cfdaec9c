"""Which executor serves a path: TensorRT-LLM's adapter for an engine built with --backend trtllm, else the native
executor; and what creating it would refuse, checked before a weight loads (`check_settings`)."""

from __future__ import annotations

import os
from pathlib import Path

from runtime.executors.base import ExecutorConfig, ExecutorProtocol
from runtime.executors.native import Executor
from runtime.executors.trtllm import TrtllmEngine, TrtllmExecutor
from runtime.executors.trtllm_api import chosen_options, llm_kwargs_for, read_llm_api_options
from runtime.io.engine_format import read_limits, read_manifest


def check_settings(path: str | Path, config: ExecutorConfig) -> None:
    """What creating an executor on `path` with `config` refuses before it loads a weight (ValueError naming the
    setting), for a deployment written before any server loads it (make_model_repo)."""
    path, source = Path(path), str(path)
    manifest = read_manifest(path)
    if manifest is not None and manifest.build.backend == "trtllm":
        llm_kwargs_for(chosen_options(read_llm_api_options(path), config), manifest, config, source=source)
        return
    cfg, build = read_limits(path, manifest)
    config.resolve(build, cfg, source, built=manifest is not None)  # a checkpoint's limits are defaults, not choices


def create_executor(path: str | Path, config: ExecutorConfig = ExecutorConfig()) -> ExecutorProtocol:
    """TensorRT-LLM for an engine built with --backend trtllm, else the native executor; engine.json is read here
    once and handed on."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a checkpoint or engine directory, got {path!r:.80}")
    manifest = read_manifest(path)
    if manifest is None:  # a checkpoint (or no model: the executor says so)
        return Executor(path, config)
    if manifest.build.backend == "trtllm":
        return TrtllmExecutor(TrtllmEngine.open(path, manifest=manifest), config)
    return Executor(path, config, manifest)
