"""One device, many handles: the memory every runtime on an accelerator shares, and who gives back what, when.

A device is shared: by every handle of this process placed on it (two pipelines of a workflow, a denoiser and a
separately placed VAE), and by what memmode does not own (another application, the call's activations, the
allocator's rounding). Each handle plans its residency alone, at ``apply``, against the free memory of that
moment; what holds at run time is decided here, before each call, against the memory free now:

- every runtime's :class:`~memmode_core.engine.moving.Moving` part is a :class:`Tenant` of its device's
  :class:`DeviceShare` (one per device and streams backend, :meth:`DeviceShare.of`);
- before a component's call, its runtime asks the share for the room the call is predicted to need
  (:meth:`DeviceShare.make_room`). The room is the device's free memory read again now (an offloaded group's memory
  cached by PyTorch's allocator counts as free: it is this process's) less the **reserve**: bytes, or a share of
  the device's memory, kept free for what memmode does not own (the largest any live handle asked for). When the
  room falls short, handles that are not running give back the groups they keep on the device, least recently
  used first; what the share could not free, the caller frees of its own (its other components, then its own
  kept groups, which then stream for the call) — so a call never starts counting on memory that another process
  took since the last one;
- what was given back, by whom and for whom, is written in both handles' ledgers (``report().evictions``).

A tenant that is running (in a call, or holding its lock in another thread) is never asked: it is busy, and what
it holds it needs. On a host device (the CPU) there is no share: the device is the RAM.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Protocol

import torch

from memmode_core.engine.streams import Streams


def reserve_bytes(reserve: int | float | None, total: int) -> int:
    """A reserve in bytes: given so, or a share of the device's ``total`` memory (a float)."""
    if reserve is None:
        return 0
    return int(reserve * total) if isinstance(reserve, float) else int(reserve)


class Tenant(Protocol):
    """What a share asks of a runtime on its device (:class:`~memmode_core.engine.moving.Moving`)."""

    #: what the handle places, for reports (``"WanPipeline"``, ``"UNet2DConditionModel"``)
    label: str

    def held_bytes(self) -> int:
        """Weight bytes it holds on the device now, besides those placed there for good."""
        ...

    def give_back(self, for_whom: str, why: str) -> int:
        """Offload every group it holds on the device that is not placed there for good, unless it is running;
        returns the bytes freed (0 when busy)."""
        ...

    def took(self, from_whom: str, nbytes: int, why: str) -> None:
        """``from_whom`` gave back ``nbytes`` for it (written in its ledger)."""
        ...


class DeviceShare:
    """The tenants of one device and the reserve they keep (see the module docstring)."""

    _lock = threading.Lock()
    #: streams backend -> device -> its share (a backend a test installed goes with its shares)
    _shares: weakref.WeakKeyDictionary[Streams, dict[str, DeviceShare]] = weakref.WeakKeyDictionary()

    def __init__(self, streams: Streams, device: torch.device) -> None:
        self.streams = streams
        self.device = device
        #: tenant -> (the reserve it asked for: bytes, or a share of the device's memory; its last use, for LRU)
        self._tenants: weakref.WeakKeyDictionary[Tenant, list] = weakref.WeakKeyDictionary()
        self._clock = itertools.count()
        self._total: int | None = None

    @classmethod
    def of(cls, streams: Streams, device: torch.device) -> DeviceShare | None:
        """The share of ``device`` (None on a host device: nothing to share but RAM)."""
        if streams.is_host(device):
            return None
        with cls._lock:
            shares = cls._shares.setdefault(streams, {})
            share = shares.get(str(device))
            if share is None:
                share = shares[str(device)] = cls(streams, device)
            return share

    # -- tenants ------------------------------------------------------------------------------------------

    def join(self, tenant: Tenant, label: str, reserve: int | float | None = None) -> str:
        """``tenant`` places weights on this device from now on, keeping ``reserve`` free for others. Returns the
        name it goes by in the others' reports: ``label``, numbered when another tenant goes by it already."""
        with self._lock:
            taken = {other.label for other in self._tenants}
            numbered = (f"{label} #{k}" for k in itertools.count(2))
            unique = next(n for n in itertools.chain([label], numbered) if n not in taken)
            self._tenants[tenant] = [reserve, next(self._clock)]
            return unique

    def leave(self, tenant: Tenant) -> None:
        """``tenant`` holds nothing here any more (its handle was removed)."""
        with self._lock:
            self._tenants.pop(tenant, None)

    def touch(self, tenant: Tenant) -> None:
        """``tenant`` runs now: it is the most recently used."""
        with self._lock:
            entry = self._tenants.get(tenant)
            if entry is not None:
                entry[1] = next(self._clock)

    def tenants(self) -> list[Tenant]:
        """The live tenants, least recently used first."""
        with self._lock:
            return [t for t, _ in sorted(self._tenants.items(), key=lambda item: item[1][1])]

    # -- room ---------------------------------------------------------------------------------------------

    @property
    def total(self) -> int:
        """The device's memory, in bytes (read once)."""
        if self._total is None:
            self._total = self.streams.memory_info(self.device)[1]
        return self._total

    @property
    def reserve(self) -> int:
        """Bytes kept free for what memmode does not own: the largest reserve a live tenant asked for."""
        with self._lock:
            asked = [entry[0] for entry in self._tenants.values() if entry[0]]
        return max((reserve_bytes(r, self.total) for r in asked), default=0)

    def room(self) -> int:
        """Bytes memmode may still allocate on the device now: the free memory, read now, less the reserve."""
        return self.streams.free_memory(self.device) - self.reserve

    def make_room(self, tenant: Tenant, needed: int, why: str) -> int:
        """Have the other tenants that are not running give back what they hold, least recently used first, until
        ``needed`` bytes are free beyond the reserve (or nobody has anything left to give); ``tenant`` becomes the
        most recently used. Returns the room there is then (it may still be short: the caller frees its own)."""
        self.touch(tenant)
        room = self.room()
        for other in self.tenants():
            if room >= needed:
                break
            if other is not tenant and self._take(tenant, other, why):
                room = self.room()
        return room

    def evict_others(self, tenant: Tenant, why: str) -> int:
        """Have every other tenant that is not running give back what it holds (``tenant`` ran out of memory).
        Returns the bytes freed."""
        return sum(self._take(tenant, other, why) for other in self.tenants() if other is not tenant)

    @staticmethod
    def _take(tenant: Tenant, other: Tenant, why: str) -> int:
        if not other.held_bytes():
            return 0
        freed = other.give_back(tenant.label, why)
        if freed:
            tenant.took(other.label, freed, why)
        return freed
