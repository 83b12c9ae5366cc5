"""The ``comfy`` reader: which safetensors files are ComfyUI's, and what their header says lies where.

A file is ComfyUI's when its header holds a float8 tensor, the legacy ``scaled_fp8`` marker, a
``_quantization_metadata`` entry in its metadata, or ``<layer>.comfy_quant`` tensors (see the package's
docstring for the forms). Reading it:

1. the header is parsed — the safetensors dtypes core knows, and the E8M0 scales of mxfp8 (``F8_E8M0``) as the
   bytes they are — and every byte range checked against the file's size (core's
   :meth:`~memmode_core.files.checkpoint.CheckpointFile.of_records`);
2. the layers the file declares quantized are gathered from ``_quantization_metadata`` and from the
   ``comfy_quant`` markers (their few bytes are read); each is read by its format
   (:mod:`~memmode_core.builtin.comfy.formats`), which checks its tensors and refuses what it does not read;
3. float8 weights no declaration names are the legacy "fp8 scaled" form (a ``scale_weight`` or ``weight_scale``
   beside them) or plain casts;
4. every other tensor is stored as it is; the markers are left out, and a scale whose weight is not quantized
   is refused.

Nothing but the header, the markers and the scales of a tensor or a row is read.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import torch

from memmode_core.builtin.comfy import codecs
from memmode_core.builtin.comfy.formats import ALIASES, INPUT_SCALES, Layer, Read, read_float8, read_layer
from memmode_core.contracts.errors import CheckpointError
from memmode_core.contracts.quantizer import Quantizer
from memmode_core.contracts.reader import EncodedTensor, FileContents, Reader, StoredTensor
from memmode_core.files.checkpoint import MAX_HEADER_BYTES, METADATA_KEY, TORCH_DTYPES, CheckpointFile, TensorRecord
from memmode_core.files.file_layout import PADDING_PREFIX

#: the float8 types of safetensors, by the name the format gives them
FLOAT8 = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
#: dtypes of Comfy files core's safetensors reading does not name, read as the bytes they are (mxfp8's E8M0 scales)
BYTE_DTYPES = {"F8_E8M0": torch.uint8}
QUANTIZATION_METADATA = "_quantization_metadata"
COMFY_QUANT = ".comfy_quant"
#: ComfyUI's legacy marker: ``scaled_fp8`` or ``<model prefix>scaled_fp8``
MARKER = "scaled_fp8"
#: a float8 weight's scale in the legacy forms: ``<layer>.scale_weight`` and ``<layer>.weight_scale``
LEGACY_SCALES = (".scale_weight", ".weight_scale")
#: the tensors of a quantized layer beside its weight: none may be left over once the layers are read
LAYER_PARTS = (".scale_weight", ".weight_scale", ".weight_scale_2", ".weight_zeros", ".weight_zero", *INPUT_SCALES)
#: what a header of this dialect holds somewhere, as bytes: a file without any is not parsed further
SIGNS = (
    *(f'"{name}"'.encode() for name in FLOAT8),
    MARKER.encode(),
    QUANTIZATION_METADATA.encode(),
    COMFY_QUANT.encode(),
)
#: a ``comfy_quant`` marker is a short JSON object; anything longer is not one
MAX_MARKER_BYTES = 1 << 16


class ComfyReader(Reader):
    """Reads ComfyUI's safetensors files: fp8 scaled (both forms), plain fp8 casts, and the mixed-precision files
    whose layers are each in a format of its own (nvfp4, mxfp8, int8, awq_w4a16, fp8) beside full-precision ones.

    :meth:`reads` parses the header only when it holds one of :data:`SIGNS`: a plain bf16 or float32 file is
    core's to read; a file that is not safetensors, or whose header does not parse, is left to core too, which
    refuses it naming what is wrong."""

    name = "comfy"
    description = (
        "ComfyUI safetensors: fp8 scaled, plain fp8, and mixed precision (nvfp4, mxfp8, int8, awq_w4a16): "
        "the quantized weights rest packed, decoded per forward"
    )
    # a .safetensors file no reader takes is core's: this dialect claims no file name ending of its own
    suffixes = ()

    def reads(self, path: Path, head: bytes) -> bool:
        header = _header(Path(path), head)
        if header is None:
            return False
        entries = [e for k, e in header.items() if k != METADATA_KEY and isinstance(e, dict)]
        if any(e.get("dtype") in FLOAT8 for e in entries):
            return True
        if any(k == MARKER or k.endswith(("." + MARKER, COMFY_QUANT)) for k in header):
            return True
        metadata = header.get(METADATA_KEY)
        return isinstance(metadata, dict) and QUANTIZATION_METADATA in metadata

    def codecs(self) -> Mapping[str, Quantizer]:
        """Every format's codec by its format name (``comfy_nvfp4``, ``comfy_fp8_e4m3fn``): what reads back a model
        saved with ``memmode.save_quantized`` after it was loaded from a ComfyUI file."""
        return codecs.every_codec()

    def read(self, path: Path) -> FileContents:
        path = Path(path)
        file = _open(path)
        records = file.records
        try:
            with open(path, "rb") as handle:
                reads = _declared_layers(path, file.metadata, records, handle)
                taken = {key for read in reads.values() for key in read.parts}
                reads.update(_undeclared_float8(path, records, taken, handle))
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
        parts = {key: part for read in reads.values() for key, part in read.parts.items()}
        encoded: dict[str, EncodedTensor] = {read.encoded.key: read.encoded for read in reads.values()}
        stored: dict[str, StoredTensor] = {}
        for key, record in records.items():
            if key in parts:
                stored[key] = parts[key]
            elif _marker(key):
                continue
            elif key.endswith(LAYER_PARTS):
                raise _orphan(path, key, records)
            else:
                stored[key] = StoredTensor(key, record.dtype, record.shape, record.start, record.end)
        return FileContents(stored, encoded, metadata=file.metadata, size=file.size)


# -- the header ------------------------------------------------------------------------------------------


def _header(path: Path, head: bytes) -> dict | None:
    """The safetensors header of ``path`` (whose first bytes are ``head``) as parsed JSON, or None when it is not
    one of this dialect: not safetensors, damaged (:meth:`ComfyReader.reads` says no and core refuses the file
    with its own message), or holding none of :data:`SIGNS`."""
    if len(head) < 9 or head[8:9] != b"{":
        return None
    (length,) = struct.unpack("<Q", head[:8])
    try:
        if length > min(MAX_HEADER_BYTES, path.stat().st_size - 8):
            return None
        raw = head[8 : 8 + length]
        if len(raw) < length:
            with open(path, "rb") as file:
                file.seek(8)
                raw = file.read(length)
        if not any(sign in raw for sign in SIGNS):
            return None  # the common case, a plain file: no JSON to parse
        header = json.loads(raw)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return header if isinstance(header, dict) else None


def _open(path: Path) -> CheckpointFile:
    """The file's header as core reads safetensors, every byte range checked; the dtypes of :data:`BYTE_DTYPES`,
    which core's reading does not name, as the bytes they are."""
    try:
        with open(path, "rb") as file:
            head = file.read(9)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    header = _header(path, head)
    if header is None or not any(isinstance(e, dict) and e.get("dtype") in BYTE_DTYPES for e in header.values()):
        return CheckpointFile.open(path)  # core's own reading, and its messages for a damaged file
    data_start = 8 + struct.unpack("<Q", head[:8])[0]
    records = []
    for key, entry in header.items():
        if key == METADATA_KEY or key.startswith(PADDING_PREFIX):
            continue
        try:
            dtype = BYTE_DTYPES.get(entry["dtype"]) or TORCH_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path}: tensor {key!r} has a header entry memmode cannot read: {entry!r} (unknown dtype)"
            ) from None
        records.append(TensorRecord(key, path, dtype, shape, data_start + begin, data_start + end))
    return CheckpointFile.of_records(path, records, header.get(METADATA_KEY) or {}, path.stat().st_size)


