"""Plugin discovery: which placements, quantizers and storages exist, and who provides them.

Discovery runs on first use, not at import, and is cached until its inputs change (the two environment
variables of :mod:`~memmode_core.discovery.disabling`, or the set of in-process plugins). Each run builds a
fresh pluggy manager — nothing global is mutated — gathers the built-in plugins, the ``memmode`` entry points
and the in-process plugins (:mod:`~memmode_core.discovery.sources`), and registers each on its own
(:mod:`~memmode_core.discovery.registering`), so that one broken plugin is recorded and isolated instead of
taking the others down. ``memmode list`` shows the outcome, failures and disabled plugins included.
"""

from __future__ import annotations

import os
import threading

from memmode_core.contracts.deprecation import moved_names
from memmode_core.discovery.disabling import AUTOLOAD_ENV, DISABLE_ENV, registration_disabled
from memmode_core.discovery.registering import add_registration, new_manager, register_one
from memmode_core.discovery.registrations import KINDS, PluginInfo, PluginSet
from memmode_core.discovery.sources import gather, temporary_sources


def discover() -> PluginSet:
    """One uncached discovery (see the module docstring)."""
    result = PluginSet()
    manager = new_manager()
    for source in gather(result):
        for reg in register_one(manager, source, result):
            add_registration(result, reg)
    return result


# -- the cached view -----------------------------------------------------------------------------

_cache: tuple[tuple, PluginSet] | None = None
_lock = threading.RLock()


def _cache_key() -> tuple:
    temporary = tuple(id(s) for s in temporary_sources())
    return (os.environ.get(AUTOLOAD_ENV), os.environ.get(DISABLE_ENV), temporary)


def current() -> PluginSet:
    """The plugins in effect now: discovered on first use, cached until the inputs change."""
    global _cache
    key = _cache_key()
    with _lock:
        if _cache is None or _cache[0] != key:
            _cache = (key, discover())
        return _cache[1]


def reset() -> None:
    """Forget the cached discovery (after installing or removing a distribution in-process)."""
    global _cache
    with _lock:
        _cache = None


def list_plugins() -> list[PluginInfo]:
    """Every registration, plus one row per plugin that failed or was disabled."""
    plugins = current()
    rows: list[PluginInfo] = []
    for kind in KINDS:
        for reg in plugins.registrations[kind].values():
            reason = reg.unavailable_reason()
            rows.append(
                PluginInfo(kind, reg.name, reg.distribution, reg.version, reason is None, reason, reg.description)
            )
        for (clash_kind, name), regs in plugins.clashes.items():
            if clash_kind != kind:
                continue
            for reg in regs:
                others = ", ".join(r.distribution for r in regs if r is not reg)
                rows.append(
                    PluginInfo(
                        kind,
                        name,
                        reg.distribution,
                        reg.version,
                        False,
                        f"clash: {others} also registers {kind} {name!r}; choose with "
                        f"{DISABLE_ENV}=<distribution>:{name}",
                        reg.description,
                    )
                )
    for reg in plugins.disabled_registrations:
        rows.append(
            PluginInfo(
                reg.kind,
                reg.name,
                reg.distribution,
                reg.version,
                False,
                f"disabled by {DISABLE_ENV}={registration_disabled(reg)}",
                reg.description,
            )
        )
    for failure in plugins.failures:
        would = (
            f"a plugin that could not be loaded; it would provide: {', '.join(failure.kinds)}"
            if failure.kinds
            else "a plugin that could not be loaded (what it provides is unknown: it did not get that far)"
        )
        rows.append(
            PluginInfo("plugin", failure.plugin, failure.distribution, failure.version, False, failure.error, would)
        )
    for source in plugins.disabled:
        rows.append(
            PluginInfo(
                "plugin",
                source.name,
                source.distribution,
                source.version,
                False,
                f"disabled by {DISABLE_ENV}",
                "a plugin that was not loaded",
            )
        )
    return rows


#: what this module's ``__all__`` listed before discovery was split by job (memmode_core/contracts/deprecation.py)
__getattr__ = moved_names(__name__)
