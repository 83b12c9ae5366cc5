"""Every mode that could place a target, prepared and priced: what ``plan`` lists and a resolver chooses from.

For every installed placement x storage (with the request's quantizer), the target is prepared exactly as
``apply`` would prepare it (:func:`~memmode_core.planning.prepared.prepare_target`) and priced for one call
(:mod:`.pricing`). Each expensive step is done once and handed on: the quantizer's layer selection once for
all candidates, each placement's layout once per variant (priced with every storage), the call traced once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memmode_core.contracts.errors import IncompatibleModeError, InvalidOptionError
from memmode_core.contracts.resolver import Resolver
from memmode_core.contracts.targets import Target
from memmode_core.discovery.plugins import current
from memmode_core.discovery.registrations import Registration
from memmode_core.planning.calls import CallTrace
from memmode_core.planning.prepared import Prepared, prepare_target, quantize_targets, select_components, with_storage
from memmode_core.planning.pricing import PlanEntry, price_all
from memmode_core.planning.request import Request
from memmode_core.planning.residency import BudgetTooSmallError


def priced_candidates(
    target: Any, base: Request, sequence: list[str], call: CallTrace, vram: int | None, ranks: int = 1
) -> list[PlanEntry]:
    """Every candidate for ``target`` made from ``base``, priced for the component calls ``sequence`` traced as
    ``call``, on each of ``ranks`` ranks of one machine. With a device budget ``vram``, a placement that can fit
    itself to it (group offload keeps groups resident up to what the activations leave) does."""
    given = dict(base.given)
    if vram is not None:
        given["vram_budget"] = call.weights_budget(vram)
    base = dataclasses.replace(base, given=given, traces=call.traces)
    entries = price_all(candidates(target, base), sequence, call.traces, ranks)
    call.mark(entries)
    return entries


def candidates(target: Any, base: Request) -> list[Prepared]:
    """Every installed placement x storage prepared for ``target`` with ``base``'s quantizer and arguments:
    each placement's layout once per variant it declares (``Placement.plan_variants``), priced with every
    usable storage (``base.storage_given`` only, when one was named). A placement that refuses the target
    is left out; the quantizer's refusal is an error (no candidate could quantize)."""
    plugins = current()
    whole = Target.of(target)
    shared = None
    if base.quantizer is not None:
        placed = whole.without(base.unplaced)
        shared = select_components(base.quantizer.obj, quantize_targets(whole, placed, base), base)
    found: list[Prepared] = []
    for preg in plugins.registrations["placement"].values():
        if isinstance(preg.obj, Resolver) or preg.unavailable_reason():
            continue
        storages = _storages(plugins, preg, base)
        if not storages:
            continue
        for variant in getattr(preg.obj, "plan_variants", None) or ({},):
            try:
                first = base.candidate(preg, storages[0], variant)
                try:
                    prepared = prepare_target(target, first, selections=shared, variant=variant)
                except BudgetTooSmallError:  # priced as it streams everything, and judged not to fit
                    options = dataclasses.replace(first.placement_options, vram_budget=None)
                    first = dataclasses.replace(first, placement_options=options)
                    prepared = prepare_target(target, first, selections=shared, variant=variant)
            except (IncompatibleModeError, InvalidOptionError):
                continue
            found.append(prepared)
            for sreg in storages[1:]:
                found.append(with_storage(prepared, sreg, base.candidate(preg, sreg, variant).storage_options))
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
