"""What a storage costs, as the planner prices it: declared, refined by measurement, or measured.

A storage declares its :class:`~memmode_core.contracts.storage_cost.StorageCost` or answers None
(:meth:`Storage.cost`). :func:`storage_cost` is the figure the planner uses:

- a declared copy from host memory (pageable or page-locked) to an accelerator with streams at the
  default bandwidth is priced at the bandwidth measured there once per process (:func:`measured_bandwidth`);
- a storage that declares nothing, or whose ``cost`` fails, is **measured** (:func:`probe`): a
  session stores a weight-like group (random normal bfloat16, which compresses about as real
  weights do), reports what it holds (``stats()``), and fetches of a large and of a tiny group are
  timed. The result is cached per storage class and device, so the probe costs a fraction of a
  second once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import torch

from memmode_core.contracts.options import resolve_options
from memmode_core.contracts.storage import Storage
from memmode_core.contracts.storage_cost import DEFAULT_BANDWIDTH, StorageCost, onload_latency
from memmode_core.engine.streams import Streams, active

#: Bytes of the group :func:`probe` stores and fetches to measure bandwidth.
PROBE_BYTES = 8 << 20
#: where a declared copy's bandwidth is measured instead of taken from the defaults
_MEASURED_KINDS = ("pageable", "pinned")


def storage_cost(storage: Storage, device: torch.device) -> StorageCost:
    """The storage's cost on ``device`` for the planner (see the module docstring)."""
    try:
        cost = storage.cost(device)
    except Exception:  # noqa: BLE001 - a plugin's cost() must not break planning
        cost = None
    if not isinstance(cost, StorageCost):
        return probe(storage, device)
    streams = active()
    if (
        not cost.measured
        and streams.has_streams(device)
        and cost.kind in _MEASURED_KINDS
        and cost.fetch_bytes_per_second == DEFAULT_BANDWIDTH[cost.kind]
    ):
        return dataclasses.replace(cost, fetch_bytes_per_second=measured_bandwidth(streams, device, cost.kind))
    return cost


#: the most a bandwidth measurement copies, and the least worth measuring (below it: the declared default)
BANDWIDTH_PROBE_BYTES = 256 << 20
MIN_BANDWIDTH_PROBE_BYTES = 16 << 20


@functools.cache
def measured_bandwidth(streams: Streams, device: torch.device, kind: str) -> float:
    """Host-to-device bytes/s, measured once per process (and backend) for pageable and page-locked memory.

    The copy is sized to what is free on the device (a quarter of it, at most 256 MiB): a device shared with
    other models or applications is never pushed out of memory by a measurement. With less than 64 MiB free the
    declared default is taken."""
    if kind not in _MEASURED_KINDS or not streams.has_streams(device):
        return DEFAULT_BANDWIDTH[kind]
    nbytes = min(BANDWIDTH_PROBE_BYTES, streams.free_memory(device) // 4)
    if nbytes < MIN_BANDWIDTH_PROBE_BYTES:
        return DEFAULT_BANDWIDTH[kind]
    host = streams.pinned_empty(nbytes) if kind == "pinned" else torch.empty(nbytes, dtype=torch.uint8)
    dev = streams.empty((nbytes,), torch.uint8, device)
    streams.copy_(dev, host)
    start = streams.new_event(device, timing=True)
    end = streams.new_event(device, timing=True)
    streams.record(start)
    streams.copy_(dev, host, non_blocking=kind == "pinned")
    streams.record(end)
    streams.wait_host(end)
    return nbytes / max(streams.elapsed(start, end), 1e-9)


_probed: dict[tuple[type, str], StorageCost] = {}


def probe(storage: Storage, device: torch.device) -> StorageCost:
    """Measure ``storage`` on ``device`` (cached per storage class and device; see the module docstring)."""
    key = (type(storage), str(device))
    if key not in _probed:
        _probed[key] = _probe(storage, device)
    return _probed[key]


def _probe(storage: Storage, device: torch.device) -> StorageCost:
    (options,) = resolve_options([(f"storage {storage.name}", storage.options)], {})
    session = storage.open(device=device, offload_dir=None, options=options)
    generator = torch.Generator().manual_seed(0)
    big = {"probe.weight": torch.randn(PROBE_BYTES // 2, generator=generator).to(torch.bfloat16)}
    small = {"probe.bias": torch.randn(16, generator=generator)}
    try:
        session.reserve({"probe/big": PROBE_BYTES, "probe/small": 64})
        session.put("probe/big", big)
        session.put("probe/small", small)
        session.flush()
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
    streams = active()
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        if streams.has_streams(device):
            streams.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best
