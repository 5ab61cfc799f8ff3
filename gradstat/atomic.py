"""Files that appear whole or not at all: every file a command writes for the user.

A disk that fills (or turns read-only) halfway through a write must not leave a
truncated CSV, figure, report or ``capture.h5`` behind, nor damage the file being
replaced: a half-written ``capture.h5`` hides every committed row of a capture.
:func:`replacing` hands out a file without a name in the target's folder
(``tempfile.TemporaryFile``: ``O_TMPFILE``, so no death, SIGKILL included, leaves it
behind); only once it is written and synced is it linked into the folder and renamed
over the target (``rename`` is atomic on POSIX file systems). Where a file system has no
``O_TMPFILE`` (NFS) the data is copied into a named temporary file first. A failure is a
:class:`~gradstat.errors.DataError` naming the file, the reason and the space left in
its folder (exit 1); the old file, if any, stays as it was.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from gradstat.errors import DataError
from gradstat.sizes import format_bytes

#: Errors of a full or read-only disk (and of a quota or a file-size limit).
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def free_text(folder: Path) -> str:
    """``1.2 MB free`` in ``folder`` (or where it would be)."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return f"{format_bytes(shutil.disk_usage(folder).free)} free"
    except OSError:
        return "free space unknown"


def write_error(path: Path, exc: OSError, what: str = "", written: int = 0) -> DataError:
    """The one-line error of a failed write of ``path`` (``what``: e.g. ``--csv``;
    ``written``: bytes written before it failed)."""
    reason = exc.strerror or str(exc)
    if written:
        reason += f" after {format_bytes(written)}"
    label = f"{what} {path}" if what else str(path)
    return DataError(
        f"{label}: cannot write ({reason}; {free_text(Path(path).parent)} in {Path(path).parent})"
    )


@contextlib.contextmanager
def replacing(path: str | os.PathLike, what: str = "") -> Iterator[IO[bytes]]:
    """A nameless binary file in ``path``'s folder that becomes ``path`` when the block
    ends without an error (see the module docstring); ``what`` names the option in the
    error (``--csv``)."""
    path = Path(path)
    try:
        handle = tempfile.TemporaryFile(dir=path.parent)  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise write_error(path, exc, what) from None
    try:
        yield handle
        handle.flush()
        os.fsync(handle.fileno())
        _publish(handle, path)
    except OSError as exc:  # the free space while the nameless file still holds its part
        raise write_error(path, exc, what, _size(handle)) from None
    finally:
        with contextlib.suppress(OSError):  # a failed write's buffer cannot be flushed
            handle.close()


def _size(handle: IO[bytes]) -> int:
    try:
        return os.fstat(handle.fileno()).st_size
    except OSError:
        return 0


def _publish(handle: IO[bytes], path: Path) -> None:
    """Give the nameless file ``handle`` the name ``path`` (replacing any old file),
    with the permissions a new file gets here (``TemporaryFile`` makes it 0600)."""
    os.fchmod(handle.fileno(), 0o666 & ~_umask())
    staged = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        try:
            os.link(f"/proc/self/fd/{handle.fileno()}", staged, follow_symlinks=True)
        except OSError:  # no O_TMPFILE here (the file was unlinked instead), or no /proc
            handle.seek(0)
            with open(staged, "xb") as copy:
                shutil.copyfileobj(handle, copy)
                copy.flush()
                os.fsync(copy.fileno())
        os.replace(staged, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise


def _umask() -> int:
    """This process's umask (read from /proc, else set and put back)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
