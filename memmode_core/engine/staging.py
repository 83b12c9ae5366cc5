"""Copying group bytes that live in pageable memory or in a file to an accelerator, asynchronously.

A copy from pageable host memory to a GPU is synchronous: the driver bounces it through a small
page-locked buffer of its own, one call at a time, and the copy cannot be queued on a stream
behind other work. The ``disk`` and ``mmap`` storages hold their bytes in exactly such memory (a
file, a file mapping), so they upload through a :class:`StagingRing` instead: two page-locked
chunks reused for every upload. The CPU fills one chunk (from the mapping, or straight from the
file) while the DMA engine drains the other into the device tensors, and every device copy is
ordered on the stream the engine gave to ``fetch``, so the engine's event covers them.

The ring is small (``2 x 16 MiB`` by default) and allocated on first use, so a storage that never
uploads to a GPU never pins anything; its page-locked bytes count against the process's budget
(:mod:`~memmode_core.engine.host_pins`), and where the budget has no room left the chunks are ordinary memory (the
copies from them are then synchronous), said once. Every stream, event, copy and allocation goes through
:mod:`~memmode_core.engine.streams`.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator

import torch

from memmode_core.contracts.storage import Tensors
from memmode_core.engine.host_pins import host_pins
from memmode_core.engine.streams import active
from memmode_core.files.file_layout import FileLayout

CHUNK_BYTES = 16 << 20
CHUNKS = 2
logger = logging.getLogger("memmode")

#: ``fill(chunk, offset)``: write the group's data bytes ``[offset, offset + chunk.numel())`` into
#: ``chunk`` (a page-locked ``uint8`` CPU tensor)
Fill = Callable[[torch.Tensor, int], None]


class StagingRing:
    def __init__(self, chunk_bytes: int = CHUNK_BYTES, chunks: int = CHUNKS) -> None:
        self.chunk_bytes = chunk_bytes
        self.count = chunks
        self._chunks: list[torch.Tensor] = []
        #: per chunk: the event recorded after the last device copy that read it
        self._drained: list[torch.Event | None] = []
        self._next = 0
        self.streams = active()
        #: gives the chunks' bytes back to the process's page-locked budget (None: nothing taken)
        self._taken: weakref.finalize | None = None

    @property
    def pinned_bytes(self) -> int:
        return sum(c.numel() for c in self._chunks) if self._taken is not None else 0

    def _allocate(self) -> None:
        """The chunks: page-locked where the process's budget has room for them, else ordinary memory."""
        total = self.chunk_bytes * self.count
        granted = host_pins.take(total)
        if granted == total:
            self._taken = weakref.finalize(self, host_pins.give, total)
            self._chunks = [self.streams.pinned_empty(self.chunk_bytes) for _ in range(self.count)]
        else:
            host_pins.give(granted)
            logger.warning(
                "memmode: the staging buffers of a file storage (%d MiB) are ordinary memory, their copies "
                "synchronous: the process's budget of page-locked memory is reached (%s sets it)",
                total >> 20,
                host_pins.variable,
            )
            self._chunks = [torch.empty(self.chunk_bytes, dtype=torch.uint8) for _ in range(self.count)]
        self._drained = [None] * self.count

    def upload(self, layout: FileLayout, fill: Fill, device: torch.device, stream: torch.Stream | None) -> Tensors:
        """The group's tensors on ``device``, their copies queued on ``stream`` (or the current stream)."""
        streams = self.streams
        if not self._chunks:
            self._allocate()
        stream = stream if stream is not None else streams.current_stream(device)
        with streams.on(stream):  # allocated on, and written by, that stream
            out = {e.name: streams.empty(e.shape, e.dtype, device) for e in layout.entries}
            flat = {name: t.reshape(-1).view(torch.uint8) for name, t in out.items()}
            for begin, end, pieces in chunks_of(layout, self.chunk_bytes):
                chunk = self._take()[: end - begin]
                fill(chunk, begin)
                for name, lo, hi, at in pieces:
                    streams.copy_(flat[name][lo:hi], chunk[at : at + hi - lo], non_blocking=True)
                self._release(stream, device)
        return out

    def _take(self) -> torch.Tensor:
        """The next chunk, once the device has finished reading what it last held."""
        event = self._drained[self._next]
        if event is not None:
            self.streams.wait_host(event)
        return self._chunks[self._next]

    def _release(self, stream: torch.Stream, device: torch.device) -> None:
        event = self.streams.new_event(device)
        self.streams.record(event, stream)
        self._drained[self._next] = event
        self._next = (self._next + 1) % self.count

    def close(self) -> None:
        """Wait for copies still reading the chunks, then let them go."""
        for event in self._drained:
            if event is not None:
                self.streams.wait_host(event)
        self._chunks, self._drained = [], []
        if self._taken is not None:
            self._taken()
            self._taken = None


def chunks_of(layout: FileLayout, chunk_bytes: int) -> Iterator[tuple[int, int, list[tuple[str, int, int, int]]]]:
    """The data section cut into chunks: ``(begin, end, pieces)`` per chunk, where each piece
    ``(name, lo, hi, at)`` copies bytes ``[lo, hi)`` of tensor ``name`` from byte ``at`` of the chunk.
    A tensor larger than a chunk, or straddling two, comes in several pieces."""
    entries = [e for e in layout.entries if e.end > e.start]
    index = 0
    for begin in range(0, layout.data_bytes, chunk_bytes):
        end = min(begin + chunk_bytes, layout.data_bytes)
        pieces = []
        while index < len(entries) and entries[index].start < end:
            entry = entries[index]
            lo, hi = max(entry.start, begin), min(entry.end, end)
            pieces.append((entry.name, lo - entry.start, hi - entry.start, lo - begin))
            if entry.end > end:
                break  # its remaining bytes are in the next chunk
            index += 1
        yield begin, end, pieces
