"""The ``mmap`` storage: the group files, mapped, are the only copy of the offloaded weights.

The files are the plugin kit's group files (``GroupFileStorage``, ``GroupFileSession``: named by content,
written atomically, verified); what ``mmap`` adds is that each is mapped once, privately, for the whole
session (``GroupFile.map``), and the weights at rest are views of that mapping. So:

- computing on the CPU, the weights *are* the page cache: onloading is bookkeeping, no byte is
  copied and no anonymous memory is used for them;
- every process that maps the same files (N ranks on one node with one ``offload_dir``) shares one
  copy of the weights in RAM, and the kernel can drop and re-read pages under memory pressure
  instead of swapping;
- to a GPU, a group is copied from the mapping through a small page-locked staging ring, on the
  engine's stream.
"""

from __future__ import annotations

import os

import torch

from memmode_core.plugin import (
    GroupFileSession,
    GroupFileStorage,
    GroupFileStore,
    StorageCost,
    Tensors,
    active_streams,
    copying_cost,
)


class MmapSession(GroupFileSession):
    #: the weights at rest are views of the files' mappings: a read at rest checks the file first
    at_rest_can_break = True

    def __init__(self, store: GroupFileStore, device: torch.device) -> None:
        super().__init__(store, device)
        #: key -> (the whole mapped file as uint8, typed views of its tensors)
        self._mapped: dict[str, tuple[torch.Tensor, Tensors]] = {}
        #: key -> the inode mapped at put, for the groups put since the last flush
        self._unflushed: dict[str, int] = {}

    def put(self, key: str, tensors: Tensors, readable: frozenset[str] = frozenset()) -> Tensors:
        group_file = self.store_group(key, tensors)
        flat, views = group_file.map()
        self._mapped[key] = (flat, views)
        if group_file.path is not None and group_file.stamp is None:  # written in the background: named at flush
            self._unflushed[key] = os.stat(group_file.path).st_ino
        return dict(views)

    def flush(self) -> None:
        """Name the files written in the background; a group whose name led to a file already there (a peer's,
        or an identical group's) is mapped from that file, so that every process maps one copy: the tensors
        ``put`` returned are pointed at the new mapping (``Tensor.set_``; the engine assigns them to the
        model only after this), and the temporary file's pages go with the old one."""
        try:
            super().flush()
            for key, inode in self._unflushed.items():
                group_file = self.files.get(key)
                if group_file is None or group_file.stamp is None or group_file.stamp.inode == inode:
                    continue
                flat, views = group_file.map()
                for name, tensor in self._mapped[key][1].items():
                    tensor.set_(views[name])
                self._mapped[key] = (flat, self._mapped[key][1])
        finally:
            self._unflushed.clear()

    def zero_copy(self, device: torch.device) -> bool:
        return active_streams().is_host(device)

    def fetch(self, key: str, device: torch.device, stream: torch.Stream | None = None) -> Tensors:
        flat, views = self._mapped[key]
        streams = active_streams()
        if streams.is_host(device):
            return dict(views)
        if streams.has_streams(device):
            group_file = self.files[key]
            return self.upload(group_file, group_file.mapped_filler(flat), device, stream)
        return {name: streams.to_device(view, device) for name, view in views.items()}

    def read(self, key: str, name: str) -> torch.Tensor:
        return self._mapped[key][1][name]

    def restore(self, key: str) -> Tensors:
        # copies into ordinary memory: after remove() the files (perhaps deleted) are not held open
        return {name: view.clone() for name, view in self._mapped[key][1].items()}

    def discard(self, key: str) -> None:
        super().discard(key)
        self._mapped.pop(key, None)

    def close(self) -> None:
        self._mapped.clear()
        super().close()

    def stats(self) -> dict[str, int]:
        mapped = sum(flat.numel() for flat, _ in self._mapped.values() if flat is not None)  # borrowed: None
        return {"pageable_bytes": 0, "mapped_bytes": mapped, **super().stats()}


class MmapStorage(GroupFileStorage):
    """Offloaded groups are safetensors files under ``offload_dir``, mapped for the whole session.

    On a CPU device the weights are zero-copy views of the page cache; to a GPU they are copied from
    the mapping through a small reused pinned staging buffer. Processes that use the same
    ``offload_dir`` share one copy of the weights in RAM. The mapping is private and copy-on-write:
    an in-place change to a weight stays in the process and never reaches the file.

    ``offload_dir``: where the files go (default: a private temporary folder, removed at
    ``remove()`` and at exit). Option ``keep_files`` (default False): leave the files this session
    wrote after ``remove()``, for the next run or other processes to reuse; needs ``offload_dir``.
    """

    name = "mmap"

    def cost(self, device: torch.device) -> StorageCost:
        # on the CPU nothing is copied; to a GPU, copies from the page cache; the files are on disk
        # the ranks of one machine map the same files (the kit's shared_folder): one copy between them
        return copying_cost("mapped", device, disk=1.0, zero_copy_on_cpu=True, shared_by_ranks=True)

    description = "memory-mapped safetensors files: zero-copy on CPU, one copy in RAM shared by all processes"

    def session(self, store: GroupFileStore, device: torch.device) -> MmapSession:
        return MmapSession(store, device)
