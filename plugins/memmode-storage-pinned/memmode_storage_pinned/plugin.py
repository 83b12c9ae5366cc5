"""The ``memmode`` entry point of memmode-storage-pinned: registers the ``pinned`` storage."""

from __future__ import annotations

import memmode_core

from .storage import PinnedStorage


@memmode_core.hookimpl
def memmode_register_storages(register):
    register(PinnedStorage())
