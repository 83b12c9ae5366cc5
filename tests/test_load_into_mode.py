"""Loading straight into a mode: ``memmode.load(folder, mode)`` gives what ``from_pretrained``
followed by ``apply`` gives — bit-equal outputs, the same report — from folders written by
``save_pretrained`` (sharded ones included), without ever holding the model in anonymous memory; quantized
models saved by ``save_quantized`` come back bit-exact; broken and foreign checkpoints are refused by name
with nothing left behind.

Every placement x storage combination runs on one family of a rotation (each family at least once).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline

import memmode_core as memmode
from helpers import (
    ACCELERATOR,
    TINY_PIPELINE_CALL,
    assert_reassociated,
    in_torch_memory,
    nbytes,
    on_accelerator,
    placement_id,
)
from memmode_core import CheckpointError, IncompatibleModeError
from memmode_core.loading.dtypes import pipeline_dtype_keyword
from memmode_core.quantization import packed_record
from tiny_pipelines import FAMILIES, make_pipeline, run

PLACEMENTS = [
    ("model_full_load", {}),
    ("model_cpu_offload", {}),
    ("model_group_offload", {"offload_type": "block_level"}),
    ("model_group_offload", {"offload_type": "leaf_level"}),
    ("sequential_cpu_offload", {}),
    ("text_encoder_offload", {}),
]
STORAGES = ["ram", "disk", "mmap"]

_SAVED: dict = {}
_REFERENCE: dict = {}


def saved_folder(family: str, dtype: torch.dtype = torch.float32, shard: str | None = None) -> Path:
    """The family's tiny pipeline saved with save_pretrained (once per session)."""
    key = (family, dtype, shard)
    if key not in _SAVED:
        folder = Path(tempfile.mkdtemp(prefix=f"memmode-saved-{family}-"))
        atexit.register(shutil.rmtree, folder, True)  # kept for the session's other tests, then removed
        kwargs = {"max_shard_size": shard} if shard else {}
        make_pipeline(family, dtype=dtype).save_pretrained(folder, **kwargs)
        _SAVED[key] = folder
    return _SAVED[key]


def from_pretrained(folder: Path, torch_dtype: torch.dtype | None = None):
    # under the keyword the installed diffusers takes (before 0.40, it ignores ``dtype``), as load passes it on
    pipe = DiffusionPipeline.from_pretrained(folder, **({pipeline_dtype_keyword(): torch_dtype} if torch_dtype else {}))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(family: str, folder: Path, torch_dtype=None, mode: str | None = None, **kwargs) -> torch.Tensor:
    """The output of from_pretrained (then ``apply(mode)`` if given): what load must reproduce."""
    key = (family, str(folder), torch_dtype, mode, tuple(sorted(kwargs.items())))
    if key not in _REFERENCE:
        pipe = from_pretrained(folder, torch_dtype)
        if mode is not None:
            memmode.apply(pipe, mode, device="cpu", **kwargs)
        _REFERENCE[key] = run(pipe, family)
    return _REFERENCE[key]


def loaded_output(handle, family: str) -> torch.Tensor:
    handle.target.set_progress_bar_config(disable=True)
    return run(handle.target, family)


def _cases() -> list:
    combos = [
        (mode, options, storage)
        for mode, options in PLACEMENTS
        for storage in (STORAGES if mode != "model_full_load" else [None])
    ]
    families = sorted(FAMILIES)
    return [
        pytest.param(
            families[j % len(families)],
            mode,
            options,
            storage,
            id=f"{families[j % len(families)]}-{placement_id((mode, options))}-{storage}",
        )
        for j, (mode, options, storage) in enumerate(combos)
    ]


@pytest.mark.parametrize("family, mode, options, storage", _cases())
def test_every_placement_and_storage_equals_from_pretrained(family, mode, options, storage, tmp_path):
    folder = saved_folder(family)
    kwargs = {"storage": storage} if storage else {}
    if storage in ("disk", "mmap"):
        kwargs["offload_dir"] = tmp_path / "offload"
    handle = memmode.load(folder, mode, device="cpu", **kwargs, **options)
    assert handle.mode.startswith(mode)
    expected = reference(family, folder, None, mode, **({"storage": storage} if storage else {}), **options)
    assert torch.equal(loaded_output(handle, family), expected)
    handle.remove()
    assert not list(tmp_path.rglob("memmode-loading-*")), "streamed files are never left behind"


