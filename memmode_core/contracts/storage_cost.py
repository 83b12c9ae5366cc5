"""What a storage costs: the part of the storage contract the planner and ``auto`` read.

A storage answers ``Storage.cost(device)`` with a :class:`StorageCost`: per byte of offloaded
weights, how many bytes it holds at rest in pageable RAM, page-locked RAM and on disk (a
compressing storage holds fewer), and how fast an onload delivers bytes to ``device`` (``None``:
nothing is copied, the stored copy is what the device computes with) plus a fixed latency per
onload. The planner multiplies these by the bytes and onloads of each layout.

A storage may declare its cost, or answer None and be **measured** by the planner
(:mod:`memmode_core.planning.measuring`), which also prices a declared copy from host memory to an
accelerator at the bandwidth it measures there. This module only holds the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Host-to-device bandwidth (bytes/s) by where copies come from, when it is not measured.
DEFAULT_BANDWIDTH = {"pageable": 10e9, "pinned": 25e9, "mapped": 6e9, "disk": 2e9}
#: Seconds of fixed cost per synchronous onload (a copy call, a stream synchronisation).
ONLOAD_LATENCY = {"cuda": 20e-6, "cpu": 1e-6}


@dataclass(frozen=True)
class StorageCost:
    """See the module docstring. Per-byte figures multiply the offloaded bytes of a layout."""

    #: a word for tables: where the bytes wait ("pageable", "pinned", "disk", "mapped", "compressed"...)
    kind: str
    pageable_per_byte: float = 1.0
    pinned_per_byte: float = 0.0
    disk_per_byte: float = 0.0
    #: bytes/s an onload delivers to the device; None when nothing is copied (zero copy)
    fetch_bytes_per_second: float | None = None
    #: seconds per onload on top of the bytes
    fetch_latency: float = 0.0
    #: whether the figures were measured (by the planner's probe) rather than declared
    measured: bool = False
    #: whether the ranks of ``torch.distributed`` on one machine hold one copy of what this storage keeps at rest
    #: between them (files every rank writes once and maps or reads), rather than one each
    shared_by_ranks: bool = False

    def fetch_seconds(self, nbytes: int, onloads: int) -> float:
        copy = 0.0 if self.fetch_bytes_per_second is None or not nbytes else nbytes / self.fetch_bytes_per_second
        return copy + onloads * self.fetch_latency


def onload_latency(device: torch.device) -> float:
    return ONLOAD_LATENCY.get(device.type, ONLOAD_LATENCY["cuda"])


def copying_cost(
    kind: str,
    device: torch.device,
    *,
    pageable: float = 0.0,
    pinned: float = 0.0,
    disk: float = 0.0,
    zero_copy_on_cpu: bool = False,
    shared_by_ranks: bool = False,
) -> StorageCost:
    """The declared cost of a storage that copies from memory of ``kind`` (the first-party ones), at the
    default bandwidth of ``kind``; the planner prices copies from host memory to an accelerator at the
    bandwidth it measures there."""
    bandwidth = None if device.type == "cpu" and zero_copy_on_cpu else DEFAULT_BANDWIDTH[kind]
    return StorageCost(kind, pageable, pinned, disk, bandwidth, onload_latency(device), shared_by_ranks=shared_by_ranks)
