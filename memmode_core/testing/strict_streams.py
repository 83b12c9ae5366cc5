"""A strict model of an accelerator's asynchronous copies, run on the CPU, for tests.

:class:`StrictStreams` replaces the primitives of :mod:`memmode_core.engine.streams` — streams, events,
copies, allocations, page-locked memory — and nothing else: installed with
:func:`~memmode_core.engine.streams.installed`, it makes the CPU an accelerator with streams, so the
engine, the staging ring and every storage run exactly the code they run on a GPU, against rules that
are stricter than the hardware, so that a missing synchronisation fails every time instead of once in a
thousand runs:

- **Copies are invisible until synchronised.** A copy issued on a side stream leaves its destination
  holding a sentinel (every byte ``0xFF``: NaN in every floating dtype, -1 in signed integers) until the
  compute stream waits on an event recorded after the copy on that stream (directly or through other
  streams' waits), or the host synchronises it (:meth:`~StrictStreams.wait_host`,
  :meth:`~StrictStreams.synchronize`). Every such copy is delayed to the last moment a correct program
  could observe it. A copy issued on the compute stream is ordered before the compute that follows, so
  it lands at once; a blocking copy (``non_blocking=False``) lands, with everything before it on its
  stream, before the call returns.
- **Landing order is shuffled.** When several copies land together they land in a random interleaving
  of their streams (per-stream order is kept, as hardware keeps it), from a seeded generator.
- **Freeing a device buffer too early is an error naming the group.** A buffer freed while a stream
  other than the one it was allocated on may still use it — a copy into it on another stream not yet
  known to the host as finished, or the compute stream having waited for an event recorded for the
  buffer's group (it reads it) — without ``record_stream`` for that stream and without a device
  synchronisation since, is an error:
  on a GPU the caching allocator could hand that memory to the next copy while it is still read.
- **Page-locked host memory is guarded.** A copy from page-locked memory reads it asynchronously: the
  buffer must not change or be freed until the host knows the copy finished. Its content at issue is
  remembered and compared when the host learns the copy finished; a change, or a release before then,
  is an error naming the group.
- ``query()`` (:meth:`~StrictStreams.done`) says finished only for work the host already knows finished.
- **The device has a capacity** (``capacity``: :class:`~memmode_core.testing.device_capacity.DeviceCapacity`):
  every device buffer counts against ``total_memory`` while it lives, an allocation that would go over raises
  ``torch.OutOfMemoryError``, and a test can take memory away as another application would.

An error is recorded where it happens (a buffer's release is noticed when its memory is freed) and
raised, as :class:`StrictStreamsError`, by the next call into the model and by :meth:`~StrictStreams.check`.

What it cannot tell: bandwidth, how much copying overlaps compute, the real allocator's behaviour
(fragmentation, its cache), the activations (ordinary CPU tensors here), kernels reading memory on a
stream other than the compute stream, and chains of copies across streams (a copy's source is read
when the copy is issued). Timing events measure host time between their records.
"""

from __future__ import annotations

import contextlib
import mmap
import random
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterator

import torch

from memmode_core.engine.streams import Streams
from memmode_core.testing.device_capacity import DeviceCapacity
from memmode_core.testing.stream_records import Buffer, Copy, FakeEvent, FakeStream, Pinned, geometry_of, view_of

#: the byte every device buffer holds until a copy lands in it
SENTINEL = 0xFF


class StrictStreamsError(AssertionError):
    """A synchronisation rule was broken: a buffer read, written or released while a copy was in flight."""


