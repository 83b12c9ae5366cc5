"""The qfloat4 format: NVFP4.

Each ``nn.Linear`` weight of shape ``(out, in)`` is cut into blocks of 16 consecutive input elements.
A block stores 16 E2M1 values (sign, 2 exponent bits, 1 mantissa bit: 0, ±0.5, ±1, ±1.5, ±2, ±3,
±4, ±6) and one E4M3 scale; the tensor stores one float32 scale on top, which lifts the block
scales into E4M3's range whatever the weights' magnitude. Packed tensors:

- ``weight_packed``: ``uint8 (out, in / 2)`` — two E2M1 codes per byte, element ``2k`` in the low nibble;
- ``weight_scale``: ``uint8 (out, in / 16)`` — the E4M3 bit patterns of the block scales;
- ``weight_global_scale``: ``float32 ()`` — ``absmax(weight) / (6 * 448)``.

A weight dequantizes as ``e2m1 * e4m3(block scale) * global scale``. Every E2M1 value is exactly an
E4M3 value, so the 256 possible bytes decode, with integer operations, into a table of their two
values; unpacking a weight is then one gather from that table (``F.embedding``, a vectorised row
gather on every device) instead of a dozen elementwise operations over the whole weight. A layer
whose input width is not a multiple of 16 cannot be cut into blocks and stays at full precision.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from memmode_core.plugin import Quantizer

#: input elements per block scale
BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
_TINY = torch.finfo(torch.float32).tiny

# Rounding |x| to the nearest E2M1 magnitude, ties to the even code: the code is the number of
# these thresholds that |x| passes. A tie rounds up where the upper neighbour's code is even.
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (sign in bit 3) of ``x``, rounded to nearest even, saturated at ±6."""
    magnitude = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold, tie_up in _THRESHOLDS:
        code += (magnitude >= threshold if tie_up else magnitude > threshold).to(torch.uint8)
    negative = ((x < 0) & (code > 0)).to(torch.uint8)
    return code | (negative << 3)


def _byte_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``(256, 2)``: the two values of every packed byte, the low nibble's first, in ``dtype``."""
    byte = torch.arange(256, device=device, dtype=torch.int32).to(torch.uint8)
    codes = torch.stack((byte & 0x0F, byte >> 4), dim=-1)
    return _e2m1_as_e4m3_bits(codes).view(torch.float8_e4m3fn).to(dtype)


def _e2m1_as_e4m3_bits(codes: torch.Tensor) -> torch.Tensor:
    """The E4M3 bit pattern of each E2M1 code: 0 -> 0x00, 0.5 -> 0x30, and for the normal values
    (magnitude code m >= 2, exponent m >> 1) the E4M3 exponent field is rebiased by 6 and the
    mantissa bit moves to the top of E4M3's three: ``(m << 2) + 0x30``. The sign moves to bit 7."""
    magnitude = codes & 7
    bits = torch.where(magnitude <= 1, magnitude * 0x30, (magnitude << 2) + 0x30)
    return bits | ((codes & 8) << 4)


class QFloat4(Quantizer):
    name = "qfloat4"
    description = (
        "NVFP4 weights: E2M1 values two per byte, an E4M3 scale per 16 inputs and an fp32 tensor "
        "scale, dequantized per forward (0.28x bf16 bytes; input widths must be multiples of 16)"
    )

    def skip_reason(self, shape: torch.Size) -> str | None:
        if shape[-1] % BLOCK:
            return f"input width {shape[-1]} is not a multiple of {BLOCK} (NVFP4 blocks)"
        return None

    def pack(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        out_features, in_features = weight.shape
        w = weight.float().reshape(out_features, in_features // BLOCK, BLOCK)
        global_scale = (w.abs().amax() / (E2M1_MAX * E4M3_MAX)).clamp_min(_TINY)
        block_amax = w.abs().amax(dim=-1, keepdim=True)
        block_scale = (block_amax / (E2M1_MAX * global_scale)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        # The scale each block really has once its E4M3 scale is rounded; a block whose scale
        # rounds to zero (all zeros, or under E4M3's range) encodes zeros.
        effective = block_scale.float() * global_scale
        x = torch.where(effective > 0, w / torch.where(effective > 0, effective, 1.0), 0.0)
        codes = _e2m1_codes(x).reshape(out_features, in_features // 2, 2)
        payload = codes[..., 0] | (codes[..., 1] << 4)
        return {
            "weight_packed": payload,
            "weight_scale": block_scale.reshape(out_features, in_features // BLOCK).view(torch.uint8),
            "weight_global_scale": global_scale,
        }

    def unpack(self, packed: Mapping[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        out_features, in_features = shape
        payload = packed["weight_packed"]
        # E2M1 x E4M3 products are exact in every compute dtype (at most 6 significant bits, within
        # float16's range); only the tensor scale rounds. It can be subnormal in float16, so float16
        # weights are scaled in float32; bfloat16 has float32's exponent range.
        math = torch.float32 if dtype == torch.float16 else dtype
        values = F.embedding(payload.int(), _byte_table(payload.device, math))
        scales = packed["weight_scale"].view(torch.float8_e4m3fn).to(math)
        weight = values.reshape(out_features, in_features // BLOCK, BLOCK) * scales.unsqueeze(-1)
        weight = weight.reshape(out_features, in_features) * packed["weight_global_scale"].to(math)
        return weight.to(dtype)
