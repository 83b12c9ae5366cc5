"""How much memory a choice may use: the budgets given (``"8GiB"``), or the defaults ``auto`` derives.

Without a ``vram_budget``, ``auto`` gives weights a share of the device's free memory less the ``reserve`` (the rest
is for the call's activations; a larger share when the call's shapes are given, since the activations are then
predicted and counted); without a ``ram_budget``, a share of what the system says is available. On a CPU device there
is no device limit: the device is the RAM.
"""

from __future__ import annotations

from typing import Any

import torch

from memmode_core.contracts.errors import InvalidOptionError
from memmode_core.contracts.options import byte_size
from memmode_core.engine.device_share import reserve_bytes
from memmode_core.engine.streams import active

#: Share of free device memory ``auto`` may fill with weights by default (the rest is for activations).
DEFAULT_VRAM_SHARE = 0.8
#: Share of free device memory ``auto`` may fill with weights and the predicted activations when the call's shapes
#: are given: the rest covers what the prediction leaves out (the allocator's rounding and caching, unmodelled
#: kernel workspace)
SHAPED_VRAM_SHARE = 0.95
#: Share of available RAM ``auto`` may fill with offloaded weights by default.
DEFAULT_RAM_SHARE = 0.9


def budget_bytes(name: str, value: Any) -> int | None:
    """A budget given as bytes or as a string such as ``"8GiB"`` (None: no limit); refused, naming it, when it
    is neither."""
    try:
        return byte_size(value)
    except (TypeError, ValueError) as exc:
        raise InvalidOptionError(f"{name}={value!r}: {exc}") from None


def default_vram_budget(
    device: torch.device, share: float = DEFAULT_VRAM_SHARE, reserve: int | float | None = None
) -> int | None:
    """``share`` of the device's free memory less the ``reserve`` (bytes, or a share of the device's memory) (None on
    the host: no limit)."""
    room = device_room(device, reserve)
    return None if room is None else int(room * share)


def reserved(device: torch.device, reserve: int | float | None) -> int:
    """The ``reserve`` in bytes on ``device`` (0 on the host, whose memory has its own budget)."""
    streams = active()
    if reserve is None or streams.is_host(device):
        return 0
    return reserve_bytes(reserve, streams.memory_info(device)[1])


def device_room(device: torch.device, reserve: int | float | None = None) -> int | None:
    """What memmode may take on ``device`` now: its free memory (what PyTorch caches for this process unused
    included) less the ``reserve`` (None on the host: no limit)."""
    streams = active()
    if streams.is_host(device):
        return None
    return max(streams.free_memory(device) - reserved(device, reserve), 0)


def default_ram_budget() -> int | None:
    """:data:`DEFAULT_RAM_SHARE` of ``MemAvailable`` (None where the system does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * DEFAULT_RAM_SHARE)
    except OSError:
        pass
    return None
