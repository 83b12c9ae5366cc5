"""Moving groups: onloading before they are used, offloading after, and the books on both.

The :class:`Moving` part of the :class:`~memmode_core.engine.runtime.Runtime` owns what is where: the
groups each component has resident on the device, the component the device serves now (``active``),
how deeply each component's call is nested, and the ledger. The forward wrappers
(:mod:`~memmode_core.engine.forwards`) call :meth:`Moving.ensure` and :meth:`Moving.offload` around
the modules a group enters and exits; a component's return (:meth:`Moving._leave`) and a pipeline's
(:meth:`Moving.end_call`) offload what is left, and a component that needs the device takes it from
idle ones (:meth:`Moving._switch_to`).

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
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from memmode_core.contracts.layout import Policy
from memmode_core.contracts.storage import StorageSession, Tensors
from memmode_core.engine.groups import Group
from memmode_core.engine.hooks import not_traced
from memmode_core.engine.ledger import Ledger, clock
from memmode_core.engine.streams import active


class Moving:
    """Onloading, offloading, prefetching and their books; part of the runtime (its components, its groups).

    Replaced tensors found at offload are reported to the change detection (``_mark_changed``).
    """

    def _init_moving(
        self,
        device: torch.device,
        session: StorageSession | None,
        ledger: Ledger,
        *,
        prefetch: bool,
        lookahead: Mapping[str, int] | None = None,
        offload_after_call: bool,
    ) -> None:
        components = self.components
        self.device = device
        self.session = session
        self.ledger = ledger
        #: the component the device serves now
        self.active: str | None = None
        #: component -> how deeply its calls are nested now (0: not in a call)
        self._depth: dict[str, int] = {name: 0 for name in components}
        #: component -> its groups resident now (a dict: ordered, O(1) removal)
        self._resident: dict[str, dict[Group, None]] = {name: {} for name in components}
        #: streams, events and copies (the real accelerator API, or a test double)
        self.streams = active()
        #: copies can run on a side stream: prefetch, and synchronise before weights leave the device
        self._async = self.streams.has_streams(device)
        #: the storage's copies are the device tensors: onload and offload only keep the books
        self._zero_copy = session is not None and session.zero_copy(device)
        self._prefetch = prefetch
        #: component -> how many streamed groups ahead a prefetch runs (default one)
        self._lookahead = dict(lookahead or {})
        self._offload_after_call = offload_after_call
        #: where prefetches are copied; without streams a prefetch is a synchronous early onload
        self._copy_stream = self.streams.new_stream(device) if prefetch and self._async else None
        #: component -> groups in the order of their first onload during the component's first call
        self._recording: dict[str, list[Group]] = {name: [] for name in components} if prefetch else {}
        #: (start, end) timing events of copies whose duration is not yet added to the ledger
        self._timings: list[tuple[torch.Event, torch.Event]] = []

    def _onload_resident(self, group: Group) -> None:
        start = clock()
        with self.streams.label(group.key):
            group.assign({n: self.streams.to_device(t, self.device) for n, t in group.tensors().items()})
        group.resident = True
        self.ledger.onloaded(group.nbytes, clock() - start)

    @not_traced
    def ensure(self, group: Group) -> None:
        """Make ``group`` usable by the compute stream: onload it, or wait for its prefetch."""
        if group.resident:
            event = group.ready_event
            if event is not None:
                streams = self.streams
                stream = streams.current_stream(self.device)
                streams.wait(stream, event)
                for slot in group.slots:  # allocated on the copy stream, read on this one
                    streams.record_stream(slot.tensor.data, stream)
                group.ready_event = None
        else:
            if group.component != self.active:
                self._switch_to(group.component)
            self._fetch(group, None)
        if self._recording and group.component in self._recording:
            self._record(group)
        nxt, ahead = group.next, self._lookahead.get(group.component, 1)
        while nxt is not None and ahead > 0:  # the next streamed groups, as far ahead as the budget allows
            if not nxt.resident:
                self._fetch(nxt, self._copy_stream)
            nxt, ahead = nxt.next, ahead - 1

    def _fetch(self, group: Group, stream: torch.Stream | None) -> None:
        for part in group.parts:  # a broken file is a typed error here, never wrong bytes or a SIGBUS
            self.session.check(part.key)
        if self._async:
            streams = self.streams
            start = streams.new_event(self.device, timing=True)
            end = streams.new_event(self.device, timing=True)
            with streams.on(stream), streams.label(group.key):
                streams.record(start)
                tensors = self._fetch_parts(group, stream)
                streams.record(end)
            self._timings.append((start, end))
            group.ready_event = end if stream is not None else None
            seconds = 0.0
        elif self._zero_copy:
            tensors, seconds = None, 0.0
            group.wake()
        else:
            began = clock()
            tensors = self._fetch_parts(group, None)
            seconds = clock() - began
        if tensors is not None:
            group.onload(tensors)
        group.resident = True
        self._resident[group.component][group] = None
        self.ledger.onloaded(group.nbytes, seconds)

    def _fetch_parts(self, group: Group, stream) -> Tensors:
        parts = group.parts
        if len(parts) == 1 and not parts[0].rename:
            return self.session.fetch(parts[0].key, self.device, stream)
        tensors: Tensors = {}
        for part in parts:
            tensors.update(part.translate(self.session.fetch(part.key, self.device, stream)))
        return tensors

    @not_traced
    def offload(self, group: Group) -> None:
        if self._zero_copy:
            seconds = 0.0
            group.lull()
        else:
            start = clock()
            replaced = group.offload_at_rest()
            for part in group.parts:
                self.session.offloaded(part.key, not replaced)
            seconds = clock() - start
            if replaced:  # kept, in ordinary memory; the component's next call stores them (see changed())
                for slot in replaced:
                    if not self.streams.is_host(slot.tensor.device):
                        slot.tensor.data = self.streams.to_host(slot.tensor.data)
                self._mark_changed(group.component)
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

    def end_call(self) -> None:
        """A pipeline call returned (see :mod:`~memmode_core.engine.pipeline_hooks`): offload what it left on
        the device, as diffusers frees its models then — unless the placement keeps it (``keep_last_on_device``)."""
        if not self._offload_after_call:
            return
        with self.lock:
            if any(self._depth.values()):
                return  # called from inside a component's call: not the end of the pipeline's
            for name in self.components:
                self._offload_component(name)
            self.active = None

    def _offload_component(self, component: str) -> None:
        if self._async:
            self.streams.synchronize(self.device)  # prefetches in flight land before their groups leave
        for group in list(self._resident[component]):
            self.offload(group)

    def settle(self) -> None:
        """Add the measured duration of finished asynchronous copies to the ledger."""
        if not self._timings:
            return
        pending = []
        for start, end in self._timings:
            if self.streams.done(end):
                self.ledger.seconds += self.streams.elapsed(start, end)
            else:
                pending.append((start, end))
        self._timings = pending

    @not_traced
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
        if self._learned:
            for name in [n for n in self._learned if not self._depth[n]]:
                self.apply_learned(name)

    # -- execution order (prefetch) ------------------------------------------------------------------

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
