"""Benchmarks and load tests: each module runs with `python -m benchmarks.<name>` and writes JSON, a
markdown table and, where a person would rather look, a plot to docs/benchmarks/."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
