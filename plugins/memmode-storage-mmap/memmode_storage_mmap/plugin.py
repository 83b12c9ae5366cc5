"""The ``memmode`` entry point of memmode-storage-mmap: registers the ``mmap`` storage."""

from __future__ import annotations

from memmode_core.plugin import hookimpl

from .storage import MmapStorage


@hookimpl
def memmode_register_storages(register):
    register(MmapStorage())
