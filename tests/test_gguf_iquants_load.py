"""A tiny model loaded from a GGUF file whose weights are i-quants (IQ4_NL, IQ4_XS, as community diffusion files
store them; and the grid types IQ1_S to IQ3_S, as blocks of random bytes): every quantized layer rests packed in its
type's blocks, the full load gives the output of the model built from gguf-py's dequantization of the same file, and
every lossless placement x storage tried gives the full load's output bit for bit (the same file, the same
operands)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from gguf import GGMLQuantizationType as Q

import memmode_core as memmode
from community_pipelines import WIDE_WAN, WIDE_WAN_FORWARD, packed_layers, wan_inputs
from gguf_files import GRID_TYPES, IQ4_TYPES, random_iq_blocks, reference_dequantize, write_gguf
from helpers import assert_reassociated
from original_checkpoints import PREFIX, to_original, wan_plan

#: (placement, options, storage) tried against the full load: the file's pages in place (mmap), a copy (disk)
PLACEMENTS = [
    ("model_group_offload", {"offload_type": "leaf_level"}, "mmap"),
    ("sequential_cpu_offload", {}, "disk"),
]


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    """A wide tiny Wan transformer (rows of 256, an IQ4_XS super-block), weights N(0, 0.05), saved with its config."""
    torch.manual_seed(7)
    model = WanTransformer3DModel(**WIDE_WAN).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.05)
    folder = tmp_path_factory.mktemp("iquants") / "transformer"
    model.save_pretrained(folder)
    return folder, model.state_dict()


def write_iquant_file(path, state, qtype: Q) -> dict[str, Q]:
    """The model under the original checkpoint's names, its matrices whose rows fit in ``qtype`` and the others in
    the other i-quant where they fit (IQ4_NL's blocks of 32), Q8_0 where none does, as city96's converter stores
    them (small and 1-D tensors F32)."""
    other = next(t for t in IQ4_TYPES if t != qtype)
    original = to_original(wan_plan(list(state)), state)
    asked = {}
    for key, value in original.items():
        fits = [t for t in (qtype, other) if value.dim() == 2 and value.shape[1] % (256 if t == Q.IQ4_XS else 32) == 0]
        asked[key] = (value.float().numpy(), fits[0] if fits else Q.Q8_0)
    return write_gguf(path, asked, arch="wan", keep_f32=(".modulation",))


def reference_output(folder, path) -> torch.Tensor:
    """The model with gguf-py's dequantization of the file, mapped by diffusers' own converter: the reference."""
    model = WanTransformer3DModel.from_pretrained(folder).eval()
    values = reference_dequantize(path)
    model.load_state_dict(convert_wan_transformer_to_diffusers({k.removeprefix(PREFIX): v for k, v in values.items()}))
    with torch.no_grad():
        return model(**wan_inputs())[0]


def output(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**wan_inputs())[0]


def write_grid_file(path, state) -> dict[str, Q]:
    """The model under the original names, its matrices whose rows fit a super-block of 256 as random blocks of
    the grid types in turn (small scales, as trained weights have), the others F32."""
    original = to_original(wan_plan(list(state)), state)
    rng = np.random.default_rng(11)
    writer = gguf.GGUFWriter(path=None, arch="wan")
    types, turn = {}, 0
    for key, value in original.items():
        if value.dim() == 2 and value.shape[1] % 256 == 0:
            qtype = GRID_TYPES[turn % len(GRID_TYPES)]
            turn += 1
            blocks = random_iq_blocks(rng, value.numel() // 256, qtype, scale=0.002)
            writer.add_tensor(key, blocks.reshape(value.shape[0], -1), raw_dtype=qtype)
        else:
            qtype = Q.F32
            writer.add_tensor(key, value.float().numpy())
        types[key] = qtype
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


@pytest.mark.parametrize("qtype", [*IQ4_TYPES, "grids"], ids=lambda t: getattr(t, "name", t))
def test_an_iquant_file_loads_packed_and_exact(wan_folder, qtype, tmp_path):
    folder, state = wan_folder
    path = tmp_path / f"wan-{getattr(qtype, 'name', qtype)}.gguf"
    if qtype == "grids":
        stored = write_grid_file(path, state)
        assert set(GRID_TYPES) <= set(stored.values())
    else:
        stored = write_iquant_file(path, state, qtype)
        assert qtype in stored.values()

    full = memmode.load(path, "model_full_load", device="cpu", torch_dtype=torch.float32, config=folder)
    formats = packed_layers(full.target)
    if qtype == "grids":
        assert set(formats.values()) == {f"gguf_{t.name.lower()}" for t in GRID_TYPES}
    else:
        assert set(formats.values()) <= {f"gguf_{t.name.lower()}" for t in IQ4_TYPES}
        assert list(formats.values()).count(f"gguf_{qtype.name.lower()}") > len(formats) // 2
    expected = output(full.target)
    assert_reassociated(expected, reference_output(folder, path), **WIDE_WAN_FORWARD)
    read = full.report().loading["files"]["module"]
    assert read["packed_layers"] == {f: list(formats.values()).count(f) for f in sorted(set(formats.values()))}
    full.remove()

    for placement, options, storage in PLACEMENTS:
        handle = memmode.load(
            path, placement, device="cpu", torch_dtype=torch.float32, config=folder,
            storage=storage, offload_dir=str(tmp_path / placement), **options,
        )  # fmt: skip
        assert torch.equal(output(handle.target), expected), (placement, storage)
        assert packed_layers(handle.target) == formats, (placement, storage)  # still packed after the call
        handle.remove()
