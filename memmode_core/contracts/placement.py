"""The placement contract: *when* and *what* moves between the compute device and the storage.

A placement does not move anything itself. It cuts the target into groups (``layout``) and says
for each one when it must be on the device (:class:`~memmode_core.contracts.group_specs.Policy`); the
engine does the moving, the hooks and the ledger, and the planner predicts costs from the same
layout (core adjusts a layout where the model or the pipeline declares it must:
:mod:`memmode_core.engine.placement_layout`).
"""

from __future__ import annotations

import torch

from memmode_core.contracts.group_specs import GroupSpec
from memmode_core.contracts.options import Option, Options
from memmode_core.contracts.targets import Target


class Placement:
    """Base class of every placement. Subclasses set ``name`` and ``description`` and implement ``layout``.

    Every method receives the placement's options as the typed :class:`Options` instance ``prepare``
    built (attributes, or ``options["name"]``).
    """

    name: str = ""
    description: str = ""
    #: an :class:`Options` dataclass, or a tuple of :class:`Option` (see :mod:`memmode_core.contracts.options`)
    options: tuple[Option, ...] | type[Options] = ()
    #: False for placements that keep nothing offloaded (a storage would have nothing to hold)
    offloads: bool = True
    #: the option values the planner prices this placement with, one candidate each (default: its defaults)
    plan_variants: tuple[dict[str, object], ...] = ({},)

    def unavailable_reason(self) -> str | None:
        """Why this placement cannot run in this environment, or None when it can."""
        return None

    def check(self, target: Target, options: Options, device: torch.device) -> None:
        """Raise ``IncompatibleModeError`` when this placement cannot work on ``target``."""

    def prefetch(self, options: Options, device: torch.device) -> bool:
        """Whether the engine copies the next group on a side stream while the current one computes."""
        return False

    def offloads_after_call(self, options: Options) -> bool:
        """Whether what a pipeline call leaves on the device (``EXCLUSIVE`` groups) is offloaded when the call
        returns, as diffusers frees its models at the end of a call (``maybe_free_model_hooks``)."""
        return True

    def layout(self, target: Target, options: Options) -> list[GroupSpec]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<placement {self.name}>"
