"""Deprecated aliases: names a plugin guide or ``__all__`` once taught at a place where they no longer live.

A plugin written from an earlier guide must keep importing for at least one release after a refactor moves
what it imports. The module at the old path stays, holding nothing but a module ``__getattr__`` made by
:func:`moved_names`: each old name is served from its new home, with a :class:`MemmodeDeprecationWarning`
that gives the import to write instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

#: the release from which the aliases are gone
REMOVED_IN = "memmode 0.3"


class MemmodeDeprecationWarning(FutureWarning):
    """A name used from a place it no longer lives; the message says the import to write instead.

    A ``FutureWarning``, so that the person running a script with an old plugin sees it (Python hides a
    ``DeprecationWarning`` outside ``__main__``)."""


@dataclass(frozen=True)
class Moved:
    """Where an old name lives now: the attribute ``name`` of the module ``home``, to be imported from ``public``
    (default: ``home`` itself; ``memmode_core.plugin`` for what the kit re-exports)."""

    home: ModuleType
    name: str
    public: str | None = None

    @property
    def instead(self) -> str:
        return f"from {self.public or self.home.__name__} import {self.name}"


def moved_names(old: str, names: Mapping[str, Moved]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the module at the old path ``old``, serving each old name of ``names`` from
    where it lives now, with a warning that gives the import to write instead."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        moved = names[name]
        warnings.warn(
            f"{old}.{name} has moved: {moved.instead} (the old name goes away in {REMOVED_IN})",
            MemmodeDeprecationWarning,
            stacklevel=2,
        )
        return getattr(moved.home, moved.name)

    return __getattr__


def names_moved_to(
    home: ModuleType, *names: str, renamed: Mapping[str, str] | None = None, public: str | None = None
) -> dict[str, Moved]:
    """``moved_names``' entries for ``names`` now in the module ``home`` (``renamed``: old name -> new name),
    imported from ``public`` (default: ``home``)."""
    entries = {name: Moved(home, name, public) for name in names}
    entries |= {old: Moved(home, new, public) for old, new in (renamed or {}).items()}
    return entries
