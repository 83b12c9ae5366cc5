"""The ledger: what the engine actually moved, counted as it happens.

It counts weight bytes resident on the compute device (now and at peak), bytes moved onto it,
and seconds spent moving, for every placement and on every device — on a CPU "device" too, where
onloading is a change of residency rather than a copy, so that the same figures can be compared
and predicted everywhere.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Report:
    """A snapshot of a handle's ledger (``handle.report()``)."""

    mode: str
    storage: str | None
    device: str
    #: most weight bytes resident on the compute device at once
    peak_device_bytes: int
    #: weight bytes resident on the compute device now
    resident_device_bytes: int
    #: bytes copied onto the compute device (each onload of a group counts its bytes)
    bytes_transferred: int
    #: seconds spent onloading and offloading
    transfer_seconds: float
    onloads: int
    offloads: int
    #: bytes the storage holds, by place (pageable, pinned, disk)
    storage_bytes: dict[str, int] = field(default_factory=dict)
    #: component -> what the quantizer did there (layers packed, layers left at full precision, bytes)
    quantization: dict[str, dict] = field(default_factory=dict)
    #: component -> calls (forward, encode, decode) since apply or the last ``reset_stats``
    component_calls: dict[str, int] = field(default_factory=dict)
    #: the same calls in the order they happened (``plan(calls=report.call_sequence)`` replays them)
    call_sequence: list[str] = field(default_factory=list)
    #: component -> what was placed differently from the placement's layout, and why (a model declaring
    #: ``_supports_group_offloading = False`` moved whole, a pipeline's ``_exclude_from_cpu_offload`` kept)
    placement_notes: dict[str, str] = field(default_factory=dict)
    #: what ``load`` did on the way (empty after ``apply``): bytes converted and quantized into staging files,
    #: groups and bytes kept in the checkpoint's pages and written to the storage's files
    loading: dict[str, Any] = field(default_factory=dict)
    #: reads of a weight outside the forward that owns it that memmode served from a stand-in (an offloaded
    #: tensor onloaded into the running call or read from its storage, a quantized weight dequantized)
    reads_served: int = 0
    #: bytes those reads produced
    bytes_served: int = 0
    #: the tensors read that way, each with how many times (the first hundred names)
    served: dict[str, int] = field(default_factory=dict)
    #: groups that left the device because another handle, or a later group of this one, needed the room, as they
    #: happened: ``{"bytes", "groups" (None: counted by the handle that gave them), "by" (whose groups), "for" (whom
    #: they made room for), "why"}``; this handle's own, and those others gave back for it (the first hundred)
    evictions: list[dict] = field(default_factory=list)
    #: out-of-memory errors met where a group was onloaded and recovered from: ``{"component", "group", "released"
    #: (bytes released before the second try), "error" (the accelerator's message)}`` (the first hundred)
    recoveries: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        from memmode_core.contracts.units import format_bytes

        return (
            f"{self.mode} ({self.storage or 'no storage'}) on {self.device}: "
            f"peak {format_bytes(self.peak_device_bytes)} on device, "
            f"{format_bytes(self.bytes_transferred)} moved in {self.transfer_seconds:.3f}s "
            f"({self.onloads} onloads)"
            + (f", {self.reads_served} reads served outside their forward" if self.reads_served else "")
            + (f", {len(self.evictions)} evictions" if self.evictions else "")
            + (f", {len(self.recoveries)} out-of-memory errors recovered" if self.recoveries else "")
        )


#: samples a trace keeps at most (a long run onloads millions of groups; a plot needs far fewer)
MAX_TRACE_SAMPLES = 500_000


#: names a ledger remembers the served reads of
MAX_SERVED_NAMES = 100
#: evictions and recoveries a ledger remembers
MAX_EVENTS = 100


class Ledger:
    __slots__ = (
        "resident",
        "peak",
        "transferred",
        "seconds",
        "onloads",
        "offloads",
        "trace",
        "reads_served",
        "bytes_served",
        "served_names",
        "evictions",
        "recoveries",
    )

    def __init__(self) -> None:
        self.resident = 0
        self.peak = 0
        self.transferred = 0
        self.seconds = 0.0
        self.onloads = 0
        self.offloads = 0
        #: (seconds, resident bytes) after each change, while tracing (``Handle.start_trace``)
        self.trace: list[tuple[float, int]] | None = None
        self.reads_served = 0
        self.bytes_served = 0
        self.served_names: dict[str, int] = {}
        self.evictions: list[dict] = []
        self.recoveries: list[dict] = []

    def onloaded(self, nbytes: int, seconds: float) -> None:
        self.resident += nbytes
        if self.resident > self.peak:
            self.peak = self.resident
        self.transferred += nbytes
        self.seconds += seconds
        self.onloads += 1
        if self.trace is not None and len(self.trace) < MAX_TRACE_SAMPLES:
            self.trace.append((clock(), self.resident))

    def offloaded(self, nbytes: int, seconds: float) -> None:
        self.resident -= nbytes
        self.seconds += seconds
        self.offloads += 1
        if self.trace is not None and len(self.trace) < MAX_TRACE_SAMPLES:
            self.trace.append((clock(), self.resident))

    def served(self, nbytes: int, name: str) -> None:
        """A read of ``name`` outside its forward, served from a stand-in (``nbytes`` produced)."""
        self.reads_served += 1
        self.bytes_served += nbytes
        names = self.served_names
        if name in names or len(names) < MAX_SERVED_NAMES:
            names[name] = names.get(name, 0) + 1

    def evicted(self, nbytes: int, groups: int | None, *, by: str, for_whom: str, why: str) -> None:
        """Groups of ``by`` left the device to make room for ``for_whom`` (see ``Report.evictions``); one after the
        other for the same reason, they make one entry."""
        last = self.evictions[-1] if self.evictions else None
        if last is not None and (last["by"], last["for"], last["why"]) == (by, for_whom, why):
            last["bytes"] += nbytes
            last["groups"] = None if groups is None or last["groups"] is None else last["groups"] + groups
        elif len(self.evictions) < MAX_EVENTS:
            self.evictions.append({"bytes": nbytes, "groups": groups, "by": by, "for": for_whom, "why": why})

    def recovered(self, component: str, group: str, released: int, error: str) -> None:
        """An out-of-memory error onloading ``group`` was recovered from by releasing ``released`` bytes."""
        if len(self.recoveries) < MAX_EVENTS:
            self.recoveries.append({"component": component, "group": group, "released": released, "error": error})

    def reset_peak(self) -> None:
        """Start a new measurement: peak restarts from what is resident now, counters from zero."""
        self.peak = self.resident
        self.transferred = 0
        self.seconds = 0.0
        self.onloads = 0
        self.offloads = 0
        self.reads_served = 0
        self.bytes_served = 0
        self.served_names = {}
        self.evictions = []
        self.recoveries = []


clock = time.perf_counter
