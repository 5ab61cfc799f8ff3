#!/usr/bin/env bash
# The measurements behind docs/findings.md: the SIDCo and ScaleCom papers' findings on the
# realistic workloads, with gradstat commands only, so anyone can rerun them.
#
#   bash scripts/findings.sh            # 4 learners x 20 recorded steps of each workload at
#                                       # its paper size (resnet50 23.5M, gpt2 85M, lstm 66M);
#                                       # about 60 GB of captures and hours on 2 cores
#   bash scripts/findings.sh --quick    # the same commands at --size small, 4 learners x 8
#                                       # steps (CI-sized: minutes, a few GB)
#   WORKLOADS="resnet50" bash scripts/findings.sh   # a subset
#
# Environment: GRADSTAT (the command, default gradstat), OUT (captures and tables, default
# captures/findings[-quick]), FIG (figures, default docs/img/findings[-quick]), KEEP=1 keeps
# each capture after its analyses (default: deleted, so only one capture is on disk at once).
# For each workload it writes OUT/WORKLOAD/*.txt (the tables as printed), *.csv (rows) and
# FIG/WORKLOAD-*.png (100 dpi).
set -euo pipefail
GRADSTAT=${GRADSTAT:-gradstat}
QUICK=0
[[ "${1:-}" == "--quick" ]] && QUICK=1
if ((QUICK)); then
  SIZE=small STEPS=8 SUFFIX=-quick
else
  SIZE=large STEPS=20 SUFFIX=
fi
OUT=${OUT:-captures/findings$SUFFIX}
FIG=${FIG:-docs/img/findings$SUFFIX}
WORKLOADS=${WORKLOADS:-resnet50 gpt2 lstm}
LEARNERS=4
DPI=100
export COLUMNS=${COLUMNS:-160}  # whole tables in the .txt files
mkdir -p "$OUT" "$FIG"
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
# run NAME COMMAND...: the command's table output to OUT/W/NAME.txt and the terminal
run() {
  local name=$1
  shift
  "$GRADSTAT" "$@" 2>&1 | tee "$DIR/$name.txt"
}

for W in $WORKLOADS; do
  case $W in
    resnet50) BATCH=8 ;;
    gpt2) BATCH=2 ;;
    lstm) BATCH=8 ;;
    *) BATCH=8 ;;
  esac
  DIR="$OUT/$W"
  RUN="$DIR/capture"
  rm -rf "$DIR"
  mkdir -p "$DIR"

  step "$W: capture, $LEARNERS gloo learners x $STEPS steps, --size $SIZE, batch $BATCH per learner"
  start=$SECONDS
  "$GRADSTAT" capture --workload "$W" --size "$SIZE" --nproc-per-node $LEARNERS \
    --steps $STEPS --batch-size $BATCH --out "$RUN"
  echo "capture took $((SECONDS - start)) s" | tee "$DIR/capture-time.txt"
  run info info "$RUN"

  step "$W: SIDCo: which distribution fits |g| (whole model), and q = selected/k of the estimators"
  # every 4th recorded step, all learners: the fits are the expensive part
  run fit fit "$RUN" --dist all --ratios 0.1,0.01,0.001 --stages 1,2,3 --steps ::4 \
    --csv "$DIR/fit.csv" --plot "$FIG/$W-fit.png" --dpi $DPI
  # every step: the adaptive rule decides on the mean q of 5 steps per learner
  run fit-adaptive fit "$RUN" --dist gpd --ratios 0.1,0.01,0.001 --stages auto \
    --estimators sidco-exp,sidco-gpd,sidco-gamma-gpd --csv "$DIR/fit-adaptive.csv"
  # SIDCo's GPD stages fitted by maximum likelihood instead of moments (issue 10 part 4)
  run fit-mle fit "$RUN" --dist gpd --ratios 0.1,0.01,0.001 --stages 1,2,3 --steps ::4 \
    --estimators sidco-gpd,sidco-gamma-gpd --stage-fit mle --csv "$DIR/fit-mle.csv"

  step "$W: SIDCo: best fit per layer (first recorded step, learner 0)"
  run fit-layers fit "$RUN" --dist all --scope layers --steps 0 --learners 0 --estimators '' \
    --csv "$DIR/fit-layers.csv"

  step "$W: ScaleCom: top-k overlap between learners and with the mean's top-k"
  run similarity similarity "$RUN" --ratio 0.001 --csv "$DIR/similarity.csv" \
    --plot "$FIG/$W-similarity.png" --dpi $DPI
  run similarity-0.01 similarity "$RUN" --ratio 0.01 --csv "$DIR/similarity-0.01.csv"
  # ScaleCom measures the top-k of the error-feedback memory (g + residual), not raw g
  run similarity-ef similarity "$RUN" --ratio 0.001 --on ef --csv "$DIR/similarity-ef.csv"

  step "$W: ScaleCom: build-up B(m) of the learners' local top-k"
  run buildup buildup "$RUN" --ratios 0.01,0.001 --csv "$DIR/buildup.csv" \
    --plot "$FIG/$W-buildup.png" --dpi $DPI

  step "$W: ScaleCom: temporal overlap of top-k sets"
  run overlap overlap "$RUN" --ratio 0.001 --lag 1 --csv "$DIR/overlap.csv" \
    --plot "$FIG/$W-overlap.png" --dpi $DPI

  step "$W: ScaleCom: CLT-k (leader's indices) against local top-k, with error feedback"
  run replay replay "$RUN" --compressors topk,clt-k --ratios 0.01,0.001 --csv "$DIR/replay.csv"
  # with ScaleCom's low-pass filter of the memory
  run replay-beta replay "$RUN" --compressors clt-k --beta 0.1 --ratios 0.01,0.001 \
    --csv "$DIR/replay-beta.csv"

  if [[ "${KEEP:-0}" != 1 ]]; then
    rm -rf "$RUN"
  fi
done
printf '\ntables in %s, figures in %s\n' "$OUT" "$FIG"
