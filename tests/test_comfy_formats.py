"""The ``comfy`` reader on ComfyUI's mixed precision: every weight format ComfyUI defines, in files written as
ComfyUI writes them, the weights quantized by comfy-kitchen's eager backend (``comfy_files.write_comfy``).

- each decode equals comfy-kitchen's own dequantization bit for bit in float32 (the same products in the same
  order), and rounds once to bfloat16;
- a mixed file — layers in every format beside full-precision ones, "nvfp4mixed" — reads each layer in its own
  codec, and a tiny Wan 2.2 pipeline given as such files (and as all-NVFP4 files) loads into every placement
  and storage giving ``model_full_load``'s output on the same files, every quantized layer resting packed at the
  file's bytes, priced packed by ``auto``, and round-trips through ``save_quantized`` bit for bit;
- the formats that quantize activations are refused by name with what runs them, an unknown name typed, and a
  damaged file (truncated, a scale of the wrong shape, a scale that is not finite) before anything is bound.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from torch import nn

import memmode_core as memmode
from comfy_files import LAYER_FORMATS, comfy_quant_marker, decode, dequantized, tensor_at, truncate, write_comfy
from community_pipelines import (
    FAMILY,
    PLACEMENTS,
    WIDE_WAN_CALL,
    packed_layers,
    wan_inputs,
    wide_wan_pipeline,
)
from helpers import assert_bit_equal, assert_reassociated, placement_id
from memmode_core import CheckpointError
from memmode_core.builtin.comfy.reader import ComfyReader
from memmode_core.contracts.quantizer import PAYLOAD
from memmode_core.loading import load as load_module
from original_checkpoints import PREFIX, to_original, wan_plan
from tiny_pipelines import run

pytest.importorskip("comfy_kitchen", reason="comfy-kitchen (ComfyUI's kernels) writes and checks the fixtures")

READER = ComfyReader()
TRANSFORMERS = ("transformer", "transformer_2")

FORMATS = LAYER_FORMATS


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two linear layers around a norm, every size a multiple of 32 (whole nvfp4 and mxfp8 blocks, unpadded)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 64))
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


WEIGHTS = ("0.weight", "2.weight")


# -- each format, decoded as comfy-kitchen dequantizes it ---------------------------------------------------------


@pytest.mark.parametrize("declare", ["markers", "metadata"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_decodes_to_comfy_kitchens_dequantization(tmp_path, name, declare):
    config, codec = FORMATS[name]
    state = tiny_state()
    path = tmp_path / f"{name}.safetensors"
    quantized = write_comfy(path, state, dict.fromkeys(WEIGHTS, config), declare=declare)
    contents = READER.read(path)
    assert set(contents.encoded) == set(WEIGHTS)
    for key in WEIGHTS:
        encoded = contents.encoded[key]
        assert encoded.codec.format_name == codec and encoded.shape == tuple(state[key].shape)
        expected = dequantized(quantized[key])
        assert expected.dtype == torch.float32
        assert_bit_equal(decode(path, contents, key), expected, f"{name} {key}")
        assert_bit_equal(decode(path, contents, key, torch.bfloat16), expected.to(torch.bfloat16), f"{name} bf16")
        # the payload is the file's weight bytes
        assert torch.equal(
            tensor_at(path, contents.stored[encoded.parts[PAYLOAD]]).view(torch.uint8).flatten(),
            quantized[key]._qdata.contiguous().view(torch.uint8).flatten(),
        )
    plain = {k for k in contents.stored if k not in {p for e in contents.encoded.values() for p in e.parts.values()}}
    assert plain == {"0.bias", "1.weight", "1.bias", "2.bias"}


def test_an_activation_scale_is_kept_with_its_layer_and_not_used(tmp_path):
    state = tiny_state()
    path = tmp_path / "nvfp4.safetensors"
    write_comfy(path, state, dict.fromkeys(WEIGHTS, {"format": "nvfp4"}))
    contents = READER.read(path)
    encoded = contents.encoded["0.weight"]
    assert encoded.parts["weight_input_scale"] == "0.input_scale"
    parts = {name: tensor_at(path, contents.stored[stored]) for name, stored in encoded.parts.items()}
    without = {name: part for name, part in parts.items() if name != "weight_input_scale"}
    shape = torch.Size(encoded.shape)
    assert_bit_equal(
        encoded.codec.unpack(parts, shape, torch.float32), encoded.codec.unpack(without, shape, torch.float32)
    )


def test_mxfp8_scales_stored_as_bytes_read_the_same(tmp_path):
    """ComfyUI saves E8M0 scales as ``F8_E8M0`` and reads them as uint8 too: both files decode alike."""
    state = tiny_state()
    layers = dict.fromkeys(WEIGHTS, {"format": "mxfp8"})
    write_comfy(tmp_path / "e8m0.safetensors", state, layers)
    quantized = write_comfy(tmp_path / "u8.safetensors", state, layers, e8m0_as_uint8=True)
    with open(tmp_path / "e8m0.safetensors", "rb") as file:
        assert b'"F8_E8M0"' in file.read(4096)
    for name in ("e8m0", "u8"):
        path = tmp_path / f"{name}.safetensors"
        contents = READER.read(path)
        assert_bit_equal(decode(path, contents, "2.weight"), dequantized(quantized["2.weight"]), name)


def test_comfyuis_own_int8_names_read_as_int8_tensorwise(tmp_path):
    """ComfyUI's ``int8`` (per row) and ``int8_convrot`` (ConvRot in groups of 256) store the same bytes."""
    torch.manual_seed(1)
    state = {"a.weight": torch.randn(32, 256), "b.weight": torch.randn(32, 256)}
    layers = {
        "a.weight": {"format": "int8_tensorwise", "per_row": True},
        "b.weight": {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256},
    }
    markers = {
        "a.comfy_quant": comfy_quant_marker({"format": "int8"}),
        "b.comfy_quant": comfy_quant_marker({"format": "int8_convrot"}),
    }
    path = tmp_path / "int8.safetensors"
    quantized = write_comfy(path, state, layers, replace=markers)
    contents = READER.read(path)
    assert contents.encoded["b.weight"].codec.format_name == "comfy_int8_convrot256"
    for key in state:
        assert_bit_equal(decode(path, contents, key), dequantized(quantized[key]), key)


