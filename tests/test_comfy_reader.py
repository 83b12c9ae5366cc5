"""The built-in ``comfy`` reader, its fp8 forms: which files it takes, what it says lies where, and the values its
codec decodes from the file's own bytes — bit for bit the value ComfyUI's files mean (``weight.float() * scale``).

Fixture files come from ``tests/comfy_files.py``; every bad input must be refused, typed, naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from comfy_files import (
    E4M3,
    E5M2,
    comfy_quant_marker,
    damage_header,
    decode,
    quantized_keys,
    tensor_at,
    tiny_state,
    truncate,
    write_legacy_scaled,
    write_metadata_scaled,
    write_plain,
    write_plain_fp8,
)
from memmode_core.builtin.comfy.codecs import FLOAT8_CODECS as CODECS
from memmode_core.builtin.comfy.reader import ComfyReader
from memmode_core.contracts.errors import CheckpointError
from memmode_core.contracts.quantizer import PAYLOAD
from memmode_core.contracts.reader import FileContents

READER = ComfyReader()
#: the tensors that are no weight of the model: they must appear nowhere in what the reader gives
NOT_THE_MODELS = ("scaled_fp8", ".comfy_quant")
#: the activation scales: kept as a part of their layer (``weight_input_scale``), never a tensor of the model
INPUT_SCALES = (".scale_input", ".input_scale")


def reads(path: Path) -> bool:
    with open(path, "rb") as file:
        return READER.reads(path, file.read(64))


def check_contents(path: Path, contents: FileContents, stored_q: dict, state: dict) -> None:
    """Every quantized weight decodes to ``q.float() * scale`` exactly (and its bf16 cast in bf16); every other
    tensor is a plain stored tensor at the byte range safetensors itself reads."""
    assert set(contents.encoded) == set(stored_q) == set(quantized_keys(state))
    assert contents.size == path.stat().st_size
    for key, (q, scale) in stored_q.items():
        encoded = contents.encoded[key]
        assert encoded.dtype == torch.float32 and encoded.shape == tuple(q.shape)
        assert list(encoded.parts)[0] == PAYLOAD and encoded.parts[PAYLOAD] == key
        payload = contents.stored[key]
        assert payload.dtype == torch.uint8 and payload.shape == tuple(q.shape)
        assert torch.equal(tensor_at(path, payload), q.view(torch.uint8))
        expected = q.float() if scale is None else q.float() * scale
        if scale is None:
            assert set(encoded.parts) - {"weight_input_scale"} == {PAYLOAD}
        else:
            part = contents.stored[encoded.parts["weight_scale"]]
            assert part.dtype == torch.float32 and part.shape == (1,)
        assert torch.equal(decode(path, contents, key), expected)
        assert torch.equal(decode(path, contents, key, torch.bfloat16), expected.to(torch.bfloat16))
    reference = load_file(str(path))
    parts = {stored for e in contents.encoded.values() for stored in e.parts.values()}
    plain = {k for k in contents.stored if k not in parts}
    assert plain == set(state) - set(stored_q)
    for key in plain:
        assert torch.equal(tensor_at(path, contents.stored[key]), reference[key])
    for key in [*contents.stored, *contents.encoded]:
        assert not key.endswith(NOT_THE_MODELS), key
        assert not key.endswith(INPUT_SCALES) or key in parts, key
    for encoded in contents.encoded.values():
        if "weight_input_scale" in encoded.parts:
            assert encoded.parts["weight_input_scale"].endswith(INPUT_SCALES)
            assert contents.stored[encoded.parts["weight_input_scale"]].shape == (1,)


@pytest.fixture
def state():
    return tiny_state()


# -- recognizing the files ------------------------------------------------------------------------------


def test_it_reads_every_fp8_form_and_no_other_file(tmp_path, state):
    forms = {
        "legacy": lambda p: write_legacy_scaled(p, state),
        "legacy_without_marker": lambda p: write_legacy_scaled(p, state, marker=False),
        "metadata": lambda p: write_metadata_scaled(p, state),
        "metadata_uint8": lambda p: write_metadata_scaled(p, state, container=True),
        "e4m3fn": lambda p: write_plain_fp8(p, state, fp8=E4M3),
        "e5m2": lambda p: write_plain_fp8(p, state, fp8=E5M2),
    }
    for name, write in forms.items():
        write(tmp_path / f"{name}.safetensors")
        assert reads(tmp_path / f"{name}.safetensors"), name
    write_plain(tmp_path / "bf16.safetensors", state)
    write_plain(tmp_path / "fp32.safetensors", {k: v.float() for k, v in state.items()})
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + bytes(200))
    (tmp_path / "short.bin").write_bytes(b"\x01")
    write_plain_fp8(tmp_path / "damaged.safetensors", state)
    damage_header(tmp_path / "damaged.safetensors")
    for name in ("bf16.safetensors", "fp32.safetensors", "x.gguf", "short.bin", "damaged.safetensors"):
        assert not reads(tmp_path / name), name


def test_a_metadata_file_in_any_format_is_its(tmp_path, state):
    """A file whose metadata declares only formats other than fp8 is ComfyUI's too: read, or refused typed."""
    write_metadata_scaled(
        tmp_path / "m.safetensors", state, container=True, formats=dict.fromkeys(["0", "2"], {"format": "nvfp4"})
    )
    assert reads(tmp_path / "m.safetensors")


