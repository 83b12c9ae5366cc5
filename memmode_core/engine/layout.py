"""Deprecated: the group vocabulary (``GroupSpec``, ``Policy``, the layout helpers) lives in the plugin kit,
``memmode_core.plugin``; what core does with a placement's layout is :mod:`memmode_core.engine.laying_out`."""

from memmode_core.contracts import layout as _layout
from memmode_core.contracts.deprecation import moved_names

__getattr__ = moved_names(
    __name__,
    {
        name: (_layout, f"from memmode_core.plugin import {name}")
        for name in ("GroupSpec", "Policy", "whole_component", "leaf_groups", "block_groups")
    },
)
