"""``torch_dtype="auto"``, the default of ``memmode.load``, never builds a model of mixed floating dtypes: every
floating parameter and buffer is in one dtype, but those of the modules the class keeps in float32
(``_keep_in_fp32_modules``). Which dtype, where the checkpoint's tensors mix dtypes:

- a single file (a community file: city96's converter keeps norms, biases and small tensors F32 beside the F16 or
  BF16 tensors it did not quantize) loads in the widest of its plain tensors' dtypes, rounding nothing: float32 for
  such a GGUF, as diffusers' GGUF loading computes by default;
- a folder loads in the dtype most of its bytes are in (a library saved it from a model in that dtype; its other
  tensors, quantization scales among them, are converted to it rather than the whole model widened).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

import memmode_core as memmode
from community_pipelines import WIDE_WAN, packed_layers, wan_inputs
from gguf_files import write_gguf
from memmode_core.files import Checkpoint
from original_checkpoints import to_original, wan_plan

KEEP_FP32 = tuple(WanTransformer3DModel._keep_in_fp32_modules)


def floating_dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    """The dtype of every floating tensor a load reads (the state dict: parameters and persistent buffers) that is
    no part of a module the class keeps in float32. A non-persistent buffer the model computes itself is its own
    (diffusers 0.38's Wan computes its rotary tables in float32 whatever the dtype, as its from_pretrained leaves
    them)."""
    return {
        name: t.dtype
        for name, t in model.state_dict(keep_vars=True).items()
        if t.is_floating_point() and not any(part in name.split(".") for part in KEEP_FP32)
    }


@pytest.fixture(scope="module")
def city96_file(tmp_path_factory):
    """A wide tiny Wan under the original names, as city96's converter writes a ``Q4_K`` file: the matrices Q4_K, the
    embeddings F16 (left unquantized, in the converted file's F16), norms, biases, modulation and small tensors F32.
    Its F16 bytes outweigh its F32 ones: the dtype most of its plain bytes are in would be float16."""
    torch.manual_seed(3)
    model = WanTransformer3DModel(**WIDE_WAN).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.05)
    folder = tmp_path_factory.mktemp("city96") / "transformer"
    model.save_pretrained(folder)
    state = model.state_dict()
    original = to_original(wan_plan(list(state)), state)
    path = folder.parent / "wan-Q4_K.gguf"
    stored = write_gguf(
        path, {key: (value.float().numpy(), Q.Q4_K) for key, value in original.items()}, arch="wan",
        keep_f32=(".modulation",), keep_f16=("embedding",),
    )  # fmt: skip
    assert {Q.F16, Q.F32, Q.Q4_K} <= set(stored.values())
    plain = {qtype: sum(original[k].numel() * (2 if qtype == Q.F16 else 4) for k, t in stored.items() if t == qtype)
             for qtype in (Q.F16, Q.F32)}  # fmt: skip
    assert plain[Q.F16] > plain[Q.F32], plain
    return path, folder


@pytest.mark.parametrize("mode", ["model_full_load", "sequential_cpu_offload"])
def test_a_city96_file_loads_in_float32_alone(city96_file, mode):
    """The bare-file call of docs/community-checkpoints.md, without torch_dtype: one dtype, float32 (the widest of
    F16 and F32), the Q4_K layers packed and computing in it; its first forward runs on float32 inputs and gives
    what ``torch_dtype=torch.float32`` gives."""
    path, folder = city96_file
    handle = memmode.load(path, mode, device="cpu", config=folder)
    model = handle.target
    assert set(floating_dtypes(model).values()) == {torch.float32}
    assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {torch.float32}
    assert set(packed_layers(model).values()) == {"gguf_q4_k"}
    with torch.no_grad():
        got = model(**wan_inputs())[0]
    handle.remove()
    explicit = memmode.load(path, "model_full_load", device="cpu", config=folder, torch_dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(got, explicit.target(**wan_inputs())[0])


def test_auto_on_a_single_file_is_the_widest_of_its_plain_dtypes(tmp_path):
    """float16 and bfloat16 beside each other: float32, which holds both; the parts of encoded tensors and the
    modules kept in float32 do not count."""
    save_file(
        {
            "a.weight": torch.zeros(64, 64, dtype=torch.float16),
            "b.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
            "c.weight_scale": torch.zeros(64, 1),
            "norm1.weight": torch.zeros(64, 64),
        },
        tmp_path / "model.safetensors",
    )
    checkpoint = Checkpoint.open(tmp_path / "model.safetensors")
    assert checkpoint.floating_dtype(("norm1",), leaving_out={"c.weight_scale"}, widest=True) == torch.float32
    assert checkpoint.floating_dtype(("norm1",), leaving_out={"c.weight_scale"}) == torch.float16
    assert checkpoint.floating_dtype(("norm1",), leaving_out={"c.weight_scale", "b.weight"}, widest=True) == (
        torch.float16
    )


def test_a_folder_of_mixed_dtypes_loads_in_one_dtype(tmp_path):
    """A bfloat16 folder with a few float32 tensors outside the modules its class keeps in float32 (a fused-in
    projection, a head): "auto" is bfloat16, the float32 ones are converted to it, and the model runs on bfloat16
    inputs; the modules the class keeps in float32 stay float32."""
    torch.manual_seed(5)
    WanTransformer3DModel(**WIDE_WAN).to(torch.bfloat16).save_pretrained(tmp_path)
    (weights,) = tmp_path.glob("*.safetensors")
    state = load_file(weights)
    for key in ("proj_out.weight", "blocks.0.ffn.net.0.proj.weight"):
        state[key] = state[key].float()
    save_file(state, weights, metadata={"format": "pt"})
    assert {t.dtype for t in state.values()} == {torch.bfloat16, torch.float32}

    handle = memmode.load(tmp_path, "model_full_load", device="cpu")
    model = handle.target
    assert set(floating_dtypes(model).values()) == {torch.bfloat16}
    kept = {n: p.dtype for n, p in model.named_parameters() if any(k in n.split(".") for k in KEEP_FP32)}
    assert kept and set(kept.values()) == {torch.float32}
    assert model.proj_out.weight.dtype == torch.bfloat16
    inputs = wan_inputs()
    inputs.update(
        hidden_states=inputs["hidden_states"].bfloat16(),
        encoder_hidden_states=inputs["encoder_hidden_states"].bfloat16(),
    )
    with torch.no_grad():
        out = model(**inputs)[0]
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
