#!/usr/bin/env bash
# The GPU check (issue 12): everything gradstat does differently on a GPU, in one run of
# under 5 minutes on one H200.
#
#   bash benchmarks/gpu_check.sh            # on a machine with a CUDA GPU
#   bash benchmarks/gpu_check.sh --cpu      # the same steps on CPU, tiny models (tests the script)
#
#   1. a 1-rank nccl capture of resnet50 (23.5M parameters), rows checked against .grad
#   2. a 4-rank capture sharing GPU 0 over gloo with CUDA tensors (the pinned,
#      non-blocking copy path), rows checked against .grad
#   3. capture overhead at every=1 and every=10 on resnet50 (step time ratios, 1 rank nccl)
#   4. similarity and fit with --device cuda against --device cpu, where the analyses
#      have --device
#   5. the cost model's GPU rates measured (--target gpu-here) beside the derived profile
#
# Installs nothing beyond the project. Python: $PYTHON if set, else the project's .venv,
# else python3; it must import torch with CUDA (the project pins torch's CPU build, so a
# GPU machine needs its own CUDA torch). If gradstat's other dependencies are missing, a
# venv .venv-gpu is made on top of that python (--system-site-packages, so its CUDA torch
# is kept) and the project installed into it with pip from constraints.txt.
# Results go to $OUT (default: a fresh temporary folder); every line says what ran.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
MODE=gpu
[[ "${1:-}" == "--cpu" ]] && MODE=cpu
OUT=${OUT:-$(mktemp -d /tmp/gradstat-gpu-check.XXXXXX)}
mkdir -p "$OUT"
started=$SECONDS
say() { printf '[gpu_check %3ds] %s\n' $((SECONDS - started)) "$*"; }
die() { printf 'gpu_check: Error: %s\n' "$*" >&2; exit 1; }

# --- the python ------------------------------------------------------------------------
if [[ -n "${PYTHON:-}" ]]; then
  py=$PYTHON
elif [[ -x .venv/bin/python ]]; then
  py=.venv/bin/python
else
  py=python3
fi
command -v "$py" >/dev/null || die "no python at '$py' (set PYTHON=...)"
torch_line=$("$py" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count())' 2>/dev/null) \
  || die "$py cannot import torch; set PYTHON to a python with a CUDA build of torch"
read -r torch_version cuda_version cuda_ok gpus <<<"$torch_line"
say "python $py: torch $torch_version, CUDA $cuda_version, available $cuda_ok, $gpus GPU(s)"
if [[ $MODE == gpu && $cuda_ok != True ]]; then
  die "no CUDA GPU visible to $py (torch $torch_version, CUDA $cuda_version): run on a machine with a GPU, with PYTHON set to a python whose torch has CUDA, or use --cpu to test this script"
fi
if ! "$py" -c 'import h5py, numpy, scipy, pandas, typer, rich, matplotlib, sklearn' 2>/dev/null; then
  say "gradstat's dependencies are missing beside $py: making .venv-gpu (--system-site-packages) with the project"
  [[ -x .venv-gpu/bin/python ]] || "$py" -m venv --system-site-packages .venv-gpu
  .venv-gpu/bin/python -m pip install --quiet -c constraints.txt -e . \
    || die "could not install the project's dependencies into .venv-gpu (no package index here?)"
  py=.venv-gpu/bin/python
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
gradstat() { "$py" -m gradstat "$@"; }
torchrun() { "$py" -m torch.distributed.run --standalone "$@"; }

if [[ $MODE == gpu ]]; then
  device=cuda size=large batch=32 steps=3 tolerance=1e-5
  "$py" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"GPU 0: {p.name}, {p.total_memory / 2**30:.0f} GiB")'
else
  device=cpu size=tiny batch=8 steps=2 tolerance=1e-5
  say "--cpu: every step on CPU with gloo and tiny models (checks this script, measures nothing about GPUs)"
fi
failures=0

# --- 1. one rank, nccl -----------------------------------------------------------------
if [[ $MODE == gpu ]]; then
  say "1. resnet50 ($size), 1 rank, nccl, $steps steps -> $OUT/nccl-1"
  torchrun --nproc-per-node 1 benchmarks/gpu_check.py train --backend nccl --device cuda \
    --size $size --batch-size $batch --steps $steps --out "$OUT/nccl-1" >"$OUT/nccl-1.log" 2>&1 \
    || { tail -20 "$OUT/nccl-1.log"; die "the nccl capture failed (log: $OUT/nccl-1.log)"; }
  "$py" benchmarks/gpu_check.py verify "$OUT/nccl-1" --tolerance $tolerance || failures=$((failures + 1))
