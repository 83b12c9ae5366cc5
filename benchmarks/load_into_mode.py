"""Loading straight into a mode on the CPU: memmode ``load`` against ``from_pretrained`` and then offloading.

A Wan-shaped transformer (diffusers ``WanTransformer3DModel`` with the Wan 2.1 1.3B config: hidden size
1536, feed-forward 8960, 30 blocks, text dim 4096; about 2.8 GB in bfloat16, random weights) is saved
once with ``save_pretrained`` into a cache folder, in bfloat16 and in float32. Each variant then runs
in a fresh process of its own: it loads the folder into block-level group offload (one block per
group, everything on the CPU) its own way and runs one forward on tiny inputs (batch 1, two latent
frames of 4 x 4, eight text tokens). Variants:

- ``diffusers_group_disk``: ``from_pretrained(torch_dtype=bf16)`` + ``enable_group_offload(...,
  offload_to_disk_path=...)``; the reference of every ratio;
- ``diffusers_cpu_offload``: ``from_pretrained`` alone. A single model has no
  ``enable_model_cpu_offload`` (it is a pipeline method), and on a CPU device model CPU offload moves
  nothing: the whole model sits in RAM, which is what this variant measures;
- ``memmode_apply_disk`` / ``apply_qfloat8_disk``: ``from_pretrained`` + ``memmode_core.apply`` (today's
  path), with ``model_group_offload`` and ``model_group_offload_and_qfloat8``, ``disk`` storage;
- ``load_mmap`` / ``load_disk`` / ``load_ram`` / ``load_qfloat8_disk``: ``memmode_core.load(folder, mode,
  torch_dtype=bf16, ...)`` with that storage. On a CPU compute device a checkpoint from ``save_pretrained``
  (tensors 8-byte aligned) is written to the storage's files, so that outputs are bit-equal to
  ``from_pretrained`` + ``apply``;
- ``load_mmap_in_place`` / ``load_disk_in_place``: the same with ``in_place=True``: the checkpoint's own
  pages are the offloaded copy and nothing is written — what every load on a CUDA device does (where an
  onload copies anyway); on the CPU, outputs can then differ in the last bits;
- ``..._f32``: the float32 checkpoint loaded as bfloat16 (the conversion path), diffusers' and
  ``load_disk``; their ratios are against ``diffusers_group_disk_f32``;
- ``load_qfloat8_disk_on_cuda`` / ``load_qfloat8_pinned_on_cuda`` (only where CUDA is available): quantizing
  while loading with a CUDA compute device, where each layer is packed on the GPU (uploaded, packed, the
  packed bytes brought back) instead of on the CPU; their ratios are against ``load_qfloat8_disk`` (packing on
  the CPU). The forward runs on the GPU, so their output digest is not comparable with the CPU variants'.

In each worker a thread reads ``/proc/self/status`` every 20 ms; reported: the peak ``RssAnon``
(anonymous memory: what the process allocated, not the page cache it maps; ``RssFile`` is recorded
too), the wall time of the load alone (up to the mode being in place), and the time to first output
(from the start of the load to the end of the forward; imports excluded, they are the same for
all). The largest group is the bytes of one transformer block in bfloat16, read from the checkpoint's
header; the load peak is also given above the worker's baseline (its ``RssAnon`` after imports, before
the load) as a multiple of that group. Rounds are interleaved (every round runs each variant once, in a
rotating order) after one untimed warm-up round; the page cache cannot be dropped without root, so
the checkpoint is hot in it: these are warm-cache figures. Targets (issue 15): ``load_mmap`` and
``load_disk`` peak RssAnon <= 0.25x diffusers' and (above baseline) <= 2x the largest group; time to
first output <= 1.0x diffusers'; ``load_qfloat8_disk`` peak <= 0.3x diffusers'.

    python benchmarks/load_into_mode.py [--rounds 3] [--cache /tmp/memmode-load-bench] [--variants a,b]
    python benchmarks/load_into_mode.py --quick      # a small model, one round: a smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _models import fill_like_initialised, flags, released_wan_config

#: variant -> (checkpoint: "bf16" / "f32", reference variant of its ratios)
VARIANTS = {
    "diffusers_group_disk": ("bf16", "diffusers_group_disk"),
    "diffusers_cpu_offload": ("bf16", "diffusers_group_disk"),
    "memmode_apply_disk": ("bf16", "diffusers_group_disk"),
    "load_mmap": ("bf16", "diffusers_group_disk"),
    "load_disk": ("bf16", "diffusers_group_disk"),
    "load_mmap_in_place": ("bf16", "diffusers_group_disk"),
    "load_disk_in_place": ("bf16", "diffusers_group_disk"),
    "load_ram": ("bf16", "diffusers_group_disk"),
    "load_qfloat8_disk": ("bf16", "diffusers_group_disk"),
    "apply_qfloat8_disk": ("bf16", "diffusers_group_disk"),
    "diffusers_group_disk_f32": ("f32", "diffusers_group_disk_f32"),
    "load_disk_f32": ("f32", "diffusers_group_disk_f32"),
    "load_qfloat8_disk_on_cuda": ("bf16", "load_qfloat8_disk"),
    "load_qfloat8_pinned_on_cuda": ("bf16", "load_qfloat8_disk"),
}
#: variants that compute on a CUDA device (left out of the default list where there is none)
ON_CUDA = tuple(v for v in VARIANTS if v.endswith("_on_cuda"))
#: variant -> (peak RssAnon ratio at most, time ratio at most, peak above baseline in groups at most)
TARGETS = {
    "load_mmap": (0.25, 1.0, 2.0),
    "load_disk": (0.25, 1.0, 2.0),
    "load_mmap_in_place": (0.25, 1.0, 2.0),
    "load_disk_in_place": (0.25, 1.0, 2.0),
    "load_qfloat8_disk": (0.30, None, None),
}
SAMPLE_S = 0.020


def wan_config(quick: bool, layers: int = 30) -> dict:
    """Wan 2.1 1.3B's transformer config with ``layers`` blocks (``--quick``: a tiny one of the same shape)."""
    if quick:
        return released_wan_config(
            heads=2, layers=4, ffn_dim=512, text_dim=256, attention_head_dim=64, eps=1e-6, rope_max_seq_len=1024
        )
    return released_wan_config(heads=12, layers=layers, ffn_dim=8960, eps=1e-6, rope_max_seq_len=1024)


