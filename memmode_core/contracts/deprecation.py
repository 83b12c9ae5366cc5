"""Deprecated aliases: names a plugin guide or ``__all__`` once taught at a place where they no longer live.

A plugin written from an earlier guide must keep importing for at least one release after a refactor moves
what it imports. The module at the old path stays, holding nothing but a module ``__getattr__`` made by
:func:`moved_names`: each old name is served from its new home, with a :class:`MemmodeDeprecationWarning`
that gives the import to write instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

#: the release from which the aliases are gone
REMOVED_IN = "memmode 0.3"


class MemmodeDeprecationWarning(FutureWarning):
    """A name used from a place it no longer lives; the message says the import to write instead.

    A ``FutureWarning``, so that the person running a script with an old plugin sees it (Python hides a
    ``DeprecationWarning`` outside ``__main__``)."""


def moved_names(old: str, names: Mapping[str, tuple[ModuleType, str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the module at the old path ``old``: ``names`` maps each old name to its
    new home (a module) and the import to write instead, ``from <module> import <new name>`` (a name renamed
    on the way is looked up in its home under the new name)."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        home, instead = names[name]
        warnings.warn(
            f"{old}.{name} has moved: {instead} (the old name goes away in {REMOVED_IN})",
            MemmodeDeprecationWarning,
            stacklevel=2,
        )
        return getattr(home, instead.rpartition(" import ")[2])

    return __getattr__


def names_moved_to(home: ModuleType, *names: str, renamed: Mapping[str, str] | None = None):
    """``moved_names``' entries for ``names`` now in the module ``home`` (``renamed``: old name -> new name)."""
    entries = {name: (home, f"from {home.__name__} import {name}") for name in names}
    entries |= {old: (home, f"from {home.__name__} import {new}") for old, new in (renamed or {}).items()}
    return entries
