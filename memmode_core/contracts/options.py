"""Typed options: what a plugin accepts as keyword arguments of ``apply``, with checks.

A plugin declares its options as a small frozen dataclass, a subclass of :class:`Options` whose
fields are made with :func:`option` (default, help text, check)::

    @dataclass(frozen=True)
    class GroupOffloadOptions(Options):
        offload_type: str = option("block_level", "'block_level' or 'leaf_level'", one_of("block_level", "leaf_level"))

or, the older spelling that third-party plugins use, as a tuple of :class:`Option`, which is made into
such a dataclass (:func:`options_type`). ``prepare`` builds each plugin's instance once, from the
keywords of ``apply`` (:func:`resolve_options`), and the plugin receives that instance in every call:
attributes for code written against the dataclass, ``options["name"]`` for code written against a
mapping. An option nobody declares, or a value a declaration refuses, is an
:class:`~memmode_core.contracts.errors.InvalidOptionError` raised before the target is touched.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memmode_core.contracts.errors import InvalidOptionError
from memmode_core.contracts.units import finite_bytes, parse_byte_size


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
        return finite_bytes(value)
    if isinstance(value, str):
        return parse_byte_size(value)
    raise TypeError("must be a number of bytes or a string such as '8GiB'")


def reserve_size(value: Any) -> int | float | None:
    """What to keep free on a device for what memmode does not own: bytes (an int, ``"2GiB"``) or a share of the
    device's memory (a float between 0 and 1, or a string such as ``"10%"``); None keeps nothing back."""
    if isinstance(value, float) and 0 <= value < 1:
        return value
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1]) / 100
        except ValueError:
            raise ValueError(f"{value!r} is not a percentage such as '10%'") from None
        if not 0 <= share < 1:
            raise ValueError(f"{value!r} must be at least 0% and under 100%")
        return share
    return byte_size(value)


def option(default: Any, doc: str, check: Callable[[Any], Any] | None = None) -> Any:
    """A field of an :class:`Options` dataclass: its default, its help text and its check (see :class:`Option`)."""
    metadata = {"doc": doc, "check": check}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: copy.copy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


class Options(Mapping):
    """Base of a plugin's typed options: subclasses are frozen dataclasses whose fields are the keywords.

    An instance is built once per ``apply`` (by ``prepare``) and handed to the plugin. It reads as a
    dataclass (``options.offload_type``) and as a read-only mapping (``options["offload_type"]``), so
    a plugin written against either works.
    """

    @classmethod
    def declarations(cls) -> tuple[Option, ...]:
        """The fields as :class:`Option` declarations (what ``memmode list`` and the messages show)."""
        found = []
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            found.append(Option(f.name, default, f.metadata.get("doc", ""), f.metadata.get("check")))
        return tuple(found)

    @classmethod
    def build(cls, given: Mapping[str, Any]) -> Options:
        """An instance from ``given`` (names this class declares only), each value checked; defaults for the rest."""
        values = {o.name: o.validate(given[o.name]) for o in cls.declarations() if o.name in given}
        return cls(**values)

    def __getitem__(self, name: str) -> Any:
        if name not in self._field_names():
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._field_names())

    def __len__(self) -> int:
        return len(self._field_names())

    @classmethod
    def _field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True)
class NoOptions(Options):
    """The options of a plugin that declares none."""


#: tuple declarations made into dataclasses, by the identity of the tuple (kept alive here with its class)
_GENERATED: dict[int, tuple[tuple[Option, ...], type[Options]]] = {}


def options_type(declared: Any, owner: str = "plugin") -> type[Options]:
    """The :class:`Options` dataclass of a plugin's ``options`` declaration: a subclass as it is, a tuple
    of :class:`Option` made into a frozen dataclass (once per tuple)."""
    if isinstance(declared, type) and issubclass(declared, Options):
        return declared
    if not declared:
        return NoOptions
    declared = tuple(declared)
    known = _GENERATED.get(id(declared))
    if known is not None and known[0] is declared:
        return known[1]
    if not all(isinstance(o, Option) for o in declared):
        raise TypeError(f"{owner}: options must be an Options dataclass or a tuple of memmode_core.Option")
    fields = [(o.name, Any, option(o.default, o.doc, o.check)) for o in declared]
    name = "".join(part.capitalize() for part in owner.replace("-", "_").replace(" ", "_").split("_")) + "Options"
    cls = dataclasses.make_dataclass(name, fields, bases=(Options,), frozen=True)
    cls.__module__ = __name__
    _GENERATED[id(declared)] = (declared, cls)
    return cls


def declared_options(declared: Any) -> tuple[Option, ...]:
    """The :class:`Option` declarations of a plugin's ``options``, whichever way they are written."""
    return options_type(declared).declarations()


def resolve_options(owners: Sequence[tuple[str, Any]], given: Mapping[str, Any]) -> list[Options]:
    """One typed :class:`Options` per owner, from the keywords ``given``; refuse unknown and shared names.

    ``owners`` is ``[(label, declaration), ...]`` (the label, e.g. ``"placement model_group_offload"``,
    only names the owner in messages); the result is in the same order. Options are one flat namespace
    per mode (``apply(..., offload_type=..., keep_files=...)``), so two owners of one mode declaring the
    same name is an error naming both: a value meant for one must never silently reach the other.
    """
    types = [(owner, options_type(declared, owner)) for owner, declared in owners]
    declarers: dict[str, list[str]] = {}
    for owner, cls in types:
        for name in cls._field_names():
            declarers.setdefault(name, []).append(owner)
    shared = {name: who for name, who in declarers.items() if len(who) > 1}
    if shared:
        name, who = sorted(shared.items())[0]
        raise InvalidOptionError(
            f"option {name!r} is declared by both {' and '.join(who)}: options of one mode share one namespace, "
            f"so a value could not say whose it is. One of the plugins must rename it (e.g. prefix it with its name)"
        )
    unknown = sorted(set(given) - set(declarers))
    if unknown:
        accepted = ", ".join(sorted(declarers)) or "none"
        labels = ", ".join(owner for owner, _ in types)
        raise InvalidOptionError(
            f"unexpected option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for {labels}; "
            f"accepted options: {accepted}"
        )
    return [cls.build({k: v for k, v in given.items() if k in cls._field_names()}) for _, cls in types]
