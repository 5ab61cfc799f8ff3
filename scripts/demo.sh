#!/usr/bin/env bash
# The main job on the built-in default: a real 4-learner capture, then every analysis,
# their plots and the HTML report. Called by `make demo` with GRADSTAT and OUT set.
set -euo pipefail
GRADSTAT=${GRADSTAT:-gradstat}
OUT=${OUT:-captures/demo}
RUN="$OUT/capture"
FIG="$OUT/figures"

rm -rf "$OUT"
mkdir -p "$FIG"
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "capture: 4 gloo learners train the charlm transformer for 100 steps"
"$GRADSTAT" capture --workload charlm --nproc-per-node 4 --steps 100 --out "$RUN"
"$GRADSTAT" info "$RUN"
