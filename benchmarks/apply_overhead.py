"""Time memmode spends deciding and installing a mode — ``prepare``, ``apply``, ``remove``, ``plan`` — side by side
for two checkouts of memmode, on the built-in pipeline.

    python benchmarks/apply_overhead.py [--rounds 7] [--size small] [--against /path/to/other/checkout]
    python benchmarks/apply_overhead.py --profile model_group_offload_and_qfloat8

No weight moves between devices here (the CPU is the device): what is timed is memmode's own work, the part a
refactor of its modules could make slower. Each round builds the pipelines afresh, outside the timings, and
runs every step once per mode in a child process per checkout, the checkouts alternating round after round,
so that the machine's noise falls on both alike; each figure is the median over rounds with the (min-max)
spread. ``--against`` runs the other checkout's ``memmode_core`` and plugins (put first on ``PYTHONPATH``).
``--profile MODE`` prints the functions one ``apply`` spends most time in (``cProfile``, cumulative).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = (
    "model_cpu_offload",
    "model_group_offload",
    "sequential_cpu_offload",
    "model_group_offload_and_qfloat8",
    "auto",
)
ROOT = Path(__file__).resolve().parent.parent


def one_round(size: str) -> dict[str, float]:
    """Seconds of each step for each mode, in this process (one round)."""
    import torch

    torch.set_num_threads(1)
    import memmode_core as memmode
    from memmode_core.demo import make_demo_pipeline

    memmode.list_plugins()  # discovery once, before any timing
    times: dict[str, float] = {}
    for mode in MODES:
        pipe = make_demo_pipeline(size, seed=0)
        start = time.perf_counter()
        prepared = memmode.prepare(pipe, mode, device="cpu")
        times[f"prepare {mode}"] = time.perf_counter() - start
        pipe = make_demo_pipeline(size, seed=0)
        start = time.perf_counter()
        handle = memmode.apply(pipe, mode, device="cpu")
        times[f"apply {mode}"] = time.perf_counter() - start
        start = time.perf_counter()
        handle.remove()
        times[f"remove {mode}"] = time.perf_counter() - start
        del prepared, handle, pipe
    pipe = make_demo_pipeline(size, seed=0)
    start = time.perf_counter()
    memmode.plan(pipe, device="cpu", quantizer="qfloat8")
    times["plan qfloat8"] = time.perf_counter() - start
    return times


def profile(size: str, mode: str) -> None:
    import cProfile
    import pstats

    import memmode_core as memmode
    from memmode_core.demo import make_demo_pipeline

    memmode.list_plugins()
    pipe = make_demo_pipeline(size, seed=0)
    profiler = cProfile.Profile()
    handle = profiler.runcall(memmode.apply, pipe, mode, device="cpu")
    handle.remove()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


def _child(checkout: Path, size: str) -> dict[str, float]:
    env = dict(os.environ)
    paths = [str(checkout), *(str(p) for p in sorted((checkout / "plugins").glob("memmode-*")))]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--one-round", "--size", size],
        env=env,
        cwd=checkout,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--against", type=Path, help="another checkout of memmode to time side by side")
    parser.add_argument("--profile", metavar="MODE")
    parser.add_argument("--one-round", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_round:
        print(json.dumps(one_round(args.size)))
        return
    if args.profile:
        profile(args.size, args.profile)
        return
    checkouts = {"this": ROOT, **({"other": args.against.resolve()} if args.against else {})}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    for _ in range(args.rounds):
        for name, checkout in checkouts.items():
            runs[name].append(_child(checkout, args.size))
    steps = list(runs["this"][0])
    header = f"{'step':<42}" + "".join(f"{name + ' (ms, median (min-max))':>34}" for name in checkouts)
    print(f"{args.rounds} rounds, the built-in {args.size} pipeline on the CPU\n{header}")
    for step in steps:
        cells = []
        for name in checkouts:
            values = [1000 * run[step] for run in runs[name]]
            cells.append(f"{statistics.median(values):8.1f} ({min(values):.1f}-{max(values):.1f})")
        ratio = ""
        if "other" in runs:
            mine = statistics.median(run[step] for run in runs["this"])
            theirs = statistics.median(run[step] for run in runs["other"])
            ratio = f"   {mine / theirs:.2f}x"
        print(f"{step:<42}" + "".join(f"{c:>34}" for c in cells) + ratio)


if __name__ == "__main__":
    main()
