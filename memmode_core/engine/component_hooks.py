"""The hooks the engine installs on a component's modules and on the weight-editing methods: what runs when a
placed module's forward, a component's entry method or an editing method is called.

The :class:`~memmode_core.engine.forwards.Forwards` part installs and removes them (see there for which module
gets which) and is what they call back (:class:`Calls`), with the parts it holds: ``moving`` (onloads, offloads,
the nesting of calls) and ``changes`` (the one owner of rebuilds and edits, handed the ``Forwards`` whose hooks it
takes off and puts back). Each is a named hook (:mod:`~memmode_core.engine.hooks`):

* ``memmode.groups`` (:class:`GroupHook`, :class:`GroupsHook`) on a module inside a component:
  onload the groups it enters before its forward, offload the streamed groups it exits after;
* ``memmode.component_entry`` (:class:`ComponentEntryHook`) on a component's root: one call of the
  component at a time (the runtime's lock), its groups rebuilt first if its weights changed
  (:meth:`Changes.rebuild_if_changed <memmode_core.engine.changes.Changes.rebuild_if_changed>`), the call
  entered (:meth:`Moving.enter <memmode_core.engine.moving.Moving.enter>`) and counted, and on return whatever
  it left on the device offloaded (its own exit is that leave step);
* ``memmode.entry_method:<name>`` (:class:`EntryMethodHook`) on the component's other entry points
  (:func:`~memmode_core.engine.forwards.entry_methods`): called from outside the component it enters it as
  the forward does, called from inside it is the method itself;
* ``memmode.weight_edit:<name>`` (:class:`WeightEditHook`) on the weight-editing methods of the
  pipeline and the components: offload before, rebuild after (:meth:`Changes.editing
  <memmode_core.engine.changes.Changes.editing>`).

A leaf's hook is the hot path of a placed model: one frame, a few attribute reads (its own slots) per call.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from memmode_core.contracts.errors import OffloadedWeightReadError
from memmode_core.engine.changes import Changes
from memmode_core.engine.groups import Group, module_path
from memmode_core.engine.hooks import MethodWrapper
from memmode_core.engine.inputs import move_inputs
from memmode_core.engine.moving import Moving
from memmode_core.engine.state import EngineState

#: component calls remembered for the report (a long video run makes a few thousand)
MAX_RECORDED_CALLS = 100_000


class Calls(Protocol):
    """What the hooks call back: the runtime's :class:`~memmode_core.engine.forwards.Forwards` part (which is also
    the :class:`~memmode_core.engine.changes.Rehooking` a rebuild or an edit is handed)."""

    state: EngineState
    moving: Moving
    changes: Changes
    calls: list[str]

    def leave(self, component: str) -> None: ...

    def offloaded_read(self, module: nn.Module, error: RuntimeError) -> OffloadedWeightReadError: ...

    def remove_hooks(self, component: str) -> list: ...

    def install_hooks(self, component: str, retired: Iterable = ()) -> None: ...

    def wrapped_over(self, component: str) -> bool: ...


def _keys(groups: Iterable[Group], shown: int = 4) -> str:
    keys = [group.key for group in groups]
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return (", ".join(keys[:shown]) + more) or "nothing"


class GroupsHook(MethodWrapper):
    """``memmode.groups``: onload the groups ``owner`` enters before its forward, offload those it exits after
    (the streamed ones: a resident group stays)."""

    kind = "memmode.groups"
    default_method = "forward"
    __slots__ = ("forwards", "enters", "exits", "ensure", "offload", "move", "device")

    def __init__(
        self, forwards: Calls, module: nn.Module, enters: list[Group], exits: list[Group], method: str = "forward"
    ):
        super().__init__(module, method)
        self.forwards = forwards
        self.enters = enters
        self.exits = exits
        self.ensure = forwards.moving.ensure
        self.offload = forwards.moving.offload
        self.device = forwards.state.device
        self.move = self.device.type != "cpu"  # on a CPU device every input already is where it computes

    def __call__(self, *args, **kwargs):
        if not self.active:
            return self.passthrough()(*args, **kwargs)
        return self._step(args, kwargs)

    def _step(self, args, kwargs):
        try:
            for group in self.enters:
                if group.needs_ensure():
                    self.ensure(group)
            if self.move and (moved := move_inputs(args, kwargs, self.device)) is not None:
                args, kwargs = moved
            return self.original(*args, **kwargs)
        except RuntimeError as exc:
            if is_device_mismatch(exc):
                raise self.forwards.offloaded_read(self.owner, exc) from exc
            raise
        finally:
            for group in self.exits:
                if group.resident and group.ready_event is None:
                    self.offload(group)

    def where(self) -> str:
        return module_path(self.forwards.state.components, self.owner)

    def describe(self) -> str:
        return f"onloads {_keys(self.enters)} before, offloads {_keys(self.exits)} after"


class GroupHook(GroupsHook):
    """``memmode.groups`` in the common case (a leaf, or a single block): one group, entered and exited by
    ``owner``; one frame, a few attribute reads per call."""

    __slots__ = ("group",)

    def __init__(
        self, forwards: Calls, module: nn.Module, enters: list[Group], exits: list[Group], method: str = "forward"
    ):
        super().__init__(forwards, module, enters, exits, method)
        (self.group,) = enters

    def __call__(self, *args, **kwargs):
        if not self.active:
            return self.passthrough()(*args, **kwargs)
        group = self.group
        if group.needs_ensure():
            self.ensure(group)
        if self.move and (moved := move_inputs(args, kwargs, self.device)) is not None:
            args, kwargs = moved
        try:
            return self.original(*args, **kwargs)
        except RuntimeError as exc:
            if is_device_mismatch(exc):
                raise self.forwards.offloaded_read(self.owner, exc) from exc
            raise
        finally:
            if group.resident and group.ready_event is None:
                self.offload(group)


class ComponentEntryHook(GroupsHook):
    """``memmode.component_entry``, on a component's root: a call of the component (see the module docstring)."""

    kind = "memmode.component_entry"
    __slots__ = ("component", "changes", "depth", "begin", "calls", "lock", "leave")

    def __init__(
        self, forwards: Calls, module: nn.Module, enters: list[Group], component: str, method: str = "forward"
    ):
        super().__init__(forwards, module, enters, [], method)  # its exit is the leave step
        self.component = component
        self.changes = forwards.changes
        self.depth = forwards.moving.depth  # read-only: the nesting of calls is Moving's
        self.begin = forwards.moving.enter
        self.calls = forwards.calls
        self.lock = forwards.state.lock
        self.leave = forwards.leave

    def enter(self, *args, **kwargs):
        if not self.active:
            return self.passthrough()(*args, **kwargs)
        changes, component, depth = self.changes, self.component, self.depth
        with self.lock:  # one call of this handle's components at a time (see the module docstring)
            if not depth[component] and changes.rebuild_if_changed(component, self.forwards):
                return getattr(self.owner, self.method)(*args, **kwargs)  # through the rebuilt wrappers
            if self.begin(component) and len(self.calls) < MAX_RECORDED_CALLS:
                self.calls.append(component)
            try:
                result = self._step(args, kwargs)
            finally:
                self.leave(component)
            if changes.check_results and not depth[component]:
                changes.explain_if_non_finite(component, self.owner, self.method, args, kwargs, result)
            return result

    __call__ = enter

    def where(self) -> str:
        return self.component

    def describe(self) -> str:
        return (
            f"enters component {self.component!r}: rebuilds its groups if its weights changed, onloads "
            f"{_keys(self.enters)}; on return offloads the streamed groups it left on the device"
        )


