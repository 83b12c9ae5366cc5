"""What an earlier plugin guide taught to import stays importable, for at least one release, as an alias that
warns and names the import to write instead. Every deprecated name is a row of one table, ``DEPRECATED`` in
``memmode_core/contracts/deprecation.py``: each row is checked here, and each old path serves its names from it.

Third-party plugins written from an earlier guide stopped importing when a refactor removed
``memmode_core.storage`` and ``memmode_core.engine.layout``; each path below is one a guide taught.
"""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

import memmode_core
import memmode_core.plugin as kit
from memmode_core.contracts.deprecation import DEPRECATED, REMOVED_IN, MemmodeDeprecationWarning
from memmode_core.contracts.versions import CORE_VERSION
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


#: every row of the table: (old module, old name, where it lives now)
TABLE = [(old, name, moved) for old, names in DEPRECATED.items() for name, moved in names.items()]


@pytest.mark.parametrize("old, name, moved", TABLE, ids=[f"{m}.{n}" for m, n, _ in TABLE])
def test_every_row_warns_names_its_new_import_and_is_the_new_object(old, name, moved):
    home, new_name = moved.new.split(":")
    new = getattr(importlib.import_module(home), new_name)
    module = importlib.import_module(old)
    with pytest.warns(MemmodeDeprecationWarning) as caught:
        got = getattr(module, name)
    assert got is new
    message = str(caught[0].message)
    assert f"{old}.{name} has moved: from {home} import {new_name}" in message
    assert f"goes away in {moved.removed_in}" in message
    assert caught[0].filename == __file__, "the warning points at the line that used the old name"


def test_the_table_holds_what_the_guides_taught():
    assert {(old, name) for old, name, _, _ in ALIASES} <= {(old, name) for old, name, _ in TABLE}


def _version(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.removeprefix("memmode ").split("."))


def test_no_name_goes_before_the_release_announced():
    """Deprecated in 0.1, gone in 0.3 at the soonest (docs/versioning.md: one minor release with the warning)."""
    assert REMOVED_IN == "memmode 0.3"
    for old, name, moved in TABLE:
        assert _version(moved.removed_in) >= _version(REMOVED_IN) > _version(CORE_VERSION)[:2], (old, name)


PACKAGE = Path(memmode_core.__file__).parent


def _module_getattrs() -> dict[str, str]:
    """memmode_core's modules that define a module ``__getattr__`` -> how (its source)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                found[name] = "def __getattr__"
            elif isinstance(node, ast.Assign) and any(ast.unparse(t) == "__getattr__" for t in node.targets):
                found[name] = ast.unparse(node.value)
    return found


def test_every_old_path_is_served_from_the_table_and_only_those():
    """One table: a module ``__getattr__`` is an old path's, made from the table, and every old path has one."""
    assert _module_getattrs() == {old: "moved_names(__name__)" for old in DEPRECATED}


def test_nothing_else_warns_of_a_deprecation():
    """No deprecation outside the table: ``MemmodeDeprecationWarning`` is raised by the table's module only
    (the package re-exports it, for filters)."""
    users = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if "MemmodeDeprecationWarning" in path.read_text()
    }
    assert users == {"contracts/deprecation.py", "__init__.py"}
