"""Every placement on a GPU, side by side with diffusers' equivalents: step time, peak memory, bus use.

A Wan-shaped transformer with random weights (about 3B parameters in bf16 by default) runs one
denoising step's forward under each variant; each variant runs in a fresh subprocess so that its
peak memory (``torch.cuda.max_memory_allocated``) and its pinned memory are its own. The pinned
host-to-device bandwidth is measured in the same run, and each offloading variant's achieved
bandwidth (bytes moved per step / step time) is given against it.

    python benchmarks/gpu_modes.py                  # on a CUDA machine, under 5 minutes on one H200
    python benchmarks/gpu_modes.py --tiny           # a CPU dry run of the whole script, 1-2 minutes: memmode's
                                                    # variants run the accelerator path (prefetch streams,
                                                    # pinned staging) under the strict model of
                                                    # asynchronous copies, checked after each run
    python benchmarks/gpu_modes.py --json out.json  # also write the table as JSON

Targets (issue 3): group offload with prefetch within 1.05x of the full-load step time, with copies
reaching 90% of the measured pinned bandwidth. The ``budget30/60/90`` variants keep groups resident up to
that share of the weights (``vram_budget``) and print the planner's prediction of their step time and peak
(weights + activations) next to the measured ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import parameter_bytes, wan_transformer  # noqa: E402

#: variant -> (library, description)
VARIANTS = {
    "model_full_load": ("memmode", "everything resident"),
    "model_cpu_offload": ("memmode", "whole component, stays once loaded"),
    "model_group_offload": ("memmode", "block level, prefetched"),
    "model_group_offload/2": ("memmode", "block level, 2 blocks per group, prefetched"),
    "model_group_offload/leaf": ("memmode", "leaf level, prefetched"),
    "sequential_cpu_offload": ("memmode", "leaf level, synchronous"),
    "model_group_offload/budget30": ("memmode", "block level, vram_budget = 30% of the weights"),
    "model_group_offload/budget60": ("memmode", "block level, vram_budget = 60% of the weights"),
    "model_group_offload/budget90": ("memmode", "block level, vram_budget = 90% of the weights"),
    "diffusers block_level": ("diffusers", "apply_group_offloading, block level, use_stream"),
    "diffusers leaf_level": ("diffusers", "apply_group_offloading, leaf level, use_stream"),
    "accelerate sequential": ("accelerate", "cpu_offload (enable_sequential_cpu_offload)"),
}


def size_args(args) -> dict:
    if args.tiny:
        return dict(heads=2, head_dim=16, layers=20)  # enough blocks for the budget variants to stream some
    return dict(heads=args.heads, head_dim=args.head_dim, layers=args.layers)


def inputs_for(model, args, device):
    config = model.config
    frames, height, width, tokens = (1, 8, 8, 8) if args.tiny else (args.frames, args.height, args.width, 512)
    g = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return dict(
        hidden_states=torch.randn(1, config.in_channels, frames, height, width, generator=g).to(device, dtype),
        timestep=torch.tensor([500], device=device),
        encoder_hidden_states=torch.randn(1, tokens, config.text_dim, generator=g).to(device, dtype),
        return_dict=False,
    )


def pinned_bandwidth(device, nbytes=1 << 30) -> float:
    """Host-to-device GB/s of one large copy from page-locked memory (the ceiling for prefetching)."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return max(rates)


@contextlib.contextmanager
def dry_run_accelerator(args):
    """For ``--tiny`` memmode variants: the CPU made an accelerator by memmode's strict model of asynchronous
    copies, so the dry run takes the code path the GPU run takes, and a synchronisation error fails it."""
    if not (args.tiny and args.child.startswith(("model_", "sequential_"))):
        yield
        return
    from memmode_core.engine.streams import installed
    from memmode_core.testing import StrictStreams

    model = StrictStreams()
    with installed(model):
        yield
        model.check()


def predict(prepared, traces, device) -> dict:
    """The planner's step time (compute at the measured rate + the time it waits for copies) and peak device
    memory (weights at peak + the activation peak), both from the traced call."""
    from memmode_core.planning.pricing import price
    from memmode_core.planning.timing import compute_rate, group_flops

    entry = price(prepared, ["module"], traces)
    flops = sum(group_flops(prepared.internal.groups, prepared.internal.target.components, traces).values())
    return {
        "predicted_step_s": flops / compute_rate(device) + entry.seconds_per_call,
        "predicted_peak_gib": (entry.peak_device_bytes + traces["module"].activation_peak) / 2**30,
        "budget_gib": prepared.internal.residency.budget / 2**30,
        # kernels whose workspace on this device the prediction leaves out (cuDNN's, for the patch embedding)
        "unmodelled_workspace": sorted(traces["module"].unmodelled),
    }


