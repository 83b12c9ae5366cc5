"""The ``memmode`` entry point of memmode-storage-pinned: registers the ``pinned`` storage."""

from __future__ import annotations

from memmode_core.plugin import hookimpl

from .storage import PinnedStorage


@hookimpl
def memmode_register_storages(register):
    register(PinnedStorage())
