"""Microscaling formats, decoded in plain torch: 4-bit E2M1 codes, E8M0 block exponents, scales per block, and
the tiled layout in which NVIDIA's kernels keep block scales.

NVFP4 and MXFP8 weights are stored as small codes with one scale per block of consecutive values along a row
(NVFP4: blocks of 16 E2M1 codes and an fp8 E4M3 scale, times one float32 scale of the whole tensor; MXFP8:
blocks of 32 fp8 E4M3 values and a power-of-two E8M0 scale). ComfyUI's files (comfy-kitchen's layouts) and
ModelOpt's exports store the same ideas with different choices — which nibble of a byte comes first, whether
the block scales are tiled for cuBLAS — so the pieces are here once, each a pure tensor function that runs on
any device (no library, no custom kernel), and the readers compose them:

- :func:`unpack_nibbles` / :func:`unpack_e2m1` / :func:`e2m1_to_float`: two 4-bit codes per byte, and their
  values (:data:`E2M1_VALUES`);
- :func:`e8m0_to_float`: E8M0 exponents as float32 powers of two;
- :func:`scale_blocks`: values times one scale per block of a row;
- :func:`untile_block_scales` (and :func:`tiled_scale_shape`): a block-scale matrix back from the 128x4 tiled
  ("swizzled") layout of cuBLAS' block-scaled matmuls, in which comfy-kitchen stores them.

Every function computes in float32 where the format's values are exact in it (an E2M1 value, an fp8 value, a
power of two), so a caller that multiplies in the same order as the reference gets its values bit for bit.
"""

from __future__ import annotations

import torch

#: the value of each E2M1 code (1 sign bit, 2 exponent bits, 1 mantissa bit; no infinities, no NaN): codes 0-7
#: are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8-15 their negatives (8 is -0.0)
E2M1_VALUES: tuple[float, ...] = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
#: the largest magnitude of an E2M1 value
E2M1_MAX = 6.0
#: E8M0's exponent bias: code ``e`` is ``2 ** (e - 127)``
E8M0_BIAS = 127
#: the tile of the cuBLAS block-scale layout: 128 rows by 4 block columns
TILE_ROWS, TILE_BLOCKS = 128, 4

_TABLES: dict[tuple[torch.device, torch.dtype, bool], torch.Tensor] = {}


