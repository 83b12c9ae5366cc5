"""A prepared plan's predicted cost: the :class:`PlanEntry` the planner reports and ``auto`` chooses from.

:func:`price` replays a call over a :class:`~memmode_core.planning.prepared.Prepared` (:mod:`.replay`) for the
peak weight bytes on the device and the bytes moved per call, and multiplies the stored bytes by the storage's
cost (:mod:`.measuring`) for the host memory and disk it holds. The time a call spends moving weights is the
bytes moved over the storage's bandwidth, plus a latency per onload; a prefetching placement hides most of it
behind compute (:data:`PREFETCH_OVERLAP`, or, with the call's shapes, the two clocks of :mod:`.timing`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from memmode_core.contracts.group_specs import Policy
from memmode_core.contracts.storage_cost import StorageCost
from memmode_core.planning.measuring import storage_cost
from memmode_core.planning.prepared import Prepared
from memmode_core.planning.replay import Replayed, SizedGroup, replay, sized_groups
from memmode_core.planning.timing import compute_rate, exposed_seconds, group_flops
from memmode_core.planning.trace import ComponentTrace

#: Share of a prefetching placement's copy time hidden behind compute.
PREFETCH_OVERLAP = 0.9


@dataclass
class PlanEntry:
    """The predicted cost of one mode with one storage."""

    mode: str
    placement: str
    quantizer: str | None
    storage: str | None
    options: dict[str, Any]
    peak_device_bytes: int
    transfer_bytes_per_call: int
    onloads_per_call: int
    pageable_bytes: int
    pinned_bytes: int
    disk_bytes: int
    seconds_per_call: float
    #: with the call's shapes (``plan(height=..., ...)``): the largest activation peak of a component the call
    #: runs, predicted on fake tensors (:mod:`memmode_core.planning.trace`); 0 without them
    activation_bytes: int = 0
    #: the operations of those components whose kernel workspace on the device is not modelled, so not in
    #: ``activation_bytes`` (:mod:`memmode_core.planning.workspace`): leave a margin for them
    unmodelled_workspace: tuple[str, ...] = ()
    #: the ranks of one machine the entry is priced for (each places the pipeline: one process per GPU), and
    #: what the machine holds for all of them: a storage whose ranks share one copy (files) counts it once
    ranks: int = 1
    machine_host_bytes: int = 0
    machine_disk_bytes: int = 0
    fits: bool = True
    reason: str | None = None
    chosen: bool = False
    #: the plan this entry prices: what ``apply`` executes when a resolver chooses the entry
    prepared: Prepared | None = field(default=None, repr=False, compare=False)

    @property
    def host_bytes(self) -> int:
        return self.pageable_bytes + self.pinned_bytes

    @property
    def device_bytes(self) -> int:
        """What the device needs at peak: weights, plus activations when the call's shapes were given."""
        return self.peak_device_bytes + self.activation_bytes

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "prepared"} | {
            "options": dict(self.options)
        }

    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.mode}[{extra}]" if extra else self.mode


def price(
    prepared: Prepared, sequence: list[str], traces: Mapping[str, ComponentTrace] | None = None, ranks: int = 1
) -> PlanEntry:
    """The predicted cost of executing ``prepared`` for the component calls ``sequence`` (with ``traces``, the
    components' FLOPs at the call's shapes: copy time hidden behind compute, :mod:`.timing`), on each of
    ``ranks`` ranks of one machine."""
    return _price(prepared, *_replayed(prepared, sequence, traces), sequence, ranks)


def price_all(
    prepared: list[Prepared], sequence: list[str], traces: Mapping[str, ComponentTrace] | None = None, ranks: int = 1
) -> list[PlanEntry]:
    """Price each candidate; candidates sharing one layout (one per storage) are sized, replayed and (with
    ``traces``) have their groups' compute counted once."""
    replays: dict[int, tuple[list[SizedGroup], Replayed, dict[str, float] | None]] = {}
    for one in prepared:
        if id(one.internal.groups) not in replays:
            replays[id(one.internal.groups)] = _replayed(one, sequence, traces)
    return [_price(one, *replays[id(one.internal.groups)], sequence, ranks) for one in prepared]


