"""What ``apply`` works on: a diffusers pipeline (its ``.components``) or a bare ``nn.Module``.

Normalising both into one ``Target`` lets every placement reason about named components only.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memmode_core.contracts.errors import IncompatibleModeError, InvalidOptionError

#: The component name used for a bare ``nn.Module`` target.
MODULE_COMPONENT = "module"

#: Parameter names of a forward that takes the denoising step: the mark of a denoiser (``timestep``
#: for UNets, DiTs, priors and ControlNets; Stable Cascade's ``timestep_ratio``; Würstchen's ``r``).
TIMESTEP_PARAMETERS = frozenset({"timestep", "timesteps", "timestep_ratio", "t", "r"})

#: the attribute set on a placed pipeline or module (and on each placed component) that points to its handle: read
#: where the handle's own module cannot be imported (``loading.save`` sits below the handle's ``save``)
HANDLE_ATTRIBUTE = "_memmode_handle"


def takes_timestep(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes the denoising step, i.e. it is called once per step (a denoiser)."""
    seen = 0
    while seen < 4 and isinstance(getattr(module, "_orig_mod", getattr(module, "module", None)), nn.Module):
        module = getattr(module, "_orig_mod", None) or module.module  # torch.compile, DDP or FSDP1 wrappers
        seen += 1
    forward = getattr(type(module), "forward", None)
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False
    return not TIMESTEP_PARAMETERS.isdisjoint(parameters)


@dataclass(eq=False)
class Target:
    obj: Any
    is_pipeline: bool
    components: dict[str, nn.Module]

    @classmethod
    def of(cls, obj: Any) -> Target:
        if isinstance(obj, nn.Module):
            return cls(obj, False, {MODULE_COMPONENT: obj})
        components = getattr(obj, "components", None)
        if isinstance(components, dict):
            modules: dict[str, nn.Module] = {}
            seen: set[int] = set()
            for name, value in components.items():
                if isinstance(value, nn.Module) and id(value) not in seen:
                    seen.add(id(value))
                    modules[name] = value
            if not modules:
                raise InvalidOptionError(f"{type(obj).__name__} has no torch.nn.Module components to place")
            return cls(obj, True, modules)
        raise TypeError(
            f"memmode works on a diffusers pipeline (an object with a .components dict) or a torch.nn.Module, "
            f"not {type(obj).__name__}"
        )

    def without(self, names: Iterable[str]) -> Target:
        """The same target with the named components left out of the placement.

        An excluded component is left exactly where the user put it: no groups, no hooks, no
        storage (diffusers' ``exclude_modules`` of pipeline-level group offloading). Names are
        checked against the components, and a placement needs at least one component left.
        """
        names = list(dict.fromkeys([names] if isinstance(names, str) else names))
        if not names:
            return self
        if not self.is_pipeline:
            raise InvalidOptionError(
                f"unplaced={names!r}: a bare module is one component; there is nothing to leave out"
            )
        unknown = [n for n in names if n not in self.components]
        if unknown:
            raise InvalidOptionError(
                f"unplaced={names!r}: {self.label} has no module component named "
                f"{', '.join(map(repr, unknown))}; it has {', '.join(self.components)}"
            )
        kept = {n: m for n, m in self.components.items() if n not in names}
        if not kept:
            raise InvalidOptionError(f"unplaced={names!r} leaves no component of {self.label} to place")
        return Target(self.obj, self.is_pipeline, kept)

    def denoisers(self) -> dict[str, nn.Module]:
        """The components the pipeline calls once per denoising step, whatever they are called: those whose
        forward takes the step (``timestep``, ``timestep_ratio``, ...) — a Flux or Wan ``transformer`` (and
        Wan 2.2's ``transformer_2``), an SD ``unet``, a Kandinsky ``prior``, a Würstchen ``decoder``, a
        ControlNet. Text encoders, VAEs and vocoders take no step."""
        return {name: module for name, module in self.components.items() if takes_timestep(module)}

    @property
    def label(self) -> str:
        return type(self.obj).__name__

    def select(self, names: Iterable[str] | None) -> dict[str, nn.Module]:
        """The components named by ``names``; by default the :meth:`denoisers` (or the module itself)."""
        if not self.is_pipeline:
            if names is not None and set(names) - {MODULE_COMPONENT}:
                raise InvalidOptionError(
                    f"components={list(names)!r}: a bare module has one component, {MODULE_COMPONENT!r}"
                )
            return dict(self.components)
        if names is None:
            return self.denoisers()
        names = [names] if isinstance(names, str) else list(names)
        missing = [n for n in names if n not in self.components]
        if missing:
            raise InvalidOptionError(
                f"components={names!r}: {self.label} has no module component named {', '.join(map(repr, missing))}; "
                f"it has {', '.join(self.components)}"
            )
        return {n: self.components[n] for n in names}


def is_compiled(module: nn.Module) -> bool:
    """True for the wrapper ``torch.compile(module)`` returns and for a module compiled in place."""
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    if optimized is not None and isinstance(module, optimized.OptimizedModule):
        return True
    return getattr(module, "_compiled_call_impl", None) is not None


def refuse_compiled(components: dict[str, nn.Module], action: str) -> None:
    for name, module in components.items():
        if is_compiled(module):
            raise IncompatibleModeError(
                f"cannot {action} {name!r}: it was already torch.compile'd, and compiled graphs keep the weights "
                f"they were traced with. Apply the memmode first, then call torch.compile."
            )


def refuse_scripted(components: dict[str, nn.Module]) -> None:
    """TorchScript modules cannot be placed: their compiled methods read weights through the
    script's own attribute slots, which memmode's ``tensor.data`` swaps and forward wrappers do not
    reach, so a placement would offload weights that the script then never onloads."""
    script_module = getattr(torch.jit, "ScriptModule", None)
    if script_module is None:  # pragma: no cover
        return
    for name, module in components.items():
        for path, sub in module.named_modules():
            if isinstance(sub, script_module):
                where = f"{name}.{path}" if path else name
                raise IncompatibleModeError(
                    f"cannot place {where!r}: it is a TorchScript module ({type(sub).__name__}), whose compiled "
                    f"code memmode cannot hook. Apply the mode to the original nn.Module (before torch.jit.script), "
                    f"or use torch.compile after apply"
                )


def is_fsdp1(module: nn.Module) -> bool:
    """Whether ``module`` holds an FSDP1 wrapper (flat parameters that only FSDP can move or pack)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return any(isinstance(sub, FullyShardedDataParallel) for sub in module.modules())


def is_fsdp_wrapped(module: nn.Module) -> bool:
    """FSDP1 wrappers and FSDP2 (``fully_shard``) modules both own their parameters' storage."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return is_fsdp1(module) or any(isinstance(sub, FSDPModule) for sub in module.modules())
