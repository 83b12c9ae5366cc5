"""Folders diffusers saved with ``BitsAndBytesConfig`` and ``QuantoConfig``, read by the built-in ``bitsandbytes`` and
``quanto`` readers: each weight decoded as the library dequantizes it, kept packed under every mode, refused typed
when damaged, and saved back by ``save_quantized`` as it was.

The folders are diffusers' own ``save_pretrained`` of the 256-wide Wan transformer quantized on the CPU
(``tests/library_folders.py``): a model folder per method (quantized in bfloat16) and the Wan 2.2 pipeline's folder
with only its ``transformer`` quantized (in float32, the pipeline's dtype: what memmode loads is what the folder
holds, so every lossless mode is compared bit for bit with ``model_full_load`` of the same folder).
"""

from __future__ import annotations

import json
import math
import struct
from functools import cache
from pathlib import Path

import pytest
import torch

pytest.importorskip("bitsandbytes", reason="the anchor of the bitsandbytes folders (requirements-test.txt)")
pytest.importorskip("optimum.quanto", reason="the anchor of the quanto folders (requirements-test.txt)")

import memmode_core as memmode  # noqa: E402
from community_pipelines import FAMILY, packed_layers  # noqa: E402
from helpers import assert_bit_equal, in_torch_memory, placement_id  # noqa: E402
from library_folders import (  # noqa: E402
    DTYPE,
    METHODS,
    WEIGHTS,
    anchor_weights,
    copy_folder,
    json_tensor,
    model_folder,
    pipeline_folder,
    quantization_config,
    quantized_weights,
    rewrite,
    sharded_model_folder,
    tensors,
    text_encoder_folder,
    truncate,
)
from memmode_core import CheckpointError  # noqa: E402
from memmode_core.builtin.bitsandbytes import BitsAndBytesReader  # noqa: E402
from memmode_core.builtin.quanto import QuantoReader  # noqa: E402
from memmode_core.loading import load as load_module  # noqa: E402
from memmode_core.quantization import packed_record, row_bands  # noqa: E402
from tiny_pipelines import run  # noqa: E402

BITSANDBYTES = [m for m in METHODS if m.startswith("bnb_")]
QUANTO = [m for m in METHODS if m.startswith("quanto_")]
#: what the readers leave out of a folder: bitsandbytes' JSON states, its 4-bit table and 8-bit layout marker, and
#: quanto's activation scales
NOT_THE_MODELS = (".quant_map", ".weight_format", ".input_scale", ".output_scale")
#: a representative set of lossless placements x storages, one per method, each placement and storage several times
CASES = {
    "bnb_nf4": (("sequential_cpu_offload", {}), "disk"),
    "bnb_nf4_double": (("model_group_offload", {"offload_type": "block_level"}), "mmap"),
    "bnb_fp4": (("model_cpu_offload", {}), "mmap"),
    "bnb_fp4_double": (("model_group_offload", {"offload_type": "leaf_level"}), "ram"),
    "bnb_int8": (("model_group_offload", {"offload_type": "leaf_level"}), "disk"),
    "quanto_int8": (("model_cpu_offload", {}), "disk"),
    "quanto_float8": (("sequential_cpu_offload", {}), "mmap"),
    "quanto_int4": (("model_group_offload", {"offload_type": "block_level"}), "disk"),
    "quanto_int2": (("model_group_offload", {"offload_type": "leaf_level"}), "mmap"),
}


def load(folder: Path, mode: str = "model_full_load", dtype: torch.dtype = torch.float32, **kwargs):
    return memmode.load(folder, mode, device="cpu", torch_dtype=dtype, **kwargs)


