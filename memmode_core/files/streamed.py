"""A safetensors file written one piece at a time, then mapped: converted weights that never sit in RAM.

Loading straight into a mode converts what the checkpoint does not hold as the mode needs it (another
dtype, or packed by a quantizer). Converting everything first would hold the converted model in memory,
which is the wall the loader exists to remove. Instead the layout is fixed from shapes and dtypes alone
(a quantizer's packed shapes never depend on the data), the file is sized, and each piece — one layer's
tensors — is computed, written at its offset with ``pwrite`` and dropped before the next. Peak memory is
one piece.

The file is unlinked as soon as it is created and written through its descriptor, then mapped
privately (in windows, as checkpoints are: :class:`~memmode_core.files.mapping.Windows`): the mapping keeps
its pages readable (and evictable, unlike anonymous memory) for as long as a tensor views it, and nothing
is ever left on disk — not even if the process is killed while writing.

Nameless, such a file is on disk all the same until its last mapping goes: each mapped window knows its file
(:class:`WrittenFile`, found from any tensor lying in it by :func:`written_file_of`), so that a file storage keeping
groups there counts it on disk (``report().storage_bytes["staged_bytes"]``).

Room is checked before a byte is written (:func:`check_room`): the sizes are known from the layout, and
finding a full disk half-way through a 57 GB conversion would cost the time of writing it. A write that
fails anyway (the disk filled up meanwhile, a file-size limit, an I/O error) is a :class:`StagingError`
naming the file, raised after the partial file is deleted.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from memmode_core.contracts.errors import StagingError
from memmode_core.contracts.storage import Tensors
from memmode_core.contracts.units import format_bytes
from memmode_core.files.file_layout import FileLayout, byte_view, host_tensors
from memmode_core.files.mapping import Windows, map_private_fd_kept


def staging_folder(folder: str | os.PathLike | None) -> Path:
    """Where a streamed file goes: ``folder``, else the system's temporary folder (as ``mkstemp`` picks)."""
    return Path(folder) if folder is not None else Path(tempfile.gettempdir())


def check_room(folder: str | os.PathLike | None, needed: int, what: str) -> None:
    """Refuse, before anything is written, ``needed`` bytes of streamed files that ``folder`` has no room for."""
    where = staging_folder(folder)
    if needed <= 0:
        return
    try:
        free = shutil.disk_usage(where).free
    except OSError as exc:
        raise StagingError(
            f"cannot use {where} for staging files ({exc.strerror or exc})", folder=str(where), needed=needed
        ) from None
    if free < needed:
        raise StagingError(
            f"{what} needs {format_bytes(needed)} ({needed} bytes) of staging files in {where}, which has "
            f"{format_bytes(free)} ({free} bytes) free; nothing was written. Pass staging_dir= on a disk with room",
            folder=str(where),
            needed=needed,
            free=free,
        )


