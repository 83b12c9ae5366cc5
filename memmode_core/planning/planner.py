"""What each mode would cost, predicted from the plan ``apply`` would execute, without running.

For every installed placement x storage (x quantizer, when asked), the planner prepares the target
exactly as ``apply`` would (:func:`~memmode_core.planning.prepared.prepare_target`: the placement's
layout as core adjusts it, the claimed groups, the quantization plans, the sizes) and prices that
:class:`~memmode_core.planning.prepared.Prepared` (:func:`price`): it replays a call through the
engine's policies — which groups are onloaded when, what stays, what is prefetched — for the peak
weight bytes on the device and the bytes moved per call, and multiplies the stored bytes by each
storage's cost (:mod:`memmode_core.planning.costs`) for the host memory and disk it holds: the
quantities the ledger of a real call reports. A resolver (``auto``) executes the candidate it chose.

A *call* is a profile of component calls: counts, ``calls={"text_encoder": 1, "transformer": 30}``
(run in the pipeline's component order), or the exact sequence, ``calls=["text_encoder",
"transformer", "transformer", ...]``.
The default profile for a pipeline is one forward of each text encoder and of the VAE (a decode:
an autoencoder's encoder side does not run in a text-to-image/video call), and ``steps`` denoiser
forwards shared between the denoisers (Wan 2.2's two experts split the steps). Figures are for a
steady-state call, as the second call of a run moves them. For an exact comparison with a real
call, pass that call's own sequence: ``plan(pipe, calls=handle.report().call_sequence)``.

The cost model behind ``auto`` — documented in docs/planner.md — is bytes moved per call over the
bandwidth of the storage (measured once per process on CUDA; declared defaults otherwise), plus a
latency per synchronous onload; a prefetching placement hides most of its copies behind compute.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from memmode_core.contracts.costs import StorageCost
from memmode_core.contracts.devices import resolve_device
from memmode_core.contracts.errors import IncompatibleModeError, InvalidOptionError
from memmode_core.contracts.layout import Policy
from memmode_core.contracts.options import byte_size
from memmode_core.contracts.resolver import Resolver
from memmode_core.contracts.targets import Target
from memmode_core.contracts.units import format_bytes
from memmode_core.discovery.first_party import STORAGE_TIE_ORDER
from memmode_core.discovery.grammar import Mode, lookup
from memmode_core.discovery.plugins import current
from memmode_core.discovery.registrations import Registration
from memmode_core.engine.groups import Group
from memmode_core.engine.streams import active
from memmode_core.planning.costs import storage_cost
from memmode_core.planning.prepared import (
    CANDIDATES,
    Prepared,
    Request,
    candidate_request,
    plan_components,
    prepare_target,
    quantize_targets,
)
from memmode_core.planning.residency import BudgetTooSmallError, encloses, idle_groups
from memmode_core.planning.timing import compute_rate, exposed_seconds, group_flops
from memmode_core.planning.trace import ComponentTrace, trace_pipeline_call

#: Share of a prefetching placement's copy time hidden behind compute.
PREFETCH_OVERLAP = 0.9
#: Denoising steps of the default call profile.
DEFAULT_STEPS = 20
#: Share of free device memory ``auto`` may fill with weights by default (the rest is for activations).
DEFAULT_VRAM_SHARE = 0.8
#: Share of free device memory ``auto`` may fill with weights and the predicted activations when the call's shapes
#: are given: the rest covers what the prediction leaves out (the allocator's rounding and caching, unmodelled
#: kernel workspace)
SHAPED_VRAM_SHARE = 0.95
#: Share of available RAM ``auto`` may fill with offloaded weights by default.
DEFAULT_RAM_SHARE = 0.9

_DENOISER = re.compile(r"^(transformer|unet|prior|decoder_transformer)(_\d+)?$")


class NoModeFitsError(IncompatibleModeError):
    """No placement × storage fits the budgets; the message says what the smallest one needs."""


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


# -- the call profile --------------------------------------------------------------------------------


def default_calls(target: Target, steps: int = DEFAULT_STEPS) -> dict[str, int]:
    if not target.is_pipeline:
        return {name: 1 for name in target.components}
    denoisers = [n for n in target.components if _DENOISER.match(n)]
    calls = {}
    for name in target.components:
        if name in denoisers:
            calls[name] = max(1, math.ceil(steps / len(denoisers)))
        else:
            calls[name] = 1
    return calls


def call_sequence(target: Target, calls: Mapping[str, int] | Iterable[str]) -> list[str]:
    """The component calls of one call, in order. Counts run in the pipeline's ``model_cpu_offload_seq``
    order (then the remaining components), each component's calls back to back."""
    if isinstance(calls, Mapping):
        sequence = getattr(target.obj, "model_cpu_offload_seq", None) or ""
        ordered = [n for n in sequence.split("->") if n in target.components]
        ordered += [n for n in target.components if n not in ordered]
        unknown = set(calls) - set(target.components)
        result = [n for n in ordered for _ in range(int(calls.get(n, 0)))]
    else:
        result = list(calls)
        unknown = set(result) - set(target.components)
    if unknown:
        raise InvalidOptionError(f"calls= names no component {', '.join(sorted(unknown))} of {target.label}")
    return result


