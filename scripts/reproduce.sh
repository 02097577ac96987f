#!/usr/bin/env bash
# Regenerate every committed results file with the command recorded for it, then redraw
# the plots and compare the new files' structure with the committed ones:
#   scripts/reproduce.sh [RESULTS_DIR] [PLOTS_DIR] [results/FILE ...]    (make reproduce)
# The commands are results/MANIFEST.yaml's (scripts/manifest.py commands), writing under
# RESULTS_DIR instead of results/ (default results/tmp-reproduce, git-ignored), so the
# committed files stay as they are; name files to regenerate only those. Reruns skip
# finished `kvjax run` cells, so an interrupted reproduce resumes where it stopped (the
# benchmark scripts append: start them on an empty RESULTS_DIR). To replace a committed
# file, delete it and run its command with RESULTS_DIR=results, then
# `python scripts/manifest.py update`.
set -uo pipefail
cd "$(dirname "$0")/.."
KVJAX=${KVJAX:-kvjax}
PYTHON=${PYTHON:-python}
RESULTS=${1:-results/tmp-reproduce}
PLOTS=${2:-plots}
shift $(( $# > 2 ? 2 : $# ))
only=("$@")

echo "reproduce: $RESULTS, $PLOTS"
cmds=$("$PYTHON" scripts/manifest.py commands --out "$RESULTS" ${only[@]:+--only "${only[@]}"}) || exit 2
failed=()
# quality and uptrain read the MHA/GQA/MQA comparison models: train any that are missing
# (tens of minutes each on a 2-core CPU, minutes on a GPU; reruns resume).
if grep -qE "configs/(quality|uptrain).yaml" <<< "$cmds"; then
  for kind in mha gqa mqa; do
    if [ ! -f "checkpoints/$kind/summary.json" ]; then
      echo "== $KVJAX train configs/train_$kind.yaml --out checkpoints/$kind"
      "$KVJAX" train "configs/train_$kind.yaml" --out "checkpoints/$kind" || failed+=("train_$kind")
    fi
  done
fi
while IFS= read -r cmd; do
  [ -n "$cmd" ] || continue
  case "$cmd" in
    "kvjax "*) run="$KVJAX ${cmd#kvjax }" ;;
    "python "*) run="$PYTHON ${cmd#python }" ;;
    *) run="$cmd" ;;
  esac
  echo "== $cmd"
  mkdir -p "$RESULTS"
  bash -c "$run" || failed+=("$cmd")
done <<< "$cmds"
$KVJAX plot "$RESULTS" --out "$PLOTS" || failed+=("plots")  # (KVJAX may carry arguments)
"$PYTHON" scripts/manifest.py compare "$RESULTS" ${only[@]:+--only "${only[@]}"} || failed+=("compare")
if [ ${#failed[@]} -gt 0 ]; then
  printf 'reproduce: failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "reproduce: every command done; plots in $PLOTS/; structure equal to the committed files"
