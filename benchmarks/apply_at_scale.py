"""``from_pretrained`` + ``apply`` with a quantizer into a file storage, at the size users run: host memory.

A Wan 2.1 14B-shaped transformer checkpoint (40 blocks, hidden 5120, ffn 13824: 28.6 GB in bfloat16, random
weights) is written shard by shard, as ``save_pretrained`` lays one out — never the whole model in memory: this
machine has 24 GB — into a cache folder, once. Each variant then runs in a fresh process: it loads the folder
with ``from_pretrained`` (its weights stay the checkpoint's mapped pages) and applies
``model_group_offload_and_qfloat8`` with the given storage, while a thread samples ``/proc/self/status`` every
20 ms. Reported: the peak ``RssAnon`` during ``apply`` above the process's baseline (its ``RssAnon`` once the
model is loaded), in bytes and in groups (one transformer block in bfloat16), and what stays above the baseline
once ``apply`` has returned (nothing should). Target (issue 34): the peak within two groups, nothing held after.

    python benchmarks/apply_at_scale.py [--storages disk,mmap] [--cache /tmp/memmode-scale-bench]
    python benchmarks/apply_at_scale.py --layers 4      # a 4-block checkpoint of the same width: a smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _models import fill_like_initialised, released_wan_config
from load_into_mode import Sampler, read_status

#: a shard of the checkpoint, as diffusers' save_pretrained cuts them
SHARD_BYTES = 5 << 30


def config_for(layers: int) -> dict:
    return released_wan_config(heads=40, layers=layers, ffn_dim=13824, eps=1e-6, rope_max_seq_len=1024)


def build(folder: Path, config: dict) -> None:
    """The checkpoint, shard by shard: each tensor made, filled with random values scaled as an initialised
    model's, and written with its shard; at most one shard in memory."""
    import torch
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    torch.manual_seed(0)
    with torch.device("meta"):
        model = WanTransformer3DModel(**config)
    parameters = {name for name, _ in model.named_parameters()}
    real = dict(WanTransformer3DModel(**{**config, "num_layers": 1}).named_buffers())  # the buffers' real values
    folder.mkdir(parents=True, exist_ok=True)
    model.save_config(folder)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    files: list[str] = []

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"diffusion_pytorch_model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            files.append(name)
            shard, size = {}, 0

    for key, meta in model.state_dict().items():
        if key not in parameters:  # a persistent buffer: its real value
            tensor = real[key].clone()
        else:
            tensor = torch.empty(meta.shape, dtype=torch.bfloat16)
            fill_like_initialised(key, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        if size + nbytes > SHARD_BYTES:
            flush()
        shard[key] = tensor
        size += nbytes
        total += nbytes
    flush()
    # files of several shards are renamed as save_pretrained names them: -0000k-of-0000n
    count = len(files)
    renamed = {}
    for index in range(1, count + 1):
        old = f"diffusion_pytorch_model-{index:05d}.safetensors"
        new = f"diffusion_pytorch_model-{index:05d}-of-{count:05d}.safetensors"
        (folder / old).rename(folder / new)
        renamed[old] = new
    index = {"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "complete").write_text("ok\n")


def ensure_checkpoint(folder: Path, configured_by: str, layers: int) -> None:
    """Write the checkpoint into ``folder`` unless it is complete there, in a child process (its memory goes back
    when it exits); ``configured_by`` names the benchmark module whose ``config_for(layers)`` is its config."""
    if (folder / "complete").is_file():
        return
    print(f"writing the checkpoint into {folder} (once) ...", file=sys.stderr, flush=True)
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"from apply_at_scale import build; from {configured_by} import config_for; from pathlib import Path; "
            f"build(Path({str(folder)!r}), config_for({layers}))",
        ],
        check=True,
    )


def worker(folder: Path, storage: str, workdir: Path) -> None:
    import diffusers
    import torch
    from diffusers import WanTransformer3DModel

    import memmode_core as memmode

    diffusers.utils.logging.set_verbosity_error()
    torch.set_num_threads(2)
    model = WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
    sampler = Sampler()
    sampler.start()
    time.sleep(0.1)
    baseline, _ = read_status()
    sampler.reset()
    began = time.perf_counter()
    handle = memmode.apply(model, "model_group_offload_and_qfloat8", device="cpu", storage=storage, offload_dir=workdir)
    seconds = time.perf_counter() - began
    after, _ = read_status()
    peak, peak_file = sampler.take()
    sampler.stop.set()
    print(
        "RESULT "
        + json.dumps(
            {
                "storage": storage,
                "apply_s": seconds,
                "baseline_anon": baseline,
                "peak_anon": peak,
                "after_anon": after,
                "peak_file": peak_file,
                "storage_bytes": handle.report().storage_bytes,
                "memmode": str(Path(memmode.__file__).parent.parent),
            }
        ),
        flush=True,
    )


def group_bytes(folder: Path) -> int:
    """One transformer block in bfloat16, from the checkpoint's index and headers."""
    from safetensors import safe_open

    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    total = 0
    for key, name in index["weight_map"].items():
        if key.startswith("blocks.0."):
            with safe_open(folder / name, "pt") as f:
                total += _numel(f.get_slice(key)) * 2
    return total


def _numel(sliced) -> int:
    count = 1
    for n in sliced.get_shape():
        count *= n
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storages", default="disk,mmap")
    parser.add_argument("--layers", type=int, default=40, help="transformer blocks (40: Wan 2.1 14B, 28.6 GB)")
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "memmode-scale-bench"))
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker[0]), args.worker[1], Path(args.worker[2]))
        return
    folder = Path(args.cache) / f"wan14b-{args.layers}"
    ensure_checkpoint(folder, "apply_at_scale", args.layers)
    group = group_bytes(folder)
    gib, mib = 2**30, 2**20
    print(f"Wan 14B-shaped transformer, {args.layers} blocks; one group (a block, bf16): {group / mib:.0f} MiB")
    print("| storage | apply s | peak RssAnon over baseline | in groups | held after apply | baseline |")
    print("|---|---:|---:|---:|---:|---:|")
    for storage in args.storages.split(","):
        with tempfile.TemporaryDirectory(dir=args.cache) as workdir:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", str(folder), storage, workdir],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        over = result["peak_anon"] - result["baseline_anon"]
        held = result["after_anon"] - result["baseline_anon"]
        print(
            f"| {storage} | {result['apply_s']:.1f} | {over / mib:.0f} MiB | {over / group:.2f} | "
            f"{held / mib:.0f} MiB | {result['baseline_anon'] / gib:.2f} GiB |",
            flush=True,
        )
    print(f"memmode_core from {result['memmode']}")


if __name__ == "__main__":
    main()
