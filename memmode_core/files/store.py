"""Group files: the folder of one-file-per-group that the ``disk`` and ``mmap`` storages share.

Both storages promise the same things about their files, so the mechanics live here once and a
plugin adds only how it reads them back (``disk``: at each onload, for as long as the group is on
the device; ``mmap``: mapped once, for the whole session):

- **Named by content.** A file's name is a digest of its header and bytes
  (:func:`~memmode_core.files.naming.content_name`), so a file left by another model, by another
  version of this one, or by a crash is never looked up as the current weights, and a second
  ``apply`` of unchanged weights finds its files and starts without writing.
- **Verified on reuse.** An existing file is used only if its size, header and every byte equal
  the weights in memory; otherwise it is rewritten (a truncated copy, or another file put under
  this name).
- **Written atomically.** A temporary file in the same folder, then ``os.replace``: the name only ever
  points at a complete file. Files kept past the session (``keep_files=True``) are also ``fsync``-ed, file
  and folder, so that they survive a power cut; the others are not, since they are deleted at ``close()``
  and a file that did not reach the disk whole is never reused: reuse compares every byte (below). The
  ``fsync`` of every group costs about as much as writing it (measured: 1.1 s of 3.0 s for 570 MiB).
  In a folder that held no group file when reserved, a group is written to a temporary file by a writer
  thread (two at a time), hashed along its write (each step just before it is written) and renamed to its content name
  after (:meth:`GroupFileStore._write_in_background`, :meth:`GroupFileStore.flush`); the temporary file is
  locked by its writer meanwhile, so a peer's sweep of orphans leaves it.
- **Safe to share.** Processes using one folder take turns on a lock of the folder while they
  check and write, so N processes applying the same model write each file once and all map the
  same file (one copy in the page cache); no session deletes a file another live session still
  reads (:mod:`memmode_core.files.folder`).
- **Refused early.** :meth:`GroupFileStore.reserve` checks that the folder can be created and
  written and that the groups fit in its free space before the engine releases any weight. While a
  load lends the checkpoint's pages (:mod:`memmode_core.files.borrowed`), groups kept in place need no
  room, which is only known group by group: then each write checks its own room instead.
- **Cleaned up.** The default folder is private (``mkdtemp``) and removed at ``close()`` and at
  interpreter exit. In a caller-given folder, the files a session wrote are deleted at
  ``close()`` (and at exit) unless ``keep_files=True``.

POSIX only: the locking uses ``fcntl.flock``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from memmode_core.contracts.errors import InvalidOptionError, StorageUnavailableError
from memmode_core.contracts.options import Options, boolean, one_of, option
from memmode_core.contracts.storage import Storage, StorageSession, Tensors
from memmode_core.engine.staging import Fill, StagingRing
from memmode_core.engine.streams import active
from memmode_core.files import folder as offload_folder
from memmode_core.files import naming, readwrite
from memmode_core.files.borrowed import borrow
from memmode_core.files.borrowed import lending_now as lending
from memmode_core.files.folder import OffloadFolder
from memmode_core.files.groupfile import FILE_PREFIX, FILE_SUFFIX, FileStamp, GroupFile
from memmode_core.files.layout import FileLayout, UnsupportedDtypeError, host_tensors
from memmode_core.files.pools import LazyPool

logger = logging.getLogger("memmode")

#: reserved per group on top of its bytes: its header and the filesystem's last partial block
PER_FILE_ALLOWANCE = 8 << 10


#: groups written to their files at once while the engine goes on (:meth:`GroupFileStore.store` with
#: ``wait=False``): two writers keep both cores of the project's machine busy writing and hashing
WRITES_AHEAD = 2
_WRITERS = LazyPool("memmode-write", lambda cores: WRITES_AHEAD)

#: how much a group file is checked before each onload and before remove() reads it back
VERIFY_LEVELS = ("size", "hash", "none")


@dataclass(frozen=True)
class GroupFileOptions(Options):
    """The options of the storages that write group files (``disk``, ``mmap``)."""

    keep_files: bool = option(
        False,
        "leave the group files this session wrote in offload_dir after remove() and at exit, so that the next "
        "apply of the same weights reuses them instead of writing (needs offload_dir)",
        boolean,
    )
    verify: str = option(
        "size",
        "check each group file before it is read back: 'size' (one stat: size, identity and modification time; a "
        "changed file is then hashed, so a truncated, replaced or edited file is an error), 'hash' (also the "
        "content digest at every onload, ~0.1 s per GB read on 2 cores), 'none'",
        one_of(*VERIFY_LEVELS),
    )


def _holds(path: Path, layout: FileLayout, host: Tensors) -> bool:
    """Whether the file under the group's content name holds exactly the group (it is reused); a file there that
    does not (truncated, or another file) is said, and the caller writes the group over it."""
    if naming.matches(path, layout, host):
        return True
    if path.exists():
        logger.warning(
            "memmode: %s does not hold the bytes its name promises (truncated or another file); rewriting it", path
        )
    return False


@dataclass(eq=False)
class _Unnamed:
    """A group being written to a temporary file in the background (:meth:`GroupFileStore.store`), not yet
    under its content name."""

    group_file: GroupFile
    #: the tensors the writer and the hash read, held until the group is named
    host: Tensors | None
    #: the temporary file (None once renamed to its name or deleted), and its descriptor, which holds the
    #: file's lock (see :meth:`~memmode_core.files.folder.OffloadFolder.temporary_file`)
    temporary: str | None
    fd: int | None
    namer: naming.ContentNamer
    #: the writer's future: the file's stamp once every byte is in, or its failure
    written: Future | None = None

    def finish(self) -> FileStamp:
        """The file's stamp once written; raises the write's failure. Returns, or raises, only once no thread
        reads the tensors any more."""
        try:
            return self.written.result()
        finally:
            self.namer.wait()

    def drop(self) -> None:
        """Wait for the threads, delete the temporary file if it is still there, release its lock."""
        if self.written is not None:
            with contextlib.suppress(BaseException):
                self.finish()
        if self.temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.temporary)
            self.temporary = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.host = None


class GroupFileStore:
    """The files of one storage session in one folder (see the module docstring)."""

    def __init__(
        self, offload_dir: str | os.PathLike | None, *, keep_files: bool, owner: str, warn_in_ram: bool = False
    ) -> None:
        self.owner = owner
        self.keep_files = keep_files
        #: warn when the folder is a RAM filesystem, for a storage whose point is to save memory
        self.warn_in_ram = warn_in_ram
        self._folder = OffloadFolder(offload_dir, keep_files=keep_files)
        self._sizes: dict[str, int] = {}  # file name -> size, of every file this session uses
        #: bytes of groups stored by reference in a lent checkpoint mapping (nothing written)
        self.borrowed_bytes = 0
        #: groups stored by reference (kept in a lent mapping's pages), and groups stored to files
        self.borrowed_groups = 0
        self.written_groups = 0
        #: check the free space before each write rather than for all groups up front (see reserve)
        self._room_per_write = False
        #: the folder held no group file when reserved: write each group while hashing it (see store)
        self._write_first = False
        #: groups written in the background, oldest first, not yet under their names (see flush)
        self._unnamed: deque[_Unnamed] = deque()

    @property
    def folder(self) -> Path | None:
        """The folder (for the default private folder: None until :meth:`reserve` creates it)."""
        return self._folder.path

    @property
    def disk_bytes(self) -> int:
        return sum(self._sizes.values())

    # -- before anything is released -----------------------------------------------------------------

    def reserve(self, sizes: Mapping[str, int]) -> None:
        """Create the folder and check that it is writable and has room for the groups."""
        self._open_folder()
        try:
            with self._folder.locked():
                self._folder.sweep_temporaries()
                collected = self._folder.collect_dead()
                if collected:
                    logger.info(
                        "memmode: removed %d group files left in %s by sessions that died", len(collected), self.folder
                    )
                present = [f.stat().st_size for f in self.folder.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}")]
                existing = sum(present)
                self._write_first = not present
                fd, probe = self._folder.temporary_file()
                os.close(fd)
                os.unlink(probe)
                free = shutil.disk_usage(self.folder).free
        except OSError as exc:
            raise self._refusal(f"cannot write in {self.folder}: {exc}") from None
        needed = sum(sizes.values()) + PER_FILE_ALLOWANCE * len(sizes)
        # files already there may be exactly these groups (a second run): they need no new space
        if free + existing < needed:
            if lending():
                # loading straight into the mode: most groups may be kept in the checkpoint's pages and need
                # no space at all, which is only known group by group; each write checks its own room instead
                self._room_per_write = True
            else:
                raise self._refusal(
                    f"{self.folder} has {free / 2**30:.2f} GiB free and the groups need {needed / 2**30:.2f} GiB; "
                    f"free some space or choose another offload_dir="
                )
        if self.warn_in_ram and (kind := offload_folder.filesystem_type(self.folder)) in ("tmpfs", "ramfs"):
            logger.warning(
                "memmode: storage %r writes to %s, a %s held in RAM: the weights will take as much "
                "memory as with storage='ram'; pass offload_dir= on a disk to save memory",
                self.owner,
                self.folder,
                kind,
            )

    def _open_folder(self) -> None:
        try:
            self._folder.open()
        except OSError as exc:
            raise self._refusal(f"cannot use {self.folder or tempfile.gettempdir()} as offload folder: {exc}") from None

    def _refusal(self, why: str) -> StorageUnavailableError:
        return StorageUnavailableError(f"storage {self.owner!r}: {why}")

    # -- storing -------------------------------------------------------------------------------------

    def store(self, tensors: Tensors, device: torch.device | None = None, *, wait: bool = True) -> GroupFile:
        """The group's file, verified if it already existed, written if not. Leaves ``tensors`` untouched.

        A group lying in a mapping lent by the loader is stored by reference when that changes no bit of
        the outputs on ``device`` (:mod:`memmode_core.files.borrowed`): nothing is written.

        With ``wait=False``, a group that is written (not reused) may be written in the background: the
        returned file then has its final size but not yet its bytes nor its name, and ``tensors`` are read
        until :meth:`flush`, which must come before the file is read, checked or mapped for use.
        """
        host = host_tensors(tensors)
        try:
            layout = FileLayout.of(host)
        except UnsupportedDtypeError as exc:
            raise self._refusal(f"cannot store {exc}") from None
        if device is not None:
            borrowed = borrow(layout, host, device)
            if borrowed is not None:
                self.borrowed_bytes += layout.data_bytes
                self.borrowed_groups += 1
                return borrowed
        self._open_folder()
        if self._write_first:
            group_file = self._write_in_background(layout, host)
            if wait:
                self.flush()
            return group_file
        self.flush()
        name = FILE_PREFIX + naming.content_name(layout, host) + FILE_SUFFIX
        path = self.folder / name
        with self._folder.locked():
            self._folder.claim(name)
            if not _holds(path, layout, host):
                if self._room_per_write:
                    self._check_room(layout.file_size + PER_FILE_ALLOWANCE)
                self._write(path, layout, host)
                self._folder.wrote(name)
            stamp = FileStamp.of(path)
        self._sizes[name] = layout.file_size
        self.written_groups += 1
        return GroupFile(path, layout, stamp)

    def _write_in_background(self, layout: FileLayout, host: Tensors) -> GroupFile:
        """:meth:`store` in a folder that held no group file when reserved: the group is written to a temporary
        file by a writer thread, hashed as it is written, and named by :meth:`flush` (or when it is the
        oldest of more than :data:`WRITES_AHEAD` groups in flight).

        There, the name is only needed to find a file to reuse, and there is none to find: so the name is
        computed along the write, each step hashed by the writer just before it is written
        (:meth:`~memmode_core.files.naming.ContentNamer.write`). The
        engine stores a component group by group and releases nothing until every group is stored, so
        writing a group while the next is prepared and written holds no memory the model does not hold
        anyway. Two groups written at once, to two files, measured 0.53-0.55 s for the 22 blocks of a
        1.9 GiB bf16 checkpoint against 0.63-1.23 s one after the other (five alternated rounds, copied by
        the kernel and hashed behind, as memmode wrote them then; three or four writers did no better on 2
        cores). The guarantees are those of :meth:`store`: the name is the content's digest, written
        atomically (the rename); a file that appeared under that name meanwhile (a peer, or an identical
        group of this session) is compared byte for byte and reused, and the temporary file dropped, or
        else replaced. A temporary file is locked by its writer until then, so a peer's sweep leaves it.
        """
        while len(self._unnamed) >= WRITES_AHEAD:
            self._name_oldest()
        if self._room_per_write:
            in_flight = sum(u.group_file.layout.file_size + PER_FILE_ALLOWANCE for u in self._unnamed)
            self._check_room(layout.file_size + PER_FILE_ALLOWANCE + in_flight)
        try:
            with self._folder.locked():
                fd, temporary = self._folder.temporary_file()
        except OSError as exc:
            raise self._cannot_write(layout, exc) from None
        group_file = GroupFile(Path(temporary), layout)
        unnamed = _Unnamed(group_file, host, temporary, fd, naming.ContentNamer(layout))
        try:
            os.ftruncate(fd, layout.file_size)  # its final size at once: the mmap storage maps it on return
        except OSError as exc:
            unnamed.drop()
            raise self._cannot_write(layout, exc) from None
        unnamed.written = _WRITERS.submit(self._write_into, fd, layout, host, unnamed.namer)
        self._unnamed.append(unnamed)
        return group_file

    def flush(self) -> None:
        """Name every group :meth:`store` left writing in the background, in order. On a failure (a typed
        refusal from the write, or the hash's error) the groups still in flight are dropped, their
        temporary files deleted, and the failure raised: the caller closes the session."""
        while self._unnamed:
            self._name_oldest()

    def _name_oldest(self) -> None:
        unnamed = self._unnamed.popleft()
        try:
            self._name(unnamed)
        except BaseException:
            self._drop_unnamed()
            raise

    def _name(self, unnamed: _Unnamed) -> None:
        """Wait for a group written in the background, then put its file under its content name, or reuse the
        file already there if it holds exactly the group."""
        layout = unnamed.group_file.layout
        try:
            stamp = unnamed.finish()
            name = FILE_PREFIX + unnamed.namer.name() + FILE_SUFFIX
            path = self.folder / name
            with self._folder.locked():
                self._folder.claim(name)
                if _holds(path, layout, unnamed.host):
                    stamp = FileStamp.of(path)
                else:
                    self._publish(unnamed.temporary, path, layout)
                    unnamed.temporary = None
                    self._folder.wrote(name)
        finally:
            unnamed.drop()
        unnamed.group_file.place(path, stamp)
        self._sizes[name] = layout.file_size
        self.written_groups += 1

    def _drop_unnamed(self) -> None:
        while self._unnamed:
            self._unnamed.popleft().drop()

    def _check_room(self, size: int) -> None:
        try:
            free = shutil.disk_usage(self.folder).free
        except OSError as exc:
            raise self._refusal(f"cannot write in {self.folder}: {exc}") from None
        if free < size:
            raise self._refusal(
                f"{self.folder} has {free / 2**30:.2f} GiB free and the next group needs "
                f"{size / 2**30:.2f} GiB; free some space or choose another offload_dir="
            )

    def _write(self, path: Path, layout: FileLayout, tensors: Tensors) -> None:
        temporary = self._write_temporary(layout, tensors)
        try:
            self._publish(temporary, path, layout)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    def _write_temporary(self, layout: FileLayout, tensors: Tensors) -> str:
        """The group written to a new temporary file in the folder (:meth:`_write_into`); its path. Call with
        the folder lock held."""
        try:
            fd, temporary = self._folder.temporary_file()
        except OSError as exc:
            raise self._cannot_write(layout, exc) from None
        try:
            self._write_into(fd, layout, tensors)
            written, temporary = temporary, None
            return written
        finally:
            os.close(fd)
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)

    def _write_into(
        self, fd: int, layout: FileLayout, tensors: Tensors, namer: naming.ContentNamer | None = None
    ) -> FileStamp:
        """Write the group into the open file ``fd`` (``fsync``-ed if kept), hashed along the write by ``namer``
        if given (:func:`~memmode_core.files.readwrite.write`); the file's stamp after. Runs in a writer thread for
        :meth:`_write_in_background`: it touches nothing but ``fd`` and the tensors."""
        try:
            with open(fd, "wb", closefd=False) as file:
                readwrite.write(file, layout, tensors, namer)
                file.flush()
                if self.keep_files:
                    os.fsync(fd)
            return FileStamp.of(fd)
        except OSError as exc:
            raise self._cannot_write(layout, exc) from None

    def _cannot_write(self, layout: FileLayout, exc: OSError) -> StorageUnavailableError:
        return self._refusal(f"cannot write a group file ({layout.file_size / 2**20:.1f} MiB) in {self.folder}: {exc}")

    def _publish(self, temporary: str, path: Path, layout: FileLayout) -> None:
        """Rename a written temporary file to its name: the name only ever points at a complete file."""
        try:
            os.replace(temporary, path)
            if self.keep_files:
                self._folder.sync()  # the rename itself survives a crash
        except OSError as exc:
            raise self._refusal(
                f"cannot write {path.name} ({layout.file_size / 2**20:.1f} MiB) in {self.folder}: {exc}"
            ) from None

    def close(self) -> None:
        """Drop the groups still written in the background (waiting for their threads: the caller may free
        the tensors next), then let the folder clean up (see :mod:`memmode_core.files.folder`). Idempotent."""
        self._drop_unnamed()
        self._folder.close()
        self._sizes.clear()


def check_offload_dir(offload_dir) -> None:
    """Refuse an ``offload_dir`` that cannot be a folder, before anything is created or touched."""
    try:
        path = os.fsdecode(offload_dir)
    except TypeError:
        raise InvalidOptionError(f"offload_dir={offload_dir!r} is not a path") from None
    if not path.strip():
        raise InvalidOptionError(
            "offload_dir='' names no folder (it would write into the current directory); give a folder, or leave "
            "it out for a private temporary one"
        )
    if "\0" in path:
        raise InvalidOptionError(f"offload_dir={path!r} contains a NUL character, which no path may hold")
    if os.path.exists(path) and not os.path.isdir(path):
        raise StorageUnavailableError(
            f"offload_dir={path!r} is a file, not a folder; give a folder for the group files"
        )


# -- the storage side: what disk and mmap share ------------------------------------------------------


class GroupFileStorage(Storage):
    """Base of the storages that keep each group in a group file (``disk``, ``mmap``)."""

    uses_offload_dir = True
    options = GroupFileOptions
    #: whether an offload folder on tmpfs defeats the storage's purpose (saving RAM), and deserves a warning
    warn_in_ram = False

    def unavailable_reason(self, device: torch.device | None = None) -> str | None:
        if offload_folder.fcntl is None:
            return "needs a POSIX system (Linux, macOS): processes sharing an offload folder coordinate with flock"
        return None

    def open(self, *, device: torch.device, offload_dir: str | None, options: GroupFileOptions) -> StorageSession:
        if offload_dir is not None:
            check_offload_dir(offload_dir)
        if options.keep_files and offload_dir is None:
            raise InvalidOptionError(
                f"keep_files=True needs offload_dir=: without it storage {self.name!r} writes to a private "
                f"temporary folder that is removed at remove() and at exit"
            )
        store = GroupFileStore(
            offload_dir, keep_files=options.keep_files, owner=self.name, warn_in_ram=self.warn_in_ram
        )
        session = self.session(store, device)
        session.verify = options.verify
        return session

    def session(self, store: GroupFileStore, device: torch.device) -> StorageSession:
        raise NotImplementedError


class GroupFileSession(StorageSession):
    """A session over a :class:`GroupFileStore`: the bookkeeping disk and mmap have in common."""

    def __init__(self, store: GroupFileStore, device: torch.device) -> None:
        self.store = store
        self.device = device
        self.files: dict[str, GroupFile] = {}
        #: see :class:`GroupFileOptions`
        self.verify = "size"
        #: page-locked bounce buffers for uploads to an accelerator (allocated on the first upload)
        self.staging = StagingRing() if active().has_streams(device) else None

    def reserve(self, sizes: Mapping[str, int]) -> None:
        self.store.reserve(sizes)

    def store_group(self, key: str, tensors: Tensors) -> GroupFile:
        """The group's file; it may still be written in the background until :meth:`flush` (see
        :meth:`GroupFileStore.store`)."""
        group_file = self.store.store(tensors, self.device, wait=False)
        self.files[key] = group_file
        return group_file

    def flush(self) -> None:
        self.store.flush()

    def check(self, key: str) -> None:
        group_file = self.files.get(key)
        if group_file is None:
            raise StorageUnavailableError(f"storage {self.store.owner!r} holds no group {key!r}")
        group_file.check(self.verify)

    def upload(self, group_file: GroupFile, fill: Fill, device: torch.device, stream: torch.Stream | None) -> Tensors:
        """The group on an accelerator ``device``, its bytes supplied chunk by chunk by ``fill``."""
        return self.staging.upload(group_file.layout, fill, device, stream)

    def discard(self, key: str) -> None:
        self.files.pop(key, None)

    def close(self) -> None:
        if self.staging is not None:
            self.staging.close()
        self.files.clear()
        self.store.close()

    def stats(self) -> dict[str, int]:
        return {
            "disk_bytes": self.store.disk_bytes,
            "borrowed_bytes": self.store.borrowed_bytes,
            "borrowed_groups": self.store.borrowed_groups,
            "written_groups": self.store.written_groups,
            "pinned_bytes": self.staging.pinned_bytes if self.staging is not None else 0,
        }
