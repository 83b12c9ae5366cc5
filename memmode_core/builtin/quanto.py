"""The ``quanto`` reader: model folders diffusers saved from a model quantized with ``QuantoConfig``.

``save_pretrained`` of such a model writes ``"quantization_config": {"quant_method": "quanto", "weights_dtype":
"int8" | "float8" | "int4" | "int2", "modules_to_not_convert": ...}`` into the component's ``config.json`` (a
transformers model quantized with quanto cannot be saved), and each ``QLinear`` flattens its weight
(optimum-quanto's ``QTensor.save_to_state_dict``) beside its two activation scales:

- **int8 and float8** (``WeightQBytesTensor``): ``<layer>.weight._data`` the codes in the weight's shape
  (``int8``, or ``float8_e4m3fn``), ``<layer>.weight._scale`` one scale per row (``[out, 1]``, the model's dtype);
- **int4 and int2** (``WeightQBitsTensor``): ``<layer>.weight._data._data`` the codes packed along the first
  dimension (``PackedTensor``: row ``r`` of the packed rows holds, in bits ``b*i`` up, code row ``r + i * packed
  rows``), ``<layer>.weight._scale`` and ``<layer>.weight._shift`` one per code row. With more than 128 inputs quanto
  quantizes group-wise: the code rows are groups of up to 128 consecutive values of the flattened weight, so the
  file does not say the weight's shape — quanto takes it from the model, and so does this reader
  (:attr:`QuantizedFolder.shapes`);
- ``<layer>.input_scale`` and ``<layer>.output_scale``, scalars quanto keeps for activation quantization, which
  diffusers' ``QuantoConfig`` does not turn on: not the model's, left out.

Each quantized weight becomes an :class:`EncodedTensor` decoded by the forward exactly as quanto's ``dequantize``
computes it — in the scale's dtype: ``scale * codes`` (then ``- shift`` for int4/int2, or ``scale * (codes -
shift)`` with an integer zero-point), rounded to the compute dtype after — in pure torch: no optimum-quanto at run
time. Every codec is one per qtype (the codes' dtype and packing are its only constants). The scales and shifts
are read and checked (finite, one per row); the codes are not read. A layer whose parts are missing, of the wrong
dtype or shape, or of another qtype than the config names is a :class:`CheckpointError` naming the folder and the
tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from memmode_core.contracts.errors import CheckpointError
from memmode_core.contracts.hookspecs import hookimpl
from memmode_core.contracts.quantizer import PAYLOAD, Quantizer
from memmode_core.contracts.reader import EncodedTensor, FileContents, QuantizedFolder, Reader, StoredTensor
from memmode_core.contracts.versions import KIT_VERSION
from memmode_core.quantization.row_bands import decode_by_rows

QUANT_METHOD = "quanto"
#: what quanto keeps per layer for activation quantization: not the model's
ACTIVATION_SCALES = (".input_scale", ".output_scale")
#: the dtypes quanto's scales and float shifts are kept in (the model's)
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class QuantoBytes(Quantizer):
    """quanto's 8-bit weights (``qint8``, ``qfloat8``): ``weight_packed`` the codes (``int8``, or the float8
    bytes as ``uint8``), ``weight_scale`` one per row; decoded as ``QBytesDequantizer``: ``scale * codes`` in the
    scale's dtype, then cast to the compute dtype."""

    packs = False

    def __init__(self, qtype: str, codes: torch.dtype) -> None:
        self.qtype, self.codes = qtype, codes
        self.name = self.format = f"quanto_{qtype}"
        self.description = f"optimum-quanto {qtype} weights, one scale a row (read from folders)"

    def pack(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        raise _no_packing(self)

    def unpack(self, packed: Mapping[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        scale = packed["weight_scale"].reshape(-1, 1)
        codes = packed[PAYLOAD].view(self.codes).reshape(shape[0], -1)

        def decode(rows: slice) -> torch.Tensor:
            return scale[rows] * codes[rows].to(scale.dtype)

        return decode_by_rows(shape, dtype, decode)


class QuantoBits(Quantizer):
    """quanto's 4- and 2-bit weights (``qint4``, ``qint2``): ``weight_packed`` the codes packed along the first
    dimension, ``weight_scale`` and ``weight_shift`` one per code row (a row of the weight, or a group of the
    flattened weight); decoded as ``QBitsDequantizer``, in the scale's dtype, and cast to the compute dtype."""

    packs = False

    def __init__(self, qtype: str, bits: int) -> None:
        self.qtype, self.bits = qtype, bits
        self.name = self.format = f"quanto_{qtype}"
        self.description = f"optimum-quanto {qtype} weights, a scale and shift per row or group (read from folders)"

    def pack(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        raise _no_packing(self)

    def unpack(self, packed: Mapping[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        scale, shift, data = packed["weight_scale"], packed["weight_shift"], packed[PAYLOAD]
        packed_rows, mask = data.shape[0], (1 << self.bits) - 1
        # a code row is a weight row or a group of one row's values: the code rows of weight row r are a run
        per_row = scale.shape[0] // shape[0]

        def decode(rows: slice) -> torch.Tensor:
            first, stop = rows.start * per_row, rows.stop * per_row
            # quanto's unpack: code row i * packed rows + r is the i-th code (bits b*i up) of packed row r
            runs = []
            for i in range(8 // self.bits):
                low, high = max(first, i * packed_rows), min(stop, (i + 1) * packed_rows)
                if low < high:
                    runs.append((data[low - i * packed_rows : high - i * packed_rows] >> (self.bits * i)) & mask)
            codes = torch.cat(runs) if len(runs) > 1 else runs[0]
            band_scale, band_shift = scale[first:stop], shift[first:stop]
            if band_shift.dtype.is_floating_point:
                return band_scale * codes.to(band_scale.dtype) - band_shift
            # an integer zero-point, removed before scaling
            return band_scale * (codes.to(torch.int8) - band_shift.to(torch.int8)).to(band_scale.dtype)

        return decode_by_rows(shape, dtype, decode)


def _no_packing(codec: Quantizer) -> NotImplementedError:
    return NotImplementedError(
        f"{codec.name} decodes weights optimum-quanto quantized (a folder diffusers saved); it does not quantize "
        f"weights (load the folder with memmode.load, or quantize with qfloat8 or qfloat4)"
    )


#: the codec of each qtype, by the weights_dtype diffusers' QuantoConfig names it with, and the codes' dtype
BYTES = {
    "int8": QuantoBytes("qint8", torch.int8),
    "float8": QuantoBytes("qfloat8", torch.float8_e4m3fn),
}
BITS = {"int4": QuantoBits("qint4", 4), "int2": QuantoBits("qint2", 2)}
CODECS: dict[str, Quantizer] = {**BYTES, **BITS}


class QuantoReader(Reader):
    """Reads folders diffusers saved from a model quantized with ``QuantoConfig`` (see the module's docstring)."""

    name = "quanto"
    description = (
        "folders diffusers saved with QuantoConfig (int8, float8, int4, int2 weights): the quantized weights rest "
        "packed, decoded per forward as optimum-quanto dequantizes them"
    )
    quant_methods = (QUANT_METHOD,)

    def codecs(self) -> Mapping[str, Quantizer]:
        return {codec.format_name: codec for codec in CODECS.values()}

    def read_folder(self, folder: QuantizedFolder) -> FileContents:
        config = folder.quantization_config
        weights = config.get("weights_dtype")
        if weights not in CODECS:
            raise CheckpointError(
                f"{folder.where}: quantization_config names weights_dtype {weights!r}; the quanto reader decodes "
                f"{', '.join(CODECS)}"
            )
        records = folder.stored
        encoded: dict[str, EncodedTensor] = {}
        used: dict[str, StoredTensor] = {}
        for key in records:
            if key.endswith(".weight._scale"):
                weight = key.removesuffix("._scale")
                if weights in BITS:
                    encoded[weight], parts = _bits_layer(folder, weight, BITS[weights])
                else:
                    encoded[weight], parts = _bytes_layer(folder, weight, BYTES[weights])
                used.update(parts)
        for key in records:
            if ".weight._" in key and key not in used:
                raise CheckpointError(
                    f"{folder.where}: tensor {key!r} is a part of a quanto {weights} weight whose other parts are "
                    f"missing or of another qtype (a damaged folder)"
                )
        stored = {key: used.get(key, record) for key, record in records.items() if not key.endswith(ACTIVATION_SCALES)}
        metadata = {"quant_method": QUANT_METHOD, "layers": f"{len(encoded)} {CODECS[weights].format_name}"}
        return FileContents(stored, encoded, metadata=metadata)


def _scales(folder: QuantizedFolder, weight: str, names: tuple[str, ...], rows: int) -> dict[str, StoredTensor]:
    """The scale (and shift) of ``weight``: ``[rows, 1]``, a float of the model's dtype (a shift may be a ``uint8``
    zero-point), and finite."""
    found = {}
    for name in names:
        key = f"{weight}.{name}"
        record = folder.stored.get(key)
        integer = name == "_shift" and record is not None and record.dtype == torch.uint8
        if record is None or record.shape != (rows, 1) or record.dtype not in SCALE_DTYPES and not integer:
            has = "missing" if record is None else f"{record.dtype} of shape {list(record.shape)}"
            raise CheckpointError(
                f"{folder.where}: tensor {key!r} is {has}; quanto keeps a float [{rows}, 1] there for {weight!r}"
            )
        if not integer and not torch.isfinite(folder.read(key)).all():
            raise CheckpointError(f"{folder.where}: tensor {key!r} holds values that are not finite")
        found[name] = record
    return found


def _bytes_layer(folder: QuantizedFolder, weight: str, codec: QuantoBytes) -> tuple[EncodedTensor, dict]:
    key = f"{weight}._data"
    data = folder.stored.get(key)
    if data is None or data.dtype != codec.codes or len(data.shape) != 2:
        has = "missing" if data is None else f"{data.dtype} of shape {list(data.shape)}"
        raise CheckpointError(
            f"{folder.where}: tensor {key!r} is {has}; a quanto {codec.qtype} weight's codes are "
            f"{str(codec.codes).removeprefix('torch.')} [out, in]"
        )
    _expect_shape(folder, weight, data.shape, key)
    scale = _scales(folder, weight, ("_scale",), data.shape[0])["_scale"]
    # float8 codes are given back as their bytes (a packed layer's payload is an integer)
    payload = StoredTensor(
        key, torch.int8 if codec.codes == torch.int8 else torch.uint8, data.shape, data.start, data.end
    )
    keys = {PAYLOAD: key, "weight_scale": scale.key}
    return EncodedTensor(weight, data.shape, scale.dtype, codec, keys), {key: payload, scale.key: scale}


def _bits_layer(folder: QuantizedFolder, weight: str, codec: QuantoBits) -> tuple[EncodedTensor, dict]:
    key = f"{weight}._data._data"
    data, scale = folder.stored.get(key), folder.stored[f"{weight}._scale"]
    shape = folder.shapes.get(weight)
    if shape is None:
        raise CheckpointError(
            f"{folder.where}: tensor {key!r} is a quanto {codec.qtype} weight of {weight!r}, which the model "
            f"built from the folder's config does not have"
        )
    rows = scale.shape[0] if scale.shape else 0
    count = math.prod(shape)
    values_per_byte = 8 // codec.bits
    # a code row is a row of the weight, or a group of whole rows' consecutive values (quanto's group_size
    # divides in_features): either way its length divides the weight's rows
    if (
        data is None
        or data.dtype != torch.uint8
        or len(data.shape) != 2
        or not rows
        or count % rows
        or shape[-1] % (count // rows)
    ):
        has = "missing" if data is None else f"{data.dtype} of shape {list(data.shape)}"
        raise CheckpointError(
            f"{folder.where}: tensor {key!r} is {has}, with a scale of shape {list(scale.shape)}; quanto packs "
            f"{values_per_byte} {codec.qtype} codes a byte along the rows of {weight!r} {list(shape)} or its groups"
        )
    expected = (-(-rows // values_per_byte), count // rows)
    if data.shape != expected:
        raise CheckpointError(
            f"{folder.where}: tensor {key!r} has shape {list(data.shape)}; {rows} code rows of {weight!r} "
            f"{list(shape)}, {values_per_byte} a byte, are packed as {list(expected)}"
        )
    found = _scales(folder, weight, ("_scale", "_shift"), rows)
    keys = {PAYLOAD: key, "weight_scale": found["_scale"].key, "weight_shift": found["_shift"].key}
    parts = {data.key: data, **{record.key: record for record in found.values()}}
    return EncodedTensor(weight, tuple(shape), found["_scale"].dtype, codec, keys), parts


def _expect_shape(folder: QuantizedFolder, weight: str, shape: tuple[int, ...], key: str) -> None:
    expected = folder.shapes.get(weight)
    if expected is not None and tuple(expected) != tuple(shape):
        raise CheckpointError(
            f"{folder.where}: tensor {key!r} has shape {list(shape)}; the model's {weight!r} is {list(expected)}"
        )


#: a built-in plugin is built for the kit of its own core
MEMMODE_KIT = KIT_VERSION


@hookimpl
def memmode_register_readers(register):
    register(QuantoReader())