else
  say "1. skipped on CPU (nccl needs GPUs)"
fi

# --- 2. four ranks share one GPU over gloo ---------------------------------------------
say "2. resnet50 ($size), 4 ranks on $device 0 over gloo, $steps steps -> $OUT/gloo-4"
torchrun --nproc-per-node 4 benchmarks/gpu_check.py train --backend gloo --device $device \
  --size $size --batch-size $batch --steps $steps --out "$OUT/gloo-4" >"$OUT/gloo-4.log" 2>&1 \
  || { tail -20 "$OUT/gloo-4.log"; die "the 4-rank gloo capture failed (log: $OUT/gloo-4.log)"; }
"$py" benchmarks/gpu_check.py verify "$OUT/gloo-4" --tolerance 1e-4 || failures=$((failures + 1))

# --- 3. capture overhead ---------------------------------------------------------------
backend=nccl
[[ $MODE == cpu ]] && backend=gloo
say "3. capture overhead, resnet50 ($size), 1 rank, $backend, batch $batch"
torchrun --nproc-per-node 1 benchmarks/gpu_check.py overhead --backend $backend --device $device \
  --size $size --batch-size $batch --steps 10 --blocks 3 --out "$OUT/overhead" 2>"$OUT/overhead.log" \
  || { tail -20 "$OUT/overhead.log"; die "the overhead benchmark failed (log: $OUT/overhead.log)"; }
rm -rf "$OUT/overhead"  # up to 4 GB of rows

# --- 4. analyses on the GPU ------------------------------------------------------------
capture="$OUT/gloo-4"
time_it() {  # time_it LABEL COMMAND...: wall seconds of one run, output kept in the log
  local label=$1 t0 t1
  shift
  t0=$(date +%s.%N)
  "$@" >>"$OUT/analyses.log" 2>&1 || { tail -5 "$OUT/analyses.log" >&2; say "   $label FAILED" >&2; return 1; }
  t1=$(date +%s.%N)
  "$py" -c "print(f'{$t1 - $t0:.2f}')"
}
for analysis in similarity fit; do
  if ! gradstat "$analysis" --help 2>/dev/null | grep -q -- '--device'; then
    say "4. $analysis has no --device option yet: skipped"
    continue
  fi
  args=(--ratio 0.001)
  [[ $analysis == fit ]] && args=(--ratios 0.01,0.001)
  say "4. gradstat $analysis $capture ${args[*]} --device cuda|cpu"
  if [[ $MODE == gpu ]]; then
    gpu_s=$(time_it "$analysis cuda" gradstat "$analysis" "$capture" "${args[@]}" --device cuda) || { failures=$((failures + 1)); continue; }
  else
    gpu_s=n/a
  fi
  cpu_s=$(time_it "$analysis cpu" gradstat "$analysis" "$capture" "${args[@]}" --device cpu) || { failures=$((failures + 1)); continue; }
  ratio=$([[ $gpu_s == n/a ]] && echo n/a || "$py" -c "print(f'{$cpu_s / $gpu_s:.1f}x')")
  say "   $analysis: cpu ${cpu_s}s, cuda ${gpu_s}s, cuda speed-up $ratio (one run each, same capture)"
done

# --- 5. the cost model's GPU rates, measured --------------------------------------------
# recommend's built-in GPU profiles derive top-k, sort and randperm rates from the memory
# bandwidth; gpu-here measures them on this GPU with the same operations as cpu-here.
if [[ $MODE == gpu ]]; then
  say "5. target profile measured on this GPU (gpu-here) against the derived h200 profile"
  "$py" - <<'PY' || failures=$((failures + 1))
from gradstat.compressors.targets import BUILTIN, builtin_target

measured, derived = builtin_target("gpu-here"), BUILTIN["h200"]
print(f"   {measured.description}")
print(f"   {'rate':<18} {'measured':>12} {'derived h200':>14} {'measured/derived':>17}")
for name, value in measured.to_dict().items():
    if isinstance(value, float):
        other = getattr(derived, name)
        print(f"   {name:<18} {value:>12.4g} {other:>14.4g} {value / other:>17.2f}")
PY
  say "   recommend on the gloo-4 capture with --target gpu-here (ranked table as printed)"
  gradstat recommend "$capture" --ratios 0.01,0.001 --cluster-size 64 --bandwidth 10Gbit/s \
    --target gpu-here 2>&1 | tail -25 || failures=$((failures + 1))
else
  say "5. skipped on CPU (gpu-here measures a CUDA GPU)"
fi

say "done in $((SECONDS - started)) s: $failures failure(s); logs and captures in $OUT"
exit $((failures > 0))
