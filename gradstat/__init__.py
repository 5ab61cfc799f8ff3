"""gradstat: record learners' local gradients during data-parallel training and analyse
them for gradient compression (distribution fits, index similarity, build-up, replay).

``import gradstat`` stays light enough for training scripts: it never imports the
command line (typer, rich) or plotting (matplotlib, seaborn).
"""

from gradstat.errors import DataError, GradstatError, UsageError
from gradstat.store import Capture, open_capture

__version__ = "0.1.0"


def __getattr__(name: str):
    # The capture hook pulls in torch.distributed; load it only when asked for.
    if name == "GradientCapture":
        from gradstat.capture.hook import GradientCapture

        return GradientCapture
    raise AttributeError(f"module 'gradstat' has no attribute {name!r}")


__all__ = [
    "Capture",
    "DataError",
    "GradientCapture",
    "GradstatError",
    "UsageError",
    "__version__",
    "open_capture",
]
