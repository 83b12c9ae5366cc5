"""Deprecated: the storage contract lives in the plugin kit, ``memmode_core.plugin``."""

from memmode_core.contracts import storage as _storage
from memmode_core.contracts.deprecation import moved_names

__getattr__ = moved_names(
    __name__,
    {
        name: (_storage, f"from memmode_core.plugin import {name}")
        for name in ("Storage", "StorageSession", "Tensors", "placeholder", "is_placeholder", "host_copy")
    },
)
