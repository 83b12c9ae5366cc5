"""Moving groups: onloading before they are used, offloading after, and the books on both.

The :class:`Moving` part of the :class:`~memmode_core.engine.runtime.Runtime` (it needs nothing but the
runtime's :class:`~memmode_core.engine.state.EngineState`) owns what is where: the groups each component
has resident on the device, the component the device serves now (``active``), the calls running now (how deeply
each component's calls are nested: :meth:`Moving.enter`, :meth:`Moving.leave`; the others read ``depth``), and
the books it keeps in the state's ledger. The forward hooks (:mod:`~memmode_core.engine.forwards`) call
:meth:`Moving.ensure` and :meth:`Moving.offload` around the modules a group enters and exits; a component's return
(:meth:`Moving.leave`) and a pipeline's (:meth:`Moving.end_call`) offload what is left, and a component that
needs the device takes it from idle ones (:meth:`Moving.switch_to`).

Weights are swapped through ``tensor.data``, so parameters and buffers keep their identity: code
that holds a reference to a parameter (an optimizer, an adapter, a tied weight) keeps seeing it.

Prefetching (on an accelerator with streams, through :mod:`~memmode_core.engine.streams`): during a
component's first call the order in which its groups are onloaded is recorded. From then on,
onloading a group also starts copying the next one in that order on a side stream; an event
recorded after those copies is what the compute stream waits on before the next group's modules
run, and every prefetched tensor is marked as used by the compute stream (``record_stream``) so the
caching allocator never hands its memory to a new copy while a kernel may still read it. A group
that was not prefetched (first call, a layer skipped or called out of order) is simply onloaded on
the compute stream when it is entered.

Sharing the device: on an accelerator, the runtime's :class:`~memmode_core.engine.device_room.DeviceRoom` part
(``room``) decides what its calls may hold; this part asks it before a component's call (:meth:`Moving.enter`),
before each onload, and when an onload runs out of memory, which is tried once more after the room released what
is not needed now. A prefetch that does not fit is dropped: the group is onloaded when it is entered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TypeVar

import torch

from memmode_core.contracts.group_specs import Policy
from memmode_core.contracts.inner_tensors import leaves
from memmode_core.contracts.storage import Tensors
from memmode_core.engine.flattened import map_leaves
from memmode_core.engine.groups import Group, set_data
from memmode_core.engine.hooks import not_traced
from memmode_core.engine.ledger import clock
from memmode_core.engine.state import EngineState

T = TypeVar("T")


class Moving:
    """Onloading, offloading, prefetching and their books, for the groups of ``state``.

    It owns what is resident now, which component the device serves (``active``), the nesting of calls (written
    by :meth:`enter` and :meth:`leave` only; ``depth`` is its read-only view) and the prefetch order. A replaced
    tensor found at offload marks its component changed (``state.mark_changed``).
    """

    def __init__(
        self,
        state: EngineState,
        *,
        prefetch: bool = False,
        lookahead: Mapping[str, int] | None = None,
        offload_after_call: bool = True,
    ) -> None:
        self.state = state
        components = state.components
        device, session = state.device, state.session
        self.streams = state.streams
        #: the component the device serves now
        self.active: str | None = None
        #: component -> how deeply its calls are nested now (0: not in a call)
        self._depth: dict[str, int] = {name: 0 for name in components}
        #: the same, read-only, for the hooks and parts that ask (only :meth:`enter` and :meth:`leave` write it)
        self.depth: Mapping[str, int] = MappingProxyType(self._depth)
        #: component -> its groups resident now (a dict: ordered, O(1) removal)
        self._resident: dict[str, dict[Group, None]] = {name: {} for name in components}
        #: copies can run on a side stream: prefetch, and synchronise before weights leave the device
        self._async = self.streams.has_streams(device)
        #: the storage's copies are the device tensors: onload and offload only keep the books
        self.zero_copy = session is not None and session.zero_copy(device)
        self._prefetch = prefetch
        #: component -> how many streamed groups ahead a prefetch runs (default one)
        self._lookahead = dict(lookahead or {})
        self._offload_after_call = offload_after_call
        #: where prefetches are copied; without streams a prefetch is a synchronous early onload
        self.copy_stream = self.streams.new_stream(device) if prefetch and self._async else None
        #: component -> groups in the order of their first onload during the component's first call
        self._recording: dict[str, list[Group]] = {name: [] for name in components} if prefetch else {}
        #: (start, end) timing events of copies whose duration is not yet added to the ledger
        self._timings: list[tuple[torch.Event, torch.Event]] = []
        #: weight bytes of the groups fetched and resident now (those placed for good are not counted)
        self._held = 0
        #: the runtime's :class:`~memmode_core.engine.device_room.DeviceRoom` on a shared device (set by the
        #: runtime once both parts exist; None: nothing this part does takes device memory that others want)
        self.room = None

    def onload_resident(self, group: Group) -> None:
        """Put a group kept on the device (``Policy.RESIDENT``) there, once."""
        start = clock()
        device = self.state.device

        def copy() -> Tensors:
            with self.streams.label(group.key):
                to_device = self.streams.to_device
                return {n: map_leaves(t, lambda x: to_device(x, device)) for n, t in group.tensors().items()}

        group.assign(self._onloading(group, copy))
        group.resident = True
        self.state.ledger.onloaded(group.nbytes, clock() - start)

    def offload_resident(self, group: Group) -> None:
        """Take a group :meth:`onload_resident` put on the device back to ordinary memory (an install that failed)."""
        group.assign({n: map_leaves(t, self.streams.to_host) for n, t in group.tensors().items()})
        group.resident = False
        self.state.ledger.offloaded(group.nbytes, 0.0)

    @not_traced
    def ensure(self, group: Group) -> None:
        """Make ``group`` usable by the compute stream: onload it, or wait for its prefetch."""
        if group.resident:
            event = group.ready_event
            if event is not None:
                streams = self.streams
                stream = streams.current_stream(self.state.device)
                streams.wait(stream, event)
                for slot in group.slots:  # allocated on the copy stream, read on this one
                    for leaf in leaves(slot.tensor.data):
                        streams.record_stream(leaf, stream)
                group.ready_event = None
        else:
            if group.component != self.active:
                self.switch_to(group.component)
            if self.room is not None:
                self.room.make_way(group)
            self._fetch(group, None)
        if self._recording and group.component in self._recording:
            self._record(group)
        nxt, ahead = group.next, self._lookahead.get(group.component, 1)
        while nxt is not None and ahead > 0:  # the next streamed groups, as far ahead as the budget allows
            if not nxt.resident:
                if self.room is not None and not self.room.fits_ahead(nxt):
                    break  # no room to copy ahead: it is onloaded when entered
                self._fetch(nxt, self.copy_stream)
            nxt, ahead = nxt.next, ahead - 1

    def _fetch(self, group: Group, stream: torch.Stream | None) -> None:
        for part in group.parts:  # a broken file is a typed error here, never wrong bytes or a SIGBUS
            self.state.session.check(part.key)
        if stream is None:
            tensors, seconds = self._onloading(group, lambda: self._copy(group, None))
        else:
            try:
                tensors, seconds = self._copy(group, stream)
            except torch.OutOfMemoryError:
                return  # a prefetch that does not fit now: the group is onloaded when it is entered
        if tensors is not None:
            group.onload(tensors)
        group.resident = True
        self._resident[group.component][group] = None
        self._held += group.nbytes
        self.state.ledger.onloaded(group.nbytes, seconds)

    def _onloading(self, group: Group, copy: Callable[[], T]) -> T:
        """``copy()``, which onloads ``group``; on the device's out-of-memory error, once more after the room part
        released what is not needed now (a :class:`DeviceMemoryError` if it fails again, chained to it)."""
        try:
            return copy()
        except torch.OutOfMemoryError as exc:
            if self.room is None:
                raise
            freed = self.room.release_for(group, exc)
            try:
                copied = copy()
            except torch.OutOfMemoryError as again:
                raise self.room.cannot_fit(group, freed) from again
            self.room.recovered(group, freed, exc)
            return copied

    def _copy(self, group: Group, stream: torch.Stream | None) -> tuple[Tensors | None, float]:
        """The group's tensors on the device (None where the storage's copies are the device tensors), and the
        seconds the host spent copying them (0 for an asynchronous copy: its events are timed later)."""
        if self._async:
            streams = self.streams
            start = streams.new_event(self.state.device, timing=True)
            end = streams.new_event(self.state.device, timing=True)
            with streams.on(stream), streams.label(group.key):
                streams.record(start)
                tensors = self._fetch_parts(group, stream)
                streams.record(end)
            self._timings.append((start, end))
            group.ready_event = end if stream is not None else None
            return tensors, 0.0
        if self.zero_copy:
            group.wake()
            return None, 0.0
        began = clock()
        tensors = self._fetch_parts(group, None)
        return tensors, clock() - began

    def _fetch_parts(self, group: Group, stream) -> Tensors:
        parts = group.parts
        if len(parts) == 1 and not parts[0].rename:
            return self.state.session.fetch(parts[0].key, self.state.device, stream)
        tensors: Tensors = {}
        for part in parts:
            tensors.update(part.translate(self.state.session.fetch(part.key, self.state.device, stream)))
        return tensors

    @not_traced
    def offload(self, group: Group) -> None:
        if self.zero_copy:
            seconds = 0.0
            group.lull()
        else:
            start = clock()
            replaced = group.offload_at_rest()
            for part in group.parts:
                self.state.session.offloaded(part.key, not replaced)
            seconds = clock() - start
            if replaced:  # kept, in ordinary memory; the component's next call stores them (see changed())
                for slot in replaced:
                    if not self.streams.is_host(slot.tensor.device):
                        set_data(slot.tensor, map_leaves(slot.tensor.data, self.streams.to_host))
                self.state.mark_changed(group.component)
        group.resident = False
        group.ready_event = None
        del self._resident[group.component][group]
        self._held -= group.nbytes
        self.state.ledger.offloaded(group.nbytes, seconds)

    def switch_to(self, component: str) -> None:
        """Another component needs the device: offload what idle components left resident."""
        for name, resident in self._resident.items():
            if name != component and resident and self._depth[name] == 0:
                for group in list(resident):
                    self.offload(group)
        self.active = component

    def end_call(self) -> None:
        """A pipeline call returned (see :mod:`~memmode_core.engine.pipeline_hooks`): offload what it left on
        the device, as diffusers frees its models then — unless the placement keeps it (``keep_last_on_device``)."""
        if not self._offload_after_call:
            return
        with self.state.lock:
            if self.in_call():
                return  # called from inside a component's call: not the end of the pipeline's
            for name in self.state.components:
                self.offload_component(name)
            self.active = None

    def offload_component(self, component: str) -> None:
        """Offload every group of ``component`` resident now."""
        self.synchronize()  # prefetches in flight land before their groups leave
        for group in list(self._resident[component]):
            self.offload(group)

    def synchronize(self) -> None:
        """Wait for the copies in flight (with side streams; without, every copy is done already)."""
        if self._async:
            self.streams.synchronize(self.state.device)

    def bring_back(self, component: str) -> None:
        """Give ``component``'s resident groups their tensors as they are now, in ordinary memory, without storing
        anything (``refresh()``: a group resident now may have been edited on the device)."""
        for group in list(self._resident[component]):
            group.assign({n: map_leaves(t, self.streams.to_host) for n, t in group.tensors().items()})
            group.resident = False
            group.ready_event = None
            del self._resident[component][group]
            self._held -= group.nbytes
            self.state.ledger.offloaded(group.nbytes, 0.0)

    def forget_resident(self, component: str | None = None) -> None:
        """Stop tracking what ``component`` (every component: None) has resident: its groups were replaced (a
        rebuild) or given back (``remove()``)."""
        for name, resident in self._resident.items():
            if component is None or name == component:
                resident.clear()
        self._held = sum(g.nbytes for resident in self._resident.values() for g in resident)

    def settle(self) -> None:
        """Add the measured duration of finished asynchronous copies to the ledger."""
        if not self._timings:
            return
        pending = []
        for start, end in self._timings:
            if self.streams.done(end):
                self.state.ledger.seconds += self.streams.elapsed(start, end)
            else:
                pending.append((start, end))
        self._timings = pending

    def enter(self, component: str) -> bool:
        """A call of ``component`` begins (its entry hook, holding the lock). Returns whether it is the outermost
        one (not nested in another call of the component)."""
        if not self._depth[component] and self.room is not None:
            self.room.admit(component)
        self._depth[component] += 1
        return self._depth[component] == 1

    def in_call(self) -> bool:
        """Whether a call of one of the components is running now."""
        return any(self._depth.values())

    @not_traced
    def leave(self, component: str) -> bool:
        """A component's forward returned: offload what it left resident, once it is no longer nested. Returns
        whether its call ended (it is no longer nested)."""
        depth = self._depth
        depth[component] -= 1
        if depth[component]:
            return False
        for group in list(self._resident[component]):
            if group.policy is Policy.STREAM:
                self.offload(group)
        if component in self._recording:
            self._finish_recording(component)
        if self._timings:
            self.settle()
        return True

    # -- what the room part reads ------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Weight bytes of the groups onloaded and resident now (those placed for good are not counted)."""
        return self._held

    def resident(self, component: str) -> list[Group]:
        """``component``'s groups resident now, in the order they were onloaded."""
        return list(self._resident[component])

    def idle_components(self, component: str) -> list[str]:
        """The other components, not in a call now, that have groups resident."""
        return [n for n, resident in self._resident.items() if n != component and resident and not self._depth[n]]

    def lookahead(self, component: str) -> int:
        """How many streamed groups ahead ``component`` prefetches (0 without prefetch)."""
        return self._lookahead.get(component, 1) if self._prefetch else 0

    # -- execution order (prefetch) ------------------------------------------------------------------

    def restart_recording(self, component: str) -> None:
        """Record ``component``'s order again at its next call (its groups were laid out again)."""
        if self._prefetch:
            self._recording[component] = []

    def _record(self, group: Group) -> None:
        order = self._recording[group.component]
        if group not in order:
            order.append(group)

    def _finish_recording(self, component: str) -> None:
        """After a component's first call: link each group to the next prefetchable streamed one (a group kept
        on the device links too: entering it starts the copy of the streamed group that follows it)."""
        order = self._recording.pop(component, None)
        if not order:
            return
        following: Group | None = None
        for group in reversed(order):
            group.next = following
            if group.prefetchable and group.policy is Policy.STREAM:
                following = group
