"""Every mode on N ranks of one machine, as users outgrow one GPU: 2 and 4 CPU ranks of ``torch.distributed``
(gloo), each a process (``tests/ranks.py``).

- **Context parallelism** (diffusers' ``ContextParallelConfig``, Ulysses: each rank attends over all tokens for
  a share of the heads, and computes everything else for a share of the tokens): a Wan transformer under every
  placement x storage x quantizer gives, on every rank, exactly the single-process output — the lossless modes
  the unquantized one, the quantized modes the single process's quantized one.
- **Data-parallel serving** (one pipeline per rank, each serving its own request): every rank's output is what
  one process gives for that request, under every placement, a storage of each kind and a quantizer.
- **FSDP2** (``fully_shard``: each rank holds a shard of every weight, all-gathered for the forward): every
  placement keeps it exact where nothing is copied (``ram`` on a CPU device); a storage that copies a resting
  weight's bytes is refused, typed, before anything is touched (a shard has no bytes of its own in one place:
  writing one used to crash the process), and the model still runs.

What needs an accelerator is not here (docs/distributed.md): ring attention needs an attention backend that
returns the log-sum-exp, which the CPU's has not, and diffusers' tensor parallelism shards onto devices.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from helpers import TINY_PIPELINE_CALL, assert_bit_equal, assert_reassociated, mapped_from
from rank_models import forward, shard, wan_transformer
from ranks import distributed_available, run_ranks

pytestmark = [
    pytest.mark.skipif(not distributed_available(), reason="needs torch.distributed with gloo"),
    pytest.mark.slow,
]

PLACEMENTS = [
    ("model_cpu_offload", {}),
    ("model_group_offload", {}),
    ("model_group_offload", {"offload_type": "leaf_level"}),
    ("sequential_cpu_offload", {}),
]
STORAGES = ("ram", "disk", "mmap")
QUANTIZERS = (None, "qfloat8", "qfloat4")


def matrix() -> list[tuple[str, str, dict]]:
    """(label, mode, apply's keywords): every placement x storage x quantizer (a full load has no storage)."""
    cases = []
    for quantizer in QUANTIZERS:
        suffix = f"_and_{quantizer}" if quantizer else ""
        cases.append((f"model_full_load{suffix}", f"model_full_load{suffix}", {}))
        for placement, options in PLACEMENTS:
            for storage in STORAGES:
                label = f"{placement}{suffix}[{','.join(f'{k}={v}' for k, v in options.items())}] {storage}"
                cases.append((label, placement + suffix, {"storage": storage, **options}))
    return cases


def quantizer_of(mode: str) -> str | None:
    return mode.rpartition("_and_")[2] if "_and_" in mode else None


def single_process_outputs(model_factory) -> dict[str | None, torch.Tensor]:
    """What one process gives, unquantized and under each quantizer: what every rank must give."""
    import memmode_core as memmode

    outputs = {}
    for quantizer in QUANTIZERS:
        model = model_factory()
        if quantizer is not None:
            memmode.apply(model, f"model_full_load_and_{quantizer}", device="cpu")
        outputs[quantizer] = forward(model)
    return outputs


# -- context parallelism -------------------------------------------------------------------------------------


def context_parallel(rank: int, world: int) -> dict:
    """Every case of the matrix on a Wan transformer split over the ranks by Ulysses."""
    from diffusers import ContextParallelConfig

    import memmode_core as memmode

    results = {}
    for label, mode, options in matrix():
        model = wan_transformer(heads=4)
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        handle = memmode.apply(model, mode, device="cpu", **options)
        results[label] = (forward(model), forward(model))  # a first call, and one in the steady state
        handle.remove()
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallelism_is_exact_under_every_mode(world):
    expected = single_process_outputs(lambda: wan_transformer(heads=4))
    for rank, results in enumerate(run_ranks(world, context_parallel)):
        assert len(results) == len(matrix())
        for label, mode, _ in matrix():
            for output in results[label]:
                assert_bit_equal(output, expected[quantizer_of(mode)], f"rank {rank}/{world}, {label}")


#: the other pipelines of the suite whose transformer diffusers splits with context parallelism (``_cp_plan``), and
#: the Ulysses options each needs: Qwen-Image's prompt is an odd number of tokens (``ulysses_anything`` pads it).
#: LTX's is not here: diffusers' own Ulysses fails on the tiny LTX (its attention mask does not follow the split
#: heads), with or without memmode
CP_FAMILIES = {"flux": {}, "qwenimage": {"ulysses_anything": True}}
#: on them, a placement with each storage, the quantizers, leaf level (every case under MEMMODE_TEST_FULL_MATRIX)
CP_FAMILY_MODES = [
    ("model_group_offload", {"storage": "ram"}),
    ("model_group_offload_and_qfloat8", {"storage": "mmap", "offload_type": "leaf_level"}),
    ("sequential_cpu_offload_and_qfloat4", {"storage": "disk"}),
]


def family_modes() -> list[tuple[str, dict]]:
    if os.environ.get("MEMMODE_TEST_FULL_MATRIX"):
        return [(mode, options) for _, mode, options in matrix()]
    return CP_FAMILY_MODES


def context_parallel_pipelines(rank: int, world: int, modes: list) -> dict:
    """The suite's pipelines whose transformer diffusers splits, the transformer split over the ranks by Ulysses:
    each rank's output of one pipeline call under each mode, and under a full load unquantized and quantized (what
    the same ranks give without anything offloaded: the reference)."""
    from diffusers import ContextParallelConfig

    import memmode_core as memmode
    from tiny_pipelines import make_pipeline, run

    references = [("model_full_load" + (f"_and_{q}" if q else ""), {}) for q in QUANTIZERS]
    results = {}
    for family, config in CP_FAMILIES.items():
        for mode, options in [*references, *modes]:
            pipe = make_pipeline(family)
            pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world, **config))
            handle = memmode.apply(pipe, mode, device="cpu", **options)
            results[family, mode, str(options)] = run(pipe, family)
            handle.remove()
    return results


