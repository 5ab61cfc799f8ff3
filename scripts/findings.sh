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
#   bash scripts/findings.sh --trained  # trained states (docs/findings.md, "At trained
#                                       # states"): charlm and digits trained in chunks of
#                                       # CHUNK steps (--save / --resume) until a chunk's
#                                       # mean loss improves by less than FLAT (2%) of the
#                                       # first chunk's, or for BUDGET seconds; then every
#                                       # analysis and noise and
#                                       # consistency on 20 recorded steps there, and on 20
#                                       # steps from initialisation beside them
#   WORKLOADS="resnet50 gpt2 lstm" BUDGET=3600 bash scripts/findings.sh --trained
#                                       # the paper-size ones: as many steps as an hour allows
#
# Environment: GRADSTAT (the command, default gradstat), PYTHON (reads the commands' JSON,
# default python3), OUT (captures and tables, default captures/findings[-quick|-trained]),
# FIG (figures, default docs/img/findings[-quick|-trained]), KEEP=1 keeps each capture
# after its analyses (default: deleted, so only one capture is on disk at once). --trained
# also: CHUNK (training steps per chunk; default 500 for charlm and digits, 100 for the
# paper-size ones), ROWS (recorded steps per chunk whose mean loss is compared; 10, and 2
# for the paper-size ones), FLAT (0.02), BUDGET (seconds of training per workload; default
# 10800 for charlm and digits, 3600 for the others), LEARNERS (4).
# For each workload it writes OUT/WORKLOAD/*.txt (the tables as printed), *.csv (rows) and
# FIG/WORKLOAD-*.png (100 dpi); --trained writes OUT/WORKLOAD/{step0,trained}/ and
# OUT/WORKLOAD/training.txt (loss per chunk, steps and seconds).
set -euo pipefail
GRADSTAT=${GRADSTAT:-gradstat}
PYTHON=${PYTHON:-python3}
MODE=paper
[[ "${1:-}" == "--quick" ]] && MODE=quick
[[ "${1:-}" == "--trained" ]] && MODE=trained
case $MODE in
  quick) SIZE=small STEPS=8 SUFFIX=-quick DEFAULT_WORKLOADS="resnet50 gpt2 lstm" ;;
  paper) SIZE=large STEPS=20 SUFFIX= DEFAULT_WORKLOADS="resnet50 gpt2 lstm" ;;
  trained) SIZE= STEPS=20 SUFFIX=-trained DEFAULT_WORKLOADS="charlm digits" ;;
esac
OUT=${OUT:-captures/findings$SUFFIX}
FIG=${FIG:-docs/img/findings$SUFFIX}
WORKLOADS=${WORKLOADS:-$DEFAULT_WORKLOADS}
LEARNERS=${LEARNERS:-4}
FLAT=${FLAT:-0.02}
USER_CHUNK=${CHUNK:-} USER_BUDGET=${BUDGET:-} USER_ROWS=${ROWS:-}
DPI=100
export COLUMNS=${COLUMNS:-160}  # whole tables in the .txt files
mkdir -p "$OUT" "$FIG"
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
# run NAME COMMAND...: the command's table output to $DIR/NAME.txt and the terminal
run() {
  local name=$1
  shift
  "$GRADSTAT" "$@" 2>&1 | tee "$DIR/$name.txt"
}
batch_of() {
  case $1 in
    resnet50) echo 8 ;;
    gpt2) echo 2 ;;
    lstm) echo 8 ;;
    charlm | digits) echo 32 ;;
    *) echo 8 ;;
  esac
}
size_of() { # the --size option of workload $1 ("" for its default)
  if [[ -n "$SIZE" ]]; then echo "--size $SIZE"; fi
}

