"""The mode grammar and name resolution.

A mode is ``<placement>`` or ``<placement>_and_<quantizer>``, split on the **last** ``_and_`` —
the spellings that existing scripts use (``model_cpu_offload_and_qfloat8``). The storage is not
part of the string; it is ``apply``'s ``storage=`` argument. Names resolve against what is
installed at call time, and a name that does not resolve is always an error, never a fallback.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch

from memmode_core.contracts.errors import (
    IncompatibleModeError,
    PluginKitError,
    PluginLoadError,
    PluginNotInstalledError,
    StorageUnavailableError,
    UnknownModeError,
)
from memmode_core.discovery.disabling import (
    AUTOLOAD_ENV,
    DISABLE_ENV,
    autoload_enabled,
    disabled_names,
    registration_disabled,
)
from memmode_core.discovery.first_party import ACCELERATOR_STORAGE, DEFAULT_STORAGE
from memmode_core.discovery.first_party import DISTRIBUTIONS as FIRST_PARTY
from memmode_core.discovery.registering import clash_error, provided_by
from memmode_core.discovery.registrations import PluginFailure, PluginSet, Registration, normalize
from memmode_core.engine.streams import active

SEPARATOR = "_and_"


@dataclass(frozen=True)
class Mode:
    placement: str
    quantizer: str | None = None

    def __str__(self) -> str:
        return self.placement if self.quantizer is None else f"{self.placement}{SEPARATOR}{self.quantizer}"


def parse_mode(mode: object) -> Mode:
    """Split a mode string into its placement and quantizer names (no installation check)."""
    if not isinstance(mode, str):
        raise TypeError(
            f"a memmode mode is a string such as 'model_cpu_offload_and_qfloat8', not {type(mode).__name__}"
        )
    placement, separator, quantizer = mode.rpartition(SEPARATOR)
    if not separator:
        placement, quantizer = mode, None
    if not placement or (separator and not quantizer) or mode != mode.strip():
        raise UnknownModeError(f"{mode!r} is not a mode: write '<placement>' or '<placement>{SEPARATOR}<quantizer>'")
    return Mode(placement, quantizer)


@dataclass(frozen=True)
class Resolved:
    mode: Mode
    placement: Registration
    quantizer: Registration | None
    storage: Registration | None


def resolve(
    mode: str, *, storage: str | None, device: torch.device, plugins: PluginSet, storage_given: bool
) -> Resolved:
    parsed = parse_mode(mode)
    placement = lookup(plugins, "placement", parsed.placement, mode=mode)
    quantizer = lookup(plugins, "quantizer", parsed.quantizer, mode=mode) if parsed.quantizer else None
    for reg in (placement, quantizer):
        if reg is not None and (reason := reg.unavailable_reason()):
            raise IncompatibleModeError(f"the {reg.kind} {reg.name!r} ({reg.distribution}) cannot run here: {reason}")
    storage_reg = None
    if getattr(placement.obj, "offloads", True):
        name = storage if storage is not None else default_storage(device, plugins)
        storage_reg = lookup(plugins, "storage", name, mode=None)
        reason = storage_reg.obj.unavailable_reason(device)
        if reason:
            raise StorageUnavailableError(f"storage {name!r} ({storage_reg.distribution}) is unavailable: {reason}")
    elif storage_given and storage is not None:
        raise IncompatibleModeError(
            f"{parsed.placement!r} keeps every weight on the device, so storage={storage!r} would hold nothing; "
            f"leave storage unset or choose an offloading placement"
        )
    return Resolved(parsed, placement, quantizer, storage_reg)


def default_storage(device: torch.device, plugins: PluginSet) -> str:
    """``pinned`` when computing on an accelerator with streams and that plugin is installed and usable,
    else ``ram``."""
    pinned = plugins.get("storage", ACCELERATOR_STORAGE)
    if active().has_streams(device) and pinned is not None and pinned.obj.unavailable_reason(device) is None:
        return ACCELERATOR_STORAGE
    return DEFAULT_STORAGE


def lookup(plugins: PluginSet, kind: str, name: str, *, mode: str | None) -> Registration:
    """The registration for ``name``, or the most useful error about why there is none."""
    if not isinstance(name, str):
        raise TypeError(f"a {kind} name is a string, not {type(name).__name__}")
    reg = plugins.get(kind, name)
    if reg is not None:
        return reg
    if (kind, name) in plugins.clashes:
        raise clash_error(plugins.clashes[(kind, name)])
    subject = f"{kind} {name!r}" + (f" (in mode {mode!r})" if mode and mode != name else "")
    for off in plugins.disabled_registrations:
        if (off.kind, off.name) == (kind, name):
            raise UnknownModeError(
                f"{subject} is provided by {off.distribution}, but disabled by "
                f"{DISABLE_ENV}={registration_disabled(off)}"
            )
    distribution = FIRST_PARTY.get((kind, name))
    if distribution is not None:
        failed = [f for f in plugins.failures if normalize(f.distribution) == normalize(distribution)]
        if failed:
            error = PluginKitError if failed[0].wrong_kit else PluginLoadError
            raise error(
                f"{subject} comes from {_named(failed[0])}, which is installed but failed to load: {failed[0].error}"
            )
        if (
            any(
                normalize(s.distribution) == normalize(distribution) or normalize(s.name) == normalize(name)
                for s in plugins.disabled
            )
            or normalize(name) in disabled_names()
        ):
            raise UnknownModeError(f"{subject} is provided by {distribution}, which is disabled by {DISABLE_ENV}")
        if not autoload_enabled():
            raise PluginNotInstalledError(
                f"{subject} is provided by {distribution}, and installed plugins are not loaded because "
                f"{AUTOLOAD_ENV} is set; if it is not installed: pip install {distribution}"
            )
        raise PluginNotInstalledError(
            f"{subject} is provided by {distribution}, which is not installed: pip install {distribution}"
        )
    for source in plugins.disabled:
        if (kind, name) in provided_by(source):
            raise UnknownModeError(
                f"{subject} is provided by the plugin {source.name} ({source.distribution}), "
                f"which is disabled by {DISABLE_ENV}"
            )
    installed = plugins.names(kind)
    message = f"unknown {subject}. Installed {kind}s: {', '.join(installed) or 'none'}."
    suggestion = _closest(plugins, kind, name, mode)
    if suggestion:
        message += f" Did you mean {suggestion!r}?"
    if plugins.failures:
        broken = "; ".join(f"{_named(f)} ({f.error})" for f in plugins.failures)
        error = PluginKitError if any(f.wrong_kit for f in plugins.failures) else PluginLoadError
        raise error(f"{message} Plugins that failed to load, and may provide it: {broken}")
    raise UnknownModeError(message)


def _named(failure: PluginFailure) -> str:
    """A failed plugin's distribution, and its version where known."""
    return f"{failure.distribution} {failure.version}" if failure.version else failure.distribution


def _closest(plugins: PluginSet, kind: str, name: str, mode: str | None) -> str | None:
    """The nearest spelling of the part that is wrong; in a mode, the other part is kept as written
    (``keep_frist_offload_and_int8wo`` -> ``keep_first_offload_and_int8wo``, not some other mode)."""

    def known(k: str) -> list[str]:
        return sorted(
            set(plugins.names(k))
            | {n for kk, n in FIRST_PARTY if kk == k}
            | {n for kk, n in plugins.clashes if kk == k}
        )

    parsed = parse_mode(mode) if mode is not None and kind in ("placement", "quantizer") else None
    if parsed is not None and parsed.quantizer is None:
        # no separator: perhaps it is missing ("model_group_offload_qfloat8")
        pool = known("placement") + [f"{p}{SEPARATOR}{q}" for p in known("placement") for q in known("quantizer")]
        match = difflib.get_close_matches(mode, pool, n=1, cutoff=0.6)
        return match[0] if match else None
    match = difflib.get_close_matches(name, known(kind), n=1, cutoff=0.6)
    if not match:
        return None
    if parsed is None:
        return match[0]
    fixed = Mode(match[0], parsed.quantizer) if kind == "placement" else Mode(parsed.placement, match[0])
    return str(fixed)
