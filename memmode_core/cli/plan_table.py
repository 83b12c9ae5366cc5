"""The table ``memmode plan`` prints: one row per candidate, those that fit first, then the fastest.

The ``+ activations`` column appears only when the planner predicted activations (the call's shapes were
given): without them it counts weights only, and a column of zeros would read as a prediction. ``RAM`` and
``disk`` are the machine's: for ``--world-size`` ranks, what they share once and the rest once per rank (for one
rank, its own).
"""

from __future__ import annotations

from collections.abc import Iterable

from memmode_core.cli.table import render
from memmode_core.contracts.units import format_bytes

#: the columns that hold numbers, right-aligned
_NUMBERS = ["weights on device", "+ activations", "moved/call", "RAM", "disk", "copy s/call"]


def render_plan(entries: Iterable, shaped: bool) -> str:
    """The entries of ``memmode_core.plan`` as a table; ``shaped``: with the ``+ activations`` column."""
    rows = [
        _plan_row(e, shaped)
        for e in sorted(entries, key=lambda e: (not e.fits, e.seconds_per_call, e.peak_device_bytes))
    ]
    headers = [
        "",
        "mode",
        "options",
        "storage",
        "weights on device",
        *(["+ activations"] if shaped else []),
        "moved/call",
        "RAM",
        "disk",
        "copy s/call",
        "fits",
    ]
    return render(headers, rows, right=_NUMBERS)


def _plan_row(e, shaped: bool) -> tuple:
    options = ", ".join(f"{k}={v}" for k, v in e.options.items())
    return (
        "*" if e.chosen else "",
        e.mode,
        options or "-",
        e.storage or "-",
        format_bytes(e.peak_device_bytes),
        *([format_bytes(e.device_bytes)] if shaped else []),
        format_bytes(e.transfer_bytes_per_call),
        format_bytes(e.machine_host_bytes),
        format_bytes(e.machine_disk_bytes) if e.machine_disk_bytes else "-",
        f"{e.seconds_per_call:.3f}",
        "yes" if e.fits else f"no: {e.reason}",
    )
