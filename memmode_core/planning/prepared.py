"""One plan, computed once: everything ``apply`` needs, resolved, checked and sized before anything moves.

:func:`prepare_target` turns a :class:`~memmode_core.planning.request.Request` for a concrete mode into a
:class:`Prepared`: it lays the target out (the placement's groups, as core adjusts them), claims the groups'
tensors, decides which layers of each component the quantizer packs, and sizes what the storage will hold.
Nothing here touches the target: every refusal happens while the user still has everything.

A :class:`Prepared` is what every consumer reuses instead of recomputing: ``apply`` executes one, the planner
prices one per candidate, ``load`` executes one while its checkpoint is read, ``auto`` prepares candidates and
executes the one it chose. It is sealed (a frozen dataclass): nothing writes into it after ``prepare``, and what
executing it did is a value of its own (the handle; :class:`~memmode_core.layer_packing.Packed` for the layers
streamed).
What a user reads of it is plain (:attr:`Prepared.groups` as :class:`PreparedGroup` descriptions,
:attr:`Prepared.quantization` as :class:`QuantizationOutline`, sizes, names, :meth:`Prepared.describe`); the
engine's objects are in :attr:`Prepared.internal` (:mod:`memmode_core.planning.internal_plan`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn

from memmode_core.contracts.errors import InvalidOptionError
from memmode_core.contracts.group_specs import Policy
from memmode_core.contracts.options import Options
from memmode_core.contracts.targets import Target, refuse_compiled, refuse_scripted
from memmode_core.contracts.units import format_bytes
from memmode_core.discovery.registrations import Registration
from memmode_core.engine.groups import Group, claim_groups
from memmode_core.engine.pipeline_hooks import refuse_foreign_offloading
from memmode_core.engine.placement_layout import lay_out
from memmode_core.planning.internal_plan import InternalPlan
from memmode_core.planning.request import Request
from memmode_core.planning.residency import fit
from memmode_core.planning.timing import group_flops
from memmode_core.quantization import (
    LayerSelection,
    check_component,
    check_weight_dtype,
    component_bytes,
    overrides,
    select_layers,
)


@dataclass(frozen=True)
class PreparedGroup:
    """One group of a prepared plan, as a user reads it: the tensors that move together."""

    #: the group's stable name (``"transformer/blocks.3"``): the storage keeps it under this key
    key: str
    component: str
    #: when it is on the device: ``Policy.RESIDENT``, ``STREAM`` or ``EXCLUSIVE``
    policy: Policy
    #: bytes of its tensors once quantized: what the device holds while it is onloaded
    nbytes: int
    #: how many tensors it holds (a tied tensor once)
    tensors: int

    @property
    def stored(self) -> bool:
        """Whether the storage holds it while it is offloaded (every group but the resident ones)."""
        return self.policy is not Policy.RESIDENT


@dataclass(frozen=True)
class QuantizationOutline:
    """What quantizing one component will do, decided without touching it."""

    #: layer paths to pack, packed already, and kept at full precision (with why)
    to_pack: tuple[str, ...]
    packed: tuple[str, ...]
    kept: Mapping[str, str]
    #: bytes of the component's tensors before, and once quantized
    bytes_before: int
    bytes_after: int


@dataclass(frozen=True, eq=False)
class Prepared:
    """Everything ``apply`` will do to one target, computed once and sealed (see the module docstring).

    What a user reads is its properties; :attr:`internal` is what the engine and the planner's pricing work
    from (:mod:`memmode_core.planning.internal_plan`: no compatibility promise)."""

    #: the engine's working objects: request, targets, layout, claimed groups, selections, sizes
    internal: InternalPlan
    #: what was asked for: differs from ``mode`` when a resolver (``auto``) chose
    requested_mode: str
    #: the planner's entry a resolver chose (a ``PlanEntry``), else None
    choice: Any = None

    # -- what it is ----------------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        return str(self.internal.request.mode)

    @property
    def device(self) -> torch.device:
        return self.internal.request.device

    @property
    def placement(self) -> str:
        return self.internal.request.placement.name

    @property
    def quantizer(self) -> str | None:
        return self.internal.request.quantizer.name if self.internal.request.quantizer is not None else None

    @property
    def storage(self) -> str | None:
        return self.internal.request.storage_name

    @property
    def options(self) -> dict[str, Options | None]:
        """Each plugin's typed options, as built from the keywords given (``"placement"``, ``"storage"``,
        ``"quantizer"``; None for a plugin the mode has not)."""
        request = self.internal.request
        return {
            "placement": request.placement_options,
            "storage": request.storage_options,
            "quantizer": request.quantizer_options,
        }

    @property
    def components(self) -> tuple[str, ...]:
        """The components the placement places."""
        return tuple(self.internal.target.components)

    @property
    def unplaced(self) -> tuple[str, ...]:
        """The components it leaves exactly where they are (``unplaced=``)."""
        return tuple(name for name in self.internal.whole.components if name not in self.internal.target.components)

    @cached_property
    def groups(self) -> tuple[PreparedGroup, ...]:
        return tuple(
            PreparedGroup(g.key, g.component, g.policy, self.internal.group_bytes[g.key], len(g.slots))
            for g in self.internal.groups
        )

    @cached_property
    def quantization(self) -> dict[str, QuantizationOutline]:
        """Component -> what quantizing it will do (the components the quantizer takes)."""
        return {
            name: QuantizationOutline(
                to_pack=tuple(layer.path for layer in selection.to_pack),
                packed=tuple(layer.path for layer in selection.packed),
                kept={layer.path: layer.reason or "" for layer in selection.kept},
                bytes_before=component_bytes(selection.component),
                bytes_after=selection.total_bytes(),
            )
            for name, selection in self.internal.selections.items()
        }

    @property
    def stored_sizes(self) -> dict[str, int]:
        """Bytes of each group the storage will hold, once quantized: what ``apply`` reserves before it
        quantizes, so that a storage without room refuses while nothing has been touched."""
        return self.internal.stored_sizes

    @property
    def notes(self) -> dict[str, str]:
        """Component -> what core placed differently from the placement's layout, and why."""
        return dict(self.internal.layout.notes)

    # -- inspection -------------------------------------------------------------------------------------

    def describe(self) -> str:
        """What executing this plan will do, in a few lines."""
        request = self.internal.request
        lines = [f"{self.mode} for {self.internal.target.label} on {self.device}" + _chosen(self)]
        lines.append(f"  placement {self.placement}{_options_text(request.placement_options)}")
        if self.internal.residency is not None:
            lines.append(f"  {self.internal.residency.describe()}")
        if self.storage is not None:
            where = f", offload_dir={str(request.offload_dir)!r}" if request.offload_dir is not None else ""
            lines.append(f"  storage {self.storage}{_options_text(request.storage_options)}{where}")
        if self.quantizer is not None:
            dtype = str(request.weight_dtype).replace("torch.", "") if request.weight_dtype else "each layer's dtype"
            lines.append(
                f"  quantizer {self.quantizer}{_options_text(request.quantizer_options)}, computing in {dtype}"
            )
            for name, outline in self.quantization.items():
                lines.append(
                    f"    {name}: {len(outline.to_pack)} layers to pack, {len(outline.packed)} packed already, "
                    f"{len(outline.kept)} kept at full precision"
                )
        for name in self.components:
            mine = [g for g in self.groups if g.component == name]
            counts = {policy: sum(g.policy is policy for g in mine) for policy in Policy}
            kinds = ", ".join(f"{n} {_POLICY_WORDS[policy]}" for policy, n in counts.items() if n)
            resident = sum(g.nbytes for g in mine if not g.stored)
            stored = sum(g.nbytes for g in mine if g.stored)
            held = [f"{format_bytes(resident)} resident"] if resident else []
            held += [f"{format_bytes(stored)} stored"] if stored else []
            lines.append(f"  {name}: {len(mine)} group{'s' if len(mine) != 1 else ''} ({kinds}), {', '.join(held)}")
        for name in self.unplaced:
            lines.append(f"  {name}: left where it is (unplaced)")
        for name, note in self.notes.items():
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
        quantizes = ",".join(self.internal.selections)
        return (
            f"<memmode.Prepared {self.mode} storage={self.storage} device={self.device} "
            f"groups={len(self.internal.groups)} stored={format_bytes(stored)}"
            f"{' quantizes ' + quantizes if quantizes else ''}>"
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
    selections: Mapping[str, LayerSelection] | None = None,
    requested_mode: str = "",
    quantize: bool = True,
    variant: Mapping[str, Any] | None = None,
) -> Prepared:
    """Lay ``target`` out for ``request`` (a concrete mode), claim its groups, decide its quantization and size
    it; see the module docstring. ``selections``: decided already for these components (the planner shares
    them between candidates). ``quantize=False``: the weights are quantized already (a mode put back), size
    them as they are."""
    whole = Target.of(target)
    tgt = whole.without(request.unplaced)
    refuse_scripted(tgt.components)
    refuse_foreign_offloading(tgt.components)
    placement, quantizer = request.placement.obj, request.quantizer.obj if request.quantizer else None
    chosen: dict[str, LayerSelection] = {}
    if quantizer is not None and quantize:
        targets = quantize_targets(whole, tgt, request)
        chosen = dict(selections) if selections is not None else select_components(quantizer, targets, request)
    layout = lay_out(placement, tgt, request.placement_options, request.device, strict=request.strict)
    groups = claim_groups(tgt.components, layout.specs)
    sizes = group_bytes(groups, chosen)
    prefetch = placement.prefetch(request.placement_options, request.device)
    residency = None
    budget = getattr(request.placement_options, "vram_budget", None)
    if budget is not None:
        compute = group_flops(groups, tgt.components, request.traces) if request.traces else None
        residency = fit(groups, sizes, tgt.components, budget, prefetch=prefetch, compute=compute)
        residency.apply(groups)
    internal = InternalPlan(
        request=request,
        target=tgt,
        whole=whole,
        layout=layout,
        groups=tuple(groups),
        selections=chosen,
        group_bytes=sizes,
        prefetch=prefetch,
        offload_after_call=placement.offloads_after_call(request.placement_options),
        variant=dict(variant or {}),
        residency=residency,
    )
    return Prepared(internal, requested_mode=requested_mode or str(request.mode))


