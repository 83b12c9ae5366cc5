"""Plugins defined in the test suite, registered in-process with ``memmode_core.temporary_plugin``.

``Int8Rows`` is a complete third-party quantizer in a page: int8 with one scale per output channel.

``PoisonStorage`` keeps weights elsewhere and leaves a NaN placeholder in each parameter while it
is offloaded, so a weight used without being onloaded turns the output into NaN. On a CPU-only
machine, where "onloading" with the ``ram`` storage changes no data, this is what proves that the
hooks onload every group before it computes (reads outside a forward are served from it, as from ``disk``).
``FailingStorage`` fails half-way through storing, to see a refused ``apply`` change nothing.
"""

from __future__ import annotations

import torch

from memmode_core import Quantizer, Storage, StorageSession, StorageUnavailableError, hookimpl
from memmode_core.contracts.storage import placeholder
from memmode_core.engine.streams import active


class PoisonSession(StorageSession):
    def __init__(self) -> None:
        self.groups: dict[str, dict[str, torch.Tensor]] = {}
        self.fetches = 0

    def put(self, key, tensors, readable=frozenset()):
        self.groups[key] = {name: t.detach().clone() for name, t in tensors.items()}
        return {name: self.groups[key][name] if name in readable else placeholder(t) for name, t in tensors.items()}

    def fetch(self, key, device, stream=None):
        self.fetches += 1
        streams = active()  # through the stream layer, so that the strict model sees the copies
        return {name: streams.to_device(t.clone(), device) for name, t in self.groups[key].items()}

    def restore(self, key):
        return self.groups[key]

    def discard(self, key):
        self.groups.pop(key, None)

    def close(self):
        self.groups.clear()


class PoisonStorage(Storage):
    name = "poison"
    description = "test storage: NaN placeholders while offloaded"
    #: what ``open`` makes (a subclass's sessions may fail on purpose)
    session = PoisonSession

    def open(self, *, device, offload_dir, options):
        return self.session()


class FailingSession(PoisonSession):
    """Accepts the reservation, then fails on the third group it is asked to store (disk full, I/O error)."""

    def put(self, key, tensors, readable=frozenset()):
        if len(self.groups) == 2:
            raise StorageUnavailableError(f"test storage: no room left for {key}")
        return super().put(key, tensors, readable)


class FailingStorage(PoisonStorage):
    name = "failing"
    description = "test storage: fails half-way through storing"
    session = FailingSession


class StoragePlugin:
    """A plugin registering one storage."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    @hookimpl
    def memmode_register_storages(self, register):
        register(self.storage)


class PoisonPlugin(StoragePlugin):
    def __init__(self) -> None:
        super().__init__(PoisonStorage())


class Int8Rows(Quantizer):
    name = "qint8"
    description = "test quantizer: int8, one scale per output channel"

    def pack(self, weight):
        scale = weight.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        return {
            "weight_packed": (weight.float() / scale).round().clamp(-127, 127).to(torch.int8),
            "weight_scale": scale,
        }

    def unpack(self, packed, shape, dtype):
        return packed["weight_packed"].to(dtype) * packed["weight_scale"].to(dtype)


class Int8Plugin:
    @hookimpl
    def memmode_register_quantizers(self, register):
        register(Int8Rows())
