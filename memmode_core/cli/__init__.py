"""The ``memmode`` command: ``list``, ``run`` and ``plan``.

It uses memmode_core's public API (``import memmode_core as memmode``), except for reading which
options the installed plugins declare (``_declared_option_names``), which has no public form yet.
Exit status: 0 on success; 2 for a usage error or a ``MemmodeError`` (printed as one line, no
traceback), and for ``run --compare`` when every mode was refused; 141 when the reader of stdout went
away early (``memmode list | head -1``), quietly.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import sys

import memmode_core as memmode
from memmode_core.contracts.units import format_bytes
from memmode_core.discovery.first_party import DEFAULT_RUN_MODE
from memmode_core.planning.calls import call_shapes

#: exit status when the reader of stdout went away (128 + SIGPIPE, what a shell reports for ``cmd | head``)
BROKEN_PIPE_STATUS = 141


# -- list ------------------------------------------------------------------------------------------


def _cmd_list(args: argparse.Namespace) -> int:
    from memmode_core.cli.table import render

    rows = memmode.list_plugins()
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return 0
    print(
        render(
            ["kind", "name", "distribution", "version", "available", "description"],
            [
                (
                    r.kind,
                    r.name,
                    r.distribution,
                    r.version or "-",
                    "yes" if r.available else f"no ({index})",
                    r.description,
                )
                for index, r in _numbered_unavailable(rows)
            ],
        )
    )
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
        raise memmode.MemmodeError(f"--dtype {name!r} is not a torch dtype (e.g. bfloat16, float16, float32)")
    return dtype


def _load_into(args: argparse.Namespace):
    """``memmode.load`` for ``--model``: the folder goes straight into each mode, never whole into RAM."""
    if args.model is None:
        return None
    dtype = _dtype(args.dtype)

    def load_into(mode, **kwargs):
        handle = memmode.load(args.model, mode, torch_dtype=dtype or "auto", **kwargs)
        handle.target.set_progress_bar_config(disable=True)
        return handle

    return load_into


def _pipeline_source(args: argparse.Namespace):
    """``(load, call, description)`` for the built-in demo or a local diffusers folder."""
    import torch

    if args.model is None:
        from memmode_core.cli.demo import SIZES, demo_call, make_demo_pipeline

        dtype = _dtype(args.dtype) or torch.float32

        def load():
            return make_demo_pipeline(args.size, seed=args.seed, dtype=dtype)

        def call(pipe, callback=None):
            return demo_call(pipe, size=args.size, steps=args.steps, seed=args.seed, callback=callback)

        dims = SIZES[args.size]
        return (
            load,
            call,
            f"built-in Wan 2.2-shaped pipeline ({args.size}, random weights, {dims.frames} frames "
            f"{dims.height}x{dims.width})",
        )

    from diffusers import DiffusionPipeline

    dtype = _dtype(args.dtype)

    def load():
        kwargs = {"torch_dtype": dtype} if dtype is not None else {}
        pipe = DiffusionPipeline.from_pretrained(args.model, local_files_only=True, **kwargs)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def call(pipe, callback=None):
        kwargs = dict(
            prompt=args.prompt,
            num_inference_steps=args.steps,
            output_type="pt",
            return_dict=False,
            generator=torch.Generator(device="cpu").manual_seed(args.seed),
        )
        for name in ("height", "width", "num_frames"):
            if getattr(args, name) is not None:
                kwargs[name] = getattr(args, name)
        if callback is not None:
            kwargs["callback_on_step_end"] = callback
        output = pipe(**kwargs)[0]
        return output if isinstance(output, torch.Tensor) else torch.as_tensor(output)

    return load, call, f"{args.model}"


# -- plugin options (--option NAME=VALUE) ---------------------------------------------------------------


def literal_value(text: str) -> object:
    """``'2'`` -> 2, ``'True'`` -> True, ``'[1, 2]'`` -> [1, 2]; what is not a Python literal stays a string
    (``'leaf_level'``, ``'8GiB'``, ``'/tmp/x'``)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text


def parse_option(text: str) -> tuple[str, object]:
    """``--option NAME=VALUE`` -> ``(NAME, literal_value(VALUE))``."""
    name, equals, value = text.partition("=")
    name = name.strip()
    if not equals or not name or any(c.isspace() for c in name):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (e.g. offload_type=leaf_level), got {text!r}")
    return name, literal_value(value)


#: flags that set what an option of the same name would (``--option device=cuda`` means ``--device cuda``)
_FLAG_FOR = {
    "device": "--device",
    "storage": "--storage",
    "vram_budget": "--vram",
    "ram_budget": "--ram",
    "quantizer": "--quantizer",
    "steps": "--steps",
}


