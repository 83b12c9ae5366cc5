"""What the engine executes of a plan: memmode's own working objects, not a user contract.

A :class:`~memmode_core.planning.prepared.Prepared` is what a user holds and reads (its groups, its
quantization outline, its sizes, ``describe()``); it carries an :class:`InternalPlan` as ``prepared.internal``
for the code that executes and prices it (``apply``, ``load``, the planner's pricing). This module, not a
leading underscore on each field, is what says "internal": nothing here is exported by ``memmode_core``, and
its shape may change in any release.

The plan is sealed: nothing writes into it after ``prepare``. What executing it does (layers packed into
streamed files, once for the ranks of a machine) is a value of its own
(:class:`~memmode_core.layer_packing.Packed`), kept by the handle. The groups' live bindings are the engine's
(``Runtime`` binds its own copies of the slots), so executing a plan leaves it as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memmode_core.contracts.group_specs import Policy
from memmode_core.contracts.targets import Target
from memmode_core.engine.groups import Group
from memmode_core.engine.placement_layout import Layout
from memmode_core.planning.request import Request
from memmode_core.planning.residency import Residency
from memmode_core.quantization import LayerSelection


@dataclass(frozen=True, eq=False)
class InternalPlan:
    """Everything ``execute`` and the planner's pricing need of one prepared mode, resolved once."""

    #: what was asked, resolved against the installed plugins
    request: Request
    #: what the placement places (the target without ``unplaced``), and the whole target
    target: Target
    whole: Target
    #: the placement's groups as core adjusted them, and the adjustments (``report().placement_notes``)
    layout: Layout
    #: the groups, their tensors claimed (each tensor in exactly one group)
    groups: tuple[Group, ...]
    #: component -> which layers quantizing it will pack and keep (the components the quantizer takes)
    selections: Mapping[str, LayerSelection]
    #: group key -> bytes of its tensors once quantized (what the device holds when it is resident)
    group_bytes: Mapping[str, int]
    #: whether the engine prefetches, and offloads what a pipeline call leaves on the device
    prefetch: bool
    offload_after_call: bool
    #: the option values the planner set for this candidate (``Placement.plan_variants``)
    variant: Mapping[str, Any]
    #: with a ``vram_budget``: the groups kept on the device while their component runs, and the prefetch
    #: depth (:mod:`memmode_core.planning.residency`)
    residency: Residency | None = None

    @property
    def stored_sizes(self) -> dict[str, int]:
        """Bytes of each group the storage will hold, once quantized."""
        return {g.key: self.group_bytes[g.key] for g in self.groups if g.policy is not Policy.RESIDENT}

    @property
    def lookahead(self) -> Mapping[str, int] | None:
        """Component -> how many groups ahead the engine prefetches (with a ``vram_budget``), else None."""
        return self.residency.lookahead if self.residency is not None else None
