"""Each road a user takes with a pipeline loaded from community files (GGUF, city96's converter): its layers rest
packed as the file encoded them (:mod:`memmode_core.quantization.packed`, a reader's codec decoding them), the same
machinery as memmode's own quantizers, so each road must work as it does for ``qfloat8``:

- **LoRA** (diffusers' ``load_lora_weights``, peft): the output is the dequantized weights' plus the adapter's,
  under a full load and under group offload with a file storage; ``fuse_lora`` is refused, typed;
  ``unload_lora_weights`` gives the output without the adapter back bit for bit; hot swapping an adapter and
  switching between two (``set_adapters``) work;
- **reads outside the forward**: ``state_dict()`` and a parent reading a child's ``weight`` get the dequantized
  value (gguf-py's, in the model's dtype), never the NaN of the stand-in's metadata, under a storage that
  offloads too;
- **saving**: ``save_pretrained`` is refused, typed, before anything is written; ``memmode.save_quantized`` writes
  the layers as the file encoded them (each in its own format), and ``load`` reads them back packed, to the same
  output bit for bit;
- **torch.compile** of a transformer placed by group offload gives the uncompiled output;
- **ranks**: two gloo ranks each load the same files into a mode with ``mmap``: each gives the single process's
  output, and each one's packed payloads are views of the GGUF file's pages, not copies;
- **auto**: ``load(folder, "auto", vram_budget=...)`` prices the modes from the file's packed sizes, and the mode
  it chooses gives the full load's output.

The fixture is ``community_pipelines``' Wan 2.2 pipeline whose two transformers are GGUF files holding every GGML
type.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline

import community_pipelines
import memmode_core as memmode
from community_pipelines import (
    FAMILY,
    WIDE_WAN_CALL,
    GgufPipeline,
    full_load_output,
    load,
    lora_targets,
    make_lora,
    packed_layers,
)
from gguf_files import reference_dequantize
from helpers import assert_bit_equal, assert_reassociated, mapped_from
from memmode_core import CheckpointError, IncompatibleModeError, PluginNotInstalledError
from memmode_core.discovery import plugins
from memmode_core.quantization import packed_record, saved
from original_checkpoints import PREFIX
from ranks import distributed_available, run_ranks
from tiny_pipelines import run

DENOISERS = ("transformer", "transformer_2")


@pytest.fixture
def gguf_pipeline() -> GgufPipeline:
    return community_pipelines.gguf_pipeline()


def placed(gguf_pipeline: GgufPipeline, mode: str, storage: str | None, tmp_path: Path, **options):
    """The GGUF pipeline loaded into ``mode`` (with ``storage``, its files under ``tmp_path``), ready to call."""
    if storage is not None:
        options["storage"] = storage
        if storage != "ram":
            options["offload_dir"] = str(tmp_path / "offload")
    handle = load(gguf_pipeline, mode, **options)
    handle.target.set_progress_bar_config(disable=True)
    return handle


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """As close as the independent reference is to the full load (test_load_single_file): the reference's weights
    are the same values in other tensors, so its matmuls sum otherwise (one LoRA's sums ride on the same layers)."""
    assert_reassociated(got, expected, **WIDE_WAN_CALL)


# -- the independent reference: gguf-py's dequantization, mapped by diffusers' own converter -----------------


@cache
def reference_values(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF file at ``path`` as gguf-py dequantizes it (float32), under diffusers' names."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    values = reference_dequantize(path)
    converted = convert_wan_transformer_to_diffusers({k.removeprefix(PREFIX): v for k, v in values.items()})
    return {key: value.float() for key, value in converted.items()}


def reference_pipeline(gguf_pipeline: GgufPipeline) -> DiffusionPipeline:
    """A fresh pipeline (no memmode) whose transformers hold :func:`reference_values` at full precision."""
    pipe = DiffusionPipeline.from_pretrained(gguf_pipeline.folder)
    pipe.set_progress_bar_config(disable=True)
    for name, path in gguf_pipeline.files.items():
        getattr(pipe, name).load_state_dict(reference_values(path), strict=True)
    return pipe


# -- LoRA -------------------------------------------------------------------------------------------------------


def load_lora(pipe, adapter_name: str, seed: int, **kwargs) -> None:
    """The adapter into both experts (one ``load_lora_weights`` call each, as Wan's loader takes them)."""
    pipe.load_lora_weights(make_lora(seed), adapter_name=adapter_name, **kwargs)
    pipe.load_lora_weights(make_lora(seed + 1), adapter_name=adapter_name, load_into_transformer_2=True, **kwargs)


_WITH_LORA: dict[tuple[str, int], torch.Tensor] = {}


def with_lora(gguf_pipeline: GgufPipeline, how: str, seed: int) -> torch.Tensor:
    """The output with the adapter of ``seed``: on the reference pipeline (``how="reference"``), or on the files
    loaded under ``model_full_load`` (``"full"``); computed once."""
    if (how, seed) not in _WITH_LORA:
        if how == "reference":
            pipe = reference_pipeline(gguf_pipeline)
        else:
            pipe = load(gguf_pipeline, "model_full_load").target
            pipe.set_progress_bar_config(disable=True)
        load_lora(pipe, "first", seed)
        _WITH_LORA[how, seed] = run(pipe, FAMILY)
    return _WITH_LORA[how, seed]


LORA_MODES = [("model_full_load", None), ("model_group_offload", "disk"), ("model_group_offload", "mmap")]


@pytest.mark.parametrize(("mode", "storage"), LORA_MODES, ids=[f"{m}-{s}" for m, s in LORA_MODES])
def test_a_lora_runs_on_the_dequantized_weights_fusing_is_refused_unloading_gives_the_output_back(
    gguf_pipeline, mode, storage, tmp_path
):
    handle = placed(gguf_pipeline, mode, storage, tmp_path)
    pipe = handle.target
    formats = packed_layers(pipe.transformer)
    load_lora(pipe, "first", seed=1)
    got = run(pipe, FAMILY)
    close(got, with_lora(gguf_pipeline, "reference", 1))
    assert_bit_equal(got, with_lora(gguf_pipeline, "full", 1), f"{mode} {storage} with the adapter")
    assert (got - full_load_output(gguf_pipeline)).abs().max() > 1e-2, "the adapter took effect"
    targets = [path for path, _, _ in lora_targets() if path in formats]
    assert len({formats[path] for path in targets}) > 5, "adapters on layers of many formats"
    for path in targets:
        wrapped = pipe.transformer.get_submodule(path)
        assert packed_record(wrapped.base_layer) is not None, "the adapter wraps the packed layer"
        assert wrapped.lora_A["first"].weight.dtype == torch.float32, "the adapter itself is not quantized"

    with pytest.raises(IncompatibleModeError, match="quantized"):
        pipe.fuse_lora(components=list(DENOISERS))
    assert_bit_equal(run(pipe, FAMILY), got, "after the refused fuse")

    pipe.unload_lora_weights()
    assert_bit_equal(run(pipe, FAMILY), full_load_output(gguf_pipeline), "after unload_lora_weights")
    assert packed_layers(pipe.transformer) == formats, "still packed, every layer in its format"
    handle.remove()


def test_an_adapter_is_hot_swapped_and_two_are_switched_between(gguf_pipeline, tmp_path):
    handle = placed(gguf_pipeline, "model_group_offload", "disk", tmp_path)
    pipe = handle.target
    load_lora(pipe, "first", seed=1)
    first = run(pipe, FAMILY)
    assert_bit_equal(first, with_lora(gguf_pipeline, "full", 1), "the first adapter")

    load_lora(pipe, "first", seed=3, hotswap=True)  # the same adapter's weights replaced in place
    swapped = run(pipe, FAMILY)
    close(swapped, with_lora(gguf_pipeline, "reference", 3))
    assert (swapped - first).abs().max() > 1e-2

    load_lora(pipe, "second", seed=1)  # the first adapter's weights again, beside the hot-swapped ones
    assert_bit_equal(run(pipe, FAMILY), first, "the second adapter, active once loaded")
    pipe.set_adapters("first")
    assert_bit_equal(run(pipe, FAMILY), swapped, "set_adapters('first')")
    pipe.set_adapters("second")
    assert_bit_equal(run(pipe, FAMILY), first, "set_adapters('second')")
    handle.remove()


# -- reads outside the forward --------------------------------------------------------------------------------

READS = [
    ("model_full_load", None, torch.float32, {}),
    ("model_group_offload", "disk", torch.float32, {"offload_type": "leaf_level"}),
    ("model_group_offload", "mmap", torch.bfloat16, {}),
]


@pytest.mark.parametrize(
    ("mode", "storage", "dtype", "options"), READS, ids=[f"{m}-{s}-{str(d)[6:]}" for m, s, d, _ in READS]
)
def test_reads_outside_the_forward_get_the_dequantized_weight(gguf_pipeline, mode, storage, dtype, options, tmp_path):
    handle = placed(gguf_pipeline, mode, storage, tmp_path, torch_dtype=dtype, **options)
    for name in DENOISERS:
        model = getattr(handle.target, name)
        expected = reference_values(gguf_pipeline.files[name])
        formats = packed_layers(model)
        assert len(set(formats.values())) > 5
        state = model.state_dict()
        dtypes = {path: packed_record(model.get_submodule(path)).compute_dtype for path in formats}
        # the model's dtype, but where the model keeps a module in float32 (Wan's time embedder)
        assert dtype in dtypes.values() and set(dtypes.values()) <= {dtype, torch.float32}
        for path in formats:
            value = state[f"{path}.weight"]
            assert value.dtype == dtypes[path] and value.shape == expected[f"{path}.weight"].shape, path
            assert torch.equal(value, expected[f"{path}.weight"].to(dtypes[path])), f"{name}.{path}"
        path = next(p for p in formats if dtypes[p] == dtype)
        layer = model.get_submodule(path)
        weight = expected[f"{path}.weight"].to(dtype)
        assert layer.weight.shape == weight.shape and layer.weight.dtype == dtype
        assert not layer.weight.float().isnan().any()
        assert torch.equal(layer.weight.float(), weight.float())
        x = torch.randn(weight.shape[1], 3, generator=torch.Generator().manual_seed(0)).to(dtype)
        assert torch.equal(layer.weight @ x, weight @ x)
    assert packed_layers(handle.target.transformer), "reading dequantized nothing for good"
    handle.remove()


def test_a_parent_reading_a_childs_weight_in_its_forward_gets_the_dequantized_value(gguf_pipeline, tmp_path):
    """Under leaf-level group offload with ``disk``, the child rests offloaded while its parent runs."""
    handle = placed(gguf_pipeline, "model_group_offload", "disk", tmp_path, offload_type="leaf_level")
    model = handle.target.transformer
    path = next(p for p in packed_layers(model) if p.startswith("blocks.0.") and p != "blocks.0")
    child = path.removeprefix("blocks.0.")
    seen = []

    def read(block, args):
        weight = block.get_submodule(child).weight
        seen.append((weight.shape, weight.dtype, weight.float().clone()))

    hook = model.blocks[0].register_forward_pre_hook(read)
    assert_bit_equal(run(handle.target, FAMILY), full_load_output(gguf_pipeline), "with the parent's reads")
    hook.remove()
    expected = reference_values(gguf_pipeline.files["transformer"])[f"{path}.weight"]
    assert seen
    for shape, dtype, value in seen:
        assert shape == expected.shape and dtype == torch.float32
        assert torch.equal(value, expected), path
    handle.remove()


# -- saving -------------------------------------------------------------------------------------------------------


def test_save_pretrained_is_refused_before_anything_is_written(gguf_pipeline, tmp_path):
    handle = placed(gguf_pipeline, "model_group_offload", "disk", tmp_path)
    pipe = handle.target
    for owner in (pipe.transformer, pipe):
        folder = tmp_path / type(owner).__name__
        with pytest.raises(IncompatibleModeError, match=r"transformer.*memmode\.save_quantized"):
            owner.save_pretrained(folder)
        assert not folder.exists() or not any(folder.iterdir()), "nothing written"
    assert_bit_equal(run(pipe, FAMILY), full_load_output(gguf_pipeline), "after the refusals")
    handle.remove()


def saved_metadata(folder: Path) -> dict[str, str]:
    raw = (folder / "diffusion_pytorch_model.safetensors").read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + length])["__metadata__"]


