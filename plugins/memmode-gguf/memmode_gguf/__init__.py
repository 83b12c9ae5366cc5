"""memmode reader ``gguf``: GGUF checkpoints (llama.cpp's format, as city96's ComfyUI-GGUF converter writes diffusion
models in it) loaded by ``memmode.load``. F32, F16 and BF16 tensors are bound as they are; weights in the block types
(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and the i-quants IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS) rest in their blocks and are decoded by the forward, bit-equal to gguf-py's
dequantization.

Importing this package registers nothing: memmode finds it through its ``memmode`` entry point.
"""

from __future__ import annotations

from .blocks import BLOCK_TYPES, BlockType, dequantize
from .codec import CODECS, GgufCodec, codec_for
from .reader import GgufReader

__version__ = "0.2.0"

__all__ = ["BLOCK_TYPES", "CODECS", "BlockType", "GgufCodec", "GgufReader", "codec_for", "dequantize", "__version__"]