# -- what it reads -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_shape", [(), (1,)])
def test_legacy_scaled(tmp_path, state, scale_shape):
    path = tmp_path / "legacy.safetensors"
    stored_q = write_legacy_scaled(path, state, scale_shape=scale_shape)
    contents = READER.read(path)
    check_contents(path, contents, stored_q, state)
    assert {e.codec.name for e in contents.encoded.values()} == {"comfy_fp8_e4m3fn"}


def test_legacy_scaled_e5m2_and_a_model_prefix(tmp_path, state):
    prefixed = {f"model.diffusion_model.{k}": v for k, v in state.items()}
    path = tmp_path / "legacy.safetensors"
    stored_q = write_legacy_scaled(path, prefixed, fp8=E5M2, extra={"model.diffusion_model.scaled_fp8": torch.zeros(2)})
    contents = READER.read(path)
    check_contents(path, contents, stored_q, prefixed)
    assert {e.codec for e in contents.encoded.values()} == {CODECS[E5M2]}


@pytest.mark.parametrize("container", [False, True])
def test_quantization_metadata(tmp_path, state, container):
    path = tmp_path / "metadata.safetensors"
    stored_q = write_metadata_scaled(path, state, container=container)
    contents = READER.read(path)
    check_contents(path, contents, stored_q, state)
    assert json.loads(contents.metadata["_quantization_metadata"])["format_version"] == "1.0"


def test_metadata_layers_named_without_the_models_prefix(tmp_path, state):
    prefixed = {f"model.diffusion_model.{k}": v for k, v in state.items()}
    names = {f"model.diffusion_model.{layer}": layer for layer in ("0", "2")}
    path = tmp_path / "metadata.safetensors"
    stored_q = write_metadata_scaled(path, prefixed, container=True, layer_names=names)
    check_contents(path, READER.read(path), stored_q, prefixed)


def test_comfy_quant_markers_declare_layers_too(tmp_path, state):
    path = tmp_path / "markers.safetensors"
    markers = {f"{layer}.comfy_quant": comfy_quant_marker({"format": "float8_e4m3fn"}) for layer in ("0", "2")}
    stored_q = write_metadata_scaled(path, state, extra=markers)
    check_contents(path, READER.read(path), stored_q, state)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_plain_fp8_casts(tmp_path, state, fp8):
    path = tmp_path / "plain.safetensors"
    stored_q = write_plain_fp8(path, state, fp8=fp8)
    contents = READER.read(path)
    check_contents(path, contents, stored_q, state)
    assert {e.codec for e in contents.encoded.values()} == {CODECS[fp8]}


def test_a_row_split_decodes_its_rows(tmp_path, state):
    """A part of one element is shared by the rows of a split; a [rows, 1] scale is split with them."""
    path = tmp_path / "legacy.safetensors"
    stored_q = write_legacy_scaled(path, state)
    contents = READER.read(path)
    encoded = contents.encoded["0.weight"]
    q, scale = stored_q["0.weight"]
    payload, part = (tensor_at(path, contents.stored[encoded.parts[k]]) for k in (PAYLOAD, "weight_scale"))
    rows = encoded.codec.unpack({PAYLOAD: payload[8:16], "weight_scale": part}, torch.Size((8, 16)), torch.float32)
    assert torch.equal(rows, q[8:16].float() * scale)
    per_row = torch.rand(24, 1) + 0.5
    rows = encoded.codec.unpack(
        {PAYLOAD: payload[8:16], "weight_scale": per_row[8:16]}, torch.Size((8, 16)), torch.float32
    )
    assert torch.equal(rows, q[8:16].float() * per_row[8:16])


def test_a_scale_per_row(tmp_path, state):
    path = tmp_path / "rows.safetensors"
    scale = torch.rand(24, 1) + 0.5
    stored_q = write_legacy_scaled(path, state, scales={"0.weight": scale})
    contents = READER.read(path)
    part = contents.stored[contents.encoded["0.weight"].parts["weight_scale"]]
    assert part.shape == (24, 1)
    q = stored_q["0.weight"][0]
    assert torch.equal(decode(path, contents, "0.weight"), q.float() * scale)


