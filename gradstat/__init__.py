"""gradstat: record learners' local gradients during data-parallel training and analyse
them for gradient compression (distribution fits, index similarity, build-up, replay).

``import gradstat`` stays light enough for training scripts: it never imports the
command line (typer, rich) or plotting (matplotlib, seaborn).
"""

from gradstat.errors import DataError, GradstatError, UsageError
from gradstat.lazy import lazy_attributes

__version__ = "0.1.0"

#: Names loaded on first use: the store pulls in h5py and torch, the capture hook
#: torch.distributed, the analyses torch, numpy and scipy; none of which
#: ``gradstat --version`` or ``--help`` needs. Every analysis is one function
#: ``(cap, selection, params, *, compute, progress)`` (docs/api.md).
_LAZY = {
    "Capture": "gradstat.store",
    "open_capture": "gradstat.store",
    "GradientCapture": "gradstat.capture.hook",
    "Selection": "gradstat.analysis.selection",
    "Compute": "gradstat.analysis.compute",
    "fit": "gradstat.analysis.fit",
    "FitParams": "gradstat.analysis.fit",
    "similarity": "gradstat.analysis.similarity",
    "SimilarityParams": "gradstat.analysis.similarity",
    "buildup": "gradstat.analysis.buildup",
    "BuildupParams": "gradstat.analysis.buildup",
    "overlap": "gradstat.analysis.overlap",
    "OverlapParams": "gradstat.analysis.overlap",
}


__getattr__ = lazy_attributes("gradstat", _LAZY, globals())


__all__ = [
    "BuildupParams",
    "Capture",
    "Compute",
    "DataError",
    "FitParams",
    "GradientCapture",
    "GradstatError",
    "OverlapParams",
    "Selection",
    "SimilarityParams",
    "UsageError",
    "__version__",
    "buildup",
    "fit",
    "open_capture",
    "overlap",
    "similarity",
]
