"""The GGUF fixtures of ``tests/gguf_files.py`` are what they claim: bytes gguf-py reads back close to the input in
every type, gguf-py's own bytes where gguf-py quantizes, and files laid out the way city96's converter lays them.

Tolerances are per block (for the K types per super-block of 256), relative to the block's absolute maximum ``A``
(its range is at most ``2A``), and follow from the bits, with a little room for the f16 scales:

- Q8_0: the level is ``A / 127``, an error of at most half of it: ``1/254 = 0.0039``, then 0.005.
- Q4_0, Q5_0 (gguf-py's, as ggml's): the signed extreme is level -8 (-16); an opposite extreme as large clips at +7
  (+15), a whole level: ``1/8`` and ``1/16``, then 0.13 and 0.065.
- Q4_1, Q5_1: the level is ``range / 15`` (``/ 31``), half of it at most: ``1/15``, ``1/31``, then 0.07 and 0.035.
- The K types (this module's quantizer, every scale rounded up so nothing clips, so half a level at most, the level
  being at most a sub-block's range over the levels, times ``1 + 1/smax`` for the stored scale's grid):
  Q6_K ``(1/31)(1 + 1/127)/2 = 0.0163`` -> 0.017; Q5_K ``(2.016/31)(1 + 1/63)/2 = 0.033`` -> 0.035;
  Q4_K ``(2.016/15)(1 + 1/63)/2 = 0.068`` -> 0.07; Q3_K ``(1/3)(1 + 1/31)/2 = 0.172`` -> 0.175;
  Q2_K ``(2.067/3)(1 + 1/15)/2 = 0.367`` -> 0.37 (2 bits, with 4-bit scales and minimums: coarse by design).
- The i-quants (this module's quantizer: a block's element of largest magnitude at level -127, the scale rounded away
  from zero, every element at its nearest of the 16 levels): at most the widest half-gap, 14 level units (113 to
  127), of a scale of at most ``A / 127``: IQ4_NL ``(14/127)(1 + 2^-10) = 0.1103`` -> 0.111 (the f16 scale's
  rounding); IQ4_XS, whose sub-block scale is a step count of ``d = A / (127 * 31)`` rounded up,
  ``(14/127)(1 + 1/31)(1 + 2^-10) = 0.1139`` -> 0.114.
- F32 exact; F16 and BF16 equal to the input rounded to them (torch's round to nearest even).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gguf_files import (
    GGUF_PY_TYPES,
    GRID_TYPES,
    IQ4_TYPES,
    K_TYPES,
    ORIG_SHAPE_KEY,
    SUPPORTED_TYPES,
    block_size,
    orig_shape,
    quantize_blocks,
    random_iq_blocks,
    reference_dequantize,
    write_gguf,
)

TOLERANCE = {
    Q.Q8_0: 0.005,
    Q.Q4_0: 0.13,
    Q.Q4_1: 0.07,
    Q.Q5_0: 0.065,
    Q.Q5_1: 0.035,
    Q.Q2_K: 0.37,
    Q.Q3_K: 0.175,
    Q.Q4_K: 0.07,
    Q.Q5_K: 0.035,
    Q.Q6_K: 0.017,
    Q.IQ4_NL: 0.111,
    Q.IQ4_XS: 0.114,
}


def sample(rows: int = 24, cols: int = 512, seed: int = 0) -> np.ndarray:
    """Gaussian rows of scales from 0.01 to 3, some shifted all positive or all negative (the affine types' minimum
    is an offset at most 0: both signs of it matter), one row of zeros and one constant row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 3, (rows, 1)).astype(np.float32)
    x[1] += 4 * np.abs(x[1]).max()
    x[2] -= 4 * np.abs(x[2]).max()
    x[3] = 0
    x[4] = 0.75
    return x


