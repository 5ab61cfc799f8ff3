"""``gradstat merge``: join the parts of a multi-node capture into one capture folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from gradstat.cli.output import console

Dest = Annotated[
    Path,
    typer.Argument(
        metavar="DEST",
        help="The joined capture: a new folder, or one of the parts.",
        show_default=False,
    ),
]
Parts = Annotated[
    list[Path],
    typer.Argument(
        metavar="PART",
        help="The nodes' capture folders (node 0's holds capture.h5).",
        show_default=False,
    ),
]
Move = Annotated[
    bool, typer.Option("--move", help="Move the rank files instead of hard-linking them.")
]


def merge_command(dest: Dest, parts: Parts, move: Move = False) -> None:
    """Join the folders that the nodes of one multi-node capture wrote into one capture.

    Without a shared file system each node of `gradstat capture --nnodes N` keeps its
    learners' rank files in its own --out folder. Copy the folders onto one machine
    and merge them there. Rank files are hard-linked (no data copied; --move moves
    them), capture.h5 is copied, and the result is checked like any capture.

    Example: gradstat merge captures/run captures/node0 captures/node1
    """
    from gradstat.store.merge import merge_parts  # h5py: only once a capture is read

    with merge_parts(dest, parts, move=move) as cap:
        steps, learners, status = len(cap.steps), cap.learners_text(), cap.status
    where = escape(str(dest))
    console.print(f"merged {steps} steps x {learners} ({status}) into [bold]{where}[/bold]")
    console.print(f"next: gradstat info {where}")
