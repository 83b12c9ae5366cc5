"""memmode storage ``mmap``: offloaded groups are safetensors files mapped into memory, shared by
every process through the page cache.

Importing this package registers nothing: memmode finds it through its ``memmode`` entry point.
"""

from __future__ import annotations

from .storage import MmapSession, MmapStorage

__version__ = "0.1.0"

__all__ = ["MmapSession", "MmapStorage", "__version__"]