def test_the_rotation_covers_every_combination_and_family():
    cases = [case.values for case in _cases()]
    assert {f for f, *_ in cases} == set(FAMILIES)
    assert len({(m, placement_id((m, o)), s) for _, m, o, s in cases}) == len(cases)


@pytest.mark.parametrize("storage", STORAGES)
def test_the_report_is_the_one_apply_gives(storage, tmp_path):
    family, mode = "flux", "model_group_offload_and_qfloat8"
    folder = saved_folder(family)
    pipe = from_pretrained(folder)
    applied = memmode.apply(pipe, mode, device="cpu", storage=storage)
    expected = run(pipe, family)
    loaded = memmode.load(folder, mode, device="cpu", storage=storage)
    assert torch.equal(loaded_output(loaded, family), expected)
    want, got = applied.report().as_dict(), loaded.report().as_dict()
    for key in want:
        if key not in ("transfer_seconds", "storage_bytes", "loading"):
            assert got[key] == want[key], key
    assert want["loading"] == {} and got["loading"]["quantized_bytes"] > 0, "only load says what it staged"
    # the storage holds the same groups, alike: those kept in place in the streamed qfloat8 file are counted as
    # borrowed instead of written (apply streams its packing too, when the storage is not ram)
    stored, kept = want["storage_bytes"], got["storage_bytes"]
    assert kept == stored
    if storage != "ram":
        assert stored["borrowed_bytes"] > 0 and stored["borrowed_groups"] > 0


@pytest.mark.parametrize(
    "saved_dtype, torch_dtype",
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
    ids=["bf16-saved-as-fp32", "fp32-saved-as-bf16"],
)
def test_a_dtype_conversion_streams_and_equals_from_pretrained(saved_dtype, torch_dtype, tmp_path):
    family = "wan22"
    folder = saved_folder(family, saved_dtype)
    handle = memmode.load(
        folder, "model_group_offload", device="cpu", storage="mmap", torch_dtype=torch_dtype, staging_dir=tmp_path
    )
    assert {p.dtype for p in handle.target.transformer.parameters()} >= {torch_dtype}
    expected = reference(family, folder, torch_dtype, "model_group_offload", storage="mmap")
    assert torch.equal(loaded_output(handle, family), expected)
    assert list(tmp_path.iterdir()) == [], "the streamed conversion file is unlinked once mapped"


@pytest.mark.parametrize("storage", ["disk", "mmap"])
def test_a_sharded_checkpoint_loads(storage):
    family = "qwenimage"
    folder = saved_folder(family, shard="20KB")
    assert list((folder / "transformer").glob("*.index.json")), "the transformer is sharded"
    handle = memmode.load(folder, "model_group_offload", device="cpu", storage=storage)
    expected = reference(family, folder, None, "model_group_offload", storage=storage)
    assert torch.equal(loaded_output(handle, family), expected)


@pytest.mark.parametrize("quantizer", ["qfloat8", "qfloat4"])
def test_quantizing_while_loading_equals_apply_after_load(quantizer):
    family = "sd3"
    folder = saved_folder(family)
    mode = f"model_cpu_offload_and_{quantizer}"
    handle = memmode.load(folder, mode, device="cpu")
    assert torch.equal(loaded_output(handle, family), reference(family, folder, None, mode))
    assert handle.report().quantization["transformer"]["packed_layers"] > 0


# -- saved quantized models --------------------------------------------------------------------------


@pytest.mark.parametrize("quantizer", ["qfloat8", "qfloat4"])
def test_a_saved_quantized_pipeline_round_trips_bit_exact(quantizer, tmp_path):
    family = "wan22"
    mode = f"model_group_offload_and_{quantizer}"
    pipe = from_pretrained(saved_folder(family))
    handle = memmode.apply(pipe, mode, device="cpu", storage="disk")
    expected = run(pipe, family)
    handle.save(tmp_path / "saved")  # while placed: offloaded weights are read back from the files
    handle.remove()
    packed = {k: v.clone() for k, v in pipe.transformer.state_dict().items() if k.endswith(("_packed", "_scale"))}
    assert packed
    meta = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert meta["_class_name"] == type(pipe).__name__
    for storage in ("ram", "mmap"):
        loaded = memmode.load(tmp_path / "saved", mode, device="cpu", storage=storage)
        assert torch.equal(loaded_output(loaded, family), expected)
        summary = loaded.report().quantization["transformer"]
        assert summary["packed_layers"] == 0 and summary["already_packed_layers"] > 0, "nothing quantized again"
        loaded.remove()
        got = loaded.target.transformer.state_dict()
        for key, value in packed.items():
            assert torch.equal(got[key], value), key


