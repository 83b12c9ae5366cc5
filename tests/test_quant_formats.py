"""The two first-party formats, weight by weight: qfloat8 (E4M3, per-channel scale) and qfloat4 (NVFP4)."""

from __future__ import annotations

import pytest
import torch

from helpers import nbytes, sqnr_db
from memmode_qfloat4 import BLOCK, QFloat4
from memmode_qfloat8 import E4M3_MAX, QFloat8
from memmode_qfloat8.format import e4m3_values

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def roundtrip(quantizer, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return quantizer.unpack(quantizer.pack(weight), weight.shape, dtype)


def plain_cast(weight: torch.Tensor) -> torch.Tensor:
    """What the reference implementation does: cast to float8 without a scale."""
    return weight.to(torch.float8_e4m3fn).float()


@pytest.fixture
def weight() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(96, 128, generator=generator)


# -- qfloat8 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 1e3, 1e-3])
def test_qfloat8_accuracy_does_not_depend_on_the_weights_scale(weight, scale):
    scaled = weight * scale
    assert sqnr_db(scaled, roundtrip(QFloat8(), scaled)) > 30.0


def test_a_plain_float8_cast_overflows_large_weights_and_flushes_small_ones(weight):
    """Why qfloat8 scales: the same weights x1e3 overflow E4M3 (saturated at 448, or NaN), x1e-3 fall
    under its smallest subnormal (2^-9)."""
    large = plain_cast(weight * 1e3)
    assert not torch.isfinite(large).all() or sqnr_db(weight * 1e3, large) < 10
    small = weight * 1e-3
    assert sqnr_db(small, plain_cast(small)) < 10
    assert (plain_cast(small) == 0).float().mean() > 0.3
    for scaled in (weight * 1e3, weight * 1e-3):
        assert sqnr_db(scaled, roundtrip(QFloat8(), scaled)) > 30.0


def test_qfloat8_layout_and_exact_values(weight):
    packed = QFloat8().pack(weight.to(torch.bfloat16))
    assert set(packed) == {"weight_packed", "weight_scale"}
    assert packed["weight_packed"].dtype == torch.uint8 and packed["weight_packed"].shape == weight.shape
    assert packed["weight_scale"].dtype == torch.float32 and packed["weight_scale"].shape == (96, 1)
    # every row's largest magnitude maps to E4M3's largest value
    values = packed["weight_packed"].view(torch.float8_e4m3fn).float()
    assert torch.equal(values.abs().amax(dim=1), torch.full((96,), E4M3_MAX))
    # weights already on the E4M3 grid of their row scale come back exactly
    grid = values * packed["weight_scale"]
    assert torch.equal(roundtrip(QFloat8(), grid), grid)


def test_qfloat8_cpu_table_decodes_every_e4m3_pattern_like_the_native_cast():
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    for dtype in (torch.float32, torch.bfloat16):
        torch.testing.assert_close(
            e4m3_values(bits, dtype), bits.view(torch.float8_e4m3fn).to(dtype), rtol=0, atol=0, equal_nan=True
        )


def test_qfloat8_zero_rows_and_dtypes():
    weight = torch.randn(4, 32)
    weight[1] = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = roundtrip(QFloat8(), weight.to(dtype), dtype)
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert torch.equal(out[1], torch.zeros(32, dtype=dtype))


# -- qfloat4 (NVFP4) ---------------------------------------------------------------------------------------


def test_qfloat4_layout(weight):
    packed = QFloat4().pack(weight)
    assert packed["weight_packed"].dtype == torch.uint8 and packed["weight_packed"].shape == (96, 64)
    assert packed["weight_scale"].dtype == torch.uint8 and packed["weight_scale"].shape == (96, 128 // BLOCK)
    assert packed["weight_global_scale"].dtype == torch.float32 and packed["weight_global_scale"].shape == ()
    size = nbytes(packed.values())
    assert size == 96 * 64 + 96 * 8 + 4  # 0.5625 bytes per weight, plus the tensor scale


def e2m1_grid(quantizer: QFloat4, weight: torch.Tensor) -> torch.Tensor:
    """The E2M1 values a weight was rounded to: its roundtrip divided by each block's real scale."""
    packed = quantizer.pack(weight)
    scales = packed["weight_scale"].view(torch.float8_e4m3fn).float() * packed["weight_global_scale"]
    out = quantizer.unpack(packed, weight.shape, torch.float32)
    return (out.reshape(*scales.shape, BLOCK) / scales.unsqueeze(-1)).reshape(weight.shape)


def test_qfloat4_represents_every_e2m1_value_and_packs_low_nibble_first():
    magnitudes = torch.tensor(E2M1_VALUES)
    row = torch.cat([magnitudes, -magnitudes.flip(0)])  # 16 values: one block whose amax is 6
    weight = torch.stack([row, row * 0.125])
    quantizer = QFloat4()
    torch.testing.assert_close(e2m1_grid(quantizer, weight), torch.stack([row, row]), rtol=1e-6, atol=0)
    torch.testing.assert_close(roundtrip(quantizer, weight), weight, rtol=1e-6, atol=0)
    codes = quantizer.pack(weight)["weight_packed"][0]
    assert codes[0].item() == 0x10  # elements 0 (0.0) and 1 (0.5): 0.5 in the high nibble
    assert codes[1].item() == 0x32  # elements 2 (1.0, code 2) and 3 (1.5, code 3)


def test_qfloat4_rounds_to_nearest_with_ties_to_even():
    values = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 0.7, 2.6, 4.9, 5.1, -0.25, -2.5, 6.0, 0.0])
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 0.5, 3.0, 4.0, 6.0, 0.0, -2.0, 6.0, 0.0])
    # amax 6 x 0.21875 = 2688 x 2^-11: the tensor scale is 2^-11 and the block scale 448, both exact,
    # so every value reaches the rounding exactly where it is written (ties included)
    weight = values.reshape(1, 16) * 0.21875
    packed = QFloat4().pack(weight)
    assert packed["weight_global_scale"].item() == 2.0**-11
    assert packed["weight_scale"].view(torch.float8_e4m3fn).float().item() == 448.0
    assert torch.equal(roundtrip(QFloat4(), weight), expected.reshape(1, 16) * 0.21875)