def test_context_parallelism_of_every_family_diffusers_splits_is_exact():
    """Flux and Qwen-Image (the tiny pipelines whose transformer diffusers splits) on 2 ranks: under every mode each
    rank gives exactly what the same ranks give with the model fully loaded (unquantized, or quantized alike).
    Ulysses itself changes the last bits on Flux (its matmuls see split token counts): that is diffusers', and the
    outputs stay within float32 rounding of one process's."""
    from tiny_pipelines import make_pipeline, run

    modes = family_modes()
    single = {family: run(make_pipeline(family), family) for family in CP_FAMILIES}
    for rank, results in enumerate(run_ranks(2, context_parallel_pipelines, modes)):
        for family in CP_FAMILIES:
            full = results[family, "model_full_load", "{}"]
            assert_reassociated(full, single[family], **TINY_PIPELINE_CALL)  # split token counts: other sums
            for mode, options in modes:
                quantizer = quantizer_of(mode)
                reference = results[family, "model_full_load" + (f"_and_{quantizer}" if quantizer else ""), "{}"]
                got = results[family, mode, str(options)]
                assert_bit_equal(got, reference, f"rank {rank}, {family}, {mode} {options}")


# -- data-parallel serving -------------------------------------------------------------------------------------

#: one pipeline per rank: a placement with each storage kind, leaf level, the text encoders alone, a quantizer
SERVING = [
    ("model_cpu_offload", {"storage": "ram"}),
    ("model_group_offload", {"storage": "disk"}),
    ("sequential_cpu_offload", {"storage": "mmap"}),
    ("text_encoder_offload", {}),
    ("model_group_offload_and_qfloat8", {"storage": "mmap", "offload_type": "leaf_level"}),
]
SERVED_FAMILY = "wan22"