def _marker(key: str) -> bool:
    return key == MARKER or key.endswith(("." + MARKER, COMFY_QUANT))


def _read(handle: BinaryIO, record: TensorRecord) -> bytes:
    handle.seek(record.start)
    data = handle.read(record.nbytes)
    if len(data) != record.nbytes:
        raise CheckpointError(f"{record.path} is truncated: tensor {record.key!r} cannot be read whole")
    return data


def _values(handle: BinaryIO, record: TensorRecord) -> torch.Tensor:
    return torch.frombuffer(bytearray(_read(handle, record)), dtype=record.dtype).reshape(record.shape)


# -- what the file declares --------------------------------------------------------------------------------


def _declared_layers(
    path: Path, metadata: Mapping[str, str], records: Mapping[str, TensorRecord], handle: BinaryIO
) -> dict[str, Read]:
    """Weight key -> its layer read in the format ``_quantization_metadata`` or its ``comfy_quant`` marker
    declares (a marker overrides the metadata, as in ComfyUI, which turns the metadata into markers)."""
    layers: dict[str, tuple[str, object]] = {}  # layer -> (where it was declared, its config)
    raw = metadata.get(QUANTIZATION_METADATA)
    if raw is not None:
        try:
            parsed = json.loads(raw)
            found = parsed["layers"] if isinstance(parsed, dict) else None
        except (ValueError, KeyError, TypeError):
            found = None
        if not isinstance(found, dict):
            raise CheckpointError(
                f"{path}: its {QUANTIZATION_METADATA!r} metadata is not the JSON object "
                f'{{"layers": {{"<layer>": {{"format": ...}}}}}} ComfyUI writes (a damaged header)'
            )
        layers.update({str(layer): (QUANTIZATION_METADATA, config) for layer, config in found.items()})
    for key, record in records.items():
        if not key.endswith(COMFY_QUANT):
            continue
        if record.dtype != torch.uint8 or record.nbytes > MAX_MARKER_BYTES:
            raise CheckpointError(f"{path}: tensor {key!r} is not a ComfyUI layer marker (uint8 JSON bytes)")
        try:
            config = json.loads(_read(handle, record))
        except (ValueError, UnicodeDecodeError):
            raise CheckpointError(
                f"{path}: tensor {key!r} is not a ComfyUI layer marker (its bytes are not JSON)"
            ) from None
        layers[key.removesuffix(COMFY_QUANT)] = (key, config)
    reads = {}
    for name, (where, config) in layers.items():
        config = config if isinstance(config, dict) else {"format": config}  # some tools write the format alone
        declared = config.get("format")
        if not isinstance(declared, str):
            raise CheckpointError(f"{path}: layer {name!r} is declared quantized (by {where}) without a format name")
        weight = _weight_of(path, name, records, where)
        layer = Layer(
            path,
            weight,
            ALIASES.get(declared, declared),
            config,
            where,
            records,
            lambda record: _values(handle, record),
        )
        reads[weight] = read_layer(layer)
    return reads


