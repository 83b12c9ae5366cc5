"""``memmode run --nproc N``: the main job on N ranks of ``torch.distributed`` on this machine, as users run one
pipeline over several GPUs.

Each rank is a process of its own: it builds the built-in pipeline, splits its transformers'
sequence over the ranks with diffusers' context parallelism (Ulysses, ``ContextParallelConfig(ulysses_degree=
N)``: each rank attends over every token for its share of the heads), applies the mode and measures a call as
one process does (:func:`~memmode_core.cli.runner.run_modes`); every rank's output is the single-process one.
Without an accelerator (or with ``--device cpu``) the ranks meet over gloo and compute on the CPU — diffusers
builds its device mesh from ``torch.accelerator.device_count()``, which a rank then reports as 1, as one CPU
process is one device; with an accelerator they meet over its backend (NCCL for CUDA), one device each.

How a rank's process starts: CPU ranks are forked from a fork server that has imported what every rank imports
(torch, diffusers and the libraries diffusers pulls in, memmode), once per parent process — a rank starts in a
fraction of a second instead of the six to eight of importing them, and nothing is forked from a parent that has
run threads (the server never computes). Accelerator ranks are spawned fresh: a fork after anything touched the
accelerator's driver (a library's import may) cannot use it.
"""

from __future__ import annotations

import argparse
import atexit
import multiprocessing
import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from memmode_core.contracts.errors import InvalidOptionError, MemmodeError

#: the key of a rank's outcome when its function was refused (a ``MemmodeError``), told apart from a failure
REFUSED = "refused"


def on_ranks(
    nproc: int, function: Callable, *args: Any, accelerator: bool = True, timeout: float | None = None
) -> list[dict[str, Any]]:
    """``function(rank, nproc, *args)`` on ``nproc`` ranks of this machine (see the module docstring; on the CPU
    without ``accelerator``); each rank's outcome, in rank order: ``{"value": what it returned}``,
    ``{"refused": message}`` for a ``MemmodeError``, or ``{"error": traceback}`` — also for a rank that crashed,
    or that ran past ``timeout`` seconds (it is killed). ``function`` must be importable by name (``spawn``).
    The suite's lane of ranks (``tests/ranks.py``) and ``memmode run --nproc`` both start their ranks here."""
    with tempfile.TemporaryDirectory(prefix="memmode-ranks-") as folder:
        context = _start_method(accelerator and torch.accelerator.is_available())
        processes = [
            context.Process(
                target=_rank_main,
                args=(rank, nproc, folder, accelerator, function, args, dict(os.environ)),
                name=f"rank {rank}",
            )
            for rank in range(nproc)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=timeout)
        outcomes = []
        for rank, process in enumerate(processes):
            if process.is_alive():
                process.kill()
                process.join()
                outcomes.append({"error": f"rank {rank} did not finish in {timeout:.0f} s"})
                continue
            path = Path(folder) / f"rank{rank}.pt"
            if process.exitcode != 0 or not path.is_file():
                outcomes.append({"error": f"rank {rank} crashed (exit status {process.exitcode})"})
                continue
            outcomes.append(torch.load(path, weights_only=False))
    return outcomes


#: what a CPU rank imports, imported once by the fork server its processes are forked from
PRELOADED = ["torch.distributed", "diffusers", "memmode_core", __name__]


def _start_method(on_accelerator: bool) -> multiprocessing.context.BaseContext:
    """``spawn`` for ranks on an accelerator; for CPU ranks, a fork server preloaded with :data:`PRELOADED` (see the
    module docstring)."""
    if on_accelerator:
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)  # read when the server starts: the first CPU ranks of this process
    return context


