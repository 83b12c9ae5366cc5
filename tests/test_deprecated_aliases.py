"""What an earlier plugin guide taught to import stays importable, for at least one release, as an alias that
warns and names the import to write instead (``memmode_core/contracts/deprecation.py``).

Third-party plugins written from an earlier guide stopped importing when a refactor removed
``memmode_core.storage`` and ``memmode_core.engine.layout``; each path below is one a guide taught.
"""

from __future__ import annotations

import importlib
import warnings

import pytest

import memmode_core
import memmode_core.plugin as kit
from memmode_core.discovery import registrations
from memmode_core.planning import candidates, choosing, measuring, pricing
from memmode_core.quantization import selection

#: (old module, name, the object it must be, the import the warning must name)
ALIASES = [
    # what the modules' own ``__all__`` listed before they were split by job, or renamed
    ("memmode_core.planning.planner", "choose", choosing.choose, "from memmode_core.planning.choosing import choose"),
    ("memmode_core.planning.planner", "price", pricing.price, "from memmode_core.planning.pricing import price"),
    (
        "memmode_core.planning.planner",
        "candidates",
        candidates.candidates,
        "from memmode_core.planning.candidates import candidates",
    ),
    (
        "memmode_core.discovery.plugins",
        "temporary_plugin",
        kit.temporary_plugin,
        "from memmode_core.discovery.sources import temporary_plugin",
    ),
    (
        "memmode_core.discovery.plugins",
        "Registration",
        registrations.Registration,
        "from memmode_core.discovery.registrations import Registration",
    ),
    (
        "memmode_core.quantization",
        "QuantizationPlan",
        selection.LayerSelection,
        "from memmode_core.quantization.selection import LayerSelection",
    ),
    (
        "memmode_core.quantization",
        "plan_quantization",
        selection.select_layers,
        "from memmode_core.quantization.selection import select_layers",
    ),
    # what plugin guides taught
    *(
        ("memmode_core.storage", name, getattr(kit, name), f"from memmode_core.plugin import {name}")
        for name in ("Storage", "StorageSession", "Tensors", "placeholder", "is_placeholder", "host_copy")
    ),
    *(
        ("memmode_core.engine.layout", name, getattr(kit, name), f"from memmode_core.plugin import {name}")
        for name in ("GroupSpec", "Policy", "whole_component", "leaf_groups", "block_groups")
    ),
    ("memmode_core.costs", "StorageCost", kit.StorageCost, "from memmode_core.plugin import StorageCost"),
    ("memmode_core.costs", "copying_cost", kit.copying_cost, "from memmode_core.plugin import copying_cost"),
    ("memmode_core.costs", "probe", measuring.probe, "from memmode_core.planning.measuring import probe"),
    ("memmode_core.planning.costs", "probe", measuring.probe, "from memmode_core.planning.measuring import probe"),
    (
        "memmode_core.planning.costs",
        "storage_cost",
        measuring.storage_cost,
        "from memmode_core.planning.measuring import storage_cost",
    ),
]


@pytest.mark.parametrize("old, name, new, instead", ALIASES, ids=[f"{m}.{n}" for m, n, _, _ in ALIASES])
def test_an_old_import_gets_the_same_object_and_a_warning_naming_the_new_import(old, name, new, instead):
    module = importlib.import_module(old)
    with pytest.warns(memmode_core.MemmodeDeprecationWarning) as caught:
        got = getattr(module, name)
    assert got is new
    assert instead in str(caught[0].message) and "goes away in memmode 0.3" in str(caught[0].message)


def test_from_import_of_an_old_path_works_and_warns():
    with pytest.warns(memmode_core.MemmodeDeprecationWarning, match="from memmode_core.plugin import block_groups"):
        from memmode_core.engine.layout import block_groups
    assert block_groups is kit.block_groups


def test_the_warning_is_seen_by_default():
    """A ``FutureWarning``: Python's default filters show it outside ``__main__`` (a ``DeprecationWarning`` they
    hide), so the person running a script with an old plugin learns what to change."""
    assert issubclass(memmode_core.MemmodeDeprecationWarning, FutureWarning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        importlib.import_module("memmode_core.storage").Storage  # noqa: B018
    assert [w.category for w in caught] == [memmode_core.MemmodeDeprecationWarning]


def test_a_name_an_old_module_never_had_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'Runtime'"):
        importlib.import_module("memmode_core.storage").Runtime  # noqa: B018
