"""The weight formats of ComfyUI's mixed precision, as its files store them: for each format a layer may be declared
in, which tensors beside ``<layer>.weight`` hold it, what each must be, and the codec that decodes them; and the
formats refused, by name, with what runs them.

ComfyUI (``comfy/quant_ops.py``'s ``QUANT_ALGOS``, loaded by ``comfy/ops.py``; the layouts are comfy-kitchen's)
stores a quantized layer ``<layer>`` as ``<layer>.weight`` in the format's storage type and a few
``<layer>.<parameter>`` tensors:

==================  ======================  ===============================================================
format              weight                  parameters
==================  ======================  ===============================================================
float8_e4m3fn/e5m2  float8 (or its uint8)   ``weight_scale`` (one element, or one per row), ``input_scale``
nvfp4               uint8 ``[R, C/2]``      ``weight_scale`` fp8 E4M3 block scales of 16, tiled;
                                            ``weight_scale_2`` float32 (the tensor's); ``input_scale``
mxfp8               float8_e4m3fn ``[R,C]`` ``weight_scale`` E8M0 block scales of 32 (uint8 or F8_E8M0), tiled
int8_tensorwise     int8 ``[R, C]``         ``weight_scale`` (one element, or ``[R, 1]``); ConvRot when the
                                            layer's config says ``"convrot": true`` (``convrot_groupsize``)
awq_w4a16           int8 ``[R, C/2]``       ``weight_scale`` and ``weight_zeros`` (or ``weight_zero``)
                                            ``[C/group, R]``; the config's ``group_size`` (64 by default)
==================  ======================  ===============================================================

ComfyUI's own ``int8`` (per-row) and ``int8_convrot`` (ConvRot in groups of 256) are the same bytes as
``int8_tensorwise``. The nvfp4 and mxfp8 weights are stored padded to whole blocks (16 x 16, 32 x 32): the
file does not say the unpadded shape (ComfyUI takes it from its model), so a layer is read in its stored shape
— every layer of the published models, whose sizes are multiples of 32 — and a padded one meets core's shape
check, refused naming the tensor. The tiled block scales are kept as the file holds them, given as
``[bands of 128 rows, ...]``: rows cut at a band boundary are the band's, any other cut is not, so core never
cuts them with the rows (a layer diffusers splits is decoded at load instead).

Formats whose forward quantizes the activations — the weight alone is not the layer's function, or not
without a rotation and rounding of the input the reference defines — are refused by name (:data:`REFUSED`);
a name ComfyUI does not define is refused as unknown. What is checked before anything is bound: each
tensor's presence, storage type and shape, and the values of every scale of a tensor or a row (finite).
Block scales and group scales are not read at load (they are most of a scale's bytes): a NaN among them
decodes to NaN in its block, as in ComfyUI.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memmode_core.builtin.comfy import codecs
from memmode_core.contracts.errors import CheckpointError
from memmode_core.contracts.quantizer import PAYLOAD
from memmode_core.contracts.reader import EncodedTensor, StoredTensor
from memmode_core.files.checkpoint import TensorRecord
from memmode_core.quantization.microscaling import TILE_ROWS, tiled_scale_shape

#: the dtypes a scale of a tensor or a row may be stored in: each is exact in float32, where products are computed
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: the activation scale's names: ComfyUI's, and the legacy "fp8 scaled" files'
INPUT_SCALES = (".input_scale", ".scale_input")
#: the format names ComfyUI reads as another (comfy/ops.py): ComfyUI's own int8 layouts store int8_tensorwise's bytes
ALIASES = {"int8": "int8_tensorwise", "int8_convrot": "int8_tensorwise"}
#: ComfyUI's ``int8_convrot`` layout rotates in groups of this many input columns
INT8_CONVROT_GROUP = 256
#: awq_w4a16's group size when the layer's config names none (comfy/quant_ops.py)
AWQ_GROUP = 64

#: the formats whose forward quantizes the activations, by name -> why, and what runs them
REFUSED = {
    name: (
        "its layers compute with the activations quantized to 4 bits in a rotated basis (ConvRot W4A4): "
        "the stored weight alone is not what the reference computes. ComfyUI runs it with comfy-kitchen's "
        "CUDA kernels; memmode does not (load the model's bf16 or fp8 weights instead)"
    )
    for name in ("convrot_w4a4", "int4_tensorwise")
} | {
    "svdquant_w4a4": (
        "its layers (Nunchaku SVDQuant) divide the activations by a smoothing factor, quantize them to 4 bits "
        "and add a low-rank branch: the stored weight alone is not the layer. ComfyUI-nunchaku or diffusers' "
        "nunchaku_lite runs it on a CUDA GPU; memmode does not"
    ),
    "asym_w4a8_int8": (
        "its layers (W4A8) quantize the activations to int8 in a rotated basis at every forward: the stored "
        "weight alone is not what the reference computes. ComfyUI runs it with comfy-kitchen's kernels; "
        "memmode does not"
    ),
}


@dataclass
class Layer:
    """One layer a file declares quantized, as a format's reading is shown it."""

    path: Path
    #: the key of its weight; its other tensors are ``<prefix>.<parameter>``
    weight: str
    #: the declared format (after :data:`ALIASES`) and the layer's config (``{"format": ..., ...}``)
    format: str
    config: Mapping[str, Any]
    #: where it was declared: ``_quantization_metadata`` or a ``<layer>.comfy_quant`` tensor
    where: str
    records: Mapping[str, TensorRecord]
    #: the values of a small tensor of the file (a scale), read from its bytes
    values: Callable[[TensorRecord], torch.Tensor]

    @property
    def prefix(self) -> str:
        return self.weight.removesuffix(".weight")

    @property
    def record(self) -> TensorRecord:
        return self.records[self.weight]

    def fail(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: layer {self.prefix!r}, declared {self.format} (by {self.where}): {why}")

    def tensor(self, parameter: str, *, required: bool = True) -> TensorRecord | None:
        record = self.records.get(f"{self.prefix}.{parameter}")
        if record is None and required:
            raise self.fail(f"tensor {self.prefix + '.' + parameter!r} is not in the file ({self.format} needs it)")
        return record

    def option(self, name: str, default: Any) -> Any:
        """A setting of the layer's config, at its top level or under ``"params"`` (ComfyUI reads both)."""
        params = self.config.get("params")
        return self.config.get(name, params.get(name, default) if isinstance(params, dict) else default)


@dataclass
class Read:
    """What a format's reading made of one layer: its encoded weight and the stored tensors of its parts."""

    encoded: EncodedTensor
    parts: dict[str, StoredTensor]


def read_layer(layer: Layer) -> Read:
    """The layer's weight as an encoded tensor, every tensor it is made of checked (see the module docstring)."""
    if layer.format in REFUSED:
        raise layer.fail(f"memmode does not read this format: {REFUSED[layer.format]}")
    reading = READINGS.get(layer.format)
    if reading is None:
        known = ", ".join(sorted(READINGS))
        raise layer.fail(
            f"{layer.format!r} is not a format ComfyUI defines (memmode reads {known}; refuses "
            f"{', '.join(sorted(REFUSED))})"
        )
    return reading(layer)


def read_float8(layer: Layer, fp8: torch.dtype, scale_key: str | None) -> Read:
    """A float8 layer: its weight stored as ``fp8`` (or the same bytes as uint8), its optional scale at
    ``scale_key`` (one element, or one per row), its optional activation scale."""
    record = layer.record
    if record.dtype not in (fp8, torch.uint8):
        raise layer.fail(
            f"tensor {layer.weight!r} is stored as {record.dtype}, not {fp8}: the header contradicts itself"
        )
    parts = {PAYLOAD: _as(record, torch.uint8)}
    if scale_key is not None:
        parts[codecs.SCALE] = _per_row_or_one(layer, layer.records[scale_key], record.shape)
    _input_scale(layer, parts)
    return _read(layer, record.shape, codecs.FLOAT8_CODECS[fp8], parts)


def _read_fp8_declared(fp8: torch.dtype) -> Callable[[Layer], Read]:
    def reading(layer: Layer) -> Read:
        scale = layer.tensor("weight_scale", required=False)
        return read_float8(layer, fp8, scale.key if scale is not None else None)

    return reading


def _read_nvfp4(layer: Layer) -> Read:
    record = _stored_as(layer, layer.record, (torch.uint8,), dims=2)
    rows, columns = record.shape[0], record.shape[1] * 2
    if columns % codecs.NVFP4_BLOCK:
        raise layer.fail(f"tensor {layer.weight!r} holds {columns} columns, not whole blocks of {codecs.NVFP4_BLOCK}")
    blocks = _tiled(layer, layer.tensor("weight_scale"), rows, columns // codecs.NVFP4_BLOCK, torch.float8_e4m3fn)
    parts = {PAYLOAD: _as(record, torch.uint8), codecs.SCALE: blocks}
    parts[codecs.TENSOR_SCALE] = _one(layer, layer.tensor("weight_scale_2"))
    _input_scale(layer, parts)
    return _read(layer, (rows, columns), codecs.NVFP4, parts)


def _read_mxfp8(layer: Layer) -> Read:
    record = _stored_as(layer, layer.record, (torch.float8_e4m3fn, torch.uint8), dims=2)
    rows, columns = record.shape
    if columns % codecs.MXFP8_BLOCK:
        raise layer.fail(f"tensor {layer.weight!r} holds {columns} columns, not whole blocks of {codecs.MXFP8_BLOCK}")
    exponents = layer.tensor("weight_scale")
    parts = {PAYLOAD: _as(record, torch.uint8)}
    parts[codecs.SCALE] = _tiled(layer, exponents, rows, columns // codecs.MXFP8_BLOCK, torch.uint8)
    _input_scale(layer, parts)
    return _read(layer, (rows, columns), codecs.MXFP8, parts)


def _read_int8(layer: Layer) -> Read:
    record = _stored_as(layer, layer.record, (torch.int8,), dims=2)
    parts = {PAYLOAD: _as(record, torch.int8)}
    parts[codecs.SCALE] = _per_row_or_one(layer, layer.tensor("weight_scale"), record.shape)
    _input_scale(layer, parts)
    codec: codecs.ComfyInt8 = codecs.INT8
    declared = layer.config.get("format")
    if declared == "int8_convrot" or layer.option("convrot", False):
        size = INT8_CONVROT_GROUP if declared == "int8_convrot" else layer.option("convrot_groupsize", 256)
        if size not in codecs.INT8_CONVROT or record.shape[1] % size:
            raise layer.fail(
                f"ConvRot group size {size!r} is not a power of 4 dividing its {record.shape[1]} input columns"
            )
        codec = codecs.INT8_CONVROT[size]
    return _read(layer, record.shape, codec, parts)


def _read_awq(layer: Layer) -> Read:
    record = _stored_as(layer, layer.record, (torch.int8, torch.uint8), dims=2)
    rows, columns = record.shape[0], record.shape[1] * 2
    group = layer.option("group_size", AWQ_GROUP)
    if not isinstance(group, int) or group <= 0 or columns % group:
        raise layer.fail(f"group size {group!r} does not divide its {columns} input columns")
    zeros = layer.tensor("weight_zeros", required=False) or layer.tensor("weight_zero")
    parts = {PAYLOAD: _as(record, torch.int8)}
    for name, part in ((codecs.SCALE, layer.tensor("weight_scale")), (codecs.ZEROS, zeros)):
        if part.dtype not in SCALE_DTYPES or part.shape != (columns // group, rows):
            raise layer.fail(
                f"tensor {part.key!r} is a {list(part.shape)} {part.dtype} tensor: {layer.format} of a "
                f"[{rows}, {columns}] weight in groups of {group} has float [{columns // group}, {rows}]"
            )
        # given flat: its first dimension is the rows only where there is one group, and then it splits with them
        parts[name] = _as(part, part.dtype, (columns // group * rows,))
    return _read(layer, (rows, columns), codecs.AWQ, parts)


#: each format memmode reads, by ComfyUI's name -> its reading
READINGS: dict[str, Callable[[Layer], Read]] = {
    "float8_e4m3fn": _read_fp8_declared(torch.float8_e4m3fn),
    "float8_e5m2": _read_fp8_declared(torch.float8_e5m2),
    "nvfp4": _read_nvfp4,
    "mxfp8": _read_mxfp8,
    "int8_tensorwise": _read_int8,
    "awq_w4a16": _read_awq,
}


# -- the checks -------------------------------------------------------------------------------------------


def _read(layer: Layer, shape: tuple[int, ...], codec: codecs.ComfyCodec, parts: dict[str, StoredTensor]) -> Read:
    encoded = EncodedTensor(layer.weight, tuple(shape), torch.float32, codec, {n: p.key for n, p in parts.items()})
    return Read(encoded, {part.key: part for part in parts.values()})


def _as(record: TensorRecord, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> StoredTensor:
    """The record's bytes as a stored tensor of ``dtype`` (same item size) and ``shape`` (same elements)."""
    return StoredTensor(record.key, dtype, tuple(record.shape if shape is None else shape), record.start, record.end)


def _stored_as(layer: Layer, record: TensorRecord, dtypes: tuple[torch.dtype, ...], dims: int) -> TensorRecord:
    if record.dtype not in dtypes or len(record.shape) != dims:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise layer.fail(
            f"tensor {record.key!r} is a {list(record.shape)} {str(record.dtype).removeprefix('torch.')} tensor, "
            f"and {layer.format} stores a {dims}-D {names} one"
        )
    return record


def _numel(record: TensorRecord) -> int:
    numel = 1
    for d in record.shape:
        numel *= d
    return numel


def _float_scale(layer: Layer, record: TensorRecord, what: str) -> torch.Tensor:
    if record.dtype not in SCALE_DTYPES:
        raise layer.fail(f"tensor {record.key!r} is {what} stored as {record.dtype}, not a float")
    if _numel(record) == 0:
        raise layer.fail(
            f"tensor {record.key!r} is an empty scale (shape {list(record.shape)}): the value of the layer is "
            f"unknown (some copies of Comfy-Org's Wan 2.2 files have this; get another)"
        )
    values = layer.values(record)
    if not torch.isfinite(values).all():
        raise layer.fail(f"tensor {record.key!r} is a scale that is not finite ({values.flatten()[:4].tolist()})")
    return values


def _one(layer: Layer, record: TensorRecord) -> StoredTensor:
    """A float scale of one element, given as ``[1]`` (tools store it 0-dim, ``[1]`` or ``[1, 1]``)."""
    _float_scale(layer, record, "a scale of the tensor")
    if _numel(record) != 1:
        raise layer.fail(f"tensor {record.key!r} has shape {list(record.shape)}: a scale of the tensor has one element")
    return _as(record, record.dtype, (1,))


def _per_row_or_one(layer: Layer, record: TensorRecord, weight_shape: tuple[int, ...]) -> StoredTensor:
    """A float scale of one element (given as ``[1]``) or one per row (``[rows, 1]``)."""
    _float_scale(layer, record, "a scale")
    numel = _numel(record)
    if numel == 1:
        return _as(record, record.dtype, (1,))
    if len(weight_shape) > 1 and record.shape == (weight_shape[0], 1):
        return _as(record, record.dtype)
    rows = weight_shape[0] if weight_shape else 1
    raise layer.fail(
        f"tensor {record.key!r} has shape {list(record.shape)}: a scale of {layer.weight!r} "
        f"{list(weight_shape)} has one element, or one per row ([{rows}, 1])"
    )


def _tiled(layer: Layer, record: TensorRecord, rows: int, blocks: int, dtype: torch.dtype) -> StoredTensor:
    """Block scales in the tiled layout: one byte each (``dtype`` or uint8), as many as the tiles of a ``[rows,
    blocks]`` matrix hold; given as uint8 ``[bands of 128 rows, band bytes]``."""
    padded = tiled_scale_shape(rows, blocks)
    if record.dtype not in (dtype, torch.uint8) or _numel(record) != padded[0] * padded[1]:
        raise layer.fail(
            f"tensor {record.key!r} is a {list(record.shape)} {str(record.dtype).removeprefix('torch.')} tensor, "
            f"not the block scales of a [{rows}, {blocks}] block matrix in "
            f"cuBLAS' tiled layout ({padded[0]} x {padded[1]} {str(dtype).removeprefix('torch.')})"
        )
    bands = padded[0] // TILE_ROWS
    return _as(record, torch.uint8, (bands, TILE_ROWS * padded[1]))


def _input_scale(layer: Layer, parts: dict[str, StoredTensor]) -> None:
    """The layer's activation scale, if the file has one: checked (a finite float of one element) and kept."""
    for suffix in INPUT_SCALES:
        record = layer.records.get(layer.prefix + suffix)
        if record is not None:
            _float_scale(layer, record, "an activation scale")
            if _numel(record) != 1:
                raise layer.fail(
                    f"tensor {record.key!r} has shape {list(record.shape)}: an activation scale has one element"
                )
            parts[codecs.INPUT_SCALE] = _as(record, record.dtype, (1,))
            return
