"""memmode storage ``disk``: offloaded groups wait in safetensors files and are read back on each onload.

Importing this package registers nothing: memmode finds it through its ``memmode`` entry point.
"""

from __future__ import annotations

from .storage import DiskSession, DiskStorage

__version__ = "0.1.0"

__all__ = ["DiskSession", "DiskStorage", "__version__"]
