"""The placement contract: *when* and *what* moves between the compute device and the storage.

A placement does not move anything itself. It cuts the target into groups (``layout``) and says
for each one when it must be on the device (:class:`~memmode_core.contracts.layout.Policy`); the
engine does the moving, the hooks and the ledger, and the planner predicts costs from the same
layout.
"""

from __future__ import annotations

from typing import Mapping

import torch

from memmode_core.contracts.layout import GroupSpec, Policy, owns_tensors
from memmode_core.contracts.errors import IncompatibleModeError
from memmode_core.contracts.options import Option
from memmode_core.contracts.targets import Target


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


def lay_out(placement: Placement, target: Target, options: Mapping[str, object], device: torch.device) -> list[GroupSpec]:
    """The placement's groups for ``target``, after the checks every placement gets from core.

    Used by ``apply`` and by the planner, so that what ``plan`` predicts is what ``apply`` accepts.
    """
    placement.check(target, options, device)
    specs = placement.layout(target, options)
    refuse_malformed_layout(target, specs, placement.name)
    refuse_unsupported_splits(target, specs, placement.name)
    return specs


def refuse_malformed_layout(target: Target, specs: list[GroupSpec], placement: str) -> None:
    """A layout must give every group its own key and put every module that holds tensors in a group:
    two groups under one key would overwrite each other's stored copy, and a module left out would
    stay wherever it is (on CUDA, a device mismatch at the first call). A plugin bug, caught at apply."""
    keys: dict[str, int] = {}
    for spec in specs:
        keys[spec.key] = keys.get(spec.key, 0) + 1
    repeated = sorted(key for key, count in keys.items() if count > 1)
    if repeated:
        raise IncompatibleModeError(f"placement {placement!r} laid out several groups under the key "
                                    f"{repeated[0]!r}; every group needs its own key (a placement bug)")
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
    """diffusers marks models that read a submodule's weights outside that submodule's forward
    with ``_supports_group_offloading = False`` (DiT calls ``transformer_blocks[0].norm1.emb`` from
    its own forward; VQModel reads ``embedding.weight`` directly). Split into groups, such a model
    would compute with a weight that is not on the device. Moving it whole, or keeping it resident,
    is fine."""
    for name, module in target.components.items():
        if getattr(module, "_supports_group_offloading", True) is not False:
            continue
        own = [s for s in specs if s.component == name]
        if len(own) > 1 and any(s.policy is not Policy.RESIDENT for s in own):
            raise IncompatibleModeError(
                f"{placement} cannot split component {name!r} ({type(module).__name__}) into groups: the model declares "
                f"_supports_group_offloading = False, because it reads weights of its submodules outside their "
                f"forward. Use model_cpu_offload (the component moves whole), or leave it where it is with "
                f"exclude_components=[{name!r}]"
            )
