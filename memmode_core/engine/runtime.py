"""The group engine: onloads and offloads groups around forwards, and keeps the ledger.

One :class:`Runtime` serves one ``apply``. It turns the placement's :class:`GroupSpec` list into
:class:`Group` objects holding the actual tensors, stores the offloaded copies through the storage
session, installs forward hooks on entry and exit modules, and undoes all of it on ``remove``.

Weights are swapped through ``tensor.data``, so parameters and buffers keep their identity: code
that holds a reference to a parameter (an optimizer, an adapter, a tied weight) keeps seeing it.

Prefetching (CUDA only): during a component's first call the order in which its groups are
onloaded is recorded. From then on, onloading a group also starts copying the next one in that
order on a side stream; an event recorded after those copies is what the compute stream waits on
before the next group's modules run, and every prefetched tensor is marked as used by the compute
stream (``record_stream``) so the caching allocator never hands its memory to a new copy while a
kernel may still read it. A group that was not prefetched (first call, a layer skipped or called
out of order) is simply onloaded on the compute stream when it is entered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from ..ledger import Ledger, clock
from ..storage import StorageSession, Tensors
from .hooks import MethodWrapper
from .inputs import move_inputs
from .layout import GroupSpec, Policy


#: methods besides ``forward`` through which a pipeline calls a component
COMPONENT_METHODS = ("encode", "decode")
#: component calls remembered for the report (a long video run makes a few thousand)
MAX_RECORDED_CALLS = 100_000


@dataclass(eq=False)
class Slot:
    """One parameter or buffer: the tensor object whose ``.data`` is swapped, a stable name, and where
    it is registered (``owner._parameters[attr]`` or ``owner._buffers[attr]``)."""

    name: str
    tensor: torch.Tensor
    is_buffer: bool
    owner: nn.Module
    attr: str


class Group:
    __slots__ = ("key", "component", "policy", "entries", "exits", "slots", "nbytes", "resident",
                 "at_rest", "prefetchable", "ready_event", "next", "readable")

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
        #: CUDA event the compute stream must wait on before using a prefetched group
        self.ready_event: torch.cuda.Event | None = None
        #: the group that followed this one in the recorded execution order
        self.next: Group | None = None
        #: slot names whose at-rest value must stay readable (buffers)
        self.readable: frozenset[str] = frozenset()

    def tensors(self) -> Tensors:
        return {slot.name: slot.tensor.data for slot in self.slots}

    def assign(self, tensors: Tensors) -> None:
        for slot in self.slots:
            slot.tensor.data = tensors[slot.name]

    def __repr__(self) -> str:
        return f"<group {self.key} {self.policy.value} {self.nbytes}B{' resident' if self.resident else ''}>"


class Runtime:
    def __init__(self, components: dict[str, nn.Module], specs: Iterable[GroupSpec], *, device: torch.device,
                 session: StorageSession | None, ledger: Ledger, prefetch: bool = False) -> None:
        self.components = components
        self.device = device
        self.session = session
        self.ledger = ledger
        self.groups = claim_groups(components, list(specs))
        self.active: str | None = None
        self._depth: dict[str, int] = {name: 0 for name in components}
        #: calls of each component since apply or ``reset_calls`` (a nested call counts once), in order
        self.calls: list[str] = []
        #: component -> its groups resident now (a dict: ordered, O(1) removal)
        self._resident: dict[str, dict[Group, None]] = {name: {} for name in components}
        self._wrappers: list[MethodWrapper] = []
        self._cuda = device.type == "cuda"
        #: the storage's copies are the device tensors: onload and offload only keep the books
        self._zero_copy = session is not None and session.zero_copy(device)
        #: where prefetches are copied; without CUDA a prefetch is a synchronous early onload
        self._copy_stream = torch.cuda.Stream(device) if prefetch and self._cuda else None
        #: component -> groups in the order of their first onload during the component's first call
        self._recording: dict[str, list[Group]] = {name: [] for name in components} if prefetch else {}
        #: CUDA (start, end) events of copies whose duration is not yet added to the ledger
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    # -- install / remove ---------------------------------------------------------------------------

    def install(self) -> None:
        """Store the offloaded copies, then release the originals and hook the modules.

        Everything that can fail (space, permissions, memory for copies) happens in the first phase,
        while the model still holds its own tensors; a failure there leaves the model as it was.
        """
        stored = [g for g in self.groups if g.policy is not Policy.RESIDENT]
        if stored and self.session is None:
            raise RuntimeError("a placement that offloads needs a storage session")
        try:
            if stored:
                self.session.reserve({g.key: g.nbytes for g in stored})
                for group in stored:
                    group.at_rest = self.session.put(group.key, group.tensors(), group.readable)
        except BaseException:
            if self.session is not None:
                self.session.close()
            raise
        for group in stored:
            group.assign(group.at_rest)
        for group in self.groups:
            if group.policy is Policy.RESIDENT:
                self._onload_resident(group)
        self._install_hooks()

    def remove(self) -> None:
        """Unhook, and leave every weight in ordinary CPU memory."""
        for wrapper in self._wrappers:
            wrapper.remove()
        self._wrappers.clear()
        if self._cuda:
            torch.cuda.synchronize(self.device)
        for group in self.groups:
            if group.policy is Policy.RESIDENT:
                group.assign({n: t.to("cpu") for n, t in group.tensors().items()})
            else:
                group.assign(self.session.restore(group.key))
                group.at_rest = {}  # the storage's copies (a file mapping, pinned memory) go with the session
            if group.resident:
                group.resident = False
                group.ready_event = None
                self.ledger.offloaded(group.nbytes, 0.0)
        for resident in self._resident.values():
            resident.clear()
        if self.session is not None:
            self.session.close()

    # -- moving -------------------------------------------------------------------------------------

    def _onload_resident(self, group: Group) -> None:
        start = clock()
        group.assign({n: t.to(self.device) for n, t in group.tensors().items()})
        group.resident = True
        self.ledger.onloaded(group.nbytes, clock() - start)

    def ensure(self, group: Group) -> None:
        """Make ``group`` usable by the compute stream: onload it, or wait for its prefetch."""
        if group.resident:
            event = group.ready_event
            if event is not None:
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(event)
                for slot in group.slots:
                    slot.tensor.data.record_stream(stream)
                group.ready_event = None
        else:
            if group.component != self.active:
                self._switch_to(group.component)
            self._fetch(group, None)
        if self._recording and group.component in self._recording:
            self._record(group)
        nxt = group.next
        if nxt is not None and not nxt.resident:
            self._fetch(nxt, self._copy_stream)

    def _fetch(self, group: Group, stream: "torch.cuda.Stream | None") -> None:
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream) if stream is not None else _nullcontext():
                start.record()
                tensors = self.session.fetch(group.key, self.device, stream)
                end.record()
            self._timings.append((start, end))
            group.ready_event = end if stream is not None else None
            seconds = 0.0
        elif self._zero_copy:
            tensors, seconds = None, 0.0
        else:
            began = clock()
            tensors = self.session.fetch(group.key, self.device, None)
            seconds = clock() - began
        if tensors is not None:
            group.assign(tensors)
        group.resident = True
        self._resident[group.component][group] = None
        self.ledger.onloaded(group.nbytes, seconds)

    def offload(self, group: Group) -> None:
        if self._zero_copy:
            seconds = 0.0
        else:
            start = clock()
            group.assign(group.at_rest)
            seconds = clock() - start
        group.resident = False
        group.ready_event = None
        del self._resident[group.component][group]
        self.ledger.offloaded(group.nbytes, seconds)

    def _switch_to(self, component: str) -> None:
        """Another component needs the device: offload what idle components left resident."""
        for name, resident in self._resident.items():
            if name != component and resident and self._depth[name] == 0:
                for group in list(resident):
                    self.offload(group)
        self.active = component

    def settle(self) -> None:
        """Add the measured duration of finished asynchronous copies to the ledger."""
        if not self._timings:
            return
        pending = []
        for start, end in self._timings:
            if end.query():
                self.ledger.seconds += start.elapsed_time(end) / 1000.0
            else:
                pending.append((start, end))
        self._timings = pending

    # -- execution order (prefetch) ------------------------------------------------------------------

    def _record(self, group: Group) -> None:
        order = self._recording[group.component]
        if group not in order:
            order.append(group)

    def _finish_recording(self, component: str) -> None:
        """After a component's first call: link each group to the next prefetchable one."""
        order = self._recording.pop(component, None)
        if not order:
            return
        following: Group | None = None
        for group in reversed(order):
            group.next = following
            if group.prefetchable and group.policy is Policy.STREAM:
                following = group

    # -- hooks --------------------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        """One forward wrapper per module that enters or exits a group or is a component's root."""
        plans: dict[int, tuple[nn.Module, list[Group], list[Group], str | None]] = {}

        def plan(module: nn.Module):
            return plans.setdefault(id(module), (module, [], [], None))

        for group in self.groups:
            if group.policy is Policy.RESIDENT:
                continue
            for module in group.entries:
                plan(module)[1].append(group)
            if group.policy is Policy.STREAM:
                for module in group.exits:
                    plan(module)[2].append(group)
        for name, module in self.components.items():
            entry = plan(module)
            # a component's own exit is its leave step: it offloads whatever the component left resident
            plans[id(module)] = (module, entry[1], [], name)
        for module, enters, exits, component in plans.values():
            self._wrappers.append(MethodWrapper(module, self._forward_maker(enters, exits, component)))
            if component is not None:
                # a component's other entry points: a VAE's decode() never calls its forward()
                for method in COMPONENT_METHODS:
                    if callable(getattr(type(module), method, None)):
                        self._wrappers.append(MethodWrapper(module, self._forward_maker(enters, [], component), method))

    def _forward_maker(self, enters: list[Group], exits: list[Group], component: str | None):
        ensure, offload, leave = self.ensure, self.offload, self._leave
        depth, calls = self._depth, self.calls
        move = self.device.type != "cpu"  # on a CPU device every input already is where it computes
        device = self.device

        def make(original, wrapper: MethodWrapper):
            if component is None and len(enters) == 1 and exits == enters:
                (group,) = enters  # the common case (a leaf or a single block): one group in and out

                def forward(*args, **kwargs):
                    if not wrapper.active:
                        return original(*args, **kwargs)
                    if not group.resident or group.ready_event is not None:
                        ensure(group)
                    if move and (moved := move_inputs(args, kwargs, device)) is not None:
                        args, kwargs = moved
                    try:
                        return original(*args, **kwargs)
                    finally:
                        if group.resident and group.ready_event is None:
                            offload(group)
                return forward

            def forward(*args, **kwargs):
                if not wrapper.active:
                    return original(*args, **kwargs)
                if component is not None:
                    depth[component] += 1
                    if depth[component] == 1 and len(calls) < MAX_RECORDED_CALLS:
                        calls.append(component)
                try:
                    for group in enters:
                        if not group.resident or group.ready_event is not None:
                            ensure(group)
                    if move and (moved := move_inputs(args, kwargs, device)) is not None:
                        args, kwargs = moved
                    return original(*args, **kwargs)
                finally:
                    for group in exits:
                        if group.resident and group.ready_event is None:
                            offload(group)
                    if component is not None:
                        leave(component)
            return forward
        return make

    def _leave(self, component: str) -> None:
        """A component's forward returned: offload what it left resident, once it is no longer nested."""
        self._depth[component] -= 1
        if self._depth[component]:
            return
        for group in list(self._resident[component]):
            if group.policy is Policy.STREAM:
                self.offload(group)
        if component in self._recording:
            self._finish_recording(component)
        if self._timings:
            self.settle()


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def claim_groups(components: dict[str, nn.Module], specs: list[GroupSpec]) -> list[Group]:
    """Turn specs into groups that hold each tensor exactly once.

    A tensor reachable from several groups (a tied weight, a module shared between two places)
    must move with all of them at once, so groups that share a tensor are merged.
    """
    paths = {id(m): ".".join(part for part in (comp if len(components) > 1 else "", path) if part)
             for comp, root in components.items() for path, m in root.named_modules()}
    owner_of: dict[int, int] = {}
    parent = list(range(len(specs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    claimed: list[list[Slot]] = [[] for _ in specs]
    for index, spec in enumerate(specs):
        for module in spec.owners:
            prefix = paths.get(id(module), type(module).__name__)
            tensors = [(a, t, False) for a, t in module._parameters.items()]
            tensors += [(a, t, True) for a, t in module._buffers.items()]
            for attr, tensor, is_buffer in tensors:
                if tensor is None:
                    continue
                first = owner_of.setdefault(id(tensor), index)
                if first == index:
                    claimed[index].append(Slot(f"{prefix}.{attr}" if prefix else attr, tensor, is_buffer, module,
                                               attr))
                else:
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
        for slot in claimed[index]:
            group.slots.append(slot)
            group.nbytes += slot.tensor.numel() * slot.tensor.element_size()
    for group in order:
        group.readable = frozenset(slot.name for slot in group.slots if slot.is_buffer)
    return [g for g in order if g.slots]
