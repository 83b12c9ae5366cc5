"""Community checkpoints (GGUF files) at the size users run them: planning, the dequantizing forward, loading and
offloading, memmode side by side with what users would use instead.

The GGUF files are made here (:mod:`_community_files`): a Wan transformer's tensors under the original checkpoint's
names, in a type mix like city96's / QuantStack's files (small and 1-D tensors F32; in ``Q4_K_M`` the matrices
``Q4_K`` and every other block's feed-forward down projection ``Q6_K``), either *sparse* (a real header, its data
a hole: no disk, for ``plan``, which reads headers only) or filled with random valid blocks (small scales, so that
outputs stay finite). Nothing is downloaded. Sub-commands (each prints a table, or ``--json``):

- ``plan``: the sparse Wan 2.2 A14B pipeline folder of ``plan_real_size.py`` (two 14B experts, UMT5-XXL, the Wan
  VAE) and two sparse ``Q4_K_M`` GGUF experts; ``memmode plan --model DIR --transformer A --transformer-2 B --vram
  12GiB --height 480 --width 832 --num-frames 81`` runs in a child process, and its wall time and peak ``RssAnon``
  (sampled from ``/proc`` every 20 ms) are reported with the plan's table as memmode prints it, and each GGUF's
  size against the bf16 expert's. ``--quick``: a 2-block, 256-wide Wan in the tiny demo pipeline, in seconds.

- ``forward``: one linear layer's forward per GGML type (``--types``, default ``Q8_0,Q4_K,Q6_K,IQ4_NL,IQ4_XS``),
  batch of ``--tokens`` (512) tokens, compute dtype bfloat16 and float32, at ``--sizes`` (default 3072x3072 and
  5120x13824, out x in). The weight is one GGUF file's bytes (random valid blocks); the *same* bytes are fed to
  memmode's packed layer (``QuantizedLinear.forward``, the layer ``memmode.load`` makes of a GGUF weight:
  ``attach_packed`` + ``install_forward`` with memmode-gguf's codec; it decodes to float32, bit-equal to gguf-py,
  then casts) and to diffusers' ``GGUFLinear``
  (what ``from_single_file(..., quantization_config=GGUFQuantizationConfig(...))`` puts in place of a linear; on the
  CPU its forward is ``forward_native``: ``dequantize_gguf_tensor`` in float16, then a cast to the compute dtype).
  "dense" is ``F.linear`` with the weight already decoded: the floor both sit on. Figures: ms per call, median
  (min–max) over interleaved rounds (every round runs each variant ``--calls`` times, in a rotating order), and the
  per-round ratio memmode / diffusers; "max diff" is memmode's output against diffusers', relative to the output's
  largest value (diffusers rounds the scales' products in float16). A type diffusers' torch path does not decode
  (the grid i-quants IQ1_S to IQ3_S) runs memmode alone, its "max diff" against the dense layer of gguf-py's values.

- ``load``: a Wan 14B-shaped transformer (40 heads, 40 blocks, ffn 13824; ``--layers`` to shrink it: 2 blocks are
  a 1 GB file; ``--quick``: a 2-block, 256-wide one, a smoke run in seconds) as a ``Q8_0`` GGUF of random valid
  blocks (about 15 GB at 40 blocks), written once into ``--cache`` and reused (hot in the page cache: warm-cache
  figures, as the page cache cannot be dropped without root). Each variant loads the file in a fresh process of its
  own, then runs one forward at a small input (``_models.wan_inputs`` in bfloat16, 1 frame of 16 x 16 latents, 16
  text tokens): ``memmode``: ``memmode.load(file, "model_group_offload", config=folder,
  storage="mmap", offload_dir=..., torch_dtype=torch.bfloat16)``; ``diffusers``: ``WanTransformer3DModel.
  from_single_file(file, config=folder, quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16),
  torch_dtype=torch.bfloat16)`` (a full load, on the CPU). Reported: load time and time to first output (from the
  start of the load to the end of the forward, imports excluded), the peaks of ``RssAnon`` and of ``RssAnon +
  RssFile`` over the worker's baseline (after imports, before the load), and those peaks in *groups*: the largest
  group's bytes, one block of the model in ``Q8_0`` (what memmode's host memory is meant to be bounded by). Rounds
  are interleaved after one untimed warm-up round (``--rounds``; ``--quick``: one round, no warm-up).

- ``offload``: time per call of a GGUF-loaded transformer (all via ``memmode.load``) under ``model_group_offload``
  at block and at leaf level (``--storage``, default ``mmap``) and under ``sequential_cpu_offload``, against
  ``model_cpu_offload`` of the same file (on the CPU it moves nothing: the reference, the decoding forward
  alone). Default: a Wan 2.1 1.3B-shaped ``Q8_0`` file (12 heads, 30 blocks, ffn 8960; ``--layers``), small
  inputs; what the differences measure is the hooks' overhead on packed layers. One child process loads every
  variant and runs them interleaved (each round runs each variant ``--calls`` times, rotating order) after a
  warm-up call each; reported: ms per call median (min–max) over rounds, the time added to ``model_cpu_offload``'s
  and the per-round ratio to it; outputs are checked bit-equal to ``model_cpu_offload``'s.

    python benchmarks/community_checkpoints.py plan [--keep DIR] [--json]
    python benchmarks/community_checkpoints.py forward [--types Q8_0,Q4_K,IQ4_XS] [--sizes 3072x3072,5120x13824]
    python benchmarks/community_checkpoints.py load [--layers 40] [--rounds 3] [--cache DIR]
    python benchmarks/community_checkpoints.py offload [--layers 30] [--rounds 10] [--cache DIR]
    python benchmarks/community_checkpoints.py SUBCOMMAND --quick      # small sizes: a smoke run in seconds

Workers run ``--threads`` torch threads (2; ``--quick``: 1). Run the full sizes on a quiet machine: on a 2-core
machine with other jobs running, two threads spin-wait for each other and a call can take 10-100x its time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _community_files import comfy_specs, original_wan_shapes, wan_gguf_specs, write_comfy_file, write_gguf_file
from _models import released_wan_config
from load_into_mode import read_status

SAMPLE_S = 0.020
GIB = 2**30
MIB = 2**20
DEFAULT_CACHE = str(Path(tempfile.gettempdir()) / "memmode-community-bench")


def spread(values: list[float], fmt: str = ".2f", scale: float = 1.0) -> str:
    values = [v / scale for v in values]
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"


def rotated(items: list, index: int) -> list:
    shift = index % len(items)
    return items[shift:] + items[:shift]


def size(nbytes: float) -> str:
    """Bytes in GB, or MB below 1 GB."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def say(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


