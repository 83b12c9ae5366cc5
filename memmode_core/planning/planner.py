"""``plan``: what each mode would cost, predicted from the plan ``apply`` would execute, without running.

For every installed placement x storage (x quantizer, when asked), the target is prepared exactly as ``apply``
would prepare it and priced for one call (:mod:`.candidates`, :mod:`.pricing`): the peak weight bytes on the
device and the bytes moved per call, from a replay of the call through the engine's policies (:mod:`.replay`);
the host memory and disk held, from each storage's cost (:mod:`.measuring`) — the quantities the ledger of a
real call reports. Figures are for a steady-state call, as the second call of a run moves them; the call's
profile and shapes are :mod:`.calls`'. The entries are judged against the budgets, and the one ``auto`` would
choose is marked (:mod:`.choosing`).

The cost model behind ``auto`` — documented in docs/planner.md — is bytes moved per call over the bandwidth of
the storage (measured once per process on CUDA; declared defaults otherwise), plus a latency per synchronous
onload; a prefetching placement hides most of its copies behind compute.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from memmode_core.contracts.deprecation import moved_names
from memmode_core.contracts.devices import resolve_device
from memmode_core.contracts.errors import InvalidOptionError
from memmode_core.contracts.options import reserve_size
from memmode_core.contracts.targets import Target
from memmode_core.discovery.grammar import lookup
from memmode_core.discovery.plugins import current
from memmode_core.discovery.registrations import Registration
from memmode_core.planning.budgets import budget_bytes, device_room
from memmode_core.planning.calls import DEFAULT_STEPS, CallTrace, call_sequence, call_shapes, default_calls
from memmode_core.planning.candidates import priced_candidates
from memmode_core.planning.choosing import judge
from memmode_core.planning.pricing import PlanEntry
from memmode_core.planning.request import Request, refuse_renamed


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
    unplaced: Iterable[str] | None = None,
    height: int | None = None,
    width: int | None = None,
    num_frames: int | None = None,
    batch: int | None = None,
    ranks: int = 1,
    context_parallel: int = 1,
    reserve: Any = None,
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

    ``reserve``: what to keep free on an accelerator for what memmode does not own (bytes, or a share of the
    device: ``"10%"``); without a ``vram_budget``, the budget is then the device's free memory now less it.

    ``ranks``: the ranks of ``torch.distributed`` on one machine that each place the pipeline (one process per
    GPU): ``vram_budget`` is one GPU's, ``ram_budget`` the machine's, and each entry's ``machine_host_bytes``
    and ``machine_disk_bytes`` count what a storage's ranks share once (``mmap``'s and ``disk``'s files) and the
    rest once per rank. ``context_parallel``: how many ranks split the sequence of the transformer (diffusers'
    ``ContextParallelConfig``): its activations are that share of one process's on each.
    """
    refuse_renamed(options)
    ranks = _count("ranks", ranks)
    context_parallel = _count("context_parallel", context_parallel)
    tgt = Target.of(target).without(unplaced or ())
    dev = resolve_device(device)
    vram = budget_bytes("vram_budget", vram_budget)
    if reserve is not None:
        try:
            kept_free = reserve_size(reserve)
        except (TypeError, ValueError) as exc:
            raise InvalidOptionError(f"reserve={reserve!r}: {exc}") from None
        if vram is None:
            vram = device_room(dev, kept_free)
    ram = budget_bytes("ram_budget", ram_budget)
    sequence = call_sequence(tgt, calls if calls is not None else default_calls(tgt, steps))
    call = CallTrace.of(target, sequence, dev, call_shapes(height, width, num_frames, batch), context_parallel)
    entries: list[PlanEntry] = []
    for qreg in _quantizers(quantizer):
        base = Request.template(
            qreg,
            device=dev,
            weight_dtype=weight_dtype,
            components=components,
            exclude=exclude,
            unplaced=unplaced,
            storage=storage,
            given=options,
        )
        entries += priced_candidates(target, base, sequence, call, vram, ranks)
    judge(entries, vram, ram)
    return entries


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidOptionError(f"{name}={value!r} must be a whole number of ranks, 1 or more")
    return value


def _quantizers(quantizer: str | Iterable[str] | None) -> list[Registration | None]:
    if quantizer is None:
        return [None]
    names = [quantizer] if isinstance(quantizer, str) else list(quantizer)
    return [lookup(current(), "quantizer", name, mode=None) for name in names]


#: what this module's ``__all__`` listed before the planner was split by job (memmode_core/contracts/deprecation.py)
__getattr__ = moved_names(__name__)
