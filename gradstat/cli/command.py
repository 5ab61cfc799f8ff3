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
        elif isinstance(param, TyperArgument) and param.metavar is None:
            param.metavar = param.name.upper()
    return params


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
        return [re.sub(r"^\{(.*)\}$", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        known = {opt for param in self.params for opt in getattr(param, "opts", [])}
        return super().parse_args(ctx, _alias(args, known))


class Group(TyperGroup):
    """The ``gradstat`` group: no ``<bool>`` on its flags either."""

    def get_params(self, ctx):
        return _tidy(super().get_params(ctx), ctx)
