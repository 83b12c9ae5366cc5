"""GGML's block types, dequantized to float32 in torch, bit-equal to gguf-py's ``gguf.quants.dequantize``.

A block type stores a row of values as blocks: ``block`` values in ``size`` bytes, the bytes of a block being its
scale(s) (little-endian float16 ``d``, and for the affine types a minimum ``m`` or ``dmin``) and its integer codes
(:data:`BLOCK_TYPES`); an i-quant's 4-bit code is the index of one of 16 integer levels (:data:`KVALUES_IQ4NL`).
Dequantizing is integer work on the bytes (shifts and masks into codes, a table look-up into levels) followed by one
or two float32 operations per value. Every float32 operation here is the one gguf-py does, on the same operands and
in the same order:

- a product of a float16-derived scale by small integers is exact in float32 (11 significant bits times at most 13:
  IQ4_XS's ``(d * sc) * level`` is 11 + 6 + 7), so only a final addition or subtraction (``d * q + m``,
  ``d * sc * q - dmin * m``) ever rounds, and it is the same single operation as gguf-py's (a fused multiply-add
  rounds it identically, the product being exact);
- the integers are converted before the operations gguf-py converts them before, so that even the sign of a zero
  (``d * 0`` with a negative ``d``) comes out as gguf-py's.

Everything is tensor operations on the device of the bytes (no numpy, no ``.item()``): the forward of a layer
whose weight rests in a block type calls :func:`dequantize` on the compute device on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: elements per super-block of the K types
QK_K = 256


@dataclass(frozen=True)
class BlockType:
    """One GGML block type: ``block`` values stored in ``size`` bytes, decoded by ``decode`` from ``(n, size)``
    uint8 blocks to ``(n, block)`` float32 values."""

    name: str
    block: int
    size: int
    decode: Callable[[torch.Tensor], torch.Tensor]


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian float16 at byte ``at`` of every block, as float32 ``(n, 1)``: its two bytes copied out
    (``(n, 2)``, small beside the codes) so that their view as float16 holds whatever the blocks' alignment."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _fields(data: torch.Tensor, width: int, at: int = 0, dim: int = -2) -> torch.Tensor:
    """The fields of ``width`` bits of every byte of ``data``, the lowest first, stacked along a new dimension
    ``dim`` (``(n, ..., L)`` -> ``(n, ..., 8 / width, L)`` by default), each moved to bit ``at`` of its byte.

    One shift and one mask per field on the bytes, then one stack: on the CPU a shift by a tensor of shifts
    broadcast over the bytes takes a slow unvectorized path, three to four times slower than this."""
    mask = ((1 << width) - 1) << at
    fields = []
    for low in range(0, 8, width):
        shift = low - at
        moved = data >> shift if shift > 0 else data << -shift if shift < 0 else data
        fields.append(moved & mask)
    return torch.stack(fields, dim=dim)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``(n, ..., L)`` bytes -> ``(n, ..., 2, L)`` 4-bit codes: the low nibbles, then the high ones."""
    return _fields(qs, 4)


# -- the legacy types: blocks of 32 ----------------------------------------------------------------------------


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # d, qs[32] int8: x * d
    d = _half(blocks, 0)
    return blocks[:, 2:].view(torch.int8).float().mul_(d)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # d, qs[16]: element j < 16 in the low nibble of qs[j], j + 16 in its high nibble; d * (q - 8)
    d = _half(blocks, 0)
    q = _nibbles(blocks[:, 2:]).view(torch.int8).sub_(8)
    return q.flatten(1).float().mul_(d)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # d, m, qs[16]: (d * q) + m
    d, m = _half(blocks, 0), _half(blocks, 2)
    q = _nibbles(blocks[:, 4:]).flatten(1)
    return q.float().mul_(d).add_(m)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # d, qh (u32: bit j the fifth bit of element j), qs[16]: d * ((low | high << 4) - 16)
    d = _half(blocks, 0)
    q = _nibbles(blocks[:, 6:]).flatten(1).bitwise_or_(_fields(blocks[:, 2:6], 1, at=4, dim=-1).flatten(1))
    return q.view(torch.int8).sub_(16).float().mul_(d)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # d, m, qh, qs[16]: (d * q) + m
    d, m = _half(blocks, 0), _half(blocks, 2)
    q = _nibbles(blocks[:, 8:]).flatten(1).bitwise_or_(_fields(blocks[:, 4:8], 1, at=4, dim=-1).flatten(1))
    return q.float().mul_(d).add_(m)


