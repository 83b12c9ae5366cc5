"""One plan, computed once: everything ``apply`` needs, resolved, checked and sized before anything moves.

``prepare(target, mode, **kw)`` (:mod:`memmode_core.planning.prepare`) turns a request into a
:class:`Prepared`, in two steps:

1. :func:`make_request` resolves the mode's names against the installed plugins, checks every argument
   and builds each plugin's typed options, without looking at the target (``load`` makes its request
   before it has built the model);
2. :func:`prepare_target` lays the target out (the placement's groups, as core adjusts them), claims
   the groups' tensors, plans the quantization of each component the quantizer takes, and sizes what
   the storage will hold.

A :class:`Prepared` is inspectable (``repr``, :meth:`Prepared.describe`) and is what every consumer
reuses instead of recomputing: ``apply`` executes one, the planner prices one per candidate, ``load``
streams its quantization into one, ``auto`` prepares candidates and executes the one it chose, and the
engine's rebuild after a weight change lays the same request out again (:meth:`Prepared.relayout`).
Nothing here touches the target: every refusal happens while the user still has everything.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memmode_core.contracts.devices import resolve_device
from memmode_core.contracts.errors import InvalidOptionError
from memmode_core.contracts.layout import GroupSpec, Policy
from memmode_core.contracts.options import Options, declared_options, resolve_options
from memmode_core.contracts.resolver import Resolver
from memmode_core.contracts.targets import Target, refuse_compiled, refuse_scripted
from memmode_core.contracts.units import format_bytes
from memmode_core.discovery.grammar import Mode, resolve
from memmode_core.discovery.plugins import current
from memmode_core.discovery.registrations import Registration
from memmode_core.engine.groups import Group, claim_groups
from memmode_core.engine.pipeline_hooks import refuse_foreign_offloading
from memmode_core.planning.layout import Layout, lay_out
from memmode_core.planning.residency import Residency, fit
from memmode_core.planning.timing import group_flops
from memmode_core.planning.trace import ComponentTrace
from memmode_core.quantization import (
    QuantizationPlan,
    check_component,
    check_weight_dtype,
    overrides,
    plan_quantization,
)

#: the placement name of a request that stands for every candidate (the planner's template)
CANDIDATES = "<candidates>"


# -- the request: names resolved, arguments checked, options typed ----------------------------------------


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
    #: components the quantizer takes (None: the pipeline's denoisers), name fragments it leaves alone
    components: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    #: components the placement leaves exactly where they are
    exclude_components: tuple[str, ...] = ()
    strict: bool = False
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


def make_request(
    mode: str,
    *,
    device: Any = None,
    weight_dtype: torch.dtype | None = None,
    storage: str | None = None,
    offload_dir: Any = None,
    components: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    exclude_components: Iterable[str] | None = None,
    strict: bool = False,
    options: Mapping[str, Any] | None = None,
) -> Request:
    """Resolve and check everything about a request that does not depend on the target (see the module
    docstring); every mistake is a typed error here."""
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a string such as 'model_cpu_offload_and_qfloat8', not {type(mode).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, not {type(strict).__name__}")
    dev = resolve_device(device)
    if weight_dtype is not None and not (isinstance(weight_dtype, torch.dtype) and weight_dtype.is_floating_point):
        raise InvalidOptionError(f"weight_dtype={weight_dtype!r} must be a floating torch.dtype such as torch.bfloat16")
    if storage is not None and not isinstance(storage, str):
        raise TypeError(f"storage must be a storage name such as 'ram', not {type(storage).__name__}")
    if offload_dir is not None and not isinstance(offload_dir, (str, bytes, os.PathLike)):
        raise TypeError("offload_dir must be a path")
    given = dict(options or {})
    resolved = resolve(mode, storage=storage, device=dev, plugins=current(), storage_given=storage is not None)
    placement_options, storage_options, quantizer_options = typed_options(
        resolved.placement, resolved.storage, resolved.quantizer, given
    )
    request = Request(
        mode=resolved.mode,
        placement=resolved.placement,
        quantizer=resolved.quantizer,
        storage=resolved.storage,
        device=dev,
        weight_dtype=weight_dtype,
        offload_dir=offload_dir,
        components=_names(components, "components"),
        exclude=_names(exclude, "exclude") or (),
        exclude_components=_names(exclude_components, "exclude_components") or (),
        strict=strict,
        placement_options=placement_options,
        storage_options=storage_options,
        quantizer_options=quantizer_options,
        storage_given=storage,
        given=given,
    )
    if request.quantizer is None and (request.components is not None or request.exclude):
        raise InvalidOptionError(
            f"components= and exclude= choose what a quantizer touches, and mode {mode!r} has no quantizer"
        )
    if request.resolver is not None:
        if offload_dir is not None and storage is None:
            raise InvalidOptionError(
                "with auto and offload_dir=, name the storage that writes there: storage='disk' or storage='mmap'"
            )
        return request
    if offload_dir is not None and not getattr(request.storage and request.storage.obj, "uses_offload_dir", False):
        raise InvalidOptionError(
            f"offload_dir= is for storages that write files (disk, mmap); storage "
            f"{request.storage.name if request.storage else None!r} does not use it"
        )
    return request


def candidate_request(
    base: Request, placement: Registration, storage: Registration | None, variant: Mapping[str, Any]
) -> Request:
    """The request for one candidate of the planner or of a resolver: ``placement`` with ``storage``, the
    quantizer and arguments of ``base``, and of the options given those each plugin declares (a
    placement's also ``variant``). An option no plugin of the candidate declares does not reach it."""
    given = {**base.given, **variant}
    placement_options, storage_options, quantizer_options = typed_options(
        placement, storage, base.quantizer, given, only_declared=True
    )
    mode = Mode(placement.name, base.mode.quantizer)
    return dataclasses.replace(
        base,
        mode=mode,
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


def _names(value: Any, what: str) -> tuple[str, ...] | None:
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


# -- the prepared plan ------------------------------------------------------------------------------------


@dataclass(eq=False)
class Prepared:
    """Everything ``apply`` will do to one target, computed once (see the module docstring)."""

    request: Request
    #: what the placement places (the target without ``exclude_components``), and the whole target
    target: Target
    whole: Target
    #: the placement's groups as core adjusted them, and the adjustments (``report().placement_notes``)
    layout: Layout
    #: the groups, their tensors claimed (each tensor in exactly one group)
    groups: list[Group]
    #: component -> what quantizing it will pack and keep (the components the quantizer takes)
    quantization: dict[str, QuantizationPlan]
    #: group key -> bytes of its tensors once quantized (what the device holds when it is resident)
    group_bytes: dict[str, int]
    #: whether the engine prefetches, and offloads what a pipeline call leaves on the device
    prefetch: bool
    offload_after_call: bool
    #: what was asked for: differs from ``mode`` when a resolver (``auto``) chose
    requested_mode: str = ""
    #: the planner's entry a resolver chose, else None
    choice: Any = None
    #: component -> (layers packed, bytes before) by a quantization done before executing (``load`` packs
    #: while it streams the checkpoint, as planned here): executing only installs their forward
    packed_ahead: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: the option values the planner set for this candidate (``Placement.plan_variants``)
    variant: dict[str, Any] = field(default_factory=dict)
    #: with a ``vram_budget``: the groups kept on the device while their component runs, and the prefetch
    #: depth (:mod:`memmode_core.planning.residency`)
    residency: Residency | None = None

    def __post_init__(self) -> None:
        if not self.requested_mode:
            self.requested_mode = self.mode

    # -- what it is ----------------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        return str(self.request.mode)

    @property
    def device(self) -> torch.device:
        return self.request.device

    @property
    def placement(self) -> Any:
        return self.request.placement.obj

    @property
    def quantizer(self) -> Any:
        return self.request.quantizer.obj if self.request.quantizer is not None else None

    @property
    def storage(self) -> Any:
        return self.request.storage.obj if self.request.storage is not None else None

    @property
    def stored_sizes(self) -> dict[str, int]:
        """Bytes of each group the storage will hold, once quantized: what ``apply`` reserves before it
        quantizes, so that a storage without room refuses while nothing has been touched."""
        return {g.key: self.group_bytes[g.key] for g in self.groups if g.policy is not Policy.RESIDENT}

    # -- consumers ----------------------------------------------------------------------------------

    def open_session(self):
        """A storage session for executing this plan (None when the placement offloads nothing)."""
        storage = self.storage
        if storage is None:
            return None
        return storage.open(
            device=self.device, offload_dir=self.request.offload_dir, options=self.request.storage_options
        )

    def relayout(self, component: str) -> list[GroupSpec]:
        """``component``'s groups laid out again from the same request: the engine rebuilds a component
        whose weights changed (an adapter injected, a parameter replaced) with them."""
        layout = lay_out(
            self.placement, self.target, self.request.placement_options, self.device, strict=self.request.strict
        )
        specs = [spec for spec in layout.specs if spec.component == component]
        if self.residency is not None:  # the same groups stay (their keys are stable)
            self.residency.apply(specs)
        return specs

    def refreshed(self) -> Prepared:
        """The same request prepared again for the target as it is now (its weights changed since)."""
        return prepare_target(self.whole.obj, self.request, requested_mode=self.requested_mode, quantize=False)

    def with_storage(self, storage: Registration, options: Options) -> Prepared:
        """The same plan with another storage (the planner prices one layout with every storage)."""
        request = dataclasses.replace(self.request, storage=storage, storage_options=options)
        return dataclasses.replace(self, request=request, packed_ahead=dict(self.packed_ahead))

    # -- inspection -------------------------------------------------------------------------------------

    def describe(self) -> str:
        """What executing this plan will do, in a few lines."""
        request = self.request
        lines = [f"{self.mode} for {self.target.label} on {self.device}" + _chosen(self)]
        lines.append(f"  placement {self.placement.name}{_options_text(request.placement_options)}")
        if self.residency is not None:
            lines.append(f"  {self.residency.describe()}")
        if self.storage is not None:
            where = f", offload_dir={str(request.offload_dir)!r}" if request.offload_dir is not None else ""
            lines.append(f"  storage {self.storage.name}{_options_text(request.storage_options)}{where}")
        if self.quantizer is not None:
            dtype = str(request.weight_dtype).replace("torch.", "") if request.weight_dtype else "each layer's dtype"
            lines.append(
                f"  quantizer {self.quantizer.name}{_options_text(request.quantizer_options)}, computing in {dtype}"
            )
            for name, plan in self.quantization.items():
                lines.append(
                    f"    {name}: {len(plan.to_pack)} layers to pack, {len(plan.packed)} packed already, "
                    f"{len(plan.kept)} kept at full precision"
                )
        for name in self.target.components:
            mine = [g for g in self.groups if g.component == name]
            counts = {policy: sum(g.policy is policy for g in mine) for policy in Policy}
            kinds = ", ".join(f"{n} {_POLICY_WORDS[policy]}" for policy, n in counts.items() if n)
            resident = sum(self.group_bytes[g.key] for g in mine if g.policy is Policy.RESIDENT)
            stored = sum(self.group_bytes[g.key] for g in mine if g.policy is not Policy.RESIDENT)
            held = [f"{format_bytes(resident)} resident"] if resident else []
            held += [f"{format_bytes(stored)} stored"] if stored else []
            lines.append(f"  {name}: {len(mine)} group{'s' if len(mine) != 1 else ''} ({kinds}), {', '.join(held)}")
        for name in self.whole.components:
            if name not in self.target.components:
                lines.append(f"  {name}: left where it is (exclude_components)")
        for name, note in self.layout.notes.items():
            lines.append(f"  note: {name} {note}")
        if self.choice is not None:
            entry = self.choice
            lines.append(
                f"  predicted: {format_bytes(entry.peak_device_bytes)} peak on the device, "
                f"{format_bytes(entry.transfer_bytes_per_call)} moved per call, "
                f"{entry.seconds_per_call:.3g} s per call moving weights"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        stored = sum(self.stored_sizes.values())
        return (
            f"<memmode.Prepared {self.mode} storage={self.storage.name if self.storage else None} "
            f"device={self.device} groups={len(self.groups)} stored={format_bytes(stored)}"
            f"{' quantizes ' + ','.join(self.quantization) if self.quantization else ''}>"
        )


_POLICY_WORDS = {Policy.RESIDENT: "resident", Policy.STREAM: "streamed", Policy.EXCLUSIVE: "kept while it runs"}


def _options_text(options: Options | None) -> str:
    if not options:
        return ""
    return " (" + ", ".join(f"{k}={v!r}" for k, v in options.items()) + ")"


def _chosen(prepared: Prepared) -> str:
    if prepared.requested_mode == prepared.mode:
        return ""
    return f", chosen by {prepared.requested_mode}"


# -- preparing a target -------------------------------------------------------------------------------------


def prepare_target(
    target: Any,
    request: Request,
    *,
    quantization: Mapping[str, QuantizationPlan] | None = None,
    requested_mode: str = "",
    quantize: bool = True,
    variant: Mapping[str, Any] | None = None,
) -> Prepared:
    """Lay ``target`` out for ``request``, claim its groups, plan its quantization and size it; see the module
    docstring. ``quantization``: plans made already for these components (the planner shares them between
    candidates). ``quantize=False``: the weights are quantized already (a mode put back), size them as they are."""
    whole = Target.of(target)
    tgt = whole.without(request.exclude_components)
    refuse_scripted(tgt.components)
    refuse_foreign_offloading(tgt.components)
    placement, quantizer = request.placement.obj, request.quantizer.obj if request.quantizer else None
    plans: dict[str, QuantizationPlan] = {}
    if quantizer is not None and quantize:
        targets = quantize_targets(whole, tgt, request)
        plans = dict(quantization) if quantization is not None else plan_components(quantizer, targets, request)
    layout = lay_out(placement, tgt, request.placement_options, request.device, strict=request.strict)
    groups = claim_groups(tgt.components, layout.specs)
    sizes = group_bytes(groups, plans)
    prefetch = placement.prefetch(request.placement_options, request.device)
    residency = None
    budget = getattr(request.placement_options, "vram_budget", None)
    if budget is not None:
        compute = group_flops(groups, tgt.components, request.traces) if request.traces else None
        residency = fit(groups, sizes, tgt.components, budget, prefetch=prefetch, compute=compute)
        residency.apply(groups)
    return Prepared(
        request=request,
        target=tgt,
        whole=whole,
        layout=layout,
        groups=groups,
        quantization=plans,
        group_bytes=sizes,
        prefetch=prefetch,
        offload_after_call=placement.offloads_after_call(request.placement_options),
        requested_mode=requested_mode,
        variant=dict(variant or {}),
        residency=residency,
    )


def quantize_targets(whole: Target, placed: Target, request: Request) -> dict[str, nn.Module]:
    """The components the quantizer takes: those named (a component left out of the placement is still
    quantized when it is named), else the placed pipeline's denoisers; refused when there is none, or
    when one is compiled."""
    names = request.components
    targets = (whole if names is not None else placed).select(names)
    if not targets:
        raise InvalidOptionError(
            f"{placed.label} has no denoiser to quantize (no component's forward takes a timestep); "
            f"name the components with components=[...] (it has {', '.join(placed.components)})"
        )
    refuse_compiled(targets, f"quantize with {request.quantizer.name}")
    return targets


def plan_components(quantizer: Any, targets: Mapping[str, nn.Module], request: Request) -> dict[str, QuantizationPlan]:
    """Check that each component can be quantized and plan it: once per component (the plan says which
    layers are packed and what they will weigh; quantizing follows it). A quantizer with its own ``check``
    checks instead of core's refusals; the plan still sizes what it will store."""
    options = request.quantizer_options
    if overrides(quantizer, "check"):
        quantizer.check(targets, weight_dtype=request.weight_dtype, exclude=request.exclude, options=options)
        return {
            name: plan_quantization(quantizer, module, exclude=request.exclude, options=options)
            for name, module in targets.items()
        }
    check_weight_dtype(request.weight_dtype)
    return {
        name: check_component(quantizer, name, module, exclude=request.exclude, options=options)
        for name, module in targets.items()
    }


def group_bytes(groups: list[Group], plans: Mapping[str, QuantizationPlan]) -> dict[str, int]:
    """Bytes of each group once its component is quantized (its own bytes when it is not)."""
    sizes = {}
    for group in groups:
        plan = plans.get(group.component)
        if plan is None:
            sizes[group.key] = group.nbytes
        else:
            owners = {id(slot.owner): slot.owner for slot in group.slots}
            sizes[group.key] = sum(plan.direct_bytes(m) for m in owners.values())
    return sizes
