"""The codecs of bitsandbytes' saved layers: a 4-bit weight (NF4 or FP4, double-quantized or not) and an 8-bit one
(LLM.int8()), each decoded exactly as bitsandbytes dequantizes it, in float32, rounded once to the compute dtype,
a band of rows at a time (:func:`~memmode_core.quantization.row_bands.decode_by_rows`). What is not a tensor — the
quant type, the block sizes, a double-quantized layer's offset — is a codec's constant: one codec per distinct set,
each with a format name :class:`Codecs` turns back into it.
"""

from __future__ import annotations

import functools
import math
import re
import struct
from collections.abc import Iterator, Mapping

import torch

from memmode_core.contracts.quantizer import PAYLOAD, Quantizer
from memmode_core.quantization.row_bands import decode_by_rows

#: the levels of each 4-bit quant type, as bitsandbytes' ``get_4bit_type`` lists them (code order); it divides
#: them by their largest magnitude in float32, which :func:`levels` repeats
LEVELS = {
    "nf4": (
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ),
    "fp4": (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0),
}  # fmt: skip
#: the block sizes ``quantize_4bit`` accepts
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
#: what ``int8_vectorwise_dequant`` multiplies by: the float32 nearest 1 / 127, written as bitsandbytes does
INV_127 = 7.874015718698502e-3


#: each quant type's levels as float32 on each device they were asked on: made once per device, not copied from
#: the host at every call (never derived from a layer's tensors)
_LEVELS: dict[tuple[str, torch.device], torch.Tensor] = {}
_PAIRS: dict[tuple[str, torch.device], torch.Tensor] = {}


def levels(quant_type: str, device: torch.device) -> torch.Tensor:
    """The 16 float32 levels of ``quant_type`` on ``device``: bitsandbytes' table, divided by its largest
    magnitude in float32 as ``get_4bit_type`` does."""
    table = _LEVELS.get((quant_type, device))
    if table is None:
        table = torch.tensor(LEVELS[quant_type], dtype=torch.float32)
        table = _LEVELS[quant_type, device] = table.div_(table.abs().max()).to(device)
    return table


def level_pairs(quant_type: str, device: torch.device) -> torch.Tensor:
    """The two levels each of the 256 bytes holds (the high nibble's first: bitsandbytes' order), a pair of float32
    as one int64: one gather a byte gives both values (as core's ``e2m1_to_float`` looks E2M1 pairs up)."""
    table = _PAIRS.get((quant_type, device))
    if table is None:
        single, byte = levels(quant_type, torch.device("cpu")), torch.arange(256)
        pairs = torch.stack((single[byte >> 4], single[byte & 15]), dim=1).contiguous()
        table = _PAIRS[quant_type, device] = pairs.view(torch.int64).reshape(256).to(device)
    return table


