"""The ``gradstat`` command line: one typer app, errors as one ``Error:`` line.

Exit codes: 0 success, 1 bad or unreadable data, 2 bad usage. Set ``GRADSTAT_DEBUG=1``
to see tracebacks.
"""

from __future__ import annotations

import ast
import os
import select
import sys
import warnings
from importlib import import_module
from importlib.util import find_spec

import typer
from rich.markup import escape
from typer.core import TyperCommand

from gradstat import __version__, cancel
from gradstat.cli.command import Command, Group, unwrap
from gradstat.cli.output import err_console, warn
from gradstat.errors import GradstatError, Interrupted
from gradstat.untrusted import printable

# in the order of the work: record, inspect, analyse, replay, decide, report
COMMANDS = {
    "capture": "gradstat.cli.capture:capture_command",
    "info": "gradstat.cli.info:info_command",
    "merge": "gradstat.cli.merge:merge_command",
    "fit": "gradstat.cli.fit:fit_command",
    "similarity": "gradstat.cli.similarity:similarity_command",
    "buildup": "gradstat.cli.similarity:buildup_command",
    "overlap": "gradstat.cli.similarity:overlap_command",
    "noise": "gradstat.cli.noise:noise_command",
    "consistency": "gradstat.cli.consistency:consistency_command",
    "replay": "gradstat.cli.replay:replay_command",
    "recommend": "gradstat.cli.replay:recommend_command",
    "compare": "gradstat.cli.compare:compare_command",
    "report": "gradstat.cli.report:report_command",
}


def command_docstring(target: str) -> str:
    """The docstring of ``module:function``, read from the module's source without
    importing it (so ``gradstat --help`` lists every command without loading torch)."""
    module, function = target.split(":")
    spec = find_spec(module)
    tree = ast.parse(spec.loader.get_source(module))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return unwrap(ast.get_docstring(node) or "")
    raise LookupError(f"{target}: no such function")  # a bad COMMANDS entry


def load_command(name: str) -> TyperCommand:
    """The command ``name``: its module imported now, with what it computes with."""
    module, function = COMMANDS[name].split(":")
    callback = getattr(import_module(module), function)
    sub = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    help_ = unwrap(callback.__doc__)
    sub.command(name, cls=Command, help=help_, short_help=help_.split("\n\n")[0])(callback)
    return typer.main.get_command(sub)


class Commands(Group):
    """The ``gradstat`` group: a command is listed from its docstring, and loaded (its
    module and the libraries that module needs) only when it runs or shows its help."""

    def list_commands(self, ctx) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx, cmd_name: str) -> TyperCommand | None:
        if cmd_name in COMMANDS and cmd_name not in self.commands:
            help_ = command_docstring(COMMANDS[cmd_name])  # a summary for the list in --help
            self.commands[cmd_name] = TyperCommand(
                cmd_name, help=help_, short_help=help_.split("\n\n")[0]
            )
        return self.commands.get(cmd_name)

    def resolve_command(self, ctx, args):
        name = args[0] if args else None
        if name in COMMANDS and not isinstance(self.commands.get(name), Command):
            self.commands[name] = load_command(name)
        elif name not in COMMANDS:  # a typo: "Did you mean" needs every name
            for known in COMMANDS:
                self.get_command(ctx, known)
        return super().resolve_command(ctx, args)


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
    cls=Commands,
)


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
    may contain ``[...]``), never markup, and shows no control character."""
    err_console.print(
        f"[bold red]Error:[/bold red] {escape(printable(message))}",
        highlight=False,
        soft_wrap=True,
    )
    sys.exit(code)


#: What a value of each type typer checks must look like, for people.
EXPECTED = {
    "int_parsing": "expected a whole number",
    "int_from_float": "expected a whole number",
    "float_parsing": "expected a number",
    "bool_parsing": "expected true or false",
}


def _bad_value(exc: typer.TyperException) -> str | None:
    """A bad option value in gradstat's words, not the validation library's (typer checks
    values with pydantic: ``Input should be a valid integer, unable to parse ...``,
    ``Value error, ...``): ``--seed abc: expected a whole number``, or the message of
    gradstat's own parser, which names the option. None: not a checked value."""
    errors = getattr(exc.__cause__, "errors", None)
    param = getattr(exc, "param", None)
    if not callable(errors) or param is None or not getattr(param, "opts", None):
        return None
    error = errors()[0]
    option, value = param.opts[0], error.get("input")
    if error["type"] == "value_error" and "error" in error.get("ctx", {}):
        text = str(error["ctx"]["error"])
        return text if text.startswith(option) else f"{option} {value}: {text}"
    if error["type"] == "enum":
        return f"{option} {value}: use {error['ctx']['expected']}"
    reason = EXPECTED.get(error["type"], error["msg"])
    return f"{option} {value}: {reason}"


