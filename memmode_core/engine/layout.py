"""Deprecated: the group vocabulary (``GroupSpec``, ``Policy``, the layout helpers) lives in the plugin kit,
``memmode_core.plugin``; what core does with a placement's layout is :mod:`memmode_core.engine.laying_out`."""

from memmode_core.contracts import layout as _layout
from memmode_core.contracts.deprecation import moved_names, names_moved_to

__getattr__ = moved_names(
    __name__,
    names_moved_to(
        _layout,
        *("GroupSpec", "Policy", "whole_component", "leaf_groups", "block_groups"),
        public="memmode_core.plugin",
    ),
)
