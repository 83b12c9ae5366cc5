"""What serves a runtime's resting tensors: the :class:`~.classes.StandInSource` of each resting slot, and of a slot
whose stored copy was lost.

When a group goes to rest, each of its tensors that rests as a stand-in is served by a :class:`SlotSource`,
registered by the runtime's :class:`~memmode_core.engine.serving.Serving` part, which it calls back (held
weakly: a model dropped without ``remove()`` is freed). Asked for the value, it gives:

* **inside a call** of one of the runtime's components (a parent module reading a child's weight): the tensor
  itself, its group onloaded into the call (:meth:`Serves.onload_for_read`);
* **outside any call**: a host copy or a mapping at rest, read where it is (:meth:`SlotSource.usable`), else
  the value read from the storage (:meth:`SlotSource.value`), never NaN;
* **for a write**: the tensor made to hold memory the write may change — onloaded into the call, or given
  memory of its own holding the value (:meth:`SlotSource.make_writable`) — and the component is stored anew
  at its next call.

A tensor whose stored copy was lost (``remove()`` raised :class:`~memmode_core.contracts.errors.RestoreError`)
is served by a :class:`LostSource`, which refuses every read, naming it.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

from memmode_core.contracts.errors import OffloadedWeightReadError
from memmode_core.contracts.inner_tensors import is_wrapper
from memmode_core.contracts.storage import is_placeholder
from memmode_core.engine.groups import Group, Slot
from memmode_core.engine.standins.classes import (
    PLAIN_CLASS,
    StandInReader,
    StandInSource,
    forget,
    is_stand_in,
    raw,
)
from memmode_core.engine.standins.values import value_of
from memmode_core.engine.state import EngineState

_DISABLE = torch._C.DisableTorchFunctionSubclass


class Serves(Protocol):
    """What a :class:`SlotSource` calls back: the runtime's :class:`~memmode_core.engine.serving.Serving` part."""

    state: EngineState

    def in_call(self) -> bool: ...

    def onload_for_read(self, source: SlotSource, reader: StandInReader) -> None: ...

    def serve(self, source: SlotSource, reader: StandInReader) -> torch.Tensor: ...

    def give_own_memory(self, source: SlotSource) -> None: ...


class SlotSource(StandInSource):
    """What serves one resting slot of a runtime (its serving part held weakly: a model dropped without
    ``remove()`` is freed)."""

    __slots__ = ("_serving", "group", "slot", "name", "what")

    def __init__(self, serving: Serves, group: Group, slot: Slot, name: str, what: str) -> None:
        self._serving = weakref.ref(serving)
        self.group = group
        self.slot = slot
        self.name = name
        self.what = what

    def _live(self) -> Serves:
        serving = self._serving()
        if serving is None or serving.state.removed:
            raise OffloadedWeightReadError(
                f"{self.name} rested {self.what} under a placement that is gone (the model was dropped or the "
                f"placement removed while this tensor was held), so its value cannot be read"
            )
        return serving

    def usable(self, reader: StandInReader) -> torch.Tensor | None:
        tensor = self.slot.tensor
        if type(tensor) not in PLAIN_CLASS:  # awake: onloaded, or given a value of its own
            return tensor
        serving = self._live()
        state = serving.state
        with state.lock:
            if type(tensor) not in PLAIN_CLASS:
                return tensor
            if serving.in_call():
                serving.onload_for_read(self, reader)
                return tensor
            at_rest = self.group.at_rest.get(self.slot.name)
            if at_rest is not None and not is_placeholder(at_rest):
                for part in self.group.parts:  # a mapped file truncated since is a typed error, never a SIGBUS
                    state.session.check(part.key)
                # its data holds the values (a host copy, a mapping): read where it is; a library's wrapper subclass
                # as its own class over the same inner tensors (its dispatch is its own, not the stand-in's)
                return raw(tensor) if is_wrapper(tensor) else tensor
        return None

    def value(self, reader: StandInReader) -> torch.Tensor:
        serving = self._live()
        with serving.state.lock:
            return serving.serve(self, reader)

    def write(self, func, name: str, args: tuple, kwargs: dict, target: torch.Tensor) -> Any:
        # a host copy at rest is written where it is (what the next onload copies from)
        tensor = self.make_writable()
        with _DISABLE():
            data = tensor.data
        swapped = pytree_swap(target, data, (args, kwargs))
        with _DISABLE():
            result = func(*swapped[0], **swapped[1])
        if name == "__setitem__":
            return None
        if result is data or result is tensor:
            return target if type(target) is type(tensor) else data
        return result

    def replaced(self) -> None:
        serving = self._serving()
        if serving is not None:
            serving.state.mark_changed(self.group.component)

    def make_writable(self) -> torch.Tensor:
        serving = self._live()
        state = serving.state
        tensor = self.slot.tensor
        with state.lock:
            if type(tensor) in PLAIN_CLASS:
                at_rest = self.group.at_rest.get(self.slot.name)
                if serving.in_call():
                    serving.onload_for_read(self, StandInReader("write", None, counted=False))
                elif at_rest is None or is_placeholder(at_rest):
                    serving.give_own_memory(self)
        return tensor

    def same(self, other: StandInSource | None) -> bool:
        return isinstance(other, SlotSource) and other.slot is self.slot


def pytree_swap(target: torch.Tensor, replacement: torch.Tensor, tree):
    """``tree`` with ``target`` replaced by ``replacement`` and every other stand-in by its value (an operand
    resting offloaded, or a quantized weight: never its raw placeholder)."""
    from torch.utils._pytree import tree_map

    def swap(leaf):
        if leaf is target:
            return replacement
        return value_of(leaf, "write") if is_stand_in(leaf) else leaf

    return tree_map(swap, tree)


class LostSource(StandInSource):
    """A tensor whose stored copy was lost (``remove()`` raised :class:`RestoreError` for its group): every read
    is refused, naming it; a whole new value (``p.copy_(x)``, ``p.data = x``, ``load_state_dict``) brings it
    back."""

    def __init__(self, name: str, why: str) -> None:
        self.name = name
        self.what = "lost"
        self._why = why

    def _refuse(self) -> OffloadedWeightReadError:
        return OffloadedWeightReadError(
            f"{self.name} has no value: remove() could not restore it ({self._why}); load the weights again"
        )

    def usable(self, reader: StandInReader) -> torch.Tensor | None:
        raise self._refuse()

    def value(self, reader: StandInReader) -> torch.Tensor:
        raise self._refuse()

    def write(self, func, name: str, args: tuple, kwargs: dict, target: torch.Tensor) -> Any:
        tensor = target
        whole = name in ("copy_", "__set__:data") and len(args) > 1 and isinstance(args[1], torch.Tensor)
        if type(tensor) not in PLAIN_CLASS or not whole or args[1].shape != tensor.shape:
            raise self._refuse()
        forget(tensor)
        with _DISABLE():
            tensor.data = torch.empty(tensor.shape, dtype=tensor.dtype)
            tensor.data.copy_(value_of(args[1]))
        return tensor
