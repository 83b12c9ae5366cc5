"""Disk-backed block-level group offload on the CPU: memmode ``disk`` and ``mmap`` against diffusers'
``apply_group_offloading(..., offload_to_disk_path=...)``.

The same Wan-shaped transformer (about 0.5 GB of float32 weights, random, built in code) is offloaded
one block per group to files by each variant, and run forward on the CPU; a fourth variant, the
model with its weights in RAM and no offloading, is the floor. The default input is
``_models.wan_inputs``' (a 16 x 16 latent, 64 tokens): small enough that moving weights, not
compute, decides the time, as it does for a large model on a small GPU. Every variant lives in a
fresh worker process of its own, so that its anonymous memory is its own; the driver interleaves
them, one forward each per round (in a rotating order), so that machine noise hits them alike, and
samples each worker's ``RssAnon`` from ``/proc`` while it computes. The files are hot in the page
cache, as they are from the second step of a pipeline on.

Reported per variant: the median forward time, the peak ``RssAnon`` during forwards (anonymous
memory: what the process itself allocated, not the page cache it maps), their ratios to diffusers',
the median CPU time of the worker per forward (less sensitive than wall time to other processes
on a shared machine; run with ``--threads 1`` there, where idle OpenMP threads spin), and the
issue-4 targets: ``disk`` at most 1.0x diffusers' time and 1.1x its RSS, ``mmap`` at most
0.95x its time and below its RSS.

With ``--quantize torchao-int8`` the transformer is first quantized in memory by torchao (``quantize_`` with
``Int8WeightOnlyConfig``: every linear weight a tensor subclass, stored by memmode by its inner tensors), and two
variants join, in RAM: memmode ``ram`` and diffusers' group offloading without files (what
``enable_group_offload`` does). A variant that cannot run the model says why instead of a row.

    python benchmarks/disk_offload.py [--rounds 25] [--layers 9] [--height 32 --width 32] [--threads 1] [--dir PATH]
                                      [--quantize torchao-int8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _models import flags

VARIANTS = ("no offload", "diffusers disk", "memmode disk", "memmode mmap")
#: the variants that join for a model quantized in memory (``--quantize``)
IN_RAM = ("diffusers ram", "memmode ram")
REFERENCE = "diffusers disk"
#: (variant, time ratio at most, RSS ratio at most, RSS ratio strictly below)
TARGETS = {"memmode disk": (1.0, 1.1, False), "memmode mmap": (0.95, 1.0, True)}


# -- worker: one variant, in its own process -----------------------------------------------------------


def worker(variant: str, args: argparse.Namespace) -> None:
    import torch
    from _models import parameter_bytes, wan_inputs, wan_transformer

    torch.set_num_threads(args.threads)
    model = wan_transformer(heads=args.heads, head_dim=128, layers=args.layers)
    inputs = wan_inputs(model, frames=1, height=args.height, width=args.width, text_tokens=args.text_tokens)
    weight_bytes = parameter_bytes(model)
    if args.quantize == "torchao-int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        from memmode_core.contracts.inner_tensors import stored_bytes
        from memmode_core.files.streamed import give_back_freed_memory

        quantize_(model, Int8WeightOnlyConfig())
        weight_bytes = sum(stored_bytes(t) for t in [*model.parameters(), *model.buffers()])
        give_back_freed_memory()  # the float weights quantize_ freed, in every variant: RssAnon compares placements
    folder = Path(args.dir) / variant.replace(" ", "-")
    folder.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    handle = None
    if variant == "no offload":
        pass  # the floor: the same model with its weights in RAM
    elif variant.startswith("diffusers"):
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(
            model,
            onload_device=torch.device("cpu"),
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            offload_to_disk_path=str(folder) if variant == "diffusers disk" else None,
        )
    else:
        import memmode_core as memmode

        handle = memmode.apply(
            model,
            "model_group_offload",
            device="cpu",
            storage=variant.split()[1],
            **({} if variant == "memmode ram" else {"offload_dir": str(folder)}),
            offload_type="block_level",
            num_blocks_per_group=1,
        )
    applied = time.perf_counter() - began
    with torch.inference_mode():
        model(**inputs)  # warm-up: first-call work (diffusers writes its files lazily)
        _send({"ready": True, "apply_s": applied, "weight_bytes": weight_bytes})
        for line in sys.stdin:
            if line.strip() != "run":
                break
            start, cpu = time.perf_counter(), time.process_time()
            model(**inputs)
            _send({"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu})
    if handle is not None:
        handle.remove()


def _send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


# -- driver ----------------------------------------------------------------------------------------------


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc status")


class Worker:
    def __init__(self, variant: str, argv: list[str]) -> None:
        self.variant = variant
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", variant, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parent,
        )
        self.ready = self._receive()
        self.idle_anon = rss_anon(self.process.pid)
        self.peak_anon = self.idle_anon
        self.times: list[float] = []
        self.cpu_times: list[float] = []

    def _receive(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.variant!r} died (exit code {self.process.wait()})")
        return json.loads(line)

    def run_once(self) -> None:
        done = threading.Event()
        peak = [0]

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], rss_anon(self.process.pid))
                time.sleep(0.0005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        measured = self._receive()
        self.times.append(measured["seconds"])
        self.cpu_times.append(measured["cpu_seconds"])
        done.set()
        sampler.join()
        self.peak_anon = max(self.peak_anon, peak[0])

    def close(self) -> None:
        self.process.stdin.write("quit\n")
        self.process.stdin.close()
        self.process.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--heads", type=int, default=8, help="attention heads of 128 dims (8: hidden size 1024)")
    parser.add_argument("--layers", type=int, default=9, help="transformer blocks (9 x 8 heads: ~0.55 GB float32)")
    parser.add_argument("--height", type=int, default=16, help="latent height (16 x 16: 64 tokens)")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--text-tokens", type=int, default=16)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per worker (one: the least noise on a shared machine, where idle OpenMP threads spin)",
    )
    parser.add_argument(
        "--dir",
        default=None,
        help="where the variants write their files (default: a temporary "
        "folder on TMPDIR; it should be on a disk, not tmpfs)",
    )
    parser.add_argument(
        "--quantize",
        choices=("none", "torchao-int8"),
        default="none",
        help="quantize the transformer in memory first (torchao int8 weight-only), and add the variants in RAM",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args)
        return

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="memmode-disk-bench-"))
    argv = [
        *flags(args, "heads", "layers", "height", "width", "text_tokens", "threads", "quantize"),
        "--dir",
        str(base),
    ]
    workers: list[Worker] = []
    failed: dict[str, str] = {}
    try:
        for variant in VARIANTS + (IN_RAM if args.quantize != "none" else ()):
            print(f"starting {variant} ...", file=sys.stderr, flush=True)
            try:
                workers.append(Worker(variant, argv))
            except RuntimeError as exc:  # its traceback is on stderr
                failed[variant] = str(exc)
        for round_index in range(args.rounds):
            shift = round_index % len(workers)
            for w in workers[shift:] + workers[:shift]:
                w.run_once()
        report(workers, args, failed)
    finally:
        for w in workers:
            if w.process.poll() is None:
                w.close()
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


def report(workers: list[Worker], args: argparse.Namespace, failed: dict[str, str]) -> None:
    by_name = {w.variant: w for w in workers}
    reference = by_name.get(REFERENCE, by_name["no offload"])
    ref_time, ref_anon = statistics.median(reference.times), reference.peak_anon
    ref_cpu = statistics.median(reference.cpu_times)
    weights = reference.ready["weight_bytes"]
    kind = "float32" if args.quantize == "none" else f"{args.quantize} (inner tensors)"
    print(
        f"\nWan-shaped transformer, {weights / 1e9:.2f} GB {kind}, {args.layers} blocks, block-level, one block "
        f"per group; CPU, {args.threads} threads; latent 1x{args.height}x{args.width}, {args.text_tokens} text "
        f"tokens; median of {args.rounds} interleaved forwards, page cache hot\n"
    )
    against = "x diffusers" if reference.variant == REFERENCE else "x no offload"
    header = (
        f"{'variant':<16} {'apply s':>8} {'forward s':>10} {against:>12} {'peak RssAnon MiB':>17} "
        f"{against:>12} {'CPU s':>7} {against:>12}  target"
    )
    print(header)
    print("-" * len(header))
    all_met = True
    for w in workers:
        median, cpu = statistics.median(w.times), statistics.median(w.cpu_times)
        time_ratio, anon_ratio = median / ref_time, w.peak_anon / ref_anon
        verdict = ""
        if w.variant in TARGETS and reference.variant == REFERENCE:
            max_time, max_anon, strictly = TARGETS[w.variant]
            met = time_ratio <= max_time and (anon_ratio < max_anon if strictly else anon_ratio <= max_anon)
            all_met &= met
            verdict = (
                f"time <= {max_time:.2f}x, RSS {'<' if strictly else '<='} {max_anon:.2f}x: "
                f"{'met' if met else 'MISSED'}"
            )
        print(
            f"{w.variant:<16} {w.ready['apply_s']:>8.2f} {median:>10.4f} {time_ratio:>11.3f}x "
            f"{w.peak_anon / 2**20:>17.0f} {anon_ratio:>11.3f}x {cpu:>7.3f} {cpu / ref_cpu:>11.3f}x  {verdict}"
        )
    for variant, why in failed.items():
        print(f"{variant:<16} did not run: {why}")
    print("\nidle RssAnon after apply (MiB): " + ", ".join(f"{w.variant} {w.idle_anon / 2**20:.0f}" for w in workers))
    if reference.variant == REFERENCE:
        print("all targets met" if all_met else "SOME TARGETS MISSED")


if __name__ == "__main__":
    main()
