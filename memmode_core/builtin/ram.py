"""The ``ram`` storage: offloaded weights wait in ordinary (pageable) CPU memory.

The copy it keeps is the tensor the model already had when that lives on the CPU, so applying a
mode to a model built on the CPU costs no memory at all. Copies to a GPU from pageable memory are
synchronous; the ``pinned`` storage plugin is the asynchronous one.
"""

from __future__ import annotations

import torch

from memmode_core.contracts.hookspecs import hookimpl
from memmode_core.contracts.options import Options
from memmode_core.contracts.storage import Storage, StorageSession, Tensors, host_copy
from memmode_core.contracts.storage_cost import StorageCost, copying_cost
from memmode_core.contracts.versions import KIT_VERSION
from memmode_core.engine.streams import active


class RamSession(StorageSession):
    def __init__(self) -> None:
        self._groups: dict[str, Tensors] = {}
        self.streams = active()

    def put(self, key: str, tensors: Tensors, readable: frozenset[str] = frozenset()) -> Tensors:
        copies = {name: host_copy(t) for name, t in tensors.items()}
        self._groups[key] = copies
        return copies

    def fetch(self, key: str, device: torch.device, stream=None) -> Tensors:
        # on the current stream: the engine makes its copy stream current around a prefetch
        return {name: self.streams.to_device(t, device) for name, t in self._groups[key].items()}

    def zero_copy(self, device: torch.device) -> bool:
        return self.streams.is_host(device)

    def restore(self, key: str) -> Tensors:
        return self._groups[key]

    def discard(self, key: str) -> None:
        self._groups.pop(key, None)

    def close(self) -> None:
        self._groups.clear()

    def stats(self) -> dict[str, int]:
        seen: set[int] = set()
        total = 0
        for tensors in self._groups.values():
            for t in tensors.values():
                if id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
        return {"pageable_bytes": total}


class RamStorage(Storage):
    name = "ram"
    description = "pageable CPU memory (synchronous copies; always available)"

    def open(self, *, device: torch.device, offload_dir: str | None, options: Options) -> StorageSession:
        return RamSession()

    def cost(self, device: torch.device) -> StorageCost:
        return copying_cost("pageable", device, pageable=1.0, zero_copy_on_cpu=True)


#: a built-in plugin is built for the kit of its own core
MEMMODE_KIT = KIT_VERSION


@hookimpl
def memmode_register_storages(register):
    register(RamStorage())
