"""Host memory and time of N ranks on one machine: one copy per machine, not one per rank.

A Wan 2.1 1.3B-shaped transformer checkpoint (30 blocks, hidden 1536, ffn 8960: 2.8 GB in bfloat16, random
weights) is written once, shard by shard, into a cache folder. For 1, 2 and 4 ranks of ``torch.distributed``
(gloo, each a process started by the launcher ``memmode run --nproc`` uses), every rank then places the model
with one variant:

- ``pinned``: ``from_pretrained`` + ``apply(model_group_offload, storage="pinned")`` under the strict model of an
  accelerator's copies (the CPU made one; the part of ``pinned`` that shares: one copy of the groups in the
  machine's shared memory, each rank's mapping registered; on a GPU ``cudaHostRegister`` locks the same pages);
- ``mmap``, ``disk``: ``from_pretrained`` + ``apply(model_group_offload, storage=...)`` on the CPU;
- ``ram+qfloat8``: ``from_pretrained`` + ``apply(model_group_offload_and_qfloat8, storage="ram")``;
- ``load+qfloat8``: ``memmode.load(folder, "model_group_offload_and_qfloat8")`` (``ram``).

**Node memory** is what the ranks hold for the model once every rank has placed it and called it once (a call
maps what ``mmap`` keeps zero-copy on the CPU; ``pinned`` is not called: under the strict model the CPU's memory
stands for the GPU's too): the sum over ranks of the
proportional set size (``Pss`` of ``/proc/self/smaps_rollup``) each process gained since before it built the
model. A page k processes map counts 1/k in each, so what the ranks share (the page cache of a file they all
map, shared memory) counts once on the machine and each rank's own memory counts in full, N times; the issue's
earlier figure (1.31x at 2 ranks for ``load+qfloat8``) was measured so. Beside it, the issue's other reading:
the anonymous memory (``RssAnon``) the ranks gained, plus the bytes in the machine's shared memory (memmode's
folders in ``/dev/shm``) counted once; it leaves out page cache, which the kernel can reclaim. (Under the strict
model, registering memory faults its pages in, as the driver does, so ``pinned``'s are counted.)
Each rank's time is from before it builds the model to when its mode is placed; the node's time is the slowest
rank's. Targets (issue 34): 4 ranks within 1.15x of one rank's node memory; ``load+qfloat8`` on 4 ranks within
1.5x of one rank's time.

    python benchmarks/ranks.py [--variants pinned,mmap,disk,ram+qfloat8,load+qfloat8] [--ranks 1,2,4] [--rounds 3]
    python benchmarks/ranks.py --layers 4      # a 4-block checkpoint of the same width: a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _models import released_wan_config
from apply_at_scale import ensure_checkpoint

VARIANTS = ("pinned", "mmap", "disk", "ram+qfloat8", "load+qfloat8")


def config_for(layers: int) -> dict:
    return released_wan_config(heads=12, layers=layers, ffn_dim=8960, eps=1e-6, rope_max_seq_len=1024)


def memory() -> tuple[int, int]:
    """This process's ``(RssAnon, Pss)``, in bytes."""
    found = {}
    for path, key in (("/proc/self/status", "RssAnon:"), ("/proc/self/smaps_rollup", "Pss:")):
        with open(path) as lines:
            found[key] = next(int(line.split()[1]) * 1024 for line in lines if line.startswith(key))
    return found["RssAnon:"], found["Pss:"]


def shared_memory_bytes() -> int:
    """Bytes in memmode's folders of the machine's shared memory."""
    return sum(p.stat().st_size for p in Path("/dev/shm").glob("memmode-*/*") if p.is_file())


