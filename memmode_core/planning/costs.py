"""Deprecated: how the planner prices and measures a storage is :mod:`memmode_core.planning.measuring`."""

from memmode_core.contracts.deprecation import moved_names
from memmode_core.planning import measuring as _measuring

__getattr__ = moved_names(
    __name__,
    {
        name: (_measuring, f"from memmode_core.planning.measuring import {name}")
        for name in ("storage_cost", "measured_bandwidth", "probe", "PROBE_BYTES")
    },
)
