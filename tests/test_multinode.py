"""Multi-node capture on one machine, as two nodes of a cluster would run it (issue 12):
a shared folder, a node that never joins, and parts joined by ``gradstat merge``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from gradstat import open_capture
from gradstat.store.schema import rank_file_name
from tests.helpers import assert_clean_error, run_cli


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(out, node_rank, port, *extra):
    argv = [
        sys.executable,
        "-m",
        "gradstat",
        "capture",
        "--workload",
        "digits",
        "--size",
        "tiny",
        "--steps",
        "3",
        "--nproc-per-node",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--out",
        str(out),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _run_nodes(out0, out1):
    port = _free_port()
    nodes = [_node(out1, 1, port), _node(out0, 0, port)]  # node 1 may well start first
    results = [node.communicate(timeout=300) for node in nodes]
    for node, (stdout, stderr) in zip(nodes, results, strict=True):
        assert node.returncode == 0, stdout + stderr
    return results


def _check_four_learners(path):
    with open_capture(path) as cap:
        assert cap.status == "complete" and cap.learners == [0, 1, 2, 3]
        assert list(cap.steps) == [0, 1, 2]
        grads = cap.read_step(2).numpy()
        assert not np.allclose(grads[0], grads[2])  # each learner its own shard


@pytest.mark.slow  # the launcher's checks: test_a_node_that_never_joins, test_merge_*
def test_two_nodes_share_one_folder(tmp_path):
    out = tmp_path / "shared"
    (_, _), (stdout0, _) = _run_nodes(out, out)
    _check_four_learners(out)
    assert "captured 3 steps x 4 learners" in stdout0
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "capture-node1.log",
        "capture.h5",
        "capture.log",
        *(rank_file_name(r) for r in range(4)),
    ]


def test_a_node_that_never_joins_fails_within_its_timeout(tmp_path):
    out = tmp_path / "alone"
    started = time.monotonic()
    node = _node(out, 0, _free_port(), "--join-timeout", "4")
    _, stderr = node.communicate(timeout=120)
    assert node.returncode == 1, stderr
    took = time.monotonic() - started  # Python and torchrun start-up, 4 s wait, stop
    assert took < 100, took
    assert "waiting for nodes to join: 1 of 2 started" in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, stderr
    assert "node 1 did not join within --join-timeout 4 s" in errors[0]


def test_merge_joins_parts_by_hard_links(tmp_path, synthetic_capture, capsys):
    """The parts of a 3-learner capture as two nodes without a shared folder leave them."""
    path, grads = synthetic_capture
    part0, part1 = path, tmp_path / "node1"
    part1.mkdir()
    (path / rank_file_name(2)).rename(part1 / rank_file_name(2))
    info = run_cli(capsys, "info", part0)
    assert_clean_error(info, code=1)
    assert "learners 2 are missing" in info.stderr and "gradstat merge" in info.stderr
    assert "learners 2 but no capture.h5" in run_cli(capsys, "info", part1).stderr
    result = run_cli(capsys, "merge", tmp_path / "joined", part0, part1)
    assert result.code == 0, result
    assert "merged 6 steps x 3 learners (complete)" in result.stdout
    with open_capture(tmp_path / "joined") as cap:
        np.testing.assert_array_equal(cap.read_step(3).numpy(), grads[:, 3])
    assert os.path.samefile(tmp_path / "joined" / rank_file_name(2), part1 / rank_file_name(2))
    with h5py.File(tmp_path / "joined" / "capture.h5", "r") as root:  # for other tools
        np.testing.assert_array_equal(root["grad"][2, 3], grads[2, 3])
    result = run_cli(capsys, "merge", part1, part1, part0, "--move")  # into a part, moving
    assert result.code == 0, result
    assert not (part0 / rank_file_name(0)).exists()
    with open_capture(part1) as cap:
        np.testing.assert_array_equal(cap.read_step(5).numpy(), grads[:, 5])


def test_merge_refuses_what_does_not_fit(tmp_path, synthetic_capture, capsys):
    path, _ = synthetic_capture
    other = tmp_path / "other"
    other.mkdir()
    (path / rank_file_name(1)).rename(other / rank_file_name(1))
    for args, message in (
        ([tmp_path / "j", path], "learners 1; give every node's folder"),
        ([tmp_path / "j", other], "exactly one part must hold capture.h5"),
        ([path, path, other], None),  # in place: fine
        ([tmp_path / "j2", path, path], None),
    ):
        result = run_cli(capsys, "merge", *args)
        if message is None:
            assert result.code == 0, result
        else:
            assert_clean_error(result, code=2)
            assert message in result.stderr


@pytest.mark.slow
def test_parts_in_separate_folders_are_merged(tmp_path, capsys):
    part0, part1 = tmp_path / "node0", tmp_path / "node1"
    (stdout1, _), _ = _run_nodes(part0, part1)
    assert "join it to node 0's folder with gradstat merge" in " ".join(stdout1.split())
    info = run_cli(capsys, "info", part0)  # a part says what is missing and what to do
    assert_clean_error(info, code=1)
    assert "learners 2-3 are missing" in info.stderr and "gradstat merge" in info.stderr
    info = run_cli(capsys, "info", part1)
    assert_clean_error(info, code=1)
    assert "learners 2-3 but no capture.h5" in info.stderr
    result = run_cli(capsys, "merge", tmp_path / "joined", part0, part1)
    assert result.code == 0, result
    assert "merged 3 steps x 4 learners (complete)" in result.stdout
    _check_four_learners(tmp_path / "joined")
    for rank, part in ((0, part0), (3, part1)):  # linked, not copied
        assert os.path.samefile(
            tmp_path / "joined" / rank_file_name(rank), part / rank_file_name(rank)
        )
    again = run_cli(capsys, "merge", tmp_path / "joined", part0, part1)
    assert_clean_error(again, code=2)
    only_one = run_cli(capsys, "merge", tmp_path / "j2", part0)
    assert_clean_error(only_one, code=2)
    assert "learners 2-3" in only_one.stderr
