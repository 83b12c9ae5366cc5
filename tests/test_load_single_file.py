"""A component given as one community file — a GGUF from city96's converter — loaded into every mode, kept packed.

The fixture is a Wan 2.2 pipeline (a high-noise and a low-noise transformer) whose transformers are 256 wide, so that
every GGML type, the K types' 256-value super-blocks included, quantizes some of their layers; each transformer is
written to a GGUF file the way the community's tools write one (original key names, a mix of types, small and 1-D
tensors in F32). What ``load`` must give:

- with ``model_full_load``, the output of the pipeline built with gguf-py's reference dequantization of the same
  file (computed apart, in float32: close, since the reference's weights lie at other addresses than ours);
- under every lossless placement x storage, that same output bit for bit (like with like: the same file);
- every quantized layer resting packed (its payload the file's blocks, never dequantized whole);
- bad input refused, typed, before anything is bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel
from gguf import GGMLQuantizationType as Q

import community_pipelines
import memmode_core as memmode
from community_pipelines import (
    FAMILY,
    PLACEMENTS,
    STORAGES,
    WIDE_WAN_CALL,
    WIDE_WAN_FORWARD,
    GgufPipeline,
    full_load_output,
    load,
    packed_layers,
    wan_inputs,
)
from gguf_files import write_gguf
from helpers import assert_reassociated
from memmode_core import CheckpointError, IncompatibleModeError, PluginNotInstalledError
from memmode_core.discovery import plugins
from memmode_core.quantization import packed_record
from tiny_pipelines import run


@pytest.fixture
def gguf_pipeline() -> GgufPipeline:
    return community_pipelines.gguf_pipeline()


def test_every_type_is_in_the_files(gguf_pipeline):
    """The fixture does what it says: each quantized GGML type stores some layer of the transformers."""
    stored = {qtype for types in gguf_pipeline.types.values() for qtype in types.values()}
    assert {Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F32} <= stored


def test_full_load_matches_the_reference_dequantization(gguf_pipeline):
    handle = load(gguf_pipeline, "model_full_load")
    formats = packed_layers(handle.target.transformer)
    quantized = {k for k, t in gguf_pipeline.types["transformer"].items() if t not in (Q.F32, Q.F16, Q.BF16)}
    assert len(formats) == len([k for k in quantized if k.endswith(".weight") and "patch_embedding" not in k]) > 10
    assert {f.startswith("gguf_") for f in formats.values()} == {True}
    read = handle.report().loading["files"]["transformer"]
    assert (read["path"], read["reader"]) == (str(gguf_pipeline.files["transformer"]), "gguf")
    assert read["packed_layers"] == {f: list(formats.values()).count(f) for f in sorted(set(formats.values()))}
    # the reference holds gguf-py's values as stored weights; memmode decodes them at each call: other sums
    assert_reassociated(full_load_output(gguf_pipeline), gguf_pipeline.reference, **WIDE_WAN_CALL)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize(("placement", "options"), PLACEMENTS, ids=lambda p: p if isinstance(p, str) else "")
def test_every_placement_and_storage_gives_the_full_load_output(gguf_pipeline, placement, options, storage, tmp_path):
    expected = full_load_output(gguf_pipeline)
    files = {"offload_dir": str(tmp_path)} if storage != "ram" else {}
    handle = load(gguf_pipeline, placement, storage=storage, **files, **options)
    handle.target.set_progress_bar_config(disable=True)
    assert torch.equal(run(handle.target, FAMILY), expected)
    # still packed after the call: nothing dequantized the model whole
    assert packed_layers(handle.target.transformer)
    report = handle.report()
    assert report.bytes_transferred > 0
    handle.remove()


def off_the_64_byte_boundary(gguf_pipeline, folder: Path) -> Path:
    """The fixture's first transformer written again as a GGUF file whose tensors all start 32 bytes off a 64-byte
    boundary (GGUF aligns to 32; where the data starts depends on the header's length, as in the benchmark's 15 GB
    file): a description in the header, 32 bytes longer if the first try lands on the boundary."""
    import gguf

    from original_checkpoints import to_original, wan_plan

    state = WanTransformer3DModel.from_pretrained(gguf_pipeline.folder / "transformer").state_dict()
    original = to_original(wan_plan(list(state)), state)
    asked = {key: (value.float().numpy(), gguf_pipeline.types["transformer"][key]) for key, value in original.items()}
    path = folder / "off-boundary.gguf"
    for padding in ("", " " * 32):
        write_gguf(path, asked, arch="wan", metadata={"general.description": "memmode test" + padding})
        offsets = {tensor.data_offset % 64 for tensor in gguf.GGUFReader(path).tensors}
        if offsets == {32}:
            return path
    raise AssertionError(f"the tensors start at {offsets} modulo 64")


@pytest.mark.parametrize("storage", ["disk", "mmap"])
def test_the_file_storages_keep_the_files_blocks_in_place_bit_exact(gguf_pipeline, storage, tmp_path):
    """Only the codec's decode reads a packed layer's parts, element by element into a fresh tensor, which no
    alignment changes: the file storages keep the blocks of a GGUF file in its pages even 32 bytes off the 64-byte
    boundary memmode's own files keep (a 15 GB file is not written again), and the output is the full load's, bit
    for bit; with ``in_place=False`` the same groups are written to the storage's files."""
    path = off_the_64_byte_boundary(gguf_pipeline, tmp_path)
    config = gguf_pipeline.folder / "transformer"
    full = memmode.load(path, "model_full_load", device="cpu", torch_dtype=torch.float32, config=config).target
    packed = sum(
        getattr(module, name).nbytes
        for module in full.modules()
        if (record := packed_record(module)) is not None
        for name in record.names
    )
    inputs = wan_inputs()
    with torch.no_grad():
        expected = full(**inputs)[0]
    for in_place in (None, False):
        handle = memmode.load(
            path,
            "model_group_offload",
            device="cpu",
            torch_dtype=torch.float32,
            config=config,
            storage=storage,
            offload_dir=tmp_path / str(in_place),
            in_place=in_place,
        )
        with torch.no_grad():
            assert torch.equal(handle.target(**inputs)[0], expected)
        loading = handle.loading
        if in_place is None:
            # every block of the file kept where it lies (what is written is plain float32, off the boundary)
            assert loading["kept_in_place_bytes"] >= packed, loading
        else:
            assert loading["kept_in_place_bytes"] == 0 and loading["written_bytes"] >= packed, loading
        handle.remove()


