"""``prepare(target, mode, **kw) -> Prepared``: the plan ``apply`` executes, for inspection or reuse.

A concrete mode is prepared in one pass (:mod:`memmode_core.planning.prepared`). A mode whose
placement slot names a resolver (``auto``, ``auto_and_qfloat8``) is resolved here: the resolver says
what to price for (:meth:`Resolver.budgets`), the planner prepares and prices every candidate
(:func:`~memmode_core.planning.planner.candidates`), and the resolver picks one
(:meth:`Resolver.choose`). The candidate it picked is returned as it was prepared and priced — with
``requested_mode`` naming the resolver and ``choice`` the entry — so executing it does not lay out,
claim or plan anything again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import torch

from memmode_core.contracts.options import declared_options
from memmode_core.contracts.targets import Target
from memmode_core.planning.planner import (
    CallTrace,
    call_sequence,
    candidates,
    default_calls,
    judge,
    price_all,
)
from memmode_core.planning.prepared import Prepared, Request, make_request, prepare_target

logger = logging.getLogger("memmode")


def prepare(
    target: Any,
    mode: str,
    *,
    device: Any = None,
    weight_dtype: torch.dtype | None = None,
    storage: str | None = None,
    offload_dir: Any = None,
    components: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    exclude_components: Iterable[str] | None = None,
    strict: bool = False,
    **options: Any,
) -> Prepared:
    """Resolve, check, lay out, claim, plan and size ``mode`` for ``target`` (a diffusers pipeline or an
    ``nn.Module``) without touching it; arguments are those of :func:`memmode_core.apply`, which executes
    the result: ``memmode.apply(memmode.prepare(pipe, mode))`` is ``memmode.apply(pipe, mode)``."""
    Target.of(target)  # what cannot be a target is refused first
    request = make_request(
        mode,
        device=device,
        weight_dtype=weight_dtype,
        storage=storage,
        offload_dir=offload_dir,
        components=components,
        exclude=exclude,
        exclude_components=exclude_components,
        strict=strict,
        options=options,
    )
    return prepare_request(target, request)


def prepare_request(target: Any, request: Request) -> Prepared:
    """:func:`prepare` for a request made already (``load`` makes it before the model exists)."""
    if request.resolver is None:
        return prepare_target(target, request)
    return resolve_choice(target, request)


def resolve_choice(target: Any, request: Request) -> Prepared:
    """The candidate a resolver chooses, prepared (see the module docstring)."""
    resolver = request.resolver
    budgets = resolver.budgets(request.placement_options, request.device)
    own = {o.name for o in declared_options(resolver.options)}
    given = {k: v for k, v in request.given.items() if k not in own}
    placed = Target.of(target).without(request.exclude_components)
    sequence = call_sequence(placed, default_calls(placed, budgets.steps))
    call = CallTrace.of(target, sequence, request.device, budgets.shapes)
    if budgets.vram is not None:  # a placement that can fit itself to the budget (group offload) does, to
        given["vram_budget"] = call.weights_budget(budgets.vram)
    base = dataclasses.replace(request, given=given, traces=call.traces)
    entries = price_all(candidates(target, base), sequence, call.traces)
    call.mark(entries)
    judge(entries, budgets.vram, budgets.ram)
    entry = resolver.choose(entries, budgets)
    chosen = entry.prepared
    chosen.requested_mode = str(request.mode)
    chosen.choice = entry
    logger.info(
        "memmode: %s chose %s with storage %s (peak %d bytes on the device)",
        request.mode,
        entry.label(),
        entry.storage,
        entry.peak_device_bytes,
    )
    return chosen
