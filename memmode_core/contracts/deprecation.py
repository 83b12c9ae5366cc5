"""Every deprecated name of memmode, in one table: :data:`DEPRECATED`.

A plugin written from an earlier guide must keep importing for at least one release after a refactor moves
what it imports. The module at the old path stays; its module ``__getattr__`` is ``moved_names(__name__)``,
which serves each of the old path's names from :data:`DEPRECATED` with a :class:`MemmodeDeprecationWarning`
that gives the import to write instead. To deprecate a name, add a row here and make its old module's
``__getattr__`` ``moved_names(__name__)``; to remove the names of a release, delete the rows whose
``removed_in`` it is (and an old module left with none).

The table names each new home as a string, ``"memmode_core.x.y:Name"``, imported when the old name is used:
this module is the bottom layer (``contracts``), and most new homes are above it.

Only imports are deprecated today; memmode deprecates no keyword argument and no behaviour. An earlier
memmode keyword (``exclude_components=``, now ``unplaced=``) is refused with the new spelling, not served:
``RENAMED`` in :mod:`memmode_core.planning.request`. ``load``'s ``torch_dtype=`` is diffusers' deprecation,
which memmode spares its users: it passes the dtype on under the keyword the installed diffusers takes
(:mod:`memmode_core.loading.dtypes`). A deprecated keyword would get its own table here, read the same way.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: the release from which the aliases of 0.1 and 0.2 are gone (kit 2.0, docs/versioning.md); none goes sooner
REMOVED_IN = "memmode 0.3"


class MemmodeDeprecationWarning(FutureWarning):
    """A name used from a place it no longer lives; the message says the import to write instead.

    A ``FutureWarning``, so that the person running a script with an old plugin sees it (Python hides a
    ``DeprecationWarning`` outside ``__main__``)."""


@dataclass(frozen=True)
class Moved:
    """Where an old name lives now: ``new`` is ``"module:Name"``, the import to write instead (the kit,
    ``memmode_core.plugin``, for what it re-exports); ``removed_in``: the release without the old name."""

    new: str
    removed_in: str = REMOVED_IN

    @property
    def instead(self) -> str:
        module, name = self.new.split(":")
        return f"from {module} import {name}"

    def resolve(self) -> Any:
        """The object the new import gives."""
        module, name = self.new.split(":")
        return getattr(importlib.import_module(module), name)


def _to(module: str, *names: str) -> dict[str, Moved]:
    return {name: Moved(f"{module}:{name}") for name in names}


#: old module -> old name -> where it lives now: every deprecated name of memmode
DEPRECATED: dict[str, dict[str, Moved]] = {
    # what plugin guides taught: the storage contract, the group vocabulary and storage costs, at paths a
    # refactor removed; all of it is the plugin kit's now
    "memmode_core.storage": _to(
        "memmode_core.plugin", "Storage", "StorageSession", "Tensors", "placeholder", "is_placeholder", "host_copy"
    ),
    "memmode_core.engine.layout": _to(
        "memmode_core.plugin", "GroupSpec", "Policy", "whole_component", "leaf_groups", "block_groups"
    ),
    "memmode_core.costs": _to("memmode_core.plugin", "StorageCost", "copying_cost")
    | _to("memmode_core.contracts.storage_cost", "onload_latency", "DEFAULT_BANDWIDTH")
    | _to("memmode_core.planning.measuring", "probe"),
    # what the modules' own ``__all__`` listed before they were split by job
    "memmode_core.planning.costs": _to(
        "memmode_core.planning.measuring", "storage_cost", "measured_bandwidth", "probe", "PROBE_BYTES"
    ),
    "memmode_core.planning.planner": _to("memmode_core.planning.choosing", "choose", "NoModeFitsError")
    | _to("memmode_core.planning.pricing", "price")
    | _to("memmode_core.planning.candidates", "candidates"),
    "memmode_core.discovery.plugins": _to("memmode_core.discovery.registrations", "Registration", "PluginFailure")
    | _to("memmode_core.discovery.registering", "clash_error", "provided_by")
    | _to("memmode_core.discovery.sources", "temporary_plugin"),
    # renamed when "plan" was kept for ``plan()``; and the forwards of a component's packed layers, installed by
    # the stage that makes packed layers since one road leads to them
    "memmode_core.quantization": {
        old: Moved(f"memmode_core.quantization.selection:{new}")
        for old, new in {
            "QuantizationPlan": "LayerSelection",
            "LayerPlan": "LayerDecision",
            "plan_quantization": "select_layers",
            "plan_layers": "decide_layers",
        }.items()
    }
    | {"install_forwards": Moved("memmode_core.quantization.making:run_packed")},
}


def moved_names(old: str) -> Callable[[str], Any]:
    """The module ``__getattr__`` of the module at the old path ``old``: each of its names in
    :data:`DEPRECATED`, served from where it lives now with a warning that gives the import to write instead."""
    names = DEPRECATED[old]

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        moved = names[name]
        warnings.warn(
            f"{old}.{name} has moved: {moved.instead} (the old name goes away in {moved.removed_in})",
            MemmodeDeprecationWarning,
            stacklevel=2,
        )
        return moved.resolve()

    return __getattr__