#: on four ranks, the two that share the most between them: group files, and packed weights mapped from them
SERVING_ON_FOUR = [SERVING[1], SERVING[4]]


def data_parallel(rank: int, world: int, serving: list) -> dict:
    """Each rank builds the pipeline, places it, and serves its own request (its rank is its seed)."""
    import memmode_core as memmode
    from tiny_pipelines import make_pipeline, run

    results = {}
    for mode, options in serving:
        pipe = make_pipeline(SERVED_FAMILY)
        handle = memmode.apply(pipe, mode, device="cpu", **options)
        results[mode, str(options)] = run(pipe, SERVED_FAMILY, rank)
        handle.remove()
    return results


def serving_on_two() -> list[tuple[str, dict]]:
    """:data:`SERVING`; every case of the matrix under MEMMODE_TEST_FULL_MATRIX."""
    if os.environ.get("MEMMODE_TEST_FULL_MATRIX"):
        return [(mode, options) for _, mode, options in matrix()]
    return SERVING


@pytest.mark.parametrize("world, serving", [(2, serving_on_two()), (4, SERVING_ON_FOUR)], ids=["2 ranks", "4 ranks"])
def test_data_parallel_ranks_each_give_what_one_process_gives(world, serving):
    import memmode_core as memmode
    from tiny_pipelines import make_pipeline, run

    expected = {}
    for seed in range(world):
        for quantizer in {quantizer_of(mode) for mode, _ in serving}:
            pipe = make_pipeline(SERVED_FAMILY)
            if quantizer is not None:
                memmode.apply(pipe, f"model_full_load_and_{quantizer}", device="cpu")
            expected[quantizer, seed] = run(pipe, SERVED_FAMILY, seed)
    for rank, results in enumerate(run_ranks(world, data_parallel, serving)):
        for mode, options in serving:
            got = results[mode, str(options)]
            assert_bit_equal(got, expected[quantizer_of(mode), rank], f"rank {rank}, {mode} {options}")


# -- FSDP2 -----------------------------------------------------------------------------------------------------


#: on four ranks: a full load and group offload, unquantized and with one quantizer
FSDP2_ON_FOUR = ((None, "qfloat8"), [("model_full_load", {}), ("model_group_offload", {})])


def fsdp2(rank: int, world: int, quantizers=QUANTIZERS, placements=None) -> dict:
    """Each placement on a sharded transformer, unquantized and converted ahead (the order FSDP2 needs); the
    storages that copy a resting weight's bytes are refused before anything is touched."""
    from torch.distributed.device_mesh import init_device_mesh

    import memmode_core as memmode

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    placements = [("model_full_load", {}), *PLACEMENTS] if placements is None else placements
    for quantizer in quantizers:
        for placement, options in placements:
            model = wan_transformer()
            if quantizer is not None:
                memmode.convert(quantizer, model)
            shard(model, mesh)
            mode = placement + (f"_and_{quantizer}" if quantizer else "")
            handle = memmode.apply(model, mode, device="cpu", **options)
            results[f"{mode} {options}"] = forward(model)
            handle.remove()
    for storage in ("disk", "mmap"):
        model = wan_transformer()
        shard(model, mesh)
        before = forward(model)
        try:
            memmode.apply(model, "model_group_offload", device="cpu", storage=storage)
            results[f"refused {storage}"] = "accepted"
        except memmode.IncompatibleModeError as exc:
            results[f"refused {storage}"] = str(exc)
        results[f"still runs {storage}"] = torch.equal(forward(model), before)
        results[f"untouched {storage}"] = not hasattr(model, "_memmode_handle")
    return results


