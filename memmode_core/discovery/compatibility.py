"""Whether a plugin was built for the plugin kit this memmode-core provides (:mod:`~memmode_core.contracts.versions`).

Each check is made where it first can be, and a plugin that fails one is a failure of that plugin alone,
refused before any of its hooks run (``memmode list`` shows why; using one of its names raises
:class:`~memmode_core.contracts.errors.PluginKitError`):

1. before it is imported: its distribution requires memmode-core releases that exclude this one (what
   ``pip install --no-deps``, or upgrading memmode-core alone, leaves behind: pip warns and installs anyway);
   nothing of the plugin is imported;
2. while it is imported: it imports from ``memmode_core`` a name or module this core does not have (it was
   built for a later kit, or for one from before a removal);
3. once imported: the ``MEMMODE_KIT`` of its entry-point module names a kit this core does not provide. A
   plugin that states none was written before kit versions were: for kit 1.0, the first.

This core's version is ``CORE_VERSION``, written once; the installed metadata is built from it, so no check
reads the metadata again.
"""

from __future__ import annotations

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from memmode_core.contracts.versions import CORE_VERSION, KIT_ATTRIBUTE, KIT_VERSION, kit_provides, parse_kit
from memmode_core.discovery.first_party import CORE

#: what a plugin that states no kit version was built for
FIRST_KIT = "1.0"


def installed_core(core_version: str) -> str:
    return f"memmode-core {core_version} (plugin kit {KIT_VERSION})"


def requirement_refusal(requires: list[str] | None, core_version: str = CORE_VERSION) -> str | None:
    """Why a distribution whose requirements are ``requires`` (its ``Requires-Dist`` lines) cannot use this
    memmode-core, or ``None``. Requirements under an extra are the user's choice and are not read."""
    try:
        installed = Version(core_version)
    except InvalidVersion:
        return None
    for line in requires or ():
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue  # a distribution's own malformed metadata: not ours to refuse
        if canonicalize_name(requirement.name) != CORE:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            return (
                f"it requires memmode-core{requirement.specifier} and this is {installed_core(core_version)}: it "
                f"was built for another plugin kit. Install a release of it built for kit {KIT_VERSION}, or "
                f"memmode-core{requirement.specifier} (pip install 'memmode-core{requirement.specifier}')"
            )
    return None


def import_refusal(error: BaseException, core_version: str = CORE_VERSION) -> str | None:
    """Why an import that failed with ``error`` means the plugin was built for another kit (it imported from
    memmode_core what is not there), or ``None`` for any other failure."""
    if not isinstance(error, ImportError) or (error.name or "").partition(".")[0] != "memmode_core":
        return None
    return (
        f"it imports from {error.name} what {installed_core(core_version)} does not have ({error}): it was built "
        f"for another plugin kit. Upgrade memmode-core, or install a release of the plugin built for kit "
        f"{KIT_VERSION}"
    )


def declared_refusal(plugin: object, core_version: str = CORE_VERSION) -> str | None:
    """Why the kit the plugin object states (``MEMMODE_KIT``) is not one this core provides, or ``None``."""
    built_for = getattr(plugin, KIT_ATTRIBUTE, FIRST_KIT)
    try:
        parse_kit(built_for)
    except ValueError as exc:
        return f"{exc} (this is {installed_core(core_version)})"
    if kit_provides(built_for):
        return None
    newer = parse_kit(built_for) > parse_kit(KIT_VERSION)
    return f"it was built for plugin kit {built_for}, and this is {installed_core(core_version)}: " + (
        "upgrade memmode-core (pip install -U memmode-core)"
        if newer
        else f"install a release of the plugin built for kit {KIT_VERSION}"
    )
