"""A placement's layout for a target, as core adjusts it: the same for ``apply``, the planner and the engine.

A placement describes its groups (:meth:`Placement.layout`); core checks that the layout covers the
model (a plugin bug is caught at ``apply``) and honours what diffusers models and pipelines declare
about themselves, whatever the placement (see :func:`lay_out`).

It sits in the engine because the engine lays a component out again when its weights change (an adapter
injected, a parameter replaced: :class:`Relayout`), with the very rules ``prepare`` used; the planning layer
calls down to it, and the engine never has to call up to planning for it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from memmode_core.contracts.errors import IncompatibleModeError
from memmode_core.contracts.group_specs import GroupSpec, Policy, owns_tensors, whole_component
from memmode_core.contracts.options import Options
from memmode_core.contracts.placement import Placement
from memmode_core.contracts.targets import Target

logger = logging.getLogger("memmode")


@dataclass
class Layout:
    """A placement's groups for a target, as core adjusted them, and what was adjusted and why.

    ``notes``: component -> what core did differently from the placement's own layout, because the
    model or the pipeline declared it (see :func:`lay_out`); ``handle.report().placement_notes``.
    """

    specs: list[GroupSpec]
    notes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Relayout:
    """How the engine lays one component out again after its weights changed: the same placement, target,
    options and device as ``prepare`` used, and the groups a ``vram_budget`` keeps while their component
    runs (their keys are stable, so the same groups stay)."""

    placement: Placement
    target: Target
    options: Options
    device: torch.device
    strict: bool = False
    kept: frozenset[str] = frozenset()

    def __call__(self, component: str) -> list[GroupSpec]:
        layout = lay_out(self.placement, self.target, self.options, self.device, strict=self.strict)
        specs = [spec for spec in layout.specs if spec.component == component]
        keep_while_running(specs, self.kept)
        return specs


def keep_while_running(items: Iterable, kept: frozenset[str]) -> None:
    """Make the streamed groups (or specs) whose keys are in ``kept`` stay on the device while their component
    runs (``Policy.EXCLUSIVE``): what a ``vram_budget`` decided (:mod:`memmode_core.planning.residency`)."""
    for item in items:
        if item.key in kept and item.policy is Policy.STREAM:
            item.policy = Policy.EXCLUSIVE
            item.exits = []


def lay_out(
    placement: Placement, target: Target, options: Options, device: torch.device, *, strict: bool = False
) -> Layout:
    """The placement's groups for ``target``, after the checks and adjustments every placement gets from core.

    Used by ``apply``, by the rebuilds after a weight change and by the planner, so that what ``plan``
    predicts is what ``apply`` does. Two declarations of diffusers are honoured, whatever the placement:

    * a model class with ``_supports_group_offloading = False`` reads its submodules' weights outside their
      forwards (DiT, HunyuanDiT, VQ decoders, audio VAEs): a placement that would split it into groups
      moves it whole instead — one group, onloaded when it is called, offloaded after;
    * a pipeline's ``_exclude_from_cpu_offload`` names components its own code reads in ways no hook sees
      (a prior whose statistics post-process the latents, an image normalizer): they stay on the device,
      as diffusers' own offloading keeps them.

    Each adjustment is logged at INFO and noted in :attr:`Layout.notes`. ``strict=True`` refuses instead
    (``IncompatibleModeError``), before anything is touched.
    """
    placement.check(target, options, device)
    specs = placement.layout(target, options)
    refuse_malformed_layout(target, specs, placement.name)
    if strict:
        refuse_unsupported_splits(target, specs, placement.name)
        refuse_declared_exclusions(target, specs, placement.name)
        return Layout(specs)
    return _honour_declarations(target, specs, placement.name)


def _honour_declarations(target: Target, specs: list[GroupSpec], placement: str) -> Layout:
    notes: dict[str, str] = {}
    replaced: dict[str, GroupSpec] = {}
    for name in _declared_exclusions(target, specs):
        replaced[name] = whole_component(name, target.components[name], Policy.RESIDENT)
        notes[name] = (
            f"kept on the device: {target.label}._exclude_from_cpu_offload lists it (the pipeline reads it "
            f"outside its forward; diffusers' own offloading keeps it there too)"
        )
    for name in _unsplittable(target, specs):
        if name in replaced:
            continue
        module = target.components[name]
        replaced[name] = whole_component(name, module, Policy.STREAM)
        notes[name] = (
            f"moved whole: {type(module).__name__} declares _supports_group_offloading = False (it reads "
            f"its submodules' weights outside their forward), so {placement} onloads it as one group for "
            f"each call and offloads it after"
        )
    if not replaced:
        return Layout(specs)
    adjusted: list[GroupSpec] = []
    placed: set[str] = set()
    for spec in specs:
        if spec.component not in replaced:
            adjusted.append(spec)
        elif spec.component not in placed:  # once, in place of the component's first group
            placed.add(spec.component)
            adjusted.append(replaced[spec.component])
    for name, note in notes.items():
        logger.info("memmode: %s: %s", name, note)
    return Layout(adjusted, notes)


def _unsplittable(target: Target, specs: list[GroupSpec]) -> list[str]:
    """Components declaring ``_supports_group_offloading = False`` that ``specs`` split into groups."""
    names = []
    for name, module in target.components.items():
        if getattr(module, "_supports_group_offloading", True) is not False:
            continue
        own = [s for s in specs if s.component == name]
        if len(own) > 1 and any(s.policy is not Policy.RESIDENT for s in own):
            names.append(name)
    return names


def _declared_exclusions(target: Target, specs: list[GroupSpec]) -> list[str]:
    """Components the pipeline lists in ``_exclude_from_cpu_offload`` that ``specs`` do not keep resident."""
    if not target.is_pipeline:
        return []
    declared = getattr(type(target.obj), "_exclude_from_cpu_offload", None) or ()
    return [
        name
        for name in declared
        if name in target.components and any(s.policy is not Policy.RESIDENT for s in specs if s.component == name)
    ]


def refuse_declared_exclusions(target: Target, specs: list[GroupSpec], placement: str) -> None:
    """``strict=True``: a component the pipeline keeps out of offloading is not offloaded silently either."""
    for name in _declared_exclusions(target, specs):
        raise IncompatibleModeError(
            f"{placement} would offload {name!r}, which {target.label}._exclude_from_cpu_offload keeps on the device "
            f"(the pipeline reads it outside its forward). Without strict=True memmode keeps it there; or leave it "
            f"where it is with unplaced=[{name!r}]"
        )


def refuse_malformed_layout(target: Target, specs: list[GroupSpec], placement: str) -> None:
    """A layout must give every group its own key and put every module that holds tensors in a group:
    two groups under one key would overwrite each other's stored copy, and a module left out would
    stay wherever it is (on CUDA, a device mismatch at the first call). A plugin bug, caught at apply."""
    keys: dict[str, int] = {}
    for spec in specs:
        keys[spec.key] = keys.get(spec.key, 0) + 1
    repeated = sorted(key for key, count in keys.items() if count > 1)
    if repeated:
        raise IncompatibleModeError(
            f"placement {placement!r} laid out several groups under the key "
            f"{repeated[0]!r}; every group needs its own key (a placement bug)"
        )
    owners = {id(module) for spec in specs for module in spec.owners}
    for name, component in target.components.items():
        for path, module in component.named_modules():
            if id(module) not in owners and owns_tensors(module):
                raise IncompatibleModeError(
                    f"placement {placement!r} left {name}.{path or '<root>'} ({type(module).__name__}), which holds "
                    f"weights, out of every group; a layout must cover every module with parameters or buffers "
                    f"(a placement bug)"
                )


def refuse_unsupported_splits(target: Target, specs: list[GroupSpec], placement: str) -> None:
    """``strict=True``: diffusers marks models that read a submodule's weights outside that submodule's
    forward with ``_supports_group_offloading = False`` (DiT calls ``transformer_blocks[0].norm1.emb``
    from its own forward; VQModel reads ``embedding.weight`` directly). Split into groups, such a model
    would compute with a weight that is not on the device; without ``strict`` core moves it whole."""
    for name in _unsplittable(target, specs):
        module = target.components[name]
        raise IncompatibleModeError(
            f"{placement} cannot split component {name!r} ({type(module).__name__}) into groups: the model declares "
            f"_supports_group_offloading = False, because it reads weights of its submodules outside their "
            f"forward. Without strict=True memmode moves it whole; or use model_cpu_offload, or leave it where it "
            f"is with unplaced=[{name!r}]"
        )
