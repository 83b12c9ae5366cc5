"""One steady-state call replayed through the engine's policies: what is on the device when, and what moves.

The planner does not run the model: it plays the component calls of a call (:mod:`.calls`) over a prepared
plan's groups with the rules the engine follows — which groups are onloaded when, what stays, what is
prefetched — and counts the peak of weight bytes on the device, the bytes moved and the onloads: the
quantities the ledger of a real call reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from memmode_core.contracts.group_specs import Policy
from memmode_core.engine.groups import Group
from memmode_core.planning.residency import encloses, idle_groups


@dataclass
class SizedGroup:
    """A prepared group with its bytes once quantized, and whether a default call leaves it idle."""

    group: Group
    nbytes: int
    idle: bool


def sized_groups(
    groups: list[Group], group_bytes: Mapping[str, int], roots: Mapping[str, nn.Module]
) -> list[SizedGroup]:
    """The groups with their sizes, and whether a default call leaves them idle (:func:`idle_groups`)."""
    idle = idle_groups(groups, roots)
    return [SizedGroup(group, group_bytes[group.key], id(group) in idle) for group in groups]


@dataclass
class Replayed:
    """The device's weight bytes over a replayed call: resident now, at peak, moved, and the onloads."""

    resident: dict[int, int] = field(default_factory=dict)  # id(group) -> bytes
    owner: dict[int, str] = field(default_factory=dict)
    peak: int = 0
    moved: int = 0
    onloads: int = 0

    def onload(self, sized: SizedGroup) -> None:
        key = id(sized.group)
        if key in self.resident:
            return
        self.resident[key] = sized.nbytes
        self.owner[key] = sized.group.component
        self.moved += sized.nbytes
        self.onloads += 1
        self.peak = max(self.peak, sum(self.resident.values()))

    def offload(self, sized: SizedGroup) -> None:
        self.resident.pop(id(sized.group), None)

    def evict_others(self, component: str, sized_groups: list[SizedGroup]) -> None:
        for s in sized_groups:
            if s.group.policy is not Policy.RESIDENT and self.owner.get(id(s.group)) not in (None, component):
                self.offload(s)


def replay(
    sized: list[SizedGroup],
    sequence: list[str],
    prefetch: bool,
    roots: Mapping[str, nn.Module],
    lookahead: Mapping[str, int] | None = None,
) -> Replayed:
    """The engine's policies over one steady-state call (the second of two identical calls).

    Within a component call, the groups entered at the component itself (its rest groups, the
    component's own loose parameters at leaf level) stay resident for the whole call; the others are
    entered one after the other in definition order, each with its ``lookahead`` successors (default
    one) when prefetching; groups kept while their component runs (``EXCLUSIVE``) stay until another
    component takes the device.
    """
    lookahead = lookahead or {}
    state = Replayed()
    for s in sized:
        if s.group.policy is Policy.RESIDENT:
            state.onload(s)
    kinds: dict[str, tuple[list[SizedGroup], list[SizedGroup], list[SizedGroup]]] = {}
    for name in set(sequence):
        mine = [s for s in sized if s.group.component == name and not s.idle]
        exclusive = [s for s in mine if s.group.policy is Policy.EXCLUSIVE]
        streaming = [s for s in mine if s.group.policy is Policy.STREAM]
        enclosing = [s for s in streaming if encloses(s.group, roots[name])]
        kinds[name] = (exclusive, enclosing, [s for s in streaming if s not in enclosing])
    for run in range(2):
        if run == 1:
            state.moved, state.onloads = 0, 0
            state.peak = sum(state.resident.values())
        for name in sequence:
            exclusive, enclosing, blocks = kinds[name]
            state.evict_others(name, sized)
            for s in exclusive + enclosing:
                state.onload(s)
            ahead = lookahead.get(name, 1) if prefetch else 0
            for s in blocks[:ahead]:
                state.onload(s)  # prefetched when the component's first group was onloaded
            for index, s in enumerate(blocks):
                state.onload(s)
                for following in blocks[index + 1 : index + 1 + ahead]:
                    state.onload(following)
                state.offload(s)
            for s in enclosing:
                state.offload(s)
    return state
