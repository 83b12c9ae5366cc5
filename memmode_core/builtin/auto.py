"""``auto``: the resolver that picks the fastest placement x storage whose predicted memory fits.

It lays nothing out. :meth:`PricingResolver.resolve` — the resolution behind the ``Resolver`` contract — has
the planner prepare and price every candidate for the target (with the mode's quantizer,
``auto_and_<quantizer>``) for the call the resolver's budgets describe, and executes the entry
:meth:`Auto.choose` takes: the one the planner marks as the fastest that fits the budgets. The candidate is
returned as it was prepared and priced, so executing it lays out, claims and selects nothing again. Alone it
never changes numerics: every placement is lossless.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memmode_core.contracts.options import Options, byte_size, declared_options, option, positive_int
from memmode_core.contracts.resolver import Budgets, Resolver
from memmode_core.contracts.targets import Target
from memmode_core.planning.budgets import (
    DEFAULT_VRAM_SHARE,
    SHAPED_VRAM_SHARE,
    default_ram_budget,
    default_vram_budget,
    reserved,
)
from memmode_core.planning.calls import DEFAULT_STEPS, CallTrace, call_sequence, call_shapes, default_calls
from memmode_core.planning.candidates import priced_candidates
from memmode_core.planning.choosing import choose, judge
from memmode_core.planning.prepared import Prepared
from memmode_core.planning.pricing import PlanEntry
from memmode_core.planning.request import Request

logger = logging.getLogger("memmode")


class PricingResolver(Resolver):
    """A resolver that chooses among the planner's priced candidates: subclasses write :meth:`budgets` (what
    to price for) and :meth:`choose` (which entry to take)."""

    def resolve(self, target: Any, request: Request) -> Prepared:
        budgets = self.budgets(request.placement_options, request.device)
        if request.reserve is not None and budgets.vram is not None and "vram_budget" not in request.given:
            # the budget derived from the free memory leaves the reserve alone (one given is the user's own)
            vram = max(budgets.vram - reserved(request.device, request.reserve), 0)
            budgets = dataclasses.replace(budgets, vram=vram)
        own = {o.name for o in declared_options(self.options)}
        base = dataclasses.replace(request, given={k: v for k, v in request.given.items() if k not in own})
        placed = Target.of(target).without(request.unplaced)
        sequence = call_sequence(placed, default_calls(placed, budgets.steps))
        call = CallTrace.of(target, sequence, request.device, budgets.shapes, budgets.context_parallel)
        entries = priced_candidates(target, base, sequence, call, budgets.vram, budgets.ranks)
        judge(entries, budgets.vram, budgets.ram)
        entry = self.choose(entries, budgets)
        # the candidate's plan as the one chosen: a new sealed plan, sharing the candidate's internal one
        chosen = dataclasses.replace(entry.prepared, requested_mode=str(request.mode), choice=entry)
        logger.info(
            "memmode: %s chose %s with storage %s (peak %d bytes on the device)",
            request.mode,
            entry.label(),
            entry.storage,
            entry.peak_device_bytes,
        )
        return chosen


@dataclass(frozen=True)
class AutoOptions(Options):
    vram_budget: int | None = option(
        None,
        "most bytes on the device (bytes or '8GiB'): weights, plus the call's activations when its shapes are given "
        "(default: 80% of the free device memory on CUDA for weights alone, 95% with the shapes; no limit on a CPU "
        "device)",
        byte_size,
    )
    ram_budget: int | None = option(
        None, "most bytes of offloaded weights in RAM (default: 90% of MemAvailable)", byte_size
    )
    steps: int = option(DEFAULT_STEPS, "denoising steps the choice is optimised for", positive_int)
    height: int | None = option(None, "the call's height: its activations are predicted and count", positive_int)
    width: int | None = option(None, "the call's width (as height)", positive_int)
    num_frames: int | None = option(None, "the call's frames, for a video pipeline (as height)", positive_int)
    batch: int | None = option(None, "prompts per call (as height)", positive_int)
    ranks: int = option(
        1,
        "ranks of this machine that each place the pipeline (torchrun's --nproc-per-node): vram_budget is one "
        "GPU's, ram_budget the machine's, and what the ranks share (mmap's and disk's files) counts once",
        positive_int,
    )
    context_parallel: int = option(
        1, "ranks that split the transformer's sequence (diffusers' ContextParallelConfig)", positive_int
    )

    def shapes(self) -> dict[str, int]:
        """The call's shapes that were given."""
        return call_shapes(self.height, self.width, self.num_frames, self.batch)


class Auto(PricingResolver):
    name = "auto"
    description = "the fastest placement x storage whose predicted memory fits vram_budget / ram_budget"
    options = AutoOptions

    def budgets(self, options: AutoOptions, device: torch.device) -> Budgets:
        shapes = options.shapes()
        vram = options.vram_budget
        if vram is None:
            vram = default_vram_budget(device, SHAPED_VRAM_SHARE if shapes else DEFAULT_VRAM_SHARE)
        ram = options.ram_budget if options.ram_budget is not None else default_ram_budget()
        return Budgets(vram, ram, options.steps, shapes, options.ranks, options.context_parallel)

    def choose(self, entries: Sequence[PlanEntry], budgets: Budgets) -> PlanEntry:
        return choose(list(entries), budgets.vram, budgets.ram)
