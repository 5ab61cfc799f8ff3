#!/usr/bin/env python3
"""Regenerate the docs' example outputs from real runs, so they cannot drift.

A generated example is a fenced block right after the marker line
``<!-- output: scripts/docs_outputs.py -->`` whose first line is the command,
``$ gradstat ...`` (continued over lines ending in ``\\``). This script runs each such
command at 80 columns from the repository root (``captures/demo/capture``: what
``make demo`` writes) and replaces the rest of the block with what it printed (stderr without
its progress lines, then stdout). Blocks without the marker are left alone.

    python scripts/docs_outputs.py [DOC.md ...]      # default: every docs/*.md
    python scripts/docs_outputs.py --check [DOC.md]  # exit 1 if an output is stale

Timings in outputs vary from run to run; ``--check`` is for outputs without them.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Progress lines on stderr (``replay: 13/30 (43%), 0:05 elapsed``): left out.
PROGRESS = re.compile(r"^\S+: \d+/\d+ \(\d+%\)")
MARKER = "<!-- output: scripts/docs_outputs.py -->"
BLOCK = re.compile(
    re.escape(MARKER) + r"\n```\n(?P<command>\$ (?:[^\n]*\\\n)*[^\n]*)\n(?P<output>.*?)```",
    re.DOTALL,
)


def run(command: str) -> str:
    """What ``command`` (``gradstat ...``) prints at 80 columns, from the repository root."""
    argv = shlex.split(command.replace("\\\n", " "))
    env = {**os.environ, "COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{command}: exit {done.returncode}\n{done.stderr}")
    lines = [line for line in done.stderr.splitlines() if not PROGRESS.match(line)]
    lines += done.stdout.splitlines()
    return "\n".join(line.rstrip() for line in lines) + "\n"


def regenerate(text: str, runner: Callable[[str], str] = run) -> str:
    """``text`` with every marked block's output replaced by its command's."""

    def replace(match: re.Match) -> str:
        command = match["command"]
        output = runner(command[2:])
        return f"{MARKER}\n```\n{command}\n{output}```"

    return BLOCK.sub(replace, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("docs", nargs="*", type=Path)
    parser.add_argument("--check", action="store_true", help="only report stale outputs")
    args = parser.parse_args()
    docs = args.docs or sorted((ROOT / "docs").glob("*.md"))
    stale = []
    for doc in docs:
        text = doc.read_text()
        if MARKER not in text:
            continue
        new = regenerate(text)
        if new != text:
            stale.append(doc)
            if not args.check:
                doc.write_text(new)
        print(f"{doc}: {'stale' if new != text else 'up to date'}", file=sys.stderr)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
