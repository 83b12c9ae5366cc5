"""The storage session as the engine uses it: every storage sees plain tensors, never a tensor subclass.

A model another library quantized in memory (torchao, optimum-quanto) registers wrapper tensor subclasses, whose
values are the plain tensors they hold (:mod:`memmode_core.contracts.inner_tensors`). A storage copies bytes — to
a file, a page-locked slab, a device — so it can keep only plain tensors. Rather than each storage learning the
subclasses (and each getting one wrong), the engine talks to every session through :class:`FlattenedSession`,
which flattens a subclass into its leaves as a group is ``put`` (named ``<slot>:<path>``: ``to_q.weight:qdata``)
and builds it again over whatever the storage hands back: at rest (a host copy, a mapped view, a placeholder), on
``fetch`` (the leaves on the compute device), on ``restore`` and ``read``. The trees are kept here, in memory, for
the length of the session (why not in the file: :mod:`~memmode_core.contracts.inner_tensors`).

Groups without a subclass pass through unchanged; the registered parameter keeps its identity, class and
``requires_grad`` (the slot takes the rebuilt tensor's contents: :func:`memmode_core.engine.groups.set_data`). A
tensor that cannot be stored (:func:`~memmode_core.contracts.inner_tensors.unstorable`: a ``DTensor``'s leaf is one
rank's shard, not its value) passes through as it is: a storage that keeps it in place (``ram`` on a CPU device)
keeps it, one that copies bytes refuses it before anything is released (the engine's check before it stores, the
group files' own at ``put``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from memmode_core.contracts.inner_tensors import SEPARATOR, Tree, flatten, is_wrapper, unstorable
from memmode_core.contracts.storage import StorageSession, Tensors


def map_leaves(tensor: torch.Tensor, fn) -> torch.Tensor:
    """``fn(tensor)`` for a plain tensor; a wrapper subclass built again over ``fn`` of each of its leaves (a copy to
    another device, made leaf by leaf: a library need not implement the allocation a copy of the whole makes).

    It is the engine's, not the protocol's (:mod:`memmode_core.contracts.inner_tensors`): ``fn`` is the engine's
    own (a stream's copy, a clone), and a contract never calls back into the layer above it."""
    if not is_wrapper(tensor):
        return fn(tensor)
    tree, found = flatten(tensor)
    return tree.rebuild({path: fn(leaf) for path, leaf in found.items()})


class FlattenedSession(StorageSession):
    """``session`` (the storage's own), handed the leaves of every wrapper subclass instead of the subclass."""

    def __init__(self, session: StorageSession) -> None:
        #: the storage's own session, which sees plain tensors only
        self.session = session
        #: group key -> slot name -> the tree its leaves are built back into
        self._trees: dict[str, dict[str, Tree]] = {}

    @property
    def at_rest_can_break(self) -> bool:  # type: ignore[override]
        return self.session.at_rest_can_break

    # -- flattening and building back -------------------------------------------------------------------------

    def put(self, key: str, tensors: Tensors, readable: frozenset[str] = frozenset()) -> Tensors:
        trees: dict[str, Tree] = {}
        flat: Tensors = {}
        flat_readable = set()
        for name, tensor in tensors.items():
            if is_wrapper(tensor) and unstorable(tensor) is None:
                tree, leaves = flatten(tensor)
                trees[name] = tree
                for path, leaf in leaves.items():
                    flat[f"{name}{SEPARATOR}{path}"] = leaf
                    if name in readable:
                        flat_readable.add(f"{name}{SEPARATOR}{path}")
            else:
                flat[name] = tensor
                if name in readable:
                    flat_readable.add(name)
        if trees:
            self._trees[key] = trees
        else:
            self._trees.pop(key, None)
        return self._built(key, self.session.put(key, flat, frozenset(flat_readable)))

    def _built(self, key: str, flat: Tensors) -> Tensors:
        """The slots of group ``key`` from the leaves ``flat`` the storage handed back."""
        trees = self._trees.get(key)
        if not trees:
            return flat
        out = {name: tensor for name, tensor in flat.items() if name.partition(SEPARATOR)[0] not in trees}
        for name, tree in trees.items():
            out[name] = _build(tree, name, flat)
        return out

    def fetch(self, key: str, device: torch.device, stream: torch.Stream | None = None) -> Tensors:
        return self._built(key, self.session.fetch(key, device, stream))

    def restore(self, key: str) -> Tensors:
        return self._built(key, self.session.restore(key))

    def read(self, key: str, name: str) -> torch.Tensor:
        tree = self._trees.get(key, {}).get(name)
        if tree is None:
            return self.session.read(key, name)
        return tree.rebuild({path: self.session.read(key, f"{name}{SEPARATOR}{path}") for path in tree.paths()})

    # -- the rest is the storage's --------------------------------------------------------------------------------

    def reserve(self, sizes: Mapping[str, int]) -> None:
        self.session.reserve(sizes)

    def flush(self) -> None:
        self.session.flush()

    def offloaded(self, key: str, intact: bool = True) -> None:
        self.session.offloaded(key, intact)

    def check(self, key: str) -> None:
        self.session.check(key)

    def zero_copy(self, device: torch.device) -> bool:
        return self.session.zero_copy(device)

    def discard(self, key: str) -> None:
        self._trees.pop(key, None)
        self.session.discard(key)

    def close(self) -> None:
        self._trees.clear()
        self.session.close()

    def stats(self) -> dict[str, int]:
        return self.session.stats()


def _build(tree: Tree, name: str, flat: Tensors) -> torch.Tensor:
    return tree.rebuild({path: flat[f"{name}{SEPARATOR}{path}"] for path in tree.paths()})
