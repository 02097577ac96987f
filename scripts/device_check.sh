#!/usr/bin/env bash
# The one prepared command for a lent GPU machine (results/gpu/ come from it):
#
#   OUT=DIR scripts/device_check.sh [BUDGET_SECONDS]     (0: step 1 only)
#
# 1. (JAX_PLATFORMS=cuda: the suite's conftest defaults to the CPU) the Pallas tests
#    executed for real on the GPU (tests/test_pallas.py: the kernel
#    against the XLA read and the dequantized reference, every codec, contiguous and
#    paged) and the decode tests (tests/test_decode.py: cached decode = the full forward
#    pass, through the accelerator's one-block read and stacked layer scan), log in
#    $OUT/gpu_tests.log;
# 2. scripts/bench_accelerator.sh with the remaining budget (default 300 s), its whole
#    results folder packed as $OUT/accel.tgz (rows, logs, plots, manifest with the device).
# Every step has its own timeout, so the whole run ends within about BUDGET + 200 s.
set -u
OUT=${OUT:-/tmp/kvjax_device}
BUDGET=${1:-300}
case "$BUDGET" in
  ''|*[!0-9]*) echo "device_check: BUDGET_SECONDS must be a whole number of seconds (0: tests only), got '$BUDGET'" >&2
               exit 2 ;;
esac
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c "import jax, jaxlib, flax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.txt"
JAX_PLATFORMS=cuda timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_pallas.py tests/test_decode.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
echo "pytest exit ${PIPESTATUS[0]}"
[ "$BUDGET" -gt 0 ] || exit 0  # 0: the tests only
PYTHON="$PY" timeout $((BUDGET + 40)) bash scripts/bench_accelerator.sh /tmp/kvjax_accel --budget "$BUDGET"
echo "bench exit $?"
tar czf "$OUT/accel.tgz" -C /tmp kvjax_accel && ls -la "$OUT"
