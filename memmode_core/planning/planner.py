"""What each mode would cost, predicted from the same groups the engine builds, without running.

For every installed placement × storage (× quantizer, when asked), the planner asks the placement
for its layout, claims the tensors exactly as the engine does (:func:`claim_groups`), sizes the
groups (with the quantizer's packed sizes when one is asked for, from
:func:`memmode_core.quantization.layers.plan_quantization`), and replays a call through the engine's
policies: which groups are onloaded when, what stays, what is prefetched. That gives the peak
weight bytes on the device, the bytes moved per call, and the host memory and disk each storage
holds — the quantities the ledger of a real call reports.

A *call* is a profile of component calls: counts, ``calls={"text_encoder": 1, "transformer": 30}``
(run in the pipeline's component order), or the exact sequence, ``calls=["text_encoder",
"transformer", "transformer", ...]``.
The default profile for a pipeline is one forward of each text encoder and of the VAE (a decode:
an autoencoder's encoder side does not run in a text-to-image/video call), and ``steps`` denoiser
forwards shared between the denoisers (Wan 2.2's two experts split the steps). Figures are for a
steady-state call, as the second call of a run moves them. For an exact comparison with a real
call, pass that call's own sequence: ``plan(pipe, calls=handle.report().call_sequence)``.

The cost model behind ``auto`` — documented in docs/planner.md — is bytes moved per call over the
bandwidth of the storage (measured once per process on CUDA; defaults below otherwise), plus a
latency per synchronous onload; a prefetching placement hides most of its copies behind compute.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from memmode_core.contracts.costs import StorageCost, probe
from memmode_core.contracts.devices import resolve_device
from memmode_core.contracts.errors import IncompatibleModeError, InvalidOptionError
from memmode_core.contracts.layout import GroupSpec, Policy
from memmode_core.contracts.options import byte_size, resolve_options
from memmode_core.contracts.placement import lay_out
from memmode_core.contracts.targets import Target
from memmode_core.discovery.plugins import PluginSet, current
from memmode_core.engine.runtime import Group, claim_groups
from memmode_core.quantization import check as check_quantizer

#: Share of a prefetching placement's copy time hidden behind compute.
PREFETCH_OVERLAP = 0.9
#: Denoising steps of the default call profile.
DEFAULT_STEPS = 20
#: Share of free device memory ``auto`` may fill with weights by default (the rest is for activations).
DEFAULT_VRAM_SHARE = 0.8
#: Share of available RAM ``auto`` may fill with offloaded weights by default.
DEFAULT_RAM_SHARE = 0.9

#: Among equally fast entries, storages that write no files come first: writing and hashing the model
#: is a cost at ``apply`` that the per-call model does not count.
_STORAGE_PREFERENCE = {None: 0, "ram": 1, "pinned": 2, "mmap": 3, "disk": 4}

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
    fits: bool = True
    reason: str | None = None
    chosen: bool = False

    @property
    def host_bytes(self) -> int:
        return self.pageable_bytes + self.pinned_bytes

    def as_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.mode}[{extra}]" if extra else self.mode


#: The placement options each built-in placement is planned with (third-party ones: their defaults).
VARIANTS: dict[str, list[dict[str, Any]]] = {
    "model_group_offload": [{"offload_type": "block_level"}, {"offload_type": "leaf_level"}],
}


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


def idle_roots(component: nn.Module) -> list[nn.Module]:
    """Submodules a default call does not run: an autoencoder's encoder side (a text-to-image/video
    call only decodes) and a vision-language text encoder's vision tower (the prompt is text)."""
    roots = []
    if callable(getattr(component, "decode", None)) and isinstance(getattr(component, "decoder", None), nn.Module):
        roots += [m for name in ("encoder", "quant_conv") if isinstance(m := getattr(component, name, None), nn.Module)]
    for path, module in component.named_modules():
        if path.split(".")[-1] == "visual" and path.count(".") <= 1:
            roots.append(module)
    return roots


# -- sizing -----------------------------------------------------------------------------------------


@dataclass
class _Sized:
    group: Group
    nbytes: int
    idle: bool


def _size_groups(
    target: Target,
    groups: list[Group],
    quantizer,
    quantized: Mapping[str, nn.Module],
    exclude: tuple[str, ...],
    quantizer_options: Mapping[str, object],
) -> list[_Sized]:
    from memmode_core.quantization import plan_quantization

    plans = (
        {
            name: plan_quantization(quantizer, module, exclude=exclude, options=quantizer_options)
            for name, module in quantized.items()
        }
        if quantizer is not None
        else {}
    )
    idle_ids: dict[str, set[int]] = {}
    for name, component in target.components.items():
        ids: set[int] = set()
        for root in idle_roots(component):
            ids.update(id(m) for m in root.modules())
        idle_ids[name] = ids
    sized = []
    for group in groups:
        plan = plans.get(group.component)
        if plan is None:
            nbytes = group.nbytes
        else:
            owners = {id(slot.owner): slot.owner for slot in group.slots}
            nbytes = sum(plan.direct_bytes(m) for m in owners.values())
        idle = bool(group.slots) and all(id(slot.owner) in idle_ids[group.component] for slot in group.slots)
        sized.append(_Sized(group, nbytes, idle))
    return sized


