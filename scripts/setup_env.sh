#!/usr/bin/env bash
# Create .venv (once) and install the project with everything the tests, Triton and benchmarks need.
# torch is pinned to 2.13.0: on these machines pip takes the CPU wheel that lies on disk; a newer
# or unpinned torch would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.installed-$(cat pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0" "numpy<2"
  python -m pip install -q -e ".[test,serve,bench]"
  touch "$stamp"
fi
# Build the runtime's CPU kernels now rather than inside the first request (about 30 s, once).
python -c "from runtime.model.kernels import cpu_kernels; cpu_kernels()"