# -- the checkpoints, built once ------------------------------------------------------------------------


def prepare(cache: Path, config: dict) -> dict[str, Path]:
    """``cache/<config hash>/{bf16,f32}``, saved with ``save_pretrained`` (reused when complete)."""
    digest = hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]
    base = cache / f"wan-{digest}"
    folders = {"bf16": base / "bf16", "f32": base / "f32"}
    if (base / "complete").is_file():
        return folders
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    print(f"building the checkpoints in {base} (once) ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, __file__, "--build", str(base), "--config", json.dumps(config)], check=True)
    (base / "complete").write_text("ok\n")
    return folders


def build(base: Path, config: dict) -> None:
    """Random weights (scaled like an initialised model), written in bfloat16 and then float32."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    with torch.device("meta"):
        model = WanTransformer3DModel(**config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            fill_like_initialised(name, param)
        real = dict(WanTransformer3DModel(**{**config, "num_layers": 1}).named_buffers())
        for name, buffer in model.named_buffers():
            buffer.copy_(real[name])
    model.save_pretrained(base / "bf16")
    model = model.float()  # every value is bf16-exact: converting back gives the bf16 model bit for bit
    model.save_pretrained(base / "f32")


def checkpoint_sizes(folder: Path) -> tuple[int, int, int]:
    """(all weights, the largest block, the rest: embedders and head), in bytes of bfloat16."""
    from safetensors import safe_open

    total, blocks = 0, {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                numel = 1
                for d in f.get_slice(key).get_shape():
                    numel *= d
                total += numel * 2
                if key.startswith("blocks."):
                    index = key.split(".")[1]
                    blocks[index] = blocks.get(index, 0) + numel * 2
    largest = max(blocks.values())
    return total, largest, total - sum(blocks.values())


# -- worker: one variant, in a fresh process --------------------------------------------------------------


def read_status(pid: int | str = "self") -> tuple[int, int]:
    """(RssAnon, RssFile) of process ``pid``, in bytes."""
    anon = file = 0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
            elif line.startswith("RssFile:"):
                file = int(line.split()[1]) * 1024
    return anon, file


class Sampler(threading.Thread):
    """Peak ``RssAnon`` and ``RssFile`` of this process since the last :meth:`reset`."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.reset()

    def reset(self) -> None:
        self.peak_anon, self.peak_file = read_status()

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            anon, file = read_status()
            self.peak_anon, self.peak_file = max(self.peak_anon, anon), max(self.peak_file, file)

    def take(self) -> tuple[int, int]:
        anon, file = read_status()
        return max(self.peak_anon, anon), max(self.peak_file, file)


def worker(args: argparse.Namespace) -> None:
    import diffusers  # everything imported in every variant: the same baseline for all
    import torch
    from diffusers import WanTransformer3DModel

    import memmode_core

    diffusers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    variant, folder, workdir = args.variant, Path(args.folder), Path(args.workdir)
    config = json.loads((folder / "config.json").read_text())
    generator = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16
    inputs = dict(
        hidden_states=torch.randn(
            1, config["in_channels"], args.frames, args.height, args.width, generator=generator
        ).to(bf16),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, args.text_tokens, config["text_dim"], generator=generator).to(bf16),
        return_dict=False,
    )
    sampler = Sampler()
    sampler.start()
    time.sleep(2 * SAMPLE_S)
    baseline_anon, baseline_file = read_status()
    sampler.reset()
    name = variant.removesuffix("_f32").removesuffix("_on_cuda")
    device = torch.device("cuda" if variant in ON_CUDA else "cpu")
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    began = time.perf_counter()
    if name.startswith("diffusers_"):
        model = WanTransformer3DModel.from_pretrained(folder, torch_dtype=bf16).eval()
        if name == "diffusers_group_disk":
            model.enable_group_offload(
                onload_device=torch.device("cpu"),
                offload_device=torch.device("cpu"),
                offload_type="block_level",
                num_blocks_per_group=1,
                offload_to_disk_path=str(workdir),
            )
    elif name in ("memmode_apply_disk", "apply_qfloat8_disk"):
        model = WanTransformer3DModel.from_pretrained(folder, torch_dtype=bf16).eval()
        mode = "model_group_offload" if name == "memmode_apply_disk" else "model_group_offload_and_qfloat8"
        memmode_core.apply(model, mode, device="cpu", storage="disk", offload_dir=str(workdir))
    else:
        in_place = True if name.endswith("_in_place") else None
        storage = name.removesuffix("_in_place").rsplit("_", 1)[1]
        mode = "model_group_offload_and_qfloat8" if "qfloat8" in name else "model_group_offload"
        handle = memmode_core.load(
            folder,
            mode,
            device=device,
            storage=storage,
            torch_dtype=bf16,
            offload_dir=None if storage == "ram" else str(workdir),
            staging_dir=str(workdir),
            in_place=in_place,
        )
        model = handle.target
    loaded = time.perf_counter()
    after_anon, _ = read_status()  # what stays held once the mode is in place (before any forward)
    load_anon, load_file = sampler.take()
    with torch.inference_mode():
        out = model(**inputs)[0].cpu()
    done = time.perf_counter()
    peak_anon, peak_file = sampler.take()
    sampler.stop.set()
    digest = hashlib.sha1(out.float().contiguous().numpy().tobytes()).hexdigest()[:12]
    print(
        "RESULT "
        + json.dumps(
            {
                "variant": variant,
                "load_s": loaded - began,
                "first_output_s": done - began,
                "baseline_anon": baseline_anon,
                "baseline_file": baseline_file,
                "load_peak_anon": load_anon,
                "after_anon": after_anon,
                "peak_anon": peak_anon,
                "peak_file": max(peak_file, load_file),
                "output": digest,
                "memmode": str(Path(memmode_core.__file__).parent.parent),
            }
        ),
        flush=True,
    )


