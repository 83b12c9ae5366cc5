"""The ``memmode`` command line: its subcommands, their flags and their help.

``run`` and ``plan`` share the flags that name the pipeline and its call, so that both read them alike;
``plan`` counts 20 steps by default where ``run`` makes 4. Each subcommand's parser is kept on its arguments
(``subparser``): a usage error found after parsing shows that subcommand's usage line. The ``--size`` help
states the built-in pipeline's sizes, which ``tests/test_docs_examples.py`` measures.
"""

from __future__ import annotations

import argparse

import memmode_core as memmode
from memmode_core.cli.listing import list_command
from memmode_core.cli.plan_command import plan_command
from memmode_core.cli.plugin_options import parse_option
from memmode_core.cli.run_command import run_command
from memmode_core.discovery.first_party import DEFAULT_RUN_MODE


def _add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    from memmode_core.cli.demo_pipeline import SIZES

    parser.add_argument(
        "--model",
        metavar="DIR",
        help="a local diffusers pipeline folder (default: the built-in Wan 2.2-shaped pipeline with random weights)",
    )
    parser.add_argument(
        "--transformer",
        metavar="FILE",
        help="the transformer from one file in place of its weights (a GGUF with memmode-gguf, a ComfyUI fp8 or any "
        "safetensors file, original or diffusers names), its config from the folder (--model, else the built-in "
        "pipeline's)",
    )
    parser.add_argument(
        "--transformer-2",
        dest="transformer_2",
        metavar="FILE",
        help="as --transformer, for the second expert of a Wan 2.2 pipeline (transformer_2)",
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
    listing.set_defaults(func=list_command)

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
    run.add_argument(
        "--reserve",
        help="keep this much of the device free for what memmode does not own: bytes ('2GiB') or a share ('10%%')",
    )
    run.add_argument(
        "--nproc",
        type=_ranks,
        default=1,
        metavar="N",
        help="run on N ranks of torch.distributed on this machine, each transformer's sequence split over them "
        "(context parallelism; gloo on the CPU, one GPU each with CUDA)",
    )
    run.set_defaults(func=run_command, subparser=run)

    planning = commands.add_parser("plan", help="what each mode would cost, and which one auto would pick")
    _add_pipeline_arguments(planning)
    planning.add_argument("--vram", help="device budget for weights, e.g. 8GiB")
    planning.add_argument("--ram", help="RAM budget for offloaded weights, e.g. 32GiB")
    planning.add_argument(
        "--reserve",
        help="keep this much of the device free for what memmode does not own ('2GiB', '10%%'): without --vram, "
        "the budget is the device's free memory now less it",
    )
    planning.add_argument("--quantizer", nargs="+", metavar="NAME", help="also plan these quantizers")
    planning.add_argument(
        "--world-size",
        type=int,
        default=1,
        metavar="N",
        help="ranks of this machine that each place the pipeline (one process per GPU): --vram is one GPU's, "
        "--ram the machine's, and what ranks share (mmap's and disk's files) counts once",
    )
    planning.add_argument(
        "--context-parallel",
        type=int,
        default=1,
        metavar="K",
        help="ranks that split the transformer's sequence (diffusers' ContextParallelConfig): its activations "
        "are that share on each",
    )
    planning.set_defaults(func=plan_command, subparser=planning, steps=20)
    return parser


def _ranks(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a number of ranks is 1 or more, not {value}")
    return value
