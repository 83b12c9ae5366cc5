"""Deprecated: what a storage costs is ``memmode_core.plugin.StorageCost`` (and ``copying_cost``); the planner
measures a storage that declares nothing with ``memmode_core.planning.measuring.probe``. What each old name is
now is in the table of deprecated names, ``memmode_core/contracts/deprecation.py``."""

from memmode_core.contracts.deprecation import moved_names

__getattr__ = moved_names(__name__)