# -- driver ----------------------------------------------------------------------------------------------


def run_variant(variant: str, folder: Path, scratch: Path, args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"{variant}-", dir=scratch))
    try:
        argv = [
            sys.executable,
            __file__,
            "--variant",
            variant,
            "--folder",
            str(folder),
            "--workdir",
            str(workdir),
            *flags(args, "threads", "frames", "height", "width", "text_tokens"),
        ]
        done = subprocess.run(argv, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"{variant} failed (exit code {done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(lines[-1][len("RESULT ") :])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and one round: a smoke run")
    parser.add_argument(
        "--cache",
        default=str(Path(tempfile.gettempdir()) / "memmode-load-bench"),
        help="where the checkpoints are saved (reused) and the variants write their files; on a disk, not tmpfs",
    )
    parser.add_argument(
        "--variants", default=None, help="comma-separated subset (default: all; the _on_cuda ones where CUDA is)"
    )
    parser.add_argument(
        "--layers", type=int, default=30, help="transformer blocks (30: Wan 2.1 1.3B, 2.84 GB in bf16; 22: 2.09 GB)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    parser.add_argument("--frames", type=int, default=2, help="latent frames")
    parser.add_argument("--height", type=int, default=4, help="latent height (4 x 4, 2 frames: 8 tokens)")
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--text-tokens", type=int, default=8)
    parser.add_argument("--save", default=None, help="also write every run's figures to this JSON file")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--build", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build is not None:
        build(Path(args.build), json.loads(args.config))
        return
    if args.variant is not None:
        worker(args)
        return

    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    import torch

    if args.variants is None:
        variants = [v for v in VARIANTS if v not in ON_CUDA or torch.cuda.is_available()]
    else:
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if any(v in ON_CUDA for v in variants) and not torch.cuda.is_available():
        parser.error(f"{', '.join(v for v in variants if v in ON_CUDA)} need a CUDA device; this process has none")
    cache = Path(args.cache)
    folders = prepare(cache, wan_config(args.quick, args.layers))
    scratch = Path(tempfile.mkdtemp(prefix="run-", dir=cache))
    results: dict[str, list[dict]] = {v: [] for v in variants}
    started = time.perf_counter()
    try:
        for round_index in range(rounds + 1):  # round 0: the untimed warm-up
            shift = round_index % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                result = run_variant(variant, folders[VARIANTS[variant][0]], scratch, args)
                label = "warm-up" if round_index == 0 else f"round {round_index}"
                print(
                    f"{label:>8} {variant:<26} load {result['load_s']:7.2f} s, first output "
                    f"{result['first_output_s']:7.2f} s, peak RssAnon {result['peak_anon'] / 2**30:6.2f} GiB",
                    file=sys.stderr,
                    flush=True,
                )
                if round_index > 0:
                    results[variant].append(result)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.save:
        Path(args.save).write_text(json.dumps({"rounds": rounds, "results": results}, indent=1))
    report(results, folders, args, rounds, time.perf_counter() - started)


def report(results: dict[str, list[dict]], folders: dict[str, Path], args, rounds: int, seconds: float) -> None:
    total, group, rest = checkpoint_sizes(folders["bf16"])
    config = json.loads((folders["bf16"] / "config.json").read_text())
    gib = 2**30

    def median(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in results[variant])

    def spread(variant: str, key: str, scale: float = 1.0, fmt: str = ".2f") -> str:
        values = [r[key] / scale for r in results[variant]]
        return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"

    print(
        f"\nWan-shaped transformer: hidden {config['num_attention_heads'] * config['attention_head_dim']}, "
        f"ffn {config['ffn_dim']}, {config['num_layers']} blocks, {total / 1e9:.2f} GB in bf16 (f32 checkpoint "
        f"{2 * total / 1e9:.2f} GB); largest group (one block) {group / 2**20:.0f} MiB, the rest {rest / 2**20:.0f} "
        f"MiB; CPU, {args.threads} threads; inputs {args.frames}x{args.height}x{args.width} latent, "
        f"{args.text_tokens} text tokens; median (min–max) of {rounds} interleaved rounds after a warm-up, "
        f"checkpoint hot in the page cache; {seconds / 60:.1f} min\n"
    )
    print(
        "| variant | load s | first output s | × ref | peak RssAnon GiB | × ref | peak over baseline MiB "
        "| × group | held after, over baseline MiB | peak RssFile GiB | target |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    all_met = True
    for variant, runs in results.items():
        if not runs:
            continue
        reference = VARIANTS[variant][1]
        have_ref = bool(results.get(reference))
        t_ratio = median(variant, "first_output_s") / median(reference, "first_output_s") if have_ref else None
        a_ratio = median(variant, "peak_anon") / median(reference, "peak_anon") if have_ref else None
        over = statistics.median(r["peak_anon"] - r["baseline_anon"] for r in runs)
        held = statistics.median(r.get("after_anon", r["baseline_anon"]) - r["baseline_anon"] for r in runs)
        groups = over / group
        verdict = ""
        if variant in TARGETS and have_ref:
            max_anon, max_time, max_groups = TARGETS[variant]
            checks = [(f"RSS ≤ {max_anon}×", a_ratio <= max_anon)]
            if max_time is not None:
                checks.append((f"time ≤ {max_time}×", t_ratio <= max_time))
            if max_groups is not None:
                checks.append((f"≤ {max_groups:g} groups", groups <= max_groups))
            all_met &= all(ok for _, ok in checks)
            verdict = ", ".join(f"{text} {'met' if ok else 'MISSED'}" for text, ok in checks)

        def ratio(x):
            return f"{x:.2f}" if x is not None else "—"

        print(
            f"| {variant} | {spread(variant, 'load_s')} | {spread(variant, 'first_output_s')} | {ratio(t_ratio)} "
            f"| {spread(variant, 'peak_anon', gib)} | {ratio(a_ratio)} | {over / 2**20:.0f} | {groups:.1f} "
            f"| {held / 2**20:.0f} | {median(variant, 'peak_file') / gib:.2f} | {verdict} |"
        )
    baseline = statistics.median(r["baseline_anon"] for runs in results.values() for r in runs)
    print(
        f"\nbaseline RssAnon of a worker after imports, before the load: {baseline / gib:.2f} GiB; ratios of the "
        f"_f32 variants are against diffusers_group_disk_f32, the others against diffusers_group_disk"
    )
    outputs: dict[str, list[str]] = {}
    for variant, runs in results.items():
        for digest in {r["output"] for r in runs}:
            outputs.setdefault(digest, []).append(variant)
    print("bit-equal outputs: " + "; ".join(" = ".join(names) for names in outputs.values()))
    print("memmode_core from: " + ", ".join(sorted({r["memmode"] for runs in results.values() for r in runs})))
    print("all targets met" if all_met else "SOME TARGETS MISSED")


if __name__ == "__main__":
    main()
