"""The group data model: which tensors move together, and where each one is registered.

A *group* (see :class:`~memmode_core.contracts.group_specs.GroupSpec` for what a placement asks for) is the
unit the engine onloads and offloads. Here it becomes concrete: :func:`claim_groups` turns a
placement's specs into :class:`Group` objects holding :class:`Slot` s, one per parameter or buffer,
each tensor claimed exactly once (tied tensors merge the groups that reach them), and a group's
stored copy is kept as one or more :class:`Part` s of the storage session.

Everything else in the engine reads this model: moving (:mod:`~memmode_core.engine.moving`) swaps a
slot's ``.data``, change detection (:mod:`~memmode_core.engine.changes`) compares a slot's
registration and data address with what was recorded here. Kept apart from the :class:`Runtime`
so that groups can be claimed (and sized by the planner) without one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from memmode_core.contracts.group_specs import GroupSpec, Policy
from memmode_core.contracts.inner_tensors import is_wrapper, stored_bytes, unstorable
from memmode_core.contracts.storage import Tensors
from memmode_core.engine.standins.classes import PLAIN_CLASS

#: engine code reading what a resting stand-in holds, not the value it serves
_RAW = torch._C.DisableTorchFunctionSubclass


def set_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Give the registered ``tensor`` the data ``value``, keeping the object (its identity, class, attributes and
    ``requires_grad``): ``tensor.data = value``.

    A wrapper subclass (a library's quantized weight, :mod:`memmode_core.contracts.inner_tensors`) holds its values
    in its inner tensors, which ``.data =`` leaves as they were: it takes ``value``'s inner tensors, by the attribute
    names its flatten protocol gives, and ``.data =`` only where its own metadata changes (another device: CPU and
    CUDA wrappers are both dense, ``TensorImpl::has_compatible_shallow_copy_type``), outside inference mode, in
    which torch asks the library's dispatch whether the two are compatible (torchao does not say). Not
    ``torch.utils.swap_tensors`` (what ``nn.Module.to`` does for these tensors): that refuses a tensor an autograd
    graph still holds (a forward run without ``no_grad``), which is every call's."""
    if not is_wrapper(tensor) or unstorable(tensor) is not None:  # a DTensor stays FSDP2's to manage
        tensor.data = value
        return
    with _RAW():
        same = (tensor.device, tensor.dtype, tensor.shape, tensor.stride()) == (
            value.device,
            value.dtype,
            value.shape,
            value.stride(),
        )
        if not same:
            with torch.inference_mode(False):
                tensor.data = value
    names, _ = value.__tensor_flatten__()
    for name in names:
        setattr(tensor, name, getattr(value, name))


@dataclass(eq=False)
class Slot:
    """One parameter or buffer: the tensor object whose ``.data`` is swapped, a stable name, where it
    is registered (``owner._parameters[attr]`` or ``owner._buffers[attr]``), and the address of the
    data it holds at rest (a different address means someone replaced it)."""

    name: str
    tensor: torch.Tensor
    is_buffer: bool
    owner: nn.Module
    attr: str
    rest_ptr: int = 0
    #: the address of the data onloading gave it (a different one at offload: replaced while onloaded)
    live_ptr: int = 0
    #: the class it has while it rests as a stand-in (``engine.standins``), None when it rests plain
    served: type | None = None
    #: the class it has while onloaded (its own)
    plain: type | None = None

    def registered(self) -> bool:
        registry = self.owner._buffers if self.is_buffer else self.owner._parameters
        return registry.get(self.attr) is self.tensor

    def place(self) -> tuple[int, str, bool]:
        """Where the tensor is registered: the same key for whatever tensor is registered there later."""
        return (id(self.owner), self.attr, self.is_buffer)


@dataclass(eq=False)
class Part:
    """One entry in the storage session: some of a group's slots, stored under ``key``.

    A part kept through a rebuild may hold tensors under the names they had then (a layer wrapped
    by an adapter moves from ``to_q.weight`` to ``to_q.base_layer.weight``): ``rename`` maps stored
    names to the slot names of today.
    """

    key: str
    names: tuple[str, ...]
    rename: dict[str, str] | None = None

    def translate(self, tensors: Tensors) -> Tensors:
        if not self.rename:
            return tensors
        return {self.rename.get(name, name): t for name, t in tensors.items()}