def prepare_again(prepared: Prepared) -> Prepared:
    """The same request prepared again for the target as it is now (its weights changed, or were quantized,
    since): what a refused re-apply puts back."""
    internal = prepared.internal
    return prepare_target(internal.whole.obj, internal.request, requested_mode=prepared.requested_mode, quantize=False)


def with_storage(prepared: Prepared, storage: Registration, options: Options) -> Prepared:
    """The same plan with another storage (the planner prices one layout with every storage)."""
    request = dataclasses.replace(prepared.internal.request, storage=storage, storage_options=options)
    return dataclasses.replace(prepared, internal=dataclasses.replace(prepared.internal, request=request))


def quantize_targets(whole: Target, placed: Target, request: Request) -> dict[str, nn.Module]:
    """The components the quantizer takes: those named (a component left out of the placement is still
    quantized when it is named), else the placed pipeline's denoisers; refused when there is none, when one is
    compiled, or when ``exclude=`` names a component (it takes layer names: a component is left out of the
    placement with ``unplaced=``, out of the quantization by not naming it in ``components=``)."""
    names = request.components
    targets = (whole if names is not None else placed).select(names)
    if not targets:
        raise InvalidOptionError(
            f"{placed.label} has no denoiser to quantize (no component's forward takes a timestep); "
            f"name the components with components=[...] (it has {', '.join(placed.components)})"
        )
    components = [fragment for fragment in request.exclude if fragment in whole.components]
    if components and whole.is_pipeline:
        raise InvalidOptionError(
            f"exclude={list(request.exclude)!r} names the component {components[0]!r} of {whole.label}: exclude= "
            f"takes fragments of layer names inside the quantized components ({', '.join(targets)}), which the "
            f"quantizer keeps at full precision. To leave a component out of the placement, use "
            f"unplaced=[{components[0]!r}]; to quantize only some components, name them with components=[...]"
        )
    refuse_compiled(targets, f"quantize with {request.quantizer.name}")
    return targets


