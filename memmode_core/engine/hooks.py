"""Hooks: the engine's wrappers around methods of modules and pipelines, as named, removable objects.

Every wrapper memmode installs is a :class:`Hook`: an object with a ``name`` that says what kind of
hook it is (``memmode.groups``, ``memmode.component_entry``, ...), a ``repr`` that says what it does,
and an entry in its owner's :class:`HookRegistry` — ``hooks_of(module)`` lists them, ``.get(name)``
finds one, ``.remove(name)`` takes it off — the shape of diffusers' hook registry. Unlike diffusers'
hooks, a memmode hook is not a set of pre/post callbacks run by one shared forward: the hook object
is itself the wrapper and its ``__call__`` is the per-call work, so a hooked leaf's forward runs one
frame of memmode code that reads a few attributes (the state of the hook, never a closure's locals).

The engine puts a wrapper in the module instance's ``forward`` attribute rather than registering
``torch.nn.Module`` forward hooks: a module with hooks takes PyTorch's slow call path on every
call, which for a leaf-level layout (hundreds of hooked modules per forward) costs more than the
bookkeeping itself. An instance attribute keeps the fast path, also catches direct calls of
``module.forward(...)``, and is removed by deleting the attribute.

If something else wrapped ``forward`` on top of ours in the meantime, deleting would drop that
wrapper too; the wrapper is then switched to pass-through instead, so removal never breaks a
model. A wrapper retired by a rebuild of the engine's hooks passes calls on to its successor.

A wrapper looks like what it wraps: name, docstring, ``__wrapped__`` and so the signature
(``functools.update_wrapper``). Pipelines ask ``inspect.signature(vae.forward)`` which arguments
a component takes (Stable Video Diffusion passes ``num_frames`` to a VAE's decode only if its
forward names it); a wrapper answering ``(*args, **kwargs)`` would change what they pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from memmode_core.engine import copying

#: attribute on an installed wrapper that points to its hook (``is_wrapped`` checks it)
MARKER = "__memmode_wrapper__"
#: attribute (in the owner's ``__dict__``) holding its :class:`HookRegistry` while it has hooks
REGISTRY_ATTRIBUTE = "_memmode_hooks"


def not_traced(function):
    """The engine's bookkeeping runs eagerly under torch.compile: its Python state (books, flags,
    swapped ``.data``) is not something to trace, and guards on it would fail at every call."""
    return torch.compiler.disable(function, recursive=True)


class Hook:
    """One named hook of memmode's on ``owner``'s ``method``. Never copied with its owner (``engine.copying``).

    ``kind`` names what hooks of a class do. ``name`` tells one owner's hooks apart: the kind alone for
    a hook on the method its class always wraps (``default_method``), else ``kind:method``
    (``memmode.entry_method:decode``).
    """

    kind: ClassVar[str] = "memmode.hook"
    __memmode_uncopied__: ClassVar[bool] = True
    #: the method hooks of this kind wrap unless told otherwise
    default_method: ClassVar[str | None] = None

    __slots__ = ("owner", "method", "name", "active")

    def __init__(self, owner: Any, method: str) -> None:
        self.owner = owner
        self.method = method
        self.name = self.kind if method == self.default_method else f"{self.kind}:{method}"
        self.active = False

    def remove(self) -> None:
        raise NotImplementedError

    def where(self) -> str:
        """The owner, for ``repr``."""
        return type(self.owner).__name__

    def describe(self) -> str:
        """What the hook does, for ``repr``."""
        return ""

    def register(self) -> None:
        """Enter the hook in its owner's registry (``install`` does; a hook installed another way calls it)."""
        owner = self.owner
        registry = owner.__dict__.get(REGISTRY_ATTRIBUTE)
        if registry is None:
            registry = owner.__dict__[REGISTRY_ATTRIBUTE] = HookRegistry()
            copying.install(owner)  # a copy of the owner is the model without memmode
        registry._hooks.append(self)

    def unregister(self, owner: Any) -> None:
        """Take the hook out of ``owner``'s registry (``remove`` does)."""
        registry = owner.__dict__.get(REGISTRY_ATTRIBUTE) if owner is not None else None
        if registry is None:
            return
        registry._hooks = [h for h in registry._hooks if h is not self]
        if not registry._hooks:  # a removed mode leaves nothing behind
            del owner.__dict__[REGISTRY_ATTRIBUTE]
            copying.uninstall(owner)

    @property
    def __memmode_wrapper__(self) -> Hook:
        """The MARKER of a hook installed as itself (one that is not ``eager``)."""
        return self

    def __repr__(self) -> str:
        what = self.describe()
        return (
            f"<{self.name} on {self.where()}.{self.method}{': ' + what if what else ''}"
            f"{'' if self.active else ' (removed)'}>"
        )


