"""GGML's block types, dequantized to float32 in torch, bit-equal to gguf-py's ``gguf.quants.dequantize``.

A block type stores a row of values as blocks: ``block`` values in ``size`` bytes, the bytes of a block being its
scale(s) (little-endian float16 ``d``, and for the affine types a minimum ``m`` or ``dmin``) and its integer codes
(:data:`BLOCK_TYPES`). The i-quants' codes are indices instead: IQ4_NL's and IQ4_XS's into 16 integer levels
(:data:`KVALUES_IQ4NL`), the others' into a grid of points of 4 or 8 values (llama.cpp's grids, taken from gguf-py,
which carries them for its own dequantizers), with a sign bit per value (7 stored per 8, the 8th making their count
even, as llama.cpp's ``ksigns_iq2xs`` has it). Dequantizing is integer work on the bytes (shifts and masks into
codes, table look-ups into levels, points and signs) followed by a few float32 operations per value. Every float32
operation here is the one gguf-py does, on the same operands and in the same order:

- a product of a float16-derived scale by small integers is exact in float32 (11 significant bits times at most 13:
  IQ4_XS's ``(d * sc) * level`` is 11 + 6 + 7, IQ2_XXS's ``d * (0.5 + s) * 0.25 * point * sign`` 11 + 5 + 6, IQ1's
  ``point + delta`` is exact too), so only a final addition or subtraction (``d * q + m``, ``d * sc * q - dmin * m``)
  ever rounds, and it is the same single operation as gguf-py's (a fused multiply-add rounds it identically, the
  product being exact);
- the integers are converted before the operations gguf-py converts them before, so that even the sign of a zero
  (``d * 0`` with a negative ``d``) comes out as gguf-py's.

Everything is tensor operations on the device of the bytes (no numpy, no ``.item()``; the look-up tables are made
once per device): the forward of a layer whose weight rests in a block type calls :func:`dequantize` on the compute
device on every call.
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

#: the look-up tables (levels, grids, sign patterns) as float32 on each device they were asked on: made once per
#: device, not copied from the host at every call of a forward
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    """Table ``name`` (:data:`KVALUES_IQ4NL` as ``"iq4nl"``, ``"signs"``, ``"bit signs"``, or a grid by its type's
    name) on ``device``."""
    table = _TABLES.get((name, device))
    if table is None:
        table = _TABLES[(name, device)] = _host_table(name).to(device)
    return table


def _host_table(name: str) -> torch.Tensor:
    if name == "iq4nl":
        return torch.tensor(KVALUES_IQ4NL, dtype=torch.float32)
    if name == "bit signs":
        # every byte's 8 bits as -1 (set) and +1 (clear), lowest first
        bits = torch.arange(256, dtype=torch.int32).unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)
        return torch.where(bits & 1 == 1, -1.0, 1.0).to(torch.float32)
    if name == "signs":
        # llama.cpp's ``ksigns_iq2xs``: 7 stored sign bits and an 8th that makes their count even, as -1 and +1
        patterns = torch.arange(128, dtype=torch.int32)
        odd = torch.zeros(128, dtype=torch.int32)
        for bit in range(7):
            odd ^= (patterns >> bit) & 1
        bits = (patterns | (odd << 7)).unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)
        return torch.where(bits & 1 == 1, -1.0, 1.0).to(torch.float32)
    # a grid: llama.cpp's points, as gguf-py carries them (its dequantizers' own table)
    import gguf.quants
    import numpy as np

    kind = getattr(gguf.quants, name)
    kind.init_grid()
    return torch.from_numpy(np.ascontiguousarray(kind.grid, dtype=np.float32).reshape(kind.grid_shape))


def _rows(name: str, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` (integers, any shape) of table ``name``: ``(*index.shape, row)``, or ``index.shape`` for a
    one-dimensional table. One ``index_select`` by int32 indices (on the CPU twice as fast as indexing by them)."""
    table = _table(name, index.device)
    return table.index_select(0, index.reshape(-1).int()).view(*index.shape, *table.shape[1:])


