"""A component given as one ComfyUI fp8 file — each form Comfy-Org's and Kijai's reposts come in — loaded into every
mode, kept packed.

The fixture (``community_pipelines.comfy_fp8_pipeline()``) is the Wan 2.2 pipeline of the GGUF suite
(``test_load_single_file``): two 256-wide transformers, each written under the original checkpoint's names
(``model.diffusion_model.`` included) in every form of ``community_pipelines.COMFY_FORMS``: legacy "fp8 scaled"
(e4m3fn, ``scale_weight`` and the ``scaled_fp8`` marker), ``_quantization_metadata`` with ``weight_scale``, and plain
e4m3fn and e5m2 casts. What ``load`` must give, per form:

- with ``model_full_load``, the output of the pipeline whose transformers hold ``q.float() * scale`` for every
  float8 weight, computed apart from what the writer stored and mapped to diffusers' names by diffusers' own
  converter (float32 either way: close, with tight tolerances);
- every float8 linear layer resting packed in the reader's format, its payload the file's bytes;
- under the offloading placements x storages, that file's ``model_full_load`` output bit for bit (like with like):
  the whole grid on the legacy form, one placement and storage on each other form, to keep the file fast;
- bad input refused, typed, before anything is bound; a mode with a quantizer refused (the file's layers are
  already encoded).
"""

from __future__ import annotations

import pytest
import torch
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors import safe_open

import memmode_core as memmode
from comfy_files import write_legacy_scaled
from community_pipelines import (
    COMFY_FORMS,
    FAMILY,
    PLACEMENTS,
    STORAGES,
    WIDE_WAN_CALL,
    ComfyFp8Pipeline,
    comfy_fp8_pipeline,
    packed_layers,
)
from helpers import assert_reassociated, placement_id
from memmode_core import CheckpointError, IncompatibleModeError
from memmode_core.loading import load as load_module
from original_checkpoints import PREFIX
from tiny_pipelines import run

FORMS = list(COMFY_FORMS)
TRANSFORMERS = ("transformer", "transformer_2")
#: the form whose files run under every placement x storage
GRID_FORM = "legacy_scaled"
#: one placement and storage for each other form, a different one each
ONE_CASE = {
    "metadata_scaled": (PLACEMENTS[2], "disk"),
    "plain_e4m3fn": (PLACEMENTS[3], "mmap"),
    "plain_e5m2": (PLACEMENTS[0], "ram"),
}


@pytest.fixture
def comfy() -> ComfyFp8Pipeline:
    return comfy_fp8_pipeline()


def _grid_cases() -> list:
    cases = [
        pytest.param(GRID_FORM, placement, storage, id=f"{GRID_FORM}-{placement_id(placement)}-{storage}")
        for placement in PLACEMENTS
        for storage in STORAGES
    ]
    cases += [
        pytest.param(form, placement, storage, id=f"{form}-{placement_id(placement)}-{storage}")
        for form, (placement, storage) in ONE_CASE.items()
    ]
    return cases


def test_the_fixture_writes_every_form(comfy):
    """The fixture does what it says: each form's files hold float8 weights of the type the form names, with a
    scale where the form has one, and the same layers in every form."""
    for form in FORMS:
        for name in TRANSFORMERS:
            stored = comfy.stored[form][name]
            assert len(stored) > 10
            fp8 = {q.dtype for q, _ in stored.values()}
            assert fp8 == {torch.float8_e5m2 if form.endswith("e5m2") else torch.float8_e4m3fn}
            scaled = {scale is not None for _, scale in stored.values()}
            assert scaled == {not form.startswith("plain")}
            assert set(stored) == set(comfy.stored[GRID_FORM][name])
            with safe_open(comfy.files[form][name], "pt") as file:
                keys, metadata = set(file.keys()), file.metadata() or {}
            assert ("scaled_fp8" in keys) == (form == "legacy_scaled")
            assert ("_quantization_metadata" in metadata) == (form == "metadata_scaled")
            assert all(key.startswith("model.diffusion_model.") for key in keys - {"scaled_fp8"})


@pytest.mark.parametrize("form", FORMS)
def test_every_fp8_linear_layer_rests_packed(comfy, form):
    handle = comfy.load(form, "model_full_load")
    for name in TRANSFORMERS:
        formats = packed_layers(getattr(handle.target, name))
        assert set(formats) == comfy.fp8_layers(form, name)
        assert {f.startswith("comfy_fp8") for f in formats.values()} == {True}
        assert {f.endswith("e5m2" if form.endswith("e5m2") else "e4m3fn") for f in formats.values()} == {True}


