"""No placeholder ever escapes: every read of a placed or quantized weight gets its real value, or a typed error.

The roads by which an at-rest stand-in used to reach user code, each on a tiny model of the shape that takes it:

* a parent module computing with a child's weight: ``nn.MultiheadAttention`` passes ``out_proj.weight`` to
  ``F.multi_head_attention_forward`` (under every quantizer and placement: the quantized ``out_proj`` is
  dequantized for that read), and an attention pool (HunyuanDiT's, SigLIP's) builds the same call from
  ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight`` and ``torch.cat`` of their biases (at leaf level,
  where each child is its own group, under every storage: the read onloads the child into the call, and the
  parent is learned as the group's entry);
* ``state_dict()`` / ``save_pretrained`` + ``from_pretrained`` / ``torch.save`` of a placed model: the real
  weights; of a quantized one: refused before anything is written, naming ``memmode.save_quantized``;
* ``copy.deepcopy`` and pickling: the model without its placement, every weight real;
* writes at rest (``load_state_dict`` into a placed model): stored at the next call;
* ``strict=True``: a served read is a typed error naming the tensor and the code that read it.
"""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
import torch.nn.functional as F
from diffusers import ModelMixin
from diffusers.configuration_utils import ConfigMixin, register_to_config
from torch import nn

import memmode_core as memmode
from helpers import (
    ACCELERATOR,
    OFFLOADING_PLACEMENTS,
    STORAGES,
    assert_same_tensors,
    hook_count,
    on_accelerator,
    placement_id,
    sqnr_db,
    state_of,
    tensors_of,
)
from memmode_core import IncompatibleModeError, OffloadedWeightReadError, OffloadedWeightWriteError, StandInReadError

WIDTH = 64
#: placements for a bare module (text_encoder_offload needs a pipeline's text encoders)
PLACEMENTS = [("model_full_load", {})] + [p for p in OFFLOADING_PLACEMENTS if p[0] != "text_encoder_offload"]
LEAF_LEVEL = [("model_group_offload", {"offload_type": "leaf_level"}), ("sequential_cpu_offload", {})]
QUANTIZERS = ["qfloat8", "qfloat4"]

pytestmark = pytest.mark.usefixtures("poison_storage", "private_tmp")


class AttentionBlocks(ModelMixin, ConfigMixin):
    """Three blocks of ``nn.MultiheadAttention(64, 4)`` and a ``Linear(64, 64)``, as the issue describes them."""

    @register_to_config
    def __init__(self, width: int = WIDTH, blocks: int = 3) -> None:
        super().__init__()
        self.attentions = nn.ModuleList(nn.MultiheadAttention(width, 4) for _ in range(blocks))
        self.projections = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attention, projection in zip(self.attentions, self.projections):
            x = x + projection(attention(x, x, x, need_weights=False)[0])
        return x


class AttentionPool(nn.Module):
    """HunyuanDiT's (and CLIP's) attention pool: the parent runs the attention itself from its children's weights."""

    def __init__(self, width: int = WIDTH, heads: int = 4) -> None:
        super().__init__()
        self.positional_embedding = nn.Parameter(torch.randn(5, width) / width**0.5)
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.c_proj = nn.Linear(width, width)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(1, 0, 2)  # (length, batch, width)
        x = torch.cat([x.mean(dim=0, keepdim=True), x], dim=0) + self.positional_embedding[:, None, :]
        pooled, _ = F.multi_head_attention_forward(
            query=x[:1],
            key=x,
            value=x,
            embed_dim_to_check=x.shape[-1],
            num_heads=self.heads,
            q_proj_weight=self.q_proj.weight,
            k_proj_weight=self.k_proj.weight,
            v_proj_weight=self.v_proj.weight,
            in_proj_weight=None,
            in_proj_bias=torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]),
            bias_k=None,
            bias_v=None,
            add_zero_attn=False,
            dropout_p=0.0,
            out_proj_weight=self.c_proj.weight,
            out_proj_bias=self.c_proj.bias,
            use_separate_proj_weight=True,
            training=False,
            need_weights=False,
        )
        return pooled.squeeze(0)


