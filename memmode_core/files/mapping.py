"""Files mapped into memory as flat ``uint8`` tensors: group files, checkpoints and streamed files.

Two kinds of mapping, for two uses:

- **private** (``MAP_PRIVATE``, copy-on-write), for bytes that become weights (:func:`map_private`): reading
  shares the page cache with every other process that maps the file, and an in-place op on a weight copies
  the page into the process instead of reaching the file, so the file can never be corrupted;
- **read-only** (shared, ``PROT_READ``), for code that only reads, a digest or a comparison
  (:func:`map_readonly`): a private writable mapping is charged against the commit limit as memory the
  process may come to own, and Linux's default overcommit refuses one larger than RAM; a read-only one is
  only page cache and has no such limit.

A large file is mapped privately in windows of about :data:`MAP_WINDOW` bytes (:class:`Windows`), each judged
alone by the overcommit heuristic, and each mapped only when a tensor in it is first read. The pages of a
kept private mapping are inspected and dropped by :mod:`memmode_core.files.pages`.
"""

from __future__ import annotations

import mmap
import os
import warnings

import torch


def map_private(path: str | os.PathLike) -> torch.Tensor:
    """The whole file as a flat ``uint8`` tensor backed by a private, copy-on-write mapping.

    Private (``MAP_PRIVATE``) and writable: reading shares the page cache with every other process
    that maps the file, and a write — an in-place op on a weight — copies the page into this
    process instead of reaching the file, so the file can never be corrupted and a write can never
    fault. The tensor keeps the mapping alive; it is unmapped when the last view is freed, and an
    unlinked file stays readable through it.
    """
    with open(path, "rb") as file:
        return map_private_fd(file.fileno())


def map_private_range(path: str | os.PathLike, offset: int, length: int) -> torch.Tensor:
    """:func:`map_private` of ``length`` bytes of the file from ``offset`` (a multiple of the page size)."""
    with open(path, "rb") as file:
        return map_private_fd(file.fileno(), offset, length)


def map_private_fd(fd: int, offset: int = 0, length: int = 0) -> torch.Tensor:
    """:func:`map_private` of an open file descriptor (an unlinked file has no path left to open); with
    ``length``, only ``length`` bytes from ``offset`` (a multiple of the page size)."""
    return map_private_fd_kept(fd, offset, length)[1]


def map_private_fd_kept(fd: int, offset: int = 0, length: int = 0) -> tuple[mmap.mmap, torch.Tensor]:
    """:func:`map_private_fd`, with the ``mmap`` object too: the tensor and every view of it keep it alive, so a
    weak reference to it says whether the mapping is still there (an unlinked file stays on disk until its last
    mapping goes)."""
    mapping = mmap.mmap(fd, length, access=mmap.ACCESS_COPY, offset=offset)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8)


def map_private_kept(path: str | os.PathLike) -> tuple[mmap.mmap, torch.Tensor]:
    """:func:`map_private`, with the ``mmap`` object too, for a caller that drops the mapping's pages
    (:func:`~memmode_core.files.pages.drop_pages`) while keeping the mapping."""
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8)


def map_readonly(path: str | os.PathLike) -> torch.Tensor:
    """The whole file as a flat ``uint8`` tensor backed by a shared, read-only mapping: for reading only.

    A private writable mapping is accounted as memory the process may come to own, so Linux's default
    overcommit refuses one larger than RAM; a read-only one is only page cache and has no such limit.
    Writing into the tensor would fault: only code that reads (a digest, a comparison) may use it.
    """
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():  # torch warns that the buffer is not writable: that is the point
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)


#: the most bytes one private mapping of a large file covers (more when one tensor is larger). A private,
#: writable mapping is charged against the commit limit as a whole when it is made, and Linux's default
#: heuristic overcommit refuses any single one larger than RAM (plus swap): a 28 GB checkpoint in one
#: mapping fails on a 24 GB machine, the same file in 1 GiB windows maps, since each window is judged alone.
MAP_WINDOW = 1 << 30


class Windows:
    """A file's byte ranges (its tensors) mapped privately in windows of about :data:`MAP_WINDOW` bytes.

    Each range lies whole in one window, so a tensor is one view as with a single mapping, at the same
    alignment modulo 64 (windows start on page boundaries). A window is mapped when a range in it is first
    asked for: opening a checkpoint, or reading one tensor far into it, maps only what it reads.
    """

    def __init__(self, ranges, window: int = MAP_WINDOW) -> None:
        page = mmap.ALLOCATIONGRANULARITY
        #: (start, end) of each window, page aligned at the start
        self.spans: list[tuple[int, int]] = []
        self._where: dict[int, int] = {}  # range start -> window index
        for start, end in sorted(r for r in ranges if r[1] > r[0]):
            if not self.spans or end - self.spans[-1][0] > window:
                self.spans.append((start - start % page, end))
            else:
                self.spans[-1] = (self.spans[-1][0], max(self.spans[-1][1], end))
            self._where[start] = len(self.spans) - 1
        self._mapped: list[torch.Tensor | None] = [None] * len(self.spans)

    def slice(self, start: int, end: int, map_window) -> torch.Tensor:
        """Bytes ``[start, end)`` of the file (a range given at construction); its window is mapped first
        with ``map_window(offset, length)`` if it is not mapped yet."""
        index = self._where[start]
        flat = self._mapped[index]
        lo, hi = self.spans[index]
        if flat is None:
            flat = self._mapped[index] = map_window(lo, hi - lo)
        return flat[start - lo : end - lo]

    def map_all(self, map_window) -> None:
        for index, (lo, hi) in enumerate(self.spans):
            if self._mapped[index] is None:
                self._mapped[index] = map_window(lo, hi - lo)

    @property
    def mapped(self) -> list[torch.Tensor]:
        """The windows mapped so far, each as a flat ``uint8`` tensor."""
        return [flat for flat in self._mapped if flat is not None]