def _options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """``args.option`` as the keywords for ``apply`` (run) or ``plan``; usage errors through ``parser``."""
    parser = getattr(args, "subparser", parser)  # its usage line, not the top-level one
    pairs = getattr(args, "option", None) or []
    options: dict = {}
    for name, value in pairs:
        if name in options:
            parser.error(f"--option {name} given twice")
        options[name] = value
    if not options:
        return options
    function = memmode.plan if args.command == "plan" else memmode.apply
    own = [p.name for p in inspect.signature(function).parameters.values() if p.kind is not p.VAR_KEYWORD]
    for name in options:
        if name in own:
            hint = f"; use {_FLAG_FOR[name]}" if name in _FLAG_FOR else ""
            parser.error(
                f"--option {name}: {name} is an argument of memmode_core.{function.__name__}, not a plugin option{hint}"
            )
    return options


def _refuse_undeclared(options: dict) -> None:
    """An option no installed plugin declares is an ``InvalidOptionError``, before any pipeline is loaded
    (``plan`` itself ignores an option no candidate declares)."""
    if not options:
        return
    declared = _declared_option_names()
    unknown = sorted(set(options) - declared)
    if unknown:
        raise memmode.InvalidOptionError(
            f"unexpected option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: no installed placement, "
            f"storage or quantizer declares {'them' if len(unknown) > 1 else 'it'}; declared options: "
            f"{', '.join(sorted(declared)) or 'none'}"
        )


def _declared_option_names() -> set[str]:
    """The option names of every loaded plugin."""
    from memmode_core.contracts.options import declared_options
    from memmode_core.discovery import plugins

    registrations = plugins.current().registrations
    return {
        option.name
        for by_name in registrations.values()
        for registration in by_name.values()
        for option in declared_options(getattr(registration.obj, "options", ()))
    }


def _describe_options(options: dict) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in options.items())


# -- run -------------------------------------------------------------------------------------------


def _call_shapes(args: argparse.Namespace) -> dict[str, int]:
    """The shapes of the call ``run`` makes: the built-in pipeline's size, or what --height/--width/--num-frames
    say for --model (the pipeline's defaults otherwise, which ``auto`` cannot know: then none)."""
    if args.model is None:
        from memmode_core.cli.demo import SIZES

        dims = SIZES[args.size]
        return {"height": dims.height, "width": dims.width, "num_frames": dims.frames}
    return _given_shapes(args)


def _given_shapes(args: argparse.Namespace) -> dict[str, int]:
    """--height/--width/--num-frames, those given."""
    return call_shapes(args.height, args.width, args.num_frames)


def _cmd_run(args: argparse.Namespace) -> int:
    from memmode_core.cli.runner import run_modes
    from memmode_core.cli.table import render

    if args.plot:
        from memmode_core.cli.plotting import require_matplotlib

        require_matplotlib()  # before minutes of work, not after
    load, call, description = _pipeline_source(args)
    modes = args.compare or [args.mode]
    _refuse_undeclared(args.options)
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
        apply_options=args.options,
        keep_going=bool(args.compare),
        load_into=_load_into(args),
        call_shapes=_call_shapes(args),
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
            print(f"options: {_describe_options(args.options)}")
        refused = any(not r.ran for r in results)
        headers = ["mode", "storage", "s/call", "peak on device", "moved/call", "RAM (offloaded)", "disk"]
        print(
            render(headers + (["note"] if refused else []), [_run_row(r, refused) for r in results], right=headers[2:])
        )
        if args.plot and ran:
            print(f"plot written to {args.plot}")
    if not ran:
        print("memmode: error: every mode was refused", file=sys.stderr)
        return 2
    return 0


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


# -- plan ------------------------------------------------------------------------------------------


