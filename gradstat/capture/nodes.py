"""Multi-node capture on a shared file system: who writes what, and who has joined.

Every node runs the same ``gradstat capture --nnodes N --node-rank K ... --out FOLDER``.
All nodes write their learners' rank files into that one folder; node 0 alone checks
that the folder is new and writes ``capture.h5`` and ``capture.log``, every other node
logs to ``capture-node<K>.log``. A node's log file appears when it starts, so on a
shared folder the log files also tell which nodes have started.

torchrun's rendezvous waits silently (10 minutes by default) for nodes that never come;
the launcher instead waits ``--join-timeout`` seconds, printing a progress line, and
then fails with the nodes that are missing.
"""

from __future__ import annotations

import re
from pathlib import Path

from gradstat.errors import UsageError
from gradstat.store.schema import ROOT_FILE

ROOT_LOG = "capture.log"
NODE_LOG = re.compile(r"capture-node(\d+)\.log")
#: Seconds a node waits for the others by default: nodes of one job start together.
DEFAULT_JOIN_TIMEOUT = 300.0


def log_name(node_rank: int) -> str:
    """``capture.log`` on node 0, ``capture-node<K>.log`` on the others."""
    return ROOT_LOG if node_rank == 0 else f"capture-node{node_rank}.log"


def check_folder(run_dir: Path, node_rank: int) -> None:
    """Check that the capture folder can be this node's: on node 0, that it holds no
    capture.

    Other nodes' log files may already be there (they may start first); anything else
    means an older capture that this one must not overwrite.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"--out {run_dir} is a file; give a folder for the capture")
    if node_rank == 0 and run_dir.exists():
        others = [p.name for p in run_dir.iterdir() if not NODE_LOG.fullmatch(p.name)]
        if others:
            raise UsageError(
                f"{run_dir} already exists and is not empty; choose another --out or remove it"
            )
    if node_rank > 0 and (run_dir / log_name(node_rank)).exists():
        raise UsageError(
            f"{run_dir} already holds node {node_rank}'s log from another capture; "
            "choose another --out or remove it"
        )


def started_nodes(run_dir: Path, nnodes: int) -> list[int]:
    """Nodes whose log file is in the (shared) folder: the ones that have started."""
    started = {0} if (run_dir / ROOT_LOG).exists() or (run_dir / ROOT_FILE).exists() else set()
    for path in run_dir.glob("capture-node*.log"):
        match = NODE_LOG.fullmatch(path.name)
        if match and int(match.group(1)) < nnodes:
            started.add(int(match.group(1)))
    return sorted(started)


def waiting_text(run_dir: Path, nnodes: int, node_rank: int, waited: float, limit: float) -> str:
    """The progress line printed while nodes are missing."""
    started = set(started_nodes(run_dir, nnodes)) | {node_rank}
    return (
        f"waiting for nodes to join: {len(started)} of {nnodes} started "
        f"({waited:.0f} s of --join-timeout {limit:g} s)"
    )


def missing_text(run_dir: Path, nnodes: int, node_rank: int, limit: float, rendezvous: str) -> str:
    """The error when the wait ends: which nodes did not come."""
    started = set(started_nodes(run_dir, nnodes)) | {node_rank}
    missing = [k for k in range(nnodes) if k not in started]
    if missing:
        names = ", ".join(str(k) for k in missing)
        what = f"node{'s' if len(missing) > 1 else ''} {names} did not join"
    else:  # every log is here (shared folder) but the rendezvous did not complete
        what = "the nodes started but could not reach each other"
    return (
        f"{what} within --join-timeout {limit:g} s (rendezvous {rendezvous}, "
        f"{nnodes} nodes); run the same command with each missing --node-rank, "
        "or raise --join-timeout"
    )
