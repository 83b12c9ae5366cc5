"""Where ``apply``'s mode goes: the modules the request passes through, and every call up a layer.

    python benchmarks/call_path.py [--mode MODE ...] [--verbose]

``apply(pipe, mode)`` on the built-in tiny pipeline, traced by ``tests/call_tracing.py`` (which says what is
counted: the stops of the request's path, the modules it enters again, the calls up a layer and the plugin
calls each layer makes); ``tests/test_call_path.py`` holds memmode to no re-entry and no call up. To compare
with another checkout, run this file with that checkout's ``memmode_core`` first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from call_tracing import DEFAULT_MODES, trace_apply  # noqa: E402
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
    from memmode_core.cli.demo import make_demo_pipeline

    memmode.list_plugins()  # discovery runs once, before any trace: what is traced is apply's own path

    short = lambda m: m.removeprefix("memmode_core.")  # noqa: E731
    for mode in args.mode:
        pipe = make_demo_pipeline("tiny", seed=0)
        path = trace_apply(pipe, mode, device="cpu")
        stops, ups, plugin_calls, again = path.stops, path.calls_up, path.plugin_calls, path.entered_again
        entered = {module for module, _ in stops}
        print(
            f"\n== {mode}: {len(stops)} stops in {len(entered)} modules, {len(again)} entered more than once, "
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


if __name__ == "__main__":
    main()
