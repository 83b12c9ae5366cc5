"""What was asked, resolved once: the :class:`Request` every public entry builds before it looks at the target.

``apply``, ``prepare`` and ``load`` take the same keyword arguments (:data:`REQUEST_ARGUMENTS`). Each lists
them in its own signature, where users read them, and hands each on by name to :meth:`Request.build` (whose
signature lists them too, so that a reader or a tool can follow every argument from the call). There the
mode's names are resolved against the installed plugins, every argument is checked and each plugin's typed
options are built, once, without looking at the target — ``load`` builds its request before the model exists.
The planner and the resolvers derive their candidates' requests from one (:meth:`Request.candidate`) instead of
resolving again.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from memmode_core.contracts.devices import resolve_device
from memmode_core.contracts.errors import InvalidOptionError
from memmode_core.contracts.options import Options, declared_options, reserve_size, resolve_options
from memmode_core.contracts.resolver import Resolver
from memmode_core.discovery.grammar import Mode, resolve
from memmode_core.discovery.plugins import current
from memmode_core.discovery.registrations import Registration
from memmode_core.planning.trace import ComponentTrace
from memmode_core.quantization import overrides

#: the keyword arguments ``apply``, ``prepare`` and ``load`` share, with their defaults (each entry's signature
#: and :meth:`Request.build` list them so, a test checks it)
REQUEST_ARGUMENTS: Mapping[str, Any] = {
    "device": None,
    "weight_dtype": None,
    "storage": None,
    "offload_dir": None,
    "components": None,
    "exclude": None,
    "unplaced": None,
    "strict": False,
    "reserve": None,
}

#: spellings of another library, or of an earlier memmode, for an argument memmode spells otherwise: refused
#: with the right one, since taken as a plugin option they would only be "unexpected"
RENAMED = {
    "exclude_components": (
        "unplaced",
        "exclude_components= is now unplaced=: the pipeline components the placement leaves where they are",
    ),
    "exclude_modules": (
        "unplaced",
        "exclude_modules= is diffusers' spelling; memmode's is unplaced=: the pipeline components the placement "
        "leaves where they are",
    ),
}

#: the placement name of a request that stands for every candidate (the planner's template)
CANDIDATES = "<candidates>"


@dataclass(frozen=True, eq=False)
class Request:
    """What was asked, resolved against the installed plugins and checked, before looking at the target."""

    mode: Mode
    #: the placement (or resolver); None in the template a resolver's candidates are made from
    placement: Registration | None
    quantizer: Registration | None
    storage: Registration | None
    device: torch.device
    weight_dtype: torch.dtype | None = None
    offload_dir: Any = None
    #: components the quantizer takes (None: the pipeline's denoisers), layer-name fragments it leaves alone
    components: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    #: components the placement leaves exactly where they are
    unplaced: tuple[str, ...] = ()
    strict: bool = False
    #: what to keep free on the device for what memmode does not own: bytes, or a share of its memory (a float)
    reserve: int | float | None = None
    placement_options: Options | None = None
    storage_options: Options | None = None
    quantizer_options: Options | None = None
    #: the storage the user named (None: the default, or every storage for a resolver)
    storage_given: str | None = None
    #: the option keywords as given (a resolver hands those of the chosen mode's plugins to its candidates)
    given: Mapping[str, Any] = field(default_factory=dict)
    #: the call traced at its shapes, when the planner has it: group offload spreads what it streams by the
    #: compute of each group (:func:`memmode_core.planning.residency.fit`)
    traces: Mapping[str, ComponentTrace] | None = None

    @property
    def resolver(self) -> Resolver | None:
        obj = self.placement.obj if self.placement is not None else None
        return obj if isinstance(obj, Resolver) else None

    @property
    def storage_name(self) -> str | None:
        return self.storage.name if self.storage is not None else None

    @property
    def packed_rest_on_host(self) -> bool:
        """Whether the packed layers rest in host memory: ``ram``, or a full load on the CPU."""
        return self.storage_name == "ram" or (self.storage is None and self.device.type == "cpu")

    @property
    def core_packs(self) -> bool:
        """Whether core's mechanics pack the layers: a packing quantizer without a ``quantize`` of its own."""
        quantizer = self.quantizer.obj if self.quantizer is not None else None
        return quantizer is not None and quantizer.packs and not overrides(quantizer, "quantize")

    @property
    def packs_once_per_machine(self) -> bool:
        """Whether the ranks of one machine pack the layers once between them and map one file
        (:mod:`memmode_core.files.made_once`): core packs them and they rest in host memory (other storages keep
        their own copy, shared or not)."""
        return self.core_packs and self.packed_rest_on_host

    @classmethod
    def build(
        cls,
        mode: str,
        *,
        device: Any = None,
        weight_dtype: torch.dtype | None = None,
        storage: str | None = None,
        offload_dir: Any = None,
        components: Iterable[str] | None = None,
        exclude: Iterable[str] | None = None,
        unplaced: Iterable[str] | None = None,
        strict: bool = False,
        reserve: Any = None,
        options: Mapping[str, Any] | None = None,
    ) -> Request:
        """The request of a call of a public entry, resolved and checked without looking at the target (see the
        module docstring): the entry hands on its ``mode``, the keywords of :data:`REQUEST_ARGUMENTS` by name, and
        its ``**options`` (the plugins' option keywords). Every mistake is a typed error here."""
        if not isinstance(mode, str):
            raise TypeError(f"mode must be a string such as 'model_cpu_offload_and_qfloat8', not {type(mode).__name__}")
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be True or False, not {type(strict).__name__}")
        given = dict(options or {})
        refuse_renamed(given)
        try:
            reserved = reserve_size(reserve)
        except (TypeError, ValueError) as exc:
            raise InvalidOptionError(f"reserve={reserve!r}: {exc}") from None
        resolved_device = resolve_device(device)
        if storage is not None and not isinstance(storage, str):
            raise TypeError(f"storage must be a storage name such as 'ram', not {type(storage).__name__}")
        if offload_dir is not None and not isinstance(offload_dir, (str, bytes, os.PathLike)):
            raise TypeError("offload_dir must be a path")
        resolved = resolve(
            mode, storage=storage, device=resolved_device, plugins=current(), storage_given=storage is not None
        )
        placement_options, storage_options, quantizer_options = typed_options(
            resolved.placement, resolved.storage, resolved.quantizer, given
        )
        request = cls(
            mode=resolved.mode,
            placement=resolved.placement,
            quantizer=resolved.quantizer,
            storage=resolved.storage,
            device=resolved_device,
            offload_dir=offload_dir,
            strict=strict,
            reserve=reserved,
            placement_options=placement_options,
            storage_options=storage_options,
            quantizer_options=quantizer_options,
            storage_given=storage,
            given=given,
            **what_is_touched(weight_dtype, components, exclude, unplaced),
        )
        request._refuse_arguments_the_mode_ignores()
        return request

    def _refuse_arguments_the_mode_ignores(self) -> None:
        """Arguments the mode has nothing to do with are refused, not ignored."""
        if self.quantizer is None and (self.components is not None or self.exclude):
            raise InvalidOptionError(
                f"components= and exclude= choose what a quantizer touches (which components, and layer names kept "
                f"at full precision), and mode {str(self.mode)!r} has no quantizer; to leave pipeline components "
                f"out of the placement, use unplaced=[...]"
            )
        if self.resolver is not None:
            if self.offload_dir is not None and self.storage_given is None:
                raise InvalidOptionError(
                    "with auto and offload_dir=, name the storage that writes there: storage='disk' or storage='mmap'"
                )
            return
        if self.offload_dir is not None and not getattr(self.storage and self.storage.obj, "uses_offload_dir", False):
            raise InvalidOptionError(
                f"offload_dir= is for storages that write files (disk, mmap); storage {self.storage_name!r} does "
                f"not use it"
            )

    @classmethod
    def template(
        cls,
        quantizer: Registration | None,
        *,
        device: torch.device,
        storage: str | None = None,
        given: Mapping[str, Any] | None = None,
        **touched: Any,
    ) -> Request:
        """The request every candidate of the planner is made from: no placement yet, ``quantizer``, and
        ``touched`` (``weight_dtype``, ``components``, ``exclude``, ``unplaced``) as ``plan`` was given them."""
        return cls(
            mode=Mode(CANDIDATES, quantizer.name if quantizer is not None else None),
            placement=None,
            quantizer=quantizer,
            storage=None,
            device=device,
            storage_given=storage,
            given=dict(given or {}),
            **what_is_touched(**touched),
        )

    def candidate(self, placement: Registration, storage: Registration | None, variant: Mapping[str, Any]) -> Request:
        """The request for one candidate of the planner or of a resolver: ``placement`` with ``storage``, this
        request's quantizer and arguments, and of the options given those each plugin declares (a placement's
        also ``variant``). An option no plugin of the candidate declares does not reach it."""
        given = {**self.given, **variant}
        placement_options, storage_options, quantizer_options = typed_options(
            placement, storage, self.quantizer, given, only_declared=True
        )
        return dataclasses.replace(
            self,
            mode=Mode(placement.name, self.mode.quantizer),
            placement=placement,
            storage=storage,
            placement_options=placement_options,
            storage_options=storage_options,
            quantizer_options=quantizer_options,
            given=given,
        )