@pytest.mark.parametrize(
    "world, quantizers, placements",
    [(2, QUANTIZERS, [("model_full_load", {}), *PLACEMENTS]), (4, *FSDP2_ON_FOUR)],
    ids=["2 ranks", "4 ranks"],
)
def test_fsdp2_is_exact_where_nothing_is_copied_and_refused_typed_where_a_shard_would_be(world, quantizers, placements):
    expected = single_process_outputs(wan_transformer)
    for rank, results in enumerate(run_ranks(world, fsdp2, quantizers, placements)):
        for quantizer in quantizers:
            for placement, options in placements:
                mode = placement + (f"_and_{quantizer}" if quantizer else "")
                assert_bit_equal(results[f"{mode} {options}"], expected[quantizer], f"rank {rank}, {mode} {options}")
        for storage in ("disk", "mmap"):
            assert "DTensor" in results[f"refused {storage}"], results[f"refused {storage}"]
            assert results[f"still runs {storage}"] and results[f"untouched {storage}"]


# -- one host copy per machine ---------------------------------------------------------------------------------


def shared_files(rank: int, world: int, storages: tuple[str, ...]) -> dict:
    """:func:`files_of_one_storage` for each of ``storages``, in one process per rank."""
    return {storage: files_of_one_storage(storage) for storage in storages}


def files_of_one_storage(storage: str) -> dict:
    """Each rank places the same transformer with a file storage and no offload_dir: where its files are, and
    what they are (name and inode), while every rank is placed; then whether the folder outlives the last."""
    import os

    import torch.distributed as dist

    import memmode_core as memmode

    model = wan_transformer(heads=4)
    handle = memmode.apply(model, "model_group_offload", device="cpu", storage=storage)
    output = forward(model)
    folder = handle.runtime.session.store.folder
    dist.barrier()  # every rank has placed its model: the files are there for all
    files = {p.name: os.stat(p).st_ino for p in folder.glob("memmode-*.safetensors")}
    stats = handle.report().storage_bytes
    dist.barrier()
    handle.remove()
    dist.barrier()  # every rank has removed its mode
    left = folder.exists() and sorted(p.name for p in folder.iterdir())
    # every rank has looked: the next storage's round makes the same folder again, and a rank that started it
    # early wrote its lease and files into what a slower rank was still looking at
    dist.barrier()
    return {
        "folder": str(folder),
        "files": files,
        "groups": len(handle.prepared.stored_sizes),
        "written": stats["written_groups"],
        "output": output,
        "folder left": left,
    }


FILE_STORAGES = ("mmap", "disk")


def test_ranks_on_one_machine_share_one_copy_of_the_group_files():
    """Without an offload_dir, every rank of the job on this machine uses one folder (made by the first, found by
    the others in torch.distributed's store): each group file is written once and mapped by all, so the page
    cache holds one copy; the last rank to leave removes the folder."""
    expected = forward(wan_transformer(heads=4))
    ranks = run_ranks(4, shared_files, FILE_STORAGES)
    for storage in FILE_STORAGES:
        _check_shared_files([rank[storage] for rank in ranks], expected)


def _check_shared_files(results: list[dict], expected: torch.Tensor) -> None:
    for result in results:
        assert_bit_equal(result["output"], expected)
    assert len({r["folder"] for r in results}) == 1, [r["folder"] for r in results]
    assert all(r["files"] == results[0]["files"] for r in results), "the ranks map the same files"
    assert len(results[0]["files"]) == results[0]["groups"], "one file per group, not one per rank"
    assert not any(r["folder left"] for r in results), [r["folder left"] for r in results]
    assert not Path(results[0]["folder"]).exists()


#: what each of the tests of ``pinned`` on ranks looks at, with the options it is placed with
PINNED_VARIANTS = {"shared": {}, "own": {"share_between_ranks": False}, "limited": {"pinned_limit": 64 << 10}}


def shared_pinned(rank: int, world: int) -> dict:
    """:func:`pinned_once` with each of :data:`PINNED_VARIANTS`, then :func:`shared_pinned_faults`, in one process
    per rank (one spawn of ranks serves the three tests of ``pinned``)."""
    said = {name: pinned_once(rank, options) for name, options in PINNED_VARIANTS.items()}
    return {**said, "faults": shared_pinned_faults(rank, world)}


