#!/usr/bin/env bash
# The main job on the built-in default: a real 4-learner capture, then every analysis,
# their plots and the HTML report. Called by `make demo` with GRADSTAT and OUT set.
set -euo pipefail
GRADSTAT=${GRADSTAT:-gradstat}
OUT=${OUT:-captures/demo}
RUN="$OUT/capture"
FIG="$OUT/figures"
# The recommendation's candidates, shared by `recommend` and the report so both agree.
CANDIDATES=fp16,bf16,topk,dgc,sidco-gpd,clt-k,powersgd  # the report's default

rm -rf "$OUT"
mkdir -p "$FIG"
# bold headings on a terminal; plain text in a log (no raw escape codes)
if [ -t 1 ]; then bold=$'\033[1m' plain=$'\033[0m'; else bold='' plain=''; fi
step() { printf '\n%s== %s%s\n' "$bold" "$*" "$plain"; }

step "capture: 4 gloo learners train the charlm transformer for 100 steps"
"$GRADSTAT" capture --workload charlm --nproc-per-node 4 --steps 100 --out "$RUN"
"$GRADSTAT" info "$RUN"

step "fit: which distribution do |g| follow, and how close do threshold estimators get to k?"
"$GRADSTAT" fit "$RUN" --dist all --ratios 0.01,0.001 --stages 1,2,3 --steps ::10 --plot "$FIG/fit.png"

step "similarity: do learners pick the same top-k indices?"
"$GRADSTAT" similarity "$RUN" --ratios 0.001 --plot "$FIG/similarity.png"

step "buildup: how large is the union of the learners' top-k sets?"
"$GRADSTAT" buildup "$RUN" --ratios 0.01,0.001 --plot "$FIG/buildup.png"

step "overlap: are top-k sets stable from one step to the next?"
"$GRADSTAT" overlap "$RUN" --ratios 0.001 --lag 1 --plot "$FIG/overlap.png"

step "replay: compressors with error feedback over the recorded steps"
"$GRADSTAT" replay "$RUN" --compressors topk,dgc,sidco-gpd,clt-k,powersgd --ratios 0.01,0.001 \
  --bandwidth 10Gbit/s --latency 5us --plot "$FIG/replay.png"

step "recommend: the fastest compressor within an error budget, extrapolated to 64 learners"
"$GRADSTAT" recommend "$RUN" --error-budget 0.5 --bandwidth 10Gbit/s --cluster-size 64 \
  --compressors "$CANDIDATES" --ratios 0.01,0.001 --out "$OUT/recommendation.json"

step "report: every analysis on one page, with the recommendation above (same settings)"
# --target-file: price compression with the profile the recommendation measured
"$GRADSTAT" report "$RUN" -o "$OUT/report.html" --error-budget 0.5 --cluster-size 64 \
  --compressors "$CANDIDATES" --target-file "$OUT/recommendation.json"
printf '\nfigures in %s, the report is %s\n' "$FIG" "$OUT/report.html"