def rank_device(rank: int) -> torch.device:
    """The device a rank of :func:`on_ranks` computes on: its own accelerator, or the CPU (gloo)."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or dist.get_backend() == "gloo":
        return torch.device("cpu")
    return torch.device(accelerator.type, rank)


def _rank_main(
    rank: int, nproc: int, folder: str, accelerator: bool, function: Callable, args: tuple, environment: dict
) -> None:
    import warnings

    import diffusers

    # the caller's environment now, as a spawned process would start with (a fork server's is its own, from when
    # it started)
    os.environ.clear()
    os.environ.update(environment)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # diffusers' context parallelism says at every enable that it is experimental, and warns of its own use of a
    # deprecated torch collective at every call: N ranks of it would bury the output
    diffusers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module="diffusers")
    if accelerator and torch.accelerator.is_available():
        torch.accelerator.set_device_index(rank)
        backend = dist.get_default_backend_for_device(torch.accelerator.current_accelerator())  # NCCL for CUDA
    else:
        torch.set_num_threads(1)
        torch.accelerator.device_count = lambda: 1  # one CPU process is one device (see the module docstring)
        backend = "gloo"
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank, world_size=nproc)
    outcome: dict[str, Any] = {}
    try:
        outcome = {"value": function(rank, nproc, *args)}
    except MemmodeError as exc:
        outcome = {REFUSED: str(exc)}
    except BaseException:
        outcome = {"error": traceback.format_exc()}
    finally:
        torch.save(outcome, Path(folder) / f"rank{rank}.pt")
        dist.destroy_process_group()
        # what the interpreter's exit runs (weakref finalizers: a session's files, the last rank's shared folder):
        # a process forked by multiprocessing ends in os._exit, which skips it; a spawned one finds nothing left
        atexit._run_exitfuncs()


def run_on_ranks(args: argparse.Namespace) -> list[list[dict]]:
    """``memmode run --nproc N``: each rank's results (``RunResult.as_dict()`` per mode), in rank order; a
    refusal in any rank is raised as the ``MemmodeError`` it was, another failure as a ``RuntimeError``
    carrying its traceback."""
    if args.model is not None:
        raise InvalidOptionError(
            "--nproc runs the built-in pipeline over N ranks; a folder of yours runs under torchrun from your own "
            "script (docs/distributed.md)"
        )
    # what a rank needs of the command line: the parser and the command's function stay here
    given = {name: value for name, value in vars(args).items() if name not in ("func", "subparser")}
    on_cpu = args.device == "cpu"
    outcomes = on_ranks(args.nproc, _run, given, accelerator=not on_cpu)
    for rank, outcome in enumerate(outcomes):
        if REFUSED in outcome:
            raise MemmodeError(f"rank {rank}: {outcome[REFUSED]}")
        if "error" in outcome:
            raise RuntimeError(f"rank {rank} of {args.nproc} failed:\n{outcome['error']}")
    return [outcome["value"] for outcome in outcomes]


def _run(rank: int, nproc: int, given: dict) -> list[dict]:
    from memmode_core.cli.pipelines import pipeline_source, run_apply_options, run_call_shapes
    from memmode_core.cli.runner import run_modes

    args = argparse.Namespace(**{**given, "device": str(rank_device(rank))})
    load, call, _ = pipeline_source(args)

    def load_split():
        return split_sequence(load(), nproc)

    results = run_modes(
        load_split,
        call,
        args.compare or [args.mode],
        device=args.device,
        storage=args.storage,
        steps=args.steps,
        progress=False,
        apply_options=run_apply_options(args),
        keep_going=bool(args.compare),
        call_shapes=run_call_shapes(args),
    )
    return [r.as_dict() for r in results]


def split_sequence(pipe, nproc: int):
    """``pipe`` with each transformer diffusers can split (one with a ``_cp_plan``) split over ``nproc`` ranks."""
    from diffusers import ContextParallelConfig

    for name, component in pipe.components.items():
        if getattr(component, "_cp_plan", None) is None:
            continue
        heads = getattr(component.config, "num_attention_heads", None)
        if heads is not None and heads % nproc:
            raise InvalidOptionError(
                f"--nproc {nproc}: the {name}'s {heads} attention heads cannot be shared evenly by {nproc} ranks "
                f"(Ulysses gives each rank a share of the heads); use a number of ranks that divides {heads}"
            )
        component.enable_parallelism(config=ContextParallelConfig(ulysses_degree=nproc))
    return pipe