def blockwise(values: torch.Tensor, scales: torch.Tensor, blocksize: int) -> torch.Tensor:
    """Each of ``values`` (float32, flat) times the scale of its block of ``blocksize``, in float32, the last block
    possibly short (bitsandbytes' ``_dequantize_blockwise_compute`` and ``_dequantize_4bit_compute``)."""
    count = values.numel()
    full = count // blocksize * blocksize
    out = torch.empty_like(values)
    torch.mul(
        values[:full].view(-1, blocksize), scales[: full // blocksize].view(-1, 1), out=out[:full].view(-1, blocksize)
    )
    if full < count:
        torch.mul(values[full:], scales[full // blocksize], out=out[full:])
    return out


class BnbFourBit(Quantizer):
    """bitsandbytes' NF4 or FP4 weights: ``weight_packed`` the codes (``uint8``, two a byte, high nibble first),
    ``weight_absmax`` the block maxima (``float32``; with double quantization ``uint8`` codes, decoded with
    ``weight_nested_absmax`` and ``weight_nested_quant_map`` and the codec's offset). Decoded in float32 as
    ``dequantize_4bit`` computes — ``level[code] * absmax[block]`` — and rounded once to the compute dtype."""

    packs = False

    def __init__(self, quant_type: str, blocksize: int, nested_blocksize: int = 0, nested_offset: float = 0.0) -> None:
        self.quant_type, self.blocksize = quant_type, blocksize
        self.nested_blocksize, self.nested_offset = nested_blocksize, nested_offset
        self.name = self.format = format_name(quant_type, blocksize, nested_blocksize, nested_offset)
        #: what the layers are, for the folder's summary (the offset is each layer's own)
        self.kind = f"{quant_type} (blocks of {blocksize}{', double-quantized' if nested_blocksize else ''})"
        nested = f", double-quantized ({nested_blocksize} a block)" if nested_blocksize else ""
        self.description = (
            f"bitsandbytes {quant_type.upper()} weights, blocks of {blocksize}{nested} (read from folders)"
        )

    def pack(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError(
            f"{self.name} decodes weights bitsandbytes quantized (a folder diffusers saved); it does not quantize "
            f"weights (load the folder with memmode.load, or quantize with qfloat8 or qfloat4)"
        )

    def unpack(self, packed: Mapping[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The weight, a band of rows at a time (:func:`~memmode_core.quantization.row_bands.decode_by_rows`): a
        large layer's float32 values are never all alive beside the result."""
        codes = packed[PAYLOAD].reshape(-1)
        blocksize, per_row = self.blocksize, math.prod(shape[1:])
        absmax = packed["weight_absmax"].reshape(-1)
        if self.nested_blocksize:
            # dequantize_blockwise of the absmax codes (float32), then the offset added in float32
            nested = packed["weight_nested_quant_map"].index_select(0, absmax.int())
            absmax = blockwise(nested, packed["weight_nested_absmax"].reshape(-1), self.nested_blocksize)
            absmax = absmax + self.nested_offset
        pairs = level_pairs(self.quant_type, codes.device)

        def decode(rows: slice) -> torch.Tensor:
            start, stop = rows.start * per_row, rows.stop * per_row
            # the blocks run over the flattened weight: decoded from the start of the block the band begins in
            first = start - start % blocksize
            # each byte's two values at once; an odd count leaves the last byte's second value unused
            values = pairs.index_select(0, codes[first // 2 : (stop + 1) // 2].int()).view(torch.float32)
            scaled = blockwise(values[: stop - first], absmax[first // blocksize : -(-stop // blocksize)], blocksize)
            return scaled[start - first :]

        return decode_by_rows(shape, dtype, decode)


class BnbInt8(Quantizer):
    """bitsandbytes' LLM.int8() weights: ``weight_packed`` the ``int8`` codes, ``weight_scb`` the absmax of each
    row; decoded in float32 as ``int8_vectorwise_dequant`` computes (``codes * scb * (1/127)``, in that order)
    and rounded once to the compute dtype."""

    packs = False
    name = format = "bnb_int8"
    description = "bitsandbytes LLM.int8() weights: int8 rows with a float32 absmax each (read from folders)"

    def pack(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError(
            f"{self.name} decodes weights bitsandbytes quantized (a folder diffusers saved); it does not quantize "
            f"weights (load the folder with memmode.load, or quantize with qfloat8 or qfloat4)"
        )

    def unpack(self, packed: Mapping[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        codes = packed[PAYLOAD].reshape(shape[0], -1)
        scb = packed["weight_scb"].to(torch.float32).reshape(-1, 1)

        def decode(rows: slice) -> torch.Tensor:
            return codes[rows].to(torch.float32) * scb[rows] * INV_127

        return decode_by_rows(shape, dtype, decode)


INT8 = BnbInt8()


def format_name(quant_type: str, blocksize: int, nested_blocksize: int = 0, nested_offset: float = 0.0) -> str:
    """``bnb_nf4_b64``; double-quantized ``bnb_nf4_b64_n256_o3db25000`` (the offset's float32 bits, in hex)."""
    name = f"bnb_{quant_type}_b{blocksize}"
    if nested_blocksize:
        name += f"_n{nested_blocksize}_o{struct.unpack('<I', struct.pack('<f', nested_offset))[0]:08x}"
    return name


FORMAT = re.compile(r"bnb_(nf4|fp4)_b(\d+)(?:_n(\d+)_o([0-9a-f]{8}))?")


@functools.cache
def four_bit(quant_type: str, blocksize: int, nested_blocksize: int = 0, nested_offset: float = 0.0) -> BnbFourBit:
    """The codec of one constant set, shared by every layer and folder that has it."""
    return BnbFourBit(quant_type, blocksize, nested_blocksize, nested_offset)


class Codecs(Mapping[str, Quantizer]):
    """Every codec of this reader by format name: the 8-bit one and the 4-bit ones of each quant type and block
    size are listed; a double-quantized one (its offset in its name) is made from its name when asked for."""

    def __getitem__(self, name: str) -> Quantizer:
        if name == INT8.format_name:
            return INT8
        found = FORMAT.fullmatch(name)
        if found is None or int(found[2]) not in BLOCKSIZES:
            raise KeyError(name)
        quant_type, blocksize, nested, offset = found.groups()
        if nested is None:
            return four_bit(quant_type, int(blocksize))
        value = struct.unpack("<f", struct.pack("<I", int(offset, 16)))[0]
        if int(nested) <= 0 or not math.isfinite(value):
            raise KeyError(name)
        return four_bit(quant_type, int(blocksize), int(nested), value)

    def __iter__(self) -> Iterator[str]:
        yield INT8.format_name
        for quant_type in LEVELS:
            for blocksize in BLOCKSIZES:
                yield format_name(quant_type, blocksize)

    def __len__(self) -> int:
        return 1 + len(LEVELS) * len(BLOCKSIZES)
