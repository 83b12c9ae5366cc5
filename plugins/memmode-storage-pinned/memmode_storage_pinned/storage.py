"""The ``pinned`` storage: offloaded groups wait in page-locked CPU memory, copied to the accelerator
asynchronously on the engine's prefetch stream.

A copy from page-locked memory is a plain DMA that the GPU runs while it computes; a copy from
pageable memory is staged by the driver and holds up the CPU. The catch with pinned memory is its
cost — it is RAM the kernel can never reclaim — so this storage allocates it exactly
(:mod:`.slabs`), once, at ``reserve`` (so a refusal comes before any weight is released), reuses it
for every call, reports it, and can be bounded: ``pinned_limit`` pins at most that many bytes and
keeps the remaining groups in pageable memory.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from memmode_core.plugin import (
    GroupFileStore,
    Options,
    Storage,
    StorageCost,
    StorageSession,
    StorageUnavailableError,
    Tensors,
    active_streams,
    boolean,
    byte_size,
    copying_cost,
    host_copy,
    host_pins,
    option,
    packing,
    ranks_share_a_machine,
    resolve_device,
    shared_folder,
    shared_memory,
)

from .shared import SharedPinnedSession
from .slabs import SLAB_BYTES, Slab, Spot, assign_spots, say_pageable

logger = logging.getLogger("memmode")


class _Pins:
    """The session's slabs and groups; apart from the session so that the finalizer that unlocks
    the slabs when a session is dropped without ``close()`` does not keep it alive."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams = active_streams()
        #: a forked child inherits this object but not the device context the slabs are registered with
        self.pid = os.getpid()
        self.slabs: list[Slab] = []
        self.spots: dict[str, Spot | None] = {}
        #: key -> the group at rest (views of a slab, or pageable tensors)
        self.groups: dict[str, Tensors] = {}

    def release(self) -> None:
        """Unlock every slab once no copy reads it. Views handed out (``restore``) stay valid: the
        memory becomes ordinary pageable memory, freed with the last view."""
        if os.getpid() != self.pid:
            return
        try:
            if any(slab.registered for slab in self.slabs):
                self.streams.synchronize(self.device)
            for slab in self.slabs:
                slab.unregister()
        finally:
            self.slabs, self.spots, self.groups = [], {}, {}


class PinnedSession(StorageSession):
    def __init__(self, device: torch.device, limit: int | None) -> None:
        self.device = device
        self.limit = limit
        self._pins = _Pins(device)
        self._finalizer = weakref.finalize(self, self._pins.release)
        self._finalizer.atexit = False  # at exit the process's memory goes anyway

    def reserve(self, sizes: Mapping[str, int]) -> None:
        """Page-lock room for these groups now, so that a refusal comes before any weight is released.

        Called once at ``apply`` and again for each part the engine stores later (an adapter's
        weights after a LoRA is loaded): each call adds slabs, and ``pinned_limit`` counts what the
        earlier calls pinned.
        """
        pins = self._pins
        already = sum(slab.nbytes for slab in pins.slabs)
        limit = None if self.limit is None else max(0, self.limit - already)
        budget_left = host_pins.left()
        bounded_by_host = budget_left is not None and (limit is None or budget_left < limit)
        if bounded_by_host:
            limit = budget_left
        spots, slab_sizes = assign_spots(sizes, limit=limit, slab_bytes=SLAB_BYTES)
        if bounded_by_host:
            say_pageable({k: sizes[k] for k, spot in spots.items() if spot is None})
        added: list[Slab] = []
        try:
            for nbytes in slab_sizes:
                added.append(Slab(nbytes, self.device))
                added[-1].register()
        except (RuntimeError, MemoryError) as exc:
            for slab in added:
                slab.unregister()
            raise StorageUnavailableError(
                f"storage 'pinned': cannot page-lock {sum(slab_sizes) / 2**30:.2f} GiB more ({exc}); pin less "
                f"with pinned_limit='...GiB', or use storage='ram'"
            ) from None
        base = len(pins.slabs)
        pins.slabs += added
        pins.spots.update(
            {key: None if spot is None else Spot(spot.slab + base, spot.offset) for key, spot in spots.items()}
        )

    def put(self, key: str, tensors: Tensors, readable: frozenset[str] = frozenset()) -> Tensors:
        if key not in self._pins.spots:
            raise KeyError(f"group {key!r} was not reserved: reserve() comes before put()")
        spot = self._pins.spots[key]
        if spot is None:  # beyond pinned_limit
            kept = {name: host_copy(t) for name, t in tensors.items()}
        else:
            entries = packing.pack(tensors)
            kept = packing.views(self._pins.slabs[spot.slab].tensor, entries, spot.offset)
            for name, view in kept.items():
                view.copy_(tensors[name])
        self._pins.groups[key] = kept
        return kept

    def fetch(self, key: str, device: torch.device, stream: torch.Stream | None = None) -> Tensors:
        streams = self._pins.streams
        with streams.on(stream):
            return {name: streams.to_device(t, device, non_blocking=True) for name, t in self._pins.groups[key].items()}

    def restore(self, key: str) -> Tensors:
        kept = self._pins.groups[key]
        spot = self._pins.spots.get(key)
        if spot is not None and not self._pins.slabs[spot.slab].exact:
            # an allocator's page-locked block stays locked while a view of it lives: give back copies
            return {name: t.clone() for name, t in kept.items()}
        return kept

    def discard(self, key: str) -> None:
        # its room in the slab stays locked, unused, until close(): a part stored again after a
        # change is reserved under a new key
        self._pins.groups.pop(key, None)
        self._pins.spots.pop(key, None)

    def close(self) -> None:
        self._finalizer()

    def stats(self) -> dict[str, int]:
        pageable = sum(
            t.numel() * t.element_size()
            for key, group in self._pins.groups.items()
            if self._pins.spots.get(key) is None
            for t in group.values()
        )
        return {
            "pinned_bytes": sum(slab.nbytes for slab in self._pins.slabs if slab.registered),
            "pageable_bytes": pageable,
        }


