#!/usr/bin/env bash
# Wheels for benchmarks/gpu_check.sh on a GPU machine without network (issue 27).
#
#   bash benchmarks/gpu_check_wheels.sh          # here, with a package index
#
# Downloads, into wheels/ (ignored by git, carried to the GPU machine beside the
# checkout), the wheels for Python 3.12 on manylinux x86_64 of what gpu_check.sh imports
# beyond torch and numpy and a GPU image may lack: crc32c and h5py (every capture),
# typer (with pydantic), rich and seaborn and their small dependencies (the CLI and the
# analyses). gpu_check.sh installs from there with `pip install --no-index` whatever its
# python cannot import. Versions are constraints.txt's. numba (+ llvmlite, 64 MB), scipy
# and scikit-learn are too large to carry: gpu_check.sh skips the steps that need them
# when the machine lacks them, and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
pins() {  # the constraints.txt pins of the named distributions
  local name
  for name in "$@"; do
    grep -i -E "^${name//-/[-_]}==" constraints.txt || { echo "no pin for $name in constraints.txt" >&2; exit 1; }
  done
}
mkdir -p wheels
python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 -d wheels \
  $(pins crc32c h5py typer click shellingham rich markdown-it-py mdurl Pygments seaborn \
    annotated-doc typing_extensions pydantic pydantic_core annotated-types typing-inspection)
du -sh wheels
ls wheels
