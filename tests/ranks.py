"""N ranks of ``torch.distributed`` on one machine, for the suite: gloo on the CPU, each rank a process of its own,
started by the launcher ``memmode run --nproc`` uses (:func:`memmode_core.cli.ranks.on_ranks`).

:func:`run_ranks` runs ``scenario(rank, world, *args)`` — a function importable by name, as ``spawn`` hands it
over — on ``world`` ranks and returns what each returned; a rank that raised, crashed or hung fails the test,
with every failed rank's traceback or exit status.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from memmode_core.cli.ranks import on_ranks

#: seconds a lane of ranks may take before it is a failure (4 ranks on 2 shared cores run their matrix in about
#: a minute)
RANKS_TIMEOUT = 420


def distributed_available() -> bool:
    return dist.is_available() and dist.is_gloo_available()


def run_ranks(
    world: int, scenario: Callable, *args: Any, timeout: float = RANKS_TIMEOUT, accelerator: bool = False
) -> list[Any]:
    """``scenario(rank, world, *args)`` on ``world`` CPU ranks (one GPU each with ``accelerator``); what each
    returned, in rank order."""
    outcomes = on_ranks(world, scenario, *args, accelerator=accelerator, timeout=timeout)
    failed = {rank: o.get("error") or o.get("refused") for rank, o in enumerate(outcomes) if "value" not in o}
    if failed:
        pytest.fail("\n".join(f"rank {rank} of {world}:\n{why}" for rank, why in failed.items()))
    return [outcome["value"] for outcome in outcomes]