def test_pinned_on_the_ranks_of_one_machine():
    """``pinned`` on 2 ranks, one spawn of ranks for its three checks (each a spawn cost ~10 s of the suite): one
    page-locked copy shared, a copy each or part of the shared one locked, and its faults."""
    ranks = run_ranks(2, shared_pinned)
    expected = forward(wan_transformer(heads=4))
    _check_one_shared_copy([rank["shared"] for rank in ranks], expected)
    _check_own_and_limited([rank["own"] for rank in ranks], [rank["limited"] for rank in ranks], expected)
    _check_faults([rank["faults"] for rank in ranks])


def pinned_once(rank: int, options: dict) -> dict:
    """Each rank places the same transformer with ``pinned`` under the strict model of an accelerator's copies (the
    CPU made one): where its groups are, which it page-locked, and its output, first and steady-state."""
    import os

    import torch.distributed as dist

    import memmode_core as memmode
    from memmode_core.engine.streams import installed
    from memmode_core.testing import StrictStreams

    strict = StrictStreams(seed=rank)
    with installed(strict):
        model = wan_transformer(heads=4)
        handle = memmode.apply(model, "model_group_offload", device="cpu", storage="pinned", **options)
        outputs = [forward(model), forward(model)]
        session = handle.runtime.session
        shared = hasattr(session, "store")
        folder = session.store.folder if shared else None
        dist.barrier()  # every rank has placed its model
        files = {p.name: os.stat(p).st_ino for p in folder.glob("memmode-*.safetensors")} if shared else {}
        stats = handle.report().storage_bytes
        locked = {key: flat.data_ptr() for key, (flat, _) in session._mapped.items()} if shared else {}
        mapped_files = {key: session.files[key].path.name for key in locked}
        dist.barrier()
        handle.remove()
        strict.check()
        dist.barrier()  # every rank has removed its mode
    return {
        "outputs": outputs,
        "shared": shared,
        "folder": str(folder),
        "on shared memory": folder is not None and str(folder).startswith("/dev/shm/"),
        "files": files,
        "groups": len(handle.prepared.stored_sizes),
        "mapped files": mapped_files,
        "stats": stats,
        "registered": strict.counts["registered"],
        "pinned copies": strict.counts["pinned_copies"],
        "still registered": len(strict._pinned),
        "folder left": folder is not None and folder.exists(),
    }


def _check_one_shared_copy(results: list[dict], expected: torch.Tensor) -> None:
    """``pinned`` on 2 ranks: each group is one file in the machine's shared memory, written once, mapped by every
    rank and page-locked in each rank's process (the registration on a device is CUDA's; here the strict model
    checks that every copy reads registered memory and that nothing is unlocked while a copy reads it); the
    outputs are exact; the last rank removes the files."""
    for rank, result in enumerate(results):
        for output in result["outputs"]:
            assert_bit_equal(output, expected, f"rank {rank}")
        assert result["shared"] and result["on shared memory"], result["folder"]
        assert result["registered"] == result["groups"] + 1, "each group's mapping page-locked (and the probe)"
        assert result["pinned copies"] > 0 and result["still registered"] == 0
        assert result["stats"]["pinned_bytes"] > 0 and result["stats"]["disk_bytes"] == 0
        assert set(result["mapped files"].values()) <= set(result["files"])
    assert len({r["folder"] for r in results}) == 1
    assert all(r["files"] == results[0]["files"] for r in results), "the ranks map the same files"
    assert len(results[0]["files"]) == results[0]["groups"], "one file per group, not one per rank"
    assert not any(r["folder left"] for r in results), [r["folder left"] for r in results]


def _check_own_and_limited(own: list[dict], limited: list[dict], expected: torch.Tensor) -> None:
    for result in own + limited:
        for output in result["outputs"]:
            assert_bit_equal(output, expected)
    assert not any(r["shared"] for r in own), "a slab of its own in each rank"
    for result in limited:
        assert result["shared"] and 0 < result["stats"]["pinned_bytes"] <= 64 << 10
        assert result["registered"] == 1 + 1, "one group fits the limit (and the probe); the others stay unlocked"


