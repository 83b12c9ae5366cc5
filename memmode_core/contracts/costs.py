"""What a storage costs: the part of the storage contract the planner and ``auto`` read.

A storage answers ``Storage.cost(device)`` with a :class:`StorageCost`: per byte of offloaded
weights, how many bytes it holds at rest in pageable RAM, page-locked RAM and on disk (a
compressing storage holds fewer), and how fast an onload delivers bytes to ``device`` (``None``:
nothing is copied, the stored copy is what the device computes with) plus a fixed latency per
onload. The planner multiplies these by the bytes and onloads of each layout.

A storage that does not say is **measured**: :func:`probe` opens a session, stores a weight-like
group (random normal bfloat16, which compresses about as real weights do), reads what the session
reports holding (``stats()``), and times fetches of a large and of a tiny group. The result is
cached per storage class and device for the life of the process, so the probe costs a fraction of
a second once.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from memmode_core.contracts.options import resolve_options

if TYPE_CHECKING:  # pragma: no cover
    from memmode_core.contracts.storage import Storage

#: Host-to-device bandwidth (bytes/s) by where copies come from, when it cannot be measured.
DEFAULT_BANDWIDTH = {"pageable": 10e9, "pinned": 25e9, "mapped": 6e9, "disk": 2e9}
#: Seconds of fixed cost per synchronous onload (a copy call, a stream synchronisation).
ONLOAD_LATENCY = {"cuda": 20e-6, "cpu": 1e-6}
#: Bytes of the group :func:`probe` stores and fetches to measure bandwidth.
PROBE_BYTES = 8 << 20


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
    #: whether the figures come from :func:`probe` rather than a declaration
    measured: bool = False

    def fetch_seconds(self, nbytes: int, onloads: int) -> float:
        copy = 0.0 if self.fetch_bytes_per_second is None or not nbytes else nbytes / self.fetch_bytes_per_second
        return copy + onloads * self.fetch_latency


def onload_latency(device: torch.device) -> float:
    return ONLOAD_LATENCY.get(device.type, ONLOAD_LATENCY["cuda"])


@functools.cache
def measured_bandwidth(device_type: str, kind: str) -> float:
    """Host-to-device bytes/s, measured once per process on CUDA for pageable and pinned memory."""
    if device_type != "cuda" or kind not in ("pageable", "pinned") or not torch.cuda.is_available():
        return DEFAULT_BANDWIDTH[kind]
    nbytes = 256 << 20
    host = torch.empty(nbytes, dtype=torch.uint8)
    if kind == "pinned":
        host = host.pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dev.copy_(host, non_blocking=kind == "pinned")
    end.record()
    end.synchronize()
    return nbytes / (start.elapsed_time(end) / 1e3)


def copying_cost(
    kind: str,
    device: torch.device,
    *,
    pageable: float = 0.0,
    pinned: float = 0.0,
    disk: float = 0.0,
    zero_copy_on_cpu: bool = False,
) -> StorageCost:
    """The declared cost of a storage that copies from memory of ``kind`` (the first-party ones)."""
    if device.type == "cpu" and zero_copy_on_cpu:
        bandwidth = None
    else:
        bandwidth = measured_bandwidth(device.type, kind)
    return StorageCost(kind, pageable, pinned, disk, bandwidth, onload_latency(device))


_probed: dict[tuple[type, str], StorageCost] = {}


def probe(storage: Storage, device: torch.device) -> StorageCost:
    """Measure ``storage`` on ``device`` (cached per storage class and device; see the module docstring)."""
    key = (type(storage), str(device))
    if key not in _probed:
        _probed[key] = _probe(storage, device)
    return _probed[key]


def _probe(storage: Storage, device: torch.device) -> StorageCost:
    options = resolve_options([(storage.name, storage.options)], {})[storage.name]
    session = storage.open(device=device, offload_dir=None, options=options)
    generator = torch.Generator().manual_seed(0)
    big = {"probe.weight": torch.randn(PROBE_BYTES // 2, generator=generator).to(torch.bfloat16)}
    small = {"probe.bias": torch.randn(16, generator=generator)}
    try:
        session.reserve({"probe/big": PROBE_BYTES, "probe/small": 64})
        session.put("probe/big", big)
        session.put("probe/small", small)
        held = session.stats()
        zero_copy = session.zero_copy(device)
        latency = _best_time(lambda: session.fetch("probe/small", device), repeat=30, device=device)
        if zero_copy:
            bandwidth = None
        else:
            seconds = _best_time(lambda: session.fetch("probe/big", device), repeat=7, device=device)
            bandwidth = PROBE_BYTES / max(seconds - latency, 1e-9)
    finally:
        session.close()
    stored = PROBE_BYTES + 64
    per_byte = {place: held.get(f"{place}_bytes", 0) / stored for place in ("pageable", "pinned", "disk")}
    if not held:  # a storage that reports nothing is taken to keep plain copies in RAM
        per_byte["pageable"] = 1.0
    return StorageCost(
        "measured",
        per_byte["pageable"],
        per_byte["pinned"],
        per_byte["disk"],
        bandwidth,
        max(latency, onload_latency(device)) if not zero_copy else onload_latency(device),
        measured=True,
    )


def _best_time(run, *, repeat: int, device: torch.device) -> float:
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best
