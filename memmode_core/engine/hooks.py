"""Wrapping a module's ``forward`` (and a component's ``encode``/``decode``) with the engine's
before/after work, removably.

The engine puts a wrapper in the module instance's ``forward`` attribute rather than registering
``torch.nn.Module`` forward hooks: a module with hooks takes PyTorch's slow call path on every
call, which for a leaf-level layout (hundreds of hooked modules per forward) costs more than the
bookkeeping itself. An instance attribute keeps the fast path, also catches direct calls of
``module.forward(...)``, and is removed by deleting the attribute.

If something else wrapped ``forward`` on top of ours in the meantime, deleting would drop that
wrapper too; the wrapper is then switched to pass-through instead, so removal never breaks a
model.

A wrapper looks like what it wraps: name, docstring, ``__wrapped__`` and so the signature
(``functools.update_wrapper``). Pipelines ask ``inspect.signature(vae.forward)`` which arguments
a component takes (Stable Video Diffusion passes ``num_frames`` to a VAE's decode only if its
forward names it); a wrapper answering ``(*args, **kwargs)`` would change what they pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: attribute on the wrapper function that marks it as memmode's
MARKER = "__memmode_wrapper__"


def not_traced(function):
    """The engine's bookkeeping runs eagerly under torch.compile: its Python state (books, flags,
    swapped ``.data``) is not something to trace, and guards on it would fail at every call."""
    return torch.compiler.disable(function, recursive=True)


class MethodWrapper:
    """One wrapped method of one module. ``make(original, wrapper) -> function`` builds the wrapping function."""

    __slots__ = ("module", "method", "original", "had_instance_attribute", "active", "function", "successor")

    def __init__(
        self,
        module: Any,
        make: Callable[[Callable[..., Any], MethodWrapper], Callable[..., Any]],
        method: str = "forward",
        *,
        eager: bool = True,
    ):
        self.module = module
        self.method = method
        self.had_instance_attribute = method in module.__dict__
        self.original = getattr(module, method)
        self.active = True
        #: the wrapper that replaced this one when the engine rebuilt its hooks (see :meth:`passthrough`)
        self.successor: MethodWrapper | None = None
        wrapper = functools.update_wrapper(make(self.original, self), self.original)
        if eager:
            # The wrapper itself runs eagerly: what it does (swapping weights, keeping the books) is
            # not something to trace, and tracing it would make every call's guards fail. The method
            # it calls is compiled as usual under torch.compile (recursive=False). A wrapper that is
            # mostly a pass-through (``eager=False``) disables its own slow path instead.
            wrapper = torch.compiler.disable(wrapper, recursive=False)
        setattr(wrapper, MARKER, self)
        setattr(module, method, wrapper)
        self.function = wrapper

    def on_top(self) -> bool:
        """Whether calling the method reaches this wrapper first (nothing was wrapped around it since)."""
        return self.module.__dict__.get(self.method) is self.function

    def passthrough(self) -> Callable[..., Any]:
        """What a call of this wrapper runs once it is no longer active: the wrapper that replaced it, if the
        engine rebuilt its hooks (code can hold a method it looked up before, ``a.f(a.g(x))`` looks ``a.f``
        up before ``a.g`` rebuilds), else the original method."""
        successor = self.successor
        while successor is not None and not successor.active:
            successor = successor.successor
        return successor.function if successor is not None else self.original

    def remove(self) -> None:
        if self.on_top():
            if self.had_instance_attribute:
                setattr(self.module, self.method, self.original)
            else:
                delattr(self.module, self.method)
        self.active = False  # a wrapper left in place by another library now only passes through


def is_wrapped(module: nn.Module, method: str = "forward") -> bool:
    return getattr(module.__dict__.get(method), MARKER, None) is not None