# analyse RUN TAG: every analysis of capture RUN; tables in $DIR, figures FIG/$W$TAG-*.png
analyse() {
  local RUN=$1 TAG=$2
  run info info "$RUN"

  step "$W$TAG: SIDCo: which distribution fits |g| (whole model), and q = selected/k of the estimators"
  # every 4th recorded step, all learners: the fits are the expensive part
  run fit fit "$RUN" --dist all --ratios 0.1,0.01,0.001 --stages 1,2,3 --steps ::4 \
    --csv "$DIR/fit.csv" --plot "$FIG/$W$TAG-fit.png" --dpi $DPI
  # every step: the adaptive rule decides on the mean q of 5 steps per learner
  run fit-adaptive fit "$RUN" --dist gpd --ratios 0.1,0.01,0.001 --stages auto \
    --estimators sidco-exp,sidco-gpd,sidco-gamma-gpd --csv "$DIR/fit-adaptive.csv"
  # SIDCo's GPD stages fitted by maximum likelihood instead of moments (issue 10 part 4)
  run fit-mle fit "$RUN" --dist gpd --ratios 0.1,0.01,0.001 --stages 1,2,3 --steps ::4 \
    --estimators sidco-gpd,sidco-gamma-gpd --stage-fit mle --csv "$DIR/fit-mle.csv"

  step "$W$TAG: SIDCo: best fit per layer (first recorded step, learner 0)"
  local first
  first=$("$GRADSTAT" info "$RUN" --json | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["steps"][0])')
  run fit-layers fit "$RUN" --dist all --scope layers --steps "$first" --learners 0 \
    --estimators '' --csv "$DIR/fit-layers.csv"

  step "$W$TAG: ScaleCom: top-k overlap between learners and with the mean's top-k"
  run similarity similarity "$RUN" --ratio 0.001 --csv "$DIR/similarity.csv" \
    --plot "$FIG/$W$TAG-similarity.png" --dpi $DPI
  run similarity-0.01 similarity "$RUN" --ratio 0.01 --csv "$DIR/similarity-0.01.csv"
  # ScaleCom measures the top-k of the error-feedback memory (g + residual), not raw g
  run similarity-ef similarity "$RUN" --ratio 0.001 --on ef --csv "$DIR/similarity-ef.csv"

  step "$W$TAG: ScaleCom: build-up B(m) of the learners' local top-k"
  run buildup buildup "$RUN" --ratios 0.01,0.001 --csv "$DIR/buildup.csv" \
    --plot "$FIG/$W$TAG-buildup.png" --dpi $DPI

  step "$W$TAG: ScaleCom: temporal overlap of top-k sets"
  run overlap overlap "$RUN" --ratio 0.001 --lag 1 --csv "$DIR/overlap.csv" \
    --plot "$FIG/$W$TAG-overlap.png" --dpi $DPI

  step "$W$TAG: ScaleCom: CLT-k (leader's indices) against local top-k, with error feedback"
  run replay replay "$RUN" --compressors topk,clt-k --ratios 0.01,0.001 --csv "$DIR/replay.csv"
  # with ScaleCom's low-pass filter of the memory
  run replay-beta replay "$RUN" --compressors clt-k --beta 0.1 --ratios 0.01,0.001 \
    --csv "$DIR/replay-beta.csv"

  if [[ $MODE == trained ]]; then
    step "$W$TAG: gradient noise scale (McCandlish et al.), compressors against the sampling noise"
    run noise noise "$RUN" --compressors topk,dgc,sidco-gpd,fp16 --ratios 0.01,0.001 \
      --csv "$DIR/noise.csv" --plot "$FIG/$W$TAG-noise.png" --dpi $DPI
    step "$W$TAG: learner consistency, and what top-k's error follows"
    run consistency consistency "$RUN" --compressors topk --ratios 0.01,0.001 \
      --csv "$DIR/consistency.csv" --plot "$FIG/$W$TAG-consistency.png" --dpi $DPI
  fi
}

# mean_loss RUN: the learners' mean loss over RUN's recorded steps (gradstat consistency)
mean_loss() {
  "$GRADSTAT" consistency "$1" --json 2>/dev/null | "$PYTHON" -c \
    'import json,sys; r=json.load(sys.stdin)["records"]; print(sum(x["loss_mean"] for x in r)/len(r))'
}