def test_awq_with_its_zero_points_named_singular(tmp_path):
    """Some savers name awq's zero points ``weight_zero``."""
    state = tiny_state()
    path = tmp_path / "awq.safetensors"
    config = {"format": "awq_w4a16", "group_size": 32}
    quantized = write_comfy(tmp_path / "plural.safetensors", state, dict.fromkeys(WEIGHTS, config))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "plural.safetensors"))
    for key in WEIGHTS:
        layer = key.removesuffix(".weight")
        tensors[f"{layer}.weight_zero"] = tensors.pop(f"{layer}.weight_zeros")
    save_file(tensors, str(path))
    contents = READER.read(path)
    for key in WEIGHTS:
        assert_bit_equal(decode(path, contents, key), dequantized(quantized[key]), key)


def test_a_mixed_file_reads_each_layer_in_its_own_format(tmp_path):
    torch.manual_seed(2)
    state = {f"l{i}.weight": torch.randn(32, 64) for i in range(len(FORMATS) + 1)} | {"norm.weight": torch.ones(64)}
    layers = {f"l{i}.weight": config for i, (config, _) in enumerate(FORMATS.values())}
    path = tmp_path / "mixed.safetensors"
    quantized = write_comfy(path, state, layers, declare="metadata")
    contents = READER.read(path)
    assert {k: e.codec.format_name for k, e in contents.encoded.items()} == {
        key: codec for key, (_, codec) in zip(layers, FORMATS.values(), strict=True)
    }
    for key, qt in quantized.items():
        assert_bit_equal(decode(path, contents, key), dequantized(qt), key)
    full = f"l{len(FORMATS)}.weight"
    assert contents.stored[full].dtype == torch.float32 and full not in contents.encoded
    assert json.loads(contents.metadata["_quantization_metadata"])["layers"]["l0"] == {"format": "nvfp4"}