# -- sizing -----------------------------------------------------------------------------------------


@dataclass
class _Sized:
    group: Group
    nbytes: int
    idle: bool


def _sized(prepared: Prepared) -> list[_Sized]:
    """The prepared groups with their bytes once quantized, and whether a default call leaves them idle."""
    idle = idle_groups(prepared.groups, prepared.target.components)
    return [_Sized(group, prepared.group_bytes[group.key], id(group) in idle) for group in prepared.groups]


# -- replaying a call ---------------------------------------------------------------------------------


@dataclass
class _Replay:
    resident: dict[int, int] = field(default_factory=dict)  # id(group) -> bytes
    owner: dict[int, str] = field(default_factory=dict)
    peak: int = 0
    moved: int = 0
    onloads: int = 0

    def onload(self, sized: _Sized) -> None:
        key = id(sized.group)
        if key in self.resident:
            return
        self.resident[key] = sized.nbytes
        self.owner[key] = sized.group.component
        self.moved += sized.nbytes
        self.onloads += 1
        self.peak = max(self.peak, sum(self.resident.values()))

    def offload(self, sized: _Sized) -> None:
        self.resident.pop(id(sized.group), None)

    def evict_others(self, component: str, sized_groups: list[_Sized]) -> None:
        for s in sized_groups:
            if s.group.policy is not Policy.RESIDENT and self.owner.get(id(s.group)) not in (None, component):
                self.offload(s)


def replay(
    sized: list[_Sized],
    sequence: list[str],
    prefetch: bool,
    roots: Mapping[str, nn.Module],
    lookahead: Mapping[str, int] | None = None,
) -> _Replay:
    """The engine's policies over one steady-state call (the second of two identical calls).

    Within a component call, the groups entered at the component itself (its rest groups, the
    component's own loose parameters at leaf level) stay resident for the whole call; the others are
    entered one after the other in definition order, each with its ``lookahead`` successors (default
    one) when prefetching; groups kept while their component runs (``EXCLUSIVE``) stay until another
    component takes the device.
    """
    lookahead = lookahead or {}
    state = _Replay()
    for s in sized:
        if s.group.policy is Policy.RESIDENT:
            state.onload(s)
    kinds: dict[str, tuple[list[_Sized], list[_Sized], list[_Sized]]] = {}
    for name in set(sequence):
        mine = [s for s in sized if s.group.component == name and not s.idle]
        exclusive = [s for s in mine if s.group.policy is Policy.EXCLUSIVE]
        streaming = [s for s in mine if s.group.policy is Policy.STREAM]
        enclosing = [s for s in streaming if encloses(s.group, roots[name])]
        kinds[name] = (exclusive, enclosing, [s for s in streaming if s not in enclosing])
    for run in range(2):
        if run == 1:
            state.moved, state.onloads = 0, 0
            state.peak = sum(state.resident.values())
        for name in sequence:
            exclusive, enclosing, blocks = kinds[name]
            state.evict_others(name, sized)
            for s in exclusive + enclosing:
                state.onload(s)
            ahead = lookahead.get(name, 1) if prefetch else 0
            for s in blocks[:ahead]:
                state.onload(s)  # prefetched when the component's first group was onloaded
            for index, s in enumerate(blocks):
                state.onload(s)
                for following in blocks[index + 1 : index + 1 + ahead]:
                    state.onload(following)
                state.offload(s)
            for s in enclosing:
                state.offload(s)
    return state