# -- the K types: super-blocks of 256 --------------------------------------------------------------------------


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # scales[16] (scale low nibble, minimum high nibble), qs[64] (element h*128 + s*32 + l: qs[h*32 + l] >> 2s),
    # d, dmin: (d * sc) * q - (dmin * m) per sub-block of 16
    n = blocks.shape[0]
    scales = blocks[:, :16]
    d, dmin = _half(blocks, 80), _half(blocks, 82)
    dl = (d * (scales & 15).float()).unsqueeze(-1)
    ml = (dmin * (scales >> 4).float()).unsqueeze(-1)
    q = _fields(blocks[:, 16:80].view(n, 2, 32), 2).view(n, 16, 16)
    return (q.float().mul_(dl).sub_(ml)).view(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # hmask[32] (element b*32 + l: bit b of hmask[l]), qs[64] (as Q2_K's), scales[12] (16 of 6 bits, biased by 32:
    # byte i < 8 holds scale i's low nibble low and scale i + 8's high, byte 8 + j holds the top 2 bits of scales
    # j, j + 4, j + 8, j + 12), d: (d * (sc - 32)) * (low - 4 * (1 - high)) per sub-block of 16
    n = blocks.shape[0]
    d = _half(blocks, 108)
    low = _nibbles(blocks[:, 96:104]).view(n, 16)
    high = _fields(blocks[:, 104:108], 2, at=4).view(n, 16)
    sc = low.bitwise_or_(high).view(torch.int8).sub_(32)
    dl = (d * sc.float()).unsqueeze(-1)
    q = _fields(blocks[:, 32:96].view(n, 2, 32), 2).view(n, 16, 16).view(torch.int8)
    q = q.bitwise_or_(_fields(blocks[:, :32], 1, at=2).view(n, 16, 16).view(torch.int8)).sub_(4)
    return (q.float().mul_(dl)).view(n, QK_K)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 scale bytes -> 8 scales and 8 minimums of 6 bits, uint8 ``(n, 8)`` each: bytes 0-3 and
    4-7 hold scales and minimums 0-3 in their low 6 bits and the top 2 bits of 4-7 above them; bytes 8-11 the low
    4 bits of scales 4-7 (low nibble) and of minimums 4-7 (high nibble)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=1)
    return sc, mn


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # d, dmin, scales[12], qs[128] (element c*64 + k*32 + l: nibble k of qs[c*32 + l]):
    # (d * sc) * q - (dmin * m) per sub-block of 32
    n = blocks.shape[0]
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    dl = (d * sc.float()).unsqueeze(-1)
    ml = (dmin * mn.float()).unsqueeze(-1)
    q = _nibbles(blocks[:, 16:].view(n, 4, 32)).view(n, 8, 32)
    return q.float().mul_(dl).sub_(ml).view(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # as Q4_K, with qh[32] (element s*32 + l: bit s of qh[l], the fifth bit) before qs[128]
    n = blocks.shape[0]
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    dl = (d * sc.float()).unsqueeze(-1)
    ml = (dmin * mn.float()).unsqueeze(-1)
    q = _nibbles(blocks[:, 48:].view(n, 4, 32)).view(n, 8, 32).bitwise_or_(_fields(blocks[:, 16:48], 1, at=4))
    return q.float().mul_(dl).sub_(ml).view(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # ql[128] (element h*128 + k*64 + i: nibble k of ql[h*64 + i]), qh[64] (element h*128 + s*32 + l: bits 2s of
    # qh[h*32 + l], the top two), scales[16] int8, d: (d * sc) * (q - 32) per sub-block of 16
    n = blocks.shape[0]
    d = _half(blocks, 208)
    dl = (d * blocks[:, 192:208].view(torch.int8).float()).unsqueeze(-1)
    low = _nibbles(blocks[:, :128].view(n, 2, 64)).view(n, 8, 32)
    high = _fields(blocks[:, 128:192].view(n, 2, 32), 2, at=4).view(n, 8, 32)
    q = low.bitwise_or_(high).view(torch.int8).sub_(32)
    return q.view(n, 16, 16).float().mul_(dl).view(n, QK_K)


# -- the non-linear 4-bit types: codes index a table of 16 levels ---------------------------------------------

#: IQ4_NL's and IQ4_XS's 16 levels (llama.cpp's ``kvalues_iq4nl``), denser near zero where weights are: a 4-bit
#: code is the index of its level, and the value is a scale times the level (exact in float32, levels being
#: integers of at most 7 bits)
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

#: the levels as float32 on each device they were asked on: made once per device, not copied from the host at
#: every call of a forward
_LEVELS: dict[torch.device, torch.Tensor] = {}


def _levels(codes: torch.Tensor) -> torch.Tensor:
    """The float32 levels of ``codes`` (uint8, 0-15) in :data:`KVALUES_IQ4NL`, in their shape: one ``index_select``
    by int32 indices (on the CPU twice as fast as indexing by them, which also takes int64 ones)."""
    table = _LEVELS.get(codes.device)
    if table is None:
        table = _LEVELS[codes.device] = torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=codes.device)
    return table.index_select(0, codes.reshape(-1).int()).view(codes.shape)


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    # d, qs[16] (as Q4_0's: element j < 16 in the low nibble of qs[j], j + 16 in its high nibble): d * level
    d = _half(blocks, 0)
    return _levels(_nibbles(blocks[:, 2:])).flatten(1).mul_(d)


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # d, scales_h (u16: bits 2j the top two of sub-block j's scale), scales_l[4] (byte i: scale 2i's low nibble low,
    # 2i + 1's high), qs[128] (sub-block s of 32 as an IQ4_NL block: element k*16 + l in nibble k of
    # qs[s*16 + l]): (d * (sc - 32)) * level per sub-block of 32
    n = blocks.shape[0]
    d = _half(blocks, 0)
    low = _nibbles(blocks[:, 4:8]).transpose(1, 2).reshape(n, 8)
    high = _fields(blocks[:, 2:4], 2, at=4).transpose(1, 2).reshape(n, 8)
    sc = low.bitwise_or_(high).view(torch.int8).sub_(32)
    dl = (d * sc.float()).unsqueeze(-1)
    q = _levels(_nibbles(blocks[:, 8:].view(n, 8, 16))).view(n, 8, 32)
    return q.mul_(dl).view(n, QK_K)


#: every block type this module dequantizes, by GGML's name
BLOCK_TYPES: dict[str, BlockType] = {
    t.name: t
    for t in (
        BlockType("Q8_0", 32, 34, _q8_0),
        BlockType("Q4_0", 32, 18, _q4_0),
        BlockType("Q4_1", 32, 20, _q4_1),
        BlockType("Q5_0", 32, 22, _q5_0),
        BlockType("Q5_1", 32, 24, _q5_1),
        BlockType("Q2_K", QK_K, 84, _q2_k),
        BlockType("Q3_K", QK_K, 110, _q3_k),
        BlockType("Q4_K", QK_K, 144, _q4_k),
        BlockType("Q5_K", QK_K, 176, _q5_k),
        BlockType("Q6_K", QK_K, 210, _q6_k),
        BlockType("IQ4_NL", 32, 18, _iq4_nl),
        BlockType("IQ4_XS", QK_K, 136, _iq4_xs),
    )
}


def dequantize(data: torch.Tensor, type_name: str) -> torch.Tensor:
    """The float32 values of ``data``, uint8 bytes of whole blocks of the GGML type ``type_name`` on any device.

    The result has ``data``'s shape with its last dimension in values instead of bytes when that dimension holds
    whole blocks (a GGUF tensor's rows), and is one-dimensional otherwise.
    """
    kind = BLOCK_TYPES.get(type_name)
    if kind is None:
        raise ValueError(f"no dequantizer for GGML type {type_name!r}: the block types are {', '.join(BLOCK_TYPES)}")
    if data.dtype != torch.uint8:
        raise TypeError(f"{type_name} blocks are uint8 bytes, got {data.dtype}")
    if data.numel() % kind.size:
        raise ValueError(f"{data.numel()} bytes are not whole {type_name} blocks of {kind.size} bytes")
    values = kind.decode(data.reshape(-1, kind.size))
    if data.dim() and data.shape[-1] % kind.size == 0:
        return values.view(*data.shape[:-1], data.shape[-1] // kind.size * kind.block)
    return values.view(-1)