def shared_pinned_faults(rank: int, world: int) -> dict:
    """What a rank sees when the accelerator cannot lock a shared mapping (refused before anything is touched),
    and when a shared file is cut short under the running ranks (a typed error naming it, no wrong number)."""
    import torch.distributed as dist

    import memmode_core as memmode
    from memmode_core.engine.streams import installed
    from memmode_core.testing import StrictStreams

    said = {}
    strict = StrictStreams(seed=rank)
    with installed(strict):
        model = wan_transformer(heads=4)
        before = forward(model)

        def cannot_lock(tensor, *, read_only=False):
            raise RuntimeError("cudaHostRegister failed: operation not supported")

        strict.register_host, real = cannot_lock, strict.register_host
        try:
            memmode.apply(model, "model_group_offload", device="cpu", storage="pinned")
            said["refused"] = "accepted"
        except memmode.StorageUnavailableError as exc:
            said["refused"] = str(exc)
        strict.register_host = real
        said["untouched"] = not hasattr(model, "_memmode_handle") and torch.equal(forward(model), before)
        handle = memmode.apply(model, "model_group_offload", device="cpu", storage="pinned")
        forward(model)
        dist.barrier()
        victim = sorted(handle.runtime.session.store.folder.glob("memmode-*.safetensors"))[0]
        if rank == 0:
            with open(victim, "r+b") as file:
                file.truncate(100)
        dist.barrier()
        try:
            forward(model)
            said["cut short"] = "ran"
        except memmode.StorageUnavailableError as exc:
            said["cut short"] = str(exc)
        said["victim"] = victim.name
        dist.barrier()
        try:
            handle.remove()
            said["removed"] = "every group restored"
        except memmode.RestoreError as exc:
            said["removed"] = str(exc)
    return said


def _check_faults(faults: list[dict]) -> None:
    """A refused registration leaves the model untouched; a shared file cut short is named at the next call and at
    remove()."""
    for said in faults:
        assert "cannot page-lock memory shared by the ranks" in said["refused"], said["refused"]
        assert "share_between_ranks=False" in said["refused"] and said["untouched"]
        assert said["victim"] in said["cut short"] and "truncated" in said["cut short"], said["cut short"]
        assert said["victim"] in said["removed"] and "except 1 group" in said["removed"], said["removed"]


def load_quantized(rank: int, world: int, folder: str, storages: tuple[str, ...]) -> dict:
    """Each rank loads the saved transformer straight into a quantized mode with each storage: how many components
    it packed and how many it found packed by another rank, the files its packed weights view, and its output."""
    import torch.distributed as dist

    import memmode_core as memmode

    results = {}
    for storage in storages:
        handle = memmode.load(folder, "model_group_offload_and_qfloat8", device="cpu", storage=storage)
        output = forward(handle.target)
        made_once = handle.loading.get("packed_once_by_ranks")
        dist.barrier()  # every rank has loaded: the shared files are all there
        shared = sorted(p.name for p in Path(made_once["folder"]).glob("memmode-made-*.safetensors"))
        dist.barrier()
        handle.remove()
        results[storage] = {"output": output, "made once": made_once, "shared files": shared}
    return results


LOADED_INTO = ("ram", "mmap")