def test_a_saved_quantized_model_loads_without_a_quantizer_in_the_mode(tmp_path):
    family = "wan22"
    pipe = from_pretrained(saved_folder(family))
    memmode.apply(pipe, "model_full_load_and_qfloat8", device="cpu")
    memmode.save_quantized(pipe, tmp_path)
    expected = loaded_output(memmode.load(tmp_path, "model_cpu_offload_and_qfloat8", device="cpu"), family)
    loaded = memmode.load(tmp_path, "model_cpu_offload", device="cpu")
    assert torch.equal(loaded_output(loaded, family), expected)
    assert "transformer" not in loaded.report().quantization
    assert any(packed_record(m) is not None for m in loaded.target.transformer.modules())


def test_a_saved_format_the_mode_does_not_write_is_refused(tmp_path):
    pipe = from_pretrained(saved_folder("wan22"))
    memmode.apply(pipe, "model_full_load_and_qfloat8", device="cpu")
    memmode.save_quantized(pipe, tmp_path)
    with pytest.raises(IncompatibleModeError, match="saved quantized in qfloat8"):
        memmode.load(tmp_path, "model_cpu_offload_and_qfloat4", device="cpu")


def test_a_format_no_installed_quantizer_reads_is_refused_by_name(tmp_path):
    pipe = from_pretrained(saved_folder("wan22"))
    memmode.apply(pipe, "model_full_load_and_qfloat8", device="cpu")
    memmode.save_quantized(pipe, tmp_path)
    weights = tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"
    raw = weights.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    header["__metadata__"]["memmode.format"] = "qint3"
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (length - len(text))
    assert len(text) == length
    weights.write_bytes(raw[:8] + text + raw[8 + length :])
    with pytest.raises(CheckpointError, match="'qint3', which no installed quantizer reads"):
        memmode.load(tmp_path, "model_cpu_offload", device="cpu")


# -- broken and foreign checkpoints ------------------------------------------------------------------


