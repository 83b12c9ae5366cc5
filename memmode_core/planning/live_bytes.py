"""Counting the device memory a forward needs: every storage its operations make, alive until its last tensor
dies, plus the workspace each kernel allocates for itself while it runs (:mod:`memmode_core.planning.workspace`).

The count is a dispatch mode, so it sees the same operations whether the tensors are real (the reference a test
compares with) or fake (the prediction :mod:`memmode_core.planning.trace` makes before a call runs).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memmode_core.planning.workspace import workspace_bytes


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors the dispatched operations made that are still alive, and their peak.

    A storage counts once however many views of it live, from its first tensor to the death of its last;
    :meth:`add` counts tensors that exist already (the inputs). Given a ``device``, each operation's kernel
    workspace on it (:func:`memmode_core.planning.workspace.workspace_bytes`) counts too, for the moment the
    operation runs, on top of everything live with its outputs; the operations whose workspace there is not
    modelled are collected in ``unmodelled``."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.device = device
        self.unmodelled: set[str] = set()
        self._refs: dict[int, list[int]] = {}

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [1, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        outputs = out if isinstance(out, (tuple, list)) and len(returns) > 1 else (out,)
        for value, declared in zip(outputs, returns):
            # an alias (a view, an in-place result) of a tensor from before the call — a weight's transpose,
            # a weight converted to fake — makes no memory; an alias of a counted one keeps it alive
            aliases = declared.alias_info is not None
            for tensor in tree_flatten(value)[0]:
                if isinstance(tensor, torch.Tensor) and (not aliases or tensor.untyped_storage()._cdata in self._refs):
                    self.add(tensor)
        if self.device is not None:
            workspace = workspace_bytes(func, args, kwargs or {}, self.device)
            if workspace is None:
                self.unmodelled.add(str(func.overloadpacket))
            else:
                self.peak = max(self.peak, self.live + workspace)
        return out
