"""The bytes of one group file: a safetensors file laid out so that it can be mapped and viewed.

The ``disk`` and ``mmap`` storages keep each offloaded group in one file in the safetensors
format, written by :mod:`memmode_core.files.store`. This module is the format itself, with no
policy: how a group's tensors are laid out, the file's content name, whether a file on disk holds
exactly a group's bytes, and the two ways of getting the tensors back (a private mapping, a read).

Why memmode writes the format itself rather than calling ``safetensors.torch.save_file``:

- the layout is chosen for mapping: tensors are packed by :mod:`memmode_core.contracts.packing` (every
  tensor at a multiple of its own element size) and the header is padded so that the data starts
  on a 64-byte boundary, so a mapping can be viewed as typed tensors without a copy;
- the bytes are written straight from the tensors' memory (``save_file`` first copies every
  tensor into a ``bytes`` object: one extra group in RAM);
- the name and the verification need the exact bytes, header included, computed once.

The files remain ordinary safetensors files: ``safetensors.safe_open`` reads them.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import warnings
from concurrent.futures import Future, wait
from dataclasses import dataclass
from functools import cached_property

import blake3
import torch

from memmode_core.contracts.packing import Entry, pack, packed_size, views
from memmode_core.contracts.storage import Tensors
from memmode_core.files.pools import LazyPool


def _dtype_names() -> dict[torch.dtype, str]:
    """torch dtype -> safetensors dtype name (the names the safetensors specification defines)."""
    names = {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
        torch.complex64: "C64",
    }
    for attr, code in (
        ("float8_e4m3fn", "F8_E4M3"),
        ("float8_e5m2", "F8_E5M2"),
        ("uint16", "U16"),
        ("uint32", "U32"),
        ("uint64", "U64"),
    ):
        if hasattr(torch, attr):  # dtypes that older torch releases lack
            names[getattr(torch, attr)] = code
    return names


DTYPE_NAMES = _dtype_names()
#: where the data starts, and every tensor in it, is aligned to this (see :mod:`memmode_core.contracts.packing`)
DATA_ALIGNMENT = 64
#: names of the zero-filled byte tensors that fill alignment gaps (safetensors allows no holes)
PADDING_PREFIX = "__memmode_padding__."
#: The hash that names files. It runs over every weight at each ``apply`` into a folder, so its speed is part of
#: the time to the first output: against diffusers' ``offload_to_disk_path``, which writes without hashing, it
#: was memmode's whole margin. BLAKE3 (the ``blake3`` package, the reference Rust implementation) is a
#: cryptographic hash like SHA-256 and 3.6x faster per core on the 2-core Xeon of the project's machine, in
#: GB/s on 512 MiB: blake3 5.99, sha256 1.65 (with SHA extensions; the fastest of ``hashlib``'s, see
#: docs/benchmarks.md), xxh3_128 15.6 (not a cryptographic hash: a name could be forged). Its ``update``
#: releases the GIL (two threads: 11.4 GB/s). Its own multi-threaded mode is not used: that is a Rayon pool,
#: whose threads a forked child does not have. A name is never trusted alone anyway: :func:`matches` compares
#: the bytes.
HASH = blake3.blake3
#: hex digits of the digest kept in a file name (128 bits)
NAME_DIGITS = 32
#: A group's bytes are hashed in pieces of this size (each tensor's bytes cut at multiples of it), and the name
#: is the digest of the header and of the pieces' digests in order (a hash list: as collision-resistant as
#: the hash). Pieces of a large group are hashed by a small pool of threads (:data:`_HASHERS`), so that the
#: hash uses more than one core: with SHA-256, hashing the 22 blocks of a 1.9 GiB model took 0.91 s
#: (0.88-1.73) instead of 1.72 s (1.69-1.76) on 2 cores. A piece is large enough that a digest per piece costs
#: nothing next to hashing it.
HASH_PIECE = 4 << 20
#: Pieces go to the hashing pool in tasks of about this many bytes (the small tensors of a block share one):
#: a future per piece made about 700 per 1.9 GiB model, whose allocations set off a full collection of the
#: garbage collector (0.13 s) during ``apply``; a task this size takes about 3 ms to hash.
HASH_TASK = 16 << 20
#: Group files are written in steps of this many bytes. Where the name is computed along the write, each step is
#: hashed just before it is written, by the writing thread: the bytes are in the core's cache when the write
#: copies them. On the project's 2-core machine (ext4, Linux 6.18), two threads writing 2 GB from a buffer took
#: 0.18-0.20 s in steps of 128-256 KiB and 0.19-1.7 s in steps of 1-4 MiB: large writes vary with the kernel's
#: state (diffusers' ``save_file``, which writes each group at once, took 1.0-3.7 s for the same model within
#: one day). The 22 blocks of a 1.9 GiB bf16 checkpoint, written and hashed by two threads (six alternated
#: rounds): 0.42-0.47 s in steps of 128 KiB hashed as written, 0.43-0.56 s in steps of 256 KiB, 0.53-0.62 s
#: copied by the kernel (``copy_file_range``) and hashed behind by a pool.
WRITE_STEP = 128 << 10


class UnsupportedDtypeError(TypeError):
    """A tensor whose dtype the safetensors format has no name for."""


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a group lies in its file, and the exact header bytes."""

    entries: tuple[Entry, ...]
    #: everything before the data: the 8-byte little-endian header length and the padded JSON
    header: bytes

    @property
    def data_start(self) -> int:
        return len(self.header)

    @cached_property
    def data_bytes(self) -> int:
        return packed_size(self.entries)

    @cached_property
    def file_size(self) -> int:  # cached: read at the check before every onload
        return self.data_start + self.data_bytes

    @classmethod
    def of(cls, tensors: Tensors, metadata: dict[str, str] | None = None) -> Layout:
        """The layout of ``tensors`` (only their names, dtypes and shapes are read: meta tensors will do);
        ``metadata`` joins the header's ``__metadata__``."""
        entries = pack(tensors, align=DATA_ALIGNMENT)
        for entry in entries:
            if entry.dtype not in DTYPE_NAMES:
                raise UnsupportedDtypeError(f"{entry.name}: dtype {entry.dtype} cannot be stored in a safetensors file")
        described = {}
        end = 0
        for e in entries:
            if e.start > end:  # safetensors allows no holes: the alignment padding is a named byte tensor
                described[f"{PADDING_PREFIX}{end}"] = {
                    "dtype": "U8",
                    "shape": [e.start - end],
                    "data_offsets": [end, e.start],
                }
            described[e.name] = {
                "dtype": DTYPE_NAMES[e.dtype],
                "shape": list(e.shape),
                "data_offsets": [e.start, e.end],
            }
            end = e.end
        described["__metadata__"] = {**(metadata or {}), "format": "pt", "writer": "memmode"}
        text = json.dumps(described, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % DATA_ALIGNMENT)  # the format allows trailing spaces
        return cls(tuple(entries), struct.pack("<Q", len(text)) + text)