def copy_of(folder: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(folder, target)
    return target


def test_a_truncated_shard_is_refused_naming_it_with_nothing_left_behind(tmp_path):
    folder = copy_of(saved_folder("qwenimage", shard="20KB"), tmp_path)
    shard = sorted((folder / "transformer").glob("*-00002-of-*.safetensors"))[0]
    os.truncate(shard, shard.stat().st_size - 100)
    staging = tmp_path / "staging"
    staging.mkdir()
    with pytest.raises(CheckpointError, match=f"{shard.name} is truncated"):
        memmode.load(
            folder,
            "model_group_offload",
            device="cpu",
            storage="disk",
            offload_dir=tmp_path / "offload",
            staging_dir=staging,
            torch_dtype=torch.bfloat16,
        )
    assert list(staging.iterdir()) == [] and not (tmp_path / "offload").exists()


def test_a_missing_tensor_is_refused_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_of(saved_folder("flux"), tmp_path)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    dropped = sorted(tensors)[3]
    del tensors[dropped]
    save_file(tensors, weights)
    with pytest.raises(CheckpointError, match=f"{dropped}: missing from the checkpoint"):
        memmode.load(folder, "model_cpu_offload", device="cpu")


@pytest.mark.parametrize("damage", ["garbage", "bin-only", "bad-header"])
def test_foreign_files_are_refused(damage, tmp_path):
    folder = copy_of(saved_folder("flux"), tmp_path)
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    if damage == "garbage":
        weights.write_bytes(os.urandom(64))
        match = "not a safetensors file"
    elif damage == "bin-only":
        weights.rename(weights.with_suffix(".bin"))
        match = "only safetensors checkpoints"
    else:
        raw = weights.read_bytes()
        weights.write_bytes(raw[:8] + b"{not json" + raw[17:])
        match = "not valid JSON"
    with pytest.raises(CheckpointError, match=match):
        memmode.load(folder, "model_group_offload", device="cpu")


def test_bad_arguments_are_refused_before_reading_anything(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or folder"):
        memmode.load(tmp_path / "nothing", "model_cpu_offload")
    with pytest.raises(memmode.UnknownModeError):
        memmode.load(saved_folder("flux"), "model_cpu_ofload")
    with pytest.raises(memmode.InvalidOptionError):
        memmode.load(saved_folder("flux"), "model_group_offload", num_blocks_per_grup=2)
    with pytest.raises(TypeError):
        memmode.load(saved_folder("flux"), 3)


# -- memory ------------------------------------------------------------------------------------------


_PEAK_SCRIPT = textwrap.dedent("""
    import gc, sys, threading, time, torch, memmode_core as memmode
    # what a load imports, imported before the baseline: diffusers' model class pulls in the quantization
    # libraries installed beside it (bitsandbytes, torchao, modelopt: 2,700 modules, 165 MiB), not the load's cost
    import diffusers; diffusers.WanTransformer3DModel
    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    peak = [0]; done = threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon()); time.sleep(0.005)
    threading.Thread(target=sample, daemon=True).start()
    for storage in sys.argv[2:]:
        gc.collect(); base = anon(); peak[0] = base
        handle = memmode.load(sys.argv[1], "model_group_offload", device="cpu", storage=storage,
                              offload_dir=f"{sys.argv[1]}-{storage}", in_place=False)
        peak[0] = max(peak[0], anon())
        print(storage, peak[0] - base)
        handle.remove(); del handle
    done.set()
""")


def test_peak_memory_while_loading_is_a_few_groups_not_the_model(tmp_path):
    """A 297 MiB transformer of 12 blocks (24 MiB each) loads into disk and mmap with at most 3 groups + 48 MiB
    of anonymous memory, 40% of the model, every group written (in_place=False: the path that copies the
    most), each in a fresh interpreter. Measured precisely, with the targets, in benchmarks/load_into_mode.py."""
    from diffusers import WanTransformer3DModel

    from tiny_components import WAN_TRANSFORMER, configured

    folder = tmp_path / "model"
    wide = {"num_attention_heads": 8, "attention_head_dim": 64, "text_dim": 64, "freq_dim": 64, "ffn_dim": 4096}
    model = configured(
        WanTransformer3DModel, WAN_TRANSFORMER, wide, {"in_channels": 4, "out_channels": 4, "num_layers": 12}
    )()
    model.save_pretrained(folder)
    block = nbytes(model.blocks[0].parameters())
    total = nbytes(model.parameters())
    del model
    assert total > 12 * block
    # one child per storage, started together: in one child the second load's baseline depended on when the
    # C heap gave back the first model's restored weights (measured 8 KiB to 300 MiB for the same load)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _PEAK_SCRIPT, str(folder), storage],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for storage in ("disk", "mmap")
    ]
    peaks = {}
    for child in children:
        stdout, stderr = child.communicate(timeout=300)
        assert child.returncode == 0, stderr[-2000:]
        peaks.update(line.split() for line in stdout.strip().splitlines())
    assert set(peaks) == {"disk", "mmap"}
    for storage, peak in peaks.items():
        assert int(peak) <= 3 * block + (48 << 20), (
            f"{storage}: peak {int(peak) / 2**20:.0f} MiB; a group is "
            f"{block / 2**20:.0f} MiB, the model {total / 2**20:.0f} MiB"
        )


# -- groups stored in place: the checkpoint is the offloaded copy ------------------------------------


def _weights_bytes(folder: Path, names=("transformer", "transformer_2")) -> int:
    return sum(f.stat().st_size for name in names for f in (folder / name).glob("*.safetensors"))


@pytest.mark.parametrize("storage", ["disk", "mmap"])
def test_a_checkpoint_memmode_wrote_is_stored_in_place_with_nothing_written(storage, tmp_path):
    """A save_quantized checkpoint aligns every tensor to 64 bytes, as memmode's group files do: the file
    storages keep its pages as the offloaded copy (no group file written for the transformers) and the
    output is bit-equal to the one from the pipeline that was saved."""
    family, mode = "wan22", "model_group_offload_and_qfloat8"
    pipe = from_pretrained(saved_folder(family))
    memmode.apply(pipe, mode, device="cpu", storage=storage)
    expected = run(pipe, family)
    memmode.save_quantized(pipe, tmp_path / "saved")
    loaded = memmode.load(tmp_path / "saved", mode, device="cpu", storage=storage, offload_dir=tmp_path / "offload")
    assert torch.equal(loaded_output(loaded, family), expected)
    stats = loaded.report().storage_bytes
    assert stats["borrowed_bytes"] >= 0.9 * _weights_bytes(tmp_path / "saved"), stats
    assert stats["disk_bytes"] < _weights_bytes(tmp_path / "saved", ("text_encoder", "vae")) * 1.1, (
        "only the components saved by save_pretrained (not 64-byte aligned) are written"
    )


def test_a_streamed_conversion_is_stored_in_place(tmp_path):
    """bfloat16 weights loaded as float32 are converted into a streamed file (mapped, unlinked); the mmap
    storage keeps that mapping as the offloaded copy instead of writing the converted weights again. The
    transformers' groups hold tensors the checkpoint already had in float32 (Wan's _keep_in_fp32_modules),
    8-byte aligned in a file from save_pretrained: those groups are written, as on any CPU load."""
    family = "wan22"
    folder = saved_folder(family, torch.bfloat16)
    handle = memmode.load(
        folder,
        "model_group_offload",
        device="cpu",
        storage="mmap",
        torch_dtype=torch.float32,
        offload_dir=tmp_path / "offload",
    )
    stats = handle.report().storage_bytes
    converted = sum(
        p.numel() * 4 for name in ("vae", "text_encoder") for p in getattr(handle.target, name).parameters()
    )
    assert stats["borrowed_bytes"] >= converted and stats["disk_bytes"] > 0, stats
    expected = reference(family, folder, torch.float32, "model_group_offload", storage="mmap")
    assert torch.equal(loaded_output(handle, family), expected)


def test_a_checkpoint_from_elsewhere_is_written_on_a_cpu_compute_device():
    """safetensors files from save_pretrained align tensors to 8 bytes only: computing on them in place could
    change bits on the CPU (another GEMV path), so their groups are written as usual."""
    handle = memmode.load(saved_folder("flux"), "model_group_offload", device="cpu", storage="mmap")
    stats = handle.report().storage_bytes
    assert stats["borrowed_bytes"] == 0 and stats["disk_bytes"] > 0


@pytest.mark.parametrize("storage", ["disk", "mmap"])
def test_the_groups_written_from_a_checkpoint_are_named_by_what_they_hold(storage):
    """The weights a load writes into group files are hashed as they are written, in the background; each file is
    named by what it holds (``verify="hash"`` checks each name against the bytes at every onload), and outputs
    equal from_pretrained + apply."""
    family = "flux"
    handle = memmode.load(saved_folder(family), "model_group_offload", device="cpu", storage=storage, verify="hash")
    stats = handle.report().storage_bytes
    assert stats["borrowed_bytes"] == 0 and stats["disk_bytes"] > 0
    expected = reference(family, saved_folder(family), None, "model_group_offload", storage=storage)
    assert torch.equal(loaded_output(handle, family), expected)


@pytest.mark.parametrize("storage", ["disk", "mmap"])
def test_apply_after_from_pretrained_stores_what_memory_holds_not_what_the_file_holds(storage):
    """After from_pretrained the weights are views of the checkpoint mapped privately; a weight changed in place
    since (copy-on-write pages: the file still holds the old values) is stored changed. Outputs equal the
    changed model's, fully loaded in torch memory (64-byte aligned, as the storage's files: the mapped views
    are not, and CPU kernels may round differently there), and every name matches its file's bytes
    (``verify="hash"``)."""
    family = "flux"
    changed = "transformer.transformer_blocks.0.ff.net.0.proj.weight"

    def loaded():
        pipe = from_pretrained(saved_folder(family))
        with torch.no_grad():
            pipe.transformer.get_parameter(changed.split(".", 1)[1]).mul_(2.0)  # in place: copy-on-write pages
        return pipe

    expected = run(in_torch_memory(loaded()), family)
    pipe = loaded()
    memmode.apply(pipe, "model_group_offload", device="cpu", storage=storage, verify="hash")
    assert torch.equal(run(pipe, family), expected)


@pytest.mark.parametrize("storage", ["disk", "mmap"])
def test_a_borrowed_checkpoint_changed_after_loading_is_refused_naming_it(storage, tmp_path):
    family, mode = "wan22", "model_cpu_offload_and_qfloat8"
    pipe = from_pretrained(saved_folder(family))
    memmode.apply(pipe, mode, device="cpu")
    memmode.save_quantized(pipe, tmp_path / "saved")
    loaded = memmode.load(tmp_path / "saved", mode, device="cpu", storage=storage)
    assert loaded.report().storage_bytes["borrowed_bytes"] > 0
    weights = tmp_path / "saved" / "transformer" / "diffusion_pytorch_model.safetensors"
    os.truncate(weights, weights.stat().st_size - 64)
    with pytest.raises(memmode.StorageUnavailableError, match=f"{weights}.*changed since it was loaded"):
        loaded_output(loaded, family)


@on_accelerator
@pytest.mark.parametrize("in_place", [pytest.param(None, id="default"), pytest.param(True, id="forced")])
def test_any_checkpoint_is_stored_in_place_on_the_accelerator(in_place, strict_streams):
    """On an accelerator every onload copies into fresh device memory: checkpoints from any tool are borrowed
    whatever their alignment (``in_place=True`` forces it anywhere), uploaded from the checkpoint's own pages
    through the staging ring, and outputs equal from_pretrained + apply."""
    family = "flux"
    folder = saved_folder(family)
    handle = memmode.load(folder, "model_group_offload", device=ACCELERATOR, storage="disk", in_place=in_place)
    assert handle.report().storage_bytes["borrowed_bytes"] > 0
    pipe = from_pretrained(folder)
    memmode.apply(pipe, "model_group_offload", device=ACCELERATOR, storage="disk")
    assert torch.equal(loaded_output(handle, family), run(pipe, family))
    if strict_streams is not None:
        assert strict_streams.counts["async_copies"] > 0 and strict_streams.counts["pinned_copies"] > 0


def test_a_checkpoint_with_legacy_names_is_loaded_by_its_library(tmp_path, caplog):
    """An AutoencoderKL saved before diffusers renamed its attention weights (query/key/value/proj_attn):
    diffusers converts the names while loading, so the VAE is loaded by diffusers itself (an info line says
    so) and the pipeline is still what from_pretrained + apply gives."""
    import logging

    from safetensors.torch import load_file, save_file

    family = "flux"
    folder = copy_of(saved_folder(family), tmp_path)
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    legacy = {".to_q.": ".query.", ".to_k.": ".key.", ".to_v.": ".value.", ".to_out.0.": ".proj_attn."}
    tensors = {}
    for key, value in load_file(weights).items():
        if ".attentions." in key:
            for new, old in legacy.items():
                key = key.replace(new, old)
        tensors[key] = value
    assert any(".query." in k for k in tensors)
    save_file(tensors, weights)
    with caplog.at_level(logging.INFO, logger="memmode"):
        handle = memmode.load(folder, "model_cpu_offload", device="cpu", storage="mmap")
    assert "vae (AutoencoderKL) is loaded by diffusers itself" in caplog.text
    expected = reference(family, folder, None, "model_cpu_offload", storage="mmap")
    assert torch.equal(loaded_output(handle, family), expected)


def test_one_model_folder_loads_into_a_mode_and_joins_from_pretrained():
    """A single model folder (config.json) loads straight into a mode; passed to from_pretrained as that
    component, it makes the pipeline that only the big model was ever kept out of RAM for."""
    family = "flux"
    folder = saved_folder(family)
    handle = memmode.load(folder / "transformer", "model_group_offload", device="cpu", storage="mmap")
    assert type(handle.target).__name__ == "FluxTransformer2DModel"
    pipe = DiffusionPipeline.from_pretrained(folder, transformer=handle.target)
    pipe.set_progress_bar_config(disable=True)
    reference_pipe = from_pretrained(folder)
    memmode.apply(reference_pipe.transformer, "model_group_offload", device="cpu", storage="mmap")
    assert torch.equal(run(pipe, family), run(reference_pipe, family))


_KILLED_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    import memmode_core as memmode
    from memmode_core.files import streamed
    real, calls = streamed.StreamedFile.write, []
    def write(self, tensors):
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGKILL)  # half-way through streaming a conversion
        real(self, tensors)
    streamed.StreamedFile.write = write
    memmode.load(sys.argv[1], "model_group_offload", device="cpu", storage="disk", offload_dir=sys.argv[2],
                 torch_dtype=torch.float32)
