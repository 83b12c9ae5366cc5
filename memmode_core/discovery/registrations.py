"""What one discovery finds: registrations, failed plugins, plugins to register, and the rows of ``memmode list``.

Plain records, with nothing of pluggy or of the contracts in them: the grammar, the planner and the CLI read
what was found without depending on how it was found. A registration keeps its plugin, distribution and
version, so that an error about a name can say who provides it.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass, field
from typing import Any

KINDS = ("placement", "quantizer", "storage", "reader")


def normalize(name: str) -> str:
    """Distribution names compare as PEP 503 does: case and runs of ``-_.`` don't matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Registration:
    kind: str
    name: str
    obj: Any
    plugin: str
    distribution: str
    version: str | None

    @property
    def description(self) -> str:
        return getattr(self.obj, "description", "") or ""

    def unavailable_reason(self) -> str | None:
        try:
            return self.obj.unavailable_reason()
        except Exception as exc:  # a plugin's own check must not break listing
            return f"availability check failed: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be imported or whose hooks raised."""

    plugin: str
    distribution: str
    version: str | None
    error: str
    #: the kinds its hooks would have registered, when it got as far as having hooks
    kinds: tuple[str, ...] = ()
    #: it was built for a plugin kit this memmode-core does not provide (``error`` says which)
    wrong_kit: bool = False

    @classmethod
    def of(cls, source: PluginSource, what: str, exc: BaseException, kinds: tuple[str, ...] = ()) -> PluginFailure:
        """The failure of ``source``: ``what`` went wrong, the exception, and the line that raised it."""
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        location = f" ({where.filename}:{where.lineno})" if where else ""
        return cls(
            source.name, source.distribution, source.version, f"{what}: {type(exc).__name__}: {exc}{location}", kinds
        )

    @classmethod
    def wrong_kit_of(cls, source: PluginSource, why: str, kinds: tuple[str, ...] = ()) -> PluginFailure:
        """``source`` refused because it was built for another plugin kit: ``why`` names both versions."""
        return cls(source.name, source.distribution, source.version, f"refused: {why}", kinds, wrong_kit=True)


@dataclass(frozen=True)
class PluginSource:
    """Something to register: a module or object with hook implementations."""

    name: str
    obj: Any
    distribution: str
    version: str | None
    #: how to load ``obj`` when it was not loaded (a disabled entry point)
    load: Any = None


@dataclass
class PluginSet:
    """The outcome of one discovery."""

    registrations: dict[str, dict[str, Registration]] = field(default_factory=lambda: {k: {} for k in KINDS})
    failures: list[PluginFailure] = field(default_factory=list)
    #: plugins not loaded because ``MEMMODE_DISABLE_PLUGINS`` names them
    disabled: list[PluginSource] = field(default_factory=list)
    #: single registrations ``MEMMODE_DISABLE_PLUGINS`` names (their plugin loaded)
    disabled_registrations: list[Registration] = field(default_factory=list)
    #: ``(kind, name)`` registered by several plugins: every registration of it, in discovery order
    clashes: dict[tuple[str, str], list[Registration]] = field(default_factory=dict)

    def get(self, kind: str, name: str) -> Registration | None:
        return self.registrations[kind].get(name)

    def names(self, kind: str) -> list[str]:
        return list(self.registrations[kind])


@dataclass(frozen=True)
class PluginInfo:
    """One row of ``memmode list``."""

    kind: str
    name: str
    distribution: str
    version: str | None
    available: bool
    reason: str | None
    description: str

    def as_dict(self) -> dict:
        return {
            k: getattr(self, k)
            for k in ("kind", "name", "distribution", "version", "available", "reason", "description")
        }
