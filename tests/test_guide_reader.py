"""The plugin guide's reader, memmode-nf4, built from docs/writing-a-plugin.md and registered in-process.

The package is the page's code, written to a folder and imported from there (``tests/test_plugin_docs.py`` installs
it with the guide's other packages and checks it imports only the kit). Its files are bitsandbytes NF4 checkpoints
made as bitsandbytes makes them (``tests/nf4_files.py``), plain and double-quantized:

- the reader takes exactly such files, and decodes every weight bit for bit to the value computed apart from the
  codes the fixture quantized to; the JSON states are no tensor of the model;
- ``memmode.load`` of a tiny Wan transformer's NF4 file gives the same output under ``model_full_load`` and under
  ``model_group_offload`` with the ``mmap`` storage, bit for bit, and the same as the model holding the dequantized
  weights (in bf16, decoded apart), every quantized linear layer resting packed in the reader's format;
- a damaged file is refused with a ``CheckpointError`` naming the tensor.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest
import tomllib
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import memmode_core as memmode
from memmode_core.plugin import PAYLOAD, CheckpointError, temporary_plugin
from memmode_core.quantization import packed_record
from nf4_files import QUANT_STATE, quantize_nf4, write_nf4
from plugin_guide import files_from_the_guide
from rank_models import forward, wan_transformer

DISTRIBUTION, PACKAGE = "memmode-nf4", "memmode_nf4"


@pytest.fixture(scope="module")
def nf4(tmp_path_factory):
    """The guide's package, written from the page and imported from its folder (not left in ``sys.modules``)."""
    root = tmp_path_factory.mktemp("guide-nf4")
    files = {k: v for k, v in files_from_the_guide().items() if k.startswith(f"{DISTRIBUTION}/")}
    for relative, body in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(body)
    project = tomllib.loads(files[f"{DISTRIBUTION}/pyproject.toml"])["project"]
    assert project["name"] == DISTRIBUTION and project["entry-points"]["memmode"] == {"nf4": PACKAGE}
    spec = importlib.util.spec_from_file_location(PACKAGE, root / DISTRIBUTION / PACKAGE / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def registered(nf4):
    with temporary_plugin(nf4, name="nf4", distribution=DISTRIBUTION, version="1.0.0"):
        yield nf4


def head(path: Path) -> bytes:
    with open(path, "rb") as file:
        return file.read(64)


def stored_value(path: Path, stored) -> torch.Tensor:
    with open(path, "rb") as file:
        file.seek(stored.start)
        data = bytearray(file.read(stored.nbytes))
    return torch.frombuffer(data, dtype=stored.dtype).reshape(stored.shape)


def small_state() -> dict[str, torch.Tensor]:
    """Two linear layers (one whose value count is odd and not a whole number of blocks), a bias, a norm."""
    generator = torch.Generator().manual_seed(0)
    return {
        "proj.weight": torch.randn(24, 40, generator=generator).to(torch.bfloat16),
        "proj.bias": torch.randn(24, generator=generator).to(torch.bfloat16),
        "odd.weight": torch.randn(7, 9, generator=generator) * 3,
        "norm.weight": torch.ones(40),
    }


# -- the reader alone ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "double_quant"])
def test_the_reader_decodes_every_weight_bit_for_bit(nf4, tmp_path, nested):
    path = tmp_path / "small.safetensors"
    state = small_state()
    quantized = write_nf4(path, state, ["proj.weight", "odd.weight"], nested=nested)
    reader = nf4.NF4Reader()
    assert reader.reads(path, head(path))

    contents = reader.read(path)
    assert contents.size == path.stat().st_size and contents.metadata == {"format": "pt"}
    assert set(contents.encoded) == set(quantized)
    assert not any(key.endswith(QUANT_STATE) for key in contents.stored)  # no tensor of the model
    parts = {key for tensor in contents.encoded.values() for key in tensor.parts.values()}
    assert {key for key in contents.stored if key not in parts} == {"proj.bias", "norm.weight"}
    for key, expected in quantized.items():
        encoded = contents.encoded[key]
        assert (encoded.shape, encoded.dtype) == (tuple(state[key].shape), torch.float32)
        assert list(encoded.parts)[0] == PAYLOAD and encoded.parts[PAYLOAD] == f"{key}:codes"
        in_the_file = {f"{key}.{suffix}" if suffix else key for suffix in expected.tensors if suffix != QUANT_STATE}
        assert set(encoded.parts.values()) == in_the_file - {key} | {f"{key}:codes"}
        assert encoded.codec.format_name == "bnb_nf4" and not encoded.codec.packs
        values = {name: stored_value(path, contents.stored[stored]) for name, stored in encoded.parts.items()}
        assert values[PAYLOAD].dtype == torch.uint8  # the payload of a packed layer is an integer
        decoded = encoded.codec.unpack(values, torch.Size(encoded.shape), torch.float32)
        assert torch.equal(decoded, expected.dequantized)
        bf16 = encoded.codec.unpack(values, torch.Size(encoded.shape), torch.bfloat16)
        assert torch.equal(bf16, expected.dequantized.to(torch.bfloat16))
    for key in ("proj.bias", "norm.weight"):
        assert torch.equal(stored_value(path, contents.stored[key]), state[key])


def test_the_reader_leaves_other_files_to_core(nf4, tmp_path):
    plain = tmp_path / "plain.safetensors"
    save_file(small_state(), str(plain))
    other = tmp_path / "model.gguf"
    other.write_bytes(b"GGUF" + bytes(60))
    reader = nf4.NF4Reader()
    assert not reader.reads(plain, head(plain))
    assert not reader.reads(other, head(other))


# -- loaded into a model ---------------------------------------------------------------------------------------


def quantizable(model: nn.Module) -> list[str]:
    """The weights bitsandbytes quantizes: every linear layer's but those the model keeps in float32."""
    keep = set(model._keep_in_fp32_modules or [])
    return [
        f"{path}.weight"
        for path, module in model.named_modules()
        if isinstance(module, nn.Linear) and keep.isdisjoint(path.split("."))
    ]


#: diffusers' BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", ...).to_dict(), as a saved config has it
QUANTIZATION_CONFIG = {
    "quant_method": "bitsandbytes",
    "load_in_4bit": True,
    "load_in_8bit": False,
    "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_compute_dtype": "bfloat16",
    "bnb_4bit_quant_storage": "uint8",
    "bnb_4bit_use_double_quant": False,
    "llm_int8_skip_modules": None,
}


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "double_quant"])
def wan_nf4(request, tmp_path_factory):
    """A tiny Wan transformer saved as bitsandbytes saves a bf16 one in NF4 (its float32 modules kept, everything
    else bf16), the folder of its config (naming its quantization, as a saved one does), and the output of the same
    model holding the dequantized weights."""
    root = tmp_path_factory.mktemp("wan-nf4")
    model = wan_transformer(torch.bfloat16)
    model.save_config(root / "transformer")
    config = root / "transformer" / "config.json"  # what save_pretrained of a bitsandbytes model adds to it
    config.write_text(json.dumps({**json.loads(config.read_text()), "quantization_config": QUANTIZATION_CONFIG}))
    weights = quantizable(model)
    quantized = write_nf4(root / "wan-nf4.safetensors", model.state_dict(), weights, nested=request.param)
    for key, value in quantized.items():
        model.get_parameter(key).data = value.dequantized.to(torch.bfloat16)
    return root / "wan-nf4.safetensors", root / "transformer", weights, forward(model)


