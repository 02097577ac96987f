#!/usr/bin/env bash
# The one prepared command for a lent GPU machine (results/gpu/ come from it):
#
#   OUT=DIR scripts/device_check.sh [BUDGET_SECONDS]      (default 600)
#   scripts/device_check.sh --dry-run                     (any machine: check, run nothing)
#
# Runs scripts/bench_accelerator.py --plan device: the stages of scripts/device_plan.py in
# priority order, each within its stated seconds and what is left of the budget, which
# the script enforces itself (a stage that would start with under 20 s left is skipped):
#   roofline-8b 100 s | model-smollm2 45 s | model-qwen 45 s | model-gemma3 60 s |
#   gpu-tests 270 s | distill 45 s | roofline-8b-long 150 s | pallas 90 s |
#   pallas-sweep 60 s | peer 35 s
# Rows, logs, the manifest (device, JAX, jaxlib, CUDA versions; per-stage status and
# seconds) and plots go to $OUT/accel and are packed as $OUT/accel.tgz; $OUT/env.txt holds
# nvidia-smi and `jax.print_environment_info()`. The whole run ends within BUDGET + 60 s.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--dry-run" ]; then
  exec "$PY" scripts/device_plan.py --dry-run
fi
OUT=${OUT:-/tmp/kvjax_device}
BUDGET=${1:-600}
case "$BUDGET" in
  ''|*[!0-9]*) echo "device_check: BUDGET_SECONDS must be a whole number of seconds, got '$BUDGET'" >&2
               exit 2 ;;
esac
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c "import jax; jax.print_environment_info()" || true
} 2>&1 | tee "$OUT/env.txt"
PYTHON="$PY" timeout $((BUDGET + 60)) "$PY" scripts/bench_accelerator.py "$OUT/accel" \
  --plan device --budget "$BUDGET"
echo "bench exit $?"
tar czf "$OUT/accel.tgz" -C "$OUT" accel && ls -la "$OUT"