class Pooled(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.proj_in = nn.Linear(width, width)
        self.pool = AttentionPool(width)
        self.proj_out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(self.pool(torch.tanh(self.proj_in(x))))


def build(cls=AttentionBlocks, seed: int = 0):
    torch.manual_seed(seed)
    return cls().eval()


def inputs(cls=AttentionBlocks, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (5, 2, WIDTH) if cls is AttentionBlocks else (2, 4, WIDTH)
    return torch.randn(shape, generator=generator)


def outputs(model, cls=AttentionBlocks, device="cpu", calls: int = 2) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(inputs(cls, seed).to(device)).cpu() for seed in range(1, calls + 1)]


def stored(mode: str, storage: str) -> str | None:
    """``storage`` for a mode that offloads; a full load takes none."""
    return None if mode == "model_full_load" else storage


def read_groups(report) -> set[str]:
    """The modules whose tensors were served (``pool.q_proj``): a read onloads a whole group, counted once under
    the name of the tensor read first."""
    return {name.rsplit(".", 1)[0] for name in report.served}


def assert_no_non_finite_read(model) -> None:
    """Every parameter and buffer read through the public API, as a script would: real values, finite."""
    for name, tensor in model.state_dict().items():
        value = tensor * 1
        assert torch.isfinite(value).all(), f"{name} read as non-finite"


# -- a parent computing with a child's weight -------------------------------------------------------------


@pytest.mark.parametrize("quantizer", QUANTIZERS)
@pytest.mark.parametrize("placement", PLACEMENTS, ids=placement_id)
def test_multihead_attention_runs_quantized_under_every_placement(placement, quantizer):
    """``out_proj`` is quantized, and ``nn.MultiheadAttention`` reads its weight outside its forward: that read is
    the dequantized weight (counted in the report), so the output is finite, close to full precision, and the
    same under every placement as under a full load."""
    mode, options = placement
    reference = outputs(build())
    expected = build()
    memmode.apply(expected, f"model_full_load_and_{quantizer}", device="cpu")
    expected = outputs(expected)
    model = build()
    storage = None if mode == "model_full_load" else "ram"
    handle = memmode.apply(model, f"{mode}_and_{quantizer}", device="cpu", storage=storage, **options)
    got = outputs(model)
    for g, e, r in zip(got, expected, reference):
        assert torch.isfinite(g).all() and torch.equal(g, e)
        assert sqnr_db(r, g) > 15
    report = handle.report()
    assert report.quantization["module"]["packed_layers"] == 6
    assert report.reads_served >= 3 and "module.attentions.0.out_proj.weight" in report.served
    assert report.bytes_served >= 3 * WIDTH * WIDTH * 4
    assert_no_non_finite_read(model)
    handle.remove()


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("placement", PLACEMENTS, ids=placement_id)
def test_multihead_attention_is_bit_exact_under_every_placement_and_storage(placement, storage):
    mode, options = placement
    expected = outputs(build())
    model = build()
    before = tensors_of(model)
    handle = memmode.apply(model, mode, device="cpu", storage=stored(mode, storage), **options)
    for got, want in zip(outputs(model), expected):
        assert torch.equal(got, want)
    if mode in ("model_group_offload", "sequential_cpu_offload"):
        assert handle.report().resident_device_bytes == 0
    assert_no_non_finite_read(model)
    handle.remove()
    assert_same_tensors(tensors_of(model), before)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("placement", LEAF_LEVEL, ids=placement_id)
def test_an_attention_pool_runs_at_leaf_level_under_every_storage(placement, storage):
    """The pool computes with ``q_proj``/``k_proj``/``v_proj``/``c_proj``'s weights and a ``torch.cat`` of their
    biases, each the tensor of a leaf group of its own: the first call onloads each group where it is read (and
    says so in the report), learns the pool as its entry, and later calls onload them before the pool runs. The
    outputs are the full load's, bit for bit."""
    mode, options = placement
    expected = outputs(build(Pooled), Pooled)
    model = build(Pooled)
    handle = memmode.apply(model, mode, device="cpu", storage=storage, **options)
    first = outputs(model, Pooled, calls=1)
    served = dict(handle.report().served)
    rest = outputs(model, Pooled, calls=2)
    assert torch.equal(first[0], expected[0]) and torch.equal(rest[1], expected[1])
    if storage != "ram":  # a placeholder, or a mapped view checked first; ram on a CPU rests as the values themselves
        assert {f"module.pool.{n}_proj" for n in "qkvc"} <= {name.rsplit(".", 1)[0] for name in served}
    assert handle.report().served == served, "learned: later calls serve nothing"
    assert handle.report().resident_device_bytes == 0
    handle.remove()


@on_accelerator
@pytest.mark.parametrize("storage", ["ram", "pinned", "disk", "mmap"])
def test_an_attention_pool_runs_at_leaf_level_on_the_accelerator(storage):
    """On an accelerator every resting copy is on the host (or a placeholder): without the onload on read the pool
    would meet a device mismatch. Under the strict model of asynchronous copies the same code runs on the CPU."""
    expected = outputs(build(Pooled), Pooled)
    model = build(Pooled)
    handle = memmode.apply(model, "model_group_offload", device=ACCELERATOR, storage=storage, offload_type="leaf_level")
    for got, want in zip(outputs(model, Pooled, device=ACCELERATOR), expected):
        assert torch.equal(got, want)
    assert {f"module.pool.{n}_proj" for n in "qkvc"} <= read_groups(handle.report())
    handle.remove()


def test_strict_refuses_a_served_read_naming_the_tensor_and_the_code():
    model = build()
    memmode.apply(model, "model_full_load_and_qfloat8", device="cpu", strict=True)
    with pytest.raises(StandInReadError, match=r"module\.attentions\.0\.out_proj\.weight .*test_stand_ins\.py:\d+"):
        outputs(model, calls=1)
    pooled = build(Pooled)
    memmode.apply(pooled, "sequential_cpu_offload", device="cpu", storage="disk", strict=True)
    with pytest.raises(StandInReadError, match=r"module\.pool\.q_proj\.bias .*in forward"):
        outputs(pooled, Pooled, calls=1)


def test_the_first_served_read_is_logged_once(caplog):
    model = build()
    with caplog.at_level(logging.INFO, logger="memmode"):
        memmode.apply(model, "model_full_load_and_qfloat8", device="cpu")
        outputs(model)
    lines = [r.message for r in caplog.records if "read by" in r.message]
    assert len(lines) == 1 and "out_proj.weight" in lines[0] and "reads_served" in lines[0]


# -- state_dict, save_pretrained, torch.save ---------------------------------------------------------------


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("placement", PLACEMENTS[1:], ids=placement_id)
def test_state_dict_and_save_pretrained_of_a_placed_model_are_the_real_weights(placement, storage, tmp_path):
    """What a user who fused a LoRA under a mode and saves it relies on: ``state_dict()``, ``save_pretrained`` +
    ``from_pretrained`` and ``torch.save`` of the state dict give the model's weights, bit for bit — never NaN."""
    mode, options = placement
    model = build()
    expected = state_of(model)
    memmode.apply(model, mode, device="cpu", storage=storage, **options)
    outputs(model, calls=1)
    assert_same_tensors(state_of(model), expected)
    model.save_pretrained(tmp_path / "saved")
    loaded = AttentionBlocks.from_pretrained(tmp_path / "saved")
    assert_same_tensors(state_of(loaded), expected)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    assert_same_tensors(torch.load(buffer, weights_only=True), expected)


@pytest.mark.parametrize("storage", ["disk", "mmap", "poison"])
def test_save_pretrained_of_a_placed_wan_transformer_round_trips(storage, tmp_path):
    """The issue's two-block Wan transformer (the suite's wan22 family) under group offload and sequential
    offload: every one of its tensors is saved as it is and loads back."""
    from tiny_pipelines import make_pipeline

    for mode, options in [("model_group_offload", {}), ("sequential_cpu_offload", {})]:
        pipe = make_pipeline("wan22")
        expected = state_of(pipe.transformer)
        handle = memmode.apply(pipe, mode, device="cpu", storage=storage, **options)
        pipe.transformer.save_pretrained(tmp_path / mode)
        loaded = type(pipe.transformer).from_pretrained(tmp_path / mode)
        assert_same_tensors(state_of(loaded), expected)
        handle.remove()


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_save_pretrained_of_a_quantized_model_is_refused_before_anything_is_written(quantizer, tmp_path):
    """diffusers would write the packed tensors beside the dequantized weights; memmode refuses before anything
    is written and names ``memmode.save_quantized``, whose folder ``memmode.load`` reads back to the same outputs.
    The pipeline's own ``save_pretrained`` is refused too, before its ``model_index.json``."""
    from tiny_pipelines import make_pipeline, run

    pipe = make_pipeline("wan22")
    handle = memmode.apply(pipe, f"model_group_offload_and_{quantizer}", device="cpu", storage="disk")
    expected = run(pipe, "wan22")
    for owner in (pipe.transformer, pipe):
        folder = tmp_path / type(owner).__name__
        with pytest.raises(IncompatibleModeError, match=r"transformer.*memmode\.save_quantized"):
            owner.save_pretrained(folder)
        assert not folder.exists() or not any(folder.iterdir()), "nothing written"
    memmode.save_quantized(pipe, tmp_path / "quantized")
    handle.remove()
    loaded = memmode.load(tmp_path / "quantized", f"model_group_offload_and_{quantizer}", device="cpu")
    assert torch.equal(run(loaded.target, "wan22"), expected)


def test_a_model_without_quantized_layers_saves_under_a_quantized_pipeline_mode(tmp_path):
    """Only what holds quantized layers is refused: the VAE of a quantized pipeline saves as usual."""
    from tiny_pipelines import make_pipeline

    pipe = make_pipeline("wan22")
    expected = state_of(pipe.vae)
    memmode.apply(pipe, "model_cpu_offload_and_qfloat8", device="cpu", storage="disk")
    pipe.vae.save_pretrained(tmp_path / "vae")
    assert_same_tensors(state_of(type(pipe.vae).from_pretrained(tmp_path / "vae")), expected)


# -- copies -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("placement", PLACEMENTS, ids=placement_id)
def test_deepcopy_and_pickle_of_a_placed_model_give_it_without_the_placement(placement, storage):
    mode, options = placement
    expected = outputs(build())
    model = build()
    handle = memmode.apply(model, mode, device="cpu", storage=stored(mode, storage), **options)
    outputs(model, calls=1)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert hook_count(copied) == 0 and getattr(copied, "_memmode_handle", None) is None
        assert all(type(p) is nn.Parameter for p in copied.parameters())
        for got, want in zip(outputs(copied), expected):
            assert torch.equal(got, want)
    for got, want in zip(outputs(model), expected):  # the original is still placed, and still right
        assert torch.equal(got, want)
    assert handle.active
    handle.remove()


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_deepcopy_of_a_quantized_placed_model_stays_quantized_and_unplaced(quantizer):
    model = build()
    handle = memmode.apply(model, f"model_group_offload_and_{quantizer}", device="cpu", storage="disk")
    expected = outputs(model)
    copied = copy.deepcopy(model)
    assert hook_count(copied) == 0 and getattr(copied, "_memmode_handle", None) is None
    for got, want in zip(outputs(copied), expected):
        assert torch.equal(got, want)
    assert copied.attentions[0].out_proj._memmode_packed.format == model.attentions[0].out_proj._memmode_packed.format
    handle.remove()


# -- writes at rest, and lost weights ----------------------------------------------------------------------


@pytest.mark.parametrize("storage", STORAGES)
def test_load_state_dict_into_a_placed_model_is_what_the_next_call_computes(storage):
    """Weights loaded into a placed model at rest land in the model (a resting placeholder gets memory of its own,
    stored anew at the next call); a write into a view of a value served for one read is refused."""
    other = build(seed=5)
    expected = outputs(other)
    model = build()
    handle = memmode.apply(model, "model_group_offload", device="cpu", storage=storage)
    outputs(model, calls=1)
    model.load_state_dict(other.state_dict())
    for got, want in zip(outputs(model), expected):
        assert torch.equal(got, want)
    before = state_of(model)
    if storage in ("poison", "disk"):
        with pytest.raises(OffloadedWeightWriteError, match=r"module\.projections\.0\.weight.*temporary copy"):
            with torch.no_grad():
                model.projections[0].weight[0].fill_(1.0)
    assert_same_tensors(state_of(model), before)
    handle.remove()
    assert_same_tensors(state_of(model), state_of(other))


def test_a_weight_whose_stored_copy_is_lost_is_a_typed_error_until_loaded_again(private_tmp):
    model = build()
    expected = state_of(model)
    handle = memmode.apply(model, "model_group_offload", device="cpu", storage="disk")
    for path in private_tmp.rglob("*.safetensors"):
        path.unlink()
    with pytest.raises(memmode.RestoreError):
        handle.remove()
    with pytest.raises(OffloadedWeightReadError, match=r"module\.projections\.0\.weight has no value"):
        model.projections[0].weight * 1
    model.load_state_dict(build().state_dict())
    assert_same_tensors(state_of(model), expected)
    assert all(type(p) is nn.Parameter for p in model.parameters())
