"""Registering one plugin: its hooks called on their own, what they register checked, and clashes kept apart.

Each plugin's register hooks are called on their own, not through one pluggy call over every plugin, so
that every registration knows its distribution and version, and so that one broken plugin (a hook that
raises, a misspelt hook, an object of the wrong kind, a bad name) is recorded and isolated instead of
taking the others down: a plugin registers all of its names or none.

Two registrations of one name in one kind are a *clash*: that name becomes an error naming both
distributions (:class:`~memmode_core.contracts.errors.DuplicatePluginError` when it is used), and everything
else keeps working; ``memmode list`` shows both rows with the clash as the reason.
"""

from __future__ import annotations

import re
from typing import Any

import pluggy

from memmode_core.contracts import hookspecs
from memmode_core.contracts.errors import DuplicatePluginError
from memmode_core.contracts.placement import Placement
from memmode_core.contracts.quantizer import Quantizer
from memmode_core.contracts.reader import Reader
from memmode_core.contracts.resolver import Resolver
from memmode_core.contracts.storage import Storage
from memmode_core.discovery.compatibility import declared_refusal
from memmode_core.discovery.disabling import DISABLE_ENV, registration_disabled
from memmode_core.discovery.registrations import PluginFailure, PluginSet, PluginSource, Registration

#: what each kind's register() takes; the placement slot of a mode also takes resolvers (``auto``)
_BASES = {"placement": (Placement, Resolver), "quantizer": (Quantizer,), "storage": (Storage,), "reader": (Reader,)}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def new_manager() -> pluggy.PluginManager:
    """A fresh pluggy manager with memmode's hooks: each discovery has its own, nothing global is mutated."""
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    return manager


def register_one(manager: pluggy.PluginManager, source: PluginSource, result: PluginSet) -> list[Registration]:
    """Register one plugin and call its hooks; on any failure, record it and keep nothing of it. A plugin built
    for a plugin kit this core does not provide is refused before its hooks are called."""
    refused = declared_refusal(source.obj)
    if refused is not None:
        result.failures.append(PluginFailure.wrong_kit_of(source, refused, _kinds_of(source.obj)))
        return []
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


def add_registration(result: PluginSet, reg: Registration) -> None:
    """Add one registration to ``result``: set aside when ``MEMMODE_DISABLE_PLUGINS`` names it, a clash when
    another plugin registered its name, else the registration of its name."""
    if registration_disabled(reg):
        result.disabled_registrations.append(reg)
        return
    key = (reg.kind, reg.name)
    if key in result.clashes:
        result.clashes[key].append(reg)
    elif reg.name in result.registrations[reg.kind]:  # a clash: the name is nobody's until resolved
        result.clashes[key] = [result.registrations[reg.kind].pop(reg.name), reg]
    else:
        result.registrations[reg.kind][reg.name] = reg


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


def provided_by(source: PluginSource) -> list[tuple[str, str]]:
    """``(kind, name)`` a plugin that was not loaded (disabled) would register; best effort, for
    error messages only: it loads the plugin and calls its hooks on a throwaway manager."""
    obj = source.obj
    try:
        if obj is None and source.load is not None:
            obj = source.load()
        if obj is None:
            return []
        scratch = PluginSet()
        return [
            (r.kind, r.name)
            for r in register_one(
                new_manager(), PluginSource(source.name, obj, source.distribution, source.version), scratch
            )
        ]
    except Exception:  # noqa: BLE001 - a broken disabled plugin simply provides nothing we can name
        return []


def _kinds_of(obj: Any) -> tuple[str, ...]:
    """The kinds a plugin object has hooks for (what it would have provided)."""
    return tuple(kind for kind, hook in hookspecs.HOOK_FOR_KIND.items() if callable(getattr(obj, hook, None)))


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
        if kind in ("placement", "quantizer") and "_and_" in name:
            raise ValueError(f"{kind} name {name!r} must not contain '_and_', the mode separator")
        staged.append(Registration(kind, name, obj, source.name, source.distribution, source.version))

    return register
