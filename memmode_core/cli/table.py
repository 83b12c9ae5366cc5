"""Aligned plain-text tables for the CLI."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def render(headers: Sequence[str], rows: Iterable[Sequence[object]], *, right: Sequence[str] = ()) -> str:
    cells = [[("" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if h in right else v.ljust(w) for v, w, h in zip(values, widths, headers)]
        return "  ".join(parts).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)
