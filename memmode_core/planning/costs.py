"""Deprecated: how the planner prices and measures a storage is :mod:`memmode_core.planning.measuring`."""

from memmode_core.contracts.deprecation import moved_names, names_moved_to
from memmode_core.planning import measuring as _measuring

__getattr__ = moved_names(
    __name__, names_moved_to(_measuring, "storage_cost", "measured_bandwidth", "probe", "PROBE_BYTES")
)