def _stopped(message: str | None = None) -> None:
    """The one line of a command stopped by a signal, with the signal's exit code."""
    _error(message or cancel.stopped_text(), cancel.exit_code())


def _run(command):
    """``command()``, or under torchrun on rank 0 with the other ranks computing its units
    (torch.distributed loads only then, or when a script already started a group)."""
    from gradstat.threads import launched_by_torchrun

    if launched_by_torchrun() or "torch.distributed" in sys.modules:
        from gradstat.parallel import follow
        from gradstat.parallel.distributed import run_command

        return run_command(command, follow)
    return command()


def _device(file) -> tuple[int, int] | None:
    """Which file ``file`` (a path or an open file) is, or None."""
    try:
        info = os.stat(file) if isinstance(file, str) else os.fstat(file.fileno())
    except (OSError, ValueError, AttributeError):
        return None
    return info.st_dev, info.st_ino


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (``| head``), so a BrokenPipeError
    came from our output and not from a pipe inside the work."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no fd, or no poll on this platform
        return False


def unraisable_hook(unraisable) -> None:
    """A Ctrl-C that Python could not raise (it came in a weakref callback or a
    finalizer) is left to :func:`cancel.check` at the end of the command: the flag is
    set. Anything else goes to Python's own hook."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``gradstat`` console script (``argv``: a run in-process, which
    leaves the signal handlers as it found them)."""
    if argv is None:  # this process ends with the command (gradstat/cancel.py)
        cancel.leave_after_atexit()
    previous = cancel.install()
    try:
        _main(argv)
    except SystemExit as exit_:
        if argv is None:
            code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
            cancel.finishing(code, said=code != 0)
        raise
    finally:
        if argv is not None:
            cancel.restore(previous)


def _main(argv: list[str] | None) -> None:
    debug = os.environ.get("GRADSTAT_DEBUG") == "1"
    warnings.showwarning = _show_warning
    sys.unraisablehook = unraisable_hook
    stdout = _device(sys.stdout)
    try:
        # under torchrun: rank 0 runs the command, the others compute its units
        result = _run(lambda: app(args=argv, prog_name="gradstat", standalone_mode=False))
        cancel.check()  # a signal that came where nothing raised it (a callback)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except SystemExit as exc:
        # rich and click exit 1 when the reader of stdout has gone (`gradstat info CAP |
        # head -3`; rich points stdout at the null device first): that is no bad data
        moved = stdout != _device(sys.stdout) == _device(os.devnull)
        if exc.code == 1 and (moved or _stdout_closed()):
            sys.exit(0)
        raise
    except (typer.Abort, KeyboardInterrupt):
        _stopped()
    except typer.TyperException as exc:
        message = _bad_value(exc) or exc.format_message()
        if not message:  # no arguments: the help is shown, with exit code 2 and no Error
            sys.exit(exc.exit_code)
        _error(message, exc.exit_code)
    except Interrupted as exc:
        _stopped(str(exc))
    except GradstatError as exc:
        if debug:
            raise
        if cancel.requested():  # the stop came first; what failed after it is moot
            _stopped()
        _error(str(exc), exc.exit_code)
    except BrokenPipeError as exc:
        if not _stdout_closed():
            _error(f"unexpected BrokenPipeError: {exc}", 1)
        # `gradstat info CAP | head -3`: the reader has what it wanted; no more output
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except Exception as exc:  # the last line of defence: never a traceback for users
        if debug:
            raise
        _error(f"unexpected {type(exc).__name__}: {exc} (GRADSTAT_DEBUG=1 shows the traceback)", 1)
    if result == INTERRUPTED:  # typer turns Ctrl-C into a returned 130, without a word
        _stopped()
    sys.exit(result if isinstance(result, int) else 0)
