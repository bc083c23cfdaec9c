#!/usr/bin/env bash
# Set up the environment and run the test suite. pytest's exit code 5 (no tests collected) fails.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh || exit 1
. .venv/bin/activate
python -m pytest -q "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit $rc
