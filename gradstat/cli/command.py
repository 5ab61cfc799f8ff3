"""gradstat's click command and group classes: help that reads cleanly at 80 columns.

Typer's defaults show ``{capture}`` in the usage line and a ``<bool>`` metavar on every
flag; gradstat's usage shows ``CAPTURE`` and flags show none. ``--ratio`` stays a hidden
alias of ``--ratios`` (the option every analysis shares), for older scripts.
"""

from __future__ import annotations

import inspect
import re

from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

#: Hidden spellings of shared options: old name -> current name.
ALIASES = {"--ratio": "--ratios"}


#: Metavars for typer's type labels: ``--seed N`` rather than ``--seed <int>``.
METAVARS = {"<str>": "TEXT", "<int>": "N", "<float>": "X", "<path>": "PATH"}


def _tidy(params: list, ctx) -> list:
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag:
            param.metavar = ""
        elif isinstance(param, TyperOption) and param.metavar is None:
            param.metavar = METAVARS.get(param.display_type(ctx))
        if _is_list_text(param.default) and param.show_default in (None, True):
            # A long comma list has no space to wrap at: help would cut it at 80 columns.
            param.show_default = param.default.replace(",", ", ")
        if type(param) is TyperOption and isinstance(param.show_default, str):
            param.__class__ = TextDefaultOption
        elif isinstance(param, TyperArgument):
            if param.metavar is None:
                param.metavar = param.name.upper()
            if type(param) is TyperArgument:
                param.__class__ = Argument
    return params


class Argument(TyperArgument):
    """An argument whose type reads as an option's does: ``PATH``, or ``PATH...`` for
    several, not typer's ``<Path>`` and ``<list[Path]>``."""

    def display_type_rich(self, ctx) -> str | None:
        label = self.display_type(ctx)
        several = label.startswith("<list[")
        inner = label.removeprefix("<list[").removeprefix("<").rstrip(">]")
        name = METAVARS.get(f"<{inner.lower()}>", inner.upper())
        return name + ("..." if several else "")


class TextDefaultOption(TyperOption):
    """An option whose default is shown as text, e.g. a comma list (``--ratios
    0.01,0.001``): help shows ``[default: 0.01, 0.001]``, without the parentheses typer
    puts around a text default (a list then reads as a Python tuple)."""

    def _get_default_string(self, *, ctx, show_default_is_str, default_value) -> str:
        if show_default_is_str:
            return str(self.show_default)
        return super()._get_default_string(
            ctx=ctx, show_default_is_str=show_default_is_str, default_value=default_value
        )


def _is_list_text(value) -> bool:
    return isinstance(value, str) and "," in value and " " not in value


def _alias(args: list[str], known: set[str]) -> list[str]:
    """``--ratio 0.01`` and ``--ratio=0.01`` read as ``--ratios`` where that exists."""
    out = []
    for arg in args:
        name, eq, value = arg.partition("=")
        target = ALIASES.get(name)
        out.append(target + eq + value if target in known else arg)
    return out


def unwrap(text: str) -> str:
    """A docstring's paragraphs each as one line, so help text re-wraps evenly."""
    paragraphs = inspect.cleandoc(text or "").split("\n\n")
    return "\n\n".join(re.sub(r"\s*\n\s*", " ", p) for p in paragraphs)


class Command(TyperCommand):
    """A gradstat command: ``CAPTURE`` in usage, no ``<bool>`` on flags, ``--ratio``."""

    def get_params(self, ctx):
        return _tidy(super().get_params(ctx), ctx)

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = super().collect_usage_pieces(ctx)
        return [re.sub(r"^\{(.*)\}((?:\.\.\.)?)$", r"\1\2", piece) for piece in pieces]

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        known = {opt for param in self.params for opt in getattr(param, "opts", [])}
        return super().parse_args(ctx, _alias(args, known))


class Group(TyperGroup):
    """The ``gradstat`` group: no ``<bool>`` on its flags either."""

    def get_params(self, ctx):
        return _tidy(super().get_params(ctx), ctx)
