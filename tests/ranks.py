"""N ranks of ``torch.distributed`` on one machine, for the suite: each a process of its own (``spawn``), gloo on
the CPU, meeting through a file in a temporary folder.

:func:`run_ranks` starts ``world`` ranks that each run ``scenario(rank, world, *args)`` — a function importable by
name, as ``spawn`` hands it over — and returns what each returned (saved with ``torch.save``). A rank that
raised returns its traceback under ``"error"``; one that crashed or hung is a test failure naming it.

diffusers builds its device mesh for context parallelism from ``torch.accelerator.device_count()``, which is 0
on a machine without an accelerator: each rank there reports one device, as one CPU process is one device.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

#: seconds a lane of ranks may take before it is a failure (4 ranks on 2 shared cores run their matrix in about
#: a minute)
RANKS_TIMEOUT = 420


def distributed_available() -> bool:
    return dist.is_available() and dist.is_gloo_available()


def _rank_main(rank: int, world: int, folder: str, scenario: Callable, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if not torch.accelerator.is_available():
        torch.accelerator.device_count = lambda: 1  # one CPU process is one device (see the module docstring)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    try:
        results = scenario(rank, world, *args)
    except BaseException:
        results = {"error": traceback.format_exc()}
    finally:
        torch.save(results, f"{folder}/rank{rank}.pt")
        dist.destroy_process_group()


def run_ranks(world: int, scenario: Callable, *args: Any, timeout: float = RANKS_TIMEOUT) -> list[dict[str, Any]]:
    """``scenario(rank, world, *args)`` on ``world`` CPU ranks; each rank's returned dict, in rank order."""
    with tempfile.TemporaryDirectory(prefix="memmode-ranks-") as folder:
        context = multiprocessing.get_context("spawn")
        processes = [
            context.Process(target=_rank_main, args=(rank, world, folder, scenario, args), name=f"rank{rank}")
            for rank in range(world)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=timeout)
        hung = [p.name for p in processes if p.is_alive()]
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        if hung:
            pytest.fail(f"{', '.join(hung)} of {world} did not finish in {timeout:.0f} s")
        crashed = {p.name: p.exitcode for p in processes if p.exitcode != 0}
        assert not crashed, f"ranks that crashed (exit codes): {crashed}"
        results = [torch.load(Path(folder) / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
    failed = {rank: r["error"] for rank, r in enumerate(results) if "error" in r}
    assert not failed, "\n".join(f"rank {rank} of {world}:\n{error}" for rank, error in failed.items())
    return results
