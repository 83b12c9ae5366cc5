"""The capacity of the strict model's device (:class:`~memmode_core.testing.strict_streams.StrictStreams`): what
its buffers hold, what another application holds, and the out-of-memory errors an accelerator raises.

Kept apart from the rules on copies and streams: this is only bytes. Every device buffer the strict model makes
counts while it lives; an allocation that would go over the capacity raises ``torch.OutOfMemoryError``, the type
an accelerator raises, with a message like CUDA's. :meth:`DeviceCapacity.occupy` takes memory away as another
application would, and :meth:`DeviceCapacity.fail_allocations` makes the next allocations fail whatever is free
(a shape nobody planned, fragmentation). ``peak_used`` is the most the device held at once, the other
application's bytes included: what a test compares with the device's size.
"""

from __future__ import annotations

import threading

import torch


class DeviceCapacity:
    """``total`` bytes of device memory (see the module docstring)."""

    def __init__(self, total: int, device_type: str = "cpu") -> None:
        self.total = total
        self.device_type = device_type
        self._lock = threading.Lock()
        #: bytes of the device buffers alive now, and the most the device held at once (with ``occupied``)
        self.used = 0
        self.peak_used = 0
        #: bytes another application holds on the device (:meth:`occupy`)
        self.occupied = 0
        #: allocations refused so far (the accelerator's out-of-memory errors)
        self.refused = 0
        self._failures = 0

    @property
    def free(self) -> int:
        return max(self.total - self.used - self.occupied, 0)

    def occupy(self, nbytes: int) -> None:
        """Another application holds ``nbytes`` of the device from now on (0: it gave everything back). It cannot
        take more than this process leaves free: a real one would fail itself."""
        with self._lock:
            if nbytes < 0 or self.used + nbytes > self.total:
                raise ValueError(f"another application cannot hold {nbytes} bytes: {self.total - self.used} are free")
            self.occupied = nbytes
            self.peak_used = max(self.peak_used, self.used + nbytes)

    def fail_allocations(self, count: int = 1) -> None:
        """The next ``count`` allocations fail with ``torch.OutOfMemoryError``, whatever is free."""
        with self._lock:
            self._failures = count

    def allocate(self, nbytes: int) -> None:
        """Make room for a buffer of ``nbytes`` (counted once it is made: :meth:`made`), or raise the accelerator's
        out-of-memory error."""
        with self._lock:
            free = self.total - self.used - self.occupied
            if not self._failures and nbytes <= free:
                return
            self._failures = max(self._failures - 1, 0)
            self.refused += 1
        raise torch.OutOfMemoryError(
            f"{self.device_type} out of memory (strict model). Tried to allocate {nbytes} bytes; the device has "
            f"{self.total} bytes of total capacity, of which {max(free, 0)} are free ({self.used} held by this "
            f"process, {self.occupied} by another application)"
        )

    def made(self, nbytes: int) -> None:
        """A buffer of ``nbytes`` lives from now on."""
        with self._lock:
            self.used += nbytes
            self.peak_used = max(self.peak_used, self.used + self.occupied)

    def freed(self, nbytes: int) -> None:
        """A buffer of ``nbytes`` was released."""
        with self._lock:
            self.used -= nbytes
