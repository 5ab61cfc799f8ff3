"""Which learners record: the ``--record-ranks`` spec, parsed and shown back.

A spec is ``all`` or comma-separated items, each one of

* ``N``: rank N, e.g. ``0,3``;
* ``A-B``: ranks A to B inclusive, e.g. ``0-7``;
* ``START:STOP:STEP``: a Python slice of ``range(world_size)``, any part may be empty,
  e.g. ``::8`` (every 8th rank: 0, 8, 16, ...) or ``1::4``.

The result is sorted and free of duplicates.
"""

from __future__ import annotations

from collections.abc import Sequence

from gradstat.errors import UsageError

ALL = "all"


def parse_ranks(spec: str | Sequence[int] | None, world_size: int) -> list[int]:
    """The ranks of a run of ``world_size`` learners that ``spec`` names."""
    if spec is None or (isinstance(spec, str) and spec.strip() in ("", ALL)):
        return list(range(world_size))
    if isinstance(spec, str):
        ranks = _parse_spec(spec, world_size)
        label = f"--record-ranks {spec!r}"
    else:
        ranks = [int(r) for r in spec]
        label = f"record_ranks {list(spec)}"
    outside = [r for r in ranks if not 0 <= r < world_size]
    if outside:
        raise UsageError(f"{label}: rank {outside[0]} is not in the run (0..{world_size - 1})")
    if not ranks:
        raise UsageError(f"{label} names no rank of the run (0..{world_size - 1})")
    return sorted(set(ranks))


def _parse_spec(spec: str, world_size: int) -> list[int]:
    ranks: list[int] = []
    try:
        for item in spec.split(","):
            item = item.strip()
            if ":" in item:
                parts = [int(p) if p.strip() else None for p in item.split(":")]
                if len(parts) > 3 or parts[-1] == 0:
                    raise ValueError
                ranks += range(world_size)[slice(*parts)]
            elif "-" in item[1:]:
                first, last = (int(p) for p in item.split("-", 1))
                if last < first:
                    raise ValueError
                ranks += range(first, last + 1)
            else:
                ranks.append(int(item))
    except ValueError:
        raise UsageError(
            f"--record-ranks {spec!r}: expected 'all', ranks '0,3', a range '0-7' "
            "or every N-th '::8'"
        ) from None
    return ranks


def format_ranks(ranks: Sequence[int], limit: int = 6) -> str:
    """Ranks for people: runs of consecutive ranks as ``A-B``, e.g. ``0-3,8,16``."""
    groups: list[list[int]] = []
    for rank in sorted(ranks):
        if groups and rank == groups[-1][1] + 1:
            groups[-1][1] = rank
        else:
            groups.append([rank, rank])
    texts = [str(a) if a == b else f"{a}-{b}" for a, b in groups]
    if len(texts) > limit:
        texts = [*texts[: limit - 1], "...", texts[-1]]
    return ",".join(texts)
