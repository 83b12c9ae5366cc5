"""One stored group's file: where it is, how its bytes are laid out, how it looked when last known right.

Shared by the group-file store (:mod:`memmode_core.files.store`, files memmode writes) and borrowed groups
(:mod:`memmode_core.files.borrowed`, ranges of a checkpoint the loader lent), and read the same way by the
``disk`` and ``mmap`` storages whichever it is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from memmode_core.contracts import packing
from memmode_core.contracts.errors import StorageUnavailableError
from memmode_core.contracts.storage import Tensors
from memmode_core.engine.staging import Fill
from memmode_core.files import readwrite
from memmode_core.files.file_layout import FileLayout, byte_view
from memmode_core.files.mapping import map_private, map_private_kept, map_readonly
from memmode_core.files.naming import file_digest_name
from memmode_core.files.pages import drop_pages, holds_own_pages, page_range

FILE_PREFIX = "memmode-"
FILE_SUFFIX = ".safetensors"


class FileStamp(NamedTuple):
    """What ``stat`` says of a file: it changes when the file is truncated, replaced or written.

    A named tuple rather than a frozen dataclass: it is made and compared before every onload of every
    group (hundreds per call at leaf level), and a tuple is built and compared in C."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path | int) -> FileStamp:
        """The stamp of the file at ``path``, or of an open file descriptor."""
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class GroupFile:
    """One stored group: where its file is, how its bytes are laid out, and how it looked when its
    content was last known to be right."""

    path: Path
    layout: FileLayout
    stamp: FileStamp | None = None
    #: the mapping :meth:`onload_views` keeps between onloads: (the stamp it was made under, the ``mmap``, the
    #: pages it spans, the typed views of its tensors)
    _kept: tuple | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        #: the path as a string, for the ``stat`` before every onload (a ``Path`` converts itself at each call)
        self._where = os.fspath(self.path) if self.path is not None else None

    def place(self, path: Path, stamp: FileStamp) -> None:
        """The file is now at ``path`` (renamed to its content name once written in the background, or the
        equal file found there), as ``stamp`` says."""
        self.path = path
        self._where = os.fspath(path)
        self.stamp = stamp

    def check(self, verify: str = "size") -> None:
        """Raise ``StorageUnavailableError`` naming the file unless it still holds this group's bytes.

        Cheap by default: one ``stat``. A file whose stamp changed is hashed: a peer that rewrote
        the same content (same name, new inode) is accepted, anything else is refused. A short file
        is refused before it is mapped, so reading it can never raise SIGBUS.
        """
        if verify == "none":
            return
        try:
            st = os.stat(self._where)
        except OSError as exc:
            raise self._broken(f"it cannot be read ({exc.strerror or exc})") from None
        stamp = self.stamp
        if (  # the common case, field by field: no stamp is built (this runs hundreds of times per call)
            stamp is not None
            and st.st_mtime_ns == stamp.mtime_ns
            and st.st_ino == stamp.inode
            and st.st_size == stamp.size
            and st.st_dev == stamp.device
            and verify != "hash"
        ):
            return
        if st.st_size != self.layout.file_size:
            raise self._broken(
                f"it is {st.st_size} bytes long and the group needs {self.layout.file_size} (truncated or replaced)"
            )
        now = FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        try:
            intact = file_digest_name(self.path, self.layout) == self.path.name[len(FILE_PREFIX) : -len(FILE_SUFFIX)]
        except (OSError, ValueError) as exc:
            raise self._broken(f"it cannot be read ({exc})") from None
        if not intact:
            raise self._broken(
                "its content no longer matches its name (modified in place, or another file put in its place)"
            )
        self.stamp = now

    def _broken(self, why: str) -> StorageUnavailableError:
        return StorageUnavailableError(f"group file {self.path} is not the one memmode wrote: {why}")

    def map(self) -> tuple[torch.Tensor, Tensors]:
        """The file mapped privately (see :func:`~memmode_core.files.mapping.map_private`): its bytes as
        one flat ``uint8`` tensor, and typed views of every tensor in it. Nothing is copied."""
        flat = map_private(self.path)
        return flat, packing.views(flat, self.layout.entries, self.layout.data_start)

    def map_shared(self) -> tuple[torch.Tensor, Tensors]:
        """The file mapped shared and read-only (see :func:`~memmode_core.files.mapping.map_readonly`): the page
        cache's own pages, which every process mapping the file shares and which stay one copy when page-locked
        for reading (a private mapping locked for writing would get a copy of its own). Writing into a view
        faults: hand out copies of what a caller may change."""
        flat = map_readonly(self.path)
        return flat, packing.views(flat, self.layout.entries, self.layout.data_start)

    def onload_views(self) -> Tensors:
        """The group's tensors as views of a private mapping of its file, for an onload computed on the CPU
        (``disk``); :meth:`release` when the group goes back to rest.

        Opening, mapping and viewing the file anew at every onload, then unmapping it and faulting its
        pages in again at the next, cost more than a small layer's forward (at leaf level: tens of
        microseconds per group, hundreds of groups per call). So the mapping is kept, and it reads exactly
        what a new mapping would: it is reused only while the file's stamp (device, inode, size,
        modification time) is the one :meth:`check` last accepted, and :meth:`check` runs before every
        onload; a file replaced under the same name (a new inode) is mapped anew once accepted; a
        truncated, deleted or changed file is refused by :meth:`check` before this is called; and a page
        the process only read is the page cache's own page, so a write into the file shows in it as it
        would in a fresh mapping. Under ``verify="none"`` nothing is checked, and the first mapping (of the
        file as it was then) is kept.
        """
        kept = self._kept
        if kept is None or kept[0] != self.stamp:
            mapping, flat = map_private_kept(self.path)
            views = packing.views(flat, self.layout.entries, self.layout.data_start)
            kept = self._kept = (self.stamp, mapping, page_range(flat), views)
        return dict(kept[3])

    def release(self, *, intact: bool = True) -> None:
        """The group went back to rest (see :meth:`onload_views`).

        The parameters hold placeholders again; what the kept mapping may still map is pages of the page
        cache, which it holds whether or not they are mapped (clean file pages: shared with every reader,
        reclaimed by the kernel under pressure like any other, counted in ``RssFile``, never in
        ``RssAnon``). Emptying the mapping at every offload (``MADV_DONTNEED``) and faulting the pages in
        at the next onload cost more than the bookkeeping of a leaf-level group. What must not outlive the
        onload is memory of the process's own: a copy-on-write copy of a page written while the group was
        onloaded (an in-place edit of a resident weight, which the file does not have). One read of
        ``/proc/self/pagemap`` finds any (:func:`~memmode_core.files.pages.holds_own_pages`), and then the
        mapping is emptied, so the edit is dropped as it was with a mapping per onload.

        With ``intact=False`` a tensor of the mapping stays in use (the model kept it in place of the one
        memmode put there): the mapping is forgotten, not emptied, as a mapping made per onload would be;
        so too where the system cannot empty it.
        """
        kept = self._kept
        if kept is None:
            return
        if not intact or (holds_own_pages(kept[2]) and not drop_pages(kept[1])):
            self._kept = None

    def read(self) -> Tensors:
        """The group read into fresh, ordinary memory."""
        return readwrite.read(self.path, self.layout)

    def mapped_filler(self, flat: torch.Tensor) -> Fill:
        """A ``fill(chunk, offset)`` for staged uploads copying the group's bytes from ``flat``, the file
        mapped by :meth:`map`."""
        start = self.layout.data_start

        def fill(chunk: torch.Tensor, offset: int) -> None:
            chunk.copy_(flat[start + offset : start + offset + chunk.numel()])

        return fill

    @contextlib.contextmanager
    def filler(self) -> Iterator[Fill]:
        """A ``fill(chunk, offset)`` for staged uploads: the group's bytes read straight from the file."""
        start = self.layout.data_start
        with open(self.path, "rb", buffering=0) as file:
            fd = file.fileno()

            def fill(chunk: torch.Tensor, offset: int) -> None:
                readwrite.read_into(fd, byte_view(chunk), start + offset)

            yield fill