def _cmd_plan(args: argparse.Namespace) -> int:
    from memmode_core.cli.table import render

    _refuse_undeclared(args.options)
    load, _, description = _pipeline_source(args)
    if args.model is not None:  # from config files and checkpoint headers: no weight is read
        from memmode_core.loading.load import skeleton
        from memmode_core.quantization import SIZES_ONLY

        pipe = skeleton(args.model, torch_dtype=_dtype(args.dtype) or "auto")
        sizes_only = SIZES_ONLY.set(True)
    else:
        pipe, sizes_only = load(), None
    shapes = _given_shapes(args)
    # placement options go to every candidate whose placement declares them
    try:
        entries = memmode.plan(
            pipe,
            device=args.device,
            vram_budget=args.vram,
            ram_budget=args.ram,
            quantizer=args.quantizer or None,
            steps=args.steps,
            # the call's shapes: activations predicted on fake tensors, counted against --vram with the weights
            # (a --model skeleton's too: its weights stand in as fake tensors, the pipeline's code runs on the host)
            **shapes,
            **args.options,
        )
    finally:
        if sizes_only is not None:
            SIZES_ONLY.reset(sizes_only)
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
    if args.options:
        print(f"options: {_describe_options(args.options)} (for each mode whose plugins declare them)")
    shaped = any(e.activation_bytes for e in entries)
    if shaped:
        print(f"activations at these shapes: {format_bytes(max(e.activation_bytes for e in entries))} at peak")
        unmodelled = entries[0].unmodelled_workspace
        if unmodelled:
            print(
                f"  not counted: the kernel workspace of {', '.join(unmodelled)} on {args.device or 'this device'}"
                " (chosen by its library at run time) - leave a margin for it"
            )
    rows = []
    for e in sorted(entries, key=lambda e: (not e.fits, e.seconds_per_call, e.peak_device_bytes)):
        options = ", ".join(f"{k}={v}" for k, v in e.options.items())
        rows.append(
            (
                "*" if e.chosen else "",
                e.mode,
                options or "-",
                e.storage or "-",
                format_bytes(e.peak_device_bytes),
                *([format_bytes(e.device_bytes)] if shaped else []),
                format_bytes(e.transfer_bytes_per_call),
                format_bytes(e.host_bytes),
                format_bytes(e.disk_bytes) if e.disk_bytes else "-",
                f"{e.seconds_per_call:.3f}",
                "yes" if e.fits else f"no: {e.reason}",
            )
        )
    print(
        render(
            [
                "",
                "mode",
                "options",
                "storage",
                "weights on device",
                *(["+ activations"] if shaped else []),
                "moved/call",
                "RAM",
                "disk",
                "copy s/call",
                "fits",
            ],
            rows,
            right=["weights on device", "+ activations", "moved/call", "RAM", "disk", "copy s/call"],
        )
    )
    chosen = next((e for e in entries if e.chosen), None)
    if chosen is not None:
        print(f"* auto would choose {chosen.label()} with storage {chosen.storage}")
    else:
        print("nothing fits these budgets: auto would refuse")
    return 0


# -- the parser ------------------------------------------------------------------------------------


def _add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    from memmode_core.cli.demo import SIZES

    parser.add_argument(
        "--model",
        metavar="DIR",
        help="a local diffusers pipeline folder (default: the built-in Wan 2.2-shaped pipeline with random weights)",
    )
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="small",
        help="size of the built-in pipeline: small (0.036 B parameters per transformer) or tiny "
        "(0.05 M parameters per transformer)",
    )
    parser.add_argument("--dtype", help="load the weights in this dtype (bfloat16, float16, float32)")
    parser.add_argument("--device", help="compute device (default: cuda when available, else cpu)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt", default="a red fox running through fresh snow at dawn", help="with --model")
    parser.add_argument("--height", type=int, help="with --model; for plan: predict the activations at this size")
    parser.add_argument("--width", type=int, help="with --model; for plan: predict the activations at this size")
    parser.add_argument(
        "--num-frames", dest="num_frames", type=int, help="with --model (video pipelines); for plan, as --height"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--option",
        action="append",
        type=parse_option,
        metavar="NAME=VALUE",
        help="a plugin option, repeatable: --option offload_type=leaf_level --option "
        "num_blocks_per_group=2 (VALUE is read as a Python literal when it is one: 2, "
        "True, None, [1, 2]; else kept as a string)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memmode", description="GPU memory modes for diffusers pipelines.")
    parser.add_argument("--version", action="version", version=f"memmode {memmode.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    listing = commands.add_parser("list", help="what is installed: placements, quantizers, storages")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(func=_cmd_list)

    run = commands.add_parser("run", help="run a pipeline under a mode and report time and memory")
    _add_pipeline_arguments(run)
    run.add_argument("--mode", default=DEFAULT_RUN_MODE, help=f"the mode (default: {DEFAULT_RUN_MODE})")
    run.add_argument(
        "--compare",
        nargs="+",
        metavar="MODE",
        help="run several modes side by side; a refused mode gets a row saying why and the others "
        "still run (exit status 0 when at least one ran)",
    )
    run.add_argument("--storage", help="where offloaded weights wait (default: pinned on CUDA if installed, else ram)")
    run.add_argument("--plot", metavar="FILE.png", help="draw resident device bytes over time for each mode")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(func=_cmd_run, subparser=run)

    planning = commands.add_parser("plan", help="what each mode would cost, and which one auto would pick")
    _add_pipeline_arguments(planning)
    planning.add_argument("--vram", help="device budget for weights, e.g. 8GiB")
    planning.add_argument("--ram", help="RAM budget for offloaded weights, e.g. 32GiB")
    planning.add_argument("--quantizer", nargs="+", metavar="NAME", help="also plan these quantizers")
    planning.set_defaults(func=_cmd_plan, subparser=planning, steps=20)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        args.options = _options(parser, args)
        try:
            status = args.func(args)
        except memmode.MemmodeError as exc:
            print(f"memmode: error: {exc}", file=sys.stderr)
            status = 2
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return status
    except BrokenPipeError:
        _discard_stdout()
        return BROKEN_PIPE_STATUS


def _discard_stdout() -> None:
    """The reader of stdout went away (``memmode list | head -1``): what is still buffered goes to
    devnull, so that the interpreter's final flush does not print a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real stdout (captured, closed): nothing to redirect
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