def test_load_keeps_the_weights_packed_and_gives_the_same_output_in_every_mode(registered, wan_nf4, tmp_path):
    path, config, weights, reference = wan_nf4
    outputs = {}
    for mode, options in [
        ("model_full_load", {}),
        ("model_group_offload", {"storage": "mmap", "offload_dir": tmp_path / "offload"}),
    ]:
        handle = memmode.load(path, mode, device="cpu", config=config, **options)
        model = handle.target
        packed = {name: record.format for name, module in model.named_modules() if (record := packed_record(module))}
        assert packed == dict.fromkeys((w.removesuffix(".weight") for w in weights), "bnb_nf4")
        layer = model.get_submodule(weights[0].removesuffix(".weight"))
        assert layer.weight_packed.dtype == torch.uint8 and "weight" not in layer._parameters
        read = handle.loading["files"]["module"]
        assert (read["reader"], read["packed_layers"]) == ("nf4", {"bnb_nf4": len(weights)})
        assert read["decoded_tensors"] == read["unused_tensors"] == 0  # the JSON states are no tensor of the model
        outputs[mode] = forward(model)
        handle.remove()
    assert torch.equal(outputs["model_full_load"], outputs["model_group_offload"])
    # the same bf16 weights, decoded by the forward rather than before it: the same output, bit for bit
    assert torch.equal(outputs["model_full_load"], reference) and reference.abs().max() > 0.1


