"""memmode-core's version and the plugin kit's: what a plugin is built for, and what this core provides.

The plugin kit (:mod:`memmode_core.plugin`, with the hooks and the contracts it exports) is what plugins
depend on, and it changes more slowly than the rest of core, so it has a version of its own, ``MAJOR.MINOR``
(docs/versioning.md):

- a MINOR release of the kit adds names, or optional methods to a contract; a plugin built for kit 1.2 works
  with every core that provides kit 1.2 or a later 1.x;
- a MAJOR release removes or changes something a plugin may use (a deprecated alias reaching the release its
  warning announces is one), and a plugin built for another major is refused.

A plugin states the kit it was built for as ``MEMMODE_KIT = "1.0"`` in the module its ``memmode`` entry point
names, and its distribution requires the memmode-core releases that provide that kit. Discovery checks both
(:mod:`memmode_core.discovery.compatibility`) before any of the plugin's hooks run, so that a plugin built for
another kit is a :class:`~memmode_core.contracts.errors.PluginKitError` naming both versions, not an
``ImportError`` from deep inside it.
"""

from __future__ import annotations

#: memmode-core's version: written here only (pyproject.toml reads it, ``memmode_core.__version__`` is it)
CORE_VERSION = "0.1.0"

#: the plugin kit this memmode-core provides, ``MAJOR.MINOR``
KIT_VERSION = "1.3"

#: the attribute of a plugin's entry-point module that states the kit version it was built for
KIT_ATTRIBUTE = "MEMMODE_KIT"


def parse_kit(version: object) -> tuple[int, int]:
    """``"1.2"`` -> ``(1, 2)``; anything else is a ``ValueError`` that says what a kit version looks like."""
    if isinstance(version, str):
        major, dot, minor = version.partition(".")
        if dot and major.isdigit() and minor.isdigit():
            return int(major), int(minor)
    raise ValueError(
        f"{KIT_ATTRIBUTE} = {version!r} is not a kit version: write 'MAJOR.MINOR', such as {KIT_VERSION!r}"
    )


def kit_provides(built_for: str, provided: str = KIT_VERSION) -> bool:
    """Whether a core providing kit ``provided`` has everything a plugin built for kit ``built_for`` uses: the
    same major, and at least its minor."""
    (major, minor), (provided_major, provided_minor) = parse_kit(built_for), parse_kit(provided)
    return major == provided_major and minor <= provided_minor
