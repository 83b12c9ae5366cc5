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

#: blocks decoded at a time (4 Mi values of a K type, 512 Ki of a 32-value type): large enough that the decoder's
#: vectorised steps amortise their launches, small enough that its temporaries stay a few tens of MiB
CHUNK_BLOCKS = 1 << 14


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
        """The weight, decoded in float32 and rounded once to ``dtype``, :data:`CHUNK_BLOCKS` blocks at a time into
        the result: the float32 values and the decoder's temporaries of a whole 5120 x 13824 layer (270 MiB and
        several times that) are never alive at once, only the result and one chunk's."""
        data = packed[PAYLOAD]
        kind = BLOCK_TYPES[self.type_name]
        if data.numel() <= CHUNK_BLOCKS * kind.size:
            values = dequantize(data, self.type_name).reshape(shape)
            return values if dtype == torch.float32 else values.to(dtype)
        if data.dtype != torch.uint8 or data.numel() % kind.size:
            dequantize(data, self.type_name)  # raises, saying what is wrong with the bytes
        blocks = data.reshape(-1, kind.size)
        out = torch.empty(blocks.shape[0] * kind.block, dtype=dtype, device=data.device)
        for start in range(0, blocks.shape[0], CHUNK_BLOCKS):
            stop = min(start + CHUNK_BLOCKS, blocks.shape[0])
            out[start * kind.block : stop * kind.block] = kind.decode(blocks[start:stop]).view(-1)
        return out.view(shape)


#: one codec per block type, by GGML type name (``CODECS["Q4_K"]``)
CODECS: dict[str, GgufCodec] = {name: GgufCodec(name) for name in BLOCK_TYPES}


def codec_for(type_name: str) -> GgufCodec:
    """The codec of GGML type ``type_name`` (``"Q4_K"``); a KeyError names the block types for any other."""
    try:
        return CODECS[type_name]
    except KeyError:
        raise KeyError(f"no GGUF codec for {type_name!r}: the block types are {', '.join(CODECS)}") from None
