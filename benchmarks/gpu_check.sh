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
#   6. FSDP2 (fully_shard per block, gpt2): a 1-rank nccl capture and a 2-rank capture
#      sharing GPU 0 over gloo (each unit's reduce-scatter), rows checked against the
#      reduced gradient, and the capture overhead at every=1 and every=10 (1 rank nccl)
#
# Needs no network. Python: $PYTHON if set, else the project's .venv, else .venv-gpu (a
# previous run's), else python3; it must import torch with CUDA (the project pins torch's
# CPU build, so a GPU machine needs its own CUDA torch). gradstat itself runs from this
# checkout (PYTHONPATH). Dependencies that python cannot import are installed into a venv
# .venv-gpu made on top of it (--system-site-packages, so its CUDA torch is kept) with
# `pip install --no-index` from wheels/ (made beforehand, where there is a package index,
# by benchmarks/gpu_check_wheels.sh, and carried here beside the checkout); never from an
# index. Steps whose dependencies are still missing are skipped with a line saying so.
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
elif [[ -x .venv-gpu/bin/python ]]; then
  py=.venv-gpu/bin/python
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
# module -> distribution, for what gradstat imports; wheels/ holds the small ones
missing_of() {
  "$py" - "$@" <<'PY'
import importlib.util, sys
names = {"sklearn": "scikit-learn"}
print(" ".join(names.get(m, m) for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PY
}
DEPENDENCIES=(numpy h5py crc32c typer rich scipy pandas matplotlib seaborn numba sklearn)
missing=$(missing_of "${DEPENDENCIES[@]}")
if [[ -n $missing ]]; then
  wheels=${WHEELS:-$ROOT/wheels}
  have=$({ ls "$wheels" 2>/dev/null || true; } | sed -E 's/-[0-9].*//; s/_/-/g' | tr 'A-Z' 'a-z' | sort -u | tr '\n' ' ')
  installable=()
  for dist in $missing; do
    [[ " $have " == *" ${dist,,} "* ]] && installable+=("$dist")
  done
  if (( ${#installable[@]} )); then
    say "missing beside $py: $missing; installing ${installable[*]} from $wheels into .venv-gpu (pip --no-index)"
    [[ -x .venv-gpu/bin/python ]] || "$py" -m venv --system-site-packages .venv-gpu
    .venv-gpu/bin/python -m pip install --quiet --no-index --find-links "$wheels" "${installable[@]}" \
      || die "pip could not install ${installable[*]} from $wheels (pip --no-index)"
    py=.venv-gpu/bin/python
    missing=$(missing_of "${DEPENDENCIES[@]}")
  fi
  if [[ -n $missing ]]; then
    say "still missing: $missing (steps that need them are skipped; make wheels/ with benchmarks/gpu_check_wheels.sh)"
  fi
fi
needs() {  # needs STEP MODULE...: true when every module imports, else a skip line
  local step=$1 lacking
  shift
  lacking=$(missing_of "$@")
  [[ -z $lacking ]] && return 0
  say "$step skipped: $lacking missing beside $py"
  return 1
}
needs "every capture" numpy h5py crc32c || die "a capture needs numpy, h5py and crc32c: bring them as wheels (benchmarks/gpu_check_wheels.sh)"
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
wl=resnet50  # its data is scikit-learn's digits
needs "resnet50 (steps 1-3)" sklearn || { wl=gpt2; say "   steps 1-3 train gpt2 instead"; }

# --- 1. one rank, nccl -----------------------------------------------------------------
if [[ $MODE == gpu ]]; then
  say "1. $wl ($size), 1 rank, nccl, $steps steps -> $OUT/nccl-1"
  torchrun --nproc-per-node 1 benchmarks/gpu_check.py train --backend nccl --device cuda --workload $wl \
    --size $size --batch-size $batch --steps $steps --out "$OUT/nccl-1" >"$OUT/nccl-1.log" 2>&1 \
    || { tail -20 "$OUT/nccl-1.log"; die "the nccl capture failed (log: $OUT/nccl-1.log)"; }
  "$py" benchmarks/gpu_check.py verify "$OUT/nccl-1" --tolerance $tolerance || failures=$((failures + 1))
else
  say "1. skipped on CPU (nccl needs GPUs)"
fi

# --- 2. four ranks share one GPU over gloo ---------------------------------------------
say "2. $wl ($size), 4 ranks on $device 0 over gloo, $steps steps -> $OUT/gloo-4"
torchrun --nproc-per-node 4 benchmarks/gpu_check.py train --backend gloo --device $device --workload $wl \
  --size $size --batch-size $batch --steps $steps --out "$OUT/gloo-4" >"$OUT/gloo-4.log" 2>&1 \
  || { tail -20 "$OUT/gloo-4.log"; die "the 4-rank gloo capture failed (log: $OUT/gloo-4.log)"; }
"$py" benchmarks/gpu_check.py verify "$OUT/gloo-4" --tolerance 1e-4 || failures=$((failures + 1))

# --- 3. capture overhead ---------------------------------------------------------------
backend=nccl
[[ $MODE == cpu ]] && backend=gloo
say "3. capture overhead, $wl ($size), 1 rank, $backend, batch $batch"
torchrun --nproc-per-node 1 benchmarks/gpu_check.py overhead --backend $backend --device $device --workload $wl \
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
analyses=(similarity fit)
needs "4. analyses" typer rich scipy pandas numba matplotlib seaborn || analyses=()
for analysis in "${analyses[@]}"; do
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
if [[ $MODE == gpu ]] && needs "5. target profile" typer rich scipy pandas numba; then
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
elif [[ $MODE == cpu ]]; then
  say "5. skipped on CPU (gpu-here measures a CUDA GPU)"
fi

# --- 6. FSDP2 ---------------------------------------------------------------------------
# fully_shard per transformer block and the root, as `gradstat capture --fsdp`. With one
# rank FSDP runs no reduce-scatter and gradstat records in the all-reduce hook; two ranks
# sharing GPU 0 over gloo record each unit's reduce-scatter input (CUDA streams, pinned
# copies). Rows: the mean over learners must equal the reduced gradient.
fsdp_batch=$([[ $MODE == gpu ]] && echo 16 || echo 4)
if [[ $MODE == gpu ]]; then
  say "6. FSDP2 gpt2 ($size), 1 rank, nccl, $steps steps -> $OUT/fsdp-nccl-1"
  if torchrun --nproc-per-node 1 benchmarks/gpu_check.py train --fsdp --backend nccl --device cuda \
      --workload gpt2 --size $size --batch-size $fsdp_batch --steps $steps --out "$OUT/fsdp-nccl-1" \
      >"$OUT/fsdp-nccl-1.log" 2>&1; then
    "$py" benchmarks/gpu_check.py verify "$OUT/fsdp-nccl-1" --tolerance $tolerance || failures=$((failures + 1))
  else
    tail -5 "$OUT/fsdp-nccl-1.log"; say "   FAILED (log: $OUT/fsdp-nccl-1.log)"; failures=$((failures + 1))
  fi
else
  say "6. FSDP2 nccl skipped on CPU (nccl needs GPUs)"
fi
say "6. FSDP2 gpt2 ($size), 2 ranks on $device 0 over gloo, $steps steps -> $OUT/fsdp-gloo-2"
if torchrun --nproc-per-node 2 benchmarks/gpu_check.py train --fsdp --backend gloo --device $device \
    --workload gpt2 --size $size --batch-size $fsdp_batch --steps $steps --out "$OUT/fsdp-gloo-2" \
    >"$OUT/fsdp-gloo-2.log" 2>&1; then
  "$py" benchmarks/gpu_check.py verify "$OUT/fsdp-gloo-2" --tolerance 1e-4 || failures=$((failures + 1))
elif [[ $MODE == gpu ]] && grep -q -i -E "(error|exception).*(gloo|not (supported|implemented)|unsupported)" "$OUT/fsdp-gloo-2.log"; then
  # not gradstat's failure: this torch's gloo lacks a collective FSDP2 needs on CUDA
  say "   gloo cannot run FSDP2's collectives on CUDA tensors here (not counted): $(grep -i -m1 -E '(error|exception).*(gloo|not (supported|implemented)|unsupported)' "$OUT/fsdp-gloo-2.log" | cut -c1-160)"
else
  tail -5 "$OUT/fsdp-gloo-2.log"; say "   FAILED (log: $OUT/fsdp-gloo-2.log)"; failures=$((failures + 1))
fi
say "6. FSDP2 capture overhead, gpt2 ($size), 1 rank, $backend, batch $fsdp_batch"
torchrun --nproc-per-node 1 benchmarks/gpu_check.py overhead --fsdp --backend $backend --device $device \
  --workload gpt2 --size $size --batch-size $fsdp_batch --steps 10 --blocks 3 --out "$OUT/fsdp-overhead" \
  2>"$OUT/fsdp-overhead.log" \
  || { tail -5 "$OUT/fsdp-overhead.log"; say "   FAILED (log: $OUT/fsdp-overhead.log)"; failures=$((failures + 1)); }
rm -rf "$OUT/fsdp-overhead"

say "done in $((SECONDS - started)) s: $failures failure(s); logs and captures in $OUT"
exit $((failures > 0))
