"""The ``memmode`` entry point of memmode-storage-mmap: registers the ``mmap`` storage."""

from __future__ import annotations

import memmode_core

from .storage import MmapStorage


@memmode_core.hookimpl
def memmode_register_storages(register):
    register(MmapStorage())
