"""Wrapping a module's ``forward`` with the engine's before/after work, removably.

The engine puts a wrapper in the module instance's ``forward`` attribute rather than registering
``torch.nn.Module`` forward hooks: a module with hooks takes PyTorch's slow call path on every
call, which for a leaf-level layout (hundreds of hooked modules per forward) costs more than the
bookkeeping itself. An instance attribute keeps the fast path, also catches direct calls of
``module.forward(...)``, and is removed by deleting the attribute.

If something else wrapped ``forward`` on top of ours in the meantime, deleting would drop that
wrapper too; the wrapper is then switched to pass-through instead, so removal never breaks a
model.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

#: attribute on the wrapper function that marks it as memmode's
MARKER = "__memmode_wrapper__"


class ForwardWrapper:
    """One wrapped module. ``make(original) -> wrapper`` builds the wrapping function."""

    __slots__ = ("module", "original", "had_instance_forward", "active")

    def __init__(self, module: nn.Module, make: Callable[[Callable[..., Any], "ForwardWrapper"], Callable[..., Any]]):
        self.module = module
        self.had_instance_forward = "forward" in module.__dict__
        self.original = module.forward
        self.active = True
        wrapper = make(self.original, self)
        setattr(wrapper, MARKER, self)
        module.forward = wrapper

    def remove(self) -> None:
        current = self.module.__dict__.get("forward")
        if current is not None and getattr(current, MARKER, None) is self:
            if self.had_instance_forward:
                self.module.forward = self.original
            else:
                del self.module.forward
        self.active = False  # a wrapper left in place by another library now only passes through


def is_wrapped(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), MARKER, None) is not None
