"""Groups stored by reference: the checkpoint's own pages are the offloaded copy, nothing is written.

When a pipeline is loaded straight into a file storage (``memmode.load(..., storage="mmap" | "disk")``),
its weights are already views of safetensors files mapped privately. Writing them again into group files
would cost the model's size in disk writes and time before the first output, for a second copy of bytes
that already sit in a file the page cache serves. So the loader *lends* those mappings to the storage
for the length of ``apply`` (:func:`lending`), and a group whose tensors all lie in one lent mapping is
stored as a :class:`BorrowedFile`: a :class:`~memmode_core.files.groupfile.GroupFile` whose bytes are ranges
of the checkpoint. The storage reads it back as it reads its own files (mapped, or copied range by range
into staging buffers), never deletes it, and counts no disk bytes for it.

A tensor is borrowed only where that cannot change a bit of any output:

- the compute device is not the CPU (every onload copies into fresh device memory), or
- it starts on a 64-byte boundary of the file, as in memmode's own group files. CPU kernels can take
  another path for a weight at another alignment (a GEMV on a weight 24 bytes off a cache line sums in
  another order). Safetensors files written by other tools align tensors to 8 bytes only; files memmode
  wrote (quantized checkpoints, streamed conversions) align them to 64; or
- it is a part of a packed layer (its payload, its scales), which the lender names: nothing computes on it but
  the codec's decode, element by element into a fresh tensor, and an elementwise kernel gives each element
  the same bits wherever it lies. A GGUF file aligns its tensors to 32 bytes: its blocks are borrowed, and a
  15 GB file is not written again.

The other tensors of a group (misaligned on a CPU device, or in no lent mapping at all, like buffers
``__init__`` computes) are kept as copies of its own, when they are a small part of it (the float32 norms
next to a group's streamed bfloat16 weights); otherwise the group is written to the storage's files as usual
(a checkpoint from ``save_pretrained`` in the dtype it is computed in, on a CPU device).
``load(..., in_place=True)`` borrows at any alignment.

A borrowed checkpoint file that changes (replaced, truncated, rewritten: its inode, size or mtime
differ) is refused at the next onload, naming it, before any byte is read. Mappings of files that were
unlinked as soon as mapped (streamed conversions) cannot change.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from memmode_core.contracts.errors import StorageUnavailableError
from memmode_core.contracts.storage import Tensors
from memmode_core.engine.staging import Fill
from memmode_core.engine.streams import active
from memmode_core.files.file_layout import DATA_ALIGNMENT, FileLayout
from memmode_core.files.groupfile import FileStamp, GroupFile


@dataclass(eq=False)
class Source:
    """One private mapping lent to the storages: the whole file as ``uint8``, and the file if it has a name."""

    flat: torch.Tensor
    path: Path | None
    stamp: FileStamp | None
    #: borrow tensors at any alignment, on a CPU compute device too (``load(..., in_place=True)``)
    any_alignment: bool = False
    #: where the tensors start (``data_ptr()``) that are borrowed at any alignment because only a decode reads them:
    #: the parts of packed layers
    decoded_only: frozenset[int] = frozenset()

    @property
    def base(self) -> int:
        return self.flat.data_ptr()

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Where ``tensor``'s bytes start in this mapping, if it is a contiguous view of it."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
            return None
        start = tensor.data_ptr() - self.base
        if start < 0 or start + tensor.numel() * tensor.element_size() > self.flat.numel():
            return None
        return start


_lock = threading.Lock()
_lent: list[Source] = []


def lending_now() -> bool:
    """Whether a load is lending mappings right now (a storage may then need far less room than it reserves)."""
    with _lock:
        return bool(_lent)


def source_of_mapping(
    view: torch.Tensor, path: Path | None, *, any_alignment: bool = False, decoded_only: frozenset[int] = frozenset()
) -> Source:
    """The :class:`Source` of the whole mapping ``view`` is a view of (its untyped storage); ``decoded_only``: the
    addresses of the tensors in it that only a decode reads (see :attr:`Source.decoded_only`)."""
    storage = view.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
    return Source(flat, path, FileStamp.of(path) if path is not None else None, any_alignment, decoded_only)


@contextlib.contextmanager
def lending(sources: list[Source]) -> Iterator[None]:
    """Inside, file storages may store groups lying in ``sources`` by reference (see the module docstring)."""
    with _lock:
        _lent.extend(sources)
    try:
        yield
    finally:
        with _lock:
            for source in sources:
                _lent.remove(source)


#: tensors of a borrowed group that lie in no lent mapping (buffers ``__init__`` computed, never saved), or
#: that a CPU would compute on at another alignment (the float32 norms of a bfloat16 checkpoint from
#: save_pretrained), are kept as copies, up to this fraction of the group's bytes; past it the group is
#: written as usual
EXTRAS_FRACTION = 0.125


def borrow(layout: FileLayout, tensors: Tensors, device: torch.device) -> BorrowedFile | None:
    """A :class:`BorrowedFile` for the group if its tensors lie in lent mappings (but for a few small ones
    that lie in none) and borrowing them cannot change a bit (see the module docstring), else None."""
    with _lock:
        lent = list(_lent)
    if not lent or not tensors:
        return None
    places: dict[str, tuple[Source, int]] = {}
    extras: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        found = next(((s, o) for s in lent if (o := s.offset_of(tensor)) is not None), None)
        computes_in_place = active().is_host(device)  # on an accelerator it is copied to fresh memory anyway
        if found is None or (computes_in_place and found[1] % DATA_ALIGNMENT and not _anywhere(found[0], tensor)):
            # in no lent mapping, or where computing on it in place could change bits: a copy of its own
            # (64-byte aligned, as in memmode's group files)
            extras[name] = tensor
        else:
            places[name] = found
    extra_bytes = sum(t.numel() * t.element_size() for t in extras.values())
    if not places or extra_bytes > EXTRAS_FRACTION * layout.data_bytes:
        return None
    return BorrowedFile(layout, places, {name: t.clone() for name, t in extras.items()})


def _anywhere(source: Source, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` may be borrowed from ``source`` at any alignment on a CPU device."""
    return source.any_alignment or tensor.data_ptr() in source.decoded_only


