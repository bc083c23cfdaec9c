#!/usr/bin/env bash
# Run every benchmark on the shipped model and write docs/benchmarks/*.{json,md,png}.
# The timed ones (load test, Triton, batch 1, serving) run one after another with torch's default
# threads (all cores); the counts and losses (acceptance, penalized drafts, FP8 vs BF16) run first, side by side with
# one thread each. Each benchmark reports ratios measured within its own run.
# Usage: bash scripts/run_benchmarks.sh [BF16_EXPORT_DIR]
#   BF16_EXPORT_DIR: a BF16 export of the same training checkpoint (python -m training.export_model --bf16),
#   needed only by the FP8-vs-BF16 comparison, which is skipped without it.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh || exit 1
. .venv/bin/activate
mkdir -p docs/benchmarks/logs
run() { local name=$1; shift; echo "== $name: $*"; python -m "$@" > "docs/benchmarks/logs/$name.log" 2>&1; echo "== $name: exit $?"; }
val=(); [ -f data/val.bin ] && val=(--val_bin data/val.bin --val_tokens 65536)

run acceptance benchmarks.acceptance --ks 1,2,3,4 "${val[@]}" --threads 1 &
run penalized_drafts benchmarks.penalized_drafts --threads 1 &
if [ $# -ge 1 ] && [ -f data/val.bin ]; then run fp8 benchmarks.fp8 --bf16_model "$1" --threads 1 & fi
wait
run load_test benchmarks.load_test --max_output_tokens 64 --modes plain,adaptive
run triton benchmarks.triton_serving
run openai_serving benchmarks.openai_serving --rounds 6 --requests 6 --max_tokens 64
run speculative benchmarks.speculative
run sampling_features benchmarks.sampling_features --rounds 6
run structured_output benchmarks.structured_output --threads 1 --rounds 4
run serving benchmarks.serving --num_requests 8 --requests_per_client 8 --rounds 3 --qps_requests 24 \
  --min_tokens 48 --max_tokens 96
# On a CUDA host, the load test, batch-1, FP8 and serving benchmarks again on the GPU (files named after it, e.g. *_h100).
gpu=$(python -c "import torch; print(torch.cuda.get_device_name().split()[1].lower() if torch.cuda.is_available() else '')")
if [ -n "$gpu" ]; then
  run "load_test_$gpu" benchmarks.load_test --device cuda --name "load_test_$gpu" --max_output_tokens 64 --modes plain,adaptive
  run "speculative_$gpu" benchmarks.speculative --device cuda --name "speculative_$gpu"
  run "fp8_$gpu" benchmarks.fp8_gpu --device cuda --name "fp8_$gpu"
  run "serving_$gpu" benchmarks.serving --device cuda --name "serving_$gpu" --num_requests 8 \
    --requests_per_client 8 --rounds 3 --qps_requests 24 --min_tokens 48 --max_tokens 96
fi
ls docs/benchmarks