def place(rank: int, world: int, variant: str, folder: str, workdir: str) -> dict:
    """One rank: build and place the model as ``variant`` says; its Pss gain and time, measured with every rank's
    model placed (barriers), and the machine's shared-memory bytes then."""
    import contextlib

    import diffusers
    import torch
    import torch.distributed as dist
    from diffusers import WanTransformer3DModel

    import memmode_core as memmode
    from memmode_core.engine.streams import installed
    from memmode_core.testing import StrictStreams

    diffusers.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.barrier()
    before = memory()
    began = time.perf_counter()
    strict = installed(StrictStreams(seed=rank)) if variant == "pinned" else contextlib.nullcontext()
    with strict:
        if variant == "load+qfloat8":
            handle = memmode.load(folder, "model_group_offload_and_qfloat8", device="cpu", storage="ram")
        else:
            model = WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
            mode, storage = (
                ("model_group_offload_and_qfloat8", "ram")
                if variant == "ram+qfloat8"
                else (
                    "model_group_offload",
                    variant,
                )
            )
            handle = memmode.apply(model, mode, device="cpu", storage=storage, offload_dir=None)
        seconds = time.perf_counter() - began
        if variant != "pinned":
            # one call: what a call maps (mmap's zero-copy pages) is counted too; not under the strict model, whose
            # memory stands for the GPU's (and holds every copy's record until it is synchronised)
            generator = torch.Generator().manual_seed(rank)
            with torch.no_grad():
                handle.target(
                    hidden_states=torch.randn(1, 16, 1, 8, 8, generator=generator).to(torch.bfloat16),
                    timestep=torch.tensor([500]),
                    encoder_hidden_states=torch.randn(1, 8, 4096, generator=generator).to(torch.bfloat16),
                    return_dict=False,
                )
        dist.barrier()  # every rank has placed its model and called it once
        after = memory()
        shared = shared_memory_bytes()
        dist.barrier()  # every rank has measured
        loading = getattr(handle, "loading", None) or {}
        handle.remove()
    return {
        "anon": after[0] - before[0],
        "pss": after[1] - before[1],
        "seconds": seconds,
        "shared": shared,
        "packed_once": loading.get("packed_once_by_ranks"),
    }


def run(variant: str, world: int, folder: Path, workdir: Path) -> list[dict]:
    from memmode_core.cli.ranks import on_ranks

    outcomes = on_ranks(world, place, variant, str(folder), str(workdir), accelerator=False, timeout=1800)
    failed = [o for o in outcomes if "value" not in o]
    if failed:
        raise SystemExit(f"{variant} on {world} ranks failed: " + "\n".join(o["error"] for o in failed))
    return [o["value"] for o in outcomes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (the table shows medians)")
    parser.add_argument("--layers", type=int, default=30, help="transformer blocks (30: Wan 2.1 1.3B, 2.8 GB)")
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "memmode-ranks-bench"))
    args = parser.parse_args()
    folder = Path(args.cache) / f"wan1.3b-{args.layers}"
    ensure_checkpoint(folder, "ranks", args.layers)
    checkpoint = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    mib = 2**20
    ranks = [int(n) for n in args.ranks.split(",")]
    print(f"Wan 2.1 1.3B-shaped transformer, {args.layers} blocks, {checkpoint / mib:.0f} MiB in bfloat16")
    runs: dict[tuple[str, int], list[tuple[int, int, int, float]]] = {}
    for _ in range(args.rounds):  # interleaved: each round runs every variant on every count of ranks
        for variant in args.variants.split(","):
            for world in ranks:
                with tempfile.TemporaryDirectory(dir=args.cache) as workdir:
                    results = run(variant, world, folder, Path(workdir))
                shared = results[0]["shared"]
                runs.setdefault((variant, world), []).append(
                    (
                        sum(r["pss"] for r in results),
                        sum(r["anon"] for r in results) + shared,
                        shared,
                        max(r["seconds"] for r in results),
                    )
                )
    print(
        f"median of {args.rounds} rounds (range); x one rank: the medians' ratio\n"
        "| variant | ranks | node memory (Pss gained) | x one rank | RssAnon gained + shared memory | x one rank | "
        "shared memory | node s | x one rank |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for variant in args.variants.split(","):
        one = [statistics.median(column) for column in zip(*runs[variant, ranks[0]], strict=True)]
        for world in ranks:
            columns = list(zip(*runs[variant, world], strict=True))
            median = [statistics.median(column) for column in columns]
            pss, node, shared, seconds = median
            print(
                f"| {variant} | {world} | {pss / mib:.0f} MiB | {pss / one[0]:.2f} | {node / mib:.0f} MiB | "
                f"{node / one[1]:.2f} | {shared / mib:.0f} MiB | {seconds:.1f} ({min(columns[3]):.1f}-"
                f"{max(columns[3]):.1f}) | {seconds / one[3]:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