# -- memory of a process, from /proc ------------------------------------------------------------------------------


class Sampler(threading.Thread):
    """Peak ``RssAnon``, ``RssFile`` and their sum, of process ``pid``, since the last :meth:`reset`."""

    def __init__(self, pid: int | str = "self") -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.stop = threading.Event()
        self.reset()

    def reset(self) -> None:
        anon, file = read_status(self.pid)
        self.peaks = [anon, file, anon + file]

    def _sample(self) -> None:
        anon, file = read_status(self.pid)
        self.peaks = [max(self.peaks[0], anon), max(self.peaks[1], file), max(self.peaks[2], anon + file)]

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            try:
                self._sample()
            except (FileNotFoundError, ProcessLookupError):
                return

    def take(self) -> dict[str, int]:
        try:
            self._sample()
        except (FileNotFoundError, ProcessLookupError):
            pass
        return dict(zip(("anon", "file", "total"), self.peaks))


def child(argv: list[str], what: str) -> str:
    """Run ``argv``; its stdout (a failure raises with the end of its stderr)."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed (exit code {done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout


def worker_argv(job: dict) -> list[str]:
    return [sys.executable, __file__, "--worker", json.dumps(job)]


def worker_result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :])


# -- GGUF files of a Wan transformer, written once ----------------------------------------------------------------


def gguf_sizes(specs: dict) -> tuple[int, int]:
    """(all the tensors' bytes, the largest block's bytes) of a file of ``specs``."""
    import gguf

    total, blocks = 0, {}
    for name, (shape, qtype) in specs.items():
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel // block * size
        total += nbytes
        if name.startswith("blocks."):
            index = name.split(".")[1]
            blocks[index] = blocks.get(index, 0) + nbytes
    return total, max(blocks.values())


def bf16_bytes(config: dict) -> int:
    import torch
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(**config)
    return sum(t.numel() * 2 for t in model.state_dict().values())


def comfy_sizes(specs: dict) -> tuple[int, int]:
    """(all the tensors' bytes, the largest block's bytes) of a ComfyUI file of ``specs``."""
    itemsize = {"BF16": 2, "F32": 4, "I8": 1, "U8": 1, "F8_E4M3": 1}
    total, blocks = 0, {}
    for name, (dtype, shape) in specs.items():
        nbytes = itemsize[dtype]
        for d in shape:
            nbytes *= d
        total += nbytes
        if name.startswith("blocks."):
            index = name.split(".")[1]
            blocks[index] = blocks.get(index, 0) + nbytes
    return total, max(blocks.values())


def cached_comfy(cache: Path, config: dict, fmt: str) -> tuple[Path, Path, dict]:
    """A ComfyUI ``fmt`` file with random values (:func:`cached_file`)."""
    specs = comfy_specs(original_wan_shapes(config), fmt)
    return (*cached_file(cache, config, fmt, ".safetensors", lambda file: write_comfy_file(file, specs, fmt)), specs)


def cached_gguf(cache: Path, config: dict, qtype: str) -> tuple[Path, Path, dict]:
    """A GGUF file of ``qtype`` with random valid blocks (:func:`cached_file`)."""
    specs = wan_gguf_specs(original_wan_shapes(config), qtype)
    return (*cached_file(cache, config, qtype, ".gguf", lambda file: write_gguf_file(file, specs, sparse=False)), specs)


def cached_file(cache: Path, config: dict, kind: str, suffix: str, write) -> tuple[Path, Path]:
    """``cache/wan-<kind>-<hash>/``: the model's config folder and its weights file of ``kind``, written by
    ``write(file)`` (which returns its size) once and reused when complete; (file, config folder)."""
    import torch
    from diffusers import WanTransformer3DModel

    digest = hashlib.sha1(json.dumps([config, kind], sort_keys=True).encode()).hexdigest()[:10]
    base = cache / f"wan-{kind}-{digest}"
    file, folder = base / f"transformer-{kind}{suffix}", base / "transformer"
    if (base / "complete").is_file():
        return file, folder
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    with torch.device("meta"):
        WanTransformer3DModel(**config).save_config(folder)
    say(f"writing {file} (once) ...")
    began = time.perf_counter()
    nbytes = write(file)
    say(f"  {size(nbytes)} in {time.perf_counter() - began:.1f} s")
    (base / "complete").write_text("ok\n")
    return file, folder


def bf16_inputs(model, **sizes) -> dict:
    """``_models.wan_inputs`` in bfloat16 (it takes the dtype of the model's first parameter, which is Wan's
    ``scale_shift_table``, kept in float32)."""
    import torch
    from _models import wan_inputs

    inputs = wan_inputs(model, **sizes)
    return {
        k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inputs.items()
    }


def wan_14b(layers: int) -> dict:
    return released_wan_config(heads=40, layers=layers, ffn_dim=13824, eps=1e-6, rope_max_seq_len=1024)


def wan_1_3b(layers: int) -> dict:
    return released_wan_config(heads=12, layers=layers, ffn_dim=8960, eps=1e-6, rope_max_seq_len=1024)


def wan_small(layers: int = 2, text_dim: int = 256) -> dict:
    """A narrow Wan (hidden 256: two heads of 128, ffn 512) whose rows are still whole 256-value K blocks."""
    return released_wan_config(heads=2, layers=layers, ffn_dim=512, text_dim=text_dim, eps=1e-6, rope_max_seq_len=1024)


# == plan =========================================================================================================


def build_quick_folder(folder: Path) -> tuple[dict, int]:
    """The tiny demo pipeline saved to ``folder``, its two experts replaced by sparse bf16 :func:`wan_small` ones."""
    import diffusers
    import torch
    from diffusers import WanTransformer3DModel
    from plan_real_size import _replace_weights

    from memmode_core.demo import make_demo_pipeline

    diffusers.utils.logging.set_verbosity_error()  # casting a model built on meta to bf16: what is wanted here
    make_demo_pipeline("tiny").save_pretrained(folder)
    text_dim = json.loads((folder / "text_encoder" / "config.json").read_text())["d_model"]
    expert = wan_small(2, text_dim)
    total = 0
    for name in ("transformer", "transformer_2"):
        with torch.device("meta"):
            model = WanTransformer3DModel(**expert).to(torch.bfloat16)
        model.save_config(folder / name)
        total = _replace_weights(folder / name, "diffusion_pytorch_model.safetensors", model)
    return expert, total


def run_plan(args: argparse.Namespace) -> None:
    import plan_real_size

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="wan22-a14b-gguf-"))
    folder, files = work / "pipeline", work / "gguf"
    try:
        began = time.perf_counter()
        if (work / "complete").is_file():
            info = json.loads((work / "complete").read_text())
        else:
            shutil.rmtree(work, ignore_errors=True)
            folder.mkdir(parents=True)
            files.mkdir()
            if args.quick:
                expert, expert_bf16 = build_quick_folder(folder)
            else:
                plan_real_size.build(folder)
                expert = wan_14b(40)
                expert_bf16 = bf16_bytes(expert)
            specs = wan_gguf_specs(original_wan_shapes(expert), args.qtype)
            sizes = {}
            for name in ("transformer", "transformer_2"):
                path = files / f"{name}-{args.qtype}.gguf"
                sizes[name] = {"file": str(path), "bytes": write_gguf_file(path, specs, sparse=True)}
            counts: dict[str, int] = {}
            for _, qtype in specs.values():
                counts[qtype.name] = counts.get(qtype.name, 0) + 1
            info = {"gguf": sizes, "bf16_bytes": expert_bf16, "types": counts}
            (work / "complete").write_text(json.dumps(info))
            say(f"built {work} (sparse) in {time.perf_counter() - began:.1f} s")
        argv = [sys.executable, "-m", "memmode_core", "plan", "--model", str(folder)]
        argv += ["--transformer", info["gguf"]["transformer"]["file"]]
        argv += ["--transformer-2", info["gguf"]["transformer_2"]["file"]]
        argv += ["--vram", args.vram, "--height", str(args.height), "--width", str(args.width)]
        argv += ["--num-frames", str(args.num_frames)] + (["--json"] if args.json else [])
        began = time.perf_counter()
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sampler = Sampler(process.pid)
        sampler.start()
        out, err = process.communicate()
        seconds = time.perf_counter() - began
        sampler.stop.set()
        peak = sampler.peaks[0]
        if process.returncode != 0:
            raise RuntimeError(f"memmode plan failed ({process.returncode}):\n{err[-4000:]}")
        command = "memmode plan " + " ".join(argv[4:]).replace(str(work), "DIR")
        sizes = [
            {"component": name, "gguf_bytes": entry["bytes"], "bf16_bytes": info["bf16_bytes"]}
            for name, entry in info["gguf"].items()
        ]
        if args.json:
            result = {"command": command, "seconds": seconds, "peak_anon": peak, "sizes": sizes}
            result |= {"types": info["types"], "plan": json.loads(out)}
            print(json.dumps(result, indent=1))
            return
        print(f"$ {command}\n")
        print(out.rstrip())
        print(
            f"\nplan: {seconds:.1f} s wall, peak RssAnon {peak / GIB:.2f} GiB (the child process, sampled every 20 ms)"
        )
        print(f"tensor types of each GGUF ({args.qtype}): {', '.join(f'{k} {v}' for k, v in info['types'].items())}\n")
        print("| expert | GGUF bytes | bf16 bytes | GGUF / bf16 | bits per weight |\n|---|---:|---:|---:|---:|")
        for row in sizes:
            ratio = row["gguf_bytes"] / row["bf16_bytes"]
            print(
                f"| {row['component']} | {size(row['gguf_bytes'])} | {size(row['bf16_bytes'])} "
                f"| {ratio:.3f} | {16 * ratio:.2f} |"
            )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


# == forward ======================================================================================================


def packed_pair(path: Path, qtype: str, out_features: int, in_features: int, bias, dtype):
    """memmode's packed layer and diffusers' ``GGUFLinear`` over the same bytes (the file's pages, copy-on-write
    mapped), with the same bias; and the bytes."""
    import numpy as np
    import torch
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter
    from gguf import GGMLQuantizationType
    from torch import nn

    from memmode_core.quantization import install_forward
    from memmode_core.quantization.packed import attach_packed
    from memmode_gguf import GgufReader, codec_for

    contents = GgufReader().read(path)
    stored = contents.stored["w:blocks"]
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=stored.start, shape=tuple(stored.shape))
    blocks = torch.from_numpy(data)
    codec = codec_for(qtype)

    ours = nn.Linear(in_features, out_features, bias=True, device="meta", dtype=dtype)
    attach_packed(
        ours, codec.format_name, torch.Size((out_features, in_features)), dtype, nn.Parameter(blocks, False), {}
    )
    ours.bias = nn.Parameter(bias.clone(), requires_grad=False)
    install_forward(ours, codec, dtype)  # what memmode.load does for a layer the file keeps encoded

    theirs = GGUFLinear(in_features, out_features, bias=True, compute_dtype=dtype, device="meta")
    theirs.weight = GGUFParameter(blocks, quant_type=GGMLQuantizationType[qtype])
    theirs.bias = nn.Parameter(bias.clone(), requires_grad=False)
    return ours.eval(), theirs.eval(), blocks


def run_forward(args: argparse.Namespace) -> None:
    import gguf
    import torch
    import torch.nn.functional as F
    from diffusers.quantizers.gguf.utils import dequantize_functions as diffusers_types
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    from memmode_core.quantization.forward import QuantizedLinear
    from memmode_gguf import dequantize as gguf_dequantize

    torch.set_num_threads(args.threads)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="gguf-forward-"))
    rows = []
    try:
        for qtype in types:
            for out_features, in_features in sizes:
                path = work / f"{qtype}-{out_features}x{in_features}.gguf"
                specs = {"w": ((out_features, in_features), gguf.GGMLQuantizationType[qtype])}
                write_gguf_file(path, specs, sparse=False, seed=1)
                for dtype in dtypes:
                    generator = torch.Generator().manual_seed(0)
                    x = torch.randn(1, args.tokens, in_features, generator=generator).to(dtype)
                    bias = (torch.randn(out_features, generator=generator) * 0.02).to(dtype)
                    ours, theirs, blocks = packed_pair(path, qtype, out_features, in_features, bias, dtype)
                    assert isinstance(ours, QuantizedLinear)
                    # diffusers' torch path decodes only some types (of the i-quants IQ4_NL and IQ4_XS): for the
                    # others memmode runs alone, the dense weight its own decode (gguf-py's values)
                    decodes = gguf.GGMLQuantizationType[qtype] in diffusers_types
                    weight = dequantize_gguf_tensor(theirs.weight) if decodes else gguf_dequantize(blocks, qtype)
                    dense = weight.reshape(out_features, in_features).to(dtype)

                    def run_dense(x=x, dense=dense, bias=bias):
                        return F.linear(x, dense, bias)

                    variants = {"memmode": ours, "diffusers": theirs, "dense": run_dense}
                    if not decodes:
                        del variants["diffusers"]
                    with torch.inference_mode():
                        outputs = {name: call(x) for name, call in variants.items()}  # warm-up, and the outputs
                        times: dict[str, list[float]] = {name: [] for name in variants}
                        for index in range(args.rounds):
                            for name in rotated(list(variants), index):
                                call = variants[name]
                                began = time.perf_counter()
                                for _ in range(args.calls):
                                    call(x)
                                times[name].append((time.perf_counter() - began) / args.calls)
                    reference = outputs["diffusers" if decodes else "dense"].float()
                    diff = (outputs["memmode"].float() - reference).abs().max() / reference.abs().max()
                    row = {
                        "type": qtype,
                        "shape": [out_features, in_features],
                        "dtype": str(dtype).removeprefix("torch."),
                        "ms": {name: [t * 1e3 for t in ts] for name, ts in times.items()},
                        "ratio": [m / d for m, d in zip(times["memmode"], times.get("diffusers", []))],
                        "max_diff": float(diff),
                        "weight_bytes": blocks.numel(),
                    }
                    rows.append(row)
                    say(
                        f"{qtype} {out_features}x{in_features} {row['dtype']}: "
                        + ", ".join(f"{name} {statistics.median(ms):.2f} ms" for name, ms in row["ms"].items())
                    )
                    del ours, theirs, blocks, dense, outputs
                path.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    setup = {"tokens": args.tokens, "rounds": args.rounds, "calls": args.calls, "threads": args.threads}
    if args.json:
        print(json.dumps({"setup": setup, "rows": rows}, indent=1))
        return
    print(
        f"\nOne linear layer's forward on the CPU ({args.threads} threads), batch 1 x {args.tokens} tokens, same GGUF "
        f"bytes; ms per call, median (min–max) of {args.rounds} interleaved rounds x {args.calls} calls\n"
    )
    print(
        "| type | weight (out x in) | dtype | memmode | diffusers | memmode / diffusers | dense F.linear | max diff |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        theirs = (spread(row["ms"]["diffusers"]), spread(row["ratio"])) if row["ratio"] else ("-", "-")
        print(
            f"| {row['type']} | {row['shape'][0]}x{row['shape'][1]} | {row['dtype']} | {spread(row['ms']['memmode'])} "
            f"| {theirs[0]} | {theirs[1]} | {spread(row['ms']['dense'])} | {row['max_diff']:.1e} |"
        )


# == load =========================================================================================================


def load_worker(job: dict) -> None:
    import diffusers  # everything imported in every variant: the same baseline for both
    import torch
    from diffusers import GGUFQuantizationConfig, WanTransformer3DModel

    import memmode_core

    diffusers.utils.logging.set_verbosity_error()
    torch.set_num_threads(job["threads"])
    bf16 = torch.bfloat16
    sampler = Sampler()
    sampler.start()
    time.sleep(2 * SAMPLE_S)
    baseline_anon, baseline_file = read_status()
    sampler.reset()
    began = time.perf_counter()
    if job["variant"] == "memmode":
        handle = memmode_core.load(
            job["file"],
            "model_group_offload",
            config=job["config"],
            device="cpu",
            storage="mmap",
            offload_dir=job["workdir"],
            torch_dtype=bf16,
        )
        model = handle.target
    else:
        model = WanTransformer3DModel.from_single_file(
            job["file"],
            config=job["config"],
            quantization_config=GGUFQuantizationConfig(compute_dtype=bf16),
            torch_dtype=bf16,
        ).eval()
    loaded = time.perf_counter()
    load_peaks = sampler.take()
    after_anon, after_file = read_status()
    inputs = bf16_inputs(model, frames=job["frames"], height=job["height"], width=job["width"])
    with torch.inference_mode():
        out = model(**inputs)[0]
    done = time.perf_counter()
    peaks = sampler.take()
    sampler.stop.set()
    torch.save(out.float(), Path(job["workdir"]) / "output.pt")
    result = {
        "variant": job["variant"],
        "load_s": loaded - began,
        "first_output_s": done - began,
        "baseline_anon": baseline_anon,
        "baseline_file": baseline_file,
        "baseline_total": baseline_anon + baseline_file,
        "load_peak_anon": load_peaks["anon"],
        "after_anon": after_anon,
        "after_total": after_anon + after_file,
        "peak_anon": peaks["anon"],
        "peak_file": peaks["file"],
        "peak_total": peaks["total"],
        "finite": bool(torch.isfinite(out).all()),
    }
    print("RESULT " + json.dumps(result), flush=True)


def run_load(args: argparse.Namespace) -> None:
    import torch

    config = wan_small(2, text_dim=4096) if args.quick else wan_14b(args.layers)
    layers = config["num_layers"]
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    warm_up = not args.quick if args.warm_up is None else args.warm_up
    cache = Path(args.cache)
    comfy = args.format != "Q8_0"
    if comfy:  # diffusers reads no ComfyUI mixed-precision file: memmode alone, its memory counted in groups
        file, folder, specs = cached_comfy(cache, config, args.format)
        file_bytes, group = comfy_sizes(specs)
        variants = ["memmode"]
    else:
        file, folder, specs = cached_gguf(cache, config, "Q8_0")
        file_bytes, group = gguf_sizes(specs)
        variants = ["memmode", "diffusers"]
    scratch = Path(tempfile.mkdtemp(prefix="load-", dir=cache))
    results: dict[str, list[dict]] = {v: [] for v in variants}
    diffs = []
    started = time.perf_counter()
    try:
        for index in range(rounds + int(warm_up)):
            outputs = {}
            for variant in rotated(variants, index):
                workdir = Path(tempfile.mkdtemp(prefix=f"{variant}-", dir=scratch))
                job = {"kind": "load", "variant": variant, "file": str(file), "config": str(folder)}
                job |= {"workdir": str(workdir), "threads": args.threads}
                job |= {"frames": args.frames, "height": args.height, "width": args.width}
                result = worker_result(child(worker_argv(job), f"load {variant}"))
                outputs[variant] = torch.load(workdir / "output.pt")
                shutil.rmtree(workdir, ignore_errors=True)
                label = "warm-up" if warm_up and index == 0 else f"round {index + 1 - int(warm_up)}"
                say(
                    f"{label:>8} {variant:<10} load {result['load_s']:7.2f} s, first output "
                    f"{result['first_output_s']:7.2f} s, peak RssAnon {result['peak_anon'] / GIB:6.2f} GiB"
                )
                if not (warm_up and index == 0):
                    results[variant].append(result)
            if not comfy:
                reference = outputs["diffusers"]
                diffs.append(float((outputs["memmode"] - reference).abs().max() / reference.abs().max()))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.perf_counter() - started
    setup = {"layers": layers, "rounds": rounds, "warm_up": warm_up, "threads": args.threads}
    setup |= {"file_bytes": file_bytes, "group_bytes": group, "frames": args.frames}
    setup |= {"height": args.height, "width": args.width, "max_diff": max(diffs, default=None)}
    setup |= {"format": args.format}
    if args.json:
        print(json.dumps({"setup": setup, "results": results}, indent=1))
        return

    def over(variant: str, key: str) -> list[float]:
        base = "baseline_anon" if key.endswith("anon") else "baseline_total"
        return [r[key] - r[base] for r in results[variant]]

    def med(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in results[variant])

    largest = max(r["peak_total"] - r["baseline_total"] for rs in results.values() for r in rs)
    scale, unit = (GIB, "GiB") if largest >= GIB else (MIB, "MiB")
    kind = f"ComfyUI {args.format} safetensors" if comfy else "Q8_0 GGUF"
    print(
        f"\nWan-shaped transformer (hidden {config['num_attention_heads'] * config['attention_head_dim']}, ffn "
        f"{config['ffn_dim']}), {layers} blocks, {kind} {size(file_bytes)} (random values, hot in the page "
        f"cache); largest group (one block as stored) {group / MIB:.1f} MiB; CPU, {args.threads} threads; "
        f"input {args.frames}x{args.height}x{args.width} latent, 16 text tokens; median (min–max) of {rounds} "
        f"{'interleaved ' if len(variants) > 1 else ''}rounds{' after a warm-up' if warm_up else ''}; "
        f"{seconds / 60:.1f} min\n"
    )
    print(
        f"| variant | load s | first output s | × diffusers | peak RssAnon over baseline {unit} | × diffusers "
        f"| in groups | peak RssAnon+RssFile over baseline {unit} | × diffusers | in groups |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def ratio(variant: str, median: float, key: str) -> str:
        if "diffusers" not in results:
            return "–"
        theirs = statistics.median(over("diffusers", key)) if key.startswith("peak") else med("diffusers", key)
        return f"{median / theirs:.2f}"

    for variant in variants:
        anon, total = over(variant, "peak_anon"), over(variant, "peak_total")
        print(
            f"| {variant} | {spread([r['load_s'] for r in results[variant]])} "
            f"| {spread([r['first_output_s'] for r in results[variant]])} "
            f"| {ratio(variant, med(variant, 'first_output_s'), 'first_output_s')} | {spread(anon, scale=scale)} "
            f"| {ratio(variant, statistics.median(anon), 'peak_anon')} | {statistics.median(anon) / group:.1f} "
            f"| {spread(total, scale=scale)} | {ratio(variant, statistics.median(total), 'peak_total')} "
            f"| {statistics.median(total) / group:.1f} |"
        )
    baseline = statistics.median(r["baseline_anon"] for rs in results.values() for r in rs)
    against = f"memmode's output against diffusers' (max |diff| / max |diffusers|): {max(diffs):.1e}; " if diffs else ""
    print(
        f"\nbaseline RssAnon of a worker after imports: {baseline / GIB:.2f} GiB; {against}outputs finite: "
        f"{all(r['finite'] for rs in results.values() for r in rs)}"
    )


# == offload ======================================================================================================

#: variant -> (mode, options)
OFFLOAD_VARIANTS = {
    "model_cpu_offload": ("model_cpu_offload", {}),
    "group block_level": ("model_group_offload", {"offload_type": "block_level"}),
    "group leaf_level": ("model_group_offload", {"offload_type": "leaf_level"}),
    "sequential_cpu_offload": ("sequential_cpu_offload", {}),
}


def offload_worker(job: dict) -> None:
    import diffusers
    import torch

    import memmode_core

    diffusers.utils.logging.set_verbosity_error()
    torch.set_num_threads(job["threads"])
    models = {}
    for variant in job["variants"]:
        mode, options = OFFLOAD_VARIANTS[variant]
        if mode == "model_group_offload":
            options = {**options, "storage": job["storage"]}
            if job["storage"] != "ram":
                options["offload_dir"] = str(Path(job["workdir"]) / variant.replace(" ", "-"))
        handle = memmode_core.load(
            job["file"], mode, config=job["config"], device="cpu", torch_dtype=torch.bfloat16, **options
        )
        models[variant] = handle.target
    inputs = bf16_inputs(models[job["variants"][0]], height=job["height"], width=job["width"])
    times: dict[str, list[float]] = {v: [] for v in models}
    digests = {}
    with torch.inference_mode():
        for variant, model in models.items():  # a warm-up call each, and its output
            out = model(**inputs)[0]
            digests[variant] = hashlib.sha1(out.float().contiguous().numpy().tobytes()).hexdigest()[:12]
        for index in range(job["rounds"]):
            for variant in rotated(list(models), index):
                model = models[variant]
                began = time.perf_counter()
                for _ in range(job["calls"]):
                    model(**inputs)
                times[variant].append((time.perf_counter() - began) / job["calls"])
    print("RESULT " + json.dumps({"times": times, "digests": digests}), flush=True)


def run_offload(args: argparse.Namespace) -> None:
    if args.quick:
        config, rounds, calls = wan_small(2, text_dim=4096), args.rounds or 2, args.calls or 1
    else:
        config, rounds, calls = wan_1_3b(args.layers), args.rounds or 10, args.calls or 1
    cache = Path(args.cache)
    file, folder, specs = cached_gguf(cache, config, args.qtype)
    file_bytes, group = gguf_sizes(specs)
    variants = list(OFFLOAD_VARIANTS)
    workdir = Path(tempfile.mkdtemp(prefix="offload-", dir=cache))
    try:
        job = {"kind": "offload", "variants": variants, "file": str(file), "config": str(folder)}
        job |= {"workdir": str(workdir), "storage": args.storage, "threads": args.threads}
        job |= {"rounds": rounds, "calls": calls, "height": args.height, "width": args.width}
        started = time.perf_counter()
        result = worker_result(child(worker_argv(job), "offload"))
        seconds = time.perf_counter() - started
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    times = {v: [t * 1e3 for t in ts] for v, ts in result["times"].items()}
    reference = times["model_cpu_offload"]
    setup = {"layers": config["num_layers"], "qtype": args.qtype, "storage": args.storage, "rounds": rounds}
    setup |= {"calls": calls, "threads": args.threads, "file_bytes": file_bytes, "height": args.height}
    setup |= {"width": args.width}
    if args.json:
        print(json.dumps({"setup": setup, "ms": times, "digests": result["digests"]}, indent=1))
        return
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    print(
        f"\nWan-shaped transformer (hidden {hidden}, ffn {config['ffn_dim']}, {config['num_layers']} blocks), "
        f"{args.qtype} GGUF {size(file_bytes)}, loaded with memmode.load (torch_dtype=bfloat16, group offload "
        f"storage={args.storage}); CPU, {args.threads} threads; input 1x{args.height}x{args.width} latent, 16 text "
        f"tokens; ms per call, median (min–max) of {rounds} interleaved rounds x {calls} calls; {seconds:.0f} s\n"
    )
    print("| variant | ms per call | adds to model_cpu_offload, ms | × model_cpu_offload | output = cpu offload's |")
    print("|---|---:|---:|---:|---|")
    for variant, ms in times.items():
        added = [m - r for m, r in zip(ms, reference)]
        ratio = [m / r for m, r in zip(ms, reference)]
        same = result["digests"][variant] == result["digests"]["model_cpu_offload"]
        print(
            f"| {variant} | {spread(ms, '.1f')} | {spread(added, '.1f')} | {spread(ratio)} "
            f"| {'bit-equal' if same else 'DIFFERS'} |"
        )


# == the command line =============================================================================================


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        job = json.loads(sys.argv[2])
        (load_worker if job["kind"] == "load" else offload_worker)(job)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="memmode plan on a sparse Wan 2.2 A14B folder with two Q4_K_M GGUFs")
    plan.add_argument("--keep", help="build the folder and files here and keep them (default: temporary)")
    plan.add_argument("--qtype", default="Q4_K_M")
    plan.add_argument("--vram", default="12GiB")
    plan.add_argument("--height", type=int, default=480)
    plan.add_argument("--width", type=int, default=832)
    plan.add_argument("--num-frames", type=int, default=81)

    forward = commands.add_parser("forward", help="one linear layer's dequantizing forward, memmode vs diffusers")
    forward.add_argument("--types", default="Q8_0,Q4_K,Q6_K,IQ4_NL,IQ4_XS", help="GGML types, comma-separated")
    forward.add_argument("--sizes", default=None, help="OUTxIN weights, comma-separated (3072x3072,5120x13824)")
    forward.add_argument("--tokens", type=int, default=None, help="tokens per call (512; --quick: 64)")
    forward.add_argument("--dtypes", default="bfloat16,float32", help="compute dtypes")
    forward.add_argument("--rounds", type=int, default=None, help="interleaved rounds (10; --quick: 2)")
    forward.add_argument("--calls", type=int, default=None, help="calls per variant per round (3; --quick: 2)")

    load = commands.add_parser("load", help="load a Wan 14B-shaped Q8_0 GGUF (or ComfyUI file) and run one forward")
    load.add_argument(
        "--format",
        default="Q8_0",
        choices=("Q8_0", "int8_tensorwise", "nvfp4"),
        help="Q8_0: a GGUF, memmode against diffusers; int8_tensorwise or nvfp4: a ComfyUI file, memmode alone",
    )
    load.add_argument("--layers", type=int, default=40, help="transformer blocks (40: 14B; 2: a 1 GB file)")
    load.add_argument("--rounds", type=int, default=None, help="timed rounds (3; --quick: 1)")
    load.add_argument(
        "--warm-up", action=argparse.BooleanOptionalAction, default=None, help="an untimed round first (not --quick)"
    )
    load.add_argument("--frames", type=int, default=1, help="latent frames of the forward's input")
    load.add_argument("--height", type=int, default=16, help="latent height")
    load.add_argument("--width", type=int, default=16, help="latent width")

    offload = commands.add_parser("offload", help="time per call of the offload modes on a GGUF file, CPU")
    offload.add_argument("--layers", type=int, default=30, help="blocks of the Wan 1.3B-shaped transformer")
    offload.add_argument("--qtype", default="Q8_0")
    offload.add_argument("--storage", default="mmap", help="model_group_offload's storage (mmap, disk, ram)")
    offload.add_argument("--rounds", type=int, default=None, help="interleaved rounds (10; --quick: 2)")
    offload.add_argument("--calls", type=int, default=None, help="calls per variant per round (1)")
    offload.add_argument("--height", type=int, default=16, help="latent height")
    offload.add_argument("--width", type=int, default=16, help="latent width")

    for sub in (plan, forward, load, offload):
        sub.add_argument("--quick", action="store_true", help="small sizes: a smoke run in seconds")
        sub.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
        if sub is not plan:
            sub.add_argument("--threads", type=int, default=None, help="torch threads (2; --quick: 1)")
        if sub in (load, offload):
            sub.add_argument(
                "--cache", default=DEFAULT_CACHE, help="where the GGUF files are written once and reused (a disk)"
            )
    args = parser.parse_args()
    if args.command != "plan":  # one thread for a smoke run: two spin-wait for each other on a busy machine
        args.threads = args.threads or (1 if args.quick else 2)
    if args.command == "forward":
        args.sizes = args.sizes or ("256x512" if args.quick else "3072x3072,5120x13824")
        args.tokens = args.tokens or (64 if args.quick else 512)
        args.rounds = args.rounds or (2 if args.quick else 10)
        args.calls = args.calls or (2 if args.quick else 3)
    if args.command in ("load", "offload"):
        os.makedirs(args.cache, exist_ok=True)
    {"plan": run_plan, "forward": run_forward, "load": run_load, "offload": run_offload}[args.command](args)


if __name__ == "__main__":
    main()
