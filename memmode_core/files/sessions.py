"""The storage side of group files: the base classes of the ``disk`` and ``mmap`` storages and their sessions.

Both storages promise the same things about their files (:mod:`memmode_core.files.store`), so what their
sessions have in common lives here once: opening a :class:`~memmode_core.files.store.GroupFileStore` with the
storages' options (:mod:`memmode_core.files.file_options`), storing each group and keeping its file by key,
naming the groups written in the background at ``flush``, checking a file before it is read back
(``verify``), the page-locked staging ring for uploads to an accelerator, and the counts ``stats`` reports.
A plugin adds only how it reads a group back (``disk``: at each onload, for as long as the group is on the
device; ``mmap``: mapped once, for the whole session), in :meth:`GroupFileStorage.session`.

Plugins and third parties subclass :class:`GroupFileStorage` and :class:`GroupFileSession`: their names are
part of the plugin interface.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from memmode_core.contracts.errors import InvalidOptionError, StorageUnavailableError
from memmode_core.contracts.storage import Storage, StorageSession, Tensors
from memmode_core.engine.staging import Fill, StagingRing
from memmode_core.engine.streams import active
from memmode_core.files import folder as offload_folder
from memmode_core.files.file_options import GroupFileOptions, check_offload_dir
from memmode_core.files.groupfile import GroupFile
from memmode_core.files.node import shared_folder
from memmode_core.files.store import GroupFileStore


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
        shared = shared_folder("offload") if offload_dir is None else None  # N ranks on one machine: one copy
        store = GroupFileStore(
            shared if shared is not None else offload_dir,
            keep_files=options.keep_files,
            owner=self.name,
            warn_in_ram=self.warn_in_ram,
            shared_by_ranks=shared is not None,
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
        #: see :class:`~memmode_core.files.file_options.GroupFileOptions`
        self.verify = "size"
        #: page-locked bounce buffers for uploads to an accelerator (allocated on the first upload)
        self.staging = StagingRing() if active().has_streams(device) else None

    def reserve(self, sizes: Mapping[str, int]) -> None:
        self.store.reserve(sizes)

    def store_group(self, key: str, tensors: Tensors) -> GroupFile:
        """The group's file; it may still be written in the background until :meth:`flush` (see
        :meth:`GroupFileStore.store <memmode_core.files.store.GroupFileStore.store>`)."""
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
        """``disk_bytes``: the group files. ``staged_bytes``: the other files on disk that hold the stored groups,
        those memmode wrote while it quantized or converted weights (:attr:`GroupFileStore.staged_bytes`): a group
        kept in one in place is counted there, not in ``disk_bytes``. What is on disk for the session is the sum.
        ``borrowed_bytes``, ``borrowed_groups``: the groups kept in place in a lent mapping (those files, or a
        checkpoint's own pages); ``written_groups``: the groups stored in group files."""
        return {
            "disk_bytes": self.store.disk_bytes,
            "staged_bytes": self.store.staged_bytes,
            "borrowed_bytes": self.store.borrowed_bytes,
            "borrowed_groups": self.store.borrowed_groups,
            "written_groups": self.store.written_groups,
            "pinned_bytes": self.staging.pinned_bytes if self.staging is not None else 0,
        }
