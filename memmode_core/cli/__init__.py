"""The ``memmode`` command: ``list``, ``run`` and ``plan``."""

from __future__ import annotations

import argparse
import json
import sys

from .. import __version__
from ..errors import MemmodeError
from ..units import format_bytes


# -- list ------------------------------------------------------------------------------------------


def _cmd_list(args: argparse.Namespace) -> int:
    from ..plugins import list_plugins
    from .table import render

    rows = list_plugins()
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return 0
    print(render(
        ["kind", "name", "distribution", "version", "available", "description"],
        [(r.kind, r.name, r.distribution, r.version or "-", "yes" if r.available else f"no ({index})",
          r.description) for index, r in _numbered_unavailable(rows)],
    ))
    notes = [r for r in rows if not r.available]
    if notes:
        print()
        for index, r in enumerate(notes, start=1):
            print(f"({index}) {r.kind} {r.name}: {r.reason}")
    return 0


def _numbered_unavailable(rows):
    """Each row with the number of its note (unavailable rows are numbered in order)."""
    index = 0
    for row in rows:
        if not row.available:
            index += 1
        yield index, row


# -- the pipeline run and plan work on -----------------------------------------------------------------


def _dtype(name: str | None):
    import torch

    if name is None:
        return None
    try:
        dtype = getattr(torch, name)
    except AttributeError:
        dtype = None
    if not isinstance(dtype, torch.dtype):
        raise MemmodeError(f"--dtype {name!r} is not a torch dtype (e.g. bfloat16, float16, float32)")
    return dtype


def _pipeline_source(args: argparse.Namespace):
    """``(load, call, description)`` for the built-in demo or a local diffusers folder."""
    import torch

    if args.model is None:
        from .demo import SIZES, build_demo_pipeline, demo_call

        dtype = _dtype(args.dtype) or torch.float32

        def load():
            return build_demo_pipeline(args.size, seed=args.seed, dtype=dtype)

        def call(pipe, callback=None):
            return demo_call(pipe, size=args.size, steps=args.steps, seed=args.seed, callback=callback)

        dims = SIZES[args.size]
        return load, call, f"built-in Wan 2.2-shaped pipeline ({args.size}, random weights, {dims.frames} frames " \
                           f"{dims.height}x{dims.width})"

    from diffusers import DiffusionPipeline

    dtype = _dtype(args.dtype)

    def load():
        kwargs = {"torch_dtype": dtype} if dtype is not None else {}
        pipe = DiffusionPipeline.from_pretrained(args.model, local_files_only=True, **kwargs)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def call(pipe, callback=None):
        kwargs = dict(prompt=args.prompt, num_inference_steps=args.steps, output_type="pt", return_dict=False,
                      generator=torch.Generator(device="cpu").manual_seed(args.seed))
        for name in ("height", "width", "num_frames"):
            if getattr(args, name) is not None:
                kwargs[name] = getattr(args, name)
        if callback is not None:
            kwargs["callback_on_step_end"] = callback
        output = pipe(**kwargs)[0]
        return output if isinstance(output, torch.Tensor) else torch.as_tensor(output)

    return load, call, f"{args.model}"


# -- run -------------------------------------------------------------------------------------------


def _cmd_run(args: argparse.Namespace) -> int:
    from .runner import run_modes
    from .table import render

    if args.plot:
        from .plotting import require_matplotlib

        require_matplotlib()  # before minutes of work, not after
    load, call, description = _pipeline_source(args)
    modes = args.compare or [args.mode]
    results = run_modes(load, call, modes, device=args.device, storage=args.storage, steps=args.steps,
                        progress=not args.no_progress and not args.json, trace=bool(args.plot))
    if args.plot:
        from .plotting import plot_traces

        plot_traces(results, args.plot)
    if args.json:
        print(json.dumps({"pipeline": description, "steps": args.steps,
                          "results": [r.as_dict() for r in results]}, indent=2))
        return 0
    print(f"{description}, {args.steps} steps, device {results[0].device}")
    print(render(
        ["mode", "storage", "s/call", "peak on device", "moved/call", "RAM (offloaded)", "disk"],
        [((r.mode if r.requested == r.mode else f"{r.requested} -> {r.mode}"), r.storage or "-",
          f"{r.seconds_per_call:.2f}", format_bytes(r.peak_device_bytes), format_bytes(r.bytes_transferred),
          format_bytes(r.offloaded_ram_bytes), format_bytes(r.disk_bytes) if r.disk_bytes else "-")
         for r in results],
        right=["s/call", "peak on device", "moved/call", "RAM (offloaded)", "disk"],
    ))
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0