# train: chunks of CHUNK steps with --save/--resume until the loss flattens or BUDGET runs out
train() {
  local ckpt=$DIR/state.pt chunk=0 trained=0 before="" first="" start=$SECONDS loss every
  every=$((CHUNK / ROWS))
  printf 'chunk\tsteps trained\tmean loss of its %s recorded steps\tseconds\n' "$ROWS" \
    > "$DIR/training.txt"
  while true; do
    local part=$DIR/chunk
    rm -rf "$part"
    local resume=()
    [[ -f "$ckpt" ]] && resume=(--resume "$ckpt")
    "$GRADSTAT" capture --workload "$W" $(size_of "$W") --nproc-per-node "$LEARNERS" \
      --batch-size "$BATCH" --steps "$CHUNK" --every "$every" --start $((every - 1)) \
      "${resume[@]}" --save "$ckpt" --out "$part" > "$DIR/chunk.log" 2>&1
    chunk=$((chunk + 1))
    trained=$((trained + CHUNK))
    loss=$(mean_loss "$part")
    printf '%s\t%s\t%s\t%s\n' $chunk $trained "$loss" $((SECONDS - start)) | tee -a "$DIR/training.txt"
    rm -rf "$part"
    # flat: the last chunk gained less than FLAT of the first chunk's loss (a relative
    # rule would never stop a loss that falls towards 0 by halves)
    if [[ -n "$before" ]] && "$PYTHON" -c "import sys; sys.exit(0 if float('$before') - float('$loss') < $FLAT * float('$first') else 1)"; then
      echo "loss flat: $before -> $loss over the last $CHUNK steps (first chunk: $first)" \
        | tee -a "$DIR/training.txt"
      break
    fi
    if ((SECONDS - start >= BUDGET)); then
      echo "time budget of $BUDGET s spent after $trained steps" | tee -a "$DIR/training.txt"
      break
    fi
    before=$loss
    first=${first:-$loss}
  done
}

for W in $WORKLOADS; do
  BATCH=$(batch_of "$W")
  DIR0="$OUT/$W"
  rm -rf "$DIR0"
  mkdir -p "$DIR0"
  if [[ $MODE != trained ]]; then
    DIR=$DIR0
    RUN="$DIR/capture"
    step "$W: capture, $LEARNERS gloo learners x $STEPS steps, --size $SIZE, batch $BATCH per learner"
    start=$SECONDS
    "$GRADSTAT" capture --workload "$W" --size "$SIZE" --nproc-per-node $LEARNERS \
      --steps $STEPS --batch-size $BATCH --out "$RUN"
    echo "capture took $((SECONDS - start)) s" | tee "$DIR/capture-time.txt"
    analyse "$RUN" ""
    if [[ "${KEEP:-0}" != 1 ]]; then rm -rf "$RUN"; fi
    continue
  fi
  case $W in # ROWS: recorded steps per chunk, whose mean loss decides flatness
    charlm | digits) CHUNK=${USER_CHUNK:-500} BUDGET=${USER_BUDGET:-10800} ROWS=${USER_ROWS:-10} ;;
    *) CHUNK=${USER_CHUNK:-100} BUDGET=${USER_BUDGET:-3600} ROWS=${USER_ROWS:-2} ;;
  esac
  for TAG in step0 trained; do
    DIR="$DIR0/$TAG"
    mkdir -p "$DIR"
    RUN="$DIR/capture"
    if [[ $TAG == trained ]]; then
      DIR=$DIR0
      step "$W: training in chunks of $CHUNK steps until the loss flattens (or $BUDGET s)"
      train
      DIR="$DIR0/$TAG"
      resume=(--resume "$DIR0/state.pt")
    else
      resume=()
    fi
    step "$W ($TAG): capture, $LEARNERS gloo learners x $STEPS steps, batch $BATCH per learner"
    start=$SECONDS
    "$GRADSTAT" capture --workload "$W" $(size_of "$W") --nproc-per-node "$LEARNERS" \
      --steps $STEPS --batch-size "$BATCH" "${resume[@]}" --out "$RUN"
    echo "capture took $((SECONDS - start)) s" | tee "$DIR/capture-time.txt"
    analyse "$RUN" "-$TAG"
    if [[ "${KEEP:-0}" != 1 ]]; then rm -rf "$RUN"; fi
  done
done
printf '\ntables in %s, figures in %s\n' "$OUT" "$FIG"