def host_tensors(tensors: Tensors) -> Tensors:
    """The tensors as contiguous CPU tensors whose memory is their plain bytes (a copy only if needed)."""
    out = {}
    for name, tensor in tensors.items():
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        out[name] = t.resolve_conj().resolve_neg().contiguous()
    return out


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy; the tensor must outlive the view."""
    size = tensor.numel() * tensor.element_size()
    if size == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * size).from_address(tensor.data_ptr())).cast("B")


def content_name(layout: Layout, tensors: Tensors) -> str:
    """The file name for these exact bytes: a digest of the header (names, dtypes, shapes) and of the
    digests of the data's pieces (see :data:`HASH_PIECE`), hashed by several threads for a large group."""
    namer = ContentNamer(layout)
    for entry in layout.entries:
        namer.add(byte_view(tensors[entry.name]))
    return namer.name()


class ContentNamer:
    """:func:`content_name` of a group whose tensors' bytes come one at a time, in layout order: handed in
    (:meth:`add`: hashed by the pool for a large group, else here at :meth:`name`), or written to a file and
    hashed along the write (:meth:`write`).

    :meth:`write` hashes each step of :data:`WRITE_STEP` bytes in the writing thread just before writing it.
    A second thread hashing what is written instead, behind the write, cost more: its reads of the weights
    compete with the write for the cores and the memory bus, and a thread reading ahead of the write slowed
    it most (the two threads' page faults on one file mapping contend: 3.0-4.1 s for the 22 blocks of a
    1.9 GiB checkpoint, against 0.93-0.94 s hashed behind and 0.42-0.47 s hashed as written, see
    :data:`WRITE_STEP`).
    """

    def __init__(self, layout: Layout) -> None:
        self._header = layout.header
        self._pooled = layout.data_bytes > HASH_TASK
        #: per task in order: the future of its pieces' digests
        self._tasks: list[Future] = []
        self._pending: list[memoryview] = []
        self._pending_bytes = 0

    def add(self, data: memoryview) -> None:
        """The next tensor's bytes; with the pool they are read after this returns, until :meth:`wait`."""
        self._pending.extend(data[start : start + HASH_PIECE] for start in range(0, len(data), HASH_PIECE))
        self._pending_bytes += len(data)
        if self._pending_bytes >= HASH_TASK:
            self._flush()

    def write(self, file, data: memoryview) -> None:
        """Write the next tensor's bytes to ``file`` in steps of at most :data:`WRITE_STEP` bytes, each hashed
        just before it is written; its pieces' digests are those :meth:`add` would give."""
        self._flush()
        digests = []
        for start in range(0, len(data), HASH_PIECE):
            digest = HASH()
            end = min(start + HASH_PIECE, len(data))
            for at in range(start, end, WRITE_STEP):
                step = data[at : min(at + WRITE_STEP, end)]
                digest.update(step)
                file.write(step)
            digests.append(digest.digest())
        self._tasks.append(_completed(digests))

    def _flush(self) -> None:
        if self._pending:
            pieces = self._pending
            self._tasks.append(_HASHERS.submit(_digests, pieces) if self._pooled else _completed(_digests(pieces)))
            self._pending, self._pending_bytes = [], 0

    def wait(self) -> None:
        """Return once no thread reads what was added (also where a hash failed)."""
        wait(self._tasks)

    def name(self) -> str:
        self._flush()
        self.wait()
        digest = HASH(self._header)
        for task in self._tasks:
            for piece_digest in task.result():
                digest.update(piece_digest)
        return digest.hexdigest()[:NAME_DIGITS]