def decoded(layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A packed layer's weight, decoded by its codec from what the layer holds (as its forward does)."""
    record = packed_record(layer)
    return record.codec.unpack({name: getattr(layer, name) for name in record.names}, record.shape, dtype)


def layers(weights) -> set[str]:
    return {key.removesuffix(".weight") for key in weights}


@cache
def full_load_output(method: str, in_memory: bool = False) -> torch.Tensor:
    """Call 1 of the pipeline folder of ``method`` under ``model_full_load``: what every lossless mode must give.
    ``in_memory``: its weights moved into torch memory first, 64-byte aligned as a file storage's are (the folder's
    own views are not: ``helpers.in_torch_memory``), for a mode whose storage writes files."""
    handle = load(pipeline_folder(method))
    handle.target.set_progress_bar_config(disable=True)
    return run(in_torch_memory(handle.target) if in_memory else handle.target, FAMILY)


@pytest.fixture
def bound(monkeypatch) -> list:
    """The components ``load`` binds, none of them actually bound: a refusal must come first."""
    skeletons: list = []
    monkeypatch.setattr(load_module, "bind", lambda skeleton, *args, **kwargs: skeletons.append(skeleton))
    return skeletons


# -- the fixtures --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_the_folder_is_what_diffusers_writes(method):
    folder = model_folder(method)
    config, stored = quantization_config(folder), tensors(folder)
    weights = quantized_weights(folder)
    assert len(weights) > 20
    if method.startswith("bnb_"):
        assert config["quant_method"] == "bitsandbytes"
        assert config["load_in_8bit"] == (method == "bnb_int8") != config["load_in_4bit"]
    else:
        assert config == {**config, "quant_method": "quanto", "weights_dtype": method.removeprefix("quanto_")}
    for weight in weights:
        if method == "bnb_int8":
            layer = weight.removesuffix(".weight")
            assert stored[weight].dtype == torch.int8 and stored[f"{layer}.SCB"].dtype == torch.float32
            assert stored[f"{layer}.weight_format"].item() == 0
        elif method.startswith("bnb_"):
            quant_type = method.split("_")[1]
            state = json.loads(bytes(stored[f"{weight}.quant_state.bitsandbytes__{quant_type}"].numpy()))
            assert state["quant_type"] == quant_type and state["dtype"] == "bfloat16"
            assert ("nested_offset" in state) == method.endswith("_double")
            assert stored[weight].dtype == (torch.bfloat16 if method.endswith("_storage") else torch.uint8)
            assert stored[f"{weight}.absmax"].dtype == (torch.uint8 if "nested_offset" in state else torch.float32)
        elif method in ("quanto_int4", "quanto_int2"):
            assert stored[f"{weight}._data._data"].dtype == torch.uint8
            assert stored[f"{weight}._scale"].dtype == stored[f"{weight}._shift"].dtype == DTYPE
        else:
            codes = stored[f"{weight}._data"]
            assert codes.dtype == (torch.int8 if method == "quanto_int8" else torch.float8_e4m3fn)
            assert stored[f"{weight}._scale"].shape == (codes.shape[0], 1)


# -- decoding ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", BITSANDBYTES)
def test_bitsandbytes_weights_rest_packed_and_decode_as_bitsandbytes_dequantizes(method):
    """float32, bit for bit: bitsandbytes computes ``level * absmax`` (and the nested absmax) in float32 and rounds
    once, so a bfloat16 decode is the float32 one rounded, which is what its bfloat16 kernel gives too. Against the
    default backend's implementation on every layer; against ``dequantize_4bit`` on the CPU wherever a row fills whole
    blocks (its CPU kernel cuts blocks at rows: see ``library_folders.anchor_weights``)."""
    folder = model_folder(method)
    model = load(folder, dtype=DTYPE).target
    anchors = anchor_weights(folder, default_backend=True)
    on_cpu = anchor_weights(folder)
    assert set(packed_layers(model)) == layers(anchors)
    blocked = 0
    for key, expected in anchors.items():
        layer = model.get_submodule(key.removesuffix(".weight"))
        assert_bit_equal(decoded(layer, torch.float32), expected, key)
        assert torch.equal(decoded(layer, torch.bfloat16), expected.to(torch.bfloat16)), f"{key}: rounded once"
        if method == "bnb_int8" or expected.shape[1] % 64 == 0:
            assert torch.equal(on_cpu[key], expected), f"{key}: bitsandbytes' CPU kernel"
            blocked += 1
    assert blocked > 20


@pytest.mark.parametrize("method", QUANTO)
def test_quanto_weights_rest_packed_and_decode_as_quanto_dequantizes(method):
    """In the scale's dtype (bfloat16 here), as quanto's ``dequantize`` computes, then cast: bit for bit."""
    folder = model_folder(method)
    model = load(folder, dtype=DTYPE).target
    anchors = anchor_weights(folder)
    assert set(packed_layers(model)) == layers(anchors)
    grouped = 0
    for key, expected in anchors.items():
        layer = model.get_submodule(key.removesuffix(".weight"))
        assert expected.dtype == DTYPE
        assert_bit_equal(decoded(layer, DTYPE), expected, key)
        assert torch.equal(decoded(layer, torch.float32), expected.float()), key
        grouped += int(hasattr(layer, "weight_shift") and layer.weight_scale.shape[0] != expected.shape[0])
    assert grouped > 20 if method in ("quanto_int4", "quanto_int2") else grouped == 0


@pytest.mark.parametrize("method", ["bnb_fp4_double", "bnb_int8", "quanto_int4", "quanto_int2"])
@pytest.mark.parametrize("band", [129, 1])
def test_a_weight_decoded_a_band_of_rows_at_a_time_is_the_same(method, band, monkeypatch):
    """A large layer is decoded a band of rows at a time (``row_bands.decode_by_rows``); bands that start inside a
    bitsandbytes block (its 32-input layer's rows are half a block) or cross quanto's packed segments give the same
    bits as the whole weight decoded at once."""
    folder = model_folder(method)
    model = load(folder, dtype=DTYPE).target
    anchors = anchor_weights(folder, default_backend=True)
    monkeypatch.setattr(row_bands, "BAND_VALUES", band)
    for key, expected in anchors.items():
        layer = model.get_submodule(key.removesuffix(".weight"))
        assert torch.equal(decoded(layer, DTYPE), expected.to(DTYPE)), key


@pytest.mark.parametrize("method", ["bnb_nf4_double", "bnb_int8", "quanto_int4", "quanto_float8"])
def test_a_packed_layer_holds_the_folders_own_bytes(method):
    """Nothing is decoded at load: the model holds exactly the folder's tensors less what is not the model's (quant
    states, the 4-bit table, the layout marker, activation scales): its weight bytes are the packed bytes."""
    folder = pipeline_folder(method) / "transformer"
    model = load(folder).target  # float32, as the folder holds it: no tensor converted
    held = sum(t.numel() * t.element_size() for t in model.parameters())
    held += sum(
        b.numel() * b.element_size()
        for m in model.modules()
        for name, b in m.named_buffers(recurse=False)
        if name not in m._non_persistent_buffers_set  # rope's tables: computed, not loaded
    )
    kept = {k: v for k, v in tensors(folder).items() if ".quant_state." not in k and not k.endswith(NOT_THE_MODELS)}
    assert held == sum(t.numel() * t.element_size() for t in kept.values())
    for key in quantized_weights(folder):
        layer = model.get_submodule(key.removesuffix(".weight"))
        codes = next(kept[k] for k in (key, f"{key}._data._data", f"{key}._data") if k in kept)
        assert torch.equal(layer.weight_packed.reshape(-1).view(torch.uint8), codes.reshape(-1).view(torch.uint8))


# -- every mode ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "placement", "storage"),
    [pytest.param(m, p, s, id=f"{m}-{placement_id(p)}-{s}") for m, (p, s) in CASES.items()],
)
def test_a_pipeline_with_its_transformer_quantized_gives_the_full_load_output(method, placement, storage, tmp_path):
    folder = pipeline_folder(method)
    mode, options = placement
    files = {"offload_dir": str(tmp_path)} if storage != "ram" else {}
    handle = load(folder, mode, storage=storage, **files, **options)
    handle.target.set_progress_bar_config(disable=True)
    expected = full_load_output(method, in_memory=storage != "ram")
    assert_bit_equal(run(handle.target, FAMILY), expected, f"{method} under {mode} + {storage}")
    # still packed after the call, in the reader's formats; the other transformer is as saved
    expected = layers(quantized_weights(folder / "transformer"))
    formats = packed_layers(handle.target.transformer)
    assert set(formats) == expected
    assert {f.split("_")[0] for f in formats.values()} == {method.split("_")[0]}
    assert packed_layers(handle.target.transformer_2) == {}
    handle.remove()


