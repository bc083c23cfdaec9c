"""Make a deployable Triton model repository: copy triton_repo/ and fill every config.pbtxt.

  make_model_repo --engine_dir engines/deepseek-v3-mini --output_dir engines/triton_repo \
      [--set num_draft_tokens:3,speculation:adaptive]

Each model gets the substitutions its template has (see triton_repo/README.md for the keys).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from serving.fill_template import fill, parse_substitutions

from runtime.io.engine_format import read_limits

TEMPLATE_REPO = Path(__file__).resolve().parents[1] / "triton_repo"
PATH_KEYS = ("engine_dir", "tokenizer_dir")


def default_values(engine_dir: Path, **overrides: str) -> dict[str, str]:
    """A single-node deployment of one engine (overrides win), with the limits the models check requests
    against before they reach the engine (max_input_tokens, vocab_size) read from it."""
    cfg, build = read_limits(engine_dir)
    values = {
        "triton_max_batch_size": "64",
        "decoupled_mode": "true",
        "engine_dir": str(engine_dir),
        "tokenizer_dir": str(engine_dir),
        "max_input_tokens": str(build.max_seq_len),
        "vocab_size": str(cfg.vocab_size),
        "speculation": "adaptive",
        "preprocessing_instance_count": "1",
        "postprocessing_instance_count": "1",
        "bls_instance_count": "1",
        "tensorrt_llm_model_name": "tensorrt_llm",
        "cancellation_check_period_ms": "100",
        "stats_check_period_ms": "100",
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
    config.write_text(fill(text, {k: v for k, v in values.items() if "${" + k + "}" in text}, str(config)))
    return dst


def fill_model_repo(dst: Path, values: dict[str, str], src: Path = TEMPLATE_REPO) -> Path:
    """Copy the template repository to `dst` and fill each config.pbtxt with the keys it has."""
    for model in sorted(p.parent for p in src.glob("*/config.pbtxt")):
        add_model(dst, model, values)
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine_dir", type=Path, required=True)
    p.add_argument("--output_dir", type=Path, required=True)
    p.add_argument("--set", default="", help="extra key:value substitutions, comma-separated")
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    if args.output_dir.exists():
        if not args.force:
            print(f"{args.output_dir}: already exists; pass --force to replace it", file=sys.stderr)
            return 2
        shutil.rmtree(args.output_dir)
    values = default_values(args.engine_dir.resolve(), **parse_substitutions(args.set) if args.set else {})
    fill_model_repo(args.output_dir, values)
    print(args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