# -- what it refuses -------------------------------------------------------------------------------------------


def refused(path: Path, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as raised:
        READER.read(path)
    message = str(raised.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize(
    "scale, why",
    [
        (torch.empty(0), "empty"),
        (torch.tensor(float("nan")), "not finite"),
        (torch.tensor([float("inf")]), "not finite"),
        (torch.ones(2), "shape [2]"),
        (torch.ones(16, 1), "shape [16, 1]"),
        (torch.ones((), dtype=torch.int32), "not a float"),
    ],
)
def test_a_bad_scale_is_refused_naming_it(tmp_path, state, scale, why):
    path = tmp_path / "bad.safetensors"
    write_legacy_scaled(path, state, scales={"2.weight": scale})
    refused(path, "'2.scale_weight'", why)


def test_an_empty_weight_scale_is_refused(tmp_path, state):
    path = tmp_path / "bad.safetensors"
    write_metadata_scaled(path, state, extra={"0.weight_scale": torch.empty(0)})
    refused(path, "'0.weight_scale'", "empty")


def test_a_scale_without_its_weight_is_refused(tmp_path, state):
    path = tmp_path / "orphan.safetensors"
    write_legacy_scaled(path, state, extra={"ghost.scale_weight": torch.tensor(1.0)})
    refused(path, "'ghost.scale_weight'", "'ghost.weight'")


def test_a_scale_of_a_weight_that_is_not_fp8_is_refused(tmp_path, state):
    path = tmp_path / "bf16.safetensors"
    write_legacy_scaled(path, state, extra={"1.scale_weight": torch.tensor(1.0)})
    refused(path, "'1.scale_weight'", "not float8")


def test_two_scales_for_one_weight_are_refused(tmp_path, state):
    path = tmp_path / "two.safetensors"
    write_legacy_scaled(path, state, extra={"0.weight_scale": torch.tensor(1.0)})
    refused(path, "'0.weight'", "two scales")


def test_a_truncated_file_is_refused(tmp_path, state):
    path = tmp_path / "cut.safetensors"
    write_legacy_scaled(path, state)
    truncate(path)
    refused(path, "truncated")


def test_a_damaged_header_is_refused(tmp_path, state):
    path = tmp_path / "damaged.safetensors"
    write_legacy_scaled(path, state)
    damage_header(path)
    refused(path, "not valid JSON")


def test_a_format_comfyui_does_not_define_is_refused_as_unknown(tmp_path, state):
    path = tmp_path / "blockwise.safetensors"
    write_metadata_scaled(path, state, formats={"2": {"format": "int8_blockwise"}})
    refused(path, "'2'", "'int8_blockwise' is not a format ComfyUI defines", "nvfp4")


def test_a_declared_format_contradicting_the_dtype_is_refused(tmp_path, state):
    path = tmp_path / "contradiction.safetensors"
    write_metadata_scaled(path, state, formats={"0": {"format": "float8_e5m2"}})
    refused(path, "'0.weight'", "contradicts")


def test_a_declared_layer_missing_from_the_file_is_refused(tmp_path, state):
    path = tmp_path / "missing.safetensors"
    write_metadata_scaled(path, state, layer_names={"0": "nowhere"})
    refused(path, "'nowhere.weight'", "not in the file")


def test_damaged_quantization_metadata_is_refused(tmp_path, state):
    path = tmp_path / "meta.safetensors"
    from safetensors.torch import save_file

    save_file({"0.weight": torch.zeros(2, 2, dtype=E4M3)}, str(path), metadata={"_quantization_metadata": "{"})
    refused(path, "_quantization_metadata")


# -- the plugin ----------------------------------------------------------------------------------------------


def test_it_is_a_builtin_reader():
    import memmode_core

    (row,) = [r for r in memmode_core.list_plugins() if r.kind == "reader" and r.name == "comfy"]
    assert row.distribution == "memmode-core" and row.available and row.description


DEVICES = ["meta", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_the_codec_decodes_on_any_device(tmp_path, state, device):
    """Only tensor operations: the forward decodes where the layer's tensors are (meta: shapes and dtypes)."""
    path = tmp_path / "legacy.safetensors"
    stored_q = write_legacy_scaled(path, state)
    contents = READER.read(path)
    encoded = contents.encoded["2.weight"]
    parts = {name: tensor_at(path, contents.stored[key]).to(device) for name, key in encoded.parts.items()}
    value = encoded.codec.unpack(parts, torch.Size(encoded.shape), torch.bfloat16)
    assert value.device.type == device and value.dtype == torch.bfloat16 and value.shape == encoded.shape
    if device != "meta":
        q, scale = stored_q["2.weight"]
        assert torch.equal(value.cpu(), (q.float() * scale).to(torch.bfloat16))
