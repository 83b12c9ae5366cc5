"""The ``memmode`` entry point of memmode-storage-disk: registers the ``disk`` storage."""

from __future__ import annotations

from memmode_core.plugin import hookimpl

from .storage import DiskStorage


@hookimpl
def memmode_register_storages(register):
    register(DiskStorage())
