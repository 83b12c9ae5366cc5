"""The placement contract: *when* and *what* moves between the compute device and the storage.

A placement does not move anything itself. It cuts the target into groups (``layout``) and says
for each one when it must be on the device (:class:`~memmode_core.engine.layout.Policy`); the
engine does the moving, the hooks and the ledger, and the planner predicts costs from the same
layout.
"""

from __future__ import annotations

from typing import Mapping

import torch

from .engine.layout import GroupSpec
from .options import Option
from .targets import Target


class Placement:
    name: str = ""
    description: str = ""
    options: tuple[Option, ...] = ()
    #: False for placements that keep nothing offloaded (a storage would have nothing to hold)
    offloads: bool = True

    def unavailable_reason(self) -> str | None:
        """Why this placement cannot run in this environment, or None when it can."""
        return None

    def check(self, target: Target, options: Mapping[str, object], device: torch.device) -> None:
        """Raise ``IncompatibleModeError`` when this placement cannot work on ``target``."""

    def prefetch(self, options: Mapping[str, object], device: torch.device) -> bool:
        """Whether the engine copies the next group on a side stream while the current one computes."""
        return False

    def layout(self, target: Target, options: Mapping[str, object]) -> list[GroupSpec]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<placement {self.name}>"
