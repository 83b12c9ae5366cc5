"""Declared options: what a plugin accepts as keyword arguments of ``apply``, with checks.

``apply(target, mode, **options)`` routes each option to the placement, storage or quantizer that
declares it. An option nobody declares, or a value a declaration refuses, is an
:class:`~memmode_core.contracts.errors.InvalidOptionError` raised before the target is touched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from memmode_core.contracts.errors import InvalidOptionError


@dataclass(frozen=True)
class Option:
    """One keyword a plugin accepts.

    ``check`` receives the value and returns the normalised value, or raises ``ValueError`` /
    ``TypeError`` with a message that completes the sentence "option <name> ...".
    """

    name: str
    default: Any
    doc: str
    check: Callable[[Any], Any] | None = None

    def validate(self, value: Any) -> Any:
        if self.check is None:
            return value
        try:
            return self.check(value)
        except (TypeError, ValueError) as exc:
            raise InvalidOptionError(f"option {self.name}={value!r}: {exc}") from None


def one_of(*choices: Any) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(repr(c) for c in choices)}")
        return value

    return check


def positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("must be a positive integer")
    return value


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError("must be True or False")
    return value


def boolean_or_none(value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise TypeError("must be True, False or None")
    return value


def names_list(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    values = tuple(value)
    if not all(isinstance(v, str) for v in values):
        raise TypeError("must be a string or a list of strings")
    return values


def byte_size(value: Any) -> int | None:
    """A size in bytes: an int, or a string such as ``"8GiB"``, ``"512 MB"``; None means no limit."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError("must be a number of bytes or a string such as '8GiB'")
    if isinstance(value, (int, float)):
        return _finite_bytes(value)
    if isinstance(value, str):
        return parse_byte_size(value)
    raise TypeError("must be a number of bytes or a string such as '8GiB'")


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_byte_size(text: str) -> int:
    """``"8GiB"`` -> 8589934592. Decimal units are powers of 1000, binary ones of 1024."""
    stripped = text.strip().lower().replace(" ", "")
    number = stripped.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = stripped[len(number) :]
    if unit not in _UNITS or not number:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. '8GiB', '512MB' or a number of bytes")
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. '8GiB'") from None
    return _finite_bytes(amount * _UNITS[unit])


def _finite_bytes(amount: float) -> int:
    if amount != amount or amount in (float("inf"), float("-inf")):  # NaN, or a string such as '1e400GB'
        raise ValueError("must be a finite number of bytes (None means no limit)")
    if amount < 0:
        raise ValueError("must not be negative")
    return int(amount)


def resolve_options(
    declared: Iterable[tuple[str, Iterable[Option]]], given: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """Route ``given`` keywords to the declaring owners; fill defaults; refuse unknown names.

    ``declared`` is ``[(owner_label, options), ...]``; the result maps each owner label to its
    complete option dict. Options are one flat namespace per mode (``apply(..., offload_type=...,
    keep_files=...)``), so two owners of one mode declaring the same name is an error naming both:
    a value meant for one must never silently reach the other.
    """
    declared = [(owner, {opt.name: opt for opt in options}) for owner, options in declared]
    declarers: dict[str, list[str]] = {}
    for owner, opts in declared:
        for name in opts:
            declarers.setdefault(name, []).append(owner)
    shared = {name: owners for name, owners in declarers.items() if len(owners) > 1}
    if shared:
        name, owners = sorted(shared.items())[0]
        raise InvalidOptionError(
            f"option {name!r} is declared by both {' and '.join(owners)}: options of one mode share one namespace, "
            f"so a value could not say whose it is. One of the plugins must rename it (e.g. prefix it with its name)"
        )
    known = set(declarers)
    unknown = sorted(set(given) - known)
    if unknown:
        accepted = ", ".join(sorted(known)) or "none"
        owners = ", ".join(owner for owner, _ in declared)
        raise InvalidOptionError(
            f"unexpected option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for {owners}; "
            f"accepted options: {accepted}"
        )
    resolved: dict[str, dict[str, Any]] = {}
    for owner, opts in declared:
        resolved[owner] = {
            name: opt.validate(given[name]) if name in given else opt.default for name, opt in opts.items()
        }
    return resolved
