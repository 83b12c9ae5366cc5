"""``memmode plan``: what each mode would cost for a pipeline, and which one ``auto`` would pick — without
running it.

The figures are ``memmode_core.plan``'s predictions, per call of ``--steps`` steps, against the ``--vram``
and ``--ram`` budgets. Given the call's shapes (``--height``, ``--width``, ``--num-frames``) the activations
count too, predicted on fake tensors; the kernel workspace a library picks at run time is named, not counted.
"""

from __future__ import annotations

import argparse
import json

import memmode_core as memmode
from memmode_core.cli.pipelines import given_shapes, pipeline_to_plan
from memmode_core.cli.plan_table import render_plan
from memmode_core.cli.plugin_options import describe_options, refuse_undeclared
from memmode_core.contracts.units import format_bytes


def plan_command(args: argparse.Namespace) -> int:
    refuse_undeclared(args.options)
    with pipeline_to_plan(args) as (pipe, description):
        shapes = given_shapes(args)
        # placement options go to every candidate whose placement declares them
        entries = memmode.plan(
            pipe,
            device=args.device,
            vram_budget=args.vram,
            ram_budget=args.ram,
            quantizer=args.quantizer or None,
            steps=args.steps,
            ranks=args.world_size,
            context_parallel=args.context_parallel,
            reserve=args.reserve,
            # the call's shapes: activations predicted on fake tensors, counted against --vram with the weights
            # (a --model skeleton's too: its weights stand in as fake tensors, the pipeline's code runs on the host)
            **shapes,
            **args.options,
        )
    if args.json:
        print(
            json.dumps(
                {
                    "pipeline": description,
                    "steps": args.steps,
                    "vram_budget": args.vram,
                    "ram_budget": args.ram,
                    "options": args.options,
                    "entries": [e.as_dict() for e in entries],
                },
                indent=2,
                default=repr,
            )
        )
        return 0
    print(f"{description}: predicted per call of {args.steps} steps")
    if args.world_size > 1:
        print(
            f"for {args.world_size} ranks of this machine: on the device, one rank's; RAM and disk, the machine's "
            f"(what the ranks share once)"
        )
    if args.options:
        print(f"options: {describe_options(args.options)} (for each mode whose plugins declare them)")
    shaped = any(e.activation_bytes for e in entries)
    if shaped:
        print(f"activations at these shapes: {format_bytes(max(e.activation_bytes for e in entries))} at peak")
        unmodelled = entries[0].unmodelled_workspace
        if unmodelled:
            print(
                f"  not counted: the kernel workspace of {', '.join(unmodelled)} on {args.device or 'this device'}"
                " (chosen by its library at run time) - leave a margin for it"
            )
    print(render_plan(entries, shaped))
    chosen = next((e for e in entries if e.chosen), None)
    if chosen is not None:
        print(f"* auto would choose {chosen.label()} with storage {chosen.storage}")
    else:
        print("nothing fits these budgets: auto would refuse")
    return 0
