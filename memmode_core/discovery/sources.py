"""Where plugins come from: memmode-core's own, the ``memmode`` entry points, and in-process plugins.

All three are plugins of one shape (:class:`~memmode_core.discovery.registrations.PluginSource`), registered
the same way afterwards: a built-in has no privilege an installed plugin lacks, and a test or a notebook can
add a plugin for one block without installing anything. Which of them ``MEMMODE_DISABLE_PLUGINS`` skips is
decided here, so that a disabled entry point is never imported.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from memmode_core.contracts.versions import CORE_VERSION
from memmode_core.discovery.compatibility import import_refusal, requirement_refusal
from memmode_core.discovery.disabling import autoload_enabled, disabled_names
from memmode_core.discovery.first_party import CORE
from memmode_core.discovery.registrations import PluginFailure, PluginSet, PluginSource, normalize

ENTRY_POINT_GROUP = "memmode"


def gather(result: PluginSet) -> list[PluginSource]:
    """The plugins to register, in order: the built-ins, the entry points, the in-process plugins.

    Those ``MEMMODE_DISABLE_PLUGINS`` names go to ``result.disabled`` instead (an entry point unloaded), and
    an entry point that fails to import goes to ``result.failures``: it takes no other plugin down; so does one
    whose distribution requires another memmode-core, before it is imported (:mod:`.compatibility`)."""
    disabled = disabled_names()

    def is_disabled(source_name: str, distribution: str) -> bool:
        return normalize(source_name) in disabled or normalize(distribution) in disabled

    sources: list[PluginSource] = []
    for source in builtin_sources():
        (result.disabled if is_disabled(source.name, source.distribution) else sources).append(source)
    if autoload_enabled():
        for ep in _entry_points():
            placeholder = PluginSource(ep.name, None, ep.distribution, ep.version, ep.entry_point.load)
            if is_disabled(ep.name, ep.distribution):
                result.disabled.append(placeholder)
                continue
            refused = requirement_refusal(list(ep.requires))
            if refused is not None:
                result.failures.append(PluginFailure.wrong_kit_of(placeholder, refused))
                continue
            try:
                obj = ep.entry_point.load()
            except Exception as exc:
                refused = import_refusal(exc)
                result.failures.append(
                    PluginFailure.of(placeholder, "failed to import", exc)
                    if refused is None
                    else PluginFailure.wrong_kit_of(placeholder, refused)
                )
                continue
            sources.append(PluginSource(ep.name, obj, ep.distribution, ep.version))
    for source in temporary_sources():
        (result.disabled if is_disabled(source.name, source.distribution) else sources).append(source)
    return sources


# -- built-in ------------------------------------------------------------------------------------


def core_version() -> str:
    try:
        return metadata.version(CORE)
    except metadata.PackageNotFoundError:
        return CORE_VERSION


#: The plugins built into memmode-core: plugin name -> module. They are loaded by name, exactly as an
#: entry point is, and register through the same hooks: discovery sits below every plugin (built-in
#: placements such as ``auto`` use the planner, which uses discovery), so it never imports one directly.
BUILTIN_PLUGINS = {
    "memmode-core.placements": "memmode_core.builtin.placements",
    "memmode-core.ram": "memmode_core.builtin.ram",
    "memmode-core.comfy": "memmode_core.builtin.comfy",
    "memmode-core.bitsandbytes": "memmode_core.builtin.bitsandbytes",
    "memmode-core.quanto": "memmode_core.builtin.quanto",
    "memmode-core.modelopt": "memmode_core.builtin.modelopt",
}


def builtin_sources() -> list[PluginSource]:
    version = core_version()
    return [
        PluginSource(name, importlib.import_module(module), CORE, version) for name, module in BUILTIN_PLUGINS.items()
    ]


# -- entry points --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _EntryPoint:
    name: str
    distribution: str
    version: str | None
    entry_point: Any
    requires: tuple[str, ...] = ()


def _entry_points() -> list[_EntryPoint]:
    """Entry points of group ``memmode``, one distribution counted once even if found twice on the path (the
    first found, the one that imports).

    A distribution is known by the name its ``.dist-info`` folder gives (``_normalized_name``, read from the
    path without parsing anything); only the distributions that declare an entry point of ours have their
    metadata parsed. Parsing every installed distribution's metadata was most of discovery's time: 17 ms
    against 2 ms with 78 distributions, more on a cold start."""
    found: list[_EntryPoint] = []
    seen: set[str] = set()
    for dist in list(metadata.distributions()):
        key = getattr(dist, "_normalized_name", None) or normalize(dist.metadata["Name"] or "<unnamed>")
        if key in seen:
            continue
        seen.add(key)
        ours = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
        if ours:
            dist_name = dist.metadata["Name"] or "<unnamed>"
            requires = tuple(getattr(dist, "requires", None) or ())
            found.extend(_EntryPoint(ep.name, dist_name, dist.version, ep, requires) for ep in ours)
    return found


# -- in-process plugins (tests, notebooks) -------------------------------------------------------

_temporary: list[PluginSource] = []
_lock = threading.RLock()


@contextlib.contextmanager
def temporary_plugin(
    obj: Any, *, name: str | None = None, distribution: str = "<in-process>", version: str | None = None
) -> Iterator[PluginSource]:
    """Register ``obj`` (a module or object with ``@hookimpl`` functions) for the duration of a block.

    Nothing is installed and nothing outlives the block: the next discovery after it no longer
    sees the plugin.
    """
    source = PluginSource(
        name or getattr(obj, "__name__", None) or f"in-process-{id(obj):x}", obj, distribution, version
    )
    with _lock:
        _temporary.append(source)
    try:
        yield source
    finally:
        with _lock:
            _temporary.remove(source)


def temporary_sources() -> list[PluginSource]:
    """The in-process plugins now, oldest first (a copy: a block may end while a discovery reads it)."""
    with _lock:
        return list(_temporary)
