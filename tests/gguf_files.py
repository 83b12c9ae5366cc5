"""GGUF files made in code, the way the community's tools make them, for tests of a GGUF reader (issue 42).

A GGUF checkpoint of a diffusion model is, in practice, what city96's ComfyUI-GGUF converter (``tools/convert.py``,
then llama.cpp's ``llama-quantize`` for the quantized types) writes through llama.cpp's own Python package, gguf-py:
the ``general.architecture`` string, every tensor in its GGML type, one-dimensional and small tensors kept in F32,
and for some architectures a tensor whose row does not fit the quantizer's 256-element blocks stored as rows of 256
with its real shape under ``comfy.gguf.orig_shape.<name>``. Real checkpoints are gigabytes, so the tests make small
ones here instead, with the same writer and the same layouts:

- :func:`quantize_blocks` turns float32 data into the bytes of one GGML type. For the types gguf-py quantizes it is
  gguf-py's own quantizer; for the K types, which gguf-py only dequantizes, a plain reference quantizer of this
  module (one scale choice per sub-block, no search for the best one, as llama.cpp does): its blocks are valid and
  dequantize close to the input, which is all a reader's test needs.
- :func:`write_gguf` writes a file the way city96's converter does.
- :func:`reference_dequantize` reads every tensor of a file back with gguf-py's dequantizers: the independent
  reference a GGUF reader's results are compared against.

gguf is a pinned test dependency (``requirements-test.txt``): its byte layouts are the reference, and its
dequantizers are what :func:`reference_dequantize` trusts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

#: every type :func:`quantize_blocks` makes
SUPPORTED_TYPES: tuple[Q, ...] = (
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    Q.IQ4_NL, Q.IQ4_XS,
)  # fmt: skip
#: the ones gguf-py quantizes itself (``gguf.quants.quantize``); the K types and the i-quants it only dequantizes
GGUF_PY_TYPES: tuple[Q, ...] = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
K_TYPES: tuple[Q, ...] = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
#: the i-quants whose levels are a table of 16 (llama.cpp's ``kvalues_iq4nl``), which community diffusion files use
IQ4_TYPES: tuple[Q, ...] = (Q.IQ4_NL, Q.IQ4_XS)
#: the i-quants whose codes index a grid of points: no quantizer here (llama.cpp searches the grid with an
#: importance matrix), only blocks of random bytes in their layout (:func:`random_iq_blocks`)
GRID_TYPES: tuple[Q, ...] = (Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S)

#: city96's converter keeps tensors of at most this many elements in F32 (``QUANTIZATION_THRESHOLD``)
SMALL_TENSOR_ELEMENTS = 1024
#: ... and reshapes (where its architecture asks for it) only tensors of at least this many (``REARRANGE_THRESHOLD``)
REARRANGE_MIN_ELEMENTS = 512
#: the metadata key under which ComfyUI-GGUF finds a reshaped tensor's real (torch-order) shape
ORIG_SHAPE_KEY = "comfy.gguf.orig_shape."

_QK = 256  # the K types' super-block


def block_size(qtype: Q) -> int:
    """Elements per block of ``qtype`` (1 for F32, F16, BF16)."""
    return gguf.GGML_QUANT_SIZES[qtype][0]


def quantize_blocks(values: np.ndarray, qtype: Q) -> np.ndarray:
    """``values`` (float32, last dimension a multiple of ``qtype``'s block size) as ``qtype``'s bytes.

    The result is uint8 in gguf's byte shape, ``(*rows, cols // block_size * type_size)``: what
    ``GGUFWriter.add_tensor`` takes with ``raw_dtype=qtype`` and what ``GGUFReader`` hands back. gguf-py's own
    quantizer for the types it has (the bytes are exactly ``gguf.quants.quantize``'s), this module's reference
    quantizer for the K types and the i-quants.
    """
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype not in SUPPORTED_TYPES:
        raise NotImplementedError(f"no quantizer here for {qtype.name}")
    bsize, tsize = gguf.GGML_QUANT_SIZES[qtype]
    if values.ndim == 0 or values.shape[-1] % bsize:
        raise ValueError(f"last dimension of {values.shape} is not a multiple of {qtype.name}'s block size {bsize}")
    byte_shape = (*values.shape[:-1], values.shape[-1] // bsize * tsize)
    if qtype in GGUF_PY_TYPES:
        # F32 and F16 come back as float arrays: their bytes are the same thing
        return np.ascontiguousarray(gguf.quants.quantize(values, qtype)).view(np.uint8).reshape(byte_shape)
    blocks = values.reshape(-1, bsize)
    out = _REFERENCE_QUANTIZERS[qtype](blocks)
    assert out.dtype == np.uint8 and out.shape == (blocks.shape[0], tsize), (qtype.name, out.shape)
    return out.reshape(byte_shape)


# ---------------------------------------------------------------------------------------------------------------
# the K types: a reference quantizer, the inverse of gguf-py's dequantize_blocks (gguf/quants.py)
#
# Each super-block of 256 holds sub-blocks (16 of 16, or 8 of 32), each with its own scale (and, for Q2_K, Q4_K,
# Q5_K, its own minimum) stored as a small integer times the super-block's f16 ``d`` (``dmin``). The choice here is
# the plain one: per sub-block the scale that covers its range, rounded *up* to the stored grid (so nothing
# clips), then every element rounded to the nearest level. The error is then at most half a level.


def _f16_at_least(x: np.ndarray) -> np.ndarray:
    """``x`` (>= 0) as f16 values that are not below it: the stored super-block scale must never shrink the range."""
    h = x.astype(np.float16)
    return np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)


def _f16_bytes(h: np.ndarray) -> np.ndarray:
    return h.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1), 0).astype(np.float32)


def _affine_scales(sub: np.ndarray, qmax: int, smax: int) -> tuple[np.ndarray, ...]:
    """For ``y = d * sc * q - dmin * m`` (q in 0..qmax, sc and m in 0..smax): per sub-block of ``sub`` (n, S, L)
    the stored ``d``, ``dmin`` (f16, (n,)), ``sc``, ``m`` (uint8, (n, S)) and the levels ``q`` (uint8, (n, S, L))."""
    lo = np.minimum(sub.min(axis=-1), 0)  # a sub-block's offset is -dmin * m <= 0
    hi = sub.max(axis=-1)
    dmin = _f16_at_least((-lo).max(axis=-1) / smax)  # (n,)
    dmin32 = dmin.astype(np.float32)[:, None]
    m = np.clip(np.ceil(_div(-lo, dmin32)), 0, smax)
    offset = dmin32 * m  # >= -lo: the lowest level reaches the sub-block's minimum
    step = (hi + offset) / qmax  # the level spacing that reaches its maximum from there
    d = _f16_at_least(step.max(axis=-1) / smax)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.ceil(_div(step, d32)), 0, smax)
    q = np.clip(np.rint(_div(sub + offset[..., None], (d32 * sc)[..., None])), 0, qmax)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)


def _symmetric_scales(sub: np.ndarray, qmax: int, smax: int) -> tuple[np.ndarray, ...]:
    """For ``y = d * sc * q`` (q in -qmax-1..qmax, sc in -smax..smax): per sub-block of ``sub`` (n, S, L) the stored
    ``d`` (f16, (n,)), ``sc`` (int, (n, S)) and ``q`` (int, (n, S, L)). The scale is kept positive and covers the
    sub-block's absolute maximum with ``qmax`` levels: the one extra negative level goes unused."""
    step = np.abs(sub).max(axis=-1) / qmax
    d = _f16_at_least(step.max(axis=-1) / smax)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.ceil(_div(step, d32)), 0, smax)
    q = np.clip(np.rint(_div(sub, (d32 * sc)[..., None])), -qmax - 1, qmax)
    return d, sc.astype(np.int32), q.astype(np.int32)


def _pack_bits(levels: np.ndarray, bits: int, groups: int) -> np.ndarray:
    """(n, groups * G, L) small integers of ``bits`` bits into (n, G * L) bytes: level ``k`` of a run of ``groups``
    in the bits ``k * bits`` of its byte (the element order gguf-py's ``x.reshape(n, -1, 1, L) >> shifts`` undoes)."""
    n, _, length = levels.shape
    levels = levels.reshape(n, -1, groups, length).astype(np.uint8)
    out = np.zeros((n, levels.shape[1], length), dtype=np.uint8)
    for k in range(groups):
        out |= (levels[:, :, k, :] & ((1 << bits) - 1)) << (k * bits)
    return out.reshape(n, -1)


def _pack_scales_6bit_k(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K's and Q5_K's 12 scale bytes for 8 scales and 8 minimums of 6 bits (``Q4_K.get_scale_min`` inverted):
    bytes 0-3 and 4-7 hold scales and minimums 0-3 in their low 6 bits and the top 2 bits of 4-7 above them; bytes
    8-11 hold the low 4 bits of scales 4-7 (low nibble) and of minimums 4-7 (high nibble)."""
    first = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    second = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=1).astype(np.uint8)


def _quantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    """Q2_K, 84 bytes: scales[16] (scale low nibble, minimum high nibble, per 16), qs[64] (2 bits), d, dmin."""
    n = blocks.shape[0]
    d, dmin, sc, m, q = _affine_scales(blocks.reshape(n, 16, 16), qmax=3, smax=15)
    scales = (sc & 0x0F) | (m << 4)
    qs = _pack_bits(q.reshape(n, 8, 32), bits=2, groups=4)  # element h*128 + s*32 + l: qs[h*32 + l] >> 2s
    return np.concatenate([scales, qs, _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def _quantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    """Q3_K, 110 bytes: hmask[32], qs[64] (low 2 bits), scales[12] (16 of 6 bits, biased by 32), d.

    The level is ``(low 2 bits) - 4 * (1 - hmask bit)``, that is ``level + 4`` split into 2 low bits and a high bit.
    """
    n = blocks.shape[0]
    d, sc, q = _symmetric_scales(blocks.reshape(n, 16, 16), qmax=3, smax=31)
    u = (q + 4).reshape(n, 8, 32)  # 0..7
    hmask = _pack_bits(u >> 2, bits=1, groups=8)  # element b*32 + l: hmask[l] >> b
    qs = _pack_bits(u & 3, bits=2, groups=4)
    s = (sc + 32).astype(np.uint8)  # (n, 16), 6 bits
    low = (s[:, :8] & 0x0F) | ((s[:, 8:] & 0x0F) << 4)  # byte i: scale i low nibble, scale i + 8 high nibble
    high = _pack_bits((s >> 4).reshape(n, 4, 4), bits=2, groups=4)  # byte 8 + j: scale 4k + j's top bits at 2k
    return np.concatenate([hmask, qs, low, high, _f16_bytes(d)], axis=1)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K, 144 bytes: d, dmin, scales[12] (8 scales and minimums of 6 bits), qs[128] (4 bits, per 32)."""
    n = blocks.shape[0]
    d, dmin, sc, m, q = _affine_scales(blocks.reshape(n, 8, 32), qmax=15, smax=63)
    qs = _pack_bits(q.reshape(n, 8, 32), bits=4, groups=2)  # element c*64 + k*32 + l: qs[c*32 + l] >> 4k
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales_6bit_k(sc, m), qs], axis=1)


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q5_K, 176 bytes: as Q4_K with qh[32] (the fifth bits: element b*32 + l in qh[l] >> b) before qs[128]."""
    n = blocks.shape[0]
    d, dmin, sc, m, q = _affine_scales(blocks.reshape(n, 8, 32), qmax=31, smax=63)
    q = q.reshape(n, 8, 32)
    qh = _pack_bits(q >> 4, bits=1, groups=8)
    qs = _pack_bits(q & 0x0F, bits=4, groups=2)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales_6bit_k(sc, m), qh, qs], axis=1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K, 210 bytes: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8, per 16), d; level - 32."""
    n = blocks.shape[0]
    d, sc, q = _symmetric_scales(blocks.reshape(n, 16, 16), qmax=31, smax=127)
    u = (q + 32).astype(np.uint8).reshape(n, 256)
    ql = _pack_bits((u & 0x0F).reshape(n, 4, 64), bits=4, groups=2)  # element h*128 + k*64 + i: ql[h*64 + i] >> 4k
    qh = _pack_bits((u >> 4).reshape(n, 8, 32), bits=2, groups=4)  # element h*128 + s*32 + l: qh[h*32 + l] >> 2s
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql, qh, scales, _f16_bytes(d)], axis=1)