def test_every_codec_decodes_on_the_meta_device(tmp_path):
    """Only tensor operations: the forward decodes where the layer's tensors are."""
    torch.manual_seed(3)
    state = {f"l{i}.weight": torch.randn(32, 64) for i in range(len(FORMATS))}
    path = tmp_path / "mixed.safetensors"
    write_comfy(path, state, {f"l{i}.weight": c for i, (c, _) in enumerate(FORMATS.values())})
    contents = READER.read(path)
    for key, encoded in contents.encoded.items():
        parts = {name: tensor_at(path, contents.stored[stored]).to("meta") for name, stored in encoded.parts.items()}
        value = encoded.codec.unpack(parts, torch.Size(encoded.shape), torch.bfloat16)
        assert value.device.type == "meta" and value.shape == encoded.shape and value.dtype == torch.bfloat16, key


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_large_weight_decodes_band_by_band_to_the_bits_of_the_whole_decode(tmp_path, name, monkeypatch):
    """A layer of many bands (bands of 256 values here: 2 rows of 128) decodes into the compute dtype band by band;
    each value is the one the whole float32 decode rounds once to."""
    from memmode_core.quantization import row_bands

    config, _ = FORMATS[name]
    torch.manual_seed(5)
    path = tmp_path / f"{name}.safetensors"
    write_comfy(path, {"w.weight": torch.randn(384, 128) * 0.05}, {"w.weight": config})
    contents = READER.read(path)
    whole = decode(path, contents, "w.weight", torch.float32)
    codec = type(contents.encoded["w.weight"].codec)
    bands = []
    monkeypatch.setattr(row_bands, "BAND_VALUES", 256)
    monkeypatch.setattr(
        codec,
        "decode",
        lambda self, parts, shape, rows, real=codec.decode: bands.append(rows) or real(self, parts, shape, rows),
    )
    assert_bit_equal(decode(path, contents, "w.weight", torch.bfloat16), whole.to(torch.bfloat16), f"{name} banded")
    assert len(bands) == 192, "two rows a band"


# -- what it refuses ----------------------------------------------------------------------------------------------


