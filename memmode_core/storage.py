"""Deprecated: the storage contract lives in the plugin kit, ``memmode_core.plugin``; what each old name is now
is in the table of deprecated names, ``memmode_core/contracts/deprecation.py``."""

from memmode_core.contracts.deprecation import moved_names

__getattr__ = moved_names(__name__)
