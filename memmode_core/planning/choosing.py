"""Which priced candidates fit the budgets, and which one ``auto`` takes: the fastest that fits.

Ties go to the least on the device, then to storages that write nothing (the tie order of the first-party
table), then to the least host memory. The device budget is one rank's (one GPU); the RAM budget is the
machine's, for all its ranks (:attr:`PlanEntry.machine_host_bytes`). When nothing fits, the refusal says what
the smallest candidate needs, so that the user knows how far the budget is.
"""

from __future__ import annotations

from memmode_core.contracts.errors import IncompatibleModeError
from memmode_core.contracts.units import format_bytes
from memmode_core.discovery.first_party import STORAGE_TIE_ORDER
from memmode_core.planning.pricing import PlanEntry


class NoModeFitsError(IncompatibleModeError):
    """No placement × storage fits the budgets; the message says what the smallest one needs."""


def judge(entries: list[PlanEntry], vram: int | None, ram: int | None) -> None:
    """Mark what fits the budgets, and the entry ``auto`` chooses (see the module docstring)."""
    for e in entries:
        reasons = []
        if vram is not None and e.device_bytes > vram:
            reasons.append(f"needs {format_bytes(e.device_bytes)} on the device")
        if ram is not None and e.machine_host_bytes > ram:
            reasons.append(f"needs {format_bytes(e.machine_host_bytes)} of RAM{_for_ranks(e)}")
        e.fits, e.reason = not reasons, "; ".join(reasons) or None
    fitting = [e for e in entries if e.fits]
    if fitting:
        best = min(
            fitting,
            key=lambda e: (e.seconds_per_call, e.peak_device_bytes, _tie_rank(e.storage), e.machine_host_bytes),
        )
        best.chosen = True


def choose(entries: list[PlanEntry], vram: int | None, ram: int | None) -> PlanEntry:
    """The entry ``auto`` picks, or :class:`NoModeFitsError` saying what the smallest one needs."""
    for e in entries:
        if e.chosen:
            return e
    if not entries:
        raise NoModeFitsError("no installed placement can place this target")
    smallest = min(entries, key=lambda e: (e.device_bytes, e.machine_host_bytes))
    budget = ", ".join(
        f"{n}={format_bytes(v)}" for n, v in (("vram_budget", vram), ("ram_budget", ram)) if v is not None
    )
    on_device = format_bytes(smallest.device_bytes)
    if smallest.activation_bytes:
        on_device += (
            f" ({format_bytes(smallest.peak_device_bytes)} of weights, {format_bytes(smallest.activation_bytes)} "
            "of activations at the call's shapes)"
        )
    raise NoModeFitsError(
        f"no mode fits {budget}: the smallest, {smallest.label()} with storage {smallest.storage}, needs "
        f"{on_device} on the device and {format_bytes(smallest.machine_host_bytes)} of RAM{_for_ranks(smallest)}"
        + (f" ({format_bytes(smallest.machine_disk_bytes)} on disk)" if smallest.machine_disk_bytes else "")
    )


def _for_ranks(entry: PlanEntry) -> str:
    return f" for the machine's {entry.ranks} ranks" if entry.ranks > 1 else ""


def _tie_rank(storage: str | None) -> int:
    if storage is None:
        return -1
    return STORAGE_TIE_ORDER.index(storage) if storage in STORAGE_TIE_ORDER else len(STORAGE_TIE_ORDER)