def refused(path: Path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as raised:
        READER.read(path)
    message = str(raised.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.mark.parametrize(
    ("fmt", "runs_it"),
    [
        ("convrot_w4a4", "comfy-kitchen's CUDA kernels"),
        ("int4_tensorwise", "comfy-kitchen's CUDA kernels"),
        ("svdquant_w4a4", "nunchaku"),
        ("asym_w4a8_int8", "comfy-kitchen's kernels"),
    ],
)
def test_a_format_that_quantizes_activations_is_refused_by_name(tmp_path, fmt, runs_it):
    path = tmp_path / f"{fmt}.safetensors"
    markers = {"2.comfy_quant": comfy_quant_marker({"format": fmt})}
    write_comfy(path, tiny_state(), {"2.weight": {"format": "int8_tensorwise"}}, replace=markers)
    refused(path, "'2'", fmt, "activations", runs_it)


def test_an_unknown_format_name_is_refused(tmp_path):
    path = tmp_path / "unknown.safetensors"
    markers = {"2.comfy_quant": comfy_quant_marker({"format": "nvfp8"})}
    write_comfy(path, tiny_state(), {"2.weight": {"format": "nvfp4"}}, replace=markers)
    refused(path, "'2'", "'nvfp8' is not a format ComfyUI defines", "awq_w4a16")


@pytest.mark.parametrize(
    ("fmt", "tensor", "value", "why"),
    [
        ("nvfp4", "2.weight_scale", torch.zeros(64, 4, dtype=torch.float8_e4m3fn), "tiled layout"),
        ("nvfp4", "2.weight_scale_2", torch.tensor(float("nan")), "not finite"),
        ("nvfp4", "2.weight_scale_2", torch.ones(2), "one element"),
        ("nvfp4", "2.weight_scale_2", None, "is not in the file"),
        ("nvfp4", "2.input_scale", torch.tensor(float("inf")), "not finite"),
        ("mxfp8", "2.weight_scale", torch.zeros(128, 2, dtype=torch.uint8), "tiled layout"),
        ("int8_tensorwise", "2.weight_scale", torch.ones(2), "shape [2]"),
        ("int8_tensorwise", "2.weight_scale", torch.tensor([float("inf")]), "not finite"),
        ("int8_tensorwise", "2.weight_scale", torch.ones((), dtype=torch.int32), "not a float"),
        ("awq_w4a16", "2.weight_scale", torch.ones(64, 2, dtype=torch.bfloat16), "[2, 64]"),
    ],
)
def test_a_bad_tensor_of_a_layer_is_refused_naming_it(tmp_path, fmt, tensor, value, why):
    path = tmp_path / "bad.safetensors"
    config = {"format": fmt, "group_size": 16} if fmt == "awq_w4a16" else {"format": fmt}
    write_comfy(path, tiny_state(), {"2.weight": config}, replace={tensor: value})
    refused(path, "'2'", why)


def test_a_truncated_mixed_file_is_refused(tmp_path):
    path = tmp_path / "cut.safetensors"
    write_comfy(path, tiny_state(), dict.fromkeys(WEIGHTS, {"format": "nvfp4"}))
    truncate(path)
    refused(path, "truncated")


def test_a_scale_of_a_full_precision_weight_is_refused(tmp_path):
    path = tmp_path / "orphan.safetensors"
    write_comfy(path, tiny_state(), {"2.weight": {"format": "nvfp4"}}, replace={"0.weight_scale_2": torch.tensor(1.0)})
    refused(path, "'0.weight_scale_2'", "no _quantization_metadata or comfy_quant declares")


# -- a pipeline given as such files -------------------------------------------------------------------------------

#: the formats the mixed files give the transformers' linear layers in turn; None: left at full precision
MIXED = [*(config for config, _ in FORMATS.values()), None]


class ComfyMixedPipeline:
    """The wide Wan 2.2 pipeline of ``community_pipelines`` (the same seeds), its two transformers written under
    the original names (``model.diffusion_model.`` included) as ComfyUI files in two forms: ``nvfp4`` (every
    linear layer NVFP4, declared in ``_quantization_metadata``, as BFL's and Lightricks' releases) and ``mixed``
    (the layers in each format of :data:`MIXED` in turn, declared by ``comfy_quant`` markers, as ComfyUI saves)."""

    FORMS = {"nvfp4": ("metadata", lambda i: {"format": "nvfp4"}), "mixed": ("markers", lambda i: MIXED[i % 8])}

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="memmode-comfy-mixed-"))
        atexit.register(shutil.rmtree, self.folder, True)
        pipe = wide_wan_pipeline()
        pipe.save_pretrained(self.folder)
        self.originals = {}
        for name in TRANSFORMERS:
            state = getattr(pipe, name).state_dict()
            self.originals[name] = to_original(wan_plan(list(state)), state)
        self.files: dict[str, dict[str, Path]] = {}
        self.quantized: dict[str, dict[str, dict]] = {}
        for form, (declare, config_of) in self.FORMS.items():
            self.files[form], self.quantized[form] = {}, {}
            for name, original in self.originals.items():
                weights = [k for k, v in original.items() if k.endswith(".weight") and v.dim() == 2]
                layers = {k: config_of(i) for i, k in enumerate(weights) if config_of(i) is not None}
                path = self.folder / f"{name}-{form}.safetensors"
                self.quantized[form][name] = write_comfy(path, original, layers, declare=declare)
                self.files[form][name] = path
        self._full: dict[str, torch.Tensor] = {}

    def packed(self, form: str, name: str) -> dict[str, str]:
        """Layer path in diffusers' model -> the codec format the file's layer decodes with."""
        contents = READER.read(self.files[form][name])
        renamed = convert_wan_transformer_to_diffusers(
            {k.removeprefix(PREFIX): e.codec.format_name for k, e in contents.encoded.items()}
        )
        return {key.removesuffix(".weight"): fmt for key, fmt in renamed.items()}

    def reference(self, form: str) -> torch.Tensor:
        """The pipeline with each transformer holding comfy-kitchen's dequantization of the files' layers."""
        pipe = DiffusionPipeline.from_pretrained(self.folder)
        pipe.set_progress_bar_config(disable=True)
        for name, original in self.originals.items():
            values = dict(original)
            values.update((key, dequantized(qt)) for key, qt in self.quantized[form][name].items())
            meant = convert_wan_transformer_to_diffusers({k.removeprefix(PREFIX): v for k, v in values.items()})
            getattr(pipe, name).load_state_dict(meant, strict=True)
        return run(pipe, FAMILY)

    def load(self, form: str, mode: str, **kwargs):
        kwargs.setdefault("torch_dtype", torch.float32)
        files = {name: str(path) for name, path in self.files[form].items()}
        return memmode.load(self.folder, mode, device="cpu", **files, **kwargs)

    def full_load_output(self, form: str) -> torch.Tensor:
        if form not in self._full:
            handle = self.load(form, "model_full_load")
            handle.target.set_progress_bar_config(disable=True)
            self._full[form] = run(handle.target, FAMILY)
            handle.remove()
        return self._full[form]


