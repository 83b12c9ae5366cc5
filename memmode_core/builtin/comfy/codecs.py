"""The codecs of ComfyUI's weight formats: each decodes one layer's stored tensors, on whatever device they are,
into the weight they mean — the value comfy-kitchen's eager backend (ComfyUI's own kernels) dequantizes them to.

Every codec computes in float32 and rounds once to the compute dtype, a band of rows at a time into the result
(:func:`~memmode_core.quantization.row_bands.decode_by_rows`: a whole layer's float32 values are never alive
beside it; each codec's :meth:`ComfyCodec.decode` gives the float32 values of some rows). In float32 the result
is comfy-kitchen's dequantization bit for bit (the same products, in the same order); in bfloat16 or float16 it
is that value rounded once, where comfy-kitchen multiplies in the narrow dtype itself (nvfp4's scales, awq's
groups), so the two may differ by a rounding there — memmode's is the closer to the file's value.

The parts a codec reads are the file's bytes as stored, viewed as an integer dtype where the file has a float8
type (a packed layer's payload and buffers keep their bytes through every placement, and no cast of the model
to a float dtype touches them): ``weight_packed`` (:data:`PAYLOAD`), then ``weight_scale`` and the format's
others. ``weight_input_scale`` — the activation scale a Comfy file keeps for its fp8/fp4 matmuls — travels with
the layer (``save_quantized`` writes it back) and is not used: memmode computes the layer in a float dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from memmode_core.contracts.quantizer import PAYLOAD, Quantizer
from memmode_core.quantization.microscaling import (
    e2m1_to_float,
    e8m0_to_float,
    scale_blocks,
    unpack_nibbles,
    untile_block_scales,
)
from memmode_core.quantization.row_bands import decode_by_rows

SCALE = "weight_scale"
#: nvfp4's scale of the whole tensor (Comfy's ``weight_scale_2``)
TENSOR_SCALE = "weight_scale_2"
#: awq's zero points per group
ZEROS = "weight_zeros"
#: the activation scale, kept and not used
INPUT_SCALE = "weight_input_scale"
#: the float8 types of ComfyUI's fp8 formats
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
#: values per block scale: nvfp4's fp8 scales, mxfp8's E8M0 exponents
NVFP4_BLOCK, MXFP8_BLOCK = 16, 32
#: the ConvRot group sizes a file may name (regular Hadamard matrices exist for powers of 4)
CONVROT_GROUPS = tuple(4**k for k in range(1, 7))


class ComfyCodec(Quantizer):
    """A codec of weights read from ComfyUI files: it decodes, and never packs a weight itself.

    A format writes :meth:`decode` (the float32 values of a band of rows) and, where some part must be read whole
    first (block scales in the tiled layout), :meth:`prepare`; :meth:`unpack` decodes band by band."""

    packs = False
    description = ""

    def __init__(self, name: str, description: str) -> None:
        self.name = self.format = name
        self.description = description

    def unpack(self, packed: Mapping[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        parts = self.prepare(packed, shape)
        return decode_by_rows(shape, dtype, lambda rows: self.decode(parts, shape, rows))

    def prepare(self, packed: Mapping[str, torch.Tensor], shape: torch.Size) -> Mapping[str, torch.Tensor]:
        """The parts as :meth:`decode` reads them: as stored, unless a format's are laid out across rows."""
        return packed

    def decode(self, parts: Mapping[str, torch.Tensor], shape: torch.Size, rows: slice) -> torch.Tensor:
        """The float32 values of the weight's rows ``rows`` (``[rows, *shape[1:]]``), made fresh."""
        raise NotImplementedError


class ComfyFloat8(ComfyCodec):
    """``float8_e4m3fn`` / ``float8_e5m2``: the float8 bytes, and optionally a float ``weight_scale`` of one element
    (the whole tensor's) or one per row (``[rows, 1]``): ``weight.float() * scale``."""

    def __init__(self, fp8: torch.dtype) -> None:
        label = str(fp8).removeprefix("torch.").replace("float8", "fp8")
        super().__init__(
            f"comfy_{label}", f"ComfyUI {label} weights, optionally with a float32 scale (read from files)"
        )
        self.fp8 = fp8

    def decode(self, parts: Mapping[str, torch.Tensor], shape: torch.Size, rows: slice) -> torch.Tensor:
        values = parts[PAYLOAD].view(self.fp8).reshape(shape)[rows].to(torch.float32)
        return _times_scale(values, parts.get(SCALE), rows)