class StrictStreams(Streams):
    """The strict model (see the module docstring). ``device_type`` is the device it makes an accelerator
    (the CPU); ``seed`` fixes the landing order; ``total_memory`` is the device's capacity."""

    name = "strict"

    def __init__(self, *, seed: int = 0, device_type: str = "cpu", total_memory: int = 64 << 30) -> None:
        self.device_type = device_type
        self.total_memory = total_memory
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self._local = threading.local()
        #: the stream computation runs on (the default stream)
        self.compute = FakeStream(self, "compute")
        self._side = 0
        #: copies whose finish the host does not know yet (and that still matter), in issue order
        self._in_flight: dict[Copy, None] = {}
        self._buffers: dict[int, Buffer] = {}
        self._pinned: dict[int, Pinned] = {}
        self._errors: list[str] = []
        self._reported = 0
        #: the device's memory: what its buffers hold, what another application holds, out-of-memory errors
        self.capacity = DeviceCapacity(total_memory, device_type)
        #: what ran, for tests to check that the asynchronous path was taken
        self.counts: Counter[str] = Counter()

    # -- errors -------------------------------------------------------------------------------------

    @property
    def errors(self) -> list[str]:
        return list(self._errors)

    def _fail(self, message: str) -> None:
        self._errors.append(message)

    def _raise_new(self) -> None:
        if len(self._errors) > self._reported:
            new = self._errors[self._reported :]
            self._reported = len(self._errors)
            raise StrictStreamsError("; ".join(new))

    def check(self) -> None:
        """Land and finish everything, then raise the errors not raised yet (for a test's teardown; every
        error ever recorded stays in :attr:`errors`)."""
        with self._lock:
            self._finish(list(self._in_flight))
            for buffer in self._buffers.values():
                buffer.readers.clear()
            self._raise_new()

    # -- what a device is -----------------------------------------------------------------------------

    def is_host(self, device: torch.device) -> bool:
        return device.type != self.device_type and device.type == "cpu"

    def has_streams(self, device: torch.device) -> bool:
        return device.type == self.device_type

    def can_pin(self, device: torch.device) -> bool:
        return self.has_streams(device)

    def can_register_host(self, device: torch.device) -> bool:
        return self.has_streams(device)

    # -- streams and events ------------------------------------------------------------------------------

    def entered(self) -> list[FakeStream]:
        """The streams this thread is inside the ``with`` block of, innermost last (a stream enters and leaves
        itself here)."""
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _current(self) -> FakeStream:
        stack = self.entered()
        return stack[-1] if stack else self.compute

    def _label(self) -> str:
        return getattr(self._local, "label", None) or "<no group>"

    def new_stream(self, device: torch.device) -> FakeStream:
        with self._lock:
            self._side += 1
            return FakeStream(self, f"side{self._side}")

    def current_stream(self, device: torch.device) -> FakeStream:
        return self._current()

    def on(self, stream: FakeStream | None) -> contextlib.AbstractContextManager:
        if stream is not None and not isinstance(stream, FakeStream):
            raise StrictStreamsError(f"{stream!r} is not a stream of the strict model")
        return contextlib.nullcontext() if stream is None else stream

    def new_event(self, device: torch.device, *, timing: bool = False) -> FakeEvent:
        return FakeEvent(timing)

    def record(self, event: FakeEvent, stream: FakeStream | None = None) -> None:
        with self._lock:
            self._raise_new()
            event.stream = stream if stream is not None else self._current()
            event.position = event.stream.issued
            event.time = time.perf_counter()
            event.label = self._label()

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        with self._lock:
            self._raise_new()
            self.counts["waits"] += 1
            if event.stream is None:
                return  # an unrecorded event: nothing to wait for (as on CUDA)
            if stream is self.compute:
                # it lands everything the event covers, and goes on to read what the event was recorded for
                for copy in self._land(self._covered(event)):
                    buffer = copy.dst_buffer
                    if buffer is not None and buffer.stream is not stream and buffer.label == event.label:
                        buffer.readers.add(stream)
            else:
                stream.waits.append((stream.issued, event))

    def done(self, event: FakeEvent) -> bool:
        with self._lock:
            self._raise_new()
            return event.stream is None or not self._covered(event)

    def wait_host(self, event: FakeEvent) -> None:
        with self._lock:
            self._raise_new()
            self.counts["host_waits"] += 1
            if event.stream is not None:
                self._finish(self._covered(event))
            self._raise_new()

    def elapsed(self, start: FakeEvent, end: FakeEvent) -> float:
        return max(end.time - start.time, 0.0)

    def synchronize(self, device: torch.device) -> None:
        with self._lock:
            self._raise_new()
            self.counts["synchronizes"] += 1
            self._finish(list(self._in_flight))
            for buffer in self._buffers.values():
                buffer.readers.clear()
            self._raise_new()

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        with self._lock:
            self._raise_new()
            self.counts["record_streams"] += 1
            storage = tensor.untyped_storage()
            buffer = self._buffers.get(storage.data_ptr())
            if buffer is None and storage.nbytes():
                self._fail(f"record_stream() on a tensor that is not a device buffer ({tuple(tensor.shape)})")
                self._raise_new()
            if buffer is not None:
                buffer.recorded.add(stream)

    @contextlib.contextmanager
    def label(self, name: str) -> Iterator[None]:
        previous = getattr(self._local, "label", None)
        self._local.label = name
        try:
            yield
        finally:
            self._local.label = previous

    # -- memory ------------------------------------------------------------------------------------------

    def _device_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return tensor  # nothing to guard (and no address of its own)
        storage.fill_(SENTINEL)
        key = storage.data_ptr()
        buffer = Buffer(storage.nbytes(), self._current(), self._label())
        self._buffers[key] = buffer
        self.capacity.made(buffer.nbytes)
        weakref.finalize(storage, self._freed, key, buffer)
        return tensor

    def empty(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with self._lock:
            self._raise_new()
            self.capacity.allocate(torch.Size(shape).numel() * dtype.itemsize)
            return self._device_buffer(torch.empty(shape, dtype=dtype))

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            self._raise_new()
            tensor = torch.empty(nbytes, dtype=torch.uint8)
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            pinned = Pinned(nbytes, self._label())
            self._pinned[key] = pinned
            weakref.finalize(storage, self._unpinned, key, pinned)
            return tensor

    def register_host(self, tensor: torch.Tensor, *, read_only: bool = False) -> None:
        """Guard ``tensor``'s memory as page-locked until :meth:`unregister_host`. As the driver does, fault its pages
        in and refuse memory already registered; unlike it, an error also names memory freed (unmapped) while still
        registered."""
        with self._lock:
            self._raise_new()
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self._pinned:
                raise RuntimeError(f"cudaHostRegister of {storage.nbytes()} bytes failed: already registered")
            pinned = Pinned(tensor.numel() * tensor.element_size(), self._label(), read_only)  # what the driver locks
            # the driver faults every page in and locks it: read one byte of each, so the pages are resident here too
            torch.empty(0, dtype=torch.uint8).set_(storage)[:: mmap.PAGESIZE].max() if storage.nbytes() else None
            self._pinned[key] = pinned
            self.counts["registered"] += 1
            weakref.finalize(storage, self._released_registered, key, pinned)

    def unregister_host(self, tensor: torch.Tensor) -> None:
        with self._lock:
            key = tensor.untyped_storage().data_ptr()
            pinned = self._pinned.get(key)
            if pinned is None:
                raise RuntimeError("cudaHostUnregister failed: memory not registered")
            self._unpinned(key, pinned)

    def _released_registered(self, key: int, pinned: Pinned) -> None:
        with self._lock:
            if self._pinned.get(key) is pinned:
                self._fail(
                    f"group {pinned.label!r}: {pinned.nbytes} bytes of host memory were freed while still "
                    f"registered (page-locked): unregister_host() comes first"
                )
                del self._pinned[key]

    @property
    def pinned_bytes(self) -> int:
        """Bytes of host memory page-locked now (allocated so, or registered)."""
        return sum(pinned.nbytes for pinned in self._pinned.values())

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        return self.capacity.free, self.capacity.total

    def free_memory(self, device: torch.device) -> int:
        return self.memory_info(device)[0]  # no allocator cache here: a freed buffer is free at once

    # -- copies ------------------------------------------------------------------------------------------

    def to_device(self, tensor: torch.Tensor, device: torch.device, *, non_blocking: bool = False) -> torch.Tensor:
        if not self.has_streams(device):
            return tensor.to(device, non_blocking=non_blocking)
        with self._lock:
            self._raise_new()
            self.capacity.allocate(tensor.nbytes)  # what empty_like takes
            dst = self._device_buffer(torch.empty_like(tensor, memory_format=torch.preserve_format))
            self._issue(dst, tensor, non_blocking)
            return dst

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        with self._lock:
            self._raise_new()
            self.counts["to_host"] += 1
            self._finish([c for c in self._in_flight if c.stream is self._current()])  # a blocking copy
            return tensor.detach().clone()

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
        with self._lock:
            self._raise_new()
            self._issue(dst, src, non_blocking)

    def _issue(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        stream = self._current()
        stream.issued += 1
        value = torch.empty_like(dst)
        value.copy_(src)  # what the copy will write, from the source as it is now
        dst_storage = dst.untyped_storage()
        copy = Copy(
            stream,
            stream.issued,
            self._label(),
            weakref.ref(dst_storage),
            geometry_of(dst),
            value,
            self._buffers.get(dst_storage.data_ptr()),
        )
        src_storage = src.untyped_storage() if src.device.type == "cpu" else None
        pinned = self._pinned.get(src_storage.data_ptr()) if src_storage is not None else None
        if pinned is not None and non_blocking:  # read by DMA later: must stay as it is until finished
            copy.src_storage, copy.src_geometry, copy.src_pinned = weakref.ref(src_storage), geometry_of(src), pinned
            # a read-only mapping cannot change under the copy by anything this process does (and, its file cut
            # short by another, reading it again would fault): only its release is guarded
            copy.src_content = None if pinned.read_only else src.clone()
            self.counts["pinned_copies"] += 1
        self.counts["copies"] += 1
        self._in_flight[copy] = None
        if not non_blocking:
            self._finish([c for c in self._in_flight if c.stream is stream])
        elif stream is self.compute:
            self._land([copy])  # ordered before the compute that follows on this stream
        else:
            self.counts["async_copies"] += 1

    # -- landing and finishing ---------------------------------------------------------------------------

    def _covered(self, event: FakeEvent) -> list[Copy]:
        """Copies in flight that ``event`` covers: on its stream up to it, and what that stream waited for."""
        streams: dict[FakeStream, int] = {}
        todo = [(event.stream, event.position)]
        while todo:
            stream, position = todo.pop()
            if streams.get(stream, -1) >= position:
                continue
            streams[stream] = position
            todo += [(e.stream, e.position) for at, e in stream.waits if at <= position and e.stream is not None]
        return [c for c in self._in_flight if c.position <= streams.get(c.stream, -1)]

    def _land(self, copies: list[Copy]) -> list[Copy]:
        """Write what these copies carry into their destinations, interleaving streams at random."""
        queues: dict[FakeStream, list[Copy]] = {}
        for copy in copies:
            if not copy.landed:
                queues.setdefault(copy.stream, []).append(copy)
        landed = []
        while queues:
            stream = self._rng.choice(list(queues))
            copy = queues[stream].pop(0)
            if not queues[stream]:
                del queues[stream]
            storage = copy.dst_storage()
            if storage is not None:
                view_of(storage, copy.dst_geometry).copy_(copy.value)
            copy.landed = True
            landed.append(copy)
            if copy.settled():
                self._in_flight.pop(copy, None)
        return landed

    def _finish(self, copies: list[Copy]) -> None:
        """The host learns these copies finished: land them, and check the page-locked memory they read."""
        self._land(copies)
        for copy in copies:
            if copy.src_pinned is not None:
                storage = copy.src_storage()
                if (
                    storage is not None
                    and copy.src_content is not None
                    and not torch.equal(view_of(storage, copy.src_geometry), copy.src_content)
                ):
                    self._fail(
                        f"group {copy.label!r}: a page-locked host buffer was overwritten while a copy from it on "
                        f"stream {copy.stream.name} was in flight (no wait_host/synchronize before reusing it)"
                    )
        for copy in copies:
            self._in_flight.pop(copy, None)

    # -- releases ----------------------------------------------------------------------------------------

    def _freed(self, key: int, buffer: Buffer) -> None:
        with self._lock:
            if self._buffers.get(key) is buffer:
                del self._buffers[key]
                self.capacity.freed(buffer.nbytes)
            risks = {c.stream for c in self._in_flight if c.dst_buffer is buffer and c.stream is not buffer.stream}
            risks |= buffer.readers
            for stream in sorted(risks - buffer.recorded, key=lambda s: s.name):
                self._fail(
                    f"group {buffer.label!r}: a device buffer of {buffer.nbytes} bytes allocated on stream "
                    f"{buffer.stream.name} was released while stream {stream.name} may still use it, without "
                    f"record_stream() for that stream or a synchronisation: its memory could be reused too early"
                )

    def _unpinned(self, key: int, pinned: Pinned) -> None:
        with self._lock:
            if self._pinned.get(key) is pinned:
                del self._pinned[key]
            for copy in self._in_flight:
                if copy.src_pinned is pinned:
                    self._fail(
                        f"group {copy.label!r}: a page-locked host buffer of {pinned.nbytes} bytes was released "
                        f"while a copy from it on stream {copy.stream.name} was in flight"
                    )
                    copy.src_pinned = None
