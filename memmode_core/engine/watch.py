"""Noticing that a placed model's weights changed, without the user having to say so.

Two mechanisms, both cheap enough for the hot path:

- PyTorch's global registration hooks (``register_module_parameter_registration_hook`` and its
  buffer and submodule siblings) report every ``module.x = Parameter(...)``, ``register_buffer``
  and ``setattr(parent, name, module)`` in the process. Those on a module that belongs to a placed
  component mark that component changed — this is how an adapter injected by peft (a new
  ``lora.Linear`` set on its parent) is noticed. One set of hooks is installed for the process and
  dispatches to the live runtimes through weak references, so a model that is dropped without
  ``remove()`` is still freed.
- At each component call the engine checks that every tensor it tracks is still the one
  registered on its module and, for offloaded tensors, still holds the at-rest data it gave it
  (``tensor.data = other`` is a replacement). See :meth:`Changes.changed <memmode_core.engine.changes.Changes.changed>`.

A registration that would make a value computed from an offloaded placeholder a weight (a model's
``to()`` override building ``nn.Parameter(self.mean.to(device))`` while ``mean`` rests on disk) is
refused by the runtime from the hook, before the assignment happens: nothing computed from a
placeholder ever becomes a weight.

What neither can see — an in-place write into a tensor's memory (``weight.data.mul_(2)``), a
module deleted from its parent — is what ``handle.refresh()`` is for. The LoRA and projection-fusing
methods of diffusers and transformers are wrapped instead (:data:`EDIT_METHODS`): memmode prepares
the weights before them and rebuilds after them, whatever they do inside.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn

from memmode_core.engine.standins.values import registered_value

#: Methods (of pipelines, diffusers models and transformers models) that add, remove or rewrite
#: weights. memmode offloads the component before them and rebuilds its groups after them.
EDIT_METHODS = (
    # diffusers pipelines (LoraBaseMixin and friends)
    "load_lora_weights",
    "unload_lora_weights",
    "fuse_lora",
    "unfuse_lora",
    "set_adapters",
    "delete_adapters",
    "enable_lora",
    "disable_lora",
    "set_lora_device",
    "fuse_qkv_projections",
    "unfuse_qkv_projections",
    # diffusers models (PeftAdapterMixin, AttentionMixin)
    "load_lora_adapter",
    "unload_lora",
    "add_adapter",
    "set_adapter",
    "enable_adapters",
    "disable_adapters",
    "delete_adapter",
    # transformers models (PeftAdapterMixin)
    "load_adapter",
)
#: Edit methods that write into existing weights: the weights must hold their real values first.
WRITES_WEIGHTS = frozenset({"fuse_lora", "unfuse_lora", "fuse_qkv_projections", "unfuse_qkv_projections"})

_watchers: weakref.WeakSet = weakref.WeakSet()
_installed = False
_lock = threading.Lock()


def _notify(module: nn.Module, name: str, value: Any) -> Any:
    """Tell every live runtime of a registration; a stand-in registered as a weight is registered as a plain
    tensor holding its value instead (:func:`~memmode_core.engine.standins.values.registered_value`), which is what
    this returns (PyTorch registers a hook's return value in place of the given one)."""
    replacement = registered_value(value)
    if replacement is not None:
        value = replacement
    for runtime in list(_watchers):
        runtime.note_registration(module, name, value)
    return replacement


def live_runtimes() -> list:
    """The runtimes being watched now (placements not yet removed)."""
    return list(_watchers)


def watch(runtime) -> None:
    """Report registrations to ``runtime`` until :func:`unwatch` (or until it is garbage)."""
    global _installed
    with _lock:
        if not _installed:
            registration = torch.nn.modules.module
            registration.register_module_parameter_registration_hook(_notify)
            registration.register_module_buffer_registration_hook(_notify)
            registration.register_module_module_registration_hook(_notify)
            _installed = True
        _watchers.add(runtime)


def unwatch(runtime) -> None:
    with _lock:
        _watchers.discard(runtime)
