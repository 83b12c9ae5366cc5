"""A tensor subclass by its inner tensors: what a storage is handed of a weight another library quantized.

torchao's and optimum-quanto's quantized weights are *wrapper* tensor subclasses: the tensor a model registers
holds no bytes of its own (its ``data_ptr`` is 0), its values are computed from plain tensors it holds as
attributes (torchao's ``Int8Tensor``: ``qdata``, ``scale``, ``zero_point``; quanto's ``WeightQBitsTensor``:
a ``PackedTensor`` of 4-bit pairs, ``_scale``, ``_shift``). torch names that structure by a protocol:
``__tensor_flatten__()`` gives the attribute names of the inner tensors and a context (everything else: block
sizes, the quantized type, the dtype it computes in), and ``cls.__tensor_unflatten__(inner, context, size,
stride)`` builds the tensor again from them. An inner tensor may itself be a subclass (quanto's packed data).

So a weight a library quantized is kept by its *leaves*, the plain tensors at the bottom of that tree
(:func:`flatten`), and given back by rebuilding the tree over the leaves a storage hands back (:meth:`Tree.rebuild`):
on the compute device when the leaves were copied there, at rest over whatever the storage left (a host copy, a
mapped view of a group file, a placeholder). Storages never see a subclass, and so every storage serves them
alike — :mod:`memmode_core.engine.flattened` does this for every session in one place.

Why the tree (class, context, shape) is kept in memory and never written into a group file: a group file is read
back only by the session that wrote it, whose model holds the same weights (a file reused by name is verified
against them byte for byte), and a context is arbitrary Python (dtypes, enums, a library's config objects) that
the safetensors header, strings only, could hold only pickled — a file that runs code when it is read.

A tensor whose values are not in bytes memmode can copy is refused (:func:`unstorable`): a ``DTensor`` (its
local shard is one rank's part of the weight; FSDP2 and tensor parallelism move it themselves), and a wrapper
subclass that does not implement the protocol.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

#: joins a slot's name and the path of an inner tensor in the names a storage sees (``to_q.weight:qdata``); no
#: parameter or attribute name holds it
SEPARATOR = ":"

#: the class attribute by which a class that stands in for a subclass while it rests (the engine's stand-ins,
#: :mod:`memmode_core.engine.standins.classes`) names the class it stands for: a tree is built of that one
STANDS_FOR = "__memmode_stands_for__"

_DISABLE = torch._C.DisableTorchFunctionSubclass


def is_wrapper(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a wrapper subclass that implements torch's flatten protocol (a library's quantized
    tensor, a ``DTensor``): its values are its inner tensors', not its own bytes."""
    return is_wrapper_class(type(tensor))


def is_wrapper_class(cls: type) -> bool:
    """Whether tensors of class ``cls`` are wrapper subclasses that implement the flatten protocol."""
    return cls is not torch.Tensor and hasattr(cls, "__tensor_flatten__") and hasattr(cls, "__tensor_unflatten__")


def is_dtensor_class(cls: type) -> bool:
    """Whether ``cls`` is torch.distributed's ``DTensor`` (or a subclass), known by name: importing
    ``torch.distributed`` to compare would cost every process that never uses it."""
    return any(base.__name__ == "DTensor" for base in cls.__mro__)


@dataclass(frozen=True)
class Opaque:
    """An inner attribute the flatten protocol names that is not a tensor (torch lets a subclass name opaque
    objects, a ``DTensor`` its device mesh): kept as it is."""

    value: object


@dataclass(frozen=True)
class Tree:
    """How a wrapper subclass is made of its inner tensors: enough to build it again over other leaves.

    ``children``: inner attribute name -> its own tree (an inner subclass), None (a plain leaf) or an
    :class:`Opaque` object."""

    cls: type
    context: object
    size: torch.Size
    stride: tuple[int, ...]
    children: tuple[tuple[str, Tree | Opaque | None], ...]

    def paths(self, prefix: str = "") -> Iterator[str]:
        """The paths of the leaves, in order (``qdata``, ``_data:_data`` for quanto's packed 4-bit data)."""
        for name, child in self.children:
            path = f"{prefix}{SEPARATOR}{name}" if prefix else name
            if child is None:
                yield path
            elif isinstance(child, Tree):
                yield from child.paths(path)

    def rebuild(self, leaves: Mapping[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
        """The subclass over ``leaves`` (path -> plain tensor, on any one device), as its class builds it."""
        inner = {}
        for name, child in self.children:
            path = f"{prefix}{SEPARATOR}{name}" if prefix else name
            if child is None:
                inner[name] = leaves[path]
            elif isinstance(child, Tree):
                inner[name] = child.rebuild(leaves, path)
            else:
                inner[name] = child.value
        return self.cls.__tensor_unflatten__(inner, self.context, self.size, self.stride)


def flatten(tensor: torch.Tensor) -> tuple[Tree, dict[str, torch.Tensor]]:
    """A wrapper subclass's tree and its leaves by path (the leaves are the tensor's own inner tensors: nothing is
    copied)."""
    names, context = tensor.__tensor_flatten__()
    children: list[tuple[str, Tree | Opaque | None]] = []
    leaves: dict[str, torch.Tensor] = {}
    for name in names:
        inner = getattr(tensor, name)
        if not isinstance(inner, torch.Tensor):
            children.append((name, Opaque(inner)))
        elif is_wrapper(inner):
            tree, below = flatten(inner)
            children.append((name, tree))
            leaves.update({f"{name}{SEPARATOR}{path}": leaf for path, leaf in below.items()})
        else:
            children.append((name, None))
            leaves[name] = inner
    with _DISABLE():
        size, stride = tensor.size(), tuple(tensor.stride())
    cls = vars(type(tensor)).get(STANDS_FOR, type(tensor))
    return Tree(cls, context, size, stride, tuple(children)), leaves


def leaves(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s values: its leaves if it is a wrapper subclass, else itself."""
    return list(flatten(tensor)[1].values()) if is_wrapper(tensor) else [tensor]


def stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes a storage keeps of ``tensor`` and an onload moves: its leaves' (a wrapper subclass's
    ``numel() * element_size()`` is its dequantized size, four times an int8 weight's bytes)."""
    with _DISABLE():
        if unstorable(tensor) is not None:  # its own size, as it is counted where it stays in place
            return tensor.numel() * tensor.element_size()
        return sum(leaf.numel() * leaf.element_size() for leaf in leaves(tensor))


def unstorable(tensor: torch.Tensor) -> str | None:
    """Why ``tensor``'s values cannot be kept by a storage as bytes (None when they can): a ``DTensor``, or a
    subclass with no bytes of its own and no flatten protocol, at any depth."""
    cls = type(tensor)
    if is_dtensor_class(cls):
        return "a DTensor (a shard of a weight split across ranks by FSDP2 or tensor parallelism)"
    if is_wrapper(tensor):
        for leaf in flatten(tensor)[1].values():
            why = unstorable(leaf)
            if why is not None:
                return why
        return None
    with _DISABLE():
        no_bytes = tensor.numel() > 0 and tensor.device.type != "meta" and tensor.data_ptr() == 0
    if no_bytes:
        return (
            f"a {cls.__name__}, a tensor subclass whose values are not bytes of its own and that does not "
            f"implement torch's flatten protocol (__tensor_flatten__ / __tensor_unflatten__)"
        )
    return None
