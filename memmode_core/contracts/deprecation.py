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
    new home (a module) and the import to write instead."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        home, instead = names[name]
        warnings.warn(
            f"{old}.{name} has moved: {instead} ({old} goes away in {REMOVED_IN})",
            MemmodeDeprecationWarning,
            stacklevel=2,
        )
        return getattr(home, name)

    return __getattr__