_SAVED: list[Path] = []


@pytest.fixture
def saved_pipeline(gguf_pipeline, tmp_path_factory) -> Path:
    """The GGUF pipeline, placed by group offload with ``disk``, saved by ``save_quantized`` (once)."""
    if not _SAVED:
        where = tmp_path_factory.mktemp("saved-gguf")
        handle = load(gguf_pipeline, "model_group_offload", storage="disk", offload_dir=str(where / "offload"))
        memmode.save_quantized(handle.target, where / "saved")
        handle.remove()
        _SAVED.append(where / "saved")
    return _SAVED[0]


@pytest.mark.parametrize(("mode", "storage"), [("model_full_load", None), ("model_group_offload", "mmap")])
def test_save_quantized_round_trip_keeps_each_layer_packed_in_its_format(
    gguf_pipeline, saved_pipeline, mode, storage, tmp_path
):
    original = load(gguf_pipeline, "model_full_load").target
    for name in DENOISERS:
        metadata = saved_metadata(saved_pipeline / name)
        assert metadata[saved.VERSION_KEY] == saved.MIXED_VERSION  # a GGUF mixes block types
        layers = json.loads(metadata[saved.LAYERS_KEY])
        assert {path: entry["format"] for path, entry in layers.items()} == packed_layers(getattr(original, name))
    options = {} if storage is None else {"storage": storage, "offload_dir": str(tmp_path)}
    handle = memmode.load(saved_pipeline, mode, device="cpu", **options)
    handle.target.set_progress_bar_config(disable=True)
    for name in DENOISERS:
        model = getattr(handle.target, name)
        assert packed_layers(model) == packed_layers(getattr(original, name)), "packed again, each in its format"
        file = saved_pipeline / name / "diffusion_pytorch_model.safetensors"
        for sub in model.modules():
            record = packed_record(sub)
            if record is not None:
                assert record.encoded_by == str(saved_pipeline / name)
                assert mapped_from(sub.weight_packed) == str(file), "a view of the saved file, not a copy"
    assert_bit_equal(run(handle.target, FAMILY), full_load_output(gguf_pipeline), f"saved, loaded into {mode}")
    handle.remove()