def test_auto_prices_the_folder_packed(tmp_path):
    """``auto`` prices the quantized transformer at its packed size: the pipeline fits a budget of its packed bytes,
    which it would not dequantized."""
    method = "bnb_nf4_double"
    full = load(pipeline_folder(method))
    models = [c for c in full.target.components.values() if isinstance(c, torch.nn.Module)]
    loaded = sum(t.numel() * t.element_size() for m in models for t in [*m.parameters(), *m.buffers()])
    transformer = full.target.transformer
    unpacked = sum(math.prod(packed_record(s).shape) * 4 for s in transformer.modules() if packed_record(s))
    packed = sum(
        getattr(s, n).numel() * getattr(s, n).element_size()
        for s in transformer.modules()
        if (record := packed_record(s))
        for n in record.names
    )
    assert unpacked > 4 * packed and loaded - packed + unpacked > 1.2 * loaded
    handle = load(pipeline_folder(method), "auto", vram_budget=loaded)
    assert handle.mode == "model_full_load"
    handle.target.set_progress_bar_config(disable=True)
    assert_bit_equal(run(handle.target, FAMILY), full_load_output(method), "auto")
    handle.remove()


# -- a transformers component -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method",
    [
        "bnb_int8",
        "bnb_nf4_double",
    ],
)
def test_a_text_encoder_transformers_quantized_rests_packed_and_gives_the_full_load_output(method, tmp_path):
    """transformers' ``save_pretrained`` of a UMT5 encoder loaded with its ``BitsAndBytesConfig`` writes the same
    tensors as diffusers': read by the same reader, decoded as bitsandbytes dequantizes, under every mode."""
    folder = text_encoder_folder(method)
    full = load(folder)
    encoder = full.target.text_encoder
    anchors = anchor_weights(folder / "text_encoder", default_backend=True)
    assert set(packed_layers(encoder)) == layers(anchors) and len(anchors) > 5
    for key, expected in anchors.items():
        assert_bit_equal(decoded(encoder.get_submodule(key.removesuffix(".weight")), torch.float32), expected, key)
    full.target.set_progress_bar_config(disable=True)
    expected = run(in_torch_memory(full.target), FAMILY)
    handle = load(folder, "model_group_offload", storage="disk", offload_dir=str(tmp_path), offload_type="leaf_level")
    handle.target.set_progress_bar_config(disable=True)
    assert_bit_equal(run(handle.target, FAMILY), expected, f"{method} text encoder, group offload + disk")
    assert set(packed_layers(handle.target.text_encoder)) == layers(anchors)
    handle.remove()