def relative_block_error(x: np.ndarray, y: np.ndarray, qtype: Q) -> float:
    """The largest error of ``y`` against ``x`` in any block of ``qtype``, over that block's absolute maximum."""
    size = max(block_size(qtype), 32)
    xb, yb = x.reshape(-1, size), y.reshape(-1, size)
    absmax = np.abs(xb).max(axis=1)
    err = np.abs(xb - yb).max(axis=1)
    assert not err[absmax == 0].any(), "a block of zeros must come back zeros"
    return float((err[absmax > 0] / absmax[absmax > 0]).max())


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_round_trip_through_gguf_py(qtype: Q) -> None:
    x = sample()
    data = quantize_blocks(x, qtype)
    size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    assert data.dtype == np.uint8 and data.shape == (x.shape[0], x.shape[1] // size * type_size)
    y = gguf.quants.dequantize(data, qtype)
    assert y.dtype == np.float32 and y.shape == x.shape and np.isfinite(y).all()
    if qtype == Q.F32:
        np.testing.assert_array_equal(y, x)
    elif qtype == Q.F16:
        np.testing.assert_array_equal(y, x.astype(np.float16).astype(np.float32))
    elif qtype == Q.BF16:
        np.testing.assert_array_equal(y, torch.from_numpy(x).to(torch.bfloat16).float().numpy())
    else:
        assert relative_block_error(x, y, qtype) <= TOLERANCE[qtype]


@pytest.mark.parametrize("qtype", GGUF_PY_TYPES, ids=lambda t: t.name)
def test_bytes_are_gguf_py_s(qtype: Q) -> None:
    x = sample(rows=6, cols=256, seed=1)
    ours = quantize_blocks(x, qtype)
    theirs = np.ascontiguousarray(gguf.quants.quantize(x, qtype)).view(np.uint8)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_k_blocks_are_valid(qtype: Q) -> None:
    x = sample(rows=8, cols=1024, seed=2)
    blocks = quantize_blocks(x, qtype).reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    # d (and dmin) where each layout keeps them: finite and not negative
    where = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[qtype]
    for offset in where:
        scale = blocks[:, offset : offset + 2].copy().view(np.float16).astype(np.float32)
        assert np.isfinite(scale).all() and (scale >= 0).all(), (qtype.name, offset)
    y = gguf.quants.dequantize(blocks, qtype)
    assert np.isfinite(y).all()
    # every block stands alone: each one quantized by itself gives the same bytes
    np.testing.assert_array_equal(quantize_blocks(x.reshape(-1, 256)[5], qtype), blocks[5])


@pytest.mark.parametrize("qtype", IQ4_TYPES, ids=lambda t: t.name)
def test_iq4_blocks_are_valid(qtype: Q) -> None:
    x = sample(rows=8, cols=1024, seed=2)
    blocks = quantize_blocks(x, qtype).reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    assert np.isfinite(scale).all()
    if qtype == Q.IQ4_XS:  # the super-block scale is a magnitude; the signs are the sub-blocks'
        assert (scale >= 0).all()
    assert np.isfinite(gguf.quants.dequantize(blocks, qtype)).all()
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    np.testing.assert_array_equal(quantize_blocks(x.reshape(-1, block)[5], qtype), blocks[5])


@pytest.mark.parametrize("qtype", IQ4_TYPES + GRID_TYPES, ids=lambda t: t.name)
def test_random_i_quant_blocks_are_valid(qtype: Q) -> None:
    """Random blocks in llama.cpp's layout: gguf-py reads them finite and within the scale they were drawn at, the
    scale's own place in the block (IQ1_M's ``d`` spread over four nibbles) read back."""
    blocks = random_iq_blocks(np.random.default_rng(0), 64, qtype, scale=0.01)
    assert blocks.shape == (64, gguf.GGML_QUANT_SIZES[qtype][1]) and blocks.dtype == np.uint8
    values = gguf.quants.dequantize(blocks, qtype)
    assert np.isfinite(values).all() and not values[:2].any()  # d = +0 and -0: zeros
    assert 0 < np.abs(values).max() < 0.1 * 127 * 32  # the largest level times the largest sub-block scale


def test_rows_that_do_not_fit_and_unknown_types_are_refused() -> None:
    with pytest.raises(ValueError, match="block size"):
        quantize_blocks(np.zeros((2, 96), np.float32), Q.Q4_K)
    with pytest.raises(NotImplementedError):
        quantize_blocks(np.zeros((2, 256), np.float32), Q.IQ2_XXS)


def wan_like_tensors() -> dict[str, tuple[np.ndarray, Q]]:
    rng = np.random.default_rng(3)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    return {
        "patch_embedding.weight": (normal(64, 16, 1, 2, 2), Q.Q4_K),  # 5-D: F32, as fix_5d_tensors.py adds it
        "text_embedding.0.weight": (normal(48, 80), Q.Q5_K),  # 80 fits no block: rows of 256 + orig_shape
        "blocks.0.self_attn.q.weight": (normal(64, 512), Q.Q4_K),
        "blocks.0.self_attn.o.weight": (normal(32, 256), Q.Q6_K),
        "blocks.0.cross_attn.k.weight": (normal(32, 64), Q.BF16),
        "blocks.0.ffn.0.weight": (normal(96, 64), Q.Q8_0),
        "blocks.0.ffn.2.weight": (normal(33, 40), Q.Q4_0),  # 1320 elements, not a multiple of 256: F16 fallback
        "blocks.0.norm3.weight": (normal(512), Q.Q4_K),  # 1-D: F32
        "blocks.0.modulation": (normal(1, 6, 256), Q.Q4_K),  # keys_hiprec: F32
        "head.head.weight": (normal(16, 48), Q.Q8_0),  # 768 elements: F32
    }


EXPECTED_TYPES = {
    "patch_embedding.weight": Q.F32,
    "text_embedding.0.weight": Q.Q5_K,
    "blocks.0.self_attn.q.weight": Q.Q4_K,
    "blocks.0.self_attn.o.weight": Q.Q6_K,
    "blocks.0.cross_attn.k.weight": Q.BF16,
    "blocks.0.ffn.0.weight": Q.Q8_0,
    "blocks.0.ffn.2.weight": Q.F16,
    "blocks.0.norm3.weight": Q.F32,
    "blocks.0.modulation": Q.F32,
    "head.head.weight": Q.F32,
}


def test_a_wan_like_file_reads_back(tmp_path) -> None:
    tensors = wan_like_tensors()
    path = tmp_path / "wan.gguf"
    stored = write_gguf(
        path, tensors, arch="wan", metadata={"test.note": "fixture", "test.count": 3},
        reshape_rows_to=256, keep_f32=(".modulation",),
    )  # fmt: skip
    assert stored == EXPECTED_TYPES

    reader = gguf.GGUFReader(path)
    arch = reader.get_field("general.architecture")
    assert bytes(arch.parts[arch.data[0]]).decode() == "wan"
    note = reader.get_field("test.note")
    assert bytes(note.parts[note.data[0]]).decode() == "fixture"
    assert int(reader.get_field("test.count").parts[-1][0]) == 3
    assert [t.name for t in reader.tensors] == list(tensors)
    assert {t.name: t.tensor_type for t in reader.tensors} == EXPECTED_TYPES

    # city96's rule reshapes every tensor of 2 to 4 dimensions and at least 512 elements, a multiple of 256 but
    # not in its last dimension, whatever its type: stored as rows of 256 (GGUF order: innermost first), its real
    # shape beside it
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    names = [key.removeprefix(ORIG_SHAPE_KEY) for key in reader.fields if key.startswith(ORIG_SHAPE_KEY)]
    reshaped = {name: orig_shape(reader, name) for name in names}
    assert reshaped == {
        "text_embedding.0.weight": (48, 80),
        "blocks.0.cross_attn.k.weight": (32, 64),
        "blocks.0.ffn.0.weight": (96, 64),
        "head.head.weight": (16, 48),
    }
    for name, shape in reshaped.items():
        assert shapes[name] == (256, int(np.prod(shape)) // 256), name
    assert shapes["blocks.0.modulation"] == (256, 6, 1)
    assert shapes["patch_embedding.weight"] == (2, 2, 1, 16, 64)

    values = reference_dequantize(path)
    assert list(values) == list(tensors)
    for name, (x, _) in tensors.items():
        y = values[name]
        assert y.dtype == torch.float32 and tuple(y.shape) == x.shape, name
        qtype = EXPECTED_TYPES[name]
        if qtype == Q.F32:
            np.testing.assert_array_equal(y.numpy(), x, err_msg=name)
        elif qtype == Q.F16:
            np.testing.assert_array_equal(y.numpy(), x.astype(np.float16).astype(np.float32), err_msg=name)
        elif qtype == Q.BF16:
            torch.testing.assert_close(y, torch.from_numpy(x).to(torch.bfloat16).float(), rtol=0, atol=0)
        else:
            assert relative_block_error(x, y.numpy(), qtype) <= TOLERANCE[qtype], name


def test_without_reshape_a_misfit_row_falls_back_to_f16(tmp_path) -> None:
    x = np.random.default_rng(4).standard_normal((48, 80)).astype(np.float32)
    stored = write_gguf(tmp_path / "flux.gguf", {"img_in.weight": (x, Q.Q4_K)}, arch="flux")
    assert stored == {"img_in.weight": Q.F16}
    reader = gguf.GGUFReader(tmp_path / "flux.gguf")
    assert orig_shape(reader, "img_in.weight") is None
    y = reference_dequantize(tmp_path / "flux.gguf")["img_in.weight"]
    np.testing.assert_array_equal(y.numpy(), x.astype(np.float16).astype(np.float32))