def _weight_of(path: Path, layer: str, records: Mapping[str, TensorRecord], where: str) -> str:
    """The key of ``layer``'s weight: ``<layer>.weight``, or the one key that ends with it (some tools name
    the layers without the model's prefix, ``model.diffusion_model.``)."""
    key = f"{layer}.weight"
    if key in records:
        return key
    found = [k for k in records if k.endswith("." + key)]
    if len(found) != 1:
        raise CheckpointError(
            f"{path}: layer {layer!r} is declared quantized (by {where}) but tensor {key!r} "
            + ("is not in the file" if not found else f"matches {len(found)} tensors: {found[:3]}")
        )
    return found[0]


def _undeclared_float8(
    path: Path, records: Mapping[str, TensorRecord], taken: set[str], handle: BinaryIO
) -> dict[str, Read]:
    """Float8 weights no declaration names (``taken``: the tensors of the declared layers, an nvfp4 layer's fp8
    block scales among them): with a legacy scale beside them (``scale_weight``, or ``weight_scale`` without
    metadata), or plain casts."""
    reads = {}
    for key, record in records.items():
        if record.dtype not in codecs.FLOAT8 or key in taken or _marker(key):
            continue
        prefix = key.removesuffix(".weight")
        scales = [prefix + suffix for suffix in LEGACY_SCALES if prefix + suffix in records]
        if len(scales) > 1:
            raise CheckpointError(f"{path}: tensor {key!r} has two scales, {scales[0]!r} and {scales[1]!r}")
        layer = Layer(path, key, "fp8 scaled", {}, "its float8 dtype", records, lambda r: _values(handle, r))
        reads[key] = read_float8(layer, record.dtype, scales[0] if scales else None)
    return reads


def _orphan(path: Path, key: str, records: Mapping[str, TensorRecord]) -> CheckpointError:
    """The refusal of a layer's scale (or zero points) whose weight is not quantized."""
    prefix = key.rsplit(".", 1)[0]
    weight = records.get(f"{prefix}.weight")
    if weight is None:
        return CheckpointError(f"{path}: tensor {key!r} is a scale without its weight {prefix + '.weight'!r}")
    return CheckpointError(
        f"{path}: tensor {key!r} scales {prefix + '.weight'!r}, which is stored as {weight.dtype}, not float8, "
        f"and which no {QUANTIZATION_METADATA} or comfy_quant declares quantized"
    )
