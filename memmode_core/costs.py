"""Deprecated: what a storage costs is ``memmode_core.plugin.StorageCost`` (and ``copying_cost``); the planner
measures a storage that declares nothing with ``memmode_core.planning.measuring.probe``."""

from memmode_core.contracts import costs as _costs
from memmode_core.contracts.deprecation import moved_names
from memmode_core.planning import measuring as _measuring

__getattr__ = moved_names(
    __name__,
    {
        "StorageCost": (_costs, "from memmode_core.plugin import StorageCost"),
        "copying_cost": (_costs, "from memmode_core.plugin import copying_cost"),
        "onload_latency": (_costs, "from memmode_core.contracts.costs import onload_latency"),
        "DEFAULT_BANDWIDTH": (_costs, "from memmode_core.contracts.costs import DEFAULT_BANDWIDTH"),
        "probe": (_measuring, "from memmode_core.planning.measuring import probe"),
    },
)
