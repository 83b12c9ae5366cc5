"""The resolver contract: a name in a mode's placement slot that chooses a concrete mode (``auto``).

A resolver lays nothing out. ``prepare`` hands it the request and the target (:meth:`Resolver.resolve`), and
it returns the prepared plan of the concrete mode it chose; what ``apply`` executes is that plan, so
``handle.mode`` names what was chosen and ``handle.requested_mode`` the resolver. The built-in ``auto`` is a
:class:`~memmode_core.builtin.auto.PricingResolver` (``memmode_core.plugin.PricingResolver``): it has the
planner prepare and price every installed placement x storage (with the mode's quantizer, if any) for the
budgets it derives from its options (:meth:`Resolver.budgets`), and picks one priced entry
(:meth:`Resolver.choose`). A resolver that prefers another trade-off subclasses it and writes ``choose``.

Resolvers register through the placement hook (they are spelt where a placement is), so
``memmode list`` shows them among the placements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from memmode_core.contracts.errors import IncompatibleModeError
from memmode_core.contracts.options import Option, Options


@dataclass(frozen=True)
class Budgets:
    """What a resolver's candidates are priced for: device and host memory limits (None: no limit), the
    denoising steps of the call profile, the call's shapes (``height``, ``width``, ``num_frames``, ``batch``;
    given, the planner predicts the call's activations and ``vram`` counts them with the weights), and the ranks
    of one machine."""

    vram: int | None
    ram: int | None
    steps: int
    shapes: Mapping[str, int] = field(default_factory=dict)
    #: the ranks of one machine that each place the pipeline (``vram`` is one's, ``ram`` the machine's), and how
    #: many split the transformer's sequence (its activations are that share on each)
    ranks: int = 1
    context_parallel: int = 1


class Resolver:
    """Base class of a resolver. Subclasses set ``name`` and ``description`` and implement :meth:`resolve`, or
    subclass ``memmode_core.plugin.PricingResolver``, which implements it with :meth:`budgets` and
    :meth:`choose`."""

    name: str = ""
    description: str = ""
    #: an :class:`Options` dataclass, or a tuple of :class:`Option`
    options: tuple[Option, ...] | type[Options] = ()
    #: a resolver chooses among offloading placements too, so a mode naming it takes a storage
    offloads: bool = True

    def unavailable_reason(self) -> str | None:
        """Why this resolver cannot run in this environment, or None when it can."""
        return None

    def resolve(self, target: Any, request: Any) -> Any:
        """The prepared plan (``Prepared``) of the concrete mode chosen for ``target``; ``request`` is the
        resolved request (``memmode_core.plugin.Request``: its ``placement_options`` are this resolver's
        options). Called by ``prepare`` before anything is touched."""
        raise IncompatibleModeError(
            f"resolver {self.name!r} ({type(self).__name__}) implements no resolve(): subclass "
            f"memmode_core.plugin.PricingResolver to choose among the planner's priced candidates with budgets() "
            f"and choose(), or implement resolve()"
        )

    def budgets(self, options: Options, device: torch.device) -> Budgets:
        """The budgets the candidates are judged by, from this resolver's options and the device."""
        raise NotImplementedError

    def choose(self, entries: Sequence[Any], budgets: Budgets) -> Any:
        """The entry to execute among the planner's priced candidates (``PlanEntry``: ``fits``, ``chosen``,
        ``seconds_per_call``, ``peak_device_bytes`` ...); raise ``NoModeFitsError`` when none will do."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<resolver {self.name}>"