def unpack_nibbles(packed: torch.Tensor, *, high_nibble_first: bool) -> torch.Tensor:
    """The 4-bit codes of ``packed`` (``uint8``, two codes a byte), as ``uint8`` codes 0-15: the last dimension
    doubles. ``high_nibble_first``: whether a byte's high nibble is the earlier of its two values (comfy-kitchen
    packs E2M1 that way) or its low nibble is (ModelOpt, torch's ``float4_e2m1fn_x2``, AWQ's uint4)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"4-bit codes are packed in uint8, got {packed.dtype}")
    high, low = packed >> 4, packed & 0x0F
    pair = (high, low) if high_nibble_first else (low, high)
    return torch.stack(pair, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def unpack_e2m1(packed: torch.Tensor, *, high_nibble_first: bool) -> torch.Tensor:
    """The E2M1 codes of ``packed`` (``uint8``, two codes a byte), as ``uint8`` codes 0-15 (:func:`unpack_nibbles`):
    the last dimension doubles."""
    return unpack_nibbles(packed, high_nibble_first=high_nibble_first)


def e2m1_to_float(packed: torch.Tensor, *, high_nibble_first: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of the E2M1 codes packed two a byte in ``packed``, in ``dtype`` (every E2M1 value is exact in
    every float dtype): the last dimension doubles. Looked up a byte at a time, in a table of the 256 pairs of
    values a byte can hold (half the lookups of one per code, and no unpacked codes in between)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"E2M1 codes are packed in uint8, got {packed.dtype}")
    table = _pair_table(packed.device, dtype, high_nibble_first)
    if table.element_size() == 4:  # a pair of float32 is one int64: a gather of scalars, the fastest on CPUs
        pairs = table.view(torch.int64).reshape(256).index_select(0, packed.flatten().to(torch.int32))
        return pairs.view(dtype).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    pairs = table.index_select(0, packed.flatten().to(torch.int32))
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e8m0_to_float(exponents: torch.Tensor) -> torch.Tensor:
    """E8M0 block exponents (``uint8`` codes, or torch's ``float8_e8m0fnu`` viewed as such) as float32:
    ``2 ** (code - 127)``, built from the bits (an exact power of two).

    Code 0 gives 0.0, as comfy-kitchen decodes it (the MX specification reads 2**-127, a difference only for a
    block whose values are all below about 2**-118, 448 times 2**-127); code 255 (NaN in the
    specification) gives infinity, as comfy-kitchen decodes it."""
    if exponents.dtype == getattr(torch, "float8_e8m0fnu", None):
        exponents = exponents.view(torch.uint8)
    if exponents.dtype != torch.uint8:
        raise TypeError(f"E8M0 exponents are uint8 codes, got {exponents.dtype}")
    bits = exponents.to(torch.int32) << 23
    return torch.where(exponents == 0, torch.zeros_like(bits), bits).view(torch.float32)


def scale_blocks(
    values: torch.Tensor, scales: torch.Tensor, block_size: int, *, in_place: bool = False
) -> torch.Tensor:
    """``values`` (``[rows, columns]``) times one scale per block of ``block_size`` consecutive values of a row:
    ``scales`` is ``[rows, columns // block_size]``. The product is computed in the promoted dtype of the two
    (float32 for float32 operands), one multiplication per value. ``in_place``: into ``values`` (a contiguous
    tensor the caller just made, of the product's dtype), saving the allocation of a weight-sized tensor."""
    rows, columns = values.shape
    if columns % block_size or tuple(scales.shape) != (rows, columns // block_size):
        raise ValueError(
            f"{list(scales.shape)} block scales do not fit [{rows}, {columns}] values in blocks of {block_size}"
        )
    blocks = values.view(rows, columns // block_size, block_size) if in_place else values.reshape(rows, -1, block_size)
    blocks = blocks.mul_(scales.unsqueeze(-1)) if in_place else blocks * scales.unsqueeze(-1)
    return blocks.reshape(rows, columns)


def tiled_scale_shape(rows: int, blocks: int) -> tuple[int, int]:
    """The shape of the tiled layout of a ``[rows, blocks]`` block-scale matrix: both padded up to whole tiles
    (``[ceil(rows / 128) * 128, ceil(blocks / 4) * 4]``), the padding left zero by the writer."""
    return (-(-rows // TILE_ROWS) * TILE_ROWS, -(-blocks // TILE_BLOCKS) * TILE_BLOCKS)


def untile_block_scales(tiled: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """The ``[rows, blocks]`` block scales held in ``tiled``, the layout cuBLAS' block-scaled matmuls read
    (its "block scaling factors layout"; comfy-kitchen's ``to_blocked``): the matrix, padded to whole tiles of
    128 rows by 4 block columns, is stored tile after tile (tiles of a row band consecutive); inside a tile, row
    ``r`` and column ``c`` are at ``(r % 32) * 16 + (r // 32) * 4 + c``. ``tiled`` may have any shape with
    :func:`tiled_scale_shape`'s number of elements, in any dtype (the values are moved, not computed).

    A band of 128 rows is a contiguous run of the tiled bytes, so rows cut at a multiple of 128 are the tiled
    rows of those rows."""
    padded_rows, padded_blocks = tiled_scale_shape(rows, blocks)
    if tiled.numel() != padded_rows * padded_blocks:
        raise ValueError(
            f"{tiled.numel()} tiled block scales are not the {padded_rows}x{padded_blocks} of [{rows}, {blocks}]"
        )
    bands, columns = padded_rows // TILE_ROWS, padded_blocks // TILE_BLOCKS
    # [band, column tile, r % 32, r // 32, c] -> [band, r // 32, r % 32, column tile, c]
    tiles = tiled.reshape(bands, columns, 32, 4, TILE_BLOCKS).permute(0, 3, 2, 1, 4)
    return tiles.reshape(padded_rows, padded_blocks)[:rows, :blocks]


def _pair_table(device: torch.device, dtype: torch.dtype, high_nibble_first: bool) -> torch.Tensor:
    """``[256, 2]``: the two E2M1 values of each byte, in the order they come."""
    key = (device, dtype, high_nibble_first)
    table = _TABLES.get(key)
    if table is None:
        values = torch.tensor(E2M1_VALUES, dtype=dtype)
        table = values[
            unpack_nibbles(torch.arange(256, dtype=torch.uint8)[:, None], high_nibble_first=high_nibble_first).long()
        ]
        table = _TABLES[key] = table.to(device)
    return table