def run_variant(name: str, args) -> dict:
    """Runs in the child process: build, place, time, report."""
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    model = wan_transformer(**size_args(args), dtype=dtype, seed=0)
    weight_bytes = parameter_bytes(model)
    inputs = inputs_for(model, args, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    moved_per_step = None
    handle = None
    predicted = {}
    if name.startswith(("model_", "sequential_")):
        import memmode_core as memmode

        mode, _, flavour = name.partition("/")
        options = {}
        if flavour == "2":
            options["num_blocks_per_group"] = 2
        if flavour == "leaf":
            options["offload_type"] = "leaf_level"
        traces = None
        if flavour.startswith("budget"):
            from memmode_core.planning.trace import trace_call

            options["vram_budget"] = int(weight_bytes * int(flavour[len("budget") :]) / 100)
            # on fake tensors, before memmode hooks the model; kernel workspace as on the device
            traces = trace_call(model, lambda: model(**inputs), device)
        handle = memmode.apply(model, mode, device=device, **options)
        if traces is not None:
            predicted = predict(handle.prepared, traces, device)
    elif name.startswith("diffusers"):
        from diffusers.hooks import apply_group_offloading

        level = name.split()[1]
        apply_group_offloading(
            model,
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type=level,
            num_blocks_per_group=1 if level == "block_level" else None,
            use_stream=device.type == "cuda",
        )
        moved_per_step = weight_bytes
    elif name == "accelerate sequential":
        from accelerate import cpu_offload

        cpu_offload(model, execution_device=device)
        moved_per_step = weight_bytes
    times = []
    with torch.inference_mode():
        for step in range(args.steps + 1):
            if handle is not None and step == 1:
                handle.reset_stats()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            output = model(**inputs)[0]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step:  # the first call records the execution order and warms up kernels
                times.append(time.perf_counter() - start)
    step_time = statistics.median(times)
    if handle is not None:
        report = handle.report()
        moved_per_step = report.bytes_transferred / args.steps
    out_path = os.path.join(args.workdir, f"{name.replace('/', '_').replace(' ', '_')}.pt")
    torch.save(output.float().cpu(), out_path)
    return {
        "variant": name,
        "library": VARIANTS[name][0],
        "step_s": step_time,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "moved_gib_per_step": (moved_per_step or 0) / 2**30,
        "achieved_gbps": (moved_per_step or 0) / step_time / 1e9 if moved_per_step else None,
        "weights_gib": weight_bytes / 2**30,
        "output": out_path,
        **predicted,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the script itself")
    parser.add_argument("--heads", type=int, default=18, help="18 x 128 = 2304 wide, 40 blocks: 2.9B parameters")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--frames", type=int, default=21, help="latent frames (81 video frames)")
    parser.add_argument("--height", type=int, default=60, help="latent height (480 px)")
    parser.add_argument("--width", type=int, default=104, help="latent width (832 px)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        with dry_run_accelerator(args):
            print(json.dumps(run_variant(args.child, args)))
        return
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("gpu_modes.py needs CUDA (use --tiny for a CPU dry run)")
    workdir = tempfile.mkdtemp(prefix="memmode-gpu-modes-")
    bandwidth = None if args.tiny else pinned_bandwidth(torch.device("cuda"))
    results = []
    passthrough = [a for a in sys.argv[1:] if not a.startswith("--json")]
    for name in args.variants:
        command = [sys.executable, os.path.abspath(__file__), *passthrough, "--child", name, "--workdir", workdir]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            results.append({"variant": name, "library": VARIANTS[name][0], "error": done.stderr.strip()[-400:]})
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    reference = next((r for r in results if r["variant"] == "model_full_load" and "error" not in r), None)
    expected = torch.load(reference["output"]) if reference else None
    for r in results:
        if "error" in r or expected is None:
            continue
        r["max_abs_diff"] = (torch.load(r["output"]) - expected).abs().max().item()
        r["vs_full_load"] = r["step_s"] / reference["step_s"]
        if bandwidth and r.get("achieved_gbps"):
            r["of_pinned_bw"] = r["achieved_gbps"] / bandwidth
    size = results[0].get("weights_gib") if results else None
    print(
        f"Wan-shaped transformer: {size and round(size, 2)} GiB of weights; pinned H2D bandwidth "
        f"{bandwidth and round(bandwidth, 1)} GB/s"
    )
    header = (
        f"{'variant':<26}{'step s':>9}{'x full':>8}{'peak GiB':>10}{'moved GiB':>11}{'GB/s':>8}{'of pinned':>10}"
        f"{'max|diff|':>11}{'pred s':>9}{'pred peak':>11}"
    )
    print(header)
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<26} failed: {r['error'].splitlines()[-1] if r['error'] else '?'}")
            continue

        def fmt(value, spec):
            width = int(spec.split(".")[0])
            return format(value, spec) if value is not None else "-".rjust(width)

        print(
            f"{r['variant']:<26}{fmt(r['step_s'], '9.3f')}{fmt(r.get('vs_full_load'), '8.2f')}"
            f"{fmt(r['peak_gib'], '10.2f')}{fmt(r['moved_gib_per_step'], '11.2f')}"
            f"{fmt(r.get('achieved_gbps'), '8.1f')}{fmt(r.get('of_pinned_bw'), '10.0%')}"
            f"{fmt(r.get('max_abs_diff'), '11.2e')}{fmt(r.get('predicted_step_s'), '9.3f')}"
            f"{fmt(r.get('predicted_peak_gib'), '11.2f')}"
        )
    unmodelled = sorted({op for r in results for op in r.get("unmodelled_workspace", ())})
    if unmodelled:
        print(f"pred peak leaves out the kernel workspace of {', '.join(unmodelled)} on this device")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pinned_gbps": bandwidth, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
