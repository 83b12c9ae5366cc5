"""The ``memmode`` entry point of memmode-storage-pinned: registers the ``pinned`` storage."""

from __future__ import annotations

from memmode_core.plugin import hookimpl

from .storage import PinnedStorage

#: the plugin kit this plugin is built for (memmode_core.plugin.KIT_VERSION; docs/versioning.md)
MEMMODE_KIT = "1.3"


@hookimpl
def memmode_register_storages(register):
    register(PinnedStorage())