def test_a_saved_gguf_pipeline_is_refused_under_a_quantizer_or_without_its_reader(saved_pipeline, monkeypatch):
    with pytest.raises(IncompatibleModeError, match="without '_and_qfloat8'"):
        memmode.load(saved_pipeline, "model_group_offload_and_qfloat8", device="cpu")
    monkeypatch.setenv("MEMMODE_DISABLE_PLUGINS", "memmode-gguf")
    plugins.reset()
    with pytest.raises((CheckpointError, PluginNotInstalledError), match="pip install memmode-gguf"):
        memmode.load(saved_pipeline, "model_full_load", device="cpu")


def test_a_comfy_fp8_pipeline_round_trips_through_save_quantized_in_one_format(tmp_path):
    """A ComfyUI fp8 file holds one format: saved as version 1, read back by the ``comfy`` reader's codec."""
    from community_pipelines import comfy_fp8_pipeline

    comfy, form = comfy_fp8_pipeline(), "legacy_scaled"
    handle = comfy.load(form, "model_full_load")
    formats = {name: packed_layers(getattr(handle.target, name)) for name in DENOISERS}
    memmode.save_quantized(handle.target, tmp_path / "saved")
    handle.remove()
    for name in DENOISERS:
        metadata = saved_metadata(tmp_path / "saved" / name)
        assert metadata[saved.VERSION_KEY] == saved.VERSION
        assert metadata[saved.FORMAT_KEY] == "comfy_fp8_e4m3fn"
    loaded = memmode.load(
        tmp_path / "saved", "model_group_offload", device="cpu", storage="mmap", offload_dir=str(tmp_path / "off")
    )
    loaded.target.set_progress_bar_config(disable=True)
    assert {name: packed_layers(getattr(loaded.target, name)) for name in DENOISERS} == formats
    assert_bit_equal(run(loaded.target, FAMILY), comfy.full_load_output(form), "saved comfy fp8, loaded")
    loaded.remove()


