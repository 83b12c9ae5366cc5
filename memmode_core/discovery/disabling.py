"""Turning plugins off without uninstalling them: the two environment variables discovery reads.

- ``MEMMODE_DISABLE_PLUGIN_AUTOLOAD=1`` skips entry points (the built-ins still register).
- ``MEMMODE_DISABLE_PLUGINS=a,b`` skips plugins by plugin name, distribution name, or the name of
  a registration; ``distribution:name`` skips exactly one distribution's registration of ``name``
  (the unambiguous way to choose between two packages that register the same name).

They are read at each discovery, never cached here: the cache of discoveries is keyed on them.
"""

from __future__ import annotations

import os

from memmode_core.discovery.registrations import Registration, normalize

AUTOLOAD_ENV = "MEMMODE_DISABLE_PLUGIN_AUTOLOAD"
DISABLE_ENV = "MEMMODE_DISABLE_PLUGINS"


def disabled_names() -> set[str]:
    """The plain entries of ``MEMMODE_DISABLE_PLUGINS``: plugin, distribution or registration names."""
    return {entry for entry in _disable_entries() if ":" not in entry}


def disabled_pairs() -> set[tuple[str, str]]:
    """The ``distribution:name`` entries: one distribution's registration of one name."""
    return {tuple(entry.split(":", 1)) for entry in _disable_entries() if ":" in entry}


def _disable_entries() -> list[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    entries = []
    for part in raw.split(","):
        dist, colon, name = part.strip().partition(":")
        if part.strip():
            entries.append(f"{normalize(dist.strip())}:{name.strip()}" if colon else normalize(part.strip()))
    return entries


def registration_disabled(reg: Registration) -> str | None:
    """The ``MEMMODE_DISABLE_PLUGINS`` entry that disables this one registration, if any."""
    if normalize(reg.name) in disabled_names():
        return reg.name
    if (normalize(reg.distribution), reg.name) in disabled_pairs():
        return f"{reg.distribution}:{reg.name}"
    return None


def autoload_enabled() -> bool:
    return os.environ.get(AUTOLOAD_ENV, "").strip().lower() not in ("1", "true", "yes", "on")
