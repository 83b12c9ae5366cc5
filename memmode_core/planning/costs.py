"""Deprecated: how the planner prices and measures a storage is :mod:`memmode_core.planning.measuring`; what
each old name is now is in the table of deprecated names, ``memmode_core/contracts/deprecation.py``."""

from memmode_core.contracts.deprecation import moved_names

__getattr__ = moved_names(__name__)
