"""Deprecated: the group vocabulary (``GroupSpec``, ``Policy``, the layout helpers) lives in the plugin kit,
``memmode_core.plugin``; what core does with a placement's layout is :mod:`memmode_core.engine.placement_layout`.
What each old name is now is in the table of deprecated names, ``memmode_core/contracts/deprecation.py``."""

from memmode_core.contracts.deprecation import moved_names

__getattr__ = moved_names(__name__)
