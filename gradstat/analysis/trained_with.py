"""Which compressor replays a run trained with one: never code that a capture names.

A capture records the compressor it trained with (root attribute ``compressor``,
docs/format.md). A capture is data that anyone may have written, so gradstat takes
from it only what runs no code: a built-in compressor of the registry, with its
parameters (``topk``, ``powersgd:rank=2``). A user's class (``MODULE:CLASS``,
``FILE.py:CLASS``, an entry point) would be imported from where the capture says; for
such a run the user names the compressor on the command line, ``--trained-with
RUN=SPEC`` (``compare``, ``report``), which may also override a built-in's recorded
spec. Nothing here imports the spec: it only says which text to parse.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from gradstat.compressors.registry import REGISTRY
from gradstat.errors import UsageError

OPTION = "--trained-with"


def _key(path: str | os.PathLike) -> str:
    return str(Path(path).resolve())


def parse_trained_with(items: Sequence[str] | None) -> dict[str, str]:
    """``RUN=SPEC`` items (split at the first ``=``) as ``{resolved RUN: SPEC}``."""
    given: dict[str, str] = {}
    for item in items or ():
        run, eq, spec = item.partition("=")
        if not eq or not run.strip() or not spec.strip():
            raise UsageError(
                f"{OPTION} {item!r}: expected RUN=SPEC, e.g. {OPTION} captures/lm-mine=mine.py:TopK"
            )
        if _key(run) in given:
            raise UsageError(f"{OPTION}: {run} is named twice")
        given[_key(run)] = spec.strip()
    return given


def is_builtin(spec: str) -> bool:
    """Whether ``spec`` names a registry compressor (the head before any ``:`` or
    ``+MEMORY``: ``topk+residual`` is one)."""
    return spec.split(":", 1)[0].split("+", 1)[0] in REGISTRY


def replay_spec(
    run: str | os.PathLike, recorded: str | None, given: Mapping[str, str]
) -> str | None:
    """The spec that replays ``run``, trained with the compressor ``recorded`` (None: a
    dense run, nothing to replay): the one ``given`` for it on the command line, else
    ``recorded`` when it is a built-in; a ``UsageError`` asking for ``--trained-with``
    when it names anything else, or when one is given for a dense run."""
    if recorded is None:
        if _key(run) in given:
            raise UsageError(f"{OPTION} {run}: that run trained without a compressor")
        return None
    if _key(run) in given:
        return given[_key(run)]
    if is_builtin(recorded):
        return recorded
    raise UsageError(
        f"{run} was trained with your own compressor {recorded!r}; gradstat does not "
        f"import code that a capture names: name it, {OPTION} {run}=SPEC"
    )


def check_all_used(given: Mapping[str, str], runs: Sequence[str | os.PathLike]) -> None:
    """A ``UsageError`` for a ``--trained-with`` run that is not among ``runs``."""
    known = {_key(run) for run in runs}
    for run in given:
        if run not in known:
            raise UsageError(f"{OPTION} {run}: not one of the runs compared")


def check_runs(runs: Sequence[str | os.PathLike], given: Mapping[str, str]) -> None:
    """Before any work: each of ``runs`` opens, and each trained with a compressor has
    one to replay it with (:func:`replay_spec`); ``given`` names only those runs."""
    from gradstat.store import open_capture

    check_all_used(given, runs)
    for run in runs:
        with open_capture(run, allow_damaged=True) as cap:
            recorded = cap.compressor
        replay_spec(run, None if recorded is None else recorded["name"], given)