""")


def test_a_load_killed_while_streaming_leaves_nothing_behind(tmp_path):
    """kill -9 in the middle of a streamed conversion: the streamed file was unlinked when created, so the
    folder it was written in holds nothing afterwards."""
    folder = saved_folder("wan22", torch.bfloat16)
    offload = tmp_path / "offload"
    out = subprocess.run(
        [sys.executable, "-c", _KILLED_SCRIPT, str(folder), str(offload)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == -9, out.stderr[-2000:]
    assert list(offload.iterdir()) == []


@pytest.mark.parametrize("in_place", [True, False])
def test_in_place_can_be_forced_or_refused(in_place, tmp_path):
    """``in_place=True`` keeps even an 8-byte aligned checkpoint's pages as the offloaded copy on the CPU
    (outputs then match from_pretrained + apply to the last bits, not bit for bit); ``False`` writes every
    group, memmode's own checkpoints included."""
    family = "flux"
    folder = saved_folder(family)
    handle = memmode.load(
        folder, "model_group_offload", device="cpu", storage="mmap", in_place=in_place, offload_dir=tmp_path / "offload"
    )
    stats = handle.report().storage_bytes
    if in_place:
        assert stats["borrowed_bytes"] > 0.9 * _weights_bytes(folder, ("transformer", "vae", "text_encoder"))
        expected = reference(family, folder, None, "model_group_offload", storage="mmap")
        # the checkpoint's own pages at their 8-byte alignment, the reference's copies at another: other sums
        assert_reassociated(loaded_output(handle, family), expected, **TINY_PIPELINE_CALL)
    else:
        assert stats["borrowed_bytes"] == 0 and stats["disk_bytes"] > 0
    with pytest.raises(memmode.InvalidOptionError, match="in_place"):
        memmode.load(folder, "model_group_offload", in_place="yes")