def _completed(value) -> Future:
    done: Future = Future()
    done.set_result(value)
    return done


def _digests(pieces: list[memoryview]) -> list[bytes]:
    return [_piece_digest(piece) for piece in pieces]


def _piece_digest(piece: memoryview) -> bytes:
    digest = HASH()
    digest.update(piece)  # releases the GIL: the pool's threads hash in parallel
    return digest.digest()


#: the threads that hash the pieces of large groups: as many as there are cores, 2 to 4
_HASHERS = LazyPool("memmode-hash", lambda cores: min(4, max(2, cores)))


def file_digest_name(path: str | os.PathLike, layout: Layout) -> str:
    """The content name of the bytes in the file now (what :func:`content_name` gave when it was
    written), read through a mapping: equal to the file's name unless its content changed."""
    flat = map_readonly(path)
    return content_name(layout, views(flat, layout.entries, layout.data_start))


def write(file, layout: Layout, tensors: Tensors, namer: ContentNamer | None = None) -> None:
    """Write the group to an open binary file, in steps of at most :data:`WRITE_STEP` bytes (buffered writes
    loop until every byte is written); with ``namer``, each step hashed as it is written
    (:meth:`ContentNamer.write`)."""
    file.write(layout.header)
    end = 0
    for entry in layout.entries:
        if entry.start > end:
            file.write(bytes(entry.start - end))  # alignment padding: zeros
        data = byte_view(tensors[entry.name])
        if namer is not None:
            namer.write(file, data)
        else:
            for at in range(0, len(data), WRITE_STEP):
                file.write(data[at : at + WRITE_STEP])
        end = entry.end


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
    mapping = mmap.mmap(fd, length, access=mmap.ACCESS_COPY, offset=offset)
    return torch.frombuffer(mapping, dtype=torch.uint8)


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


def map_private_kept(path: str | os.PathLike) -> tuple[mmap.mmap, torch.Tensor]:
    """:func:`map_private`, with the ``mmap`` object too, for a caller that drops the mapping's pages
    (:func:`drop_pages`) while keeping the mapping."""
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8)


#: ``madvise`` advice that empties a range of a private file mapping: it reads the file again when touched
DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
#: the top byte of a ``/proc/<pid>/pagemap`` entry -> 1 where the page is the process's own memory: present
#: (bit 63) and not a file page (bit 61), or swapped (bit 62); in a private file mapping, a copy-on-write copy
_OWN_PAGE = bytes(int(b & 0x40 != 0 or b & 0xA0 == 0x80) for b in range(256))
_PAGE = mmap.PAGESIZE


