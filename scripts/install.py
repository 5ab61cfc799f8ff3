"""Install gradstat into this interpreter's virtual environment with pinned versions only.

Called by `make setup` (so by `make demo` and `make test`) with the venv's python:

    .venv/bin/python scripts/install.py --constraints constraints.txt \
        --extras test,compression,lightning,transformers

1. pip itself, at its pin in the constraints file.
2. torch from PyTorch's CPU index (``--torch-index``) as an extra index: pip takes
   ``2.13.0+cpu`` there over PyPI's ``2.13.0`` (a local label sorts above the bare
   version, and ``==2.13.0`` matches both), so no CUDA libraries come along. Where the
   index does not answer within a few seconds (a machine that reaches only the default
   index), torch comes from the default index in step 3: on Linux x86-64 that is the
   CUDA build and its nvidia packages, pinned in the constraints file too.
3. gradstat, editable, with the extras, from the default index.
4. The check: every distribution the steps installed or changed has a pin in the
   constraints file, at that version (a local label such as ``+cpu`` aside). Exit 1
   naming the unpinned ones: add them to the constraints file.

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import urllib.request
from importlib.metadata import distributions
from pathlib import Path

TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
#: Seconds to wait for the CPU index before falling back to the default index.
PROBE_SECONDS = 10


def normal(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """name -> version of every distribution in this environment."""
    return {normal(d.metadata["Name"]): d.version for d in distributions()}


def pins(path: str) -> dict[str, str]:
    """name -> version of each ``name==version`` line of a constraints file."""
    found = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)", line)
        if match:
            found[normal(match.group(1))] = match.group(2)
    return found


def reachable(index: str) -> bool:
    """Whether ``index`` serves torch's page within ``PROBE_SECONDS``."""
    try:
        with urllib.request.urlopen(f"{index.rstrip('/')}/torch/", timeout=PROBE_SECONDS):
            return True
    except (OSError, ValueError):
        return False


def pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", "install", "--quiet", *args]
    print("+", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True)


def unpinned(before: dict[str, str], after: dict[str, str], pinned: dict[str, str]) -> list[str]:
    """Distributions new or changed since ``before`` whose version is not pinned."""
    faults = []
    for name, version in sorted(after.items()):
        if before.get(name) == version or name == "gradstat":
            continue
        pin = pinned.get(name)
        if pin is None or version.split("+")[0] != pin.split("+")[0]:
            faults.append(f"{name}=={version}" + (f" (pinned {pin})" if pin else " (no pin)"))
    return faults


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--constraints", default="constraints.txt")
    parser.add_argument("--extras", default="test,compression,lightning,transformers")
    parser.add_argument(
        "--torch-index", default=TORCH_INDEX, help="PyTorch's CPU index ('' to skip it)"
    )
    args = parser.parse_args()
    before = installed()
    constraints = ["-c", args.constraints]
    pip(*constraints, "pip")
    if args.torch_index and reachable(args.torch_index):
        pip(*constraints, "--extra-index-url", args.torch_index, "torch")
    elif args.torch_index:
        print(
            f"note: {args.torch_index} did not answer; torch comes from the default index "
            "(on Linux x86-64 the CUDA build, about 3 GB more; pinned in "
            f"{args.constraints} too)",
            flush=True,
        )
    pip(*constraints, "-e", f".[{args.extras}]" if args.extras else ".")
    faults = unpinned(before, installed(), pins(args.constraints))
    if faults:
        print(
            f"Error: installed without a pin in {args.constraints}: {', '.join(faults)}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