# -- pricing --------------------------------------------------------------------------------------------


def _seconds(cost: StorageCost | None, moved: int, onloads: int, prefetch: bool) -> float:
    """Estimated seconds a call spends moving weights (the quantity ``auto`` minimises)."""
    if cost is None:  # nothing offloaded: nothing moves
        return 0.0
    seconds = cost.fetch_seconds(moved, onloads)
    return seconds * (1 - PREFETCH_OVERLAP) if prefetch else seconds


def price(prepared: Prepared, sequence: list[str], traces: Mapping[str, ComponentTrace] | None = None) -> PlanEntry:
    """The predicted cost of executing ``prepared`` for the component calls ``sequence`` (with ``traces``, the
    components' FLOPs at the call's shapes: copy time hidden behind compute, :mod:`.timing`)."""
    return _price(prepared, *_replayed(prepared, sequence, traces), sequence)


def _lookahead(prepared: Prepared) -> Mapping[str, int]:
    return prepared.residency.lookahead if prepared.residency is not None else {}


def _replayed(
    prepared: Prepared, sequence: list[str], traces: Mapping[str, ComponentTrace] | None
) -> tuple[list[_Sized], _Replay, dict[str, float] | None]:
    """What a layout costs whatever the storage: its sized groups, the replay of a call, and (with the call's
    traces) each group's compute seconds."""
    sized = _sized(prepared)
    state = replay(sized, sequence, prepared.prefetch, prepared.target.components, _lookahead(prepared))
    compute = None
    if traces:
        rate = compute_rate(prepared.device)
        flops = group_flops(prepared.groups, prepared.target.components, traces)
        compute = {key: count / rate for key, count in flops.items()}
    return sized, state, compute


def _price(
    prepared: Prepared,
    sized: list[_Sized],
    state: _Replay,
    compute: dict[str, float] | None,
    sequence: list[str],
) -> PlanEntry:
    """The entry for ``prepared`` from its sized groups, the replay of its layout and its groups' compute."""
    storage = prepared.storage
    cost = storage_cost(storage, prepared.device) if storage is not None else None
    if compute is not None:
        seconds = exposed_seconds(
            prepared.groups,
            prepared.group_bytes,
            {id(s.group) for s in sized if s.idle},
            sequence,
            prepared.target.components,
            prefetch=prepared.prefetch,
            lookahead=_lookahead(prepared),
            compute=compute,
            cost=cost,
        )
    else:
        seconds = _seconds(cost, state.moved, state.onloads, prepared.prefetch)
    offloaded = sum(s.nbytes for s in sized if s.group.policy is not Policy.RESIDENT)
    held = {"pageable": 0, "pinned": 0, "disk": 0}
    if cost is not None:
        held = {
            "pageable": round(offloaded * cost.pageable_per_byte),
            "pinned": round(offloaded * cost.pinned_per_byte),
            "disk": round(offloaded * cost.disk_per_byte),
        }
    if prepared.device.type == "cpu":  # the device is the RAM: resident weights are host memory too
        held["pageable"] += sum(s.nbytes for s in sized if s.group.policy is Policy.RESIDENT)
    request = prepared.request
    return PlanEntry(
        mode=prepared.mode,
        placement=request.placement.name,
        quantizer=request.quantizer.name if request.quantizer else None,
        storage=request.storage.name if request.storage else None,
        options=dict(prepared.variant),
        peak_device_bytes=state.peak,
        transfer_bytes_per_call=state.moved,
        onloads_per_call=state.onloads,
        pageable_bytes=held["pageable"],
        pinned_bytes=held["pinned"],
        disk_bytes=held["disk"],
        seconds_per_call=seconds,
        prepared=prepared,
    )


