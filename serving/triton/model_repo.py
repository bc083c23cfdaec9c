"""Make a deployable Triton model repository of one engine, in one of two flavours:

  make_model_repo --engine_dir engines/deepseek-v3-mini --output_dir engines/triton_repo \
      [--flavour legacy] [--set num_draft_tokens:3,speculation:adaptive]
  make_model_repo --engine_dir engines/deepseek-v3-mini --output_dir engines/triton_llmapi \
      --flavour llmapi [--set decoupled_mode:false]

legacy (the default) copies triton_repo/ (TensorRT-LLM's inflight_batcher_llm models) and fills every config.pbtxt
with the substitutions its template has; llmapi copies triton_repo_llmapi/ (TensorRT-LLM's current `llmapi`
tensorrt_llm model) and writes its 1/model.yaml from the engine. See triton_repo/README.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from runtime.executors.backends import check_settings
from runtime.executors.base import ExecutorConfig
from runtime.io.atomic import (atomic_write, check_not_replacing, new_output_dir, os_error_text, release_owned,
                               remove_stale)
from runtime.io.engine_format import ENGINE_JSON, EngineManifest, read_limits, tokenizer_dir
from runtime.io.tokenizer import TOKENIZER_FILE
from runtime.cli import interrupt_on_sigterm, show_defaults
from serving.triton.bls import bls_settings
from serving.triton.engine_parameters import SETTING_NAMES, engine_parameters
from serving.triton.fill_template import UPSTREAM_ONLY, fill, parse_substitutions, placeholders
from serving.triton.llmapi_config import MODEL_YAML, model_yaml
from serving.triton.parameters import TritonConfig, named_as_deployed, read_model_config
from serving.triton.text_processing import Postprocessor, Preprocessor

TEMPLATE_REPO = Path(__file__).resolve().parents[2] / "triton_repo"
LLMAPI_TEMPLATE = Path(__file__).resolve().parents[2] / "triton_repo_llmapi" / "tensorrt_llm"
PATH_KEYS = ("engine_dir", "tokenizer_dir")
ENGINE_LINK = "engine"  # the engine's name inside an llmapi model's directory


def default_values(engine_dir: Path, **overrides: str) -> dict[str, str]:
    """A single-node deployment of one engine (overrides win), with the limits the models check requests
    against before they reach the engine (max_input_tokens, vocab_size) read from it."""
    cfg, build = read_limits(engine_dir)
    values = {
        "triton_max_batch_size": "64",
        "decoupled_mode": "true",
        "engine_dir": str(engine_dir),
        "tokenizer_dir": str(tokenizer_dir(engine_dir)),
        "max_input_tokens": str(build.max_seq_len),
        "vocab_size": str(cfg.vocab_size),
        "speculation": ExecutorConfig.speculation,
        "preprocessing_instance_count": "1",
        "postprocessing_instance_count": "1",
        "bls_instance_count": "8",  # requests the BLS serves at once (one per instance, docs/reliability.md)
        "tensorrt_llm_model_name": "tensorrt_llm",
        "cancellation_check_period_ms": str(TritonConfig.cancellation_check_period_ms),
        "stats_check_period_ms": str(TritonConfig.stats_check_period_ms),
    }
    values.update(overrides)
    return values


def add_model(repo: Path, template: Path, values: dict[str, str], name: str | None = None) -> Path:
    """Copy one template model into `repo` (as `name`, renaming it in its config) and fill it. A directory the
    model reads (engine, tokenizer) is linked into the model's own directory and named by the link, which the
    models resolve there: the model config endpoint shows clients no server path."""
    dst = repo / (name or template.name)
    shutil.copytree(template, dst, ignore=shutil.ignore_patterns("__pycache__"))
    config = dst / "config.pbtxt"
    text = config.read_text().replace(f'name: "{template.name}"', f'name: "{dst.name}"', 1)
    values = dict(values)
    for key in PATH_KEYS:
        if key in values and "${" + key + "}" in text:
            link = key.removesuffix("_dir")
            (dst / link).symlink_to(Path(values[key]).resolve(), target_is_directory=True)
            values[key] = link
    config.write_text(fill(text, {k: v for k, v in values.items() if "${" + k + "}" in text},
                           f"{dst.name}/config.pbtxt"))  # named in the repository: it is written in a temporary one
    return dst


def template_keys() -> set[str]:
    """The keys some model of the template repository takes."""
    return set().union(*(placeholders(p.read_text()) for p in TEMPLATE_REPO.glob("*/config.pbtxt")))


def fill_model_repo(dst: Path, values: dict[str, str]) -> Path:
    """Copy the template repository to `dst` and fill each config.pbtxt with the keys it has; a key no model has is
    refused (a misspelt setting would be left out without a word)."""
    models = sorted(p.parent for p in TEMPLATE_REPO.glob("*/config.pbtxt"))
    unknown = sorted(set(values) - template_keys() - UPSTREAM_ONLY)
    if unknown:
        raise ValueError(f"--set {', '.join(unknown)}: no model of the repository takes it (see triton_repo/README.md "
                         "for the settings)")
    for model in models:
        add_model(dst, model, values)
    return dst


def check_repository(repo: Path, engine_dir: Path, values: dict[str, str]) -> None:
    """Read each model's settings as the model reads them when it loads (`check_engine_model` for tensorrt_llm; the
    text models load their tokenizer): a repository a server would fail to load is refused here, naming the model
    and the parameter, rather than by the server."""
    check_engine_model(repo, engine_dir, values["decoupled_mode"].lower() == "true")
    read: dict[str, Any] = {}
    for name, reader in (("preprocessing", Preprocessor.from_config), ("postprocessing", Postprocessor.from_config),
                         ("tensorrt_llm_bls", bls_settings)):
        try:
            read[name] = reader(read_model_config(repo / name), str(repo / name))
        except FileNotFoundError:  # the tokenizer's: named as the user gave it, not in the temporary repository
            raise ValueError(f"model {name}: parameter tokenizer_dir: no {TOKENIZER_FILE} in "
                             f"{values['tokenizer_dir']}") from None
        except ValueError as e:  # a file the linked tokenizer directory holds: named where the user keeps it
            raise ValueError(str(e).replace(str(repo / name / "tokenizer"), str(values["tokenizer_dir"]))) from None
    engine_model = read["tensorrt_llm_bls"].engine_model
    if not (repo / engine_model / "config.pbtxt").is_file():
        raise ValueError(f"--set tensorrt_llm_model_name:{engine_model}: no such model in the repository (the BLS "
                         "calls it for every request); its engine model is tensorrt_llm")


def check_engine_model(repo: Path, engine_dir: Path, decoupled: bool) -> None:
    """Read the filled tensorrt_llm model's settings as the model reads them when it loads, and check them as its
    executor will on the engine: a repository whose model would fail to load is refused here, naming the parameter,
    rather than by the server."""
    settings = engine_parameters(read_model_config(repo / "tensorrt_llm"), decoupled).executor
    try:
        check_settings(engine_dir, settings)
    except ValueError as e:  # as the model's load would say it
        raise ValueError(f"model tensorrt_llm: {named_as_deployed(str(e), SETTING_NAMES)}") from None


def add_llmapi_model(repo: Path, engine_dir: Path, *, decoupled: bool = True, name: str = "tensorrt_llm") -> Path:
    """Copy the llmapi model into `repo` (as `name`), link the engine into it and write its 1/model.yaml (the
    engine's settings in LLM-API keys) and config.pbtxt (triton_config's max_batch_size and decoupled)."""
    dst = repo / name
    shutil.copytree(LLMAPI_TEMPLATE, dst, ignore=shutil.ignore_patterns("__pycache__"))
    (dst / ENGINE_LINK).symlink_to(Path(engine_dir).resolve(), target_is_directory=True)
    doc = model_yaml(Path(engine_dir), ENGINE_LINK, decoupled=decoupled)
    atomic_write(dst / "1" / MODEL_YAML, yaml.safe_dump(doc, sort_keys=False))
    config = dst / "config.pbtxt"
    text = config.read_text().replace('name: "tensorrt_llm"', f'name: "{name}"', 1)
    config.write_text(fill(text, {"triton_max_batch_size": str(doc["triton_config"]["max_batch_size"]),
                                  "decoupled_mode": str(decoupled).lower()}, f"{dst.name}/config.pbtxt"))
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine_dir", type=Path, required=True)
    p.add_argument("--output_dir", type=Path, required=True)
    p.add_argument("--flavour", choices=("legacy", "llmapi"), default="legacy",
                   help="legacy: TensorRT-LLM's inflight_batcher_llm models (ensemble, preprocessing, tensorrt_llm, "
                        "postprocessing, tensorrt_llm_bls); llmapi: its current llmapi tensorrt_llm model")
    p.add_argument("--set", default="", help="extra key:value substitutions, comma-separated (llmapi: "
                                             "decoupled_mode only; its other settings are in tensorrt_llm/1/model.yaml)")
    p.add_argument("--force", action="store_true")
    args = show_defaults(p).parse_args(argv)
    interrupt_on_sigterm()
    try:
        subs = parse_substitutions(args.set)
        if "engine_dir" in subs:
            raise ValueError("--set engine_dir: the engine is --engine_dir")
        for key, value in subs.items():
            if "${" in value:  # a model reads a placeholder left in place as unset
                raise ValueError(f"--set {key}:{value}: a template placeholder is not a value")
        tokenizer = subs.get("tokenizer_dir")
        for flag, source in (("--engine_dir", args.engine_dir), ("--set tokenizer_dir", tokenizer)):
            if source is not None and Path(source).resolve() in args.output_dir.resolve().parents:
                raise ValueError(f"--output_dir {args.output_dir} is inside {flag} ({source}): the repository links "
                                 "that directory, and Triton would walk the loop; choose a directory outside it")
        check_not_replacing(args.output_dir, "--output_dir", {
            "--engine_dir": args.engine_dir, "the current directory": Path.cwd(), "the templates": TEMPLATE_REPO,
            "the llmapi template": LLMAPI_TEMPLATE.parent,
            **{f"--set {key}": Path(subs[key]) for key in PATH_KEYS if key in subs}})
        if args.flavour == "llmapi":
            unknown = sorted(set(subs) - {"decoupled_mode"})
            if unknown:
                raise ValueError(f"--set {', '.join(unknown)}: the llmapi flavour takes decoupled_mode only; its other "
                                 f"settings are LLM-API keys in tensorrt_llm/1/{MODEL_YAML}")
            decoupled = subs.get("decoupled_mode", "true").lower()
            if decoupled not in ("true", "false"):
                raise ValueError(f"--set decoupled_mode:{subs['decoupled_mode']}: expected true or false")
        if (args.engine_dir / ENGINE_JSON).is_file():  # whole weight files, from their headers: hashes read it all
            EngineManifest.read(args.engine_dir).verify_files(args.engine_dir, hashes=False)
        for note in remove_stale(args.output_dir):  # what a killed run left beside it
            print(f"make_model_repo: {note}", file=sys.stderr)
        with new_output_dir(args.output_dir, args.force) as repo:  # replaced only once the new one is whole
            if args.flavour == "llmapi":
                add_llmapi_model(repo, args.engine_dir, decoupled=decoupled == "true")
            else:
                values = default_values(args.engine_dir.resolve(), **subs)
                fill_model_repo(repo, values)
                check_repository(repo, args.engine_dir, values)
                ignored = sorted(set(subs) & UPSTREAM_ONLY - template_keys())
                if ignored:  # upstream's settings, taken as fill_template takes them
                    print(f"make_model_repo: --set {', '.join(ignored)}: ignored (upstream's settings, not used by "
                          "this repository)", file=sys.stderr)
    except (ValueError, KeyError) as e:
        print(f"make_model_repo: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    except OSError as e:  # the file system's: no space, no permission (the repository is written whole or not at all)
        print(f"make_model_repo: {os_error_text(e, args.output_dir)}; no model repository was written", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        release_owned()
        print("make_model_repo: interrupted; no model repository was written", file=sys.stderr)
        return 130
    print(args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