@pytest.fixture(scope="module")
def comfy() -> ComfyMixedPipeline:
    return ComfyMixedPipeline()


@pytest.mark.parametrize("form", ["nvfp4", "mixed"])
def test_full_load_matches_comfy_kitchens_dequantization(comfy, form):
    """memmode decodes per call where the reference holds the dequantized weights: other tensors, other sums."""
    assert_reassociated(comfy.full_load_output(form), comfy.reference(form), **WIDE_WAN_CALL)


@pytest.mark.parametrize("form", ["nvfp4", "mixed"])
def test_every_quantized_layer_rests_packed_at_the_files_bytes(comfy, form):
    handle = comfy.load(form, "model_full_load")
    for name in TRANSFORMERS:
        module = getattr(handle.target, name)
        expected = comfy.packed(form, name)
        assert packed_layers(module) == expected
        if form == "mixed":
            assert set(expected.values()) == {codec for _, codec in FORMATS.values()}
        contents = READER.read(comfy.files[form][name])
        file_bytes = {k: v.nbytes for k, v in contents.stored.items()}
        renamed = convert_wan_transformer_to_diffusers({k.removeprefix(PREFIX): e for k, e in contents.encoded.items()})
        for key, encoded in renamed.items():
            layer = module.get_submodule(key.removesuffix(".weight"))
            held = {n: getattr(layer, n) for n in encoded.parts}
            # the layer holds its parts and nothing decoded: its weight bytes are the file's packed bytes
            assert {n: t.nbytes for n, t in held.items()} == {n: file_bytes[k] for n, k in encoded.parts.items()}
            assert not any(
                isinstance(p, torch.Tensor) and p.is_floating_point() and p.shape == encoded.shape
                for p in layer.parameters(recurse=False)
            )
    handle.remove()


def _grid() -> list:
    storages = ["ram", "disk", "mmap", "mmap"]
    cases = [pytest.param("mixed", p, s, id=f"mixed-{placement_id(p)}-{s}") for p, s in zip(PLACEMENTS, storages)]
    return [*cases, pytest.param("nvfp4", PLACEMENTS[1], "disk", id="nvfp4-block-disk")]


@pytest.mark.parametrize(("form", "placement", "storage"), _grid())
def test_every_placement_and_storage_gives_the_full_load_output(comfy, form, placement, storage, tmp_path):
    expected = comfy.full_load_output(form)
    mode, options = placement
    files = {"offload_dir": str(tmp_path)} if storage != "ram" else {}
    handle = comfy.load(form, mode, storage=storage, **files, **options)
    handle.target.set_progress_bar_config(disable=True)
    assert_bit_equal(run(handle.target, FAMILY), expected, f"{form} under {mode} + {storage}")
    for name in TRANSFORMERS:
        assert packed_layers(getattr(handle.target, name)) == comfy.packed(form, name)
    handle.remove()


def test_one_file_loads_alone_with_its_config(comfy, tmp_path):
    """The single-file road: ``load(file, mode, config=...)``, in an offloading mode equal to a full load."""
    path, config = comfy.files["mixed"]["transformer"], comfy.folder / "transformer"
    full = memmode.load(path, "model_full_load", device="cpu", torch_dtype=torch.float32, config=config).target
    expected = full(**wan_inputs())[0]
    handle = memmode.load(
        path,
        "model_group_offload",
        device="cpu",
        torch_dtype=torch.float32,
        config=config,
        storage="mmap",
        offload_dir=str(tmp_path),
        offload_type="leaf_level",
    )
    assert packed_layers(handle.target) == comfy.packed("mixed", "transformer")
    assert_bit_equal(handle.target(**wan_inputs())[0], expected, "one file under group offload")
    handle.remove()