def test_a_mode_with_a_quantizer_is_refused_before_anything_is_bound(gguf_pipeline):
    with pytest.raises(IncompatibleModeError, match="without '_and_qfloat8'"):
        load(gguf_pipeline, "model_group_offload_and_qfloat8")


def test_a_gguf_without_its_reader_names_the_package(gguf_pipeline, monkeypatch):
    monkeypatch.setenv("MEMMODE_DISABLE_PLUGINS", "memmode-gguf")
    plugins.reset()
    with pytest.raises(PluginNotInstalledError, match="pip install memmode-gguf"):
        load(gguf_pipeline, "model_full_load")


def test_a_truncated_file_is_refused(gguf_pipeline, tmp_path):
    path = tmp_path / "cut.gguf"
    data = gguf_pipeline.files["transformer"].read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="cut.gguf"):
        memmode.load(gguf_pipeline.folder, "model_full_load", device="cpu", transformer=str(path))


def test_a_file_of_another_architecture_names_missing_and_unexpected_keys(gguf_pipeline, tmp_path):
    import numpy as np

    path = tmp_path / "other.gguf"
    write_gguf(path, {"double_blocks.0.img_attn.qkv.weight": (np.ones((96, 32), np.float32), Q.Q8_0)}, arch="flux")
    with pytest.raises(CheckpointError) as refused:
        memmode.load(gguf_pipeline.folder, "model_full_load", device="cpu", transformer=str(path))
    message = str(refused.value)
    assert str(path) in message and "double_blocks.0.img_attn.qkv.weight" in message and "scale_shift_table" in message


def test_a_bare_model_file_takes_its_config(gguf_pipeline):
    handle = memmode.load(
        gguf_pipeline.files["transformer"], "model_full_load", device="cpu", config=gguf_pipeline.folder / "transformer"
    )
    assert isinstance(handle.target, WanTransformer3DModel)
    assert packed_layers(handle.target)


