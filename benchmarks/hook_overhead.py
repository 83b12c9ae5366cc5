"""Time that block- and leaf-level offloading add to one forward on the CPU: memmode vs diffusers.

Both libraries offload the same Wan-shaped transformer from and to the CPU (so no bytes really
move): what is measured is the bookkeeping each adds per call — hooks, residency checks, input
handling. The variants run interleaved, round after round, so that machine noise hits all of them
alike; each figure is the median over rounds, and "added" is the median minus the plain model's.

    python benchmarks/hook_overhead.py [--rounds 30] [--layers 24]

Target (issue 3): memmode adds at most half of what diffusers adds, at both levels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _models import wan_inputs, wan_transformer


def build_variants(layers: int):
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
    return variants


def measure(variants, inputs, rounds: int, calls: int) -> dict[str, float]:
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
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=5, help="forwards per timing")
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the bookkeeping is what is measured; keep kernels from adding noise
    variants = build_variants(args.layers)
    reference = variants["plain"]
    inputs = wan_inputs(reference, height=8, width=8, text_tokens=8)
    outputs = {name: model(**inputs)[0] for name, model in variants.items()}
    for name, out in outputs.items():
        torch.testing.assert_close(out, outputs["plain"], rtol=0, atol=0, msg=f"{name} changed the output")
    medians = measure(variants, inputs, args.rounds, args.calls)
    plain = medians["plain"]
    print(f"Wan-shaped transformer, {args.layers} blocks, CPU, median of {args.rounds} rounds x {args.calls} calls")
    print(f"{'variant':<26}{'ms/call':>10}{'added ms':>10}")
    for name, value in medians.items():
        print(f"{name:<26}{value * 1e3:>10.3f}{(value - plain) * 1e3:>10.3f}")
    for level in ("block_level", "leaf_level"):
        ours = medians[f"memmode {level}"] - plain
        theirs = medians[f"diffusers {level}"] - plain
        print(
            f"{level}: memmode adds {ours * 1e3:.3f} ms, diffusers {theirs * 1e3:.3f} ms -> ratio "
            f"{ours / theirs:.2f} (target <= 0.50)"
        )


if __name__ == "__main__":
    main()
