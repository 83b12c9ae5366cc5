"""``pinned`` for the ranks of one machine: one copy of the offloaded groups in shared memory, page-locked by
every rank in its own process.

Each rank pinning a copy of its own multiplies page-locked memory — RAM the kernel can never reclaim — by the
ranks: an 8-GPU node offloading a 28 GB model would pin 224 GB. The ranks offload the same bytes, so they keep
them once. Each group is a group file of the kit's store — named by its content, written once by the first rank
to store it and verified byte for byte by the others, written to a temporary name and renamed when complete, so
that a rank killed mid-write leaves only a temporary file nobody reads — in the folder every rank of the job on
this machine uses (``shared_folder``), on the shared-memory filesystem (``/dev/shm``): the files are memory,
counted once on the machine. Each rank maps each file shared and read-only and page-locks its mapping
(``register_host(read_only=True)``): locking for writing would be refused on a read-only mapping, and on a
private mapping it would give the rank a copy of its own again.

The reservation checks, before any weight is released, that the folder has room for the groups and that this
accelerator can page-lock a read-only shared mapping. ``pinned_limit`` bounds what each rank page-locks; the
groups beyond it stay in the shared files, pageable (one copy still). The files go with the last rank's session.
"""

from __future__ import annotations

import mmap
import warnings
import weakref
from collections.abc import Mapping

import torch

from memmode_core.plugin import (
    GroupFileSession,
    GroupFileStore,
    StorageUnavailableError,
    Tensors,
    active_streams,
    host_pins,
)

from .slabs import say_pageable

PAGE = mmap.PAGESIZE


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


class _Registrations:
    """The mappings this rank page-locked, apart from the session so that the finalizer that unlocks them when
    a session is dropped without ``close()`` does not keep it alive."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams = active_streams()
        #: key -> the group's whole mapping, page-locked
        self.locked: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(_pages(flat.numel()) for flat in self.locked.values())

    def lock(self, key: str, flat: torch.Tensor) -> None:
        nbytes = _pages(flat.numel())
        if host_pins.take(nbytes) < nbytes:
            host_pins.give(nbytes)
            raise MemoryError(f"the process's budget of page-locked memory ({host_pins.budget} bytes) is reached")
        try:
            self.streams.register_host(flat, read_only=True)
        except BaseException:
            host_pins.give(nbytes)
            raise
        self.locked[key] = flat

    def unlock(self, key: str | None = None) -> None:
        """Unlock one group's mapping (or all) once no copy reads it."""
        keys = list(self.locked) if key is None else [key] if key in self.locked else []
        if not keys:
            return
        self.streams.synchronize(self.device)
        for each in keys:
            flat = self.locked.pop(each)
            host_pins.give(_pages(flat.numel()))
            self.streams.unregister_host(flat)


class SharedPinnedSession(GroupFileSession):
    """The groups in the machine's shared files, each rank's mappings page-locked (see the module docstring)."""

    #: the weights at rest are views of files in a folder other processes use: checked before each onload
    at_rest_can_break = True

    def __init__(self, store: GroupFileStore, device: torch.device, limit: int | None) -> None:
        super().__init__(store, device)
        # copies come straight from the page-locked mappings: no staging ring
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        self.limit = limit
        #: key -> (the group's whole mapping, typed views of its tensors)
        self._mapped: dict[str, tuple[torch.Tensor, Tensors]] = {}
        #: the keys page-locked when put, chosen at reserve in the placement's order within ``limit``
        self._to_lock: set[str] = set()
        self._locks = _Registrations(device)
        self._finalizer = weakref.finalize(self, self._locks.unlock)
        self._finalizer.atexit = False  # at exit the process's memory goes anyway

    def reserve(self, sizes: Mapping[str, int]) -> None:
        """Room for the groups in the shared folder, and proof that a shared mapping can be page-locked here,
        before any weight is released; which groups are locked is decided now, in order, within the limit."""
        self._probe()
        super().reserve(sizes)
        room = None if self.limit is None else self.limit - self._locks.nbytes
        budget_left = host_pins.left()
        bounded_by_host = budget_left is not None and (room is None or budget_left < room)
        if bounded_by_host:
            room = budget_left
        for key, size in sizes.items():
            if size and (room is None or _pages(size) <= room):
                self._to_lock.add(key)
                room = None if room is None else room - _pages(size)
        if bounded_by_host:
            say_pageable({k: n for k, n in sizes.items() if n and k not in self._to_lock})

    def _probe(self) -> None:
        """Page-lock one read-only shared page and unlock it (not every device can lock read-only memory)."""
        streams = self._locks.streams
        probe = mmap.mmap(-1, PAGE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        with warnings.catch_warnings():  # torch warns that the buffer is not writable: that is the point
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(probe, dtype=torch.uint8)
        try:
            streams.register_host(flat, read_only=True)
            streams.unregister_host(flat)
        except (RuntimeError, MemoryError) as exc:
            raise StorageUnavailableError(
                f"storage 'pinned': this accelerator cannot page-lock memory shared by the ranks of this machine "
                f"({exc}); pass share_between_ranks=False to pin a copy per rank, or use storage='mmap'"
            ) from None
        finally:
            del flat
            probe.close()

    def put(self, key: str, tensors: Tensors, readable: frozenset[str] = frozenset()) -> Tensors:
        group_file = self.store.store(tensors, wait=True)  # written by the first rank, verified by the others
        self.files[key] = group_file
        flat, views = group_file.map_shared()
        self._mapped[key] = (flat, views)
        if key in self._to_lock:
            try:
                self._locks.lock(key, flat)
            except (RuntimeError, MemoryError) as exc:
                raise StorageUnavailableError(
                    f"storage 'pinned': cannot page-lock group {key!r} ({flat.numel()} bytes) in {group_file.path} "
                    f"({exc}); pin less with pinned_limit='...GiB'"
                ) from None
        return dict(views)

    def fetch(self, key: str, device: torch.device, stream: torch.Stream | None = None) -> Tensors:
        streams = self._locks.streams
        with streams.on(stream):
            return {
                name: streams.to_device(view, device, non_blocking=True) for name, view in self._mapped[key][1].items()
            }

    def read(self, key: str, name: str) -> torch.Tensor:
        return self._mapped[key][1][name]

    def restore(self, key: str) -> Tensors:
        # copies into ordinary memory: the views are read-only, and the files go with the last rank's session
        return {name: view.clone() for name, view in self._mapped[key][1].items()}

    def discard(self, key: str) -> None:
        self._locks.unlock(key)
        self._mapped.pop(key, None)
        self._to_lock.discard(key)
        super().discard(key)

    def close(self) -> None:
        self._finalizer()
        self._mapped.clear()
        super().close()

    def stats(self) -> dict[str, int]:
        return {
            **super().stats(),
            "disk_bytes": 0,  # the files are in shared memory, counted below
            "pinned_bytes": self._locks.nbytes,
            "pageable_bytes": 0,
            "shared_bytes": self.store.disk_bytes,
        }
