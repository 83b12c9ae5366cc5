"""The group-file store: the files of one storage session in one folder, one file per group.

The ``disk`` and ``mmap`` storages promise the same things about their files, so the mechanics live here
once (their sessions' common side is :mod:`memmode_core.files.sessions`) and a plugin adds only how it
reads them back (``disk``: at each onload, for as long as the group is on the device; ``mmap``: mapped
once, for the whole session). :class:`GroupFileStore` keeps these promises:

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
  thread (two at a time), hashed along its write (each step just before it is written) and renamed to its
  content name after (:meth:`GroupFileStore._write_in_background`, :meth:`GroupFileStore.flush`,
  :mod:`memmode_core.files.writers`); the temporary file is locked by its writer meanwhile, so a peer's
  sweep of orphans leaves it.
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
from pathlib import Path

import torch

from memmode_core.contracts.errors import StorageUnavailableError
from memmode_core.contracts.storage import Tensors
from memmode_core.files import folder as offload_folder
from memmode_core.files import naming, readwrite
from memmode_core.files.borrowed import borrow
from memmode_core.files.borrowed import lending_now as lending
from memmode_core.files.file_layout import FileLayout, UnsupportedDtypeError, host_tensors
from memmode_core.files.folder import OffloadFolder
from memmode_core.files.groupfile import FILE_PREFIX, FILE_SUFFIX, FileStamp, GroupFile
from memmode_core.files.streamed import WrittenFile, written_file_of
from memmode_core.files.writers import InFlight, Unnamed

logger = logging.getLogger("memmode")

#: reserved per group on top of its bytes: its header and the filesystem's last partial block
PER_FILE_ALLOWANCE = 8 << 10


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


class GroupFileStore:
    """The files of one storage session in one folder (see the module docstring)."""

    def __init__(
        self,
        offload_dir: str | os.PathLike | None,
        *,
        keep_files: bool,
        owner: str,
        warn_in_ram: bool = False,
        shared_by_ranks: bool = False,
    ) -> None:
        self.owner = owner
        self.keep_files = keep_files
        #: warn when the folder is a RAM filesystem, for a storage whose point is to save memory
        self.warn_in_ram = warn_in_ram
        #: ``offload_dir`` is the folder the ranks of this machine share (``files.node``): the last removes it
        self._folder = OffloadFolder(offload_dir, keep_files=keep_files, remove_when_empty=shared_by_ranks)
        self._sizes: dict[str, int] = {}  # file name -> size, of every file this session uses
        #: bytes of groups stored by reference in a lent checkpoint mapping (nothing written)
        self.borrowed_bytes = 0
        #: groups stored by reference (kept in a lent mapping's pages), and groups stored to files
        self.borrowed_groups = 0
        self.written_groups = 0
        #: the files memmode wrote (streamed: packed layers, converted weights) that the stored groups' tensors
        #: lay in (see staged_bytes)
        self._staged: set[WrittenFile] = set()
        #: check the free space before each write rather than for all groups up front (see reserve)
        self._room_per_write = False
        #: the folder held no group file when reserved: write each group while hashing it (see store)
        self._write_first = False
        #: groups written in the background, oldest first, not yet under their names (see flush)
        self._unnamed = InFlight()

    @property
    def folder(self) -> Path | None:
        """The folder (for the default private folder: None until :meth:`reserve` creates it)."""
        return self._folder.path

    @property
    def disk_bytes(self) -> int:
        """Bytes of the group files this session uses."""
        return sum(self._sizes.values())

    @property
    def staged_bytes(self) -> int:
        """Bytes on disk, besides the group files, of the files memmode wrote that the stored groups lay in when
        they were stored (a quantizer's layers packed into a streamed file, weights converted while loading),
        each counted whole while it is still mapped: an unlinked file stays on disk as long as anything maps it,
        a group kept in it in place (borrowed: nothing written) or a tensor still viewing it. A checkpoint's own
        pages count nothing here: its files were there before."""
        return sum(written.size for written in self._staged if written.mapped)

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
        self._staged.update(w for w in map(written_file_of, host.values()) if w is not None)
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
                self._write(name, layout, host)
            stamp = FileStamp.of(path)
        self._sizes[name] = layout.file_size
        self.written_groups += 1
        return GroupFile(path, layout, stamp)

    def _write_in_background(self, layout: FileLayout, host: Tensors) -> GroupFile:
        """:meth:`store` in a folder that held no group file when reserved: the group is written to a temporary
        file by a writer thread, hashed as it is written, and named by :meth:`flush` (or when it is the
        oldest of more than :data:`~memmode_core.files.writers.WRITES_AHEAD` groups in flight): why, and why
        two writers, is :mod:`memmode_core.files.writers`.

        The guarantees are those of :meth:`store`: the name is the content's digest, written
        atomically (the rename); a file that appeared under that name meanwhile (a peer, or an identical
        group of this session) is compared byte for byte and reused, and the temporary file dropped, or
        else replaced. A temporary file is locked by its writer until then, so a peer's sweep leaves it.
        """
        self._unnamed.make_way(self._name)
        if self._room_per_write:
            in_flight = sum(u.group_file.layout.file_size + PER_FILE_ALLOWANCE for u in self._unnamed)
            self._check_room(layout.file_size + PER_FILE_ALLOWANCE + in_flight)
        try:
            with self._folder.locked():
                fd, temporary = self._folder.temporary_file()
        except OSError as exc:
            raise self._cannot_write(layout, exc) from None
        group_file = GroupFile(Path(temporary), layout)
        unnamed = Unnamed(group_file, host, temporary, fd, naming.ContentNamer(layout))
        try:
            os.ftruncate(fd, layout.file_size)  # its final size at once: the mmap storage maps it on return
        except OSError as exc:
            unnamed.drop()
            raise self._cannot_write(layout, exc) from None
        self._unnamed.start(unnamed, self._write_into, fd, layout, host, unnamed.namer)
        return group_file

    def flush(self) -> None:
        """Name every group :meth:`store` left writing in the background, in order. On a failure (a typed
        refusal from the write, or the hash's error) the groups still in flight are dropped, their
        temporary files deleted, and the failure raised: the caller closes the session."""
        self._unnamed.flush(self._name)

    def _name(self, unnamed: Unnamed) -> None:
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
                    self._publish(unnamed.temporary, name, layout)
                    unnamed.temporary = None
        finally:
            unnamed.drop()
        unnamed.group_file.place(path, stamp)
        self._sizes[name] = layout.file_size
        self.written_groups += 1

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

    def _write(self, name: str, layout: FileLayout, tensors: Tensors) -> None:
        temporary = self._write_temporary(layout, tensors)
        try:
            self._publish(temporary, name, layout)
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

    def _publish(self, temporary: str, name: str, layout: FileLayout) -> None:
        """Put a written temporary file under its name, as this session's (:meth:`OffloadFolder.publish`)."""
        try:
            self._folder.publish(temporary, name)
            if self.keep_files:
                self._folder.sync()  # the rename itself survives a crash
        except OSError as exc:
            raise self._refusal(
                f"cannot write {name} ({layout.file_size / 2**20:.1f} MiB) in {self.folder}: {exc}"
            ) from None

    def close(self) -> None:
        """Drop the groups still written in the background (waiting for their threads: the caller may free
        the tensors next), then let the folder clean up (see :mod:`memmode_core.files.folder`). Idempotent."""
        self._unnamed.drop()
        self._folder.close()
        self._sizes.clear()
        self._staged.clear()
