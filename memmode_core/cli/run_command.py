"""``memmode run``: one pipeline under one mode, or several side by side (``--compare``), and its table.

The measuring is :mod:`memmode_core.cli.runner`'s; this module turns the command line into its arguments and
its results into the output: a table of time and memory per mode, JSON, or a plot. A refused mode in a
``--compare`` gets a row saying why; when every mode was refused the exit status is 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from memmode_core.cli.pipelines import (
    component_files,
    load_into,
    pipeline_source,
    run_apply_options,
    run_call_shapes,
)
from memmode_core.cli.plugin_options import describe_options, refuse_undeclared
from memmode_core.contracts.errors import InvalidOptionError
from memmode_core.contracts.units import format_bytes


def run_command(args: argparse.Namespace) -> int:
    from memmode_core.cli.runner import run_modes
    from memmode_core.cli.table import render

    if args.nproc > 1:
        return _run_on_ranks(args)
    if args.plot:
        from memmode_core.cli.plotting import require_matplotlib

        require_matplotlib()  # before minutes of work, not after
    load, call, description = pipeline_source(args)
    modes = args.compare or [args.mode]
    refuse_undeclared(args.options)
    # --compare goes on past a refused mode; a single --mode that is refused is an error
    results = run_modes(
        load,
        call,
        modes,
        device=args.device,
        storage=args.storage,
        steps=args.steps,
        progress=not args.no_progress and not args.json,
        trace=bool(args.plot),
        apply_options=run_apply_options(args),
        keep_going=bool(args.compare),
        load_into=load_into(args),
        call_shapes=run_call_shapes(args),
    )
    ran = [r for r in results if r.ran]
    if args.plot and ran:
        from memmode_core.cli.plotting import plot_traces

        plot_traces(ran, args.plot)
    if args.json:
        print(
            json.dumps(
                {
                    "pipeline": description,
                    "steps": args.steps,
                    "options": args.options,
                    "results": [r.as_dict() for r in results],
                },
                indent=2,
                default=repr,
            )
        )
    else:
        device = f", device {ran[0].device}" if ran else ""
        print(f"{description}, {args.steps} step{'s' if args.steps != 1 else ''}{device}")
        if args.options:
            print(f"options: {describe_options(args.options)}")
        refused = any(not r.ran for r in results)
        headers = ["mode", "storage", "s/call", "peak on device", "moved/call", "RAM (offloaded)", "disk"]
        print(
            render(headers + (["note"] if refused else []), [_run_row(r, refused) for r in results], right=headers[2:])
        )
        for line in room_lines(ran):
            print(line)
        if args.plot and ran:
            print(f"plot written to {args.plot}")
    if not ran:
        print("memmode: error: every mode was refused", file=sys.stderr)
        return 2
    return 0


def room_lines(results) -> list[str]:
    """What left the device during each mode's measured call, whose, for whom and why, and the out-of-memory errors
    recovered from (nothing when everything fitted)."""
    lines = []
    for r in results:
        for e in r.evictions:
            groups = f"{e['groups']} groups, " if e["groups"] is not None else ""
            lines.append(
                f"{r.mode}: {groups}{format_bytes(e['bytes'])} of {e['by']} left the device for {e['for']} ({e['why']})"
            )
        for rec in r.recoveries:
            lines.append(
                f"{r.mode}: out of memory onloading {rec['group']} ({rec['error']}); {format_bytes(rec['released'])} "
                f"released and the onload tried again"
            )
    return lines


def _run_row(r, with_note: bool) -> tuple:
    if not r.ran:
        return (r.requested, "-", "-", "-", "-", "-", "-", f"refused: {r.refused}")
    row = (
        (r.mode if r.requested == r.mode else f"{r.requested} -> {r.mode}"),
        r.storage or "-",
        f"{r.seconds_per_call:.2f}",
        format_bytes(r.peak_device_bytes),
        format_bytes(r.bytes_transferred),
        format_bytes(r.offloaded_ram_bytes),
        format_bytes(r.disk_bytes) if r.disk_bytes else "-",
    )
    return row + ("",) if with_note else row


def _run_on_ranks(args: argparse.Namespace) -> int:
    """``--nproc N``: the job on N ranks of this machine (:mod:`memmode_core.cli.ranks`), a table row per mode
    and rank."""
    from memmode_core.cli.ranks import run_on_ranks
    from memmode_core.cli.runner import RunResult
    from memmode_core.cli.table import render

    if args.plot:
        raise InvalidOptionError("--plot draws one process's trace; leave it out with --nproc")
    if component_files(args):
        raise InvalidOptionError(
            "--nproc splits a pipeline built in each rank; a --transformer file is loaded by memmode.load, which "
            "the ranks of a script call themselves (docs/community-checkpoints.md): leave out --nproc"
        )
    refuse_undeclared(args.options)
    _, _, description = pipeline_source(args)
    per_rank = [
        [RunResult(**{**d, "output_shape": tuple(d["output_shape"] or ()) or None}) for d in results]
        for results in run_on_ranks(args)
    ]
    if args.json:
        print(
            json.dumps(
                {
                    "pipeline": description,
                    "steps": args.steps,
                    "ranks": args.nproc,
                    "options": args.options,
                    "results": [[r.as_dict() for r in results] for results in per_rank],
                },
                indent=2,
                default=repr,
            )
        )
    else:
        print(
            f"{description}, {args.steps} step{'s' if args.steps != 1 else ''}, {args.nproc} ranks of this machine "
            f"(each transformer's sequence split over them: context parallelism)"
        )
        refused = any(not r.ran for results in per_rank for r in results)
        headers = ["rank", "mode", "storage", "s/call", "peak on device", "moved/call", "RAM (offloaded)", "disk"]
        rows = [(str(rank), *_run_row(r, refused)) for rank, results in enumerate(per_rank) for r in results]
        print(render(headers + (["note"] if refused else []), rows, right=headers[3:]))
    if not any(r.ran for results in per_rank for r in results):
        print("memmode: error: every mode was refused", file=sys.stderr)
        return 2
    return 0
