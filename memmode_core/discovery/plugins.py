"""Plugin discovery: which placements, quantizers and storages exist, and who provides them.

Discovery runs on first use, not at import, and is cached until its inputs change (the two environment
variables of :mod:`~memmode_core.discovery.disabling`, or the set of in-process plugins). Each run builds a
fresh pluggy manager — nothing global is mutated — registers the built-in plugins and the ``memmode`` entry
points, and calls each plugin's register hooks on its own, so that every registration knows its
distribution and version, and so that one broken plugin (an import error, a hook that raises, two
names that clash with nothing) is recorded and isolated instead of taking the others down.

Two registrations of one name in one kind are a *clash*: that name becomes an error naming both
distributions (:class:`~memmode_core.contracts.errors.DuplicatePluginError` when it is used), and everything
else keeps working; ``memmode list`` shows both rows with the clash as the reason.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

import pluggy

from memmode_core.contracts import hookspecs
from memmode_core.contracts.errors import DuplicatePluginError
from memmode_core.contracts.placement import Placement
from memmode_core.contracts.quantizer import Quantizer
from memmode_core.contracts.resolver import Resolver
from memmode_core.contracts.storage import Storage
from memmode_core.discovery.disabling import AUTOLOAD_ENV, DISABLE_ENV, registration_disabled
from memmode_core.discovery.registrations import (
    KINDS,
    PluginFailure,
    PluginInfo,
    PluginSet,
    PluginSource,
    Registration,
)
from memmode_core.discovery.sources import gather, temporary_sources

#: what each kind's register() takes; the placement slot of a mode also takes resolvers (``auto``)
_BASES = {"placement": (Placement, Resolver), "quantizer": (Quantizer,), "storage": (Storage,)}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


# -- discovery -----------------------------------------------------------------------------------


def discover() -> PluginSet:
    """One uncached discovery (see the module docstring)."""
    result = PluginSet()
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    for source in gather(result):
        for reg in _register_one(manager, source, result):
            if registration_disabled(reg):
                result.disabled_registrations.append(reg)
                continue
            key = (reg.kind, reg.name)
            if key in result.clashes:
                result.clashes[key].append(reg)
            elif reg.name in result.registrations[reg.kind]:  # a clash: the name is nobody's until resolved
                result.clashes[key] = [result.registrations[reg.kind].pop(reg.name), reg]
            else:
                result.registrations[reg.kind][reg.name] = reg
    return result


def clash_error(registrations: list[Registration]) -> DuplicatePluginError:
    """The error for a name several plugins register, with the unambiguous way to choose."""
    kind, name = registrations[0].kind, registrations[0].name
    who = " and ".join(
        f"{r.distribution} {r.version or ''} (plugin {r.plugin})".replace("  ", " ") for r in registrations
    )
    keep = registrations[0]
    others = ",".join(f"{r.distribution}:{name}" for r in registrations[1:])
    return DuplicatePluginError(
        f"the {kind} {name!r} is registered by {who}. Uninstall all but one, or choose one: "
        f"{DISABLE_ENV}={others} keeps {keep.distribution}'s (each 'distribution:name' entry skips only that "
        f"distribution's {name!r}). Every other name still works."
    )


def _register_one(manager: pluggy.PluginManager, source: PluginSource, result: PluginSet) -> list[Registration]:
    """Register one plugin and call its hooks; on any failure, record it and keep nothing of it."""
    plugin_name = source.name
    if manager.has_plugin(plugin_name):
        plugin_name = f"{source.name}@{source.distribution}"
    try:
        manager.register(source.obj, name=plugin_name)
        _check_hooks(manager, source.obj)
    except Exception as exc:
        if manager.is_registered(source.obj):
            manager.unregister(source.obj)
        result.failures.append(PluginFailure.of(source, "has invalid hooks", exc, _kinds_of(source.obj)))
        return []
    staged: list[Registration] = []
    try:
        for kind, hook_name in hookspecs.HOOK_FOR_KIND.items():
            for impl in getattr(manager.hook, hook_name).get_hookimpls():
                if impl.plugin is source.obj:
                    impl.function(register=_registrar(kind, source, staged))
        names = [(r.kind, r.name) for r in staged]
        repeated = {n for n in names if names.count(n) > 1}
        if repeated:
            kind, name = sorted(repeated)[0]
            raise DuplicatePluginError(f"it registers the {kind} {name!r} twice")
    except Exception as exc:
        manager.unregister(source.obj)
        result.failures.append(PluginFailure.of(source, "failed to register", exc, _kinds_of(source.obj)))
        return []
    return staged


def _kinds_of(obj: Any) -> tuple[str, ...]:
    """The kinds a plugin object has hooks for (what it would have provided)."""
    return tuple(kind for kind, hook in hookspecs.HOOK_FOR_KIND.items() if callable(getattr(obj, hook, None)))


def provided_by(source: PluginSource) -> list[tuple[str, str]]:
    """``(kind, name)`` a plugin that was not loaded (disabled) would register; best effort, for
    error messages only: it loads the plugin and calls its hooks on a throwaway manager."""
    obj = source.obj
    try:
        if obj is None and source.load is not None:
            obj = source.load()
        if obj is None:
            return []
        manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        manager.add_hookspecs(hookspecs)
        scratch = PluginSet()
        return [
            (r.kind, r.name)
            for r in _register_one(
                manager, PluginSource(source.name, obj, source.distribution, source.version), scratch
            )
        ]
    except Exception:  # noqa: BLE001 - a broken disabled plugin simply provides nothing we can name
        return []


def _check_hooks(manager: pluggy.PluginManager, obj: Any) -> None:
    """Hook implementations whose name matches no hook (a typo) make the plugin invalid."""
    marker = f"{hookspecs.PROJECT_NAME}_impl"
    for name in dir(obj):
        if not hasattr(getattr(obj, name, None), marker):
            continue
        caller = getattr(manager.hook, name, None)
        if caller is None or caller.spec is None:
            raise pluggy.PluginValidationError(
                obj, f"unknown hook {name!r}; memmode's hooks are {', '.join(hookspecs.HOOK_FOR_KIND.values())}"
            )


def _registrar(kind: str, source: PluginSource, staged: list[Registration]):
    bases = _BASES[kind]

    def register(obj: Any) -> None:
        if not isinstance(obj, bases):
            expected = " or a ".join(f"memmode_core.{base.__name__}" for base in bases)
            raise TypeError(f"register() in the {kind} hook takes a {expected}, got {type(obj).__name__}")
        name = getattr(obj, "name", "")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{kind} name {name!r} must be lowercase letters, digits and underscores")
        if kind != "storage" and "_and_" in name:
            raise ValueError(f"{kind} name {name!r} must not contain '_and_', the mode separator")
        staged.append(Registration(kind, name, obj, source.name, source.distribution, source.version))

    return register


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


__all__ = [
    "clash_error",
    "current",
    "discover",
    "list_plugins",
    "provided_by",
    "reset",
]
