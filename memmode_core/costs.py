"""Deprecated: what a storage costs is ``memmode_core.plugin.StorageCost`` (and ``copying_cost``); the planner
measures a storage that declares nothing with ``memmode_core.planning.measuring.probe``."""

from memmode_core.contracts import costs as _costs
from memmode_core.contracts.deprecation import moved_names, names_moved_to
from memmode_core.planning import measuring as _measuring

__getattr__ = moved_names(
    __name__,
    names_moved_to(_costs, "StorageCost", "copying_cost", public="memmode_core.plugin")
    | names_moved_to(_costs, "onload_latency", "DEFAULT_BANDWIDTH")
    | names_moved_to(_measuring, "probe"),
)
