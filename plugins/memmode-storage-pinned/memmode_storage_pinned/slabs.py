"""Exactly-sized page-locked memory: groups packed into a few slabs, each page-locked once.

``tensor.pin_memory()`` goes through PyTorch's caching host allocator, which rounds every block up
to a power of two (a 2.1 GiB group takes a 4 GiB block) and keeps freed blocks cached: pinning a
model that way can cost up to twice its size in locked RAM. Here the groups' sizes are known when
the engine calls ``reserve``, so they are packed back to back into slabs of about
:data:`SLAB_BYTES` (a group larger than that gets a slab of its own size), each slab is ordinary
CPU memory, and each is page-locked in place with ``cudaHostRegister``. The only overhead is the
rounding of each slab to whole pages and at most 63 bytes of alignment per group.

A slab is page-aligned and made of whole pages that belong to it alone: ``cudaHostRegister``
locks whole pages and refuses a page that is already registered, so two registrations must never
share one.

Registering memory in place is CUDA's ``cudaHostRegister`` (ROCm builds map it to HIP's), reached through the
kit's ``active_streams().register_host``. On any other accelerator a slab is allocated page-locked by
PyTorch's host allocator instead (``active_streams().pinned_empty``), which rounds it up to its block size.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from memmode_core.plugin import StorageUnavailableError, active_streams, host_pins

#: groups are packed into slabs of about this size (fewer, larger registrations are cheaper, and a
#: slab freed by close() is a large contiguous release)
SLAB_BYTES = 256 << 20
#: every group starts at a multiple of this within its slab (cache line; also covers every dtype)
GROUP_ALIGNMENT = 64
PAGE = mmap.PAGESIZE
logger = logging.getLogger("memmode")


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Spot:
    """Where a group lives: slab index and byte offset."""

    slab: int
    offset: int


def assign_spots(
    sizes: Mapping[str, int], *, limit: int | None, slab_bytes: int = SLAB_BYTES
) -> tuple[dict[str, Spot | None], list[int]]:
    """Assign each group a :class:`Spot`, or None to stay pageable because ``limit`` would be passed.

    Groups are taken in the order given (the engine's group order), each into the open slab if it
    fits there, else into a new one. With a ``limit``, a group is pinned only if the page-rounded
    total stays within it; later, smaller groups may still fit. Returns the spots and the byte size
    of each slab (whole pages).
    """
    spots: dict[str, Spot | None] = {}
    used: list[int] = []  # bytes used in each slab
    for key, size in sizes.items():
        padded = round_up(size, GROUP_ALIGNMENT)
        if used and used[-1] + padded <= slab_bytes:
            trial, spot = used[:-1] + [used[-1] + padded], Spot(len(used) - 1, used[-1])
        else:
            trial, spot = used + [padded], Spot(len(used), 0)
        if size == 0 or (limit is not None and sum(round_up(u, PAGE) for u in trial) > limit):
            spots[key] = None
            continue
        used, spots[key] = trial, spot
    return spots, [round_up(u, PAGE) for u in used]


class Slab:
    """``nbytes`` (whole pages) of CPU memory, page-locked from :meth:`register` until :meth:`unregister`.

    Where memory can be page-locked in place (CUDA) it is ordinary page-aligned memory that ``register`` locks,
    exactly (``exact``); elsewhere ``register`` allocates it from the accelerator's page-locked host allocator.
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        #: the stream layer that locks the slab also unlocks it (a slab may be freed after a test's layer is gone)
        self.streams = active_streams()
        self.exact = self.streams.can_register_host(device)
        self.tensor: torch.Tensor | None = None
        if self.exact:
            # one spare page so that a page-aligned range of nbytes fits whatever malloc returned
            backing = torch.empty(nbytes + PAGE, dtype=torch.uint8)
            skip = -backing.data_ptr() % PAGE
            self.tensor = backing[skip : skip + nbytes]
        self.registered = False

    def register(self) -> None:
        """Page-lock the slab, counted against the process's budget of page-locked memory (``host_pins``)."""
        if host_pins.take(self.nbytes) < self.nbytes:
            host_pins.give(self.nbytes)
            raise StorageUnavailableError(
                f"storage 'pinned': the process's budget of page-locked memory ({host_pins.budget} bytes) was taken "
                f"by another session meanwhile"
            )
        try:
            if not self.exact:
                self.tensor = self.streams.pinned_empty(self.nbytes)
            else:
                self.streams.register_host(self.tensor)
        except BaseException:
            host_pins.give(self.nbytes)
            raise
        self.registered = True

    def unregister(self) -> None:
        """Unlock (CUDA); an allocator's page-locked block is freed with its last view instead."""
        if self.registered:
            self.registered = False
            host_pins.give(self.nbytes)
            if self.exact:
                self.streams.unregister_host(self.tensor)


def say_pageable(sizes: Mapping[str, int]) -> None:
    """Warn that these groups stay in pageable memory because the process's page-locked budget is reached."""
    if not sizes:
        return
    logger.warning(
        "memmode: storage 'pinned' keeps %d groups (%.2f GiB) in pageable memory, their copies synchronous: this "
        "process may page-lock %.2f GiB (half of the host's memory, or its container's limit; %s sets it) and "
        "%.2f GiB of it are locked already",
        len(sizes),
        sum(sizes.values()) / 2**30,
        (host_pins.budget or 0) / 2**30,
        host_pins.variable,
        host_pins.pinned / 2**30,
    )
