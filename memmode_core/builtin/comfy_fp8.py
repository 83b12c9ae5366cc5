"""The ``comfy_fp8`` reader: float8 safetensors files, as ComfyUI's community reposts have them.

Comfy-Org's repackaged checkpoints and Kijai's Wan files keep a model's linear weights in float8 and say how to
scale them back in one of three ways, all read here:

- **legacy "fp8 scaled"**: ``<layer>.weight`` in float8 (E4M3 or E5M2), a float32 ``<layer>.scale_weight``
  of one element, a marker tensor ``scaled_fp8`` (its dtype names the float8 type; ComfyUI looks for it, with
  the model's key prefix, to switch its loader to scaled weights), and ``<layer>.scale_input`` for
  ComfyUI's fp8 matmuls;
- **quantization metadata** (ComfyUI's ``QUANTIZATION.md``): the header's ``__metadata__`` has
  ``_quantization_metadata``, the JSON ``{"format_version": "1.0", "layers": {"<layer>": {"format":
  "float8_e4m3fn"}, ...}}``, and each layer ``<layer>.weight_scale`` (and ``<layer>.input_scale``). ComfyUI
  turns it into per-layer ``<layer>.comfy_quant`` tensors (JSON bytes) at load, and some files carry those
  instead: both are read. The weight may be float8, or a ``uint8`` container of the same bytes;
- **plain fp8 casts**: float8 weights and no scale at all.

Every float8 tensor becomes an :class:`EncodedTensor` whose payload is the same bytes viewed as ``uint8``,
decoded by :class:`ComfyFloat8` (one codec per float8 type: the type is not stored as a tensor) in float32 —
``weight.float() * scale``, rounded once to the compute dtype — so that a layer holding it *rests packed* at
one byte a weight instead of being upcast whole at load. The markers and the activation scales
(``scaled_fp8``, ``scale_input``, ``input_scale``, ``comfy_quant``) are not the model's and are left out.

Reading is liberal in the names it accepts and strict in what it checks: the header is checked whole (core's
own safetensors parsing, :class:`~memmode_core.files.checkpoint.CheckpointFile`), then every scale must have
its float8 weight, one or ``rows`` elements, and a finite value; a layer declared in a format this reader does
not decode (``nvfp4``, ``int8_blockwise``) is refused rather than read as raw bytes. To check the scales'
values and read the ``comfy_quant`` markers, the reader reads those tensors' few bytes — nothing else.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import torch

from memmode_core.contracts.errors import CheckpointError
from memmode_core.contracts.hookspecs import hookimpl
from memmode_core.contracts.quantizer import PAYLOAD, Quantizer
from memmode_core.contracts.reader import EncodedTensor, FileContents, Reader, StoredTensor
from memmode_core.contracts.versions import KIT_VERSION
from memmode_core.files.checkpoint import MAX_HEADER_BYTES, METADATA_KEY, CheckpointFile, TensorRecord

SCALE = "weight_scale"
#: the float8 types of safetensors, by the name the format gives them and the name ComfyUI's metadata does
FLOAT8 = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
QUANTIZATION_METADATA = "_quantization_metadata"
#: ComfyUI's legacy marker: ``scaled_fp8`` or ``<model prefix>scaled_fp8``
MARKER = "scaled_fp8"
#: a weight's scale, by the name of each form: ``<layer>.scale_weight`` (legacy) and ``<layer>.weight_scale``
SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
#: tensors that are no weight of the model: the activation scales of fp8 matmuls and ComfyUI's layer markers
DROPPED_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")
COMFY_QUANT = ".comfy_quant"
#: what a header of this dialect holds somewhere, as bytes: a file without any is not parsed further
SIGNS = (*(f'"{name}"'.encode() for name in FLOAT8), MARKER.encode(), QUANTIZATION_METADATA.encode())
#: a ``comfy_quant`` marker is a short JSON object; anything longer is not one
MAX_MARKER_BYTES = 1 << 16
#: the dtypes a scale may be stored in: each is exact in float32, where the product is computed
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class ComfyFloat8(Quantizer):
    """The codec of one float8 type: ``weight_packed`` holds the float8 bytes as ``uint8``, the optional
    ``weight_scale`` one float (the whole tensor's) or one per row (``[rows, 1]``).

    The product is computed in float32 and rounded once to ``dtype``: every float8 value and every float32
    scale is exact in float32, so the result is the value ComfyUI's files mean, whatever the compute dtype."""

    packs = False

    def __init__(self, fp8: torch.dtype) -> None:
        self.fp8 = fp8
        self.name = self.format = f"comfy_{fp8_name(fp8)}"
        self.description = f"ComfyUI {fp8_name(fp8)} weights, optionally with a float32 scale (read from files)"

    def unpack(self, packed: Mapping[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        values = packed[PAYLOAD].view(self.fp8).to(torch.float32).reshape(shape)
        scale = packed.get(SCALE)
        if scale is not None:
            scale = scale.to(device=values.device, dtype=torch.float32)
            # one element: the whole tensor's; else one per row (of a row split, the split's rows)
            scale = scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, *([1] * (values.dim() - 1)))
            values = values * scale
        return values.to(dtype)


def fp8_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.").replace("float8", "fp8")


#: one codec per float8 type, shared by every file read
CODECS = {dtype: ComfyFloat8(dtype) for dtype in FLOAT8.values()}


class ComfyFloat8Reader(Reader):
    """Reads safetensors files holding float8 tensors (see the module's docstring for the three forms).

    :meth:`reads` parses the safetensors header (8-byte little-endian length, then JSON) and says yes when a
    tensor is stored as ``F8_E4M3`` or ``F8_E5M2``, when the legacy marker ``scaled_fp8`` is there, or when
    ``_quantization_metadata`` declares a float8 layer (its weights may be ``uint8`` containers). A file
    holding none of these — a plain bf16 or float32 safetensors file — is core's to read; a file that is not
    safetensors, or whose header does not parse, is left to core too, which refuses it naming what is wrong."""

    name = "comfy_fp8"
    description = (
        "ComfyUI fp8 safetensors (fp8 scaled, _quantization_metadata, plain fp8 casts): "
        "the float8 weights rest packed, decoded per forward"
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
        if any(k == MARKER or k.endswith("." + MARKER) for k in header):
            return True
        metadata = header.get(METADATA_KEY)
        raw = metadata.get(QUANTIZATION_METADATA) if isinstance(metadata, dict) else None
        return isinstance(raw, str) and any(f in raw for f in FORMATS)

    def codecs(self) -> Mapping[str, Quantizer]:
        """Each float8 type's codec by its format name (``comfy_fp8_e4m3fn``): what reads back a model saved with
        ``memmode.save_quantized`` after it was loaded from a ComfyUI file."""
        return {codec.format_name: codec for codec in CODECS.values()}

    def read(self, path: Path) -> FileContents:
        path = Path(path)
        file = CheckpointFile.open(path)  # every entry's dtype, byte count and range checked against the size
        records = file.records
        try:
            with open(path, "rb") as handle:
                declared = _declared_formats(path, file.metadata, records, handle)
                scales = _scales(path, records, declared, handle)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
        stored: dict[str, StoredTensor] = {}
        encoded: dict[str, EncodedTensor] = {}
        for key, record in records.items():
            if _dropped(key) or key.endswith(SCALE_SUFFIXES):
                continue
            fp8 = record.dtype if record.dtype in CODECS else declared.get(key)
            if fp8 is None:
                stored[key] = StoredTensor(key, record.dtype, record.shape, record.start, record.end)
                continue
            # the payload: the same bytes as uint8, in the weight's shape (a packed layer's weight is an integer)
            stored[key] = StoredTensor(key, torch.uint8, record.shape, record.start, record.end)
            parts = {PAYLOAD: key}
            if key in scales:
                scale = records[scales[key]]
                # one element is stored 0-dim, [1] or [1, 1] by different tools: the same bytes, given as [1]
                # (a part of one element is shared by a row split; [rows, 1] is split with the rows)
                shape = (1,) if scale.nbytes == scale.dtype.itemsize else scale.shape
                stored[scale.key] = StoredTensor(scale.key, scale.dtype, shape, scale.start, scale.end)
                parts[SCALE] = scale.key
            encoded[key] = EncodedTensor(key, record.shape, torch.float32, CODECS[fp8], parts)
        return FileContents(stored, encoded, metadata=file.metadata, size=file.size)


# -- the header ------------------------------------------------------------------------------------------


def _header(path: Path, head: bytes) -> dict | None:
    """The safetensors header of ``path`` as parsed JSON, or None when it is not one (not safetensors, or damaged:
    :meth:`ComfyFloat8Reader.reads` says no and core refuses the file with its own message)."""
    if len(head) < 9 or head[8:9] != b"{":
        return None
    (length,) = struct.unpack("<Q", head[:8])
    try:
        size = path.stat().st_size
        if length > min(MAX_HEADER_BYTES, size - 8):
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


def _dropped(key: str) -> bool:
    return key == MARKER or key.endswith(("." + MARKER, *DROPPED_SUFFIXES))


def _read(handle: BinaryIO, record: TensorRecord) -> bytes:
    handle.seek(record.start)
    data = handle.read(record.nbytes)
    if len(data) != record.nbytes:
        raise CheckpointError(f"{record.path} is truncated: tensor {record.key!r} cannot be read whole")
    return data


# -- what the file declares --------------------------------------------------------------------------------


def _declared_formats(
    path: Path, metadata: Mapping[str, str], records: Mapping[str, TensorRecord], handle: BinaryIO
) -> dict[str, torch.dtype]:
    """Weight key -> the float8 type its layer is declared in, by ``_quantization_metadata`` and by the
    ``<layer>.comfy_quant`` markers. A declared layer must be float8, and its weight that type or ``uint8``."""
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
    declared = {}
    for layer, (where, config) in layers.items():
        fmt = config.get("format") if isinstance(config, dict) else config  # some tools write the format alone
        if fmt not in FORMATS:
            raise CheckpointError(
                f"{path}: layer {layer!r} is declared in format {fmt!r} (by {where}); the comfy_fp8 reader "
                f"decodes only {' and '.join(FORMATS)}"
            )
        weight = _weight_of(path, layer, records, where)
        record = records[weight]
        if record.dtype not in (FORMATS[fmt], torch.uint8):
            raise CheckpointError(
                f"{path}: tensor {weight!r} is stored as {record.dtype} but declared {fmt} (by {where}): "
                f"the header contradicts itself"
            )
        declared[weight] = FORMATS[fmt]
    return declared


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


def _scales(
    path: Path, records: Mapping[str, TensorRecord], declared: Mapping[str, torch.dtype], handle: BinaryIO
) -> dict[str, str]:
    """Weight key -> the key of its scale, every scale checked: its weight is float8 (or declared), it is a
    float of one element (or one per row, ``[rows, 1]``), finite, and the weight has no other."""
    found: dict[str, str] = {}
    for key, record in records.items():
        suffix = next((s for s in SCALE_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            continue
        weight_key = key.removesuffix(suffix) + ".weight"
        weight = records.get(weight_key)
        if weight is None:
            raise CheckpointError(f"{path}: tensor {key!r} is a scale without its weight {weight_key!r}")
        if weight.dtype not in FLOAT8.values() and weight_key not in declared:
            raise CheckpointError(
                f"{path}: tensor {key!r} scales {weight_key!r}, which is stored as {weight.dtype}, not float8"
            )
        if weight_key in found:
            raise CheckpointError(f"{path}: tensor {weight_key!r} has two scales, {found[weight_key]!r} and {key!r}")
        numel = 1
        for d in record.shape:
            numel *= d
        if numel == 0:
            raise CheckpointError(
                f"{path}: tensor {key!r} is an empty scale (shape {list(record.shape)}): the value of "
                f"{weight_key!r} is unknown (some copies of Comfy-Org's Wan 2.2 files have this; get another)"
            )
        per_row = len(weight.shape) > 1 and numel > 1 and record.shape == (weight.shape[0], 1)
        if numel != 1 and not per_row:
            raise CheckpointError(
                f"{path}: tensor {key!r} has shape {list(record.shape)}: a scale of {weight_key!r} "
                f"{list(weight.shape)} has one element, or one per row ([{weight.shape[0]}, 1])"
            )
        if record.dtype not in SCALE_DTYPES:
            raise CheckpointError(f"{path}: tensor {key!r} is a scale stored as {record.dtype}, not a float")
        values = torch.frombuffer(bytearray(_read(handle, record)), dtype=record.dtype)
        if not torch.isfinite(values).all():
            raise CheckpointError(f"{path}: tensor {key!r} is a scale that is not finite ({values[:4].tolist()})")
        found[weight_key] = key
    return found


#: a built-in plugin is built for the kit of its own core
MEMMODE_KIT = KIT_VERSION


@hookimpl
def memmode_register_readers(register):
    register(ComfyFloat8Reader())