def test_tensors_a_conversion_splits_or_swaps_stay_packed_and_exact(gguf_pipeline, tmp_path, monkeypatch):
    """What diffusers' Flux conversion does to a file's weights — a fused ``qkv`` split into three runs of rows
    (``torch.chunk``), a weight's halves swapped (``swap_scale_shift``: chunk, then cat) — on a Wan file, through a
    converter of that kind: every piece rests packed (the payload's rows, a view of the file for a single run,
    copied once for the swap) and the output is the reference's, computed by the same converter on gguf-py's
    dequantized values."""
    from diffusers.loaders import single_file_model

    from gguf_files import reference_dequantize

    model = WanTransformer3DModel.from_pretrained(gguf_pipeline.folder / "transformer").eval()
    state = model.state_dict()
    attn = "blocks.0.attn1"
    fused = {
        f"{attn}.qkv.weight": torch.cat([state[f"{attn}.to_{p}.weight"] for p in "qkv"]),
        f"{attn}.qkv.bias": torch.cat([state[f"{attn}.to_{p}.bias"] for p in "qkv"]),
    }
    swapped = torch.cat(state["proj_out.weight"].chunk(2)[::-1])
    original = {k: v for k, v in state.items() if not k.startswith(f"{attn}.to_") or "to_out" in k}
    original.update(fused, **{"proj_out.weight": swapped})
    path = tmp_path / "fused.gguf"
    types = {f"{attn}.qkv.weight": Q.Q4_K, "proj_out.weight": Q.Q8_0}
    write_gguf(path, {k: (v.float().numpy(), types.get(k, Q.Q6_K)) for k, v in original.items()}, arch="wan")

    def convert(checkpoint, **_):
        out = dict(checkpoint)
        for name in ("weight", "bias"):
            q, k, v = torch.chunk(out.pop(f"{attn}.qkv.{name}"), 3, dim=0)
            out.update({f"{attn}.to_q.{name}": q, f"{attn}.to_k.{name}": k, f"{attn}.to_v.{name}": v})
        shift, scale = out.pop("proj_out.weight").chunk(2, dim=0)
        out["proj_out.weight"] = torch.cat([scale, shift], dim=0)
        return out

    table = dict(single_file_model.SINGLE_FILE_LOADABLE_CLASSES)
    table["WanTransformer3DModel"] = {**table["WanTransformer3DModel"], "checkpoint_mapping_fn": convert}
    monkeypatch.setattr(single_file_model, "SINGLE_FILE_LOADABLE_CLASSES", table)

    handle = memmode.load(
        path, "model_full_load", device="cpu", torch_dtype=torch.float32, config=gguf_pipeline.folder / "transformer"
    )
    loaded = handle.target
    formats = packed_layers(loaded)
    assert {formats[f"{attn}.to_{p}"] for p in "qkv"} == {"gguf_q4_k"} and formats["proj_out"] == "gguf_q8_0"
    # decoded at load: only what is encoded and no linear layer's weight (the blocks' 3-D modulation tables)
    tables = [k for k, v in original.items() if k.endswith("scale_shift_table") and v.numel() > 1024]
    assert handle.report().loading["files"]["module"]["decoded_tensors"] == len(tables) > 0

    model.load_state_dict(convert(reference_dequantize(path)))
    inputs = wan_inputs()
    with torch.no_grad():
        assert_reassociated(loaded(**inputs)[0], model(**inputs)[0], **WIDE_WAN_FORWARD)


def test_a_weight_stored_reshaped_rests_packed_in_its_real_shape(gguf_pipeline, tmp_path):
    """city96's converter stores a tensor whose row does not fit the blocks as rows of 256, its real shape in
    ``comfy.gguf.orig_shape.<name>`` (here the text embedder's first layer, 256 x 32): it rests packed as the file
    stores it, decodes to its real shape, and the model gives gguf-py's reference output."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from gguf_files import reference_dequantize
    from original_checkpoints import PREFIX, to_original, wan_plan

    model = WanTransformer3DModel.from_pretrained(gguf_pipeline.folder / "transformer").eval()
    state = model.state_dict()
    original = to_original(wan_plan(list(state)), state)
    path = tmp_path / "reshaped.gguf"
    write_gguf(path, {k: (v.float().numpy(), Q.Q8_0) for k, v in original.items()}, arch="wan", reshape_rows_to=256)
    handle = memmode.load(
        path, "model_full_load", device="cpu", torch_dtype=torch.float32, config=gguf_pipeline.folder / "transformer"
    )
    layer = handle.target.condition_embedder.text_embedder.linear_1
    assert packed_layers(layer) == {"": "gguf_q8_0"} and layer.weight_packed.shape == (32, 256 // 32 * 34)
    model.load_state_dict(
        convert_wan_transformer_to_diffusers({k.removeprefix(PREFIX): v for k, v in reference_dequantize(path).items()})
    )
    inputs = wan_inputs()
    with torch.no_grad():
        assert_reassociated(handle.target(**inputs)[0], model(**inputs)[0], **WIDE_WAN_FORWARD)