@pytest.mark.parametrize("form", FORMS)
def test_the_packed_payload_is_the_files_bytes(comfy, form):
    """Each packed layer holds the float8 bytes the writer stored (viewed as ``uint8``), and its scale."""
    handle = comfy.load(form, "model_full_load")
    for name in TRANSFORMERS:
        stored = comfy.stored[form][name]
        renamed = convert_wan_transformer_to_diffusers({k.removeprefix(PREFIX): k for k in stored})
        module = getattr(handle.target, name)
        for key, original in renamed.items():
            layer = module.get_submodule(key.removesuffix(".weight"))
            q, scale = stored[original]
            assert torch.equal(layer.weight_packed, q.view(torch.uint8)), f"{name}.{key}: payload"
            if scale is not None:
                assert torch.equal(layer.weight_scale.reshape(()), scale), f"{name}.{key}: scale"


@pytest.mark.parametrize("form", FORMS)
def test_full_load_matches_the_weights_the_file_means(comfy, form):
    """The reference holds the same float32 values as stored weights, where memmode dequantizes them at each call:
    other tensors, so other sums (on an AMD EPYC, 2 of 3840 values moved by 4.3e-6, and under
    ATEN_CPU_CAPABILITY=default by 4.6e-5, out of 1.0)."""
    assert_reassociated(comfy.full_load_output(form), comfy.reference(form), **WIDE_WAN_CALL)


@pytest.mark.parametrize(("form", "placement", "storage"), _grid_cases())
def test_every_placement_and_storage_gives_the_full_load_output(comfy, form, placement, storage, tmp_path):
    expected = comfy.full_load_output(form)
    mode, options = placement
    files = {"offload_dir": str(tmp_path)} if storage != "ram" else {}
    handle = comfy.load(form, mode, storage=storage, **files, **options)
    handle.target.set_progress_bar_config(disable=True)
    assert torch.equal(run(handle.target, FAMILY), expected)
    # still packed after the call: nothing decoded the model whole
    for name in TRANSFORMERS:
        assert set(packed_layers(getattr(handle.target, name))) == comfy.fp8_layers(form, name)
    assert handle.report().bytes_transferred > 0
    handle.remove()


@pytest.fixture
def bound(monkeypatch) -> list:
    """The components ``load`` binds (their skeletons), none of them actually bound: a refusal must come first."""
    skeletons: list = []
    monkeypatch.setattr(load_module, "bind", lambda skeleton, *args, **kwargs: skeletons.append(skeleton))
    return skeletons


def test_a_file_with_empty_scales_is_refused_naming_the_tensor(comfy, tmp_path, bound):
    original = comfy.originals["transformer"]
    key = f"{PREFIX}blocks.0.self_attn.q.weight"
    path = tmp_path / "empty-scale.safetensors"
    write_legacy_scaled(path, original, scales={key: torch.empty(0)})
    with pytest.raises(CheckpointError, match="empty scale") as refused:
        memmode.load(comfy.folder, "model_full_load", device="cpu", torch_dtype=torch.float32, transformer=str(path))
    assert str(path) in str(refused.value) and f"{PREFIX}blocks.0.self_attn.q.scale_weight" in str(refused.value)
    assert bound == [], "refused after binding"


def test_a_file_of_another_architecture_names_missing_and_unexpected_keys(comfy, tmp_path, bound):
    path = tmp_path / "other.safetensors"
    write_legacy_scaled(path, {f"{PREFIX}double_blocks.0.img_attn.qkv.weight": torch.randn(96, 32)})
    with pytest.raises(CheckpointError) as refused:
        memmode.load(comfy.folder, "model_full_load", device="cpu", transformer=str(path))
    message = str(refused.value)
    assert str(path) in message and "double_blocks.0.img_attn.qkv.weight" in message and "scale_shift_table" in message
    assert bound == [], "refused after binding"


def test_a_mode_with_a_quantizer_is_refused(comfy):
    """The file's layers are already encoded: memmode does not quantize them again."""
    with pytest.raises(IncompatibleModeError, match="without '_and_qfloat8'") as refused:
        comfy.load(GRID_FORM, "model_group_offload_and_qfloat8")
    assert "comfy_fp8_e4m3fn" in str(refused.value)


def test_a_mode_with_a_quantizer_is_refused_before_anything_is_bound(comfy, bound):
    with pytest.raises(IncompatibleModeError, match="without '_and_qfloat8'"):
        comfy.load(GRID_FORM, "model_group_offload_and_qfloat8")
    assert bound == [], "refused after binding"