class _Pagemap:
    """This process's ``/proc/self/pagemap``, opened on first use (a forked child opens its own: the
    parent's file describes the parent's pages)."""

    fd: int | None = None

    @classmethod
    def open(cls) -> int | None:
        if cls.fd is None:
            try:
                cls.fd = os.open("/proc/self/pagemap", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError:  # not Linux, or /proc not mounted
                return None
        return cls.fd

    @classmethod
    def forget(cls) -> None:
        if cls.fd is not None:
            os.close(cls.fd)
        cls.fd = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_Pagemap.forget)


def page_range(tensor: torch.Tensor) -> tuple[int, int]:
    """Where the ``/proc/self/pagemap`` entries of the pages under ``tensor``'s bytes are: ``(offset, length)``
    in bytes, for :func:`holds_own_pages`."""
    start = tensor.data_ptr()
    first = start // _PAGE
    return first * 8, (-(-(start + tensor.numel() * tensor.element_size()) // _PAGE) - first) * 8


def holds_own_pages(entries_at: tuple[int, int]) -> bool:
    """Whether any of the pages whose entries are at ``entries_at`` (:func:`page_range` of a view of a private
    file mapping) is the process's own memory: a copy-on-write copy of a page it wrote. Pages it only read
    are the page cache's: those are not. One ``pread`` of ``/proc/self/pagemap`` (8 bytes per page); True
    where that cannot be read. Runs at every offload of a ``disk`` group on a CPU: kept to one call."""
    fd = _Pagemap.fd if _Pagemap.fd is not None else _Pagemap.open()
    if fd is None:
        return True
    offset, length = entries_at
    try:
        entries = os.pread(fd, length, offset)
    except OSError:
        return True
    return len(entries) != length or b"\x01" in entries[7::8].translate(_OWN_PAGE)


def drop_pages(mapping: mmap.mmap) -> bool:
    """Take every page of a private file mapping out of the process (``MADV_DONTNEED``): pages it only read
    go back to being the page cache's alone, pages it wrote (copy-on-write copies) are discarded, and the
    next access reads the file again, exactly as a fresh mapping would. False where the system cannot."""
    if DONTNEED is None:
        return False
    try:
        mapping.madvise(DONTNEED)
    except (OSError, ValueError):
        return False
    return True


def read(path: str | os.PathLike, layout: Layout) -> Tensors:
    """The group read into fresh memory (one allocation, one pass over the file)."""
    buffer = torch.empty(layout.data_bytes, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as file:
        read_into(file.fileno(), byte_view(buffer), layout.data_start)
    return views(buffer, layout.entries)


def read_into(fd: int, target: memoryview, offset: int) -> None:
    """Fill ``target`` from the file at ``offset``; a short file is an error, never zeros."""
    done = 0
    while done < len(target):
        got = os.preadv(fd, [target[done:]], offset + done)
        if got == 0:
            raise OSError(f"group file ended {len(target) - done} bytes early (truncated while in use?)")
        done += got


def matches(path: str | os.PathLike, layout: Layout, tensors: Tensors) -> bool:
    """Whether the file holds exactly this group: its size, its header and every data byte.

    The name already is a digest of the content, so a mismatch means a file that was truncated, or
    another file put under this name (copied, restored from elsewhere, damaged): comparing the
    bytes, not trusting the name, is what keeps such a file from being read back as the weights.
    """
    try:
        if os.stat(path).st_size != layout.file_size:
            return False
        flat = map_readonly(path)
    except (OSError, ValueError):  # missing, unreadable, or empty (mmap refuses a zero-length file)
        return False
    if byte_view(flat[: layout.data_start]).tobytes() != layout.header:
        return False
    on_disk = views(flat, layout.entries, layout.data_start)
    return all(_same_bytes(on_disk[e.name], tensors[e.name]) for e in layout.entries)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (``torch.equal`` on floats would call NaN unequal to itself), on the widest
    integer view the alignment allows: int64 compares run several times faster than uint8."""
    a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    if a.numel() % 8 == 0 and a.data_ptr() % 8 == 0 and b.data_ptr() % 8 == 0:
        a, b = a.view(torch.int64), b.view(torch.int64)
    return torch.equal(a, b)
