"""The one door to an accelerator's asynchronous machinery: streams, events, copies and page-locked memory.

Everything in memmode that overlaps a copy with compute — the engine's prefetch, the staging ring, the
storages' ``fetch`` — asks this layer, never ``torch.cuda``, so the same code drives CUDA, ROCm, Intel
XPU and any PrivateUse1 backend that implements PyTorch's device-generic stream API (``torch.Stream``,
``torch.Event``, ``torch.accelerator``). What is CUDA-only by nature (``cudaHostRegister`` in the
``pinned`` storage's slabs) says so where it is, and falls back to :meth:`Streams.pinned_empty` elsewhere.

The layer is also the seam for tests: :func:`installed` swaps :func:`active` for a double, and
:class:`memmode_core.testing.StrictStreams` is one that runs the whole accelerator path on the CPU with
asynchronous copies that are stricter than real hardware (see ``docs/streams.md``). Code that uses the
layer fetches :func:`active` where it starts (a runtime, a storage session) and keeps it, so one apply
talks to one backend from beginning to end.

Ordering rules every caller keeps (they are what the strict double checks):

- a copy issued on a stream is usable by another stream only after that stream :meth:`~Streams.wait`\\ s an
  event recorded after the copy (or after a host synchronisation that covers it);
- a device buffer used by a stream other than the one it was allocated on is :meth:`~Streams.record_stream`\\ ed
  for that stream before it is released, so the caching allocator cannot hand it to a new copy too early;
- a page-locked host buffer a copy reads from is neither written nor released before the host knows the
  copy finished (:meth:`~Streams.wait_host`, :meth:`~Streams.synchronize`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch

_NULL = contextlib.nullcontext()


class Streams:
    """The real backend: PyTorch's device-generic stream API."""

    name = "torch"

    # -- what a device is -------------------------------------------------------------------------

    def is_host(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` live in host memory (then storages may hand out their copies as they are)."""
        return device.type == "cpu"

    def has_streams(self, device: torch.device) -> bool:
        """Whether copies to ``device`` can run on a side stream, overlapped with compute."""
        return _supports_streams(device.type)

    def can_pin(self, device: torch.device) -> bool:
        """Whether page-locked host memory speeds up copies to ``device`` (asynchronous DMA)."""
        return self.has_streams(device)

    def can_register_host(self, device: torch.device) -> bool:
        """Whether host memory that is already there (ordinary pages, a shared mapping) can be page-locked in
        place for asynchronous copies to ``device`` (:meth:`register_host`): CUDA's ``cudaHostRegister``, which
        ROCm builds map to HIP's. Other accelerators only have a host allocator of their own (:meth:`pinned_empty`)."""
        return device.type == "cuda" and self.has_streams(device)

    # -- streams and events -----------------------------------------------------------------------

    def new_stream(self, device: torch.device) -> torch.Stream:
        return torch.Stream(device=device)

    def current_stream(self, device: torch.device) -> torch.Stream:
        return torch.accelerator.current_stream(device)

    def on(self, stream: torch.Stream | None) -> contextlib.AbstractContextManager:
        """Make ``stream`` current for the block (work and allocations in it go to that stream); None: no change."""
        return _NULL if stream is None else stream

    def new_event(self, device: torch.device, *, timing: bool = False) -> torch.Event:
        return torch.Event(device=device, enable_timing=timing)

    def record(self, event: torch.Event, stream: torch.Stream | None = None) -> None:
        """Record ``event`` on ``stream`` (None: the current stream): it completes after the work issued before it."""
        event.record(stream)

    def wait(self, stream: torch.Stream, event: torch.Event) -> None:
        """Work issued on ``stream`` from now on runs after ``event`` (the host does not block)."""
        stream.wait_event(event)

    def done(self, event: torch.Event) -> bool:
        """Whether the work before ``event`` has finished (without blocking)."""
        return event.query()

    def wait_host(self, event: torch.Event) -> None:
        """Block the host until the work before ``event`` has finished."""
        event.synchronize()

    def elapsed(self, start: torch.Event, end: torch.Event) -> float:
        """Seconds between two finished timing events."""
        return start.elapsed_time(end) / 1000.0

    def synchronize(self, device: torch.device) -> None:
        """Block the host until everything issued on ``device``, on every stream, has finished."""
        torch.accelerator.synchronize(device)

    def record_stream(self, tensor: torch.Tensor, stream: torch.Stream) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor``: its memory waits for that work before reuse."""
        tensor.record_stream(stream)

    # -- memory and copies ------------------------------------------------------------------------

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor on ``device``, allocated on the current stream."""
        return torch.empty(shape, dtype=dtype, device=device)

    def to_device(self, tensor: torch.Tensor, device: torch.device, *, non_blocking: bool = False) -> torch.Tensor:
        """``tensor`` on ``device``, copied on the current stream (itself when it is there already)."""
        return tensor.to(device, non_blocking=non_blocking)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in ordinary CPU memory, copied synchronously (itself when it is there already)."""
        return tensor.to("cpu")

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
        """Copy ``src`` into ``dst`` on the current stream."""
        dst.copy_(src, non_blocking=non_blocking)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of page-locked host memory (``uint8``), from PyTorch's host allocator."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def register_host(self, tensor: torch.Tensor, *, read_only: bool = False) -> None:
        """Page-lock ``tensor``'s memory in place (whole pages it alone uses), for every device of the process.

        ``read_only`` for memory mapped without write permission (a mapping shared with other processes): without
        ``cudaHostRegisterReadOnly`` the driver pins the pages for writing, which a read-only mapping refuses and
        which would break copy-on-write sharing of a private one (each process would pin its own copy)."""
        flags = _HOST_REGISTER_PORTABLE | (_HOST_REGISTER_READ_ONLY if read_only else 0)
        nbytes = tensor.numel() * tensor.element_size()
        registered = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, flags)
        _cuda_check(registered, f"cudaHostRegister of {nbytes} bytes")

    def unregister_host(self, tensor: torch.Tensor) -> None:
        """Undo :meth:`register_host` (the memory stays, pageable). The caller makes sure no copy still reads it."""
        _cuda_check(torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr()), "cudaHostUnregister")

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        """``(free, total)`` bytes of ``device``'s memory."""
        free, total = torch.accelerator.get_memory_info(device)
        return int(free), int(total)

    def free_memory(self, device: torch.device) -> int:
        """Bytes this process could allocate on ``device`` now: what the driver says is free, plus what PyTorch's
        caching allocator holds for this process without using it (an offloaded group's memory stays cached there,
        and is this process's to reuse; the driver counts it as taken)."""
        free, _ = self.memory_info(device)
        cached = torch.accelerator.memory_reserved(device) - torch.accelerator.memory_allocated(device)
        return free + max(int(cached), 0)

    def label(self, name: str) -> contextlib.AbstractContextManager:
        """The work issued in the block is for ``name`` (a group key); a double names it in what it reports."""
        return _NULL


#: ``cudaHostRegisterPortable``: the memory counts as page-locked for every CUDA context of the process, not only
#: the current device's, so copies to any GPU of the process are asynchronous
_HOST_REGISTER_PORTABLE = 1
#: ``cudaHostRegisterReadOnly``: the device only reads the memory (needed for a read-only mapping)
_HOST_REGISTER_READ_ONLY = 8


def _cuda_check(result, what: str) -> None:
    try:
        torch.cuda.check_error(result)
    except torch.cuda.CudaError as exc:
        raise RuntimeError(f"{what} failed: {exc}") from None


@functools.cache
def _supports_streams(device_type: str) -> bool:
    """Whether ``device_type`` is this process's accelerator and implements side streams."""
    if device_type in ("cpu", "meta"):
        return False
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != device_type:
        return False
    try:
        torch.Stream(device=torch.device(device_type))
    except (RuntimeError, NotImplementedError):  # an accelerator without stream support (e.g. one stream only)
        return False
    return True


_REAL = Streams()
_active: Streams = _REAL
_swap = threading.Lock()


def active() -> Streams:
    """The backend in use now: the real one unless a test :func:`installed` a double."""
    return _active


@contextlib.contextmanager
def installed(backend: Streams) -> Iterator[Streams]:
    """Use ``backend`` for everything started inside the block (process-wide; for tests)."""
    global _active
    with _swap:
        previous, _active = _active, backend
    try:
        yield backend
    finally:
        with _swap:
            _active = previous