@dataclass(frozen=True)
class PinnedOptions(Options):
    pinned_limit: int | None = option(
        None,
        "pin at most this many bytes (e.g. '24GiB'); the groups beyond it stay in pageable memory (default: pin "
        "every offloaded group)",
        byte_size,
    )
    share_between_ranks: bool = option(
        True,
        "when several ranks of torch.distributed share this machine, keep one copy of the groups in shared memory "
        "that every rank page-locks, instead of one pinned copy per rank (default True)",
        boolean,
    )


class PinnedStorage(Storage):
    """Offloaded groups wait in page-locked CPU memory and are copied to the GPU asynchronously.

    The page-locked copies are made once, at exactly the weights' size (packed into slabs that are
    registered with ``cudaHostRegister``, instead of ``pin_memory()``'s power-of-two blocks), and
    reused for every call. Needs an accelerator with streams; on one other than CUDA the slabs come
    from PyTorch's page-locked host allocator (rounded up to its block sizes).

    Option ``pinned_limit`` (default None: pin everything): pin at most this many bytes — an int or
    a string such as ``"24GiB"`` — and keep the groups beyond it in pageable memory (their copies
    are synchronous). Groups are pinned in the placement's order until the limit is reached.

    Ranks of ``torch.distributed`` on one machine share one copy (:mod:`.shared`): the groups are files in the
    machine's shared memory, written once, and each rank page-locks its mapping of them. Option
    ``share_between_ranks=False`` pins a copy per rank instead.
    """

    name = "pinned"
    description = "page-locked CPU memory, exactly sized, for asynchronous copies to an accelerator"
    options = PinnedOptions

    def cost(self, device: torch.device) -> StorageCost:
        # copies run at page-locked bandwidth; ranks of one machine share one copy where a shared mapping can be
        # page-locked (and a machine has shared memory)
        shared = active_streams().can_register_host(device) and shared_memory() is not None
        return copying_cost("pinned", device, pinned=1.0, shared_by_ranks=shared)

    def unavailable_reason(self, device: torch.device | None = None) -> str | None:
        streams = active_streams()
        default = resolve_device(None)
        if streams.can_pin(device if device is not None else default):
            return None
        if not streams.can_pin(default):  # nothing here to copy to asynchronously
            build = "" if torch.accelerator.is_available() else " (this PyTorch build has no accelerator)"
            return (
                f"no accelerator with streams (CUDA, ROCm, XPU...){build}: page-locked memory only speeds up "
                f"asynchronous copies to one"
            )
        return f"page-locked memory only speeds up copies to an accelerator, and the compute device is {device}"

    def open(self, *, device: torch.device, offload_dir: str | None, options: PinnedOptions) -> StorageSession:
        if options.share_between_ranks and ranks_share_a_machine():
            why_not = self._why_ranks_cannot_share(device)
            if why_not is None:
                store = GroupFileStore(
                    shared_folder("pinned", under=shared_memory()),
                    keep_files=False,
                    owner=self.name,
                    shared_by_ranks=True,
                )
                return SharedPinnedSession(store, device, options.pinned_limit)
            logger.warning(
                "memmode: storage 'pinned' pins one copy per rank (%d ranks of torch.distributed share this machine): "
                "%s; storage='mmap' keeps one copy for all of them",
                torch.distributed.get_world_size(),
                why_not,
            )
        return PinnedSession(device, options.pinned_limit)

    @staticmethod
    def _why_ranks_cannot_share(device: torch.device) -> str | None:
        if shared_memory() is None:
            return "this system has no shared-memory filesystem (/dev/shm)"
        if not active_streams().can_register_host(device):
            return f"{device.type} cannot page-lock memory it did not allocate (a shared mapping)"
        return None
