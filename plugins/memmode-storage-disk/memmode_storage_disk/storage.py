"""The ``disk`` storage: while a group is offloaded, its weights exist only in its file.

Everything about the files — naming by content, atomic writes, verification, free-space checks,
sharing a folder, cleanup — is the plugin kit's group-file machinery (``GroupFileStorage``,
``GroupFileSession``: any storage that keeps groups in files shares it). What is particular to ``disk`` is
how little it keeps: at rest a parameter holds a ``placeholder`` (no memory) and only what the engine marks
readable keeps its values: the buffers and a component's own loose parameters, small tensors that pipelines
read outside any forward. Code that reads a parameter's
value at rest anyway (``state_dict()``, a parent module) is served from the file by the engine, through
:meth:`DiskSession.read`. Memory holds the groups that are on the device at the time, whatever the size of the model.

How a group comes back depends on the device:

- to an accelerator, the file is read chunk by chunk into a small page-locked staging ring and
  copied on the engine's stream (``GroupFileSession.upload``);
- on the CPU, the file is mapped privately: its pages in the page cache are the weights. The mapping
  is kept from one onload to the next while the file's stamp is unchanged, and its page-cache pages
  stay mapped at rest; a page the process wrote (a copy-on-write copy) is dropped at the offload
  (``GroupFile.release``). Mapping anew and faulting the pages in
  at every onload cost more than a small layer's forward at leaf level. Reading into fresh memory
  instead costs a page fault and a zeroed page for every 4 KiB of weights on every onload —
  measured at 53 ms for a 56 MiB block against 12 ms for computing straight from the mapping,
  which made block-level offload twice as slow as diffusers' disk offload.
"""

from __future__ import annotations

import torch

from memmode_core.plugin import (
    GroupFileSession,
    GroupFileStorage,
    GroupFileStore,
    StorageCost,
    Tensors,
    active_streams,
    copying_cost,
    host_copy,
    placeholder,
)


class DiskSession(GroupFileSession):
    def __init__(self, store: GroupFileStore, device: torch.device) -> None:
        super().__init__(store, device)
        #: key -> the group's buffers, kept readable at rest
        self._buffers: dict[str, Tensors] = {}
        streams = active_streams()
        #: onloads to the session's device compute from a mapping of the file (asked once: it is asked per onload)
        self._maps = not streams.has_streams(device) and streams.is_host(device)

    def put(self, key: str, tensors: Tensors, readable: frozenset[str] = frozenset()) -> Tensors:
        self.store_group(key, tensors)
        buffers = {name: host_copy(tensors[name]) for name in readable}
        self._buffers[key] = buffers
        return {name: buffers[name] if name in readable else placeholder(t) for name, t in tensors.items()}

    def fetch(self, key: str, device: torch.device, stream: torch.Stream | None = None) -> Tensors:
        group_file, buffers = self.files[key], self._buffers[key]
        if self._maps and device == self.device:
            tensors = group_file.onload_views()
            tensors.update(buffers)  # the values the module holds now, which are the ones it computes with
            return tensors
        streams = active_streams()
        if streams.has_streams(device):
            with group_file.filler() as fill:
                tensors = self.upload(group_file, fill, device, stream)
            with streams.on(stream):
                tensors.update({n: streams.to_device(t, device, non_blocking=True) for n, t in buffers.items()})
            return tensors
        tensors = group_file.onload_views()
        tensors.update(buffers)  # the values the module holds now, which are the ones it computes with
        if streams.is_host(device):
            return tensors
        return {name: streams.to_device(t, device) for name, t in tensors.items()}

    def offloaded(self, key: str, intact: bool = True) -> None:
        group_file = self.files.get(key)
        if group_file is not None:
            group_file.release(intact=intact)

    def restore(self, key: str) -> Tensors:
        tensors = self.files[key].read()
        tensors.update(self._buffers[key])
        return tensors

    def read(self, key: str, name: str) -> torch.Tensor:
        """One tensor for a read at rest (``state_dict()``, a parent module): a view of a private mapping of the
        file, made for this read, so reading a model's weights at rest holds no memory of the process's own."""
        buffers = self._buffers[key]
        if name in buffers:
            return buffers[name]
        return self.files[key].map()[1][name]

    def discard(self, key: str) -> None:
        super().discard(key)
        self._buffers.pop(key, None)

    def close(self) -> None:
        self._buffers.clear()
        super().close()

    def stats(self) -> dict[str, int]:
        held = sum(t.numel() * t.element_size() for group in self._buffers.values() for t in group.values())
        return {"pageable_bytes": held, **super().stats()}


class DiskStorage(GroupFileStorage):
    """Offloaded groups wait in safetensors files under ``offload_dir``, read back on each onload.

    While a group is offloaded, only its file holds its weights; a group on a CPU device computes
    from a private mapping of its file that is dropped with the offload, a group going to a GPU is
    read through a small page-locked staging buffer.

    ``offload_dir``: where the files go (default: a private temporary folder, removed at
    ``remove()`` and at exit). Files are named by a digest of their content and written atomically;
    an existing file with the right content is reused, so a second run starts without writing.

    Option ``keep_files`` (default False): leave the files this session wrote after ``remove()``,
    for the next run to reuse; needs ``offload_dir``.
    """

    name = "disk"

    def cost(self, device: torch.device) -> StorageCost:
        # every onload reads the file; the ranks of one machine read the same files (the kit's shared_folder)
        return copying_cost("disk", device, disk=1.0, shared_by_ranks=True)

    #: files on tmpfs are RAM: the point of this storage is lost
    warn_in_ram = True
    description = "safetensors files, one per group, read back on each onload (RAM: only what is on the device)"

    def session(self, store: GroupFileStore, device: torch.device) -> DiskSession:
        return DiskSession(store, device)