def test_a_model_in_one_format_is_still_saved_as_version_1():
    """What every memmode reads: one format for the component, no format per layer."""
    from tiny_pipelines import make_pipeline

    pipe = make_pipeline(FAMILY)
    memmode.apply(pipe, "model_full_load_and_qfloat8", device="cpu")
    metadata = saved.packed_metadata(pipe.transformer)
    assert metadata[saved.VERSION_KEY] == "1" and metadata[saved.FORMAT_KEY] == "qfloat8"
    assert not any("format" in entry for entry in json.loads(metadata[saved.LAYERS_KEY]).values())
    assert {layer.format for layer in saved.saved_layers(metadata, "here")} == {"qfloat8"}


# -- torch.compile ------------------------------------------------------------------------------------------------


@pytest.fixture
def unprofiled_guards(monkeypatch):
    """Dynamo times every guard set it builds, for a log line: nothing checked here (see test_weight_changes)."""
    import torch._dynamo.guards

    monkeypatch.setattr(torch._dynamo.guards, "profile_guard_manager", lambda *args: 0.0, raising=False)


@pytest.mark.slow
def test_torch_compile_under_group_offload_gives_the_uncompiled_output(gguf_pipeline, unprofiled_guards):
    import torch._dynamo

    handle = placed(gguf_pipeline, "model_group_offload", "ram", Path("."))
    pipe = handle.target
    torch._dynamo.reset()
    pipe.transformer = torch.compile(pipe.transformer, backend="eager")
    try:
        # dynamo's eager backend runs the model's own operations on the same tensors: like with like
        assert_bit_equal(run(pipe, FAMILY), full_load_output(gguf_pipeline), "compiled")
    finally:
        pipe.transformer = pipe.transformer._orig_mod
        torch._dynamo.reset()
    assert packed_layers(pipe.transformer)
    handle.remove()