# -- candidates ---------------------------------------------------------------------------------------------


def candidates(target: Any, base: Request) -> list[Prepared]:
    """Every installed placement x storage prepared for ``target`` with ``base``'s quantizer and arguments:
    each placement's layout once per variant it declares (``Placement.plan_variants``), priced with every
    usable storage (``base.storage_given`` only, when one was named). A placement that refuses the target
    is left out; the quantizer's refusal is an error (no candidate could quantize)."""
    plugins = current()
    whole = Target.of(target)
    shared = None
    if base.quantizer is not None:
        placed = whole.without(base.exclude_components)
        shared = plan_components(base.quantizer.obj, quantize_targets(whole, placed, base), base)
    found: list[Prepared] = []
    for preg in plugins.registrations["placement"].values():
        if isinstance(preg.obj, Resolver) or preg.unavailable_reason():
            continue
        storages = _storages(plugins, preg, base)
        if not storages:
            continue
        for variant in getattr(preg.obj, "plan_variants", None) or ({},):
            try:
                first = candidate_request(base, preg, storages[0], variant)
                try:
                    prepared = prepare_target(target, first, quantization=shared, variant=variant)
                except BudgetTooSmallError:  # priced as it streams everything, and judged not to fit
                    options = dataclasses.replace(first.placement_options, vram_budget=None)
                    first = dataclasses.replace(first, placement_options=options)
                    prepared = prepare_target(target, first, quantization=shared, variant=variant)
            except (IncompatibleModeError, InvalidOptionError):
                continue
            found.append(prepared)
            for sreg in storages[1:]:
                found.append(prepared.with_storage(sreg, candidate_request(base, preg, sreg, variant).storage_options))
    return found


def _storages(plugins, preg: Registration, base: Request) -> list[Registration | None]:
    """The storages a candidate placement is priced with: none for a placement that offloads nothing (and
    none at all if ``offload_dir`` asks for a storage that writes files); else every usable one, or the
    one named."""
    if not getattr(preg.obj, "offloads", True):
        return [] if base.offload_dir is not None else [None]
    found = []
    for reg in plugins.registrations["storage"].values():
        if base.storage_given is not None and reg.name != base.storage_given:
            continue
        if reg.obj.unavailable_reason(base.device) is None:
            found.append(reg)
    return found


# -- budgets --------------------------------------------------------------------------------------------


def default_vram_budget(device: torch.device, share: float = DEFAULT_VRAM_SHARE) -> int | None:
    """``share`` of the device's free memory (None on the host: no limit)."""
    streams = active()
    if not streams.is_host(device):
        free, _ = streams.memory_info(device)
        return int(free * share)
    return None


def default_ram_budget() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * DEFAULT_RAM_SHARE)
    except OSError:
        pass
    return None


# -- the planner ------------------------------------------------------------------------------------------