def stored_sizes(
    target: Target,
    specs: list[GroupSpec],
    quantizer=None,
    quantized: Mapping[str, nn.Module] = {},
    exclude: tuple[str, ...] = (),
    quantizer_options: Mapping[str, object] = {},
) -> dict[str, int]:
    """Bytes of each group a storage will hold, once quantized: what ``apply`` reserves before it
    quantizes, so that a storage without room refuses while nothing has been touched."""
    groups = claim_groups(target.components, specs)
    sized = _size_groups(target, groups, quantizer, quantized, exclude, quantizer_options)
    return {s.group.key: s.nbytes for s in sized if s.group.policy is not Policy.RESIDENT}


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


def replay(sized: list[_Sized], sequence: list[str], prefetch: bool, roots: Mapping[str, nn.Module]) -> _Replay:
    """The engine's policies over one steady-state call (the second of two identical calls).

    Within a component call, the groups entered at the component itself (its rest groups, the
    component's own loose parameters at leaf level) stay resident for the whole call; the others are
    entered one after the other in definition order, each with its successor when prefetching.
    """
    state = _Replay()
    for s in sized:
        if s.group.policy is Policy.RESIDENT:
            state.onload(s)
    kinds: dict[str, tuple[list[_Sized], list[_Sized], list[_Sized]]] = {}
    for name in set(sequence):
        mine = [s for s in sized if s.group.component == name and not s.idle]
        exclusive = [s for s in mine if s.group.policy is Policy.EXCLUSIVE]
        streaming = [s for s in mine if s.group.policy is Policy.STREAM]
        enclosing = [s for s in streaming if not s.group.prefetchable or roots[name] in _owners(s.group)]
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
            if prefetch and blocks:
                state.onload(blocks[0])  # prefetched when the component's first group was onloaded
            for index, s in enumerate(blocks):
                state.onload(s)
                if prefetch and index + 1 < len(blocks):
                    state.onload(blocks[index + 1])
                state.offload(s)
            for s in enclosing:
                state.offload(s)
    return state


def _owners(group: Group) -> list[nn.Module]:
    return [slot.owner for slot in group.slots]


# -- bandwidth ------------------------------------------------------------------------------------------


def _seconds(cost: StorageCost | None, moved: int, onloads: int, device: torch.device, prefetch: bool) -> float:
    """Estimated seconds a call spends moving weights (the quantity ``auto`` minimises)."""
    if cost is None:  # nothing offloaded: nothing moves
        return 0.0
    seconds = cost.fetch_seconds(moved, onloads)
    return seconds * (1 - PREFETCH_OVERLAP) if prefetch else seconds


# -- budgets --------------------------------------------------------------------------------------------


def default_vram_budget(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_VRAM_SHARE)
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
    **options: Any,
) -> list[PlanEntry]:
    """Predict every installed placement × storage (× ``quantizer``) for ``target``; see the module docstring.

    ``vram_budget`` / ``ram_budget`` (bytes or strings such as ``"8GiB"``) decide ``fits``; the
    entry ``auto`` would choose has ``chosen=True``. ``options`` are placement options applied to
    every candidate that accepts them (e.g. ``num_blocks_per_group=2``).
    """
    tgt = Target.of(target).without(exclude_components or ())
    dev = resolve_device(device)
    vram = _budget("vram_budget", vram_budget)
    ram = _budget("ram_budget", ram_budget)
    plugins = current()
    quantizers = _quantizers(plugins, quantizer)
    sequence = call_sequence(tgt, calls if calls is not None else default_calls(tgt, steps))
    excluded = tuple(exclude or ())
    entries: list[PlanEntry] = []
    for qname, qreg in quantizers:
        qobj = qreg.obj if qreg is not None else None
        quantized = tgt.select(components) if qobj is not None else {}
        qopts = resolve_options([(qname, qobj.options)], {})[qname] if qobj is not None else {}
        if qobj is not None:
            check_quantizer(qobj, quantized, weight_dtype=weight_dtype, exclude=excluded, options=qopts)
        for preg in plugins.registrations["placement"].values():
            if preg.name == "auto" or preg.unavailable_reason():
                continue
            placement = preg.obj
            for variant in VARIANTS.get(preg.name, [{}]):
                given = {k: v for k, v in {**options, **variant}.items() if k in {o.name for o in placement.options}}
                popts = resolve_options([(preg.name, placement.options)], given)[preg.name]
                try:
                    specs = lay_out(placement, tgt, popts, dev).specs
                except (IncompatibleModeError, InvalidOptionError):
                    continue
                groups = claim_groups(tgt.components, specs)
                sized = _size_groups(tgt, groups, qobj, quantized, excluded, qopts)
                prefetch = placement.prefetch(popts, dev)
                state = replay(sized, sequence, prefetch, tgt.components)
                storages = _storages(plugins, placement, dev, storage)
                mode = preg.name if qname is None else f"{preg.name}_and_{qname}"
                for sreg in storages:
                    entries.append(_entry(mode, preg.name, qname, sreg, variant, sized, state, dev, prefetch))
    _judge(entries, vram, ram)
    return entries


