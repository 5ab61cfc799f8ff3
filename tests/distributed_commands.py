"""Run gradstat commands in one torchrun job (``tests/test_distributed.py``).

Usage under torchrun: ``distributed_commands.py OUT.json COMMANDS.json``. Every rank
joins one gloo group and runs each command through ``gradstat.cli.main.main`` (rank 0
runs it, the others compute its units); rank 0 writes each command's exit code, stdout
and stderr to OUT.json. One job for all commands, so the test pays torchrun's start once.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

import torch.distributed as dist

from gradstat.cli.main import main


def run(argv: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    target, commands = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    results = [run(argv) for argv in commands]
    if dist.get_rank() == 0:
        with open(target, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