class ComfyNVFP4(ComfyCodec):
    """``nvfp4``: E2M1 codes two a byte, the high nibble first (``[rows, columns / 2]``); an fp8 E4M3 scale per
    block of 16 codes of a row, in cuBLAS' tiled layout (``weight_scale``); a float32 scale of the whole tensor
    (``weight_scale_2``). A value is ``code * (weight_scale_2 * block_scale)``, comfy-kitchen's order."""

    def __init__(self) -> None:
        super().__init__("comfy_nvfp4", "ComfyUI NVFP4 weights: E2M1 codes, fp8 block scales of 16, a tensor scale")

    def prepare(self, packed: Mapping[str, torch.Tensor], shape: torch.Size) -> Mapping[str, torch.Tensor]:
        rows, columns = shape
        blocks = untile_block_scales(packed[SCALE], rows, columns // NVFP4_BLOCK)
        scales = packed[TENSOR_SCALE].to(torch.float32).reshape(()) * blocks.view(torch.float8_e4m3fn).float()
        return {PAYLOAD: packed[PAYLOAD].reshape(rows, columns // 2), SCALE: scales}

    def decode(self, parts: Mapping[str, torch.Tensor], shape: torch.Size, rows: slice) -> torch.Tensor:
        values = e2m1_to_float(parts[PAYLOAD][rows], high_nibble_first=True)
        return scale_blocks(values, parts[SCALE][rows], NVFP4_BLOCK, in_place=True)


class ComfyMXFP8(ComfyCodec):
    """``mxfp8``: fp8 E4M3 values (``[rows, columns]``) and an E8M0 exponent per block of 32 values of a row, in
    cuBLAS' tiled layout (``weight_scale``): ``value * 2 ** (exponent - 127)``."""

    def __init__(self) -> None:
        super().__init__("comfy_mxfp8", "ComfyUI MXFP8 weights: fp8 E4M3 values, E8M0 block scales of 32")

    def prepare(self, packed: Mapping[str, torch.Tensor], shape: torch.Size) -> Mapping[str, torch.Tensor]:
        rows, columns = shape
        exponents = untile_block_scales(packed[SCALE], rows, columns // MXFP8_BLOCK)
        return {PAYLOAD: packed[PAYLOAD].reshape(rows, columns), SCALE: e8m0_to_float(exponents.contiguous())}

    def decode(self, parts: Mapping[str, torch.Tensor], shape: torch.Size, rows: slice) -> torch.Tensor:
        values = parts[PAYLOAD][rows].view(torch.float8_e4m3fn).to(torch.float32)
        return scale_blocks(values, parts[SCALE][rows], MXFP8_BLOCK, in_place=True)


class ComfyInt8(ComfyCodec):
    """``int8_tensorwise`` (and ComfyUI's ``int8``): int8 codes and a float32 ``weight_scale`` of one element or
    one per row (``[rows, 1]``): ``codes.float() * scale``. With ConvRot (``convrot_groupsize`` given), the file
    holds the weight rotated — each group of that many input columns times a regular Hadamard matrix ``H`` — and
    the decoded value is rotated back (``H`` is symmetric and orthogonal: rotating twice is the identity)."""

    def __init__(self, convrot_groupsize: int | None = None) -> None:
        if convrot_groupsize is None:
            super().__init__("comfy_int8", "ComfyUI int8 weights, a scale of the tensor or of each row")
        else:
            super().__init__(
                f"comfy_int8_convrot{convrot_groupsize}",
                f"ComfyUI int8 weights rotated in groups of {convrot_groupsize} (ConvRot), a scale per row",
            )
        self.convrot_groupsize = convrot_groupsize

    def decode(self, parts: Mapping[str, torch.Tensor], shape: torch.Size, rows: slice) -> torch.Tensor:
        values = _times_scale(parts[PAYLOAD].reshape(shape)[rows].to(torch.float32), parts[SCALE], rows)
        if self.convrot_groupsize is not None:
            values = rotate_groups(values, self.convrot_groupsize)
        return values


class ComfyAWQ(ComfyCodec):
    """``awq_w4a16``: unsigned 4-bit codes two a byte, the low nibble first (``[rows, columns / 2]``, stored as
    int8); a scale and a zero point per group of input columns and row (``weight_scale`` and ``weight_zeros``,
    ``[columns / group, rows]`` in the file, given here flat): ``(code - 8) * scale + zero``. The group size is
    the columns over the scales' groups."""

    def __init__(self) -> None:
        super().__init__("comfy_awq_w4a16", "ComfyUI AWQ W4A16 weights: uint4 codes, a scale and zero per group")

    def prepare(self, packed: Mapping[str, torch.Tensor], shape: torch.Size) -> Mapping[str, torch.Tensor]:
        rows, columns = shape
        return {
            PAYLOAD: packed[PAYLOAD].view(torch.uint8).reshape(rows, columns // 2),
            SCALE: packed[SCALE].reshape(-1, rows).t().to(torch.float32),  # [rows, groups]
            ZEROS: packed[ZEROS].reshape(-1, rows).t().to(torch.float32),
        }

    def decode(self, parts: Mapping[str, torch.Tensor], shape: torch.Size, rows: slice) -> torch.Tensor:
        codes = unpack_nibbles(parts[PAYLOAD][rows], high_nibble_first=False)
        scales, zeros = parts[SCALE][rows], parts[ZEROS][rows]
        band, groups = scales.shape
        blocks = codes.reshape(band, groups, shape[1] // groups).to(torch.float32)
        return blocks.sub_(8.0).mul_(scales.unsqueeze(-1)).add_(zeros.unsqueeze(-1)).reshape(band, shape[1])


def _times_scale(values: torch.Tensor, scale: torch.Tensor | None, rows: slice) -> torch.Tensor:
    """``values`` (float32, the rows ``rows`` the codec just made: multiplied in place) times a float scale of one
    element (the whole tensor's) or one per row (of a row split, the split's rows)."""
    if scale is None:
        return values
    scale = scale.to(device=values.device, dtype=torch.float32)
    if scale.numel() == 1:
        return values.mul_(scale.reshape(()))
    return values.mul_(scale.reshape(-1)[rows].reshape(-1, *([1] * (values.dim() - 1))))


def regular_hadamard(size: int, device: torch.device) -> torch.Tensor:
    """The normalized regular Hadamard matrix of ``size`` (a power of 4), in float32: Kronecker powers of the 4x4
    one whose rows and columns each sum to 2, divided by ``sqrt(size)`` — every entry is exactly ``±2**-k``."""
    if size not in CONVROT_GROUPS:
        raise ValueError(f"a regular Hadamard matrix has a power of 4 for its size, got {size}")
    base = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float32)
    matrix = base
    while matrix.shape[0] < size:
        matrix = torch.kron(matrix, base)
    return (matrix / math.sqrt(size)).to(device)


def rotate_groups(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """``values`` (``[rows, columns]``, float32) with each group of ``group_size`` columns times ``H.T``, as
    comfy-kitchen rotates a ConvRot weight (and back: ``H`` is its own inverse)."""
    rows, columns = values.shape
    hadamard = regular_hadamard(group_size, values.device)
    return torch.matmul(values.reshape(rows, columns // group_size, group_size), hadamard.T).reshape(rows, columns)


#: one codec of each kind, shared by every file read (a codec holds no file's data)
FLOAT8_CODECS = {fp8: ComfyFloat8(fp8) for fp8 in FLOAT8}
NVFP4 = ComfyNVFP4()
MXFP8 = ComfyMXFP8()
INT8 = ComfyInt8()
INT8_CONVROT = {size: ComfyInt8(size) for size in CONVROT_GROUPS}
AWQ = ComfyAWQ()


def every_codec() -> dict[str, Quantizer]:
    """Every codec by its format name: what reads back a model ``save_quantized`` wrote from a ComfyUI file."""
    codecs = [*FLOAT8_CODECS.values(), NVFP4, MXFP8, INT8, *INT8_CONVROT.values(), AWQ]
    return {codec.format_name: codec for codec in codecs}
