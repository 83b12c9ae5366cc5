"""One stored group's file: where it is, how its bytes are laid out, how it looked when last known right.

Shared by the group-file store (:mod:`memmode_core.files.store`, files memmode writes) and borrowed groups
(:mod:`memmode_core.files.borrowed`, ranges of a checkpoint the loader lent), and read the same way by the
``disk`` and ``mmap`` storages whichever it is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from memmode_core.contracts import packing
from memmode_core.contracts.errors import StorageUnavailableError
from memmode_core.contracts.storage import Tensors
from memmode_core.engine.staging import Fill
from memmode_core.files import format as group_format
from memmode_core.files.format import Layout

FILE_PREFIX = "memmode-"
FILE_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class FileStamp:
    """What ``stat`` says of a file: it changes when the file is truncated, replaced or written."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class GroupFile:
    """One stored group: where its file is, how its bytes are laid out, and how it looked when its
    content was last known to be right."""

    path: Path
    layout: Layout
    stamp: FileStamp | None = None

    def check(self, verify: str = "size") -> None:
        """Raise ``StorageUnavailableError`` naming the file unless it still holds this group's bytes.

        Cheap by default: one ``stat``. A file whose stamp changed is hashed: a peer that rewrote
        the same content (same name, new inode) is accepted, anything else is refused. A short file
        is refused before it is mapped, so reading it can never raise SIGBUS.
        """
        if verify == "none":
            return
        try:
            now = FileStamp.of(self.path)
        except OSError as exc:
            raise self._broken(f"it cannot be read ({exc.strerror or exc})") from None
        if now.size != self.layout.file_size:
            raise self._broken(
                f"it is {now.size} bytes long and the group needs {self.layout.file_size} (truncated or replaced)"
            )
        if now == self.stamp and verify != "hash":
            return
        try:
            intact = (
                group_format.file_digest_name(self.path, self.layout)
                == self.path.name[len(FILE_PREFIX) : -len(FILE_SUFFIX)]
            )
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
        """The file mapped privately (see :func:`~memmode_core.files.format.map_private`): its bytes as
        one flat ``uint8`` tensor, and typed views of every tensor in it. Nothing is copied."""
        flat = group_format.map_private(self.path)
        return flat, packing.views(flat, self.layout.entries, self.layout.data_start)

    def read(self) -> Tensors:
        """The group read into fresh, ordinary memory."""
        return group_format.read(self.path, self.layout)

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
                group_format.read_into(fd, group_format.byte_view(chunk), start + offset)

            yield fill
