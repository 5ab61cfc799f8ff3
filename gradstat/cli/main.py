"""The ``gradstat`` command line: one typer app, errors as one ``Error:`` line.

Exit codes: 0 success, 1 bad or unreadable data, 2 bad usage. Set ``GRADSTAT_DEBUG=1``
to see tracebacks.
"""

from __future__ import annotations

import ast
import os
import sys
import warnings
from importlib import import_module
from importlib.util import find_spec

import click
import typer
from rich.markup import escape

from gradstat import __version__, cancel
from gradstat.cli.command import Command, Group, unwrap
from gradstat.cli.output import err_console, warn
from gradstat.errors import GradstatError

# in the order of the work: record, inspect, analyse, replay, decide, report
COMMANDS = {
    "capture": "gradstat.cli.capture:capture_command",
    "info": "gradstat.cli.info:info_command",
    "merge": "gradstat.cli.merge:merge_command",
    "fit": "gradstat.cli.fit:fit_command",
    "similarity": "gradstat.cli.similarity:similarity_command",
    "buildup": "gradstat.cli.similarity:buildup_command",
    "overlap": "gradstat.cli.similarity:overlap_command",
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


def load_command(name: str) -> click.Command:
    """The click command ``name``: its module imported now, with what it computes with."""
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

    def get_command(self, ctx, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS and cmd_name not in self.commands:
            help_ = command_docstring(COMMANDS[cmd_name])  # a summary for the list in --help
            self.commands[cmd_name] = click.Command(
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
    may contain ``[...]``), never markup."""
    err_console.print(
        f"[bold red]Error:[/bold red] {escape(message)}", highlight=False, soft_wrap=True
    )
    sys.exit(code)


def _run(command):
    """``command()``, or under torchrun on rank 0 with the other ranks computing its units
    (torch.distributed loads only then, or when a script already started a group)."""
    from gradstat.threads import launched_by_torchrun

    if launched_by_torchrun() or "torch.distributed" in sys.modules:
        from gradstat.parallel import follow
        from gradstat.parallel.distributed import run_command

        return run_command(command, follow)
    return command()


def unraisable_hook(unraisable) -> None:
    """A Ctrl-C that Python could not raise (it came in a weakref callback or a
    finalizer) is left to :func:`cancel.check` at the end of the command: the flag is
    set. Anything else goes to Python's own hook."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``gradstat`` console script."""
    debug = os.environ.get("GRADSTAT_DEBUG") == "1"
    warnings.showwarning = _show_warning
    sys.unraisablehook = unraisable_hook
    cancel.install()
    try:
        # under torchrun: rank 0 runs the command, the others compute its units
        result = _run(lambda: app(args=argv, prog_name="gradstat", standalone_mode=False))
        cancel.check()  # a Ctrl-C that came where nothing raised it (a callback)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        _error("interrupted", INTERRUPTED)
    except typer.TyperException as exc:
        message = exc.format_message()
        if not message:  # no arguments: the help is shown, with exit code 2 and no Error
            sys.exit(exc.exit_code)
        _error(message, exc.exit_code)
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
