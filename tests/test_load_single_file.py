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

import pytest
import torch
from diffusers import WanTransformer3DModel
from gguf import GGMLQuantizationType as Q

import community_pipelines
import memmode_core as memmode
from community_pipelines import FAMILY, GgufPipeline, full_load_output, load, packed_layers
from gguf_files import write_gguf
from memmode_core import CheckpointError, IncompatibleModeError, PluginNotInstalledError
from memmode_core.discovery import plugins
from tiny_pipelines import run

PLACEMENTS = [
    ("model_cpu_offload", {}),
    ("model_group_offload", {"offload_type": "block_level"}),
    ("model_group_offload", {"offload_type": "leaf_level"}),
    ("sequential_cpu_offload", {}),
]
STORAGES = ["ram", "disk", "mmap"]


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
    output = full_load_output(gguf_pipeline)
    torch.testing.assert_close(output, gguf_pipeline.reference, rtol=1e-4, atol=1e-5)


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