def _budget(name: str, value: Any) -> int | None:
    try:
        return byte_size(value)
    except (TypeError, ValueError) as exc:
        raise InvalidOptionError(f"{name}={value!r}: {exc}") from None


def _quantizers(plugins: PluginSet, quantizer) -> list[tuple[str | None, Any]]:
    from memmode_core.discovery.grammar import lookup

    if quantizer is None:
        return [(None, None)]
    names = [quantizer] if isinstance(quantizer, str) else list(quantizer)
    return [(name, lookup(plugins, "quantizer", name, mode=None)) for name in names]


def _storages(plugins: PluginSet, placement, device: torch.device, only: str | None) -> list:
    if not placement.offloads:
        return [None]
    found = []
    for reg in plugins.registrations["storage"].values():
        if only is not None and reg.name != only:
            continue
        if reg.obj.unavailable_reason(device) is None:
            found.append(reg)
    return found


def _entry(mode, placement, quantizer, sreg, variant, sized, state: _Replay, device, prefetch) -> PlanEntry:
    cost = _cost(sreg.obj, device) if sreg is not None else None
    offloaded = sum(s.nbytes for s in sized if s.group.policy is not Policy.RESIDENT)
    held = {"pageable": 0, "pinned": 0, "disk": 0}
    if cost is not None:
        held = {
            "pageable": round(offloaded * cost.pageable_per_byte),
            "pinned": round(offloaded * cost.pinned_per_byte),
            "disk": round(offloaded * cost.disk_per_byte),
        }
    if device.type == "cpu":  # the device is the RAM: resident weights are host memory too
        held["pageable"] += sum(s.nbytes for s in sized if s.group.policy is Policy.RESIDENT)
    return PlanEntry(
        mode=mode,
        placement=placement,
        quantizer=quantizer,
        storage=sreg.name if sreg is not None else None,
        options=dict(variant),
        peak_device_bytes=state.peak,
        transfer_bytes_per_call=state.moved,
        onloads_per_call=state.onloads,
        pageable_bytes=held["pageable"],
        pinned_bytes=held["pinned"],
        disk_bytes=held["disk"],
        seconds_per_call=_seconds(cost, state.moved, state.onloads, device, prefetch),
    )


def _cost(storage, device: torch.device) -> StorageCost:
    """The storage's declared or measured cost; a storage whose ``cost`` fails is measured instead."""
    try:
        cost = storage.cost(device)
        if isinstance(cost, StorageCost):
            return cost
    except Exception:  # noqa: BLE001 - a plugin's cost() must not break planning
        pass
    return probe(storage, device)


def _judge(entries: list[PlanEntry], vram: int | None, ram: int | None) -> None:
    from memmode_core.contracts.units import format_bytes

    for e in entries:
        reasons = []
        if vram is not None and e.peak_device_bytes > vram:
            reasons.append(f"needs {format_bytes(e.peak_device_bytes)} on the device")
        if ram is not None and e.host_bytes > ram:
            reasons.append(f"needs {format_bytes(e.host_bytes)} of RAM")
        e.fits, e.reason = not reasons, "; ".join(reasons) or None
    fitting = [e for e in entries if e.fits]
    if fitting:
        best = min(
            fitting,
            key=lambda e: (
                e.seconds_per_call,
                e.peak_device_bytes,
                _STORAGE_PREFERENCE.get(e.storage, 9),
                e.host_bytes,
            ),
        )
        best.chosen = True


def choose(entries: list[PlanEntry], vram: int | None, ram: int | None) -> PlanEntry:
    """The entry ``auto`` picks, or :class:`NoModeFitsError` saying what the smallest one needs."""
    from memmode_core.contracts.units import format_bytes

    for e in entries:
        if e.chosen:
            return e
    if not entries:
        raise NoModeFitsError("no installed placement can place this target")
    smallest = min(entries, key=lambda e: (e.peak_device_bytes, e.host_bytes))
    budget = ", ".join(
        f"{n}={format_bytes(v)}" for n, v in (("vram_budget", vram), ("ram_budget", ram)) if v is not None
    )
    raise NoModeFitsError(
        f"no mode fits {budget}: the smallest, {smallest.label()} with storage {smallest.storage}, needs "
        f"{format_bytes(smallest.peak_device_bytes)} on the device and {format_bytes(smallest.host_bytes)} of RAM"
        + (f" ({format_bytes(smallest.disk_bytes)} on disk)" if smallest.disk_bytes else "")
    )


__all__ = ["PlanEntry", "plan", "choose", "NoModeFitsError", "default_calls"]