class StreamedFile:
    """Write ``specs`` (name -> meta or real tensor giving dtype and shape) piece by piece, then map."""

    def __init__(
        self,
        specs: Mapping[str, torch.Tensor],
        folder: str | os.PathLike | None = None,
        metadata: dict[str, str] | None = None,
        keep_as: str | os.PathLike | None = None,
        into: tuple[int, str] | None = None,
    ) -> None:
        """``keep_as``: the file is renamed there when finished (and ``fsync``-ed first), instead of being nameless
        from the start. ``into``: an open temporary file ``(fd, path)`` to write, which :meth:`finish` leaves at its
        path for the caller to rename (:mod:`memmode_core.files.made_once`); deleted if abandoned."""
        self.layout = FileLayout.of(dict(specs), metadata)
        self._entries = {e.name: e for e in self.layout.entries}
        self._written: set[str] = set()
        self.keep_as = Path(keep_as) if keep_as is not None else None
        self.path: Path | None = None
        self._fd = -1
        self.folder = self.keep_as.parent if self.keep_as is not None else staging_folder(folder)
        #: the file's name while it had one (for messages: a streamed file is unlinked at once)
        self.name = str(self.folder / "memmode-loading-*.safetensors")
        try:
            if into is not None:
                fd, name = into
                self.folder = Path(name).parent
            elif self.keep_as is not None:
                self.keep_as.parent.mkdir(parents=True, exist_ok=True)
                fd, name = tempfile.mkstemp(prefix=".memmode-", suffix=".partial", dir=self.keep_as.parent)
            else:
                fd, name = tempfile.mkstemp(prefix="memmode-loading-", suffix=".safetensors", dir=folder)
            self.path, self._fd, self.name = Path(name), fd, name
            if self.keep_as is None and into is None:  # nameless from the start: a kill -9 leaves nothing behind
                os.unlink(name)
                self.path = None
            os.ftruncate(fd, self.layout.file_size)  # alignment gaps read back as zeros
            os.pwrite(fd, self.layout.header, 0)
        except OSError as exc:
            self.abandon()
            raise self._failed(exc) from None
        except BaseException:
            self.abandon()
            raise

    def _failed(self, exc: OSError) -> StagingError:
        """The typed error for a failed write (the partial file is deleted already)."""
        return StagingError(
            f"cannot write {self.name} ({format_bytes(self.layout.file_size)}, in {self.folder}): "
            f"{exc.strerror or exc}; the partial file was deleted",
            folder=str(self.folder),
            path=self.name,
            needed=self.layout.file_size,
        )

    def write(self, tensors: Tensors) -> None:
        """Write one piece (a subset of the names) at its place in the file."""
        for name, tensor in host_tensors(tensors).items():
            entry = self._entries[name]
            if (tensor.dtype, tuple(tensor.shape)) != (entry.dtype, tuple(entry.shape)):
                raise ValueError(
                    f"{name}: got a {tuple(tensor.shape)} {tensor.dtype} tensor, the layout has "
                    f"{tuple(entry.shape)} {entry.dtype}"
                )
            data, offset = byte_view(tensor), self.layout.data_start + entry.start
            done = 0
            try:
                while done < len(data):
                    done += os.pwrite(self._fd, data[done:], offset + done)
            except OSError as exc:
                self.abandon()
                raise self._failed(exc) from None
            self._written.add(name)

    def finish(self) -> MappedTensors:
        """Every tensor, as views of the file mapped privately; the file is unlinked (or renamed to
        ``keep_as``)."""
        missing = set(self._entries) - self._written
        if missing:
            self.abandon()
            raise ValueError(f"{len(missing)} tensors were never written (e.g. {sorted(missing)[0]})")
        try:
            if self.keep_as is not None:
                os.fsync(self._fd)
            fd = self._fd
            mapped = mapped_tensors(self.layout, lambda offset, length: map_private_fd_kept(fd, offset, length))
            os.close(self._fd)
            self._fd = -1
            if self.keep_as is not None:
                os.replace(self.path, self.keep_as)
                self.path = self.keep_as
        except OSError as exc:
            self.abandon()
            raise self._failed(exc) from None
        except BaseException:
            self.abandon()
            raise
        return mapped

    def abandon(self) -> None:
        """Close and delete the partial file. Idempotent."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
        if self.path is not None and self.path != self.keep_as:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


class WrittenFile:
    """A file memmode wrote and mapped (a streamed file of packed layers or converted weights, or one the ranks of
    a machine made once), while its windows are mapped: ``size`` bytes on disk (an unlinked file stays there
    until its last mapping goes, whatever holds it: a group a storage keeps in place, or one tensor viewing it).
    :func:`written_file_of` finds it from any tensor lying in it."""

    __slots__ = ("size", "_mappings")

    def __init__(self, size: int) -> None:
        self.size = size
        self._mappings: list[weakref.ref] = []

    @property
    def mapped(self) -> bool:
        """Whether a window of it is still mapped (a tensor still views it)."""
        return any(ref() is not None for ref in self._mappings)

    def _window(self, mapping: mmap.mmap, flat: torch.Tensor) -> None:
        ref = weakref.ref(mapping)
        self._mappings.append(ref)
        start = flat.data_ptr()
        with _windows_lock:
            _prune()
            _WINDOWS.append((start, start + flat.numel(), ref, self))


#: the windows of the files memmode wrote that may still be mapped: (first address, end address, a weak
#: reference to the mapping, the file); a window whose mapping is gone is pruned (its addresses may be reused)
_WINDOWS: list[tuple[int, int, weakref.ref, WrittenFile]] = []
_windows_lock = threading.Lock()


def _prune() -> None:
    _WINDOWS[:] = [w for w in _WINDOWS if w[2]() is not None]


def written_file_of(tensor: torch.Tensor) -> WrittenFile | None:
    """The file memmode wrote (still mapped) whose bytes ``tensor`` views, or None."""
    if tensor.device.type != "cpu" or tensor.is_meta or tensor.numel() == 0:
        return None
    address = tensor.data_ptr()
    with _windows_lock:
        for start, end, ref, written in _WINDOWS:
            if start <= address < end and ref() is not None:
                return written
    return None


def mapped_tensors(layout: FileLayout, map_window) -> MappedTensors:
    """Every tensor of a file memmode wrote, laid out as ``layout``, as views of its windows, each mapped by
    ``map_window(offset, length) -> (mmap, flat)`` (see :class:`~memmode_core.files.mapping.Windows`); the
    windows are those of one :class:`WrittenFile` (what the file takes on disk while they are mapped)."""
    start = layout.data_start
    windows = Windows((start + e.start, start + e.end) for e in layout.entries)
    written = WrittenFile(layout.file_size)

    def window(offset: int, length: int) -> torch.Tensor:
        mapping, flat = map_window(offset, length)
        written._window(mapping, flat)
        return flat

    windows.map_all(window)
    tensors = {}
    for e in layout.entries:
        if e.end == e.start:
            tensors[e.name] = torch.empty(e.shape, dtype=e.dtype)
        else:
            raw = windows.slice(start + e.start, start + e.end, None)
            tensors[e.name] = raw.view(e.dtype).view(e.shape)
    return MappedTensors(tensors, windows.mapped, layout.file_size)


def map_file(path: str | os.PathLike, layout: FileLayout) -> MappedTensors:
    """A finished file laid out as ``layout``, mapped privately as :meth:`StreamedFile.finish` maps one."""
    with open(path, "rb") as file:
        fd = file.fileno()
        return mapped_tensors(layout, lambda offset, length: map_private_fd_kept(fd, offset, length))


class MappedTensors(dict):
    """The tensors of a streamed file (name -> view), and ``flats``: the mapped windows they view."""

    def __init__(self, tensors: Tensors, flats: list[torch.Tensor], file_size: int = 0) -> None:
        super().__init__(tensors)
        self.flats = flats
        #: the file's size: what was written to the staging folder (header and alignment gaps included)
        self.file_size = file_size


def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


_TRIM = _malloc_trim()


def give_back_freed_memory() -> None:
    """Return the C heap's free memory to the system.

    Each piece is computed in temporaries that are freed before the next, but glibc keeps freed heap memory
    for reuse, and after a large free it raises its threshold for serving allocations from fresh mappings,
    so the temporaries of later pieces land on the heap and stay counted in the process's memory: measured
    on a 570 MiB model quantized layer by layer, 166 MiB retained after streaming, 0 after a trim.
    """
    if _TRIM is not None:
        _TRIM(0)


def file_size(specs: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """The size of the streamed file ``specs`` lay out: the room :func:`write_pieces` needs."""
    return FileLayout.of(dict(specs), metadata).file_size if specs else 0


def write_pieces(
    specs: Mapping[str, torch.Tensor],
    pieces: Iterable[Tensors],
    *,
    folder=None,
    metadata: dict[str, str] | None = None,
    keep_as=None,
    into: tuple[int, str] | None = None,
) -> MappedTensors:
    """Write every piece of ``pieces`` into a :class:`StreamedFile` laid out from ``specs``; its mapped views."""
    streamed = StreamedFile(specs, folder, metadata, keep_as, into)
    try:
        for piece in pieces:
            streamed.write(piece)
    except BaseException:
        streamed.abandon()
        raise
    finally:
        piece = None
        # once, at the end: the heap reuses its freed memory from piece to piece, and trimming after every
        # piece would only make the next one fault its pages in again
        give_back_freed_memory()
    return streamed.finish()
