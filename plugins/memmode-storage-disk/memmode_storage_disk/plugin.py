"""The ``memmode`` entry point of memmode-storage-disk: registers the ``disk`` storage."""

from __future__ import annotations

import memmode_core

from .storage import DiskStorage


@memmode_core.hookimpl
def memmode_register_storages(register):
    register(DiskStorage())
