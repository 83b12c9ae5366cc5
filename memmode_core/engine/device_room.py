"""A runtime's room on a shared device: what its calls may hold, what leaves when room is short, and the recovery
from an out-of-memory error.

The :class:`DeviceRoom` part of the :class:`~memmode_core.engine.runtime.Runtime` is the runtime's tenant of its
device's :class:`~memmode_core.engine.device_share.DeviceShare` (on an accelerator, for a storage whose onloads
copy: otherwise nothing memmode does takes device memory and the runtime has no room part). It decides; the
:class:`~memmode_core.engine.moving.Moving` part, which it gets through its constructor, moves:

- before a component's call (:meth:`DeviceRoom.admit`) it reads the room free now and makes the room the call is
  predicted to need: its weights (:meth:`DeviceRoom.predicted_peak`), plus its activations where the plan predicted
  them (``auto`` given the call's shapes: a VAE's decode gets the room its activations take at those shapes).
  Other handles that are not running give back what they keep, then this runtime's idle components leave. The
  weight bytes the call may hold are capped at what there is then, less its activations, so that what is still
  short comes out of the component's own kept groups, one at a time as a later group needs the room
  (:meth:`DeviceRoom.make_way`), rather than pushing the device over; a prefetch that would go over is not issued
  (:meth:`DeviceRoom.fits_ahead`);
- an out-of-memory error where a group is onloaded (a shape nobody planned, fragmentation, another process)
  releases every group not needed now (:meth:`DeviceRoom.release_for`); Moving tries once more, and a group that
  still does not fit is a :class:`~memmode_core.contracts.errors.DeviceMemoryError` naming the component
  (:meth:`DeviceRoom.cannot_fit`), raised before any weight is lost: every group keeps its stored copy;
- another handle's share asks it to give back what it holds when it is not running (:meth:`DeviceRoom.give_back`).

Whatever leaves, and for whom, is written in the ledger (``report().evictions``, ``report().recoveries``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from memmode_core.contracts.errors import DeviceMemoryError
from memmode_core.contracts.group_specs import Policy
from memmode_core.contracts.units import format_bytes
from memmode_core.engine.device_share import DeviceShare
from memmode_core.engine.groups import Group
from memmode_core.engine.hooks import not_traced
from memmode_core.engine.moving import Moving
from memmode_core.engine.state import EngineState

#: bytes to free when everything that can go must go
EVERYTHING = 1 << 62


class DeviceRoom:
    """One runtime's tenancy of its device's ``share`` (see the module docstring): ``label`` names the handle in
    the reports of the others, ``reserve`` is what it asks the share to keep free for what memmode does not own."""

    def __init__(
        self,
        state: EngineState,
        moving: Moving,
        share: DeviceShare,
        *,
        label: str,
        reserve: int | float | None,
        activations: Mapping[str, int] | None = None,
    ) -> None:
        self.state = state
        self.moving = moving
        self.share = share
        #: component -> the activation peak of its call predicted at the shapes the plan was made for (``auto`` given
        #: the call's shapes); a component without one counts none, and the reserve covers its activations
        self.activations = dict(activations or {})
        #: weight bytes this runtime may hold on the device in the call running now (None: before the first call)
        self.cap: int | None = None
        self.label = share.join(self, label, reserve)

    def leave(self) -> None:
        """The runtime was removed: nothing of it is on the device any more."""
        self.share.leave(self)

    # -- before and during a call ---------------------------------------------------------------------------

    def predicted_peak(self, component: str) -> int:
        """Weight bytes ``component``'s call holds at once as laid out now: the groups it keeps (and those held
        through the whole call), plus its largest streamed group once more for each group prefetched ahead."""
        groups = [g for g in self.state.groups_of[component] if g.policy is not Policy.RESIDENT]
        kept = sum(g.nbytes for g in groups if g.policy is Policy.EXCLUSIVE or not g.prefetchable)
        streamed = [g.nbytes for g in groups if g.policy is Policy.STREAM and g.prefetchable]
        ahead = min(self.moving.lookahead(component), len(streamed))
        return kept + (1 + ahead) * max(streamed, default=0)

    @not_traced
    def admit(self, component: str) -> None:
        """Before ``component``'s call: make the room it is predicted to need from the memory free now, and cap what
        this runtime holds during the call at what there is."""
        moving = self.moving
        mine = sum(g.nbytes for g in moving.resident(component))
        idle = sum(g.nbytes for name in moving.idle_components(component) for g in moving.resident(name))
        activations = self.activations.get(component, 0)
        need = max(self.predicted_peak(component) - mine, 0) + activations
        room = self.share.make_room(self, need - idle, f"room for a call of {component!r}")
        if room + idle < need:
            moving.switch_to(component)  # this runtime's idle components leave now, not at the first onload
            room = self.share.room()
        # what is still short comes out of the component's own kept groups, one at a time as its later groups need
        # the room (make_way), so that those needed first stay; the call's activations keep theirs
        self.cap = moving.held + max(room - activations, 0)

    def make_way(self, group: Group) -> None:
        """Before ``group`` is onloaded in a call: if it would take the runtime over the call's cap, the kept groups
        of the running component that are not in use leave first."""
        over = self.moving.held + group.nbytes - self.cap if self.cap is not None else 0
        if over > 0:
            self.release_kept(group, over, f"a call of {group.component!r}", "its room on the device is full")

    def fits_ahead(self, group: Group) -> bool:
        """Whether ``group`` may be copied ahead of its use without taking the runtime over the call's cap."""
        return self.cap is None or self.moving.held + group.nbytes <= self.cap

    def release_kept(self, keep: Group | None, needed: int, for_whom: str, why: str) -> int:
        """Offload kept groups of the running component that are not in use now until ``needed`` bytes are freed
        (they stream from then on); ``keep`` stays. Returns the bytes freed.

        Those needed again last leave first. A component enters its groups in the same order at every forward (the
        order of its layout), so the group needed last is the one just before ``keep`` in that order, then the one
        before it, and so on round the cycle: the one whose next use is furthest (letting the oldest leave first
        would make every kept group leave just before its next use, and all of them stream)."""
        moving = self.moving
        if moving.active is None:
            return 0
        order = {g: i for i, g in enumerate(self.state.groups_of[moving.active])}
        start = order.get(keep, 0)
        freed, count = 0, 0
        for group in sorted(moving.resident(moving.active), key=lambda g: (start - order.get(g, 0)) % len(order)):
            if freed >= needed:
                break
            if group is keep or not group.prefetchable or group.policy is not Policy.EXCLUSIVE:
                continue
            moving.synchronize()
            moving.offload(group)
            freed, count = freed + group.nbytes, count + 1
        if count:
            self.state.ledger.evicted(freed, count, by=self.label, for_whom=for_whom, why=why)
        return freed

    # -- out of memory ----------------------------------------------------------------------------------------

    def release_for(self, group: Group, error: torch.OutOfMemoryError) -> int:
        """The device ran out of memory onloading ``group``: release every group not needed now — what other
        handles that are not running keep, this runtime's idle components, the running component's groups copied
        ahead and its kept ones. Returns the bytes released."""
        moving = self.moving
        moving.synchronize()
        freed = self.share.evict_others(self, f"a call of {group.component!r} ran out of memory")
        for name in moving.idle_components(group.component):
            freed += sum(g.nbytes for g in moving.resident(name))
            moving.offload_component(name)
        for ahead in [g for g in moving.resident(group.component) if g.ready_event is not None and g is not group]:
            freed += ahead.nbytes  # copied ahead, not entered yet
            moving.offload(ahead)
        return freed + self.release_kept(group, EVERYTHING, f"a call of {group.component!r}", "out of memory")

    def recovered(self, group: Group, freed: int, error: torch.OutOfMemoryError) -> None:
        """The second try of ``group``'s onload fitted: say so, and let the call hold what it holds now."""
        message = str(error).strip()
        self.state.ledger.recovered(
            group.component, group.key, freed, message.splitlines()[0] if message else type(error).__name__
        )
        if self.cap is not None:
            self.cap = max(self.cap, self.moving.held + group.nbytes)

    def cannot_fit(self, group: Group, freed: int) -> DeviceMemoryError:
        """The error for a group that did not fit even after :meth:`release_for` freed ``freed`` bytes."""
        component, device, held = group.component, self.state.device, self.moving.held
        predicted, free = self.predicted_peak(component), self.share.streams.free_memory(device)
        return DeviceMemoryError(
            f"component {component!r} does not fit on {device}: its call was planned to hold "
            f"{format_bytes(predicted)} of weights at once; it held {format_bytes(held)} and could not onload group "
            f"{group.key!r} ({format_bytes(group.nbytes)}) even after memmode released {format_bytes(freed)} of "
            f"groups not needed now ({format_bytes(free)} free on the device). Every weight still has its stored "
            f"copy. Give it room: a smaller reserve=, what else uses the device closed, a placement that holds less "
            f"(model_group_offload with a smaller vram_budget, offload_type='leaf_level'), or a quantizer",
            component=component,
            device=str(device),
            predicted=predicted,
            actual=held + group.nbytes,
            free=free,
        )

    # -- the share's tenant ------------------------------------------------------------------------------------

    def held_bytes(self) -> int:
        """Weight bytes of the groups this runtime onloaded that are on the device now."""
        return self.moving.held

    def give_back(self, for_whom: str, why: str) -> int:
        """Another handle needs the room: offload every group onloaded here, unless this runtime is running (in a
        call, or its lock held by another thread). Returns the bytes freed."""
        lock = self.state.lock
        if not lock.acquire(blocking=False):
            return 0
        try:
            moving = self.moving
            if moving.in_call() or not moving.held:
                return 0
            freed = moving.held
            count = sum(len(moving.resident(name)) for name in self.state.components)
            for name in self.state.components:
                moving.offload_component(name)
            moving.active = None
            self.state.ledger.evicted(freed, count, by=self.label, for_whom=for_whom, why=why)
            return freed
        finally:
            lock.release()

    def took(self, from_whom: str, nbytes: int, why: str) -> None:
        """``from_whom`` gave back ``nbytes`` for this runtime."""
        self.state.ledger.evicted(nbytes, None, by=from_whom, for_whom=self.label, why=why)
