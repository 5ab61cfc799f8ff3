"""Lightning, Hugging Face Trainer and accelerate with gradstat: 2 CPU learners, real DDP.

Each framework trains a tiny MLP for 3 optimizer steps of 2 accumulated micro-batches
(``tests/framework_train.py``); the mean of the learners' recorded rows must equal the
all-reduced ``.grad`` the optimizer saw, so accumulation under ``no_sync`` is covered too.
Skipped where the framework is not installed (CI installs the extras).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from gradstat import open_capture
from tests.helpers import TESTS, torchrun

SCRIPT = TESTS / "framework_train.py"
FRAMEWORKS = {
    "lightning": "lightning",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "lightning-fsdp2": "lightning",  # ModelParallelStrategy, fully_shard in configure_model
}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.parametrize(
    "framework",
    [
        pytest.param(
            name,
            marks=[pytest.mark.skipif(not _installed(module), reason=f"no {module}")]
            # lightning runs in `make test`; the others share its path (make test-slow)
            + ([] if name == "lightning" else [pytest.mark.slow]),
        )
        for name, module in FRAMEWORKS.items()
    ],
)
def test_rows_are_the_local_gradients_of_the_allreduced_step(tmp_path, framework):
    result = torchrun(SCRIPT, "--out", str(tmp_path), "--framework", framework, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    references = [np.load(tmp_path / f"reference-rank{rank}.npy") for rank in range(2)]
    np.testing.assert_array_equal(references[0], references[1])
    assert len(references[0]) == 3
    with open_capture(tmp_path) as cap:
        assert cap.status == "complete"
        assert list(cap.steps) == [0, 1, 2]
        for row, (_step, grads) in enumerate(cap.iter_steps()):
            np.testing.assert_allclose(
                grads.mean(0).numpy(), references[0][row], rtol=1e-5, atol=1e-7
            )
            assert not np.allclose(grads[0].numpy(), grads[1].numpy()), "learners must differ"
        assert cap.losses.shape == (2, 3) and np.isfinite(cap.losses).all()
        assert (cap.losses > 0).all()  # mean squared errors


@pytest.mark.skipif(not _installed("lightning"), reason="no lightning")
def test_lightning_callback_rejects_unknown_options():
    from gradstat.errors import UsageError
    from gradstat.integrations.lightning import GradstatCallback

    with pytest.raises(UsageError, match="evry"):
        GradstatCallback("unused", evry=10)
