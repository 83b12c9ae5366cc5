"""``memmode list``: what is installed — placements, quantizers, storages — and why an unavailable one is.

A plugin that cannot load still gets its row, marked ``no (n)``, and note ``n`` under the table says why: a
missing dependency shows where the user looks for the plugin, not as a traceback.
"""

from __future__ import annotations

import argparse
import json

import memmode_core as memmode


def list_command(args: argparse.Namespace) -> int:
    from memmode_core.cli.table import render

    rows = memmode.list_plugins()
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return 0
    print(
        render(
            ["kind", "name", "distribution", "version", "available", "description"],
            [
                (
                    r.kind,
                    r.name,
                    r.distribution,
                    r.version or "-",
                    "yes" if r.available else f"no ({index})",
                    r.description,
                )
                for index, r in _numbered_unavailable(rows)
            ],
        )
    )
    notes = [r for r in rows if not r.available]
    if notes:
        print()
        for index, r in enumerate(notes, start=1):
            print(f"({index}) {r.kind} {r.name}: {r.reason}")
    return 0


def _numbered_unavailable(rows):
    """Each row with the number of its note (unavailable rows are numbered in order)."""
    index = 0
    for row in rows:
        if not row.available:
            index += 1
        yield index, row
