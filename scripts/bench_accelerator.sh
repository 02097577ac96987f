#!/usr/bin/env bash
# One command for a GPU or TPU machine: latency, memory, codec, roofline and peer
# experiments at accelerator-sized shapes, within 8 minutes, results into RESULTS_DIR.
#
#   scripts/bench_accelerator.sh RESULTS_DIR [--budget SECONDS] [--tiny]
#
# On an accelerator, stages in this order (the most wanted first, as a stage that runs out
# of budget skips the rest):
#   roofline-smollm2  SmolLM2-135M's shape (fp32 weights), GQA-3, 4k in the cache, batch
#                     1/8/32 x fp32/bf16/int8/int4 (configs/roofline_smollm2.yaml)
#   pallas            decode attention: Pallas kernel vs XLA grouped vs JAX's paged kernel,
#                     bf16/int8/int4, 4k..32k (scripts/bench_pallas.py; pallas/pallas.jsonl)
#   latency-codecs    TTFT/TPOT at GQA-4 for int8 / int4 / fp8_e4m3 caches, batch 8, 8k
#   memory            cache bytes, measured vs closed form, Llama-3-8B-shaped MHA/GQA-8/MQA
#                     x 6 codecs, contexts 1k..128k (caches up to 8 GiB really allocated)
#   latency-variants  MHA vs GQA-4 vs MQA, bf16, batch 8, context 8k
#   latency-32k       GQA-4 bf16 / int8, batch 4, context 32k
#   latency-batch64   GQA-4 bf16 / int8, batch 64, context 2k
#     (latency stages: configs/accel/latency.yaml's 1.1B shape, 16 layers, bf16 weights)
#   roofline          Llama-3-8B shape in bf16, GQA-8, 4k and 16k (configs/accel/roofline.yaml)
#   quality           codec quality, if the trained checkpoints it names exist
#   peer              kvjax vs transformers' dynamic and static caches (configs/peer.yaml,
#                     trimmed; no quanto)
#   sharded-generate  kvjax generate on all devices (data x model mesh), if more than one
# Every stage is `kvjax run` in its own process with a share of the remaining budget
# (default 420 s); a stage that fails or runs out of time keeps its flushed rows and the
# next one runs. RESULTS_DIR gets <experiment>/<experiment>.jsonl, logs/, plots/ and
# bench_accelerator.json (device, per-stage status and seconds).
#
# On a CPU (no GPU/TPU visible to JAX) it says so and runs a tiny version of the same
# stages (a few minutes on 2 cores), which checks the pipeline, not the hardware.
set -uo pipefail
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: scripts/bench_accelerator.sh RESULTS_DIR [--budget SECONDS] [--tiny]" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
backend=$("$PYTHON" -c "import jax; print(jax.default_backend())" 2>/dev/null || echo none)
case "$backend" in
  gpu|cuda|rocm|tpu) ;;
  cpu) echo "bench_accelerator: no GPU or TPU is visible to JAX (backend cpu); running the" \
            "tiny CPU version instead. It checks the pipeline only: its numbers say nothing" \
            "about an accelerator." ;;
  *) echo "bench_accelerator: cannot import jax with $PYTHON; install kvjax first (make install)" >&2
     exit 2 ;;
esac
exec "$PYTHON" scripts/bench_accelerator.py "$@"