class EntryMethodHook(ComponentEntryHook):
    """``memmode.entry_method:<name>``: a component's entry method other than ``forward``. Called from outside
    the component it enters it as the forward does; called from inside (the component is entered) it is the
    method itself, traceable by torch.compile without a graph break (so only the entering path is eager)."""

    kind = "memmode.entry_method"
    default_method = None
    eager = False
    __slots__ = ("_enter",)

    def install(self) -> EntryMethodHook:
        self._enter = torch.compiler.disable(self.enter, recursive=False)
        return super().install()

    def __call__(self, *args, **kwargs):
        if not self.active:
            return self.passthrough()(*args, **kwargs)
        if self.depth[self.component]:
            return self.original(*args, **kwargs)
        return self._enter(*args, **kwargs)

    def describe(self) -> str:
        return (
            f"called from outside component {self.component!r}, enters it as its forward does (onloads "
            f"{_keys(self.enters)}); from inside, calls the method itself"
        )


class WeightEditHook(MethodWrapper):
    """``memmode.weight_edit:<name>``, on a method that adds, removes or rewrites weights (``watch.EDIT_METHODS``):
    runs it inside :meth:`Changes.editing <memmode_core.engine.changes.Changes.editing>` of ``components``."""

    kind = "memmode.weight_edit"
    __slots__ = ("forwards", "components")

    def __init__(self, forwards: Calls, owner: object, method: str, components: list[str]):
        super().__init__(owner, method)
        self.forwards = forwards
        self.components = components

    def __call__(self, *args, **kwargs):
        if not self.active:
            return self.passthrough()(*args, **kwargs)
        forwards = self.forwards
        with forwards.state.lock, forwards.changes.editing(self.components, self.method, forwards):
            return self.original(*args, **kwargs)

    def describe(self) -> str:
        its = "its" if len(self.components) == 1 else "their"
        return f"offloads {', '.join(self.components)} before the edit, rebuilds {its} groups after"


#: what torch says when one operation gets tensors on two devices
_DEVICE_MISMATCH = ("Expected all tensors to be on the same device", "found at least two devices")


def is_device_mismatch(error: BaseException) -> bool:
    message = str(error)
    return any(text in message for text in _DEVICE_MISMATCH)
