"""Deprecated: the storage contract lives in the plugin kit, ``memmode_core.plugin``."""

from memmode_core.contracts import storage as _storage
from memmode_core.contracts.deprecation import moved_names, names_moved_to

__getattr__ = moved_names(
    __name__,
    names_moved_to(
        _storage,
        *("Storage", "StorageSession", "Tensors", "placeholder", "is_placeholder", "host_copy"),
        public="memmode_core.plugin",
    ),
)
