"""Ctrl-C that is never lost: installed as ``sys.unraisablehook`` by the command line.

Python raises KeyboardInterrupt wherever the main thread is when SIGINT arrives. Where
that is a weakref callback or a finalizer, the exception cannot propagate: Python prints
"Exception ignored ..." with a traceback and goes on, and the command runs to its end
(seen in ``make test``: a report interrupted during an import exited 0).
"""

from __future__ import annotations

import _imp
import _thread
import contextlib
import sys
import threading
from types import TracebackType

#: Seconds after which a Ctrl-C that Python could not raise is sent again.
RESEND_INTERRUPT_S = 0.01


def _release_import_lock_left_by(traceback: TracebackType | None) -> None:
    """importlib's module-lock callback takes the global import lock on its first line and
    releases it in a ``finally`` it has not yet entered when Ctrl-C is raised right after
    that line: the lock would stay with this thread, and any other thread's next import
    would wait for it forever. Release it once when the interrupt came from that line."""
    while traceback is not None:
        code = traceback.tb_frame.f_code
        in_callback = code.co_name == "cb" and code.co_filename.endswith("importlib._bootstrap>")
        if in_callback and traceback.tb_lineno == code.co_firstlineno + 1:
            with contextlib.suppress(RuntimeError):  # not held by this thread after all
                _imp.release_lock()
            return
        traceback = traceback.tb_next


def keep_interrupts(unraisable) -> None:
    """``sys.unraisablehook``: a Ctrl-C that arrived where Python cannot raise it (in a
    weakref callback such as importlib's module-lock cleanup, or in a finalizer, which
    print "Exception ignored" and go on) is raised again in the main thread, without a
    traceback; anything else goes to Python's own hook. (A report interrupted during an
    import printed that traceback, ran on and exited 0.) The interrupt is sent again a
    moment later from another thread: sent from here, it would be taken inside this
    hook, where it is lost again."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        _release_import_lock_left_by(unraisable.exc_traceback)
        resend = threading.Timer(RESEND_INTERRUPT_S, _thread.interrupt_main)
        resend.daemon = True
        resend.start()
        return
    sys.__unraisablehook__(unraisable)
