"""How a diffusers pipeline learns where its components compute.

A pipeline creates its latents and embeddings on ``pipe._execution_device``. When weights rest on
the CPU between calls, ``pipe.device`` would say "cpu"; diffusers then looks for an accelerate-style
hook object at ``component._hf_hook`` with an ``execution_device`` attribute, and calls its
``pre_forward`` before a VAE's ``encode``/``decode``. memmode puts such an object on each component
for as long as a mode is applied, so pipelines compute on the device that was asked for. If
diffusers itself removes it (``pipe.enable_model_cpu_offload()`` calls ``remove_all_hooks``), the
memmode placement is removed with it, so two offloading schemes never fight over one model.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from memmode_core.contracts.errors import IncompatibleModeError

ATTRIBUTE = "_hf_hook"


class ExecutionDeviceHook:
    def __init__(self, device: torch.device, on_detach: Callable[[], None]) -> None:
        self.execution_device = device
        self._on_detach = on_detach

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module

    def pre_forward(self, module: nn.Module, *args, **kwargs):
        return args, kwargs

    def post_forward(self, module: nn.Module, output):
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        self._on_detach()
        # accelerate deletes the attribute itself right after this call; removing the placement
        # already deleted it, so put it back for that deletion to succeed.
        setattr(module, ATTRIBUTE, self)
        return module


def refuse_foreign_offloading(components: dict[str, nn.Module]) -> None:
    """Another offloading scheme (accelerate's or diffusers' own hooks) already owns these weights.

    Checked on every module of every component, for pipelines and bare modules alike: accelerate's
    sequential offload hooks each leaf (``_hf_hook`` on submodules) and leaves meta tensors behind,
    which memmode must never try to store.
    """
    for name, component in components.items():
        for path, sub in component.named_modules():
            where = f"{name}.{path}" if path else name
            hook = getattr(sub, ATTRIBUTE, None)
            if hook is not None and not isinstance(hook, ExecutionDeviceHook):
                raise IncompatibleModeError(
                    f"{where!r} already has accelerate offloading hooks ({type(hook).__name__}, from "
                    f"enable_model_cpu_offload, enable_sequential_cpu_offload, accelerate.cpu_offload or a "
                    f"device_map); remove them first (pipe.remove_all_hooks(), or "
                    f"accelerate.hooks.remove_hook_from_module(module, recurse=True)) and load the weights back"
                )
            registry = getattr(sub, "_diffusers_hook", None)
            if registry is not None and getattr(registry, "get_hook", None) and \
                    registry.get_hook("group_offloading") is not None:
                raise IncompatibleModeError(
                    f"{where!r} already uses diffusers' group offloading; remove it first (build the component "
                    f"again, or call its _diffusers_hook.remove_hook('group_offloading', recurse=True))"
                )


def install(components: dict[str, nn.Module], device: torch.device, on_detach: Callable[[], None]) -> None:
    for component in components.values():
        setattr(component, ATTRIBUTE, ExecutionDeviceHook(device, on_detach))


def uninstall(components: dict[str, nn.Module]) -> None:
    for component in components.values():
        if isinstance(getattr(component, ATTRIBUTE, None), ExecutionDeviceHook):
            delattr(component, ATTRIBUTE)
