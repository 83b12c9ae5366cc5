"""A pipeline folder whose transformer a library saved quantized (its config.json's ``quantization_config``), loaded
into every mode, kept packed — and every method diffusers knows either read or refused by name.

The fixtures (``quantized_folders.modelopt_folder``) are the tiny Wan 2.2 pipeline of the community-file suites, its
two transformers quantized by nvidia-modelopt on the CPU and written by modelopt's own ``export_hf_checkpoint`` with
each algorithm (FP8 per tensor, per channel, in 128x128 blocks; NVFP4), the text encoder and the VAE left plain.
What ``load`` must give:

- each quantized weight decoded as modelopt dequantizes it, bit for bit in float32;
- with ``model_full_load``, the output of the pipeline holding those weights (computed apart: other sums, so within
  the reassociation tolerance);
- every quantized linear layer resting packed, its parts the file's bytes; ``plan`` pricing the folder packed;
- under the offloading placements x storages, the folder's ``model_full_load`` output bit for bit: the whole grid
  on NVFP4, one placement and storage each on the others;
- ``save_quantized`` and a load back: the same output, each layer packed in its format;
- bad input refused, typed, before anything is bound: an unknown method, a method diffusers knows that memmode does
  not read (a torchao ``.bin`` folder), a folder diffusers' NVIDIAModelOptConfig saved without modelopt's export, a
  truncated shard, a scale of the wrong shape or not finite, and a mode with a quantizer.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers.quantizers.auto import AUTO_QUANTIZER_MAPPING
from safetensors import safe_open
from safetensors.torch import save_file

import memmode_core as memmode
from community_pipelines import FAMILY, PLACEMENTS, STORAGES, WIDE_WAN_CALL, packed_layers
from helpers import assert_bit_equal, assert_reassociated, placement_id
from memmode_core import CheckpointError, IncompatibleModeError
from memmode_core.builtin.modelopt import ModelOptReader
from memmode_core.discovery.plugins import current
from memmode_core.loading import load as load_module
from memmode_core.loading.quantized_folders import (
    NOT_READ,
    open_quantized_folder,
    quant_method,
    quantization_config,
    reader_of_method,
)
from memmode_core.quantization import row_bands
from quantized_folders import (
    ALGORITHMS,
    QUANTIZED,
    SHARDED,
    ModelOptFolder,
    base_pipeline,
    diffusers_modelopt_folder,
    fp8_text_encoder_folder,
    modelopt_dequantize,
    modelopt_folder,
)
from tiny_pipelines import run

ALL = list(ALGORITHMS)
#: the algorithm whose folder runs under every placement x storage, and one case for each other
GRID = "nvfp4"
ONE_CASE = {
    "fp8": (PLACEMENTS[1], "mmap"),
    "fp8_per_channel": (PLACEMENTS[2], "disk"),
    "fp8_blockwise": (PLACEMENTS[3], "ram"),
}
#: the codec of each algorithm's layers
FORMATS = {
    "fp8": {"modelopt_fp8"},
    "fp8_per_channel": {"modelopt_fp8"},
    "fp8_blockwise": {"modelopt_fp8_block128"},
    "nvfp4": {"modelopt_nvfp4"},
}


def load(folder: Path, mode: str, **kwargs):
    kwargs.setdefault("torch_dtype", torch.float32)
    return memmode.load(folder, mode, device="cpu", **kwargs)


_FULL: dict[str, torch.Tensor] = {}


def full_load_output(made: ModelOptFolder) -> torch.Tensor:
    if made.name not in _FULL:
        handle = load(made.folder, "model_full_load")
        handle.target.set_progress_bar_config(disable=True)
        _FULL[made.name] = run(handle.target, FAMILY)
        handle.remove()
    return _FULL[made.name]


@pytest.fixture
def bound(monkeypatch) -> list:
    """The components ``load`` binds (their skeletons), none of them actually bound: a refusal must come first."""
    skeletons: list = []
    monkeypatch.setattr(load_module, "bind", lambda skeleton, *args, **kwargs: skeletons.append(skeleton))
    return skeletons


def _copy(made: ModelOptFolder, where: Path) -> Path:
    folder = where / made.name
    shutil.copytree(made.folder, folder)
    return folder


def _edit_config(folder: Path, **quantization) -> None:
    path = folder / "transformer" / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = quantization
    path.write_text(json.dumps(config))


# -- what the fixture is ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_the_fixture_is_modelopts_export(name):
    made = modelopt_folder(name)
    config = quantization_config(made.folder / "transformer")
    assert config["quant_method"] == "modelopt" and config["producer"]["name"] == "modelopt"
    assert (
        quantization_config(made.folder / "text_encoder") is None and quantization_config(made.folder / "vae") is None
    )
    tensors = made.tensors()
    payload = torch.uint8 if name == "nvfp4" else torch.float8_e4m3fn
    assert len(made.layers) > 20 and all(tensors[f"{layer}.weight"].dtype == payload for layer in made.layers)
    if name == "fp8_blockwise":  # 2x2 blocks of a 256x256 weight, as modelopt keeps its amax
        assert tensors["blocks.0.attn1.to_q.weight_scale"].shape == (2, 1, 2, 1)
    assert len(made.shards()) > 1 if name == SHARDED else len(made.shards()) == 1


# -- decoding ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_each_weight_decodes_as_modelopt_dequantizes_it(name):
    made = modelopt_folder(name)
    folder = made.folder / "transformer_2"
    config = quantization_config(folder)
    opened = open_quantized_folder(folder, "transformer_2", _transformer_class(), config, current(), None)
    tensors = made.tensors("transformer_2")
    assert sorted(key.removesuffix(".weight") for key in opened.encoded) == made.layers
    for key, encoded in opened.encoded.items():
        parts = {part: opened.checkpoint.view(stored) for part, stored in encoded.parts.items()}
        got = encoded.codec.unpack(parts, torch.Size(encoded.shape), torch.float32)
        assert_bit_equal(got, modelopt_dequantize(tensors, key.removesuffix(".weight")), key)
        # in a narrower dtype: that value, rounded once
        assert torch.equal(encoded.codec.unpack(parts, torch.Size(encoded.shape), torch.bfloat16), got.bfloat16())


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (130, 257)], ids=lambda shape: "x".join(map(str, shape)))
def test_blockwise_fp8_decodes_as_modelopt_dequantizes_it_whatever_the_shape(shape, monkeypatch):
    """Random values quantized by modelopt's own ``FP8QTensor.quantize`` in 128x128 blocks, the last ones cut short
    where the shape is not a multiple of the block: decoded bit for bit as modelopt dequantizes them."""
    from modelopt.torch.quantization.qtensor import FP8QTensor

    rows, columns = shape
    blocks = {-1: 128, -2: 128}
    qtensor, scale = FP8QTensor.quantize(
        torch.randn(shape, generator=torch.Generator().manual_seed(rows)), None, None, blocks
    )
    grid = (-(-rows // 128), -(-columns // 128))
    expected = qtensor.dequantize(dtype=torch.float32, scale=scale.reshape(grid), block_sizes=blocks)
    codec = ModelOptReader().codecs()["modelopt_fp8_block128"]
    parts = {"weight_packed": qtensor._quantized_data.view(torch.uint8), "weight_scale": scale}
    assert_bit_equal(codec.unpack(parts, torch.Size(shape), torch.float32), expected, f"{shape}")
    # in bands of rows (a band cutting through blocks), rounded once to bfloat16: the same values
    monkeypatch.setattr(row_bands, "BAND_VALUES", 7 * columns)
    assert torch.equal(codec.unpack(parts, torch.Size(shape), torch.bfloat16), expected.bfloat16())


@pytest.mark.parametrize("name", ["fp8_per_channel", "nvfp4"])
def test_a_weight_decoded_in_bands_of_rows_is_the_whole_decode_rounded_once(name, monkeypatch):
    made = modelopt_folder(name)
    tensors = made.tensors()
    layer = "blocks.0.ffn.net.0.proj"
    expected = modelopt_dequantize(tensors, layer)
    codec = ModelOptReader().codecs()["modelopt_nvfp4" if name == "nvfp4" else "modelopt_fp8"]
    parts = {
        "weight_packed": tensors[f"{layer}.weight"].view(torch.uint8),
        "weight_scale": tensors[f"{layer}.weight_scale"],
    }
    if name == "nvfp4":
        parts = {**parts, "weight_scale": parts["weight_scale"].view(torch.uint8)}
        parts["weight_scale_2"] = tensors[f"{layer}.weight_scale_2"]
    monkeypatch.setattr(row_bands, "BAND_VALUES", 3 * expected.shape[1])
    assert torch.equal(codec.unpack(parts, expected.shape, torch.bfloat16), expected.bfloat16())


def _transformer_class():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel


@pytest.mark.parametrize("name", ALL)
def test_full_load_matches_the_weights_modelopt_means(name):
    made = modelopt_folder(name)
    assert_reassociated(full_load_output(made), made.reference(), **WIDE_WAN_CALL)


@pytest.mark.parametrize("name", ALL)
def test_every_quantized_layer_rests_packed_at_the_files_bytes(name):
    made = modelopt_folder(name)
    handle = load(made.folder, "model_full_load")
    files = handle.report().loading["files"]
    assert set(files) == set(QUANTIZED), "the plain components are read as they are"
    for component in QUANTIZED:
        model = getattr(handle.target, component)
        packed = packed_layers(model)
        assert set(packed) == set(made.layers) and set(packed.values()) == FORMATS[name]
        tensors = made.tensors(component)
        for layer in made.layers[:4]:
            stored = tensors[f"{layer}.weight"]
            assert torch.equal(model.get_submodule(layer).weight_packed, stored.view(torch.uint8))
        assert files[component]["reader"] == "modelopt"
        assert sum(files[component]["packed_layers"].values()) == len(made.layers)
    handle.remove()


def test_plan_prices_the_folder_packed():
    """``skeleton`` (what ``plan`` prices) holds the layers packed at the export's sizes, from headers alone: a full
    load is priced at the packed bytes."""
    made = modelopt_folder(GRID)
    skeleton = load_module.skeleton(made.folder, torch_dtype=torch.float32)
    assert set(packed_layers(skeleton.transformer)) == set(made.layers)
    handle = load(made.folder, "model_full_load")
    models = [c for c in handle.target.components.values() if isinstance(c, torch.nn.Module)]
    loaded = sum(t.numel() * t.element_size() for m in models for t in [*m.parameters(), *m.buffers()])
    handle.remove()
    entry = next(e for e in memmode.plan(skeleton, device="cpu") if e.mode == "model_full_load")
    assert entry.peak_device_bytes == loaded


def test_a_transformers_component_is_read_through_its_reader_too():
    """A quantized UMT5 text encoder (transformers' names, its embedding tied and saved once): built without acting on
    the quantization_config, its linear layers packed, the tied embedding bound once, the encoder's output that of
    the weights modelopt's dequantization gives."""
    folder = fp8_text_encoder_folder()
    handle = load(folder, "model_full_load")
    encoder = handle.target.text_encoder
    layers = packed_layers(encoder)
    assert layers and set(layers.values()) == {"modelopt_fp8"}
    assert encoder.shared.weight is encoder.encoder.embed_tokens.weight
    with safe_open(folder / "text_encoder" / "model.safetensors", "pt") as file:
        tensors = {key: file.get_tensor(key) for key in file.keys()}
    reference = copy.deepcopy(base_pipeline().text_encoder)
    state = reference.state_dict()
    for key in state:
        layer = key.removesuffix(".weight")
        state[key] = (
            modelopt_dequantize(tensors, layer) if layer in layers else tensors.get(key, tensors["shared.weight"])
        )
    reference.load_state_dict(state)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        got, expected = encoder(ids)[0], reference(ids)[0]
    assert_reassociated(got, expected, length=64, depth=12, what="text encoder")
    handle.remove()


def test_auto_prices_the_folder_packed_and_its_choice_gives_the_full_load_output():
    """The pipeline fits at its packed size (not at full precision): ``auto`` chooses a full load only if it prices
    the folder packed; with a third of that, an offloading mode, to the same output."""
    made = modelopt_folder(GRID)
    full = load(made.folder, "model_full_load")
    models = [c for c in full.target.components.values() if isinstance(c, torch.nn.Module)]
    loaded = sum(t.numel() * t.element_size() for m in models for t in [*m.parameters(), *m.buffers()])
    full.remove()
    for budget in (loaded, loaded // 3):
        handle = load(made.folder, "auto", vram_budget=budget)
        assert (handle.mode == "model_full_load") == (budget == loaded), handle.mode
        handle.target.set_progress_bar_config(disable=True)
        assert_bit_equal(run(handle.target, FAMILY), full_load_output(made), f"auto: {handle.mode}")
        handle.remove()


# -- every placement x storage ----------------------------------------------------------------------------------


def _cases() -> list:
    cases = [
        pytest.param(GRID, placement, storage, id=f"{GRID}-{placement_id(placement)}-{storage}")
        for placement in PLACEMENTS
        for storage in STORAGES
    ]
    cases += [
        pytest.param(name, placement, storage, id=f"{name}-{placement_id(placement)}-{storage}")
        for name, (placement, storage) in ONE_CASE.items()
    ]
    return cases


@pytest.mark.parametrize(("name", "placement", "storage"), _cases())
def test_every_placement_and_storage_gives_the_full_load_output(name, placement, storage, tmp_path):
    made = modelopt_folder(name)
    expected = full_load_output(made)
    mode, options = placement
    files = {"offload_dir": str(tmp_path)} if storage != "ram" else {}
    handle = load(made.folder, mode, storage=storage, **files, **options)
    handle.target.set_progress_bar_config(disable=True)
    assert_bit_equal(run(handle.target, FAMILY), expected, f"{name} {mode} {storage}")
    for component in QUANTIZED:
        assert set(packed_layers(getattr(handle.target, component))) == set(made.layers), "still packed after the call"
    handle.remove()


def test_save_quantized_and_load_back_give_the_same_output(tmp_path):
    made = modelopt_folder(GRID)
    handle = load(made.folder, "model_full_load")
    formats = packed_layers(handle.target.transformer)
    memmode.save_quantized(handle.target, tmp_path / "saved")
    handle.remove()
    assert quantization_config(tmp_path / "saved" / "transformer") is None, "saved in memmode's format"
    again = load(tmp_path / "saved", "model_group_offload", storage="mmap", offload_dir=str(tmp_path / "offload"))
    again.target.set_progress_bar_config(disable=True)
    assert packed_layers(again.target.transformer) == formats
    assert_bit_equal(run(again.target, FAMILY), full_load_output(made), "loaded back")
    again.remove()


# -- refusals, before anything is bound ------------------------------------------------------------------------


def test_an_unknown_method_is_refused_naming_it(tmp_path, bound):
    folder = _copy(modelopt_folder("fp8"), tmp_path)
    _edit_config(folder, quant_method="hqq_magic")
    with pytest.raises(CheckpointError, match="'hqq_magic'.*does not know") as refused:
        load(folder, "model_full_load")
    assert "transformer" in str(refused.value) and str(folder / "transformer") in str(refused.value)
    assert bound == [], "refused after binding"


@pytest.mark.parametrize("method", sorted(NOT_READ))
def test_a_method_memmode_does_not_read_is_refused_with_the_reason(method, tmp_path, bound):
    """A torchao folder (its weights pickled in a .bin) and every other method diffusers knows and memmode does not
    read: the method, the component, the reason and what loads it instead."""
    folder = _copy(modelopt_folder("fp8"), tmp_path)
    _edit_config(folder, quant_method=method)
    if method == "torchao":
        for shard in (folder / "transformer").glob("diffusion_pytorch_model*"):
            shard.unlink()
        (folder / "transformer" / "diffusion_pytorch_model.bin").write_bytes(b"pickled torchao tensors")
    with pytest.raises(CheckpointError, match=f"saved quantized with {method}") as refused:
        load(folder, "model_full_load")
    message = str(refused.value)
    assert "transformer" in message and ("from_pretrained" in message or ".gguf" in message)
    assert bound == [], "refused after binding"


@pytest.mark.parametrize("method", sorted(AUTO_QUANTIZER_MAPPING))
def test_every_method_diffusers_knows_is_read_or_refused_by_name(method, tmp_path):
    """diffusers 0.42's ``AUTO_QUANTIZER_MAPPING``, each method as its config.json writes it: an installed reader of
    it is found, or it is refused with its reason (never as a method nobody knows)."""
    bnb = {"quant_method": "bitsandbytes", "load_in_4bit": method.endswith("4bit"), "load_in_8bit": True}
    config = bnb if method.startswith("bitsandbytes") else {"quant_method": method}
    assert quant_method(config, tmp_path, "transformer") == method
    try:
        reader = reader_of_method(method, config["quant_method"], tmp_path, "transformer", current())
    except CheckpointError as refused:
        assert method in NOT_READ and NOT_READ[method] in str(refused)
    else:
        assert method not in NOT_READ
        assert method in reader.quant_methods or config["quant_method"] in reader.quant_methods


def test_a_folder_diffusers_saved_without_modelopts_export_is_refused(bound):
    """diffusers' ``save_pretrained`` of a model quantized with ``NVIDIAModelOptConfig`` writes modelopt's quantizer
    state (``_amax``), which only modelopt's own layers make weights of."""
    folder = diffusers_modelopt_folder()
    assert quantization_config(folder / "transformer")["quant_type"] == "FP8"
    with pytest.raises(CheckpointError, match="NVIDIAModelOptConfig.*export_hf_checkpoint") as refused:
        load(folder, "model_full_load")
    assert str(folder / "transformer") in str(refused.value)
    assert bound == [], "refused after binding"


def test_a_truncated_shard_is_refused_naming_it(tmp_path, bound):
    folder = _copy(modelopt_folder("nvfp4"), tmp_path)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    with open(weights, "r+b") as file:
        file.truncate(weights.stat().st_size - 1000)
    with pytest.raises(CheckpointError, match="truncated") as refused:
        load(folder, "model_full_load")
    assert str(weights) in str(refused.value)
    assert bound == [], "refused after binding"


@pytest.mark.parametrize(
    ("name", "change", "match"),
    [
        ("fp8", lambda scale: torch.ones(3), "neither one, one per row"),
        ("fp8_per_channel", lambda scale: torch.full_like(scale, float("nan")), "not finite"),
        ("nvfp4", lambda scale: scale[:, :1].contiguous(), "one per block of 16"),
    ],
    ids=["fp8-wrong-shape", "per-channel-nan", "nvfp4-wrong-shape"],
)
def test_a_damaged_scale_is_refused_naming_the_tensor(name, change, match, tmp_path, bound):
    made = modelopt_folder(name)
    folder = _copy(made, tmp_path)
    key = "blocks.0.attn1.to_q.weight_scale"
    for shard in made.shards():  # the shard that holds the scale, written again with it changed
        with safe_open(shard, "pt") as file:
            if key in file.keys():
                tensors = {k: file.get_tensor(k) for k in file.keys()}
                tensors[key] = change(tensors[key])
                save_file(tensors, folder / "transformer" / shard.name, metadata=file.metadata())
    with pytest.raises(CheckpointError, match=match) as refused:
        load(folder, "model_full_load")
    assert key in str(refused.value) and str(folder / "transformer") in str(refused.value)
    assert bound == [], "refused after binding"


def test_a_mode_with_a_quantizer_is_refused_before_anything_is_bound(bound):
    with pytest.raises(IncompatibleModeError, match="without '_and_qfloat8'") as refused:
        load(modelopt_folder("fp8").folder, "model_group_offload_and_qfloat8")
    assert "modelopt_fp8" in str(refused.value)
    assert bound == [], "refused after binding"