def _lookahead(prepared: Prepared) -> Mapping[str, int]:
    return prepared.internal.lookahead or {}


def _replayed(
    prepared: Prepared, sequence: list[str], traces: Mapping[str, ComponentTrace] | None
) -> tuple[list[SizedGroup], Replayed, dict[str, float] | None]:
    """What a layout costs whatever the storage: its sized groups, the replay of a call, and (with the call's
    traces) each group's compute seconds."""
    roots = prepared.internal.target.components
    sized = sized_groups(prepared.internal.groups, prepared.internal.group_bytes, roots)
    state = replay(sized, sequence, prepared.internal.prefetch, roots, _lookahead(prepared))
    compute = None
    if traces:
        rate = compute_rate(prepared.device)
        flops = group_flops(prepared.internal.groups, roots, traces)
        compute = {key: count / rate for key, count in flops.items()}
    return sized, state, compute


def _seconds(cost: StorageCost | None, moved: int, onloads: int, prefetch: bool) -> float:
    """Estimated seconds a call spends moving weights (the quantity ``auto`` minimises)."""
    if cost is None:  # nothing offloaded: nothing moves
        return 0.0
    seconds = cost.fetch_seconds(moved, onloads)
    return seconds * (1 - PREFETCH_OVERLAP) if prefetch else seconds


def _price(
    prepared: Prepared,
    sized: list[SizedGroup],
    state: Replayed,
    compute: dict[str, float] | None,
    sequence: list[str],
    ranks: int = 1,
) -> PlanEntry:
    """The entry for ``prepared`` from its sized groups, the replay of its layout and its groups' compute; what
    the machine holds for ``ranks`` ranks: each rank's own copy, but once what a storage's ranks share."""
    request = prepared.internal.request
    storage = request.storage.obj if request.storage is not None else None
    cost = storage_cost(storage, prepared.device) if storage is not None else None
    if compute is not None:
        seconds = exposed_seconds(
            prepared.internal.groups,
            prepared.internal.group_bytes,
            {id(s.group) for s in sized if s.idle},
            sequence,
            prepared.internal.target.components,
            prefetch=prepared.internal.prefetch,
            lookahead=_lookahead(prepared),
            compute=compute,
            cost=cost,
        )
    else:
        seconds = _seconds(cost, state.moved, state.onloads, prepared.internal.prefetch)
    offloaded = sum(s.nbytes for s in sized if s.group.policy is not Policy.RESIDENT)
    held = {"pageable": 0, "pinned": 0, "disk": 0}
    if cost is not None:
        held = {
            "pageable": round(offloaded * cost.pageable_per_byte),
            "pinned": round(offloaded * cost.pinned_per_byte),
            "disk": round(offloaded * cost.disk_per_byte),
        }
    # what the ranks of a machine share counts once: a storage's shared copy, and layers they pack once between them
    packed_once = request.packs_once_per_machine
    copies = 1 if (cost is not None and cost.shared_by_ranks) or packed_once else ranks
    machine_host = (held["pageable"] + held["pinned"]) * copies
    if prepared.device.type == "cpu":  # the device is the RAM: resident weights are host memory too, each rank's
        resident = sum(s.nbytes for s in sized if s.group.policy is Policy.RESIDENT)
        held["pageable"] += resident
        machine_host += resident * (1 if packed_once else ranks)
    return PlanEntry(
        mode=prepared.mode,
        placement=prepared.placement,
        quantizer=prepared.quantizer,
        storage=prepared.storage,
        options=dict(prepared.internal.variant),
        peak_device_bytes=state.peak,
        transfer_bytes_per_call=state.moved,
        onloads_per_call=state.onloads,
        pageable_bytes=held["pageable"],
        pinned_bytes=held["pinned"],
        disk_bytes=held["disk"],
        seconds_per_call=seconds,
        ranks=ranks,
        machine_host_bytes=machine_host,
        machine_disk_bytes=held["disk"] * copies,
        prepared=prepared,
    )