class Group:
    """Tensors that move together: onloaded before any of ``entries`` runs, offloaded after ``exits``
    (``policy`` says whether it streams or stays resident), stored as ``parts``."""

    __slots__ = (
        "key",
        "component",
        "policy",
        "entries",
        "exits",
        "slots",
        "nbytes",
        "resident",
        "at_rest",
        "prefetchable",
        "ready_event",
        "next",
        "readable",
        "parts",
        "owners",
        "stand_ins",
    )

    def __init__(self, spec: GroupSpec) -> None:
        self.key = spec.key
        self.component = spec.component
        self.policy = spec.policy
        self.entries = list(spec.entries)
        self.exits = list(spec.exits)
        self.prefetchable = spec.prefetchable
        self.slots: list[Slot] = []
        self.nbytes = 0
        #: the device copy is assigned (it may still be in flight: see ``ready_event``)
        self.resident = False
        self.at_rest: Tensors = {}
        #: event the compute stream must wait on before using a prefetched group (recorded after its copies)
        self.ready_event: torch.Event | None = None
        #: the group that followed this one in the recorded execution order
        self.next: Group | None = None
        #: slot names whose at-rest value must stay readable (buffers, a component root's own parameters)
        self.readable: frozenset[str] = frozenset()
        #: where the storage keeps the group: usually one part; a rebuilt group may keep old parts
        self.parts: list[Part] = []
        #: the modules whose tensors it holds, with the name each one's slots are called by, in claiming order
        self.owners: list[tuple[nn.Module, str]] = []
        #: (tensor, its own class, its class at rest) of the slots that rest as stand-ins (``Slot.served``)
        self.stand_ins: list[tuple[torch.Tensor, type, type]] = []

    def fresh(self) -> Group:
        """A group of the same claim (key, component, policy, entries, exits, owners) with no slots and no state."""
        group = Group.__new__(Group)
        Group.__init__(group, GroupSpec(self.key, self.component, [], self.entries, self.exits, self.policy))
        group.prefetchable = self.prefetchable
        group.owners = list(self.owners)
        return group

    def needs_ensure(self) -> bool:
        """Whether entering the group calls the engine's ``ensure``: it is not on the device, its prefetch has
        not been waited for, or the streamed group after it has not been started (a kept group starts it)."""
        nxt = self.next
        return not self.resident or self.ready_event is not None or (nxt is not None and not nxt.resident)

    def tensors(self) -> Tensors:
        """What each slot's tensor holds now (a resting stand-in's raw data: never served)."""
        with _RAW():
            return {slot.name: slot.tensor.data for slot in self.slots}

    def assign(self, tensors: Tensors) -> None:
        """Give every slot ``tensors`` as plain tensors (restoring, giving real values for an edit)."""
        for slot in self.slots:
            tensor = slot.tensor
            plain = PLAIN_CLASS.get(type(tensor))
            if plain is not None:
                tensor.__class__ = plain
            set_data(tensor, tensors[slot.name])

    def onload(self, tensors: Tensors) -> None:
        """Assign the onloaded tensors, remembering their addresses for :meth:`offload_at_rest`."""
        for tensor, plain, _ in self.stand_ins:
            tensor.__class__ = plain
        for slot in self.slots:
            data = tensors[slot.name]
            set_data(slot.tensor, data)
            slot.live_ptr = data.data_ptr()

    def wake(self) -> None:
        """An onload that swaps no data (the storage's at-rest tensors are the device tensors): the slots that
        rest as stand-ins are plain while the group is onloaded."""
        for tensor, plain, _ in self.stand_ins:
            tensor.__class__ = plain

    def lull(self) -> None:
        """The offload of such a group: its stand-ins rest as stand-ins again."""
        for tensor, plain, served in self.stand_ins:
            if type(tensor) is plain:
                tensor.__class__ = served

    def offload_at_rest(self) -> list[Slot]:
        """Give every slot its at-rest tensor again, except those whose tensor was replaced while the group
        was onloaded (a method of the component setting ``param.data = ...``): those keep their new
        value, and are returned."""
        replaced = []
        for slot in self.slots:
            if slot.tensor.data_ptr() != slot.live_ptr:
                replaced.append(slot)
            else:
                set_data(slot.tensor, self.at_rest[slot.name])
                if slot.served is not None:
                    slot.tensor.__class__ = slot.served
        return replaced

    def rest(self, tensors: Tensors) -> None:
        """Assign the at-rest tensors and remember their addresses (to notice replacements). Which of them rest
        as stand-ins the runtime decides next (``Serving.rest_as_stand_ins``)."""
        self.at_rest = tensors
        for slot in self.slots:
            data = tensors[slot.name]
            tensor = slot.tensor
            plain = PLAIN_CLASS.get(type(tensor))
            if plain is not None:
                tensor.__class__ = plain
            slot.served = None
            set_data(tensor, data)
            slot.rest_ptr = data.data_ptr()
        self.stand_ins = []

    def __repr__(self) -> str:
        return f"<group {self.key} {self.policy.value} {self.nbytes}B{' resident' if self.resident else ''}>"


