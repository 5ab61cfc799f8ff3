"""gradstat: record learners' local gradients during data-parallel training and analyse
them for gradient compression (distribution fits, index similarity, build-up, replay).

``import gradstat`` stays light enough for training scripts: it never imports the
command line (typer, rich) or plotting (matplotlib, seaborn).
"""

from gradstat.errors import DataError, GradstatError, UsageError
from gradstat.lazy import lazy_attributes

__version__ = "0.1.0"

#: Names loaded on first use: the store pulls in h5py and torch, the capture hook
#: torch.distributed, none of which ``gradstat --version`` or ``--help`` needs.
_LAZY = {
    "Capture": "gradstat.store",
    "open_capture": "gradstat.store",
    "GradientCapture": "gradstat.capture.hook",
}


__getattr__ = lazy_attributes("gradstat", _LAZY, globals())


__all__ = [
    "Capture",
    "DataError",
    "GradientCapture",
    "GradstatError",
    "UsageError",
    "__version__",
    "open_capture",
]