def typed_options(
    placement: Registration,
    storage: Registration | None,
    quantizer: Registration | None,
    given: Mapping[str, Any],
    *,
    only_declared: bool = False,
) -> tuple[Options, Options | None, Options | None]:
    """Each plugin's typed options from the keywords ``given`` (None for a plugin the mode has not).
    ``only_declared``: leave out a keyword none of them declares (a candidate takes what applies to it)
    instead of refusing it."""
    plugins = [("placement", placement), ("storage", storage), ("quantizer", quantizer)]
    owners = [(f"{kind} {reg.name}", reg.obj.options) for kind, reg in plugins if reg is not None]
    if only_declared:
        declared = {o.name for _, declaration in owners for o in declared_options(declaration)}
        given = {k: v for k, v in given.items() if k in declared}
    typed = iter(resolve_options(owners, given))
    return tuple(next(typed) if reg is not None else None for _, reg in plugins)


def what_is_touched(
    weight_dtype: torch.dtype | None = None,
    components: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    unplaced: Iterable[str] | None = None,
) -> dict[str, Any]:
    """The request's fields that say what the mode touches and how, checked: the dtype quantized weights
    compute in, the components the quantizer takes and the layer-name fragments it keeps, the components the
    placement leaves alone."""
    if weight_dtype is not None and not (isinstance(weight_dtype, torch.dtype) and weight_dtype.is_floating_point):
        raise InvalidOptionError(f"weight_dtype={weight_dtype!r} must be a floating torch.dtype such as torch.bfloat16")
    return {
        "weight_dtype": weight_dtype,
        "components": names_of(components, "components"),
        "exclude": names_of(exclude, "exclude") or (),
        "unplaced": names_of(unplaced, "unplaced") or (),
    }


def refuse_renamed(given: Mapping[str, Any]) -> None:
    """Refuse a keyword of :data:`RENAMED` among options given, naming the spelling memmode uses."""
    for old, (new, why) in RENAMED.items():
        if old in given:
            raise InvalidOptionError(
                f"{why}: write {new}={given[old]!r}. (exclude= is not it either: that is the layer-name fragments "
                f"a quantizer keeps at full precision)"
            )


def names_of(value: Any, what: str) -> tuple[str, ...] | None:
    """A string or an iterable of strings as a tuple (None stays None); anything else is refused."""
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    try:
        values = tuple(value)
    except TypeError:
        raise InvalidOptionError(f"{what}= must be a string or a list of strings") from None
    if not all(isinstance(v, str) for v in values):
        raise InvalidOptionError(f"{what}= must be a string or a list of strings")
    return values
