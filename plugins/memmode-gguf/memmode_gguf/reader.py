"""The ``gguf`` reader: GGUF files, as llama.cpp's tools and city96's ComfyUI-GGUF converter write them.

The header is parsed with llama.cpp's own Python package, gguf-py (``gguf.GGUFReader``, which maps the file and
reads only what it parses: no tensor data is read here). Each tensor becomes:

- F32, F16, BF16: a plain :class:`StoredTensor` in its torch shape (GGUF lists dimensions innermost first: the torch
  shape is GGUF's reversed);
- a block type (:data:`~memmode_gguf.blocks.BLOCK_TYPES`): its bytes as a uint8 :class:`StoredTensor`
  ``<key>:blocks`` in GGUF's row layout (the torch shape with its last dimension in bytes: whole blocks per row),
  and an :class:`EncodedTensor` ``<key>`` of the real shape that the type's codec decodes to float32.

A tensor the converter stored reshaped (rows of 256 for a row that does not fit the blocks) has its real shape,
torch order, under ``comfy.gguf.orig_shape.<key>``: the tensor is given back in that shape.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch

from memmode_core.plugin import PAYLOAD, CheckpointError, EncodedTensor, FileContents, Reader, StoredTensor

from .codec import CODECS, GgufCodec

#: GGUF's magic, the file's first four bytes
MAGIC = b"GGUF"
#: where ComfyUI-GGUF keeps a reshaped tensor's real shape (torch order)
ORIG_SHAPE_KEY = "comfy.gguf.orig_shape."
#: the GGML types read as plain tensors, and their torch dtypes
PLAIN_TYPES: dict[str, torch.dtype] = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
#: metadata arrays longer than this are left out of :attr:`FileContents.metadata` (a tokenizer's vocabulary)
METADATA_ARRAY_LIMIT = 16

_INTEGER_VALUES = {
    gguf.GGUFValueType.UINT8,
    gguf.GGUFValueType.INT8,
    gguf.GGUFValueType.UINT16,
    gguf.GGUFValueType.INT16,
    gguf.GGUFValueType.UINT32,
    gguf.GGUFValueType.INT32,
    gguf.GGUFValueType.UINT64,
    gguf.GGUFValueType.INT64,
}


def supported_types() -> str:
    return ", ".join([*PLAIN_TYPES, *CODECS])


class _Header(gguf.GGUFReader):
    """gguf-py's reader, parsing the header only: the tensor records are kept as gguf-py parsed them, and no view
    of their data is made (a data range past the end of the file is this module's to report, by tensor)."""

    def _build_tensors(self, start_offs: int, fields: list[gguf.ReaderField]) -> None:
        self.tensor_fields = fields


class GgufReader(Reader):
    name = "gguf"
    description = (
        "GGUF files (llama.cpp, city96's ComfyUI-GGUF): F32, F16, BF16 tensors, and weights in the block types "
        "Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K to Q6_K, and the i-quants IQ1_S to IQ4_XS decoded by the forward"
    )
    suffixes = (".gguf",)

    def reads(self, path: Path, head: bytes) -> bool:
        return head.startswith(MAGIC)

    def codecs(self) -> Mapping[str, GgufCodec]:
        """Every block type's codec by its format name (``gguf_q4_k``): what reads back a model saved with
        ``memmode.save_quantized`` after it was loaded from a GGUF file."""
        return {codec.format_name: codec for codec in CODECS.values()}

    def read(self, path: Path) -> FileContents:
        path = Path(path)
        size = path.stat().st_size
        try:
            header = _Header(path)
        except Exception as error:  # gguf-py raises whatever numpy does on a damaged header
            raise CheckpointError(
                f"{path}: not a readable GGUF file (its header is damaged or truncated: "
                f"{type(error).__name__}: {error})"
            ) from error
        try:
            if header.byte_order != "I":
                raise CheckpointError(f"{path}: a GGUF file of the other byte order, which memmode-gguf does not read")
            fields = getattr(header, "tensor_fields", None)
            if fields is None:  # a gguf-py that builds tensors elsewhere: take its records
                fields = [tensor.field for tensor in header.tensors]
            stored: dict[str, StoredTensor] = {}
            encoded: dict[str, EncodedTensor] = {}
            for field in fields:
                self._tensor(path, size, header, field, stored, encoded)
            return FileContents(stored, encoded, metadata=_metadata(header), size=size)
        finally:
            del header  # the mapping of the file goes with it

    def _tensor(
        self,
        path: Path,
        size: int,
        header: gguf.GGUFReader,
        field: gguf.ReaderField,
        stored: dict[str, StoredTensor],
        encoded: dict[str, EncodedTensor],
    ) -> None:
        _, name_data, _, dims, raw_type, offset = field.parts
        key = bytes(name_data).decode("utf-8", errors="replace")
        if key in stored or key in encoded:
            raise CheckpointError(f"{path}: tensor {key!r} is in the file twice")
        try:
            type_name = gguf.GGMLQuantizationType(int(raw_type[0])).name
        except ValueError:
            raise CheckpointError(
                f"{path}: tensor {key!r} has GGML type number {int(raw_type[0])}, which is no GGML type gguf-py "
                f"knows; memmode-gguf reads {supported_types()}"
            ) from None
        if type_name not in PLAIN_TYPES and type_name not in CODECS:
            raise CheckpointError(
                f"{path}: tensor {key!r} is stored as {type_name}, which memmode-gguf cannot decode; it reads "
                f"{supported_types()}"
            )
        shape = tuple(int(dim) for dim in reversed(dims.tolist()))  # torch order
        count = math.prod(shape)
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
        if shape and shape[-1] % block:
            raise CheckpointError(
                f"{path}: tensor {key!r} of shape {shape} has rows of {shape[-1]} values, not whole {type_name} "
                f"blocks of {block}"
            )
        start = header.data_offset + int(offset[0])
        end = start + count // block * type_size
        if end > size:
            raise CheckpointError(
                f"{path}: tensor {key!r} ({type_name}, shape {shape}) lies at bytes {start} to {end}, past the end "
                f"of the file ({size} bytes): the file is truncated"
            )
        real = _orig_shape(path, header, key, count) or shape
        if type_name in PLAIN_TYPES:
            stored[key] = StoredTensor(key, PLAIN_TYPES[type_name], real, start, end)
            return
        part = f"{key}:blocks"
        row_bytes = shape[-1] // block * type_size if shape else type_size
        stored[part] = StoredTensor(part, torch.uint8, (*shape[:-1], row_bytes), start, end)
        encoded[key] = EncodedTensor(key, real, torch.float32, CODECS[type_name], {PAYLOAD: part})


def _orig_shape(path: Path, header: gguf.GGUFReader, key: str, count: int) -> tuple[int, ...] | None:
    """``comfy.gguf.orig_shape.<key>``, checked: an array of integers of ``count`` elements in all."""
    field = header.get_field(ORIG_SHAPE_KEY + key)
    if field is None:
        return None
    if len(field.types) != 2 or field.types[0] != gguf.GGUFValueType.ARRAY or field.types[1] not in _INTEGER_VALUES:
        raise CheckpointError(
            f"{path}: {ORIG_SHAPE_KEY}{key} should be an array of integers, the real shape of tensor {key!r}; it is "
            f"{[t.name for t in field.types]}"
        )
    shape = tuple(int(field.parts[index][0]) for index in field.data)
    if any(dim < 0 for dim in shape) or math.prod(shape) != count:
        raise CheckpointError(
            f"{path}: {ORIG_SHAPE_KEY}{key} says tensor {key!r} is of shape {shape}, but the file stores "
            f"{count} values for it"
        )
    return shape


def _metadata(header: gguf.GGUFReader) -> dict[str, str]:
    """The file's key-value metadata as strings: strings, numbers and booleans, and arrays of at most
    :data:`METADATA_ARRAY_LIMIT` of them (a vocabulary is left out); gguf-py's own ``GGUF.*`` records are not."""
    metadata: dict[str, str] = {}
    for key, field in header.fields.items():
        if key.startswith("GGUF.") or not field.types:
            continue
        try:
            if field.types[0] == gguf.GGUFValueType.ARRAY:
                if len(field.data) > METADATA_ARRAY_LIMIT:
                    continue
                metadata[key] = str(field.contents())
            else:
                value = field.contents()
                metadata[key] = str(value.item() if isinstance(value, np.generic) else value)
        except Exception:  # a value gguf-py cannot show (bytes that are not UTF-8): left out
            continue
    return metadata
