"""Exceptions that the command line turns into one ``Error:`` line.

``UsageError`` means the user asked for something impossible (exit code 2);
``DataError`` means a capture or input file cannot be read or makes no sense (exit 1);
``UserCodeError`` means a user's own compressor failed inside its code (exit 1).
Library code raises these instead of printing, so notebooks get ordinary exceptions.
"""


class GradstatError(Exception):
    """Base class of every error gradstat reports to the user."""

    exit_code = 1


class UsageError(GradstatError, ValueError):
    """A bad option or argument: out of range, unknown name, wrong format."""

    exit_code = 2


class DataError(GradstatError):
    """A capture or data file that is missing, unreadable, of another schema or damaged."""

    exit_code = 1


class UserCodeError(GradstatError):
    """A user's own compressor failed inside its code (the message names the spec, the
    method and the user's file and line)."""

    exit_code = 1


class DamagedData(DataError):
    """Data that fails its checksum or structure check: a file damaged on disk."""


class Interrupted(GradstatError):
    """Ctrl-C, SIGTERM or SIGHUP: the message says what was kept (the command line exits
    with the signal's code, 128 + N: 130 for SIGINT; gradstat/cancel.py)."""

    exit_code = 130


class GradstatWarning(UserWarning):
    """Something the user should know that does not stop the analysis (gaps, NaNs)."""