def plan(
    target: Any,
    *,
    device: Any = None,
    vram_budget: Any = None,
    ram_budget: Any = None,
    quantizer: str | Iterable[str] | None = None,
    storage: str | None = None,
    weight_dtype=None,
    components: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    calls: Mapping[str, int] | None = None,
    steps: int = DEFAULT_STEPS,
    exclude_components: Iterable[str] | None = None,
    height: int | None = None,
    width: int | None = None,
    num_frames: int | None = None,
    batch: int | None = None,
    **options: Any,
) -> list[PlanEntry]:
    """Predict every installed placement × storage (× ``quantizer``) for ``target``; see the module docstring.

    ``vram_budget`` / ``ram_budget`` (bytes or strings such as ``"8GiB"``) decide ``fits`` (and group offload
    keeps groups on the device up to ``vram_budget``: :mod:`memmode_core.planning.residency`); the
    entry ``auto`` would choose has ``chosen=True``. ``options`` are options applied to every
    candidate whose placement, storage or quantizer declares them (e.g. ``num_blocks_per_group=2``).

    ``height``, ``width``, ``num_frames``, ``batch``: the shapes of the call to plan for. Given any, each
    entry's ``activation_bytes`` is the activation peak of the call's components, predicted by running their
    forwards on fake tensors, and ``vram_budget`` counts weights plus activations (``device_bytes``).
    """
    tgt = Target.of(target).without(exclude_components or ())
    dev = resolve_device(device)
    vram = _budget("vram_budget", vram_budget)
    ram = _budget("ram_budget", ram_budget)
    plugins = current()
    sequence = call_sequence(tgt, calls if calls is not None else default_calls(tgt, steps))
    call = CallTrace.of(target, sequence, dev, call_shapes(height, width, num_frames, batch))
    entries: list[PlanEntry] = []
    for qreg in _quantizers(plugins, quantizer):
        base = Request(
            mode=Mode(CANDIDATES, qreg.name if qreg is not None else None),
            placement=None,
            quantizer=qreg,
            storage=None,
            device=dev,
            weight_dtype=weight_dtype,
            components=tuple(components) if components is not None else None,
            exclude=tuple(exclude or ()),
            exclude_components=tuple(exclude_components or ()),
            storage_given=storage,
            # a placement that can fit itself to the budget (group offload keeps groups up to what the
            # activations leave of it) does
            given=dict(options) | ({"vram_budget": call.weights_budget(vram)} if vram is not None else {}),
            traces=call.traces,
        )
        entries += price_all(candidates(target, base), sequence, call.traces)
    call.mark(entries)
    judge(entries, vram, ram)
    return entries


def call_shapes(
    height: int | None = None, width: int | None = None, num_frames: int | None = None, batch: int | None = None
) -> dict[str, int]:
    """The call's shapes that were given (what :class:`CallTrace` traces the call at)."""
    given = dict(height=height, width=width, num_frames=num_frames, batch=batch)
    return {name: value for name, value in given.items() if value is not None}


@dataclass(frozen=True)
class CallTrace:
    """A call at given shapes, traced once on fake tensors (:mod:`memmode_core.planning.trace`) and handed to
    what prices and judges the candidates: the traces (compute per group), the activation peak over the
    components the call sequence runs, and the operations whose workspace that peak leaves out. Without
    shapes nothing is traced and activations count 0 (``vram_budget`` counts weights only)."""

    traces: Mapping[str, ComponentTrace] | None = None
    activation_bytes: int = 0
    unmodelled_workspace: tuple[str, ...] = ()

    @classmethod
    def of(cls, target: Any, sequence: list[str], device: torch.device, shapes: Mapping[str, int]) -> CallTrace:
        if not shapes:
            return cls()
        shapes = dict(shapes)
        batch = shapes.pop("batch", 1)
        traces = trace_pipeline_call(target, batch=batch, device=device, **shapes)
        ran = [traces[name] for name in set(sequence) if name in traces]
        return cls(
            traces,
            max((t.activation_peak for t in ran), default=0),
            tuple(sorted(set().union(*(t.unmodelled for t in ran)))),
        )

    def weights_budget(self, vram: int) -> int:
        """What a device budget of ``vram`` bytes leaves for weights once the call's activations have theirs."""
        return max(vram - self.activation_bytes, 1)

    def mark(self, entries: Iterable[PlanEntry]) -> None:
        for entry in entries:
            entry.activation_bytes = self.activation_bytes
            entry.unmodelled_workspace = self.unmodelled_workspace