class BorrowedFile(GroupFile):
    """A group whose bytes are ranges of lent mappings (checkpoint files, unlinked streamed files), and a
    few small tensors of its own."""

    def __init__(self, layout: FileLayout, places: dict[str, tuple[Source, int]], extras: Tensors) -> None:
        files = {s.path for s, _ in places.values()}
        super().__init__(next(iter(files)) if len(files) == 1 else None, layout, None)
        #: tensor name -> (the mapping, where its bytes start in it)
        self.places = places
        #: tensor name -> its own copy (tensors in no lent mapping)
        self.extras = extras
        self._sources = list({id(s): s for s, _ in places.values()}.values())
        # the typed views, made once: disk's CPU onload maps the group at every call
        self._typed = dict(extras)
        for entry in layout.entries:
            if entry.name in places:
                source, offset = places[entry.name]
                self._typed[entry.name] = (
                    source.flat[offset : offset + entry.end - entry.start].view(entry.dtype).view(entry.shape)
                )
        self._bytes = {name: view.reshape(-1).view(torch.uint8) for name, view in self._typed.items()}

    def check(self, verify: str = "size") -> None:
        if verify == "none":
            return
        for source in self._sources:
            if source.path is None:
                continue  # unlinked as soon as mapped: nothing can change it
            try:
                now = FileStamp.of(source.path)
            except OSError as exc:
                raise self._changed(source.path, f"it cannot be read ({exc.strerror or exc})") from None
            if now != source.stamp:
                raise self._changed(
                    source.path,
                    "it changed since it was loaded (replaced, truncated or rewritten); load the model again",
                )

    @staticmethod
    def _changed(path: Path, why: str) -> StorageUnavailableError:
        return StorageUnavailableError(
            f"checkpoint file {path}, which holds offloaded weights in place, is not the one memmode loaded: {why}"
        )

    def map(self) -> tuple[torch.Tensor | None, Tensors]:
        """``(None, views)``: the group's tensors as views of the lent mappings (and its own copies)."""
        return None, dict(self._typed)

    def onload_views(self) -> Tensors:
        return dict(self._typed)

    def release(self, *, intact: bool = True) -> None:
        """Nothing to give back: the lent mappings are the loader's, shared by many groups."""

    def read(self) -> Tensors:
        return {name: view.clone() for name, view in self._typed.items()}

    def mapped_filler(self, flat: torch.Tensor | None) -> Fill:
        def fill(chunk: torch.Tensor, offset: int) -> None:
            end = offset + chunk.numel()
            for entry in self.layout.entries:
                lo, hi = max(offset, entry.start), min(end, entry.end)
                if lo < hi:
                    chunk[lo - offset : hi - offset].copy_(self._bytes[entry.name][lo - entry.start : hi - entry.start])

        return fill

    @contextlib.contextmanager
    def filler(self) -> Iterator[Fill]:
        yield self.mapped_filler(None)