@pytest.mark.parametrize("scale", [1.0, 1e3, 1e-3])
def test_qfloat4_accuracy_does_not_depend_on_the_weights_scale(weight, scale):
    scaled = weight * scale
    assert sqnr_db(scaled, roundtrip(QFloat4(), scaled)) > 19.0


def test_qfloat4_zero_blocks_and_compute_dtypes(weight):
    weight = weight.clone()
    weight[:, :BLOCK] = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = roundtrip(QFloat4(), weight.to(dtype), dtype)
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert torch.equal(out[:, :BLOCK], torch.zeros(96, BLOCK, dtype=dtype))
    # unpacking straight to bfloat16 rounds no more than bfloat16 itself does
    packed = QFloat4().pack(weight)
    torch.testing.assert_close(
        QFloat4().unpack(packed, weight.shape, torch.bfloat16).float(),
        QFloat4().unpack(packed, weight.shape, torch.float32),
        rtol=2**-7,
        atol=0,
    )


def test_float16_unpacking_survives_subnormal_scales():
    tiny = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)) * 1e-5
    for quantizer, floor in ((QFloat8(), 25.0), (QFloat4(), 15.0)):
        out = roundtrip(quantizer, tiny, torch.float16)
        assert sqnr_db(tiny, out.float()) > floor, quantizer.name


def test_qfloat4_refuses_input_widths_that_do_not_fill_blocks():
    assert QFloat4().skip_reason(torch.Size([32, 20])) == "input width 20 is not a multiple of 16 (NVFP4 blocks)"
    assert QFloat4().skip_reason(torch.Size([32, 48])) is None
    assert QFloat8().skip_reason(torch.Size([32, 20])) is None


@pytest.mark.parametrize("quantizer", [QFloat8(), QFloat4()], ids=lambda q: q.name)
def test_pack_runs_on_meta_tensors_with_the_real_shapes(quantizer, weight):
    real = quantizer.pack(weight.to(torch.bfloat16))
    meta = quantizer.pack(torch.empty(weight.shape, dtype=torch.bfloat16, device="meta"))
    assert {k: (v.shape, v.dtype) for k, v in real.items()} == {k: (v.shape, v.dtype) for k, v in meta.items()}
    assert all(v.is_meta for v in meta.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qfloat8_packs_rows_in_chunks_to_the_same_bits(dtype):
    """Rows are packed a chunk at a time to bound the float32 temporaries; each row's scale is its own, so
    the bits are those of packing the whole weight at once."""
    weight = (torch.randn(97, 300, generator=torch.Generator().manual_seed(3)) * 0.02).to(dtype)
    weight[5] = 0  # an all-zero row inside a chunk
    whole = QFloat8().pack(weight)
    chunked = QFloat8()
    chunked.chunk_elements = 7 * 300 + 11  # 7 rows per chunk, the last chunk shorter
    parts = chunked.pack(weight)
    assert parts.keys() == whole.keys()
    for name in whole:
        assert parts[name].dtype == whole[name].dtype and torch.equal(parts[name], whole[name]), name


# -- what could make a scale or a dequantized value overflow --------------------------------------------


def _adversarial_weights():
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(8, 32, generator=generator)
    yield "zero rows", torch.cat([torch.zeros(4, 32), base[:4]])
    yield "subnormal rows", base * 1e-40
    yield "tiny rows", base * 1e-30
    yield "huge float32", base * 1e36
    yield "float16 at its largest", (base / base.abs().max() * 65504).half()
    yield "bfloat16 near its largest", (base / base.abs().max() * 3e38).bfloat16()
    yield "one large weight per row", torch.eye(8, 32) * 1e4 + base * 1e-3
    yield "constant rows", torch.full((8, 32), -2.5)


@pytest.mark.parametrize("quantizer", [QFloat8(), QFloat4()], ids=["qfloat8", "qfloat4"])
def test_no_weight_the_source_dtype_can_hold_dequantizes_to_a_non_finite_value(quantizer):
    """Every scale is computed in float32 from the weight's own maximum, clamped away from zero (a zero or
    subnormal row divides to zeros, not NaN) and the largest code times its scale is the maximum again (the
    block holding a tensor's maximum gets NVFP4's exact top scale), so a weight dequantizes, in any compute
    dtype that holds its source values, to finite values close to it."""
    for name, weight in _adversarial_weights():
        largest = float(weight.float().abs().max())
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            if largest > torch.finfo(dtype).max:
                continue
            got = roundtrip(quantizer, weight, dtype)
            assert torch.isfinite(got).all(), f"{name} in {dtype}: non-finite"
            if weight.float().abs().max() > torch.finfo(dtype).tiny * 1e3:
                floor = 8 if dtype == torch.float32 else 5  # bfloat16's own rounding is coarser than the codes'
                assert sqnr_db(weight.float(), got.float()) > floor, f"{name} in {dtype}"
