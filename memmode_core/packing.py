"""How a group's tensors sit side by side in one flat buffer (a file's data section, a pinned slab).

Tensors are ordered by element size, largest first, then by name. Every tensor's size is a
multiple of its element size, so when the buffer starts suitably aligned, every tensor starts at a
multiple of its own element size and the buffer can be viewed as typed tensors without a copy —
no padding needed, which is what keeps packed copies exactly the size of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .storage import Tensors


@dataclass(frozen=True)
class Entry:
    """One tensor's place in the buffer: bytes ``[start, end)``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def pack(tensors: Tensors) -> tuple[Entry, ...]:
    """Where each tensor goes, in buffer order; the last entry's ``end`` is the buffer size."""
    entries, offset = [], 0
    for name, tensor in sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0])):
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
            out[entry.name] = flat[offset + entry.start:offset + entry.end].view(entry.dtype).view(entry.shape)
    return out
