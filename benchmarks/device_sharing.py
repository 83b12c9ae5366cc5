"""One device, many models: two Wan-shaped transformers sharing a device, memory another process takes between
calls, and out-of-memory errors the device raises at onloads — measured against the ledger.

Scenarios, each on fresh models, every output compared with the same model's output computed alone, first:

- ``two_models``: two transformers, each keeping all its blocks (``vram_budget`` = its size) between calls, on a
  device that holds 1.5 of them (the room: another process holds the rest): called in turn, the one not running
  gives back its blocks. Reported: seconds per call, bytes moved per call, this process's
  ``max_memory_allocated`` against the device's room, evictions;
- ``shrinking``: one transformer keeping all its blocks, called as a pipeline of one component (memmode offloads
  what a pipeline holds when its call returns, as diffusers does); after its first call another process takes
  memory until the room is 60% of the model: the next calls keep what fits, stream the rest, raise nothing;
- ``refused_onloads`` (CUDA): ``torch.cuda.set_per_process_memory_fraction`` makes the caching allocator refuse
  what the free memory would allow: each refusal at an onload is recovered from (``report().recoveries``).

On CUDA the other process is a child holding a tensor of the size asked; ``--strict`` runs the same scenarios on
the CPU under the strict model of an accelerator with a capacity (``StrictStreams``), to check the script itself.

    python benchmarks/device_sharing.py --device cuda [--layers 8 --heads 12] [--json out.json]
    python benchmarks/device_sharing.py --strict
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time

import torch
from _models import parameter_bytes, wan_inputs, wan_transformer

import memmode_core as memmode

HOLDER = """
import sys, torch
held = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
print("held", flush=True)
sys.stdin.readline()
"""


class OnePipeline:
    """A pipeline of one transformer (anything with a ``components`` dict is one to memmode): like diffusers'
    pipelines, memmode offloads what it holds when its call returns, so every call onloads again."""

    def __init__(self, transformer) -> None:
        self.transformer = transformer
        self.components = {"transformer": transformer}

    def __call__(self, **inputs):
        return self.transformer(**inputs)


class OtherApplication:
    """Another process holding device memory: a child on CUDA, the strict model's ``occupy`` on the CPU."""

    def __init__(self, strict) -> None:
        self.strict = strict
        self.child: subprocess.Popen | None = None

    def hold(self, nbytes: int) -> None:
        self.release()
        if self.strict is not None:
            self.strict.capacity.occupy(nbytes)
            return
        self.child = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.child.stdout.readline().strip() == "held", "the holding process could not allocate"

    def release(self) -> None:
        if self.strict is not None:
            self.strict.capacity.occupy(0)
        elif self.child is not None:
            self.child.communicate("\n", timeout=60)
            self.child = None


def free_bytes(device: torch.device) -> int:
    from memmode_core.engine.streams import active

    return active().free_memory(device)


def timed_call(model, inputs, device) -> tuple[torch.Tensor, float]:
    from memmode_core.engine.streams import active

    active().synchronize(device)
    began = time.perf_counter()
    with torch.no_grad():
        out = model(**inputs)[0]
    active().synchronize(device)
    return out.float().cpu(), time.perf_counter() - began


def make_models(args, count: int):
    models = [
        wan_transformer(heads=args.heads, head_dim=64, layers=args.layers, seed=s, dtype=torch.bfloat16)
        for s in range(count)
    ]
    inputs = [wan_inputs(m, frames=1, height=32, width=32) for m in models]
    alone = []
    for model, x in zip(models, inputs):  # each alone on the device, without memmode: the reference
        with torch.no_grad():
            alone.append(
                model.to(args.device)(**{k: v.to(args.device) if torch.is_tensor(v) else v for k, v in x.items()})[0]
                .float()
                .cpu()
            )
        model.to("cpu")
    inputs = [{k: v.to(args.device) if torch.is_tensor(v) else v for k, v in x.items()} for x in inputs]
    return models, inputs, alone