# ---------------------------------------------------------------------------------------------------------------
# IQ4_NL and IQ4_XS: a reference quantizer, the inverse of gguf-py's dequantize_blocks
#
# A block of 32 is a signed scale times one of 16 integer levels per element (``KVALUES_IQ4NL``, from -127 to 113).
# As llama.cpp does, the scale's sign is chosen so that the block's element of largest magnitude maps to -127 (the
# level of largest magnitude); unlike llama.cpp (which searches scales around it), the scale is that one, rounded
# away from zero to the stored grid so that nothing clips, and each element takes its nearest level. The error is
# then at most 14 level units (the gap from 113 to 127) of the scale: 14/127 of the block's absolute maximum,
# times the scale's grid rounding.

#: llama.cpp's ``kvalues_iq4nl``, written out here: the fixtures do not take the decoder's table on trust
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _block_scales(sub: np.ndarray) -> np.ndarray:
    """Per block of ``sub`` (n, S, 32) the signed scale that maps its element of largest magnitude to -127."""
    extreme = np.take_along_axis(sub, np.abs(sub).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    return (-extreme / 127).astype(np.float32)


def _nearest_levels(sub: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The index of the level nearest ``sub / scale`` for every element (uint8, sub's shape)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(scale[..., None] != 0, sub / np.where(scale != 0, scale, 1)[..., None], 0)
    return np.abs(ratio[..., None] - KVALUES_IQ4NL).argmin(axis=-1).astype(np.uint8)


def _quantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL, 18 bytes per 32: d, qs[16] (element j < 16 in the low nibble of qs[j], j + 16 in its high nibble)."""
    n = blocks.shape[0]
    wanted = _block_scales(blocks.reshape(n, 1, 32))[:, 0]
    d = (np.sign(wanted) * _f16_at_least(np.abs(wanted))).astype(np.float16)
    q = _nearest_levels(blocks.reshape(n, 1, 32), d.astype(np.float32)[:, None]).reshape(n, 2, 16)
    return np.concatenate([_f16_bytes(d), _pack_bits(q, bits=4, groups=2)], axis=1)


def _quantize_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS, 136 bytes per 256: d, scales_h (u16, bits 2j: the top 2 bits of sub-block j's scale), scales_l[4]
    (byte i: the low 4 bits of scale 2i low, of 2i + 1 high), qs[128] (each sub-block of 32 as IQ4_NL's); a sub-block's
    scale is ``d * (sc - 32)``, sc of 6 bits. ``d`` covers the largest sub-block scale with 31 steps, each sub-block's
    step count rounded away from zero (its scale never shrinks)."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    wanted = _block_scales(sub)  # (n, 8), signed
    d = _f16_at_least(np.abs(wanted).max(axis=-1) / 31)
    d32 = d.astype(np.float32)[:, None]
    steps = np.clip(np.sign(wanted) * np.ceil(_div(np.abs(wanted), d32)), -32, 31).astype(np.int32)
    q = _nearest_levels(sub, d32 * steps.astype(np.float32))  # (n, 8, 32)
    sc = (steps + 32).astype(np.uint16)  # 6 bits
    scales_h = np.zeros(n, dtype=np.uint16)
    for j in range(8):
        scales_h |= (sc[:, j] >> 4) << (2 * j)
    scales_l = ((sc[:, 0::2] & 0x0F) | ((sc[:, 1::2] & 0x0F) << 4)).astype(np.uint8)
    qs = _pack_bits(q.reshape(n, 16, 16), bits=4, groups=2)  # per sub-block: element k*16 + l in nibble k
    return np.concatenate([_f16_bytes(d), scales_h.reshape(-1, 1).view(np.uint8), scales_l, qs], axis=1)


def random_iq_blocks(rng: np.random.Generator, count: int, qtype: Q, scale: float = 0.01) -> np.ndarray:
    """``count`` blocks of the i-quant ``qtype`` of random bytes: every code, grid index, sign and sub-block scale
    possible, in llama.cpp's layout, whatever a quantizer would choose; the f16 ``d`` drawn from N(0, ``scale``) (of
    either sign), the first four zeros, the smallest subnormal and a negative subnormal. ``(count, type_size)``
    uint8."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (count, size), dtype=np.uint8)
    d = (rng.standard_normal(count) * scale).astype(np.float16)
    d[:4] = np.array([0.0, -0.0, 6e-8, -3e-5], dtype=np.float16)[: min(4, count)]
    bits = d.view(np.uint16)
    if qtype == Q.IQ1_M:  # d's four nibbles are the top nibbles of the four u16 scale words, lowest first
        words = blocks[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
        blocks[:, 48:56] = words.view(np.uint8)
    else:
        blocks[:, :2] = bits.reshape(-1, 1).view(np.uint8)
    return blocks


_REFERENCE_QUANTIZERS = {
    Q.Q2_K: _quantize_q2_k,
    Q.Q3_K: _quantize_q3_k,
    Q.Q4_K: _quantize_q4_k,
    Q.Q5_K: _quantize_q5_k,
    Q.Q6_K: _quantize_q6_k,
    Q.IQ4_NL: _quantize_iq4_nl,
    Q.IQ4_XS: _quantize_iq4_xs,
}


# ---------------------------------------------------------------------------------------------------------------
# files


def stored_type(
    name: str, shape: tuple[int, ...], qtype: Q, keep_f32: Iterable[str] = (), keep_f16: Iterable[str] = ()
) -> Q:
    """The type city96's converter stores a float32 tensor in when asked for ``qtype``: F32 for one-dimensional
    tensors, for tensors of at most :data:`SMALL_TENSOR_ELEMENTS` elements, for more than 4 dimensions (its
    ``fix_5d_tensors.py`` adds those back as F32) and for names containing one of ``keep_f32`` (its ``keys_hiprec``,
    e.g. Wan's ``.modulation``); ``qtype`` otherwise.

    ``keep_f16``: tensors of 2 to 4 dimensions whose names contain one of these stay F16, whatever their size, as
    the converter's F16 file holds them and llama-quantize leaves them (the embeddings city96's patch keeps out of
    the quantization): a file with F16 embeddings beside F32 norms, even made from a tiny model."""
    if 1 < len(shape) <= 4 and any(part in name for part in keep_f16):
        return Q.F16
    if len(shape) <= 1 or int(np.prod(shape)) <= SMALL_TENSOR_ELEMENTS or len(shape) > 4:
        return Q.F32
    if any(part in name for part in keep_f32):
        return Q.F32
    return qtype


def write_gguf(
    path: str | os.PathLike[str],
    tensors: Mapping[str, tuple[np.ndarray, Q]],
    *,
    arch: str,
    metadata: Mapping[str, object] | None = None,
    reshape_rows_to: int | None = None,
    keep_f32: Iterable[str] = (),
    keep_f16: Iterable[str] = (),
) -> dict[str, Q]:
    """Write ``tensors`` (name: (float32 values in torch's shape, the type asked for)) to a GGUF file at ``path``
    the way city96's ComfyUI-GGUF converter does, and return the type each tensor was stored in.

    - ``general.architecture`` is ``arch`` and ``general.quantization_version`` gguf's; ``metadata`` adds further
      keys (str, bool, int as INT32, float as FLOAT32, or a list of those as an array).
    - A tensor is stored in :func:`stored_type` (F32 for 1-D, small, 5-D and ``keep_f32`` tensors, F16 for
      ``keep_f16`` ones), quantized by
      :func:`quantize_blocks` and written as its uint8 bytes with ``raw_dtype`` (gguf-py derives the element shape).
    - ``reshape_rows_to`` (city96 uses 256, for the architectures that set ``shape_fix``: SD1, SDXL): a tensor of
      2 to 4 dimensions, at least :data:`REARRANGE_MIN_ELEMENTS` elements, a multiple of ``reshape_rows_to`` in
      all but not in its last dimension, is stored as rows of ``reshape_rows_to`` with its real shape (torch order,
      an INT32 array, as ComfyUI-GGUF's ``get_orig_shape`` requires) under ``comfy.gguf.orig_shape.<name>``.
    - A tensor whose row still does not fit its type's block is stored F16, as the converter's fallback does.
    """
    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in (metadata or {}).items():
        _add_metadata(writer, key, value)
    stored: dict[str, Q] = {}
    for name, (values, asked) in tensors.items():
        values = np.asarray(values, dtype=np.float32)
        qtype = stored_type(name, values.shape, asked, keep_f32, keep_f16)
        n = values.size
        if (
            reshape_rows_to is not None
            and 1 < values.ndim <= 4
            and n >= REARRANGE_MIN_ELEMENTS
            and n % reshape_rows_to == 0
            and values.shape[-1] % reshape_rows_to != 0
        ):
            writer.add_array(ORIG_SHAPE_KEY + name, [int(dim) for dim in values.shape])
            values = values.reshape(n // reshape_rows_to, reshape_rows_to)
        if values.shape[-1] % block_size(qtype):
            qtype = Q.F16
        writer.add_tensor(name, quantize_blocks(values, qtype), raw_dtype=qtype)
        stored[name] = qtype
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _add_metadata(writer: gguf.GGUFWriter, key: str, value: object) -> None:
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_int32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, list | tuple):
        writer.add_array(key, list(value))
    else:
        raise TypeError(f"metadata {key!r}: no GGUF value for {type(value).__name__}")


def orig_shape(reader: gguf.GGUFReader, name: str) -> tuple[int, ...] | None:
    """The real shape of tensor ``name`` stored under ``comfy.gguf.orig_shape.<name>``, None without one; read as
    ComfyUI-GGUF reads it (an array of INT32, anything else an error)."""
    field = reader.get_field(ORIG_SHAPE_KEY + name)
    if field is None:
        return None
    if field.types != [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]:
        raise TypeError(f"{ORIG_SHAPE_KEY}{name}: expected an array of INT32, got {field.types}")
    return tuple(int(field.parts[index][0]) for index in field.data)


def reference_dequantize(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF file at ``path``, dequantized by gguf-py (``gguf.quants.dequantize``) to float32
    in its real torch shape: GGUF lists dimensions innermost first, so the shape is the stored one reversed, or
    ``comfy.gguf.orig_shape.<name>`` where the file has one."""
    reader = gguf.GGUFReader(path)
    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        shape = orig_shape(reader, tensor.name) or tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
        out[tensor.name] = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
    return out