def select_components(quantizer: Any, targets: Mapping[str, nn.Module], request: Request) -> dict[str, LayerSelection]:
    """Check that each component can be quantized and decide which of its layers are packed: once per
    component (the selection says which layers are packed and what they will weigh; quantizing follows it).
    A quantizer with its own ``check`` checks instead of core's refusals; the selection still sizes what it
    will store."""
    options = request.quantizer_options
    if overrides(quantizer, "check"):
        quantizer.check(targets, weight_dtype=request.weight_dtype, exclude=request.exclude, options=options)
        return {
            name: select_layers(quantizer, module, exclude=request.exclude, options=options)
            for name, module in targets.items()
        }
    check_weight_dtype(request.weight_dtype)
    return {
        name: check_component(quantizer, name, module, exclude=request.exclude, options=options)
        for name, module in targets.items()
    }


def group_bytes(groups: list[Group], selections: Mapping[str, LayerSelection]) -> dict[str, int]:
    """Bytes of each group once its component is quantized (its own bytes when it is not)."""
    sizes = {}
    for group in groups:
        selection = selections.get(group.component)
        if selection is None:
            sizes[group.key] = group.nbytes
        else:
            owners = {id(slot.owner): slot.owner for slot in group.slots}
            sizes[group.key] = sum(selection.direct_bytes(m) for m in owners.values())
    return sizes
