"""How a group's tensors sit side by side in one flat buffer (a file's data section, a pinned slab).

Tensors are ordered by element size, largest first, then by name. Every tensor's size is a
multiple of its element size, so when the buffer starts suitably aligned, every tensor starts at a
multiple of its own element size and the buffer can be viewed as typed tensors without a copy.

``align`` pads each tensor's start to a multiple of that many bytes. Buffers the CPU computes from
directly (a mapped group file) use 64, the alignment of PyTorch's own CPU allocations: BLAS kernels
pick their code path by the address of the weights, and a weight at another alignment can give a
different last bit — memmode's lossless modes are bit-exact, so the weights must sit as a fresh
tensor would. Buffers only ever copied from (a pinned slab) need no padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memmode_core.contracts.storage import Tensors


@dataclass(frozen=True)
class Entry:
    """One tensor's place in the buffer: bytes ``[start, end)``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def pack(tensors: Tensors, align: int = 1) -> tuple[Entry, ...]:
    """Where each tensor goes, in buffer order; the last entry's ``end`` is the buffer size."""
    entries, offset = [], 0
    for name, tensor in sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0])):
        offset += -offset % align
        size = tensor.numel() * tensor.element_size()
        entries.append(Entry(name, tensor.dtype, tuple(tensor.shape), offset, offset + size))
        offset += size
    return tuple(entries)


def packed_size(entries: tuple[Entry, ...]) -> int:
    return entries[-1].end if entries else 0


def views(flat: torch.Tensor, entries: tuple[Entry, ...], offset: int = 0) -> Tensors:
    """Typed views of the ``uint8`` tensor ``flat``, whose byte ``offset`` is where the packing starts."""
    out = {}
    for entry in entries:
        if entry.end == entry.start:
            out[entry.name] = torch.empty(entry.shape, dtype=entry.dtype)
        else:
            out[entry.name] = flat[offset + entry.start : offset + entry.end].view(entry.dtype).view(entry.shape)
    return out
