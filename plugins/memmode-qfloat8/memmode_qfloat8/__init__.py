"""memmode quantizers ``qfloat8`` and ``qfloat8_preconverted`` (float8 E4M3, one scale per output channel).

Importing this package registers nothing: memmode finds it through its ``memmode`` entry point.
:func:`convert` is the helper for converting a model before sharding it with FSDP2.
"""

from __future__ import annotations

from .convert import convert
from .format import E4M3_MAX, QFloat8, QFloat8Preconverted

__version__ = "0.1.0"

__all__ = ["E4M3_MAX", "QFloat8", "QFloat8Preconverted", "convert", "__version__"]