# -- refusals --------------------------------------------------------------------------------------------------


def rewritten(path: Path, tmp_path: Path, change) -> Path:
    """``path``'s tensors, changed by ``change(tensors)``, in a new file."""
    tensors = load_file(str(path))
    change(tensors)
    out = tmp_path / "changed.safetensors"
    save_file(tensors, str(out))
    return out


def state_bytes(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def damaged_state(tensors):
    tensors[f"proj.weight.{QUANT_STATE}"] = state_bytes('{"quant_type": "nf4", "blocksize": 64, "sha')


def fp4_in_an_nf4_state(tensors):
    state = json.loads(bytes(tensors[f"proj.weight.{QUANT_STATE}"].tolist()))
    tensors[f"proj.weight.{QUANT_STATE}"] = state_bytes(json.dumps({**state, "quant_type": "fp4"}))


def absmax_missing(tensors):
    del tensors["proj.weight.absmax"]


def wrong_shape(tensors):
    state = json.loads(bytes(tensors[f"proj.weight.{QUANT_STATE}"].tolist()))
    tensors[f"proj.weight.{QUANT_STATE}"] = state_bytes(json.dumps({**state, "shape": [24, 80]}))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (damaged_state, f"proj.weight.{QUANT_STATE}"),
        (fp4_in_an_nf4_state, f"proj.weight.{QUANT_STATE}"),
        (absmax_missing, "proj.weight.absmax"),
        (wrong_shape, "proj.weight"),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_a_damaged_file_is_refused_naming_the_tensor(nf4, tmp_path, change, named):
    path = tmp_path / "small.safetensors"
    write_nf4(path, small_state(), ["proj.weight", "odd.weight"])
    damaged = rewritten(path, tmp_path, change)
    reader = nf4.NF4Reader()
    assert reader.reads(damaged, head(damaged))
    with pytest.raises(CheckpointError) as refused:
        reader.read(damaged)
    assert str(damaged) in str(refused.value) and repr(named) in str(refused.value)


def test_load_refuses_a_damaged_state_before_building_anything(registered, wan_nf4, tmp_path):
    path, config, weights, _ = wan_nf4
    key = f"{weights[0]}.{QUANT_STATE}"
    damaged = rewritten(path, tmp_path, lambda tensors: tensors.update({key: state_bytes("not json")}))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        memmode.load(damaged, "model_full_load", device="cpu", config=config)


def test_a_truncated_header_is_refused(nf4, tmp_path):
    path = tmp_path / "small.safetensors"
    write_nf4(path, small_state(), ["proj.weight"])
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: 8 + length // 2])
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        nf4.NF4Reader().read(truncated)


def test_the_fixture_quantizes_as_bitsandbytes_does():
    """The fixture's codes: nearest NF4 level of each value over its block's absmax, the first of two in the high
    nibble; the largest value of a block is exactly its absmax times 1 (code 15) or -1 (code 0)."""
    weight = torch.tensor([[0.6, -1.0, 0.5, 0.0]])
    done = quantize_nf4(weight)
    assert done.tensors["absmax"].tolist() == [1.0]
    # bitsandbytes' decision tree cuts halfway between levels: 0.6 -> 0.5626 (13), 0.5 -> 0.4407 (12, below 0.5017)
    assert done.codes.tolist() == [13, 0, 12, 7]
    assert done.tensors[""].flatten().tolist() == [13 << 4 | 0, 12 << 4 | 7]
    state = json.loads(bytes(done.tensors[QUANT_STATE].tolist()))
    assert state == {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [1, 4]}
