"""The resolver contract: a name in a mode's placement slot that chooses a concrete mode (``auto``).

A resolver lays nothing out. ``prepare`` asks it for the budgets to price the candidates with
(:meth:`Resolver.budgets`), has the planner prepare and price every installed placement x storage
(with the mode's quantizer, if any) for the target, and asks the resolver to pick one entry
(:meth:`Resolver.choose`); what ``apply`` executes is that candidate's prepared plan, so
``handle.mode`` names what was chosen and ``handle.requested_mode`` the resolver.

Resolvers register through the placement hook (they are spelt where a placement is), so
``memmode list`` shows them among the placements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from memmode_core.contracts.options import Option, Options


@dataclass(frozen=True)
class Budgets:
    """What a resolver's candidates are priced for: device and host memory limits (None: no limit), the
    denoising steps of the call profile, and the call's shapes (``height``, ``width``, ``num_frames``,
    ``batch``; given, the planner predicts the call's activations and ``vram`` counts them with the weights)."""

    vram: int | None
    ram: int | None
    steps: int
    shapes: Mapping[str, int] = field(default_factory=dict)


class Resolver:
    """Base class of a resolver. Subclasses set ``name`` and ``description`` and implement both methods."""

    name: str = ""
    description: str = ""
    #: an :class:`Options` dataclass, or a tuple of :class:`Option`
    options: tuple[Option, ...] | type[Options] = ()
    #: a resolver chooses among offloading placements too, so a mode naming it takes a storage
    offloads: bool = True

    def unavailable_reason(self) -> str | None:
        """Why this resolver cannot run in this environment, or None when it can."""
        return None

    def budgets(self, options: Options, device: torch.device) -> Budgets:
        """The budgets the candidates are judged by, from this resolver's options and the device."""
        raise NotImplementedError

    def choose(self, entries: Sequence[Any], budgets: Budgets) -> Any:
        """The entry to execute among the planner's priced candidates (``PlanEntry``: ``fits``, ``chosen``,
        ``seconds_per_call``, ``peak_device_bytes`` ...); raise ``NoModeFitsError`` when none will do."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<resolver {self.name}>"
