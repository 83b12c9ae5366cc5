"""Where ``apply``'s and ``load``'s mode goes: the modules the request passes through, every call up a layer,
and where each argument of the request goes by name.

    python benchmarks/call_path.py [--mode MODE ...] [--verbose]

``apply(pipe, mode)`` on the built-in tiny pipeline, and ``load(folder, mode)`` of the same pipeline saved,
traced by ``tests/call_tracing.py`` (which says what is counted: the stops of the request's path, the modules
it enters again, the calls up a layer and the plugin calls each layer makes; and, for each argument of the
request, the functions that receive it under its own name); ``tests/test_call_path.py`` holds memmode to no
re-entry, no call up, and every argument followed by name into ``Request.build``. To compare
with another checkout, run this file with that checkout's ``memmode_core`` first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from call_tracing import DEFAULT_MODES, follow_arguments, trace_apply, trace_load  # noqa: E402
from layers import layer_of_module  # noqa: E402


def type_of(module: str, function: str) -> str:
    """``Auto.choose`` for a method, the module for anything else: what kind of plugin code was called."""
    owner = function.split(".")[0]
    return f"{owner}.{function.split('.')[-1]}" if "." in function else module.removeprefix("memmode_core.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", nargs="+", default=list(DEFAULT_MODES))
    parser.add_argument("--verbose", action="store_true", help="print every stop")
    args = parser.parse_args()
    import memmode_core as memmode
    from memmode_core.demo import make_demo_pipeline

    memmode.list_plugins()  # discovery runs once, before any trace: what is traced is apply's own path

    short = lambda m: m.removeprefix("memmode_core.")  # noqa: E731
    folder = Path(tempfile.mkdtemp(prefix="memmode-call-path-"))
    make_demo_pipeline("tiny", seed=0).save_pretrained(folder)
    traced = []
    for mode in args.mode:
        traced.append((f"apply {mode}", trace_apply(make_demo_pipeline("tiny", seed=0), mode, device="cpu")))
        traced.append((f"load {mode}", trace_load(folder, mode, device="cpu")))
    for label, path in traced:
        stops, ups, plugin_calls, again = path.stops, path.calls_up, path.plugin_calls, path.entered_again
        entered = {module for module, _ in stops}
        print(
            f"\n== {label}: {len(stops)} stops in {len(entered)} modules, {len(again)} entered more than once, "
            f"{sum(ups.values())} calls up a layer ({len(ups)} distinct), "
            f"{sum(plugin_calls.values())} plugin contract calls"
        )
        if args.verbose:
            print("  path: " + " -> ".join(f"{short(m)}.{f}" for m, f in stops))
        for module, count in sorted(again.items()):
            print(f"  entered {count}x: {short(module)}")
        for (caller, callee, function), count in sorted(ups.items()):
            print(
                f"  up: {short(caller)} [{layer_of_module(caller)}] -> {short(callee)}.{function} "
                f"[{layer_of_module(callee)}] x{count}"
            )
        by_layer: collections.Counter = collections.Counter()
        for (caller, callee, function), count in plugin_calls.items():
            by_layer[(short(caller).split(".")[0], f"{type_of(callee, function)}")] += count
        for (layer, kind), count in sorted(by_layer.items()):
            print(f"  plugin calls from {layer}: {kind} x{count}")
        if args.verbose:
            for (caller, callee, function), count in sorted(plugin_calls.items()):
                print(f"  plugin: {short(caller)} -> {short(callee)}.{function} x{count}")

    print("\n== where each argument of the request goes, by name (apply, then load)")
    arguments = {"device": torch.device("cpu"), "storage": "".join("disk"), "offload_dir": str(folder / "offload")}
    arguments |= {"components": ["transformer"], "exclude": ["".join("norm")], "unplaced": ["vae"], "strict": False}
    mode = "model_group_offload_and_qfloat8"
    for entry, target in ((memmode.apply, make_demo_pipeline("tiny", seed=0)), (memmode.load, folder)):
        trails, handle = follow_arguments(entry, target, mode, followed=dict(arguments))
        handle.remove()
        for name, trail in trails.items():
            print(f"  {entry.__name__} {name}: " + " -> ".join(short(stop) for stop in trail[:4]))
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
