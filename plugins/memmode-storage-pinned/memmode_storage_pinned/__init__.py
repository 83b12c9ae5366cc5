"""memmode storage ``pinned``: offloaded groups wait in exactly-sized page-locked memory, for
asynchronous copies to the GPU.

Importing this package registers nothing: memmode finds it through its ``memmode`` entry point.
"""

from __future__ import annotations

from .storage import PinnedSession, PinnedStorage

__version__ = "0.1.0"

__all__ = ["PinnedSession", "PinnedStorage", "__version__"]
