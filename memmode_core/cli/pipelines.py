"""The pipeline ``run`` and ``plan`` work on: how it is loaded, how it is called, at which shapes.

Without ``--model`` it is the built-in Wan 2.2-shaped pipeline (:mod:`memmode_core.cli.demo_pipeline`), so that a
first ``memmode run`` needs no download. With ``--model DIR`` it is a local diffusers folder: ``run`` loads
it straight into each mode (``memmode.load``), never whole into RAM, and ``plan`` builds it from its config
files and checkpoint headers without reading a weight. ``--transformer FILE`` (and ``--transformer-2``) give a
denoiser as one community file (a GGUF, a ComfyUI fp8 file): loaded the same way, into the ``--model`` folder or,
without one, into the built-in pipeline's configs (saved once to a temporary folder).
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import memmode_core as memmode
from memmode_core.planning.calls import call_shapes


def torch_dtype(name: str | None):
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


def component_files(args: argparse.Namespace) -> dict[str, str]:
    """The components given as one file (``--transformer``, ``--transformer-2``)."""
    given = {"transformer": getattr(args, "transformer", None), "transformer_2": getattr(args, "transformer_2", None)}
    return {name: path for name, path in given.items() if path is not None}


_DEMO_FOLDERS: dict[tuple, Path] = {}


def model_folder(args: argparse.Namespace) -> str | Path:
    """The folder ``load`` reads: ``--model``, or the built-in pipeline saved to a temporary folder (once per
    process, removed at exit), whose configs a ``--transformer`` file is read with."""
    if args.model is not None:
        return args.model
    from memmode_core.cli.demo_pipeline import make_demo_pipeline

    key = (args.size, args.seed)
    if key not in _DEMO_FOLDERS:
        folder = Path(tempfile.mkdtemp(prefix="memmode-demo-pipeline-"))
        atexit.register(shutil.rmtree, folder, True)
        make_demo_pipeline(args.size, seed=args.seed).save_pretrained(folder)
        _DEMO_FOLDERS[key] = folder
    return _DEMO_FOLDERS[key]


def load_into(args: argparse.Namespace):
    """``memmode.load`` for ``--model`` or ``--transformer``: the folder (and files) go straight into each mode,
    never whole into RAM."""
    files = component_files(args)
    if args.model is None and not files:
        return None
    dtype = torch_dtype(args.dtype)

    def load_into(mode, **kwargs):
        handle = memmode.load(model_folder(args), mode, torch_dtype=dtype or "auto", **files, **kwargs)
        handle.target.set_progress_bar_config(disable=True)
        return handle

    return load_into


def pipeline_source(args: argparse.Namespace):
    """``(load, call, description)`` for the built-in demo or a local diffusers folder."""
    import torch

    if args.model is None:
        from memmode_core.cli.demo_pipeline import SIZES, demo_call, make_demo_pipeline

        dtype = torch_dtype(args.dtype) or torch.float32

        def load():
            return make_demo_pipeline(args.size, seed=args.seed, dtype=dtype)

        def call(pipe, callback=None):
            return demo_call(pipe, size=args.size, steps=args.steps, seed=args.seed, callback=callback)

        dims = SIZES[args.size]
        files = "".join(f", {name} from {path}" for name, path in component_files(args).items())
        return (
            load,
            call,
            f"built-in Wan 2.2-shaped pipeline ({args.size}, random weights, {dims.frames} frames "
            f"{dims.height}x{dims.width}{files})",
        )

    from diffusers import DiffusionPipeline

    from memmode_core.loading.dtypes import pipeline_dtype_keyword

    dtype = torch_dtype(args.dtype)

    def load():
        kwargs = {pipeline_dtype_keyword(): dtype} if dtype is not None else {}
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

    files = "".join(f", {name} from {path}" for name, path in component_files(args).items())
    return load, call, f"{args.model}{files}"


@contextmanager
def pipeline_to_plan(args: argparse.Namespace) -> Iterator[tuple[object, str]]:
    """``(pipeline, description)`` for ``plan``, which prices it inside the ``with``. A ``--model`` folder is a
    skeleton built from its config files and checkpoint headers: no weight is read, so quantizers are checked
    on the shapes and dtypes of meta weights (``SIZES_ONLY``) until the ``with`` ends."""
    load, _, description = pipeline_source(args)
    files = component_files(args)
    if args.model is None and not files:
        yield load(), description
        return
    from memmode_core.loading.load import skeleton
    from memmode_core.quantization import SIZES_ONLY

    pipe = skeleton(model_folder(args), torch_dtype=torch_dtype(args.dtype) or "auto", **files)
    sizes_only = SIZES_ONLY.set(True)
    try:
        yield pipe, description
    finally:
        SIZES_ONLY.reset(sizes_only)


def run_apply_options(args: argparse.Namespace) -> dict:
    """The keywords ``run`` gives ``apply`` besides the mode and storage: the plugins' options (``-o``), and the
    reserve."""
    return dict(args.options) | ({"reserve": args.reserve} if args.reserve is not None else {})


def run_call_shapes(args: argparse.Namespace) -> dict[str, int]:
    """The shapes of the call ``run`` makes: the built-in pipeline's size, or what --height/--width/--num-frames
    say for --model (the pipeline's defaults otherwise, which ``auto`` cannot know: then none)."""
    if args.model is None:
        from memmode_core.cli.demo_pipeline import SIZES

        dims = SIZES[args.size]
        return {"height": dims.height, "width": dims.width, "num_frames": dims.frames}
    return given_shapes(args)


def given_shapes(args: argparse.Namespace) -> dict[str, int]:
    """--height/--width/--num-frames, those given."""
    return call_shapes(args.height, args.width, args.num_frames)
