"""Serving reads of resting tensors: the engine's part of the stand-ins (:mod:`memmode_core.engine.standins`).

The :class:`Serving` part of the :class:`~memmode_core.engine.runtime.Runtime` (it needs the runtime's
:class:`~memmode_core.engine.state.EngineState` and its :class:`~memmode_core.engine.moving.Moving` part).
When a group goes to rest, each of its tensors whose data is not what the model computes with — a storage's
placeholder (``disk``), or a host copy while the model computes on an accelerator — rests as a stand-in
(:func:`~memmode_core.engine.standins.classes.rest_served`) served by a
:class:`~memmode_core.engine.standins.slots.SlotSource`, which calls this part back. A read then gets:

* **inside a call** of one of the runtime's components (a parent module reading a child's weight: an
  attention pool's ``q_proj.weight``, ``nn.MultiheadAttention``'s ``out_proj.weight``): the group,
  onloaded as the child's own forward would have onloaded it (prefetch, books, device and all). The
  module whose forward read it is *learned*: when the call returns, that module enters and exits the
  group from then on (:meth:`Serving.apply_learned`), so later calls onload it before the reader runs and
  nothing stands in any more;
* **outside any call** (``state_dict()``, ``save_pretrained``, a script): a host copy that is already
  there is read as it is; otherwise the value is read from the storage (:meth:`StorageSession.read
  <memmode_core.contracts.storage.StorageSession.read>`), never NaN;
* **a write** outside any call: the tensor gets its own memory holding the value, the write lands there,
  and the component is stored anew at its next call (as for a parameter replaced at rest).

Every served read is counted in the ledger (``reads_served``, ``bytes_served``); under ``strict`` it is
refused (:class:`~memmode_core.contracts.errors.StandInReadError`), naming the tensor and the code.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch
from torch import nn

from memmode_core.contracts.errors import StandInReadError
from memmode_core.contracts.group_specs import Policy
from memmode_core.contracts.inner_tensors import stored_bytes
from memmode_core.contracts.storage import is_placeholder
from memmode_core.engine.flattened import map_leaves
from memmode_core.engine.groups import Group, Slot, set_data
from memmode_core.engine.moving import Moving
from memmode_core.engine.standins.classes import (
    PLAIN_CLASS,
    StandInReader,
    StandInSource,
    can_serve,
    forget,
    rest_lost,
    rest_served,
    served_class,
)
from memmode_core.engine.standins.slots import LostSource, SlotSource
from memmode_core.engine.state import EngineState

logger = logging.getLogger("memmode")

_DISABLE = torch._C.DisableTorchFunctionSubclass


class Serving:
    """Resting tensors as stand-ins, and the reads and writes they serve, for the groups of ``state``; it onloads
    a group into a running call through ``moving``. ``strict``: refuse every served read."""

    def __init__(self, state: EngineState, moving: Moving, *, strict: bool = False) -> None:
        self.state = state
        self.moving = moving
        #: refuse every served read (``apply(..., strict=True)``)
        self.strict_reads = strict
        #: at rest, a host copy is not what the model computes with (an accelerator), or may break behind the
        #: session's back (a mapped file): it rests as a stand-in
        self._host_rest_stands_in = not state.streams.is_host(state.device) or bool(
            getattr(state.session, "at_rest_can_break", False)
        )
        #: component -> (module whose forward read a resting group, that group), applied when the call returns
        #: (:meth:`apply_learned`)
        self.learned: dict[str, list[tuple[nn.Module, Group]]] = {}
        self._warned_reads = False
        #: id(resting tensor) -> what serves it
        self._sources: dict[int, SlotSource] = {}

    # -- resting ------------------------------------------------------------------------------------------

    def rest_as_stand_ins(self, group: Group) -> None:
        """After ``group.rest(...)``: each slot whose at-rest data is not usable where the model computes rests as
        a stand-in; the others stay plain."""
        qualify = len(self.state.components) > 1
        for slot in group.slots:
            at_rest = group.at_rest.get(slot.name)
            placeholder = at_rest is not None and is_placeholder(at_rest)
            if not (placeholder or self._host_rest_stands_in) or not can_serve(slot.tensor):
                slot.served = None
                continue
            plain = PLAIN_CLASS.get(type(slot.tensor), type(slot.tensor))
            slot.plain, slot.served = plain, served_class(plain)
            group.stand_ins.append((slot.tensor, plain, slot.served))
            name = slot.name if qualify else f"{group.component}.{slot.name}"
            where = "offloaded to " + self.state.storage_name
            key = id(slot.tensor)
            self._sources[key] = SlotSource(
                self, group, slot, name, where + (" (a placeholder at rest)" if placeholder else "")
            )
            rest_served(slot.tensor, functools.partial(_source_in, weakref.ref(self), key))

    def unservable(self, group: Group, at_rest: dict[str, torch.Tensor]) -> str | None:
        """The first slot whose at-rest value is a placeholder and whose tensor class cannot rest as a stand-in."""
        for slot in group.slots:
            value = at_rest.get(slot.name)
            if value is not None and is_placeholder(value) and not can_serve(slot.tensor):
                return f"{slot.name} ({type(slot.tensor).__name__})"
        return None

    def wake_all(self, group: Group) -> None:
        """``group`` leaves the engine (``remove()``, a rebuild): its tensors are plain and unregistered."""
        for slot in group.slots:
            forget(slot.tensor)
            self._sources.pop(id(slot.tensor), None)
            slot.served = None
        group.stand_ins = []

    def rest_lost(self, group: Group, why: str) -> None:
        """``group``'s stored copy is lost: its tensors stand in for nothing, and every read says so."""
        for slot in group.slots:
            if not can_serve(slot.tensor):
                continue
            name = slot.name if len(self.state.components) > 1 else f"{group.component}.{slot.name}"
            rest_lost(slot.tensor, LostSource(name, why))

    # -- reads ----------------------------------------------------------------------------------------------

    def in_call(self) -> bool:
        """Whether a call of one of the components is running now (a read then onloads into it)."""
        return self.moving.in_call()

    def _count(self, source: SlotSource | StandInSource, nbytes: int, reader: StandInReader) -> None:
        if not reader.counted:
            return
        if self.strict_reads:
            raise StandInReadError(
                f"{source.name} ({source.what}) was read by {reader.code()} ({reader.operation}) outside the forward "
                f"of the module that owns it. memmode would serve it (onload it, read it from the storage or "
                f"dequantize it); strict=True refuses instead. Read weights inside the owning module's forward, "
                f"or apply without strict=True (served reads are then counted in report().reads_served)"
            )
        self.state.ledger.served(nbytes, source.name)
        if not self._warned_reads:
            self._warned_reads = True
            logger.info(
                "memmode: %s (%s) read by %s outside the forward of its module: served, and counted in "
                "report().reads_served (strict=True refuses such reads)",
                source.name,
                source.what,
                reader.code(),
            )

    def count_read(self, source: StandInSource, nbytes: int, reader: StandInReader) -> None:
        """A read served by a stand-in of another kind (a quantized weight, dequantized): counted, or refused."""
        with self.state.lock:
            self._count(source, nbytes, reader)

    def serve(self, source: SlotSource, reader: StandInReader) -> torch.Tensor:
        """The value of a resting slot, read from the storage (on the CPU)."""
        slot, group = source.slot, source.group
        self._count(source, slot_bytes(slot), reader)
        return self.read_stored(group, slot.name)

    def read_stored(self, group: Group, name: str) -> torch.Tensor:
        """One tensor of a resting group, as its storage holds it (checked first: a broken file is a typed error)."""
        for part in group.parts:
            stored = name
            if part.rename:
                stored = {now: then for then, now in part.rename.items()}.get(name, name)
            if stored in part.names:
                self.state.session.check(part.key)
                with _DISABLE():
                    return self.state.session.read(part.key, stored)
        raise KeyError(name)

    def onload_for_read(self, source: SlotSource, reader: StandInReader) -> None:
        """A call reads a resting group's tensor: onload the group into the call, and learn the module that read it."""
        group = source.group
        self._count(source, group.nbytes, reader)
        self.moving.ensure(group)
        if reader.frame is None:
            return
        members = self.state.member_of
        module = reader.module(lambda m: members.get(id(m)) == group.component)
        if module is not None and module not in group.entries:
            learned = self.learned.setdefault(group.component, [])
            if (module, group) not in learned:
                learned.append((module, group))

    def apply_learned(self, component: str) -> bool:
        """At the end of a call: each module that read a resting group enters it from now on, and the group
        leaves when that module's forward returns (not when one of the modules inside it does). Returns whether
        ``component`` had learned readers: its hooks are then installed again
        (:meth:`Forwards.relearn <memmode_core.engine.forwards.Forwards.relearn>`)."""
        learned = self.learned.pop(component, None)
        if not learned:
            return False
        live = set(map(id, self.state.groups_of.get(component, ())))
        for module, group in learned:
            if id(group) not in live or module in group.entries:
                continue
            group.entries.append(module)
            if group.policy is Policy.STREAM:  # it leaves when the reader is done, not when a module inside it is
                inside = {id(m) for m in module.modules()}
                group.exits = [m for m in group.exits if id(m) not in inside] + [module]
        return True

    # -- writes ---------------------------------------------------------------------------------------------

    def give_own_memory(self, source: SlotSource) -> None:
        """A write into a resting slot whose data is a placeholder: the slot gets its value in memory of its own
        (the write lands there) and is stored anew at its component's next call."""
        slot = source.slot
        value = map_leaves(self.read_stored(source.group, slot.name), torch.clone)
        forget(slot.tensor)
        with _DISABLE():
            set_data(slot.tensor, value)
        self.state.mark_changed(source.group.component)


def _source_in(serving_ref: weakref.ref, key: int, tensor: torch.Tensor) -> SlotSource | None:
    serving = serving_ref()
    source = serving._sources.get(key) if serving is not None else None
    return source if source is not None and source.slot.tensor is tensor else None


def slot_bytes(slot: Slot) -> int:
    return stored_bytes(slot.tensor)