# -- save_quantized ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["bnb_nf4_double", "bnb_int8", "quanto_int4"])
def test_save_quantized_and_load_back_is_bit_exact(method, tmp_path):
    """Each layer keeps its encoding (a double-quantized layer's codec, its offset in its format name, is found again
    through ``Reader.codecs()``), and the loaded pipeline gives the folder's full-load output bit for bit."""
    handle = load(pipeline_folder(method))
    formats = packed_layers(handle.target.transformer)
    memmode.save_quantized(handle.target, tmp_path / "saved")
    handle.remove()
    loaded = load(tmp_path / "saved", "model_group_offload", storage="mmap", offload_dir=str(tmp_path / "off"))
    loaded.target.set_progress_bar_config(disable=True)
    assert packed_layers(loaded.target.transformer) == formats
    assert_bit_equal(run(loaded.target, FAMILY), full_load_output(method, True), f"{method}: saved, loaded back")
    loaded.remove()


def test_every_codec_is_found_by_its_format_name():
    for reader in (BitsAndBytesReader(), QuantoReader()):
        codecs = reader.codecs()
        for name, codec in codecs.items():
            assert codec.format_name == name and not codec.packs
    nested = BitsAndBytesReader().codecs()["bnb_nf4_b64_n256_o3db25000"]
    assert (nested.quant_type, nested.blocksize, nested.nested_blocksize) == ("nf4", 64, 256)
    assert nested.nested_offset == struct.unpack("<f", bytes.fromhex("3db25000")[::-1])[0] == 0.087066650390625
    assert "bnb_nf4_b65" not in BitsAndBytesReader().codecs()


# -- damaged folders -----------------------------------------------------------------------------------------------

LAYER = "blocks.0.attn1.to_q"


def _state_key(method: str) -> str:
    return f"{LAYER}.weight.quant_state.bitsandbytes__{method.split('_')[1]}"


def _set(key: str, value: torch.Tensor):
    def change(values: dict) -> None:
        values[key] = value

    return change


def _drop(key: str):
    return lambda values: values.pop(key)


def _shorter(key: str):
    return lambda values: values.__setitem__(key, values[key][:-1].clone())


def _not_finite(key: str):
    def change(values: dict) -> None:
        values[key] = values[key].clone()
        values[key].view(-1)[0] = float("nan")

    return change


