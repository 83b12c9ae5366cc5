"""The objects of the strict model of asynchronous copies: the streams and events it hands out, and its records of
the buffers it allocated and the copies in flight.

They are plain records: every rule lives in :class:`~memmode_core.testing.strict_streams.StrictStreams`, which
reads and updates them under its lock; a stream only passes its ``with`` block and ``wait_event`` on to its
model, which it holds weakly.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch


class Model(Protocol):
    """What a stream needs of its model (:class:`~memmode_core.testing.strict_streams.StrictStreams`)."""

    def entered(self) -> list[FakeStream]: ...

    def wait(self, stream: FakeStream, event: FakeEvent) -> None: ...


class FakeStream:
    """A stream of the model: copies issued on it, and the events it waited on, in order."""

    def __init__(self, model: Model, name: str) -> None:
        self._model = weakref.ref(model)
        self.name = name
        #: number of copies issued on it so far (a copy's position; an event covers positions up to its own)
        self.issued = 0
        #: ``(position, event)``: from ``position`` on, work on this stream runs after ``event``
        self.waits: list[tuple[int, FakeEvent]] = []

    def __enter__(self) -> FakeStream:
        self._model().entered().append(self)
        return self

    def __exit__(self, *exc) -> None:
        self._model().entered().pop()

    def wait_event(self, event: FakeEvent) -> None:
        self._model().wait(self, event)

    def __repr__(self) -> str:
        return f"<strict stream {self.name}>"


class FakeEvent:
    def __init__(self, timing: bool) -> None:
        self.timing = timing
        self.stream: FakeStream | None = None
        self.position = 0
        self.time = 0.0
        #: the group it was recorded for (what a stream waiting on it goes on to read)
        self.label = ""

    def __repr__(self) -> str:
        where = f"{self.stream.name}@{self.position}" if self.stream is not None else "unrecorded"
        return f"<strict event {where}>"


@dataclass(eq=False)
class Buffer:
    """A device buffer the model allocated (by the address of its storage)."""

    nbytes: int
    stream: FakeStream
    label: str
    #: streams ``record_stream`` was called for
    recorded: set[FakeStream] = field(default_factory=set)
    #: streams other than its own that were made to wait for a copy into it (they read it)
    readers: set[FakeStream] = field(default_factory=set)


@dataclass(eq=False)
class Pinned:
    """A page-locked host buffer the model allocated, or host memory it registered (``read_only``: a mapping
    the process cannot write, so nothing it does can change it under a copy)."""

    nbytes: int
    label: str
    read_only: bool = False


@dataclass(eq=False)
class Copy:
    """A copy issued and not known to the host as finished: where it lands, what it carries, what it reads."""

    stream: FakeStream
    position: int
    label: str
    #: the destination: its storage (weakly) and the view's geometry, and the bytes it will receive
    dst_storage: weakref.ref
    dst_geometry: tuple
    value: torch.Tensor
    dst_buffer: Buffer | None
    #: a page-locked source, read asynchronously: its storage (weakly), geometry and content at issue
    src_storage: weakref.ref | None = None
    src_geometry: tuple = ()
    src_content: torch.Tensor | None = None
    src_pinned: Pinned | None = None
    landed: bool = False

    def settled(self) -> bool:
        """Landed, and nothing more to check: no page-locked source to guard, no buffer of another stream."""
        buffer = self.dst_buffer
        return self.landed and self.src_pinned is None and (buffer is None or buffer.stream is self.stream)


def geometry_of(t: torch.Tensor) -> tuple:
    """What locates a view in its storage (kept instead of the view, which would keep the storage alive)."""
    return (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())


def view_of(storage: torch.UntypedStorage, geometry: tuple) -> torch.Tensor:
    dtype, shape, stride, offset = geometry
    return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