def two_models(args, other: OtherApplication) -> dict:
    models, inputs, alone = make_models(args, 2)
    size = parameter_bytes(models[0])
    other.hold(max(free_bytes(args.device) - size * 3 // 2, 0))
    handles = [memmode.apply(m, "model_group_offload", device=args.device, vram_budget=size) for m in models]
    reset_peak(args.device)
    rows = []
    for round_ in range(args.rounds):
        for k, (model, x, want) in enumerate(zip(models, inputs, alone)):
            handles[k].reset_stats()
            got, seconds = timed_call(model, x, args.device)
            rows.append(
                {
                    "round": round_,
                    "model": k,
                    "seconds": seconds,
                    "equal": bool(torch.equal(got, want)),
                    "moved": handles[k].report().bytes_transferred,
                }
            )
    result = {
        "model_bytes": size,
        "calls": rows,
        "max_memory_allocated": peak(args.device),
        "room": size * 3 // 2,
        "evictions": [h.report().evictions for h in handles],
    }
    for h in handles:
        h.remove()
    other.release()
    return result


def shrinking(args, other: OtherApplication) -> dict:
    (transformer,), (x,), (want,) = make_models(args, 1)
    size, model = parameter_bytes(transformer), OnePipeline(transformer)
    handle = memmode.apply(model, "model_group_offload", device=args.device, vram_budget=size)
    first, seconds_alone = timed_call(model, x, args.device)
    other.hold(max(free_bytes(args.device) - size * 6 // 10, 0))
    reset_peak(args.device)
    rows = []
    for _ in range(args.rounds):
        handle.reset_stats()
        got, seconds = timed_call(model, x, args.device)
        report = handle.report()
        rows.append(
            {
                "seconds": seconds,
                "equal": bool(torch.equal(got, want)),
                "moved": report.bytes_transferred,
                "peak_device_bytes": report.peak_device_bytes,
            }
        )
    result = {
        "model_bytes": size,
        "first_call_equal": bool(torch.equal(first, want)),
        "calls": rows,
        "seconds_with_room": seconds_alone,
        "max_memory_allocated": peak(args.device),
        "room": size * 6 // 10,
        "evictions": handle.report().evictions,
    }
    handle.remove()
    other.release()
    return result


def refused_onloads(args, strict) -> dict:
    (transformer,), (x,), (want,) = make_models(args, 1)
    size, model = parameter_bytes(transformer), OnePipeline(transformer)
    handle = memmode.apply(model, "model_group_offload", device=args.device, vram_budget=size)
    timed_call(model, x, args.device)
    if strict is not None:
        strict.capacity.fail_allocations(1)
    else:  # the allocator refuses past 40% of the model more than it holds now: the free memory says otherwise
        total = torch.cuda.get_device_properties(args.device).total_memory
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + size * 4 // 10) / total)
    try:
        handle.reset_stats()
        got, seconds = timed_call(model, x, args.device)
        outcome = {"equal": bool(torch.equal(got, want)), "seconds": seconds}
    except memmode.DeviceMemoryError as error:
        outcome = {"error": str(error)}
    finally:
        if strict is None:
            torch.cuda.set_per_process_memory_fraction(1.0)
    report = handle.report()
    handle.remove()
    return {"model_bytes": size, **outcome, "recoveries": report.recoveries, "evictions": report.evictions}


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--strict", action="store_true", help="on the CPU, under the strict model with a capacity")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    strict = None
    with contextlib.ExitStack() as stack:
        if args.strict:
            from memmode_core.engine.streams import installed
            from memmode_core.testing import StrictStreams

            args.device = "cpu"
            strict = stack.enter_context(installed(StrictStreams(seed=0, total_memory=4 << 30)))
        args.device = torch.device(args.device)
        other = OtherApplication(strict)
        results = {}
        for name, scenario in (
            ("two_models", lambda: two_models(args, other)),
            ("shrinking", lambda: shrinking(args, other)),
            ("refused_onloads", lambda: refused_onloads(args, strict)),
        ):
            results[name] = scenario()
            print(name, json.dumps(results[name], indent=1, default=str)[:3000], flush=True)
        if strict is not None:
            strict.check()
            results["strict"] = {
                "peak_used": strict.capacity.peak_used,
                "total": strict.capacity.total,
                "refused": strict.capacity.refused,
            }
            print("strict", results["strict"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