NF4_STATE, FP4_STATE = _state_key("bnb_nf4"), _state_key("bnb_fp4")
AF4_STATE = FP4_STATE.replace("__fp4", "__af4")
BAD_BLOCKSIZE = json_tensor({"quant_type": "nf4", "blocksize": 65, "dtype": "bfloat16", "shape": [256, 256]})
W = f"{LAYER}.weight"
#: (method, what is done to the folder, the tensor the refusal names, what it says)
DAMAGES = {
    "quant state not JSON": ("bnb_nf4", _set(NF4_STATE, json_tensor("x")[:3]), NF4_STATE, "does not parse"),
    "quant state blocksize": ("bnb_nf4", _set(NF4_STATE, BAD_BLOCKSIZE), NF4_STATE, "blocksize 65"),
    "unknown quant type": ("bnb_fp4", lambda v: v.__setitem__(AF4_STATE, v.pop(FP4_STATE)), AF4_STATE, "'af4'"),
    "absmax one short": ("bnb_nf4", _shorter(f"{W}.absmax"), f"{W}.absmax", "must hold 1024 float32"),
    "nested absmax short": ("bnb_nf4_double", _shorter(f"{W}.nested_absmax"), f"{W}.nested_absmax", "hold 4 float32"),
    "nested absmax NaN": ("bnb_nf4_double", _not_finite(f"{W}.nested_absmax"), f"{W}.nested_absmax", "not finite"),
    "quant map not the table": ("bnb_fp4", _not_finite(f"{W}.quant_map"), f"{W}.quant_map", "not bitsandbytes' fp4"),
    "codes missing": ("bnb_fp4_double", _drop(W), W, "no such tensor"),
    "SCB of the wrong shape": ("bnb_int8", _shorter(f"{LAYER}.SCB"), f"{LAYER}.SCB", "float32 \\[256\\]"),
    "weight_format col32": (
        "bnb_int8",
        _set(f"{W}_format", torch.tensor(1, dtype=torch.uint8)),
        f"{W}_format",
        "row-major",
    ),
    "quanto scale NaN": ("quanto_int8", _not_finite(f"{W}._scale"), f"{W}._scale", "not finite"),
    "quanto scale shape": ("quanto_float8", _shorter(f"{W}._scale"), f"{W}._scale", "float \\[256, 1\\]"),
    "quanto shift missing": ("quanto_int4", _drop(f"{W}._shift"), f"{W}._shift", "missing"),
    "quanto codes shape": ("quanto_int4", _shorter(f"{W}._data._data"), f"{W}._data._data", "as \\[256, 128\\]"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_folder_is_refused_naming_the_tensor_before_anything_is_bound(damage, tmp_path, bound):
    method, change, key, says = DAMAGES[damage]
    folder = copy_folder(model_folder(method), tmp_path / "damaged")
    rewrite(folder, change)
    with pytest.raises(CheckpointError, match=says) as refused:
        load(folder)
    assert str(folder) in str(refused.value) and key in str(refused.value)
    assert bound == [], "refused after binding"


def test_a_truncated_checkpoint_is_refused_before_anything_is_bound(tmp_path, bound):
    folder = copy_folder(model_folder("bnb_nf4_double"), tmp_path / "truncated")
    truncate(folder)
    with pytest.raises(CheckpointError) as refused:
        load(folder)
    assert WEIGHTS in str(refused.value)
    assert bound == [], "refused after binding"


@pytest.mark.parametrize("method", ["bnb_nf4_double", "quanto_int4"])
def test_a_sharded_folder_reads_as_the_folder_in_one_file(method):
    """diffusers' shards (a layer's codes, absmax and quant state may lie in different files) read as one file."""
    folder = sharded_model_folder(method)
    assert len(list(folder.glob("*.safetensors"))) > 2 and (folder / f"{WEIGHTS}.index.json").is_file()
    sharded, whole = load(folder, dtype=DTYPE).target, load(model_folder(method), dtype=DTYPE).target
    formats = packed_layers(whole)
    assert packed_layers(sharded) == formats
    for path in formats:
        expected = decoded(whole.get_submodule(path), torch.float32)
        assert torch.equal(decoded(sharded.get_submodule(path), torch.float32), expected), path


def test_a_truncated_shard_is_refused_naming_it_before_anything_is_bound(tmp_path, bound):
    folder = copy_folder(sharded_model_folder("bnb_nf4_double"), tmp_path / "truncated")
    shard = sorted(folder.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError) as refused:
        load(folder)
    assert shard.name in str(refused.value)
    assert bound == [], "refused after binding"


def test_a_folder_contradicting_its_config_is_refused(tmp_path, bound):
    folder = copy_folder(model_folder("bnb_int8"), tmp_path / "flags")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(load_in_4bit=True, load_in_8bit=False, _load_in_4bit=True, _load_in_8bit=False)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="contradicts itself"):
        load(folder)
    folder = copy_folder(model_folder("quanto_int8"), tmp_path / "qtype")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["weights_dtype"] = "int4"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="weight._data._data") as refused:
        load(folder)
    assert str(folder) in str(refused.value)
    assert bound == [], "refused after binding"
