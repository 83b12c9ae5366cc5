"""Serving reads of resting tensors: the engine's side of :mod:`memmode_core.engine.standins`.

The :class:`Serving` part of the :class:`~memmode_core.engine.runtime.Runtime`. When a group goes to rest,
each of its tensors whose data is not what the model computes with — a storage's placeholder (``disk``),
or a host copy while the model computes on an accelerator — rests as a stand-in
(:func:`~memmode_core.engine.standins.rest_served`) served by a :class:`SlotSource`. A read then gets:

* **inside a call** of one of the runtime's components (a parent module reading a child's weight: an
  attention pool's ``q_proj.weight``, ``nn.MultiheadAttention``'s ``out_proj.weight``): the group,
  onloaded as the child's own forward would have onloaded it (prefetch, books, device and all). The
  module whose forward read it is *learned*: when the call returns, that module enters and exits the
  group from then on, so later calls onload it before the reader runs and nothing stands in any more;
* **outside any call** (``state_dict()``, ``save_pretrained``, a script): a host copy that is already
  there is read as it is; otherwise the value is read from the storage (:meth:`StorageSession.read
  <memmode_core.contracts.storage.StorageSession.read>`), never NaN;
* **a write** outside any call: the tensor gets its own memory holding the value, the write lands there,
  and the component stores it anew at its next call (as for a parameter replaced at rest).

Every served read is counted in the ledger (``reads_served``, ``bytes_served``); under ``strict`` it is
refused (:class:`~memmode_core.contracts.errors.StandInReadError`), naming the tensor and the code.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch
from torch import nn

from memmode_core.contracts.errors import OffloadedWeightReadError, StandInReadError
from memmode_core.contracts.layout import Policy
from memmode_core.contracts.storage import is_placeholder
from memmode_core.engine import standins
from memmode_core.engine.groups import Group, Slot
from memmode_core.engine.sources import Reader, Source
from memmode_core.engine.standin_values import value_of

logger = logging.getLogger("memmode")

_DISABLE = torch._C.DisableTorchFunctionSubclass


class SlotSource(Source):
    """What serves one resting slot of a runtime (held weakly: a model dropped without ``remove()`` is freed)."""

    __slots__ = ("_runtime", "group", "slot", "name", "what")

    def __init__(self, runtime: Serving, group: Group, slot: Slot, name: str, what: str) -> None:
        self._runtime = weakref.ref(runtime)
        self.group = group
        self.slot = slot
        self.name = name
        self.what = what

    def _live(self) -> Serving:
        runtime = self._runtime()
        if runtime is None or runtime._removed_runtime:
            raise OffloadedWeightReadError(
                f"{self.name} rested {self.what} under a placement that is gone (the model was dropped or the "
                f"placement removed while this tensor was held), so its value cannot be read"
            )
        return runtime

    def usable(self, reader: Reader) -> torch.Tensor | None:
        tensor = self.slot.tensor
        if type(tensor) not in standins.PLAIN_CLASS:  # awake: onloaded, or given a value of its own
            return tensor
        runtime = self._live()
        with runtime.lock:
            if type(tensor) not in standins.PLAIN_CLASS:
                return tensor
            if any(runtime._depth.values()):
                runtime.onload_for_read(self, reader)
                return tensor
            at_rest = self.group.at_rest.get(self.slot.name)
            if at_rest is not None and not is_placeholder(at_rest):
                for part in self.group.parts:  # a mapped file truncated since is a typed error, never a SIGBUS
                    runtime.session.check(part.key)
                return tensor  # its data holds the values (a host copy, a mapping): read where it is
        return None

    def value(self, reader: Reader) -> torch.Tensor:
        runtime = self._live()
        with runtime.lock:
            return runtime.serve(self, reader)

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
        runtime = self._runtime()
        if runtime is not None:
            runtime._mark_changed(self.group.component)

    def make_writable(self) -> torch.Tensor:
        runtime = self._live()
        tensor = self.slot.tensor
        with runtime.lock:
            if type(tensor) in standins.PLAIN_CLASS:
                at_rest = self.group.at_rest.get(self.slot.name)
                if any(runtime._depth.values()):
                    runtime.onload_for_read(self, Reader("write", None, counted=False))
                elif at_rest is None or is_placeholder(at_rest):
                    runtime.give_own_memory(self)
        return tensor

    def same(self, other: Source | None) -> bool:
        return isinstance(other, SlotSource) and other.slot is self.slot


def pytree_swap(target: torch.Tensor, replacement: torch.Tensor, tree):
    """``tree`` with ``target`` replaced by ``replacement`` and every other stand-in by its value (an operand
    resting offloaded, or a quantized weight: never its raw placeholder)."""
    from torch.utils._pytree import tree_map

    def swap(leaf):
        if leaf is target:
            return replacement
        return value_of(leaf, "write") if standins.is_stand_in(leaf) else leaf

    return tree_map(swap, tree)


class LostSource(Source):
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

    def usable(self, reader: Reader) -> torch.Tensor | None:
        raise self._refuse()

    def value(self, reader: Reader) -> torch.Tensor:
        raise self._refuse()

    def write(self, func, name: str, args: tuple, kwargs: dict, target: torch.Tensor) -> Any:
        tensor = target
        whole = name in ("copy_", "__set__:data") and len(args) > 1 and isinstance(args[1], torch.Tensor)
        if type(tensor) not in standins.PLAIN_CLASS or not whole or args[1].shape != tensor.shape:
            raise self._refuse()
        standins.forget(tensor)
        with _DISABLE():
            tensor.data = torch.empty(tensor.shape, dtype=tensor.dtype)
            tensor.data.copy_(value_of(args[1]))
        return tensor


class Serving:
    """Resting tensors as stand-ins, and the reads and writes they serve; part of the runtime (its groups,
    storage session, moving, change detection and hooks)."""

    def _init_serving(self, *, strict: bool, storage: str | None) -> None:
        #: refuse every served read (``apply(..., strict=True)``)
        self.strict_reads = strict
        self._storage_name = storage or "its storage"
        #: at rest, a host copy is not what the model computes with (an accelerator), or may break behind the
        #: session's back (a mapped file): it rests as a stand-in
        self._host_rest_stands_in = not self.streams.is_host(self.device) or bool(
            getattr(self.session, "at_rest_can_break", False)
        )
        #: component -> (module whose forward read a resting group, that group), applied when the call returns
        self._learned: dict[str, list[tuple[nn.Module, Group]]] = {}
        self._warned_reads = False
        self._removed_runtime = False
        #: id(resting tensor) -> what serves it
        self._sources: dict[int, SlotSource] = {}

    # -- resting ------------------------------------------------------------------------------------------

    def rest_as_stand_ins(self, group: Group) -> None:
        """After ``group.rest(...)``: each slot whose at-rest data is not usable where the model computes rests as
        a stand-in; the others stay plain."""
        qualify = len(self.components) > 1
        for slot in group.slots:
            at_rest = group.at_rest.get(slot.name)
            placeholder = at_rest is not None and is_placeholder(at_rest)
            if not (placeholder or self._host_rest_stands_in) or not standins.can_serve(slot.tensor):
                slot.served = None
                continue
            plain = standins.PLAIN_CLASS.get(type(slot.tensor), type(slot.tensor))
            slot.plain, slot.served = plain, standins.SERVED_CLASS[plain]
            group.stand_ins.append((slot.tensor, plain, slot.served))
            name = slot.name if qualify else f"{group.component}.{slot.name}"
            where = "offloaded to " + self._storage_name
            key = id(slot.tensor)
            self._sources[key] = SlotSource(
                self, group, slot, name, where + (" (a placeholder at rest)" if placeholder else "")
            )
            standins.rest_served(slot.tensor, functools.partial(_source_in, weakref.ref(self), key))

    def unservable(self, group: Group, at_rest: dict[str, torch.Tensor]) -> str | None:
        """The first slot whose at-rest value is a placeholder and whose tensor class cannot rest as a stand-in."""
        for slot in group.slots:
            value = at_rest.get(slot.name)
            if value is not None and is_placeholder(value) and not standins.can_serve(slot.tensor):
                return f"{slot.name} ({type(slot.tensor).__name__})"
        return None

    def wake_all(self, group: Group) -> None:
        """``group`` leaves the engine (``remove()``, a rebuild): its tensors are plain and unregistered."""
        for slot in group.slots:
            standins.forget(slot.tensor)
            self._sources.pop(id(slot.tensor), None)
            slot.served = None
        group.stand_ins = []

    def rest_lost(self, group: Group, why: str) -> None:
        """``group``'s stored copy is lost: its tensors stand in for nothing, and every read says so."""
        for slot in group.slots:
            if not standins.can_serve(slot.tensor):
                continue
            name = slot.name if len(self.components) > 1 else f"{group.component}.{slot.name}"
            standins.rest_lost(slot.tensor, LostSource(name, why))

    # -- reads ----------------------------------------------------------------------------------------------

    def _count(self, source: SlotSource | Source, nbytes: int, reader: Reader) -> None:
        if not reader.counted:
            return
        if self.strict_reads:
            raise StandInReadError(
                f"{source.name} ({source.what}) was read by {reader.code()} ({reader.operation}) outside the forward "
                f"of the module that owns it. memmode would serve it (onload it, read it from the storage or "
                f"dequantize it); strict=True refuses instead. Read weights inside the owning module's forward, "
                f"or apply without strict=True (served reads are then counted in report().reads_served)"
            )
        self.ledger.served(nbytes, source.name)
        if not self._warned_reads:
            self._warned_reads = True
            logger.info(
                "memmode: %s (%s) read by %s outside the forward of its module: served, and counted in "
                "report().reads_served (strict=True refuses such reads)",
                source.name,
                source.what,
                reader.code(),
            )

    def count_read(self, source: Source, nbytes: int, reader: Reader) -> None:
        """A read served by a stand-in of another kind (a quantized weight, dequantized): counted, or refused."""
        with self.lock:
            self._count(source, nbytes, reader)

    def serve(self, source: SlotSource, reader: Reader) -> torch.Tensor:
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
                self.session.check(part.key)
                with _DISABLE():
                    return self.session.read(part.key, stored)
        raise KeyError(name)

    def onload_for_read(self, source: SlotSource, reader: Reader) -> None:
        """A call reads a resting group's tensor: onload the group into the call, and learn the module that read it."""
        group = source.group
        self._count(source, group.nbytes, reader)
        self.ensure(group)
        if reader._frame is None:
            return
        members = self._member_of
        module = reader.module(lambda m: members.get(id(m)) == group.component)
        if module is not None and module not in group.entries:
            learned = self._learned.setdefault(group.component, [])
            if (module, group) not in learned:
                learned.append((module, group))

    def apply_learned(self, component: str) -> None:
        """At the end of a call: each module that read a resting group enters it from now on, and the group
        leaves when that module's forward returns (not when one of the modules inside it does)."""
        learned = self._learned.pop(component, None)
        if not learned:
            return
        live = set(map(id, self._groups_of.get(component, ())))
        for module, group in learned:
            if id(group) not in live or module in group.entries:
                continue
            group.entries.append(module)
            if group.policy is Policy.STREAM:  # it leaves when the reader is done, not when a module inside it is
                inside = {id(m) for m in module.modules()}
                group.exits = [m for m in group.exits if id(m) not in inside] + [module]
        retired = self._remove_hooks(component)
        self._install_hooks(component, retired)

    # -- writes ---------------------------------------------------------------------------------------------

    def give_own_memory(self, source: SlotSource) -> None:
        """A write into a resting slot whose data is a placeholder: the slot gets its value in memory of its own
        (the write lands there) and is stored anew at its component's next call."""
        slot = source.slot
        value = self.read_stored(source.group, slot.name).clone()
        standins.forget(slot.tensor)
        with _DISABLE():
            slot.tensor.data = value
        self._mark_changed(source.group.component)


def _source_in(runtime: weakref.ref, key: int, tensor: torch.Tensor) -> SlotSource | None:
    serving = runtime()
    source = serving._sources.get(key) if serving is not None else None
    return source if source is not None and source.slot.tensor is tensor else None


def slot_bytes(slot: Slot) -> int:
    with _DISABLE():
        return slot.tensor.numel() * slot.tensor.element_size()
