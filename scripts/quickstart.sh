#!/usr/bin/env bash
# Set up, build an FP8 engine from the shipped model, serve it with Triton, stream a request, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
python -m serving.quickstart "$@"
