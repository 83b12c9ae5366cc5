"""Group files: the folder of one-file-per-group that the ``disk`` and ``mmap`` storages share.

Both storages promise the same things about their files, so the mechanics live here once and a
plugin adds only how it reads them back (``disk``: at each onload, for as long as the group is on
the device; ``mmap``: mapped once, for the whole session):

- **Named by content.** A file's name is a digest of its header and bytes
  (:func:`~memmode_core.files.format.content_name`), so a file left by another model, by another
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
  In a folder that held no group file when reserved, a group is hashed along its write to a temporary file
  (each tensor once written) and renamed to its content name after (:meth:`GroupFileStore._store_written`).
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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from memmode_core.contracts.errors import InvalidOptionError, StorageUnavailableError
from memmode_core.contracts.options import Options, boolean, one_of, option
from memmode_core.contracts.storage import Storage, StorageSession, Tensors
from memmode_core.engine.staging import Fill, StagingRing
from memmode_core.engine.streams import active
from memmode_core.files import folder as offload_folder
from memmode_core.files import format as group_format
from memmode_core.files.borrowed import borrow
from memmode_core.files.borrowed import lending_now as lending
from memmode_core.files.folder import OffloadFolder
from memmode_core.files.format import Copy, Layout
from memmode_core.files.groupfile import FILE_PREFIX, FILE_SUFFIX, FileStamp, GroupFile
from memmode_core.files.mapped import COPY_MIN_BYTES, file_ranges

logger = logging.getLogger("memmode")

#: reserved per group on top of its bytes: its header and the filesystem's last partial block
PER_FILE_ALLOWANCE = 8 << 10


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


def _holds(path: Path, layout: Layout, host: Tensors) -> bool:
    """Whether the file under the group's content name holds exactly the group (it is reused); a file there that
    does not (truncated, or another file) is said, and the caller writes the group over it."""
    if group_format.matches(path, layout, host):
        return True
    if path.exists():
        logger.warning(
            "memmode: %s does not hold the bytes its name promises (truncated or another file); rewriting it", path
        )
    return False


def _copy_places(layout: Layout, tensors: Tensors) -> dict[str, tuple[Path, int, tuple[int, int]]]:
    """``name -> (file, offset, (device, inode))`` for the tensors of a group large enough whose exact bytes
    lie in a file they are mapped from (a checkpoint a load mapped, or another loader did), for
    :func:`group_format.write` to copy them (:func:`~memmode_core.files.mapped.file_ranges`)."""
    if not hasattr(os, "copy_file_range") or layout.data_bytes < COPY_MIN_BYTES:
        return {}
    return file_ranges(tensors)


def _open_unchanged(
    identities: dict[Path, tuple[int, int]], opened: contextlib.ExitStack
) -> dict[Path, tuple[int, FileStamp]]:
    """The files to copy from, opened: ``path -> (fd, its stamp now)`` for each that is still the file mapped
    (its device and inode); a file gone or replaced is left out, and its tensors are written from memory."""
    files = {}
    for path, identity in identities.items():
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        opened.callback(os.close, fd)
        stamp = FileStamp.of(fd)
        if (stamp.device, stamp.inode) == identity:
            files[path] = (fd, stamp)
    return files


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

    def store(self, tensors: Tensors, device: torch.device | None = None) -> GroupFile:
        """The group's file, verified if it already existed, written if not. Leaves ``tensors`` untouched.

        A group lying in a mapping lent by the loader is stored by reference when that changes no bit of
        the outputs on ``device`` (:mod:`memmode_core.files.borrowed`): nothing is written.
        """
        host = group_format.host_tensors(tensors)
        try:
            layout = Layout.of(host)
        except group_format.UnsupportedDtypeError as exc:
            raise self._refusal(f"cannot store {exc}") from None
        if device is not None:
            borrowed = borrow(layout, host, device)
            if borrowed is not None:
                self.borrowed_bytes += layout.data_bytes
                self.borrowed_groups += 1
                return borrowed
        self._open_folder()
        if self._write_first:
            return self._store_written(layout, host)
        name = FILE_PREFIX + group_format.content_name(layout, host) + FILE_SUFFIX
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

    def _store_written(self, layout: Layout, host: Tensors) -> GroupFile:
        """:meth:`store` where no file is expected to be reused: write the group to a temporary file, hashing
        each tensor once it is written, then rename the file to its content name.

        In a folder that held no group file when reserved (the default private folder, or a new one), the
        name is only needed to find a file to reuse, and there is none to find: so the name is computed along
        the write, each tensor hashed by the pool while the next one is written
        (:class:`~memmode_core.files.format.ContentNamer`, which measured why never ahead of the write). The
        guarantees are those of :meth:`store`: the name is the content's digest, written atomically (the
        rename); a file that appeared under that name meanwhile (a peer, or an identical group of this
        session) is compared byte for byte and reused, and the temporary file dropped, or else replaced.
        """
        with self._folder.locked():  # held while writing, as in store: a temporary file seen unlocked is an orphan
            if self._room_per_write:
                self._check_room(layout.file_size + PER_FILE_ALLOWANCE)
            namer = group_format.ContentNamer(layout)
            try:
                temporary = self._write_temporary(layout, host, namer)
            finally:
                namer.wait()  # never leave a thread reading tensors the caller may free
            try:
                name = FILE_PREFIX + namer.name() + FILE_SUFFIX
                path = self.folder / name
                self._folder.claim(name)
                if _holds(path, layout, host):
                    os.unlink(temporary)
                else:
                    self._publish(temporary, path, layout)
                    self._folder.wrote(name)
                temporary = None
                stamp = FileStamp.of(path)
            finally:
                if temporary is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(temporary)
        self._sizes[name] = layout.file_size
        self.written_groups += 1
        return GroupFile(path, layout, stamp)

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

    def _write(self, path: Path, layout: Layout, tensors: Tensors) -> None:
        temporary = self._write_temporary(layout, tensors)
        try:
            self._publish(temporary, path, layout)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    def _write_temporary(self, layout: Layout, tensors: Tensors, namer: group_format.ContentNamer | None = None) -> str:
        """The group written to a new temporary file in the folder (``fsync``-ed if kept), each tensor handed to
        ``namer`` once written; its path. The tensors whose exact bytes lie in a file they are mapped from are
        copied from it file to file (see :func:`group_format.write`)."""
        temporary = None
        places = _copy_places(layout, tensors)
        try:
            with contextlib.ExitStack() as opened:
                files = _open_unchanged({path: identity for path, _, identity in places.values()}, opened)
                copies = {
                    name: Copy(files[path][0], offset) for name, (path, offset, _) in places.items() if path in files
                }
                fd, temporary = self._folder.temporary_file()
                with open(fd, "wb") as file:
                    group_format.write(file, layout, tensors, namer, copies)
                    file.flush()
                    if self.keep_files:
                        os.fsync(file.fileno())
                for path, (source_fd, stamp) in files.items():
                    if FileStamp.of(source_fd) != stamp:
                        raise self._refusal(f"{path} changed while its weights were copied into a group file")
            written, temporary = temporary, None
            return written
        except OSError as exc:
            raise self._refusal(
                f"cannot write a group file ({layout.file_size / 2**20:.1f} MiB) in {self.folder}: {exc}"
            ) from None
        finally:
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)

    def _publish(self, temporary: str, path: Path, layout: Layout) -> None:
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
        """Let the folder clean up (see :mod:`memmode_core.files.folder`). Idempotent."""
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
        group_file = self.store.store(tensors, self.device)
        self.files[key] = group_file
        return group_file

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