# -- ranks --------------------------------------------------------------------------------------------------------


def gguf_on_a_rank(rank: int, world: int, folder: str, files: dict[str, str]) -> dict:
    """One rank loads the files into group offload with ``mmap``: its output, and the files its packed payloads
    are mapped from, by component."""
    import memmode_core as memmode

    handle = memmode.load(
        folder, "model_group_offload", device="cpu", storage="mmap", torch_dtype=torch.float32, **files
    )
    handle.target.set_progress_bar_config(disable=True)
    output = run(handle.target, FAMILY)
    mapped = {
        name: sorted(
            {
                str(mapped_from(m.weight_packed))
                for m in getattr(handle.target, name).modules()
                if packed_record(m) is not None
            }
        )
        for name in files
    }
    handle.remove()
    return {"output": output, "mapped": mapped}


@pytest.mark.slow
@pytest.mark.skipif(not distributed_available(), reason="needs torch.distributed with gloo")
def test_two_ranks_load_the_same_files_each_viewing_their_pages(gguf_pipeline):
    expected = full_load_output(gguf_pipeline)
    files = gguf_pipeline.files_kwargs()
    for rank, result in enumerate(run_ranks(2, gguf_on_a_rank, str(gguf_pipeline.folder), files)):
        assert_bit_equal(result["output"], expected, f"rank {rank}")
        assert result["mapped"] == {name: [path] for name, path in files.items()}, f"rank {rank}"


# -- auto ---------------------------------------------------------------------------------------------------------


def test_auto_prices_the_files_packed_sizes_and_its_choice_gives_the_full_load_output(gguf_pipeline):
    full = load(gguf_pipeline, "model_full_load")
    models = [c for c in full.target.components.values() if isinstance(c, torch.nn.Module)]
    loaded = sum(t.numel() * t.element_size() for m in models for t in [*m.parameters(), *m.buffers()])
    dequantized = loaded + sum(
        record.shape.numel() * record.dtype.itemsize
        - sum(getattr(sub, n).numel() * getattr(sub, n).element_size() for n in record.names)
        for m in models
        for sub in m.modules()
        if (record := packed_record(sub)) is not None
    )
    assert dequantized > 2 * loaded
    # the whole pipeline fits at its packed size, not at full precision: a full load is chosen only if priced packed
    handle = load(gguf_pipeline, "auto", vram_budget=loaded)
    assert handle.mode == "model_full_load"
    handle.target.set_progress_bar_config(disable=True)
    assert_bit_equal(run(handle.target, FAMILY), full_load_output(gguf_pipeline), "auto, all of it fitting")
    handle.remove()
    handle = load(gguf_pipeline, "auto", vram_budget=loaded // 3)
    assert handle.mode != "model_full_load"
    handle.target.set_progress_bar_config(disable=True)
    assert_bit_equal(run(handle.target, FAMILY), full_load_output(gguf_pipeline), f"auto: {handle.mode}")
    assert packed_layers(handle.target.transformer)
    handle.remove()
