"""Time that block- and leaf-level offloading add to one forward on the CPU: memmode vs diffusers.

Both libraries offload the same Wan-shaped transformer from and to the CPU (so no bytes really
move): what is measured is the bookkeeping each adds per call — hooks, residency checks, input
handling. At leaf level the same is measured with the weights offloaded to files: memmode's
``disk`` and ``mmap`` storages against diffusers' ``offload_to_disk_path`` (files hot in the page
cache: what is measured is each onload's checks, mapping or reading, and bookkeeping). The variants
run interleaved, round after round, so that machine noise hits all of them alike; "added" is a
variant's time minus the plain model's in the same round, and each figure is the median over rounds
with the (min-max) spread.

    python benchmarks/hook_overhead.py [--rounds 30] [--layers 24]

Targets: memmode adds at most half of what diffusers adds, at both levels; with files at leaf
level, ``disk`` adds at most a quarter of what diffusers' disk offload adds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from _models import wan_inputs, wan_transformer


def build_variants(layers: int, folder: str):
    from diffusers.hooks import apply_group_offloading

    import memmode_core as memmode

    cpu = torch.device("cpu")
    variants = {}
    variants["plain"] = wan_transformer(heads=2, head_dim=32, layers=layers)
    for level in ("block_level", "leaf_level"):
        model = wan_transformer(heads=2, head_dim=32, layers=layers)
        memmode.apply(model, "model_group_offload", device="cpu", offload_type=level)
        variants[f"memmode {level}"] = model
        model = wan_transformer(heads=2, head_dim=32, layers=layers)
        apply_group_offloading(
            model,
            onload_device=cpu,
            offload_device=cpu,
            offload_type=level,
            num_blocks_per_group=1 if level == "block_level" else None,
        )
        variants[f"diffusers {level}"] = model
    for storage in ("disk", "mmap"):
        model = wan_transformer(heads=2, head_dim=32, layers=layers)
        memmode.apply(
            model,
            "model_group_offload",
            device="cpu",
            offload_type="leaf_level",
            storage=storage,
            offload_dir=f"{folder}/memmode-{storage}",
        )
        variants[f"memmode leaf_level {storage}"] = model
    model = wan_transformer(heads=2, head_dim=32, layers=layers)
    apply_group_offloading(
        model,
        onload_device=cpu,
        offload_device=cpu,
        offload_type="leaf_level",
        offload_to_disk_path=f"{folder}/diffusers",
    )
    variants["diffusers leaf_level disk"] = model
    return variants


def measure(variants, inputs, rounds: int, calls: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        for model in variants.values():  # warm-up (and diffusers' lazy first-call work)
            model(**inputs)
        for _ in range(rounds):
            for name, model in variants.items():
                start = time.perf_counter()
                for _ in range(calls):
                    model(**inputs)
                times[name].append((time.perf_counter() - start) / calls)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=5, help="forwards per timing")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dir", default=None, help="where the file-backed variants write (default: TMPDIR; a disk)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the bookkeeping is what is measured; keep kernels from adding noise
    with tempfile.TemporaryDirectory(prefix="memmode-hook-bench-", dir=args.dir) as folder:
        variants = build_variants(args.layers, folder)
        reference = variants["plain"]
        inputs = wan_inputs(reference, height=8, width=8, text_tokens=8)
        outputs = {name: model(**inputs)[0] for name, model in variants.items()}
        for name, out in outputs.items():
            if name.startswith("memmode"):  # memmode's files are 64-byte aligned, as torch's allocations
                torch.testing.assert_close(out, outputs["plain"], rtol=0, atol=0, msg=f"{name} changed the output")
            else:  # diffusers' safetensors files are not: on some CPUs kernels round differently there
                diff = (out - outputs["plain"]).abs().max().item()
                assert diff < 1e-4, f"{name} changed the output by {diff}"
                if diff:
                    print(f"{name}: output differs from the plain model's by {diff:.1e} (its files' alignment)")
        times = measure(variants, inputs, args.rounds, args.calls)
    report(times, args)


def report(times: dict[str, list[float]], args: argparse.Namespace) -> None:
    """Per variant the median and (min-max) over rounds; "added" pairs each round with the plain model's
    time in the same round, so that noise common to a round cancels out."""
    plain = times["plain"]
    added = {name: [t - p for t, p in zip(values, plain)] for name, values in times.items()}

    def spread(values: list[float], scale: float = 1e3) -> str:
        return f"{statistics.median(values) * scale:.3f} ({min(values) * scale:.3f}-{max(values) * scale:.3f})"

    print(f"Wan-shaped transformer, {args.layers} blocks, CPU, {args.rounds} rounds x {args.calls} calls")
    print(f"{'variant':<28}{'ms/call median (min-max)':>30}{'added ms median (min-max)':>32}")
    for name, values in times.items():
        print(f"{name:<28}{spread(values):>30}{spread(added[name]):>32}")
    pairs = [
        ("block_level", "memmode block_level", "diffusers block_level", 0.50),
        ("leaf_level", "memmode leaf_level", "diffusers leaf_level", 0.50),
        ("leaf_level, disk", "memmode leaf_level disk", "diffusers leaf_level disk", 0.25),
        ("leaf_level, mmap", "memmode leaf_level mmap", "diffusers leaf_level disk", None),
    ]
    for label, ours, theirs, target in pairs:
        ratios = [a / b for a, b in zip(added[ours], added[theirs])]
        ratio = statistics.median(added[ours]) / statistics.median(added[theirs])
        print(
            f"{label}: memmode adds {statistics.median(added[ours]) * 1e3:.3f} ms, diffusers "
            f"{statistics.median(added[theirs]) * 1e3:.3f} ms -> ratio {ratio:.2f} (per round "
            f"{spread(ratios, 1)})" + (f" (target <= {target:.2f})" if target is not None else "")
        )


if __name__ == "__main__":
    main()