def claim_groups(
    components: dict[str, nn.Module], specs: list[GroupSpec], *, names: dict[str, nn.Module] | None = None
) -> list[Group]:
    """Turn specs into groups that hold each tensor exactly once.

    A tensor reachable from several groups (a tied weight, a module shared between two places)
    must move with all of them at once, so groups that share a tensor are merged. ``names`` are
    the components slot names are qualified against (default: ``components``).
    """
    named = names if names is not None else components
    paths = {
        id(m): ".".join(part for part in (comp if len(named) > 1 else "", path) if part)
        for comp, root in named.items()
        for path, m in root.named_modules()
    }
    owner_of: dict[int, int] = {}
    parent = list(range(len(specs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owners: list[list[tuple[nn.Module, str]]] = [[] for _ in specs]
    for index, spec in enumerate(specs):
        for module in spec.owners:
            owners[index].append((module, paths.get(id(module), type(module).__name__)))
            for _, tensor, _ in _direct_tensors(module):
                first = owner_of.setdefault(id(tensor), index)
                if first != index:  # a tensor two specs reach: they move together
                    parent[find(index)] = find(first)
    merged: dict[int, Group] = {}
    order: list[Group] = []
    for index, spec in enumerate(specs):
        root = find(index)
        group = merged.get(root)
        if group is None:
            group = merged[root] = Group(spec)
            order.append(group)
        else:
            group.entries += [m for m in spec.entries if m not in group.entries]
            group.exits += [m for m in spec.exits if m not in group.exits]
            if Policy.RESIDENT in (spec.policy, group.policy):
                group.policy = Policy.RESIDENT
        group.owners += owners[index]
    return _take_slots(order, components)


def bind_groups(claimed: list[Group], components: dict[str, nn.Module]) -> list[Group]:
    """Live groups for one runtime from groups claimed beforehand (by ``prepare``): the same keys, policies,
    entries, exits and owner modules — claiming, which finds the groups that tied tensors merge, is not done
    again — with each slot taken from the owners as they are now. Quantizing since the claim replaced a
    layer's ``weight`` by its packed tensors, in the same modules, tied where the weight was tied.

    The claimed groups are left as they are (a prepared plan can be executed again, and the planner reads
    them); the slots are taken exactly as :func:`claim_groups` takes them.
    """
    return _take_slots([group.fresh() for group in claimed], components)


def _take_slots(groups: list[Group], components: dict[str, nn.Module]) -> list[Group]:
    """Give each group one slot per tensor its owners register, in owner order; a tensor tied between two owners
    is taken once, by the first. Groups that hold nothing are dropped. Claiming merged every group that shares
    a tensor, so a tensor in two groups means a tie made since the claim: refused."""
    taken: dict[int, Group] = {}
    for group in groups:
        for module, prefix in group.owners:
            for attr, tensor, is_buffer in _direct_tensors(module):
                holder = taken.get(id(tensor))
                if holder is None:
                    taken[id(tensor)] = group
                    group.slots.append(Slot(f"{prefix}.{attr}" if prefix else attr, tensor, is_buffer, module, attr))
                    group.nbytes += stored_bytes(tensor)
                elif holder is not group:
                    raise RuntimeError(
                        f"{prefix}.{attr} is tied to a tensor of group {holder.key} since the groups were claimed, and "
                        f"group {group.key} holds it too: prepare the mode again"
                    )
        group.readable = _readable(group, components)
    return [g for g in groups if g.slots]


def _direct_tensors(module: nn.Module):
    """``(attr, tensor, is_buffer)`` for the parameters and buffers ``module`` registers itself."""
    for attr, tensor in module._parameters.items():
        if tensor is not None:
            yield attr, tensor, False
    for attr, tensor in module._buffers.items():
        if tensor is not None:
            yield attr, tensor, True


def _readable(group: Group, components: dict[str, nn.Module]) -> frozenset[str]:
    """What pipelines read outside any forward: buffers, and a model's own loose parameters."""
    root = components.get(group.component)
    container = root is not None and next(iter(root.children()), None) is not None
    return frozenset(slot.name for slot in group.slots if slot.is_buffer or (container and slot.owner is root))


def module_path(components: dict[str, nn.Module], module: nn.Module, component: str | None = None) -> str:
    """``component.path.to.module``, searched in ``component`` or in every component (for messages)."""
    for name in [component] if component is not None else components:
        for path, sub in components[name].named_modules():
            if sub is module:
                return f"{name}.{path}" if path else name
    return f"{component}.<{type(module).__name__}>" if component is not None else type(module).__name__
