"""memmode quantizer ``qfloat4``: NVFP4 weights (E2M1 values, E4M3 per-16 block scales, fp32 tensor scale).

Importing this package registers nothing: memmode finds it through its ``memmode`` entry point.
"""

from __future__ import annotations

from .format import BLOCK, QFloat4

__version__ = "0.1.0"

__all__ = ["BLOCK", "QFloat4", "__version__"]
