"""The ``gradstat`` command line: one typer app, errors as one ``Error:`` line.

Exit codes: 0 success, 1 bad or unreadable data, 2 bad usage. Set ``GRADSTAT_DEBUG=1``
to see tracebacks.
"""

from __future__ import annotations

import os
import sys
import warnings

import typer
from rich.markup import escape

from gradstat import __version__
from gradstat.cli.capture import capture_command
from gradstat.cli.command import Command, Group, unwrap
from gradstat.cli.compare import compare_command
from gradstat.cli.fit import fit_command
from gradstat.cli.info import info_command
from gradstat.cli.interrupts import keep_interrupts
from gradstat.cli.merge import merge_command
from gradstat.cli.output import err_console, warn
from gradstat.cli.replay import recommend_command, replay_command
from gradstat.cli.report import report_command
from gradstat.cli.similarity import buildup_command, overlap_command, similarity_command
from gradstat.errors import GradstatError
from gradstat.parallel.allocator import tune_allocators
from gradstat.parallel.distributed import run_command

app = typer.Typer(
    name="gradstat",
    help=(
        "Record each learner's local gradient during real data-parallel training, then "
        "analyse it for gradient compression: distribution fits and threshold estimators "
        "(SIDCo), cross-learner top-k similarity and build-up (ScaleCom), compressor "
        "replay with error feedback, and recommendations."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    cls=Group,
)

# in the order of the work: record, inspect, analyse, replay, decide, report
COMMANDS = {
    "capture": capture_command,
    "info": info_command,
    "merge": merge_command,
    "fit": fit_command,
    "similarity": similarity_command,
    "buildup": buildup_command,
    "overlap": overlap_command,
    "replay": replay_command,
    "recommend": recommend_command,
    "compare": compare_command,
    "report": report_command,
}
for _name, _function in COMMANDS.items():
    _help = unwrap(_function.__doc__)
    app.command(_name, cls=Command, help=_help, short_help=_help.split("\n\n")[0])(_function)


#: Exit code of Ctrl-C (128 + SIGINT), what typer returns when a command is interrupted.
INTERRUPTED = 130


def _version(value: bool) -> None:
    if value:
        print(f"gradstat {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """gradstat: gradient statistics for gradient-compression design."""


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    warn(str(message))


def _error(message: str, code: int) -> None:
    """One ``Error:`` line; the message is plain text (paths, arguments, library errors
    may contain ``[...]``), never markup."""
    err_console.print(
        f"[bold red]Error:[/bold red] {escape(message)}", highlight=False, soft_wrap=True
    )
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``gradstat`` console script."""
    debug = os.environ.get("GRADSTAT_DEBUG") == "1"
    warnings.showwarning = _show_warning
    sys.unraisablehook = keep_interrupts
    tune_allocators()
    try:
        # under torchrun: rank 0 runs the command, the others compute its units
        result = run_command(lambda: app(args=argv, prog_name="gradstat", standalone_mode=False))
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        _error("interrupted", INTERRUPTED)
    except typer.TyperException as exc:
        _error(exc.format_message(), exc.exit_code)
    except GradstatError as exc:
        if debug:
            raise
        _error(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        _error("interrupted", INTERRUPTED)
    except Exception as exc:  # the last line of defence: never a traceback for users
        if debug:
            raise
        _error(f"unexpected {type(exc).__name__}: {exc} (GRADSTAT_DEBUG=1 shows the traceback)", 1)
    if result == INTERRUPTED:  # typer turns Ctrl-C into a returned 130, without a word
        _error("interrupted", INTERRUPTED)
    sys.exit(result if isinstance(result, int) else 0)
