#!/usr/bin/env bash
# Run every experiment config and redraw every plot:
#   scripts/reproduce.sh [RESULTS_DIR] [PLOTS_DIR]        (make reproduce)
# Every configs/*.yaml that names an `experiment:` runs into RESULTS_DIR/<config>/ and is
# plotted into PLOTS_DIR/<config>/. On a GPU or TPU, configs/accel/<config>.yaml (bigger
# model, longer contexts, larger batches) replaces the CPU-sized config where it exists.
# Reruns skip finished cells, so an interrupted reproduce resumes where it stopped.
set -uo pipefail
cd "$(dirname "$0")/.."
KVJAX=${KVJAX:-kvjax}
PYTHON=${PYTHON:-python}
RESULTS=${1:-results}
PLOTS=${2:-plots}

backend=$("$PYTHON" -c "import jax; print(jax.default_backend())" 2>/dev/null || echo cpu)
echo "reproduce: backend $backend -> $RESULTS, $PLOTS"
failed=()
# quality and uptrain read the MHA/GQA/MQA comparison models: train any that are missing
# (tens of minutes each on a 2-core CPU, minutes on a GPU; reruns resume).
for kind in mha gqa mqa; do
  if [ ! -f "checkpoints/$kind/config.yaml" ]; then
    echo "== train $kind (checkpoints/$kind)"
    "$KVJAX" train "configs/train_$kind.yaml" --out "checkpoints/$kind" || failed+=("train_$kind")
  fi
done
for cfg in configs/*.yaml; do
  grep -q '^experiment:' "$cfg" || continue
  name=$(basename "$cfg" .yaml)
  if [ "$backend" != "cpu" ] && [ -f "configs/accel/$name.yaml" ]; then
    cfg="configs/accel/$name.yaml"
  fi
  echo "== $name ($cfg)"
  if "$KVJAX" run "$cfg" --out "$RESULTS/$name"; then
    "$PYTHON" scripts/plot_all.py "$RESULTS/$name" --out "$PLOTS/$name" || failed+=("$name (plots)")
  else
    failed+=("$name")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "reproduce: failed: ${failed[*]}" >&2
  exit 1
fi
echo "reproduce: all experiments done; plots in $PLOTS/"