def test_ranks_loading_into_a_quantized_mode_pack_each_component_once_per_machine(tmp_path):
    """``load(folder, "..._and_qfloat8")`` on 4 ranks, with ``ram`` and ``mmap``: one rank packs the transformer,
    the other three map its file (one copy in the page cache, the packing's time spent once); every rank's output
    is the single process's; the last rank to leave removes the shared folder."""
    import memmode_core as memmode

    wan_transformer(heads=4).save_pretrained(tmp_path / "model")
    expected = {}
    for storage in LOADED_INTO:
        single = memmode.load(tmp_path / "model", "model_group_offload_and_qfloat8", device="cpu", storage=storage)
        expected[storage] = forward(single.target)
        single.remove()
    ranks = run_ranks(4, load_quantized, str(tmp_path / "model"), LOADED_INTO)
    for storage in LOADED_INTO:
        results = [rank[storage] for rank in ranks]
        for rank, result in enumerate(results):
            assert_bit_equal(result["output"], expected[storage], f"rank {rank}, {storage}")
            assert result["shared files"] == results[0]["shared files"] and len(result["shared files"]) == 1
        made = [r["made once"]["made"] for r in results]
        assert all(r["made once"]["made"] + r["made once"]["found"] == 1 for r in results)
        # the first load packs it once; the second finds that file while a rank still maps it, or packs it once again
        assert sum(made) == 1 if storage == LOADED_INTO[0] else sum(made) <= 1, [r["made once"] for r in results]
        assert not Path(results[0]["made once"]["folder"]).exists(), "the last rank to leave removed the folder"


def packed_in_memory(rank: int, world: int) -> dict:
    """:func:`packed_by_each` with the same weights on every rank, then with weights that differ by rank."""
    return {differ: packed_by_each(rank, differ) for differ in (False, True)}


def packed_by_each(rank: int, weights_differ: bool) -> dict:
    """Ranks quantizing into their own memory: what memmode says, and which file each rank's packed weights are
    mapped from (the same weights are packed once into a file the ranks share; different ones each their own)."""
    import logging

    import torch.distributed as dist

    import memmode_core as memmode

    said: dict[str, list[str]] = {}
    mapped: dict[str, str | None] = {}
    outputs = {}
    for storage in ("ram", "mmap"):
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("memmode").addHandler(handler)
        try:
            model = wan_transformer()
            if weights_differ:
                with torch.no_grad():
                    model.blocks[0].ffn.net[0].proj.weight.add_(rank)
            handle = memmode.apply(model, "model_group_offload_and_qfloat8", device="cpu", storage=storage)
            outputs[storage] = forward(model)
            mapped[storage] = mapped_from(model.blocks[0].ffn.net[0].proj.weight_packed)
            dist.barrier()  # every rank has packed: the files are there for all
            handle.remove()
        finally:
            logging.getLogger("memmode").removeHandler(handler)
        said[storage] = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    return {"said": said, "mapped": mapped, "outputs": outputs}


def test_ranks_packing_into_their_own_memory_share_one_file_of_the_same_weights():
    """``apply(..., "..._and_qfloat8", storage="ram")`` on 2 ranks: weights that hash the same are packed once
    into a file in the machine's shared folder, and every rank's packed layers are mapped from it (one copy in
    the page cache); ranks with different weights each get their own. Nothing needs saying; outputs exact."""
    ranks = run_ranks(2, packed_in_memory)
    for weights_differ in (False, True):
        _check_packed_by_each([rank[weights_differ] for rank in ranks], weights_differ)


def _check_packed_by_each(results: list[dict], weights_differ: bool) -> None:
    import memmode_core as memmode

    for rank, result in enumerate(results):
        model = wan_transformer()
        if weights_differ:
            with torch.no_grad():
                model.blocks[0].ffn.net[0].proj.weight.add_(rank)
        memmode.apply(model, "model_full_load_and_qfloat8", device="cpu")
        expected = forward(model)
        for storage in ("ram", "mmap"):
            assert_bit_equal(result["outputs"][storage], expected, f"rank {rank}, {storage}")
        assert not any("keeps the packed weights" in m for m in result["said"]["ram"] + result["said"]["mmap"])
        assert "memmode-loading-" in result["mapped"]["ram"] and "/memmode-made-" in result["mapped"]["ram"]
    same_file = results[0]["mapped"]["ram"] == results[1]["mapped"]["ram"]
    assert same_file != weights_differ, [r["mapped"]["ram"] for r in results]
