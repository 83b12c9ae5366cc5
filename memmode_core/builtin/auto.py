"""``auto``: the resolver that picks the fastest placement x storage whose predicted memory fits.

It lays nothing out: ``prepare`` has the planner prepare and price every candidate for the target
(with the mode's quantizer, ``auto_and_<quantizer>``), and :meth:`Auto.choose` takes the entry the
planner marks as the fastest that fits the budgets. Alone it never changes numerics: every placement
is lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from memmode_core.contracts.options import Options, byte_size, option, positive_int
from memmode_core.contracts.resolver import Budgets, Resolver
from memmode_core.planning.planner import (
    DEFAULT_STEPS,
    DEFAULT_VRAM_SHARE,
    SHAPED_VRAM_SHARE,
    PlanEntry,
    call_shapes,
    choose,
    default_ram_budget,
    default_vram_budget,
)


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

    def shapes(self) -> dict[str, int]:
        """The call's shapes that were given."""
        return call_shapes(self.height, self.width, self.num_frames, self.batch)


class Auto(Resolver):
    name = "auto"
    description = "the fastest placement x storage whose predicted memory fits vram_budget / ram_budget"
    options = AutoOptions

    def budgets(self, options: AutoOptions, device: torch.device) -> Budgets:
        shapes = options.shapes()
        vram = options.vram_budget
        if vram is None:
            vram = default_vram_budget(device, SHAPED_VRAM_SHARE if shapes else DEFAULT_VRAM_SHARE)
        ram = options.ram_budget if options.ram_budget is not None else default_ram_budget()
        return Budgets(vram, ram, options.steps, shapes)

    def choose(self, entries: Sequence[PlanEntry], budgets: Budgets) -> PlanEntry:
        return choose(list(entries), budgets.vram, budgets.ram)