def price_all(
    prepared: list[Prepared], sequence: list[str], traces: Mapping[str, ComponentTrace] | None = None
) -> list[PlanEntry]:
    """Price each candidate; candidates sharing one layout (one per storage) are sized, replayed and (with
    ``traces``) have their groups' compute counted once."""
    replays: dict[int, tuple[list[_Sized], _Replay, dict[str, float] | None]] = {}
    for one in prepared:
        if id(one.groups) not in replays:
            replays[id(one.groups)] = _replayed(one, sequence, traces)
    return [_price(one, *replays[id(one.groups)], sequence) for one in prepared]


def _budget(name: str, value: Any) -> int | None:
    try:
        return byte_size(value)
    except (TypeError, ValueError) as exc:
        raise InvalidOptionError(f"{name}={value!r}: {exc}") from None


def _quantizers(plugins, quantizer) -> list[Registration | None]:
    if quantizer is None:
        return [None]
    names = [quantizer] if isinstance(quantizer, str) else list(quantizer)
    return [lookup(plugins, "quantizer", name, mode=None) for name in names]


def _tie_rank(storage: str | None) -> int:
    if storage is None:
        return -1
    return STORAGE_TIE_ORDER.index(storage) if storage in STORAGE_TIE_ORDER else len(STORAGE_TIE_ORDER)


def judge(entries: list[PlanEntry], vram: int | None, ram: int | None) -> None:
    """Mark what fits the budgets, and the entry ``auto`` chooses: the fastest that fits (ties: least on the
    device, then storages that write nothing, then least host memory)."""
    for e in entries:
        reasons = []
        if vram is not None and e.device_bytes > vram:
            reasons.append(f"needs {format_bytes(e.device_bytes)} on the device")
        if ram is not None and e.host_bytes > ram:
            reasons.append(f"needs {format_bytes(e.host_bytes)} of RAM")
        e.fits, e.reason = not reasons, "; ".join(reasons) or None
    fitting = [e for e in entries if e.fits]
    if fitting:
        best = min(
            fitting,
            key=lambda e: (e.seconds_per_call, e.peak_device_bytes, _tie_rank(e.storage), e.host_bytes),
        )
        best.chosen = True


def choose(entries: list[PlanEntry], vram: int | None, ram: int | None) -> PlanEntry:
    """The entry ``auto`` picks, or :class:`NoModeFitsError` saying what the smallest one needs."""
    for e in entries:
        if e.chosen:
            return e
    if not entries:
        raise NoModeFitsError("no installed placement can place this target")
    smallest = min(entries, key=lambda e: (e.device_bytes, e.host_bytes))
    budget = ", ".join(
        f"{n}={format_bytes(v)}" for n, v in (("vram_budget", vram), ("ram_budget", ram)) if v is not None
    )
    on_device = format_bytes(smallest.device_bytes)
    if smallest.activation_bytes:
        on_device += (
            f" ({format_bytes(smallest.peak_device_bytes)} of weights, {format_bytes(smallest.activation_bytes)} "
            "of activations at the call's shapes)"
        )
    raise NoModeFitsError(
        f"no mode fits {budget}: the smallest, {smallest.label()} with storage {smallest.storage}, needs "
        f"{on_device} on the device and {format_bytes(smallest.host_bytes)} of RAM"
        + (f" ({format_bytes(smallest.disk_bytes)} on disk)" if smallest.disk_bytes else "")
    )


__all__ = ["PlanEntry", "plan", "choose", "judge", "price", "candidates", "NoModeFitsError", "default_calls"]