def _levels(codes: torch.Tensor) -> torch.Tensor:
    """The float32 levels of ``codes`` (uint8, 0-15) in :data:`KVALUES_IQ4NL`, in their shape."""
    return _rows("iq4nl", codes)


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


# -- the grid i-quants: codes index points of a grid, with signs and a scale per sub-block ----------------------


def _u16(data: torch.Tensor) -> torch.Tensor:
    """Little-endian 16-bit words of ``data`` (``(..., 2k)`` bytes) as int32 ``(..., k)``, 0 to 65535."""
    return data.contiguous().view(torch.int16).int() & 0xFFFF


def _u32(data: torch.Tensor) -> torch.Tensor:
    """Little-endian 32-bit words of ``data`` (``(..., 4k)`` bytes) as int64 ``(..., k)``, 0 to 2**32 - 1."""
    return data.contiguous().view(torch.int32).long() & 0xFFFFFFFF


def _sign_bits(data: torch.Tensor) -> torch.Tensor:
    """``(..., L)`` bytes -> ``(..., L, 8)`` float32: -1 where bit ``k`` of a byte is set, +1 where not (one look-up
    per byte)."""
    return _rows("bit signs", data)


def _nibble_scales(data: torch.Tensor) -> torch.Tensor:
    """``(n, L)`` bytes of 4-bit scales, scale ``2i`` the low nibble of byte ``i``: ``(n, 2L)`` uint8."""
    return _nibbles(data).transpose(1, 2).reshape(data.shape[0], -1)


def _iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    # d, then per sub-block of 32 two u32: four grid indices (bytes), and four 7-bit sign indices with the scale s
    # in the top 4 bits: (d * (0.5 + s) * 0.25) * grid[8 values] * signs
    n = blocks.shape[0]
    d = _half(blocks, 0)
    words = blocks[:, 2:].reshape(n, 8, 8)
    aux = _u32(words[:, :, 4:]).view(n, 8)
    db = (d * (0.5 + (aux >> 28).float()) * 0.25).view(n, 8, 1, 1)
    signs = _rows("signs", torch.stack([(aux >> (7 * j)) & 127 for j in range(4)], dim=-1))
    grid = _rows("IQ2_XXS", words[:, :, :4])
    return (db * grid * signs).view(n, QK_K)


def _iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    # d, qs[32] u16 (a 9-bit grid index, a 7-bit sign index), scales[8] (16 of 4 bits, one per 16 values):
    # (d * (0.5 + sc) * 0.25) * grid[8 values] * signs
    n = blocks.shape[0]
    d = _half(blocks, 0)
    qs = _u16(blocks[:, 2:66])
    db = (d * (0.5 + _nibble_scales(blocks[:, 66:74]).float()) * 0.25).view(n, 16, 1, 1)
    signs = _rows("signs", qs >> 9).view(n, 16, 2, 8)
    grid = _rows("IQ2_XS", qs & 511).view(n, 16, 2, 8)
    return (db * grid * signs).view(n, QK_K)


def _iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    # d, qs[32] (grid index, low 8 bits), signs[32] (a bit per value), qh[8] (the index's top 2 bits, 4 per byte),
    # scales[8] (as IQ2_XS's): (d * (0.5 + sc) * 0.25) * grid[8 values] * signs, grid of 1024
    n = blocks.shape[0]
    d = _half(blocks, 0)
    db = (d * (0.5 + _nibble_scales(blocks[:, 74:82]).float()) * 0.25).view(n, 16, 1, 1)
    signs = _sign_bits(blocks[:, 34:66]).view(n, 16, 2, 8)
    high = _fields(blocks[:, 66:74], 2, dim=-1).reshape(n, 32).int()
    grid = _rows("IQ2_S", blocks[:, 2:34].int() | (high << 8)).view(n, 16, 2, 8)
    return (db * grid * signs).view(n, QK_K)