class MethodWrapper(Hook):
    """A hook that replaces ``owner.<method>`` through the owner's ``__dict__``; subclasses define ``__call__``.

    ``install()`` puts it in place: the hook itself (updated to look like the method it wraps) or, for an
    ``eager`` hook, ``torch.compiler.disable(hook, recursive=False)``: what an eager hook does (swapping
    weights, keeping the books) is not something to trace, and tracing it would make every call's guards
    fail; the method it calls is compiled as usual under torch.compile. A hook that mostly passes through
    (``eager = False``) disables its own slow path instead.
    """

    eager: ClassVar[bool] = True

    # ``__dict__`` holds what ``functools.update_wrapper`` copies from the wrapped method (name, docstring,
    # ``__wrapped__``); the hook's own state lives in slots, where nothing copied can overwrite it
    __slots__ = ("original", "had_instance_attribute", "function", "successor", "__dict__")

    def __init__(self, owner: Any, method: str = "forward") -> None:
        super().__init__(owner, method)
        self.original: Callable[..., Any] | None = None
        self.had_instance_attribute = False
        #: what calling ``owner.<method>`` runs while this hook is on top: the hook, or its eager wrapper
        self.function: Callable[..., Any] | None = None
        #: the hook that replaced this one when the engine rebuilt its hooks (see :meth:`passthrough`)
        self.successor: MethodWrapper | None = None

    def install(self) -> MethodWrapper:
        owner, method = self.owner, self.method
        self.had_instance_attribute = method in owner.__dict__
        self.original = getattr(owner, method)
        self.active = True
        function = functools.update_wrapper(self, self.original)
        if self.eager:
            function = torch.compiler.disable(function, recursive=False)
            setattr(function, MARKER, self)
        setattr(owner, method, function)
        self.function = function
        self.register()
        return self

    def on_top(self) -> bool:
        """Whether calling the method reaches this wrapper first (nothing was wrapped around it since)."""
        return self.owner.__dict__.get(self.method) is self.function

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
                setattr(self.owner, self.method, self.original)
            else:
                delattr(self.owner, self.method)
        self.active = False  # a wrapper left in place by another library now only passes through
        self.unregister(self.owner)

    def __call__(self, *args, **kwargs):
        raise NotImplementedError


class HookRegistry:
    """The memmode hooks installed on one object, in the order they were installed (``hooks_of(obj)``).

    Several hooks may share a name (a module placed by two nested placements): ``get`` and ``remove``
    take the most recent one.
    """

    __slots__ = ("_hooks",)
    __memmode_uncopied__ = True

    def __init__(self) -> None:
        self._hooks: list[Hook] = []

    def get(self, name: str, default: Hook | None = None) -> Hook | None:
        for hook in reversed(self._hooks):
            if hook.name == name:
                return hook
        return default

    def remove(self, name: str) -> Hook:
        """Take the hook called ``name`` off (``KeyError`` if there is none) and return it."""
        hook = self.get(name)
        if hook is None:
            raise KeyError(f"no memmode hook named {name!r}; installed: {self.names()}")
        hook.remove()
        return hook

    def names(self) -> list[str]:
        return [hook.name for hook in self._hooks]

    def __iter__(self) -> Iterator[Hook]:
        return iter(list(self._hooks))

    def __len__(self) -> int:
        return len(self._hooks)

    def __contains__(self, name: object) -> bool:
        return any(hook.name == name for hook in self._hooks)

    def __repr__(self) -> str:
        if not self._hooks:
            return "HookRegistry()"
        return "HookRegistry(\n" + "".join(f"  {hook!r}\n" for hook in self._hooks) + ")"


def hooks_of(obj: Any) -> HookRegistry:
    """The memmode hooks installed on ``obj`` (a module, a pipeline): empty if it has none.

    The registry is the object's own while it has hooks; once its last hook is removed it is detached (a
    removed mode leaves nothing on the object), so ask again after installing."""
    registry = getattr(obj, "__dict__", {}).get(REGISTRY_ATTRIBUTE)
    return registry if registry is not None else HookRegistry()


def is_wrapped(module: nn.Module, method: str = "forward") -> bool:
    return getattr(module.__dict__.get(method), MARKER, None) is not None
