"""The codecs of GGUF's block types: how a layer whose weight rests in a block type is decoded by the forward.

One :class:`GgufCodec` per block type (``gguf_q4_k`` for Q4_K, ...), in :data:`CODECS` by GGML type name. A codec is
a quantizer of files (``packs = False``): it never packs a weight itself; its :meth:`GgufCodec.unpack` decodes the
blocks an encoded tensor of a GGUF file holds (its ``weight_packed``, uint8, any shape) on the compute device.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from memmode_core.plugin import PAYLOAD, Quantizer

from .blocks import BLOCK_TYPES, dequantize


class GgufCodec(Quantizer):
    """GGML block type ``type_name``'s bytes decoded to float32 (bit-equal to gguf-py), then cast to the compute
    dtype."""

    packs = False

    def __init__(self, type_name: str) -> None:
        kind = BLOCK_TYPES[type_name]
        self.type_name = type_name
        self.name = self.format = f"gguf_{type_name.lower()}"
        self.description = (
            f"GGUF {type_name} blocks ({kind.block} values in {kind.size} bytes, "
            f"{8 * kind.size / kind.block:.4g} bits per weight), read from .gguf files"
        )

    def pack(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError(
            f"{self.name} decodes {self.type_name} weights read from GGUF files; it does not quantize weights "
            f"(load a .gguf file with memmode.load, or quantize with qfloat8 or qfloat4)"
        )

    def unpack(self, packed: Mapping[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        values = dequantize(packed[PAYLOAD], self.type_name).reshape(shape)
        return values if dtype == torch.float32 else values.to(dtype)


#: one codec per block type, by GGML type name (``CODECS["Q4_K"]``)
CODECS: dict[str, GgufCodec] = {name: GgufCodec(name) for name in BLOCK_TYPES}


def codec_for(type_name: str) -> GgufCodec:
    """The codec of GGML type ``type_name`` (``"Q4_K"``); a KeyError names the block types for any other."""
    try:
        return CODECS[type_name]
    except KeyError:
        raise KeyError(f"no GGUF codec for {type_name!r}: the block types are {', '.join(CODECS)}") from None