def _iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    # d, qs[64] (indices into a grid of 256 points of 4), then per sub-block of 32 a u32 of four 7-bit sign indices
    # and the scale s in the top 4 bits: (d * (0.5 + s) * 0.5) * grid * signs
    n = blocks.shape[0]
    d = _half(blocks, 0)
    aux = _u32(blocks[:, 66:98]).view(n, 8)
    db = (d * (0.5 + (aux >> 28).float()) * 0.5).view(n, 8, 1, 1)
    signs = _rows("signs", torch.stack([(aux >> (7 * j)) & 127 for j in range(4)], dim=-1))
    grid = _rows("IQ3_XXS", blocks[:, 2:66]).view(n, 8, 4, 8)
    return (db * grid * signs).view(n, QK_K)


def _iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    # d, qs[64] (grid index, low 8 bits), qh[8] (the index's 9th bit, a bit per index), signs[32] (a bit per value),
    # scales[4] (8 of 4 bits, as IQ2_XS's): (d * (1 + 2 * sc)) * grid * signs, a grid of 512 points of 4
    n = blocks.shape[0]
    d = _half(blocks, 0)
    db = (d * (1 + 2 * _nibble_scales(blocks[:, 106:110]).int()).float()).view(n, 8, 1, 1)
    high = _fields(blocks[:, 66:74], 1, dim=-1).reshape(n, 64).int()
    grid = _rows("IQ3_S", blocks[:, 2:66].int() | (high << 8)).view(n, 8, 4, 8)
    signs = _sign_bits(blocks[:, 74:106]).view(n, 8, 4, 8)
    return (db * grid * signs).view(n, QK_K)


def _iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    # d, qs[32] (grid index, low 8 bits), qh[8] u16 per sub-block of 32 (four 3-bit tops of its indices, a 3-bit
    # scale s, the sign of delta): (d * (2 * s + 1)) * (grid + delta), delta = +-0.125, a grid of 2048 points of 8
    n = blocks.shape[0]
    d = _half(blocks, 0)
    qh = _u16(blocks[:, 34:50])
    dl = (d * (2 * ((qh >> 12) & 7) + 1).float()).view(n, 8, 1, 1)
    delta = torch.where(qh & 0x8000 == 0, 0.125, -0.125).view(n, 8, 1, 1)
    high = torch.stack([(qh >> (3 * j)) & 7 for j in range(4)], dim=-1).view(n, 32)
    grid = _rows("IQ1_S", blocks[:, 2:34].int() | (high << 8)).view(n, 8, 4, 8)
    return (dl * (grid + delta)).view(n, QK_K)


def _iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    # qs[32] (grid index, low 8 bits), qh[16] (per index a nibble: the index's top 3 bits, the sign of delta),
    # scales[8] as 4 u16 (twelve 3-bit scales s per 16 values in their low bits, the f16 d in their four top
    # nibbles, lowest first): (d * (2 * s + 1)) * (grid + delta), delta = +-0.125, IQ1_S's grid
    n = blocks.shape[0]
    words = _u16(blocks[:, 48:56])
    top = words >> 12
    bits = top[:, 0] | (top[:, 1] << 4) | (top[:, 2] << 8) | (top[:, 3] << 12)
    d = ((bits ^ 0x8000) - 0x8000).to(torch.int16).view(torch.float16).float().view(n, 1)
    scales = torch.stack([(words >> (3 * j)) & 7 for j in range(4)], dim=-1).view(n, 16)
    dl = (d * (2 * scales + 1).float()).view(n, 8, 2, 1, 1)
    qh = _fields(blocks[:, 32:48], 4, dim=-1).reshape(n, 32)
    delta = torch.where(qh & 8 == 0, 0.125, -0.125).view(n, 8, 2, 2, 1)
    grid = _rows("IQ1_S", blocks[:, :32].int() | ((qh & 7).int() << 8)).view(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).view(n, QK_K)


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
        BlockType("IQ2_XXS", QK_K, 66, _iq2_xxs),
        BlockType("IQ2_XS", QK_K, 74, _iq2_xs),
        BlockType("IQ2_S", QK_K, 82, _iq2_s),
        BlockType("IQ3_XXS", QK_K, 98, _iq3_xxs),
        BlockType("IQ3_S", QK_K, 110, _iq3_s),
        BlockType("IQ1_S", QK_K, 50, _iq1_s),
        BlockType("IQ1_M", QK_K, 56, _iq1_m),
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
