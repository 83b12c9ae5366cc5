"""Group files named by their content: the digest that names a file, and the byte comparison that verifies one.

A group file's name is a digest of its header (the tensors' names, dtypes and shapes) and of every data
byte (:func:`content_name`), so a file left by another model, by another version of this one or by a crash
is never looked up as the current weights, and a second ``apply`` of unchanged weights finds its files and
starts without writing. The digest is computed from the tensors in memory, or along the file's write
(:meth:`ContentNamer.write`), or from a file on disk (:func:`file_digest_name`: a file whose stamp changed
is hashed again before it is read back).

A name is never trusted alone: before a file under a group's name is reused, :func:`matches` compares its
size, its header and every byte with the group in memory, so a truncated file, or another file put under
this name, is never read back as the weights.

Why BLAKE3, hashed in pieces by a small pool of threads, and along the write: see :data:`HASH`,
:data:`HASH_PIECE`, :data:`HASH_TASK` and :class:`ContentNamer`.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, wait

import blake3
import torch

from memmode_core.contracts.packing import views
from memmode_core.contracts.storage import Tensors
from memmode_core.files.file_layout import FileLayout, byte_view
from memmode_core.files.mapping import map_readonly
from memmode_core.files.pools import LazyPool

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


def content_name(layout: FileLayout, tensors: Tensors) -> str:
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

    :meth:`write` hashes each step of the write (:data:`~memmode_core.files.readwrite.WRITE_STEP` bytes) in
    the writing thread just before writing it. A second thread hashing what is written instead, behind the
    write, cost more: its reads of the weights compete with the write for the cores and the memory bus, and
    a thread reading ahead of the write slowed it most (the two threads' page faults on one file mapping
    contend: 3.0-4.1 s for the 22 blocks of a 1.9 GiB checkpoint, against 0.93-0.94 s hashed behind and
    0.42-0.47 s hashed as written, see :data:`~memmode_core.files.readwrite.WRITE_STEP`).
    """

    def __init__(self, layout: FileLayout) -> None:
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

    def write(self, file, data: memoryview, step: int) -> None:
        """Write the next tensor's bytes to ``file`` in steps of at most ``step`` bytes, each hashed just before
        it is written; its pieces' digests are those :meth:`add` would give."""
        self._flush()
        digests = []
        for start in range(0, len(data), HASH_PIECE):
            digest = HASH()
            end = min(start + HASH_PIECE, len(data))
            for at in range(start, end, step):
                chunk = data[at : min(at + step, end)]
                digest.update(chunk)
                file.write(chunk)
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


def file_identity(path: str | os.PathLike) -> tuple:
    """What names a file's content without reading it: its real path, device, inode, size and modification time
    (a file rewritten in place keeps its inode but not its modification time)."""
    st = os.stat(path)
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def file_digest_name(path: str | os.PathLike, layout: FileLayout) -> str:
    """The content name of the bytes in the file now (what :func:`content_name` gave when it was
    written), read through a mapping: equal to the file's name unless its content changed."""
    flat = map_readonly(path)
    return content_name(layout, views(flat, layout.entries, layout.data_start))


def matches(path: str | os.PathLike, layout: FileLayout, tensors: Tensors) -> bool:
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
