"""Shared fixtures: small captures with known contents."""

from __future__ import annotations

import numpy as np
import pytest

from gradstat.store import layer_table, write_capture


@pytest.fixture
def synthetic_capture(tmp_path):
    """A 3-learner, 6-step capture of Laplace-distributed gradients with 3 layers.

    Returns ``(path, grads)`` with ``grads[learner, step, numel]`` as written.
    """
    rng = np.random.default_rng(0)
    layers = layer_table(
        [("conv.weight", (8, 1, 3, 3)), ("conv.bias", (8,)), ("fc.weight", (10, 50))]
    )
    numel = layers[-1].stop
    shared = rng.laplace(size=(1, 6, numel))
    grads = (shared + 0.5 * rng.laplace(size=(3, 6, numel))).astype(np.float32)
    path = write_capture(tmp_path / "synthetic", grads, layers, steps=[0, 1, 2, 3, 4, 5])
    return path, grads


@pytest.fixture(scope="session")
def real_capture(tmp_path_factory):
    """A real capture: 3 gloo learners train the digits CNN for 10 steps (about 10 s).

    Shared by the whole session; tests must only read it.
    """
    from gradstat.capture.launch import CaptureOptions, run_capture

    out = tmp_path_factory.mktemp("real") / "digits"
    options = CaptureOptions(
        workload="digits", steps=10, nproc_per_node=3, out=out, command="tests"
    )
    return run_capture(options)