def test_groups_kept_in_place_need_no_room_in_the_offload_folder(tmp_path, monkeypatch):
    """The offload folder's disk has 64 KiB free: a load that keeps every group in the checkpoint's pages
    needs none of it, where writing the groups is refused up front, before anything is written."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    offload = tmp_path / "offload"
    monkeypatch.setattr(
        shutil,
        "disk_usage",
        lambda path: (
            usage(1 << 30, (1 << 30) - (64 << 10), 64 << 10) if str(path).startswith(str(tmp_path)) else real(path)
        ),
    )
    family = "flux"
    folder = saved_folder(family)
    handle = memmode.load(
        folder, "model_group_offload", device="cpu", storage="disk", offload_dir=offload, in_place=True
    )
    stats = handle.report().storage_bytes
    assert stats["disk_bytes"] == 0 and stats["borrowed_bytes"] > 0, stats
    expected = reference(family, folder, None, "model_group_offload", storage="disk")
    assert_reassociated(loaded_output(handle, family), expected, **TINY_PIPELINE_CALL)  # kept in place: see above
    with pytest.raises(memmode.StorageUnavailableError, match="free"):
        memmode.load(
            folder, "model_group_offload", device="cpu", storage="disk", offload_dir=tmp_path / "o2", in_place=False
        )
    assert not list((tmp_path / "o2").glob("memmode-*"))
    # the default keeps only what cannot change a bit in place (on the CPU: not this 8-byte aligned
    # checkpoint), so a group has to be written and its own room check refuses it; nothing is left behind
    with pytest.raises(memmode.StorageUnavailableError, match="the next group needs"):
        memmode.load(folder, "model_group_offload", device="cpu", storage="disk", offload_dir=tmp_path / "o3")
    assert not list((tmp_path / "o3").glob("memmode-*"))


# -- the libraries as installed: what an update of diffusers or transformers changes ----------------------


def _from_pretrained_then_apply(folder: Path, mode: str, **kwargs):
    pipe = from_pretrained(folder)
    memmode.apply(pipe, mode, device="cpu", **kwargs)
    return pipe


@pytest.mark.parametrize("hub_kernels", ["1", "0"], ids=["hub-kernels-on", "hub-kernels-off"])
def test_load_equals_from_pretrained_with_hub_kernels_on_and_off(hub_kernels, monkeypatch):
    """transformers 5.25 hands every model it loads to the hub kernels library (``USE_HUB_KERNELS``, on by
    default), which refuses the meta device load builds on: load still gives from_pretrained + apply's model,
    kernelized as from_pretrained kernelizes it, under either setting and any release."""
    monkeypatch.setenv("USE_HUB_KERNELS", hub_kernels)
    family = "wan22"
    folder = saved_folder(family)
    expected = _from_pretrained_then_apply(folder, "model_group_offload")
    handle = memmode.load(folder, "model_group_offload", device="cpu")
    got = handle.target
    assert type(got.text_encoder) is type(expected.text_encoder)
    assert getattr(got.text_encoder, "use_kernels", None) == getattr(expected.text_encoder, "use_kernels", None)
    assert torch.equal(loaded_output(handle, family), run(expected, family))


def test_a_library_that_kernelizes_what_it_loads_is_followed_after_binding(monkeypatch):
    """The transformers 5.25 behaviour, on any release: a meta build that kernelizes fails as the kernels library
    fails, one with ``use_kernels=False`` works; load builds the second and kernelizes once the weights are bound
    (the call from_pretrained makes, on the CPU), so nothing is refused and nothing differs."""
    from transformers import UMT5EncoderModel

    real = UMT5EncoderModel.from_pretrained.__func__
    calls = []

    def from_pretrained_that_kernelizes(cls, *args, use_kernels=None, **kwargs):
        if kwargs.get("device_map") == "meta" and use_kernels is not False:
            raise ValueError("Unsupported device type 'meta'. Supported device types are: cpu, cuda")
        return real(cls, *args, **kwargs, **({} if use_kernels is None else {"use_kernels": use_kernels}))

    def set_use_kernels(self, use_kernels, *args, **kwargs):
        calls.append((use_kernels, {p.device.type for p in self.parameters()}))

    monkeypatch.setattr(UMT5EncoderModel, "from_pretrained", classmethod(from_pretrained_that_kernelizes))
    monkeypatch.setattr(UMT5EncoderModel, "set_use_kernels", set_use_kernels, raising=False)
    family = "wan22"
    folder = saved_folder(family)
    handle = memmode.load(folder, "model_cpu_offload", device="cpu")
    # (a release that does not kernelize calls set_use_kernels(False) itself)
    assert [call for call in calls if call[0]] == [(True, {"cpu"})], "kernelized once, its weights bound on the CPU"
    monkeypatch.undo()
    assert torch.equal(
        loaded_output(handle, family), run(_from_pretrained_then_apply(folder, "model_cpu_offload"), family)
    )


def test_a_library_that_cannot_build_a_skeleton_is_a_typed_error_naming_the_component_and_version(
    tmp_path, monkeypatch
):
    import transformers
    from transformers import UMT5EncoderModel

    def refuses(cls, *args, **kwargs):
        raise ValueError("Unsupported device type 'meta'")

    monkeypatch.setattr(UMT5EncoderModel, "from_pretrained", classmethod(refuses))
    folder = saved_folder("wan22")
    with pytest.raises(memmode.ModelBuildError) as refused:
        memmode.load(folder, "model_group_offload", device="cpu", storage="disk", offload_dir=tmp_path / "offload")
    error = refused.value
    assert isinstance(error, CheckpointError)
    assert (error.component, error.library, error.library_version) == (
        "text_encoder",
        "transformers",
        transformers.__version__,
    )
    message = str(error)
    assert "text_encoder" in message and f"transformers {transformers.__version__}" in message
    assert "UMT5EncoderModel" in message and "Unsupported device type 'meta'" in message
    assert not (tmp_path / "offload").exists() or not list((tmp_path / "offload").iterdir())


def test_dtype_is_torch_dtype_under_diffusers_current_name(tmp_path):
    family = "wan22"
    folder = saved_folder(family)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # diffusers warns for torch_dtype; load must not make it warn
        handle = memmode.load(folder, "model_group_offload", device="cpu", dtype=torch.bfloat16, staging_dir=tmp_path)
    assert {p.dtype for p in handle.target.transformer.parameters()} >= {torch.bfloat16}
    expected = reference(family, folder, torch.bfloat16, "model_group_offload")
    assert torch.equal(loaded_output(handle, family), expected)
    with pytest.raises(memmode.InvalidOptionError, match="one argument under two names"):
        memmode.load(folder, "model_group_offload", dtype=torch.bfloat16, torch_dtype=torch.float32)
    with pytest.raises(memmode.InvalidOptionError, match="dtype="):
        memmode.load(folder, "model_group_offload", dtype="float16")
