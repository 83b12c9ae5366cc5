"""The layout of one group file: where each tensor's bytes lie in a safetensors file, and its exact header.

The ``disk`` and ``mmap`` storages keep each offloaded group in one file in the safetensors format
(:mod:`memmode_core.files.store` decides when to write one). This module is the layout itself, with no
policy: the dtype names of the format, where each of a group's tensors lies, the header bytes, and a
tensor's bytes as memory. The bytes are written and read back by :mod:`memmode_core.files.readwrite`,
named by :mod:`memmode_core.files.naming` and mapped by :mod:`memmode_core.files.mapping`.

Why memmode writes the format itself rather than calling ``safetensors.torch.save_file``:

- the layout is chosen for mapping: tensors are packed by :mod:`memmode_core.contracts.packing` (every
  tensor at a multiple of its own element size) and the header is padded so that the data starts
  on a 64-byte boundary, so a mapping can be viewed as typed tensors without a copy;
- the bytes are written straight from the tensors' memory (:func:`byte_view`; ``save_file`` first copies
  every tensor into a ``bytes`` object: one extra group in RAM);
- the name and the verification need the exact bytes, header included, computed once (:class:`FileLayout`).

The files remain ordinary safetensors files: ``safetensors.safe_open`` reads them.
"""

from __future__ import annotations

import ctypes
import json
import struct
from dataclasses import dataclass
from functools import cached_property

import torch

from memmode_core.contracts.errors import IncompatibleModeError
from memmode_core.contracts.inner_tensors import unstorable
from memmode_core.contracts.packing import Entry, pack, packed_size
from memmode_core.contracts.storage import Tensors, data_class, has_own_bytes


def _dtype_names() -> dict[torch.dtype, str]:
    """torch dtype -> safetensors dtype name (the names the safetensors specification defines)."""
    names = {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
        torch.complex64: "C64",
    }
    for attr, code in (
        ("float8_e4m3fn", "F8_E4M3"),
        ("float8_e5m2", "F8_E5M2"),
        ("uint16", "U16"),
        ("uint32", "U32"),
        ("uint64", "U64"),
    ):
        if hasattr(torch, attr):  # dtypes that older torch releases lack
            names[getattr(torch, attr)] = code
    return names


DTYPE_NAMES = _dtype_names()
#: where the data starts, and every tensor in it, is aligned to this (see :mod:`memmode_core.contracts.packing`)
DATA_ALIGNMENT = 64
#: names of the zero-filled byte tensors that fill alignment gaps (safetensors allows no holes)
PADDING_PREFIX = "__memmode_padding__."


class UnsupportedDtypeError(TypeError):
    """A tensor whose dtype the safetensors format has no name for."""


@dataclass(frozen=True)
class FileLayout:
    """Where each tensor of a group lies in its file, and the exact header bytes."""

    entries: tuple[Entry, ...]
    #: everything before the data: the 8-byte little-endian header length and the padded JSON
    header: bytes

    @property
    def data_start(self) -> int:
        return len(self.header)

    @cached_property
    def data_bytes(self) -> int:
        return packed_size(self.entries)

    @cached_property
    def file_size(self) -> int:  # cached: read at the check before every onload
        return self.data_start + self.data_bytes

    @classmethod
    def of(cls, tensors: Tensors, metadata: dict[str, str] | None = None) -> FileLayout:
        """The layout of ``tensors`` (only their names, dtypes and shapes are read: meta tensors will do);
        ``metadata`` joins the header's ``__metadata__``."""
        entries = pack(tensors, align=DATA_ALIGNMENT)
        for entry in entries:
            if entry.dtype not in DTYPE_NAMES:
                raise UnsupportedDtypeError(f"{entry.name}: dtype {entry.dtype} cannot be stored in a safetensors file")
        described = {}
        end = 0
        for e in entries:
            if e.start > end:  # safetensors allows no holes: the alignment padding is a named byte tensor
                described[f"{PADDING_PREFIX}{end}"] = {
                    "dtype": "U8",
                    "shape": [e.start - end],
                    "data_offsets": [end, e.start],
                }
            described[e.name] = {
                "dtype": DTYPE_NAMES[e.dtype],
                "shape": list(e.shape),
                "data_offsets": [e.start, e.end],
            }
            end = e.end
        described["__metadata__"] = {**(metadata or {}), "format": "pt", "writer": "memmode"}
        text = json.dumps(described, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % DATA_ALIGNMENT)  # the format allows trailing spaces
        return cls(tuple(entries), struct.pack("<Q", len(text)) + text)


def host_tensors(tensors: Tensors) -> Tensors:
    """The tensors as contiguous CPU tensors whose memory is their plain bytes (a copy only if needed).

    A wrapper tensor subclass has no bytes of its own to write: its ``data_ptr`` is not its values', and reading
    there crashes the process. A library's quantized tensor never gets here (the engine hands a storage its inner
    tensors: :mod:`memmode_core.engine.flattened`); one that cannot be stored so (a ``DTensor`` sharded by FSDP2 or
    tensor parallelism, a subclass without the flatten protocol) is refused, typed, before a byte is read."""
    out = {}
    for name, tensor in tensors.items():
        why = unstorable(tensor) or (None if has_own_bytes(tensor) else f"a {data_class(tensor).__name__}")
        if why is not None:
            raise IncompatibleModeError(
                f"{name} is {why}, whose values are not the bytes of one tensor: it cannot be written to a group file"
            )
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        out[name] = t.resolve_conj().resolve_neg().contiguous()
    return out


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy; the tensor must outlive the view."""
    size = tensor.numel() * tensor.element_size()
    if size == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * size).from_address(tensor.data_ptr())).cast("B")