# -- plan ------------------------------------------------------------------------------------------


def _cmd_plan(args: argparse.Namespace) -> int:
    from ..planner import plan
    from .table import render

    load, _, description = _pipeline_source(args)
    pipe = load()
    entries = plan(pipe, device=args.device, vram_budget=args.vram, ram_budget=args.ram,
                   quantizer=args.quantizer or None, steps=args.steps)
    if args.json:
        print(json.dumps({"pipeline": description, "steps": args.steps, "vram_budget": args.vram,
                          "ram_budget": args.ram, "entries": [e.as_dict() for e in entries]}, indent=2))
        return 0
    print(f"{description}: predicted per call of {args.steps} steps")
    rows = []
    for e in sorted(entries, key=lambda e: (not e.fits, e.seconds_per_call, e.peak_device_bytes)):
        options = ", ".join(f"{k}={v}" for k, v in e.options.items())
        rows.append(("*" if e.chosen else "", e.mode, options or "-", e.storage or "-",
                     format_bytes(e.peak_device_bytes), format_bytes(e.transfer_bytes_per_call),
                     format_bytes(e.host_bytes), format_bytes(e.disk_bytes) if e.disk_bytes else "-",
                     f"{e.seconds_per_call:.3f}", "yes" if e.fits else f"no: {e.reason}"))
    print(render(["", "mode", "options", "storage", "peak on device", "moved/call", "RAM", "disk",
                  "copy s/call", "fits"], rows,
                 right=["peak on device", "moved/call", "RAM", "disk", "copy s/call"]))
    chosen = next((e for e in entries if e.chosen), None)
    if chosen is not None:
        print(f"* auto would choose {chosen.label()} with storage {chosen.storage}")
    else:
        print("nothing fits these budgets: auto would refuse")
    return 0


# -- the parser ------------------------------------------------------------------------------------


def _add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    from .demo import SIZES

    parser.add_argument("--model", metavar="DIR", help="a local diffusers pipeline folder (default: the built-in "
                        "Wan 2.2-shaped pipeline with random weights)")
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="size of the built-in pipeline")
    parser.add_argument("--dtype", help="load the weights in this dtype (bfloat16, float16, float32)")
    parser.add_argument("--device", help="compute device (default: cuda when available, else cpu)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt", default="a red fox running through fresh snow at dawn", help="with --model")
    parser.add_argument("--height", type=int, help="with --model")
    parser.add_argument("--width", type=int, help="with --model")
    parser.add_argument("--num-frames", dest="num_frames", type=int, help="with --model (video pipelines)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memmode", description="GPU memory modes for diffusers pipelines.")
    parser.add_argument("--version", action="version", version=f"memmode {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    listing = commands.add_parser("list", help="what is installed: placements, quantizers, storages")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(func=_cmd_list)

    run = commands.add_parser("run", help="run a pipeline under a mode and report time and memory")
    _add_pipeline_arguments(run)
    run.add_argument("--mode", default="model_group_offload", help="the mode (default: model_group_offload)")
    run.add_argument("--compare", nargs="+", metavar="MODE", help="run several modes side by side")
    run.add_argument("--storage", help="where offloaded weights wait (default: pinned on CUDA if installed, else ram)")
    run.add_argument("--plot", metavar="FILE.png", help="draw resident device bytes over time for each mode")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(func=_cmd_run)

    planning = commands.add_parser("plan", help="what each mode would cost, and which one auto would pick")
    _add_pipeline_arguments(planning)
    planning.add_argument("--vram", help="device budget for weights, e.g. 8GiB")
    planning.add_argument("--ram", help="RAM budget for offloaded weights, e.g. 32GiB")
    planning.add_argument("--quantizer", nargs="+", metavar="NAME", help="also plan these quantizers")
    planning.set_defaults(func=_cmd_plan, steps=20)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MemmodeError as exc:
        print(f"memmode: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