def test_auto_prices_the_packed_layers_from_the_header(comfy):
    """All of it fits at its packed size, not at full precision: a full load is chosen only if priced packed."""
    full = comfy.load("nvfp4", "model_full_load")
    models = [c for c in full.target.components.values() if isinstance(c, nn.Module)]
    packed_bytes = sum(t.nbytes for m in models for t in [*m.parameters(), *m.buffers()])
    full.remove()
    handle = comfy.load("nvfp4", "auto", vram_budget=packed_bytes)
    assert handle.mode == "model_full_load"
    handle.remove()
    unpacked = packed_bytes + sum(
        sum(comfy.originals[n][k].nbytes for k in comfy.quantized["nvfp4"][n]) for n in TRANSFORMERS
    )
    assert unpacked > 1.5 * packed_bytes


def test_a_padded_nvfp4_layer_reads_in_its_stored_shape_and_a_mismatch_is_refused(comfy, tmp_path, monkeypatch):
    """ComfyUI pads an nvfp4 weight to whole 16 x 16 blocks and the file keeps no unpadded shape (ComfyUI takes it
    from its model): the layer reads in its padded shape, and where the model's differs, core's check refuses the
    file naming the tensor, before anything is bound."""
    torch.manual_seed(4)
    path = tmp_path / "padded.safetensors"
    write_comfy(path, {"0.weight": torch.randn(24, 40)}, {"0.weight": {"format": "nvfp4"}})
    assert READER.read(path).encoded["0.weight"].shape == (32, 48)
    bound: list = []
    monkeypatch.setattr(load_module, "bind", lambda skeleton, *args, **kwargs: bound.append(skeleton))
    original = dict(comfy.originals["transformer"])
    head = f"{PREFIX}head.head.weight"
    original[head] = torch.randn(72, 256)  # stored as [80, 128] codes, read as [80, 256]; the model's is [64, 256]
    path = tmp_path / "mismatch.safetensors"
    write_comfy(path, original, {head: {"format": "nvfp4"}})
    with pytest.raises(CheckpointError, match=r"proj_out: a \[80, 256\] weight in the file") as refused_load:
        memmode.load(comfy.folder, "model_full_load", device="cpu", torch_dtype=torch.float32, transformer=str(path))
    assert str(path) in str(refused_load.value)
    assert bound == [], "refused after binding"


def test_a_refused_file_is_refused_before_anything_is_bound(comfy, tmp_path, monkeypatch):
    bound: list = []
    monkeypatch.setattr(load_module, "bind", lambda skeleton, *args, **kwargs: bound.append(skeleton))
    original = comfy.originals["transformer"]
    key = f"{PREFIX}blocks.0.self_attn.q"
    path = tmp_path / "svdquant.safetensors"
    write_comfy(
        path,
        original,
        {f"{key}.weight": {"format": "int8_tensorwise"}},
        replace={f"{key}.comfy_quant": comfy_quant_marker({"format": "svdquant_w4a4"})},
    )
    with pytest.raises(CheckpointError, match="svdquant_w4a4"):
        memmode.load(comfy.folder, "model_full_load", device="cpu", torch_dtype=torch.float32, transformer=str(path))
    assert bound == [], "refused after binding"


@pytest.mark.parametrize("form", ["nvfp4", "mixed"])
def test_save_quantized_and_load_back_is_bit_exact(comfy, form, tmp_path):
    handle = comfy.load(form, "model_full_load")
    formats = {name: packed_layers(getattr(handle.target, name)) for name in TRANSFORMERS}
    memmode.save_quantized(handle.target, tmp_path / "saved")
    handle.remove()
    loaded = memmode.load(
        tmp_path / "saved", "model_group_offload", device="cpu", storage="mmap", offload_dir=str(tmp_path / "off")
    )
    loaded.target.set_progress_bar_config(disable=True)
    assert {name: packed_layers(getattr(loaded.target, name)) for name in TRANSFORMERS} == formats
    assert_bit_equal(run(loaded.target, FAMILY), comfy.full_load_output(form), f"saved {form}, loaded")
    loaded.remove()
