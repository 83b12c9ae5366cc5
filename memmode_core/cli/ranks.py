"""``memmode run --nproc N``: the main job on N ranks of ``torch.distributed`` on this machine, as users run one
pipeline over several GPUs.

Each rank is a process of its own (``spawn``): it builds the built-in pipeline, splits its transformers'
sequence over the ranks with diffusers' context parallelism (Ulysses, ``ContextParallelConfig(ulysses_degree=
N)``: each rank attends over every token for its share of the heads), applies the mode and measures a call as
one process does (:func:`~memmode_core.cli.runner.run_modes`); every rank's output is the single-process one.
Without an accelerator (or with ``--device cpu``) the ranks meet over gloo and compute on the CPU — diffusers
builds its device mesh from ``torch.accelerator.device_count()``, which a rank then reports as 1, as one CPU
process is one device; with an accelerator they meet over its backend (NCCL for CUDA), one device each.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import traceback
from pathlib import Path

from memmode_core.contracts.errors import InvalidOptionError, MemmodeError

#: what a rank needs of the command line (an ``argparse.Namespace`` also holds the parser, which is not sent)
RANK_ARGUMENTS = (
    "model",
    "size",
    "dtype",
    "device",
    "steps",
    "seed",
    "prompt",
    "height",
    "width",
    "num_frames",
    "mode",
    "compare",
    "storage",
    "options",
)
#: exit status of a rank whose mode was refused (a ``MemmodeError``), told apart from a crash
REFUSED = 3


def run_on_ranks(args: argparse.Namespace) -> list[list[dict]]:
    """Each rank's results (``RunResult.as_dict()`` per mode), in rank order; a refusal in any rank is raised as
    the ``MemmodeError`` it was, another failure as a ``RuntimeError`` carrying its traceback."""
    if args.model is not None:
        raise InvalidOptionError(
            "--nproc runs the built-in pipeline over N ranks; a folder of yours runs under torchrun from your own "
            "script (docs/distributed.md)"
        )
    given = {name: getattr(args, name) for name in RANK_ARGUMENTS}
    with tempfile.TemporaryDirectory(prefix="memmode-run-") as folder:
        context = multiprocessing.get_context("spawn")
        processes = [
            context.Process(target=_rank_main, args=(rank, args.nproc, folder, given), name=f"rank {rank}")
            for rank in range(args.nproc)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        outcomes = []
        for rank, process in enumerate(processes):
            path = Path(folder) / f"rank{rank}.json"
            outcome = json.loads(path.read_text()) if path.is_file() else {"error": f"exit status {process.exitcode}"}
            outcomes.append(outcome)
    for rank, outcome in enumerate(outcomes):
        if "refused" in outcome:
            raise MemmodeError(f"rank {rank}: {outcome['refused']}")
        if "error" in outcome:
            raise RuntimeError(f"rank {rank} of {args.nproc} failed:\n{outcome['error']}")
    return [outcome["results"] for outcome in outcomes]


def _rank_main(rank: int, nproc: int, folder: str, given: dict) -> None:
    import warnings

    import diffusers
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    # diffusers' context parallelism says at every enable that it is experimental, and warns of its own use of a
    # deprecated torch collective at every call: N ranks of it would bury the table
    diffusers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module="diffusers")
    if accelerator is not None and given["device"] != "cpu":
        torch.accelerator.set_device_index(rank)
        device = torch.device(accelerator.type, rank)
        backend = dist.get_default_backend_for_device(device)  # NCCL for CUDA
    else:
        torch.set_num_threads(1)
        torch.accelerator.device_count = lambda: 1  # one CPU process is one device (see the module docstring)
        device, backend = torch.device("cpu"), "gloo"
    given = {**given, "device": str(device)}
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank, world_size=nproc)
    outcome: dict = {}
    try:
        outcome = {"results": [r.as_dict() for r in _run(nproc, argparse.Namespace(**given))]}
    except MemmodeError as exc:
        outcome = {"refused": str(exc)}
    except BaseException:
        outcome = {"error": traceback.format_exc()}
    finally:
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps(outcome, default=repr))
        dist.destroy_process_group()


def _run(nproc: int, args: argparse.Namespace):
    from memmode_core.cli.pipelines import pipeline_source, run_call_shapes
    from memmode_core.cli.runner import run_modes

    load, call, _ = pipeline_source(args)

    def load_split():
        return split_sequence(load(), nproc)

    return run_modes(
        load_split,
        call,
        args.compare or [args.mode],
        device=args.device,
        storage=args.storage,
        steps=args.steps,
        progress=False,
        apply_options=args.options,
        keep_going=bool(args.compare),
        call_shapes=run_call_shapes(args),
    )


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
