"""Core quantization mechanics: which layers, how they are swapped, how they run, and the refusals."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from torch import nn

import memmode_core as memmode
from helpers import assert_bit_equal, assert_reassociated, nbytes, sqnr_db
from memmode_core import IncompatibleModeError, InvalidOptionError, QuantizedWeightWriteError, Quantizer
from memmode_core.quantization import (
    QuantizedLinear,
    packed_record,
    quantize_component,
    quantized_direct_bytes,
    select_layers,
)
from memmode_qfloat4 import QFloat4
from memmode_qfloat8 import QFloat8, convert
from tiny_pipelines import make_pipeline, run

QUANTIZERS = {"qfloat8": QFloat8, "qfloat4": QFloat4}


def linears(module: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in module.named_modules() if isinstance(m, nn.Linear)}


class Blocks(nn.Module):
    """A plain module with repeated blocks, one of them too narrow for NVFP4."""

    def __init__(self, widths=(32, 32, 20)) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, w), nn.GELU(), nn.Linear(w, 32)) for w in widths)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


# -- identity: the layout computed before quantization stays valid ---------------------------------------


@pytest.mark.parametrize("quantizer", sorted(QUANTIZERS))
def test_quantizing_keeps_every_module_object_and_linear_identity(quantizer):
    pipe = make_pipeline("flux", dtype=torch.bfloat16)
    before = {name: id(m) for name, m in pipe.transformer.named_modules()}
    memmode.apply(pipe, f"model_full_load_and_{quantizer}")
    assert {name: id(m) for name, m in pipe.transformer.named_modules()} == before
    packed = [m for m in linears(pipe.transformer).values() if packed_record(m) is not None]
    assert packed and all(isinstance(m, nn.Linear) and type(m) is QuantizedLinear for m in packed)
    layer = pipe.transformer.transformer_blocks[0].attn.to_q
    assert (layer.in_features, layer.out_features) == (32, 32)
    assert layer.weight_packed.dtype == torch.uint8 and not layer.weight_packed.requires_grad
    assert "weight" not in dict(layer.named_parameters())
    assert f"{quantizer} -> bfloat16" in repr(layer)


@pytest.mark.parametrize("quantizer", sorted(QUANTIZERS))
def test_layer_weight_is_a_stand_in_that_writes_through_or_fails_loudly(quantizer):
    """What loaders and adapters inspect: the full-precision shape, the compute dtype, the device. A merge
    into the whole weight is re-quantized into the packed tensors; a write into part of it is refused."""
    layer = nn.Linear(64, 48).to(torch.bfloat16)
    quantizer_obj = QUANTIZERS[quantizer]()
    quantize_component(quantizer_obj, layer, weight_dtype=torch.float32)
    weight = layer.weight
    assert (weight.shape, weight.dtype, weight.device.type) == ((48, 64), torch.float32, "cpu")
    assert weight.untyped_storage().nbytes() == 4  # one element, broadcast: no memory of its own
    record = layer._memmode_packed

    def dequantized():
        return quantizer_obj.unpack({n: getattr(layer, n) for n in record.names}, record.shape, torch.float32)

    assert torch.equal(weight * 1, dequantized()), "a read of its values is the dequantized weight"

    before = dequantized()
    layer.weight.data += torch.ones(48, 64)  # merging into a quantized weight is not silently lost
    expected = quantizer_obj.unpack(quantizer_obj.pack(before + 1), record.shape, torch.float32)
    assert torch.equal(dequantized(), expected) and not torch.equal(dequantized(), before)
    packed = {n: getattr(layer, n).clone() for n in record.names}
    with pytest.raises(QuantizedWeightWriteError, match="Nothing was changed"):
        layer.weight[0].add_(1.0)
    assert all(torch.equal(getattr(layer, n), packed[n]) for n in record.names)
    with pytest.raises(KeyError, match="already exists"):
        layer.weight = nn.Parameter(torch.zeros(48, 64))


def test_linear_subclasses_keep_their_class_and_custom_forwards_stay_full_precision():
    class Plain(nn.Linear):
        pass

    class Custom(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model, other = nn.Sequential(Plain(32, 32), Custom(32, 32)), nn.Sequential(Plain(16, 16), Plain(16, 16))
    summary = quantize_component(QFloat8(), model, weight_dtype=None)
    quantize_component(QFloat8(), other, weight_dtype=None)
    assert isinstance(model[0], Plain) and isinstance(model[0], QuantizedLinear)
    assert type(model[0]).__name__ == "QuantizedPlain" and type(model[0]) is type(other[0]) is type(other[1])
    assert summary.full_precision == {"1": "Custom has its own forward"}
    assert type(model[1]) is Custom


def test_tied_weights_are_packed_once_and_stay_tied():
    model = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False))
    model[1].weight = model[0].weight
    quantize_component(QFloat8(), model, weight_dtype=None)
    assert model[0].weight_packed is model[1].weight_packed
    assert model[0].weight_scale is model[1].weight_scale


# -- the compute dtype: what pipelines read, what layers compute in ------------------------------------------


def test_pipeline_dtype_keeps_reporting_the_compute_dtype_when_the_first_parameter_is_packed():
    """Flux's first parameter is x_embedder.weight; diffusers creates latents with transformer.dtype."""
    reference = run(make_pipeline("flux", dtype=torch.bfloat16), "flux")
    pipe = make_pipeline("flux", dtype=torch.bfloat16)
    memmode.apply(pipe, "model_cpu_offload_and_qfloat8", default_exclude=())
    assert packed_record(pipe.transformer.x_embedder) is not None
    assert list(dict(pipe.transformer.x_embedder.named_parameters())) == ["bias", "weight_packed"]
    assert pipe.transformer.dtype == torch.bfloat16
    assert sqnr_db(reference, run(pipe, "flux")) > 25


def test_a_parent_reading_its_childs_first_parameter_for_a_dtype_reads_the_compute_dtype():
    """Wan embeds the timestep with ``timestep.to(next(iter(self.time_embedder.parameters())).dtype)``: with the
    time embedder packed (GGUF files quantize it: tests/test_load_single_file.py), a payload listed first cast the
    timestep to uint8. A packed layer lists its payload after its floating parameters."""

    class Embedder(nn.Module):
        def __init__(self):
            super().__init__()
            self.child = nn.Sequential(nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 64))

        def forward(self, t):
            return self.child(t.to(next(iter(self.child.parameters())).dtype))

    torch.manual_seed(0)
    model = Embedder()
    t = torch.linspace(-1, 1, 64).reshape(1, 64).double()
    reference = model(t)
    quantize_component(QFloat8(), model, weight_dtype=None, options={"default_exclude": ()})
    assert packed_record(model.child[0]) is not None
    assert next(iter(model.child.parameters())).dtype == torch.float32
    assert sqnr_db(reference, model(t)) > 25


def test_weight_dtype_is_the_compute_dtype_and_outputs_keep_the_input_dtype():
    model = Blocks(widths=(32, 32))
    x = torch.randn(4, 16)
    reference = model(x)
    summary = quantize_component(QFloat8(), model, weight_dtype=torch.bfloat16)
    assert summary.compute_dtype == "bfloat16"
    out = model(x)
    assert out.dtype == torch.float32
    assert sqnr_db(reference, out) > 25
    again = quantize_component(QFloat8(), model, weight_dtype=None)  # a no-op keeps the compute dtype
    assert again.no_op and again.compute_dtype == "bfloat16"


def test_weight_dtype_must_be_a_compute_dtype():
    pipe = make_pipeline("wan22")
    with pytest.raises(InvalidOptionError, match="cannot be a compute dtype"):
        memmode.apply(pipe, "model_full_load_and_qfloat8", weight_dtype=torch.float8_e4m3fn)
    assert not any(packed_record(m) for m in pipe.transformer.modules())


# -- dequantizing at call time -------------------------------------------------------------------------------


def test_the_forward_reads_whatever_the_attributes_hold_at_call_time():
    layer = nn.Linear(32, 16)
    quantize_component(QFloat8(), layer, weight_dtype=None)
    x = torch.randn(2, 32)
    first = layer(x)
    payload = layer.weight_packed.data
    layer.weight_packed.data = torch.full_like(payload, 0xFF)  # E4M3 NaN: what a storage placeholder holds
    assert torch.isnan(layer(x)).all()
    layer.weight_packed.data = payload.clone()
    layer.weight_scale.data = layer.weight_scale.data * 2
    # twice the scale is exactly twice the weight; taking the bias out of y = Wx + b again rounds (one layer of 32)
    assert_reassociated(layer(x) - layer.bias, (first - layer.bias) * 2, length=32, depth=1)


def test_torch_compile_after_apply_traces_the_dequantizing_forward():
    model = Blocks(widths=(32, 32))
    x = torch.randn(4, 16)
    memmode.apply(model, "model_cpu_offload_and_qfloat4")
    eager = model(x)
    compiled = torch.compile(model, backend="aot_eager")
    assert_reassociated(compiled(x), eager, length=32, depth=2)  # AOT's decompositions may sum otherwise
    layer = Blocks(widths=(32,))
    quantize_component(QFloat8(), layer, weight_dtype=None)
    torch.compile(layer, backend="aot_eager", fullgraph=True)(x)  # no graph break in the forward


def test_a_lora_adapter_wraps_a_quantized_layer():
    import peft

    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    quantize_component(QFloat8(), model, weight_dtype=None)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["0"], init_lora_weights=False)
    model = peft.inject_adapter_in_model(config, model)
    wrapper = model[0]
    assert isinstance(wrapper.base_layer, QuantizedLinear)  # peft found an nn.Linear and wrapped it
    x = torch.randn(4, 32)
    with torch.no_grad():
        expected = wrapper.base_layer(x) + wrapper.lora_B["default"](wrapper.lora_A["default"](x)) * 2.0
        assert_reassociated(wrapper(x), expected, length=32, depth=2)  # peft's own order of the same terms


# -- which layers: defaults, model declarations, exclude=, format limits --------------------------------------


def test_default_exclusions_keep_stem_and_head_and_the_models_fp32_modules():
    pipe = make_pipeline("wan22", dtype=torch.bfloat16)
    handle = memmode.apply(pipe, "model_full_load_and_qfloat8", exclude=["ffn.net.2"])
    report = handle.report().quantization["transformer"]
    kept = report["full_precision"]
    assert kept["condition_embedder.time_embedder.linear_1"].startswith("kept in float32 by the model")
    assert kept["condition_embedder.time_proj"] == "outside the repeated blocks (default exclusion)"
    assert kept["proj_out"] == "outside the repeated blocks (default exclusion)"
    assert kept["blocks.0.ffn.net.2"] == "exclude='ffn.net.2'"
    assert report["packed_layers"] == 18 and report["full_precision_layers"] == 8
    assert all(not name.startswith("blocks.") or "ffn.net.2" in name for name in kept)


def test_default_exclude_option_replaces_the_defaults():
    pipe = make_pipeline("wan22", dtype=torch.bfloat16)
    handle = memmode.apply(pipe, "model_full_load_and_qfloat8", default_exclude=())
    kept = handle.report().quantization["transformer"]["full_precision"]
    assert set(kept) == {"condition_embedder.time_embedder.linear_1", "condition_embedder.time_embedder.linear_2"}
    with pytest.raises(InvalidOptionError, match="default_exclude"):
        memmode.apply(make_pipeline("wan22"), "model_full_load_and_qfloat8", default_exclude=3)


def test_qfloat4_keeps_layers_whose_width_does_not_fill_blocks_and_reports_them():
    model = Blocks()
    x = torch.randn(4, 16)
    reference = model(x)
    handle = memmode.apply(model, "model_full_load_and_qfloat4")
    report = handle.report().quantization["module"]
    assert report["full_precision"] == {
        "blocks.2.2": "input width 20 is not a multiple of 16 (NVFP4 blocks)",
        "embed": "outside the repeated blocks (default exclusion)",
        "head": "outside the repeated blocks (default exclusion)",
    }
    assert report["packed_layers"] == 5
    assert packed_record(model.blocks[2][0]) is not None and packed_record(model.blocks[2][2]) is None
    assert sqnr_db(reference, model(x)) > 15


def test_nothing_to_quantize_is_refused():
    convs = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3))
    with pytest.raises(IncompatibleModeError, match="no nn.Linear layer"):
        memmode.apply(convs, "model_full_load_and_qfloat8")
    with pytest.raises(IncompatibleModeError, match="every nn.Linear layer stays at full precision"):
        memmode.apply(Blocks(), "model_full_load_and_qfloat8", exclude=["blocks"])


# -- sizes: predicted without quantizing, equal to what quantizing stores -----------------------------------


@pytest.mark.parametrize("quantizer", sorted(QUANTIZERS))
@pytest.mark.parametrize("family", ["wan22", "flux", "sd3", "qwenimage", "ltx"])
def test_predicted_sizes_equal_the_quantized_sizes(family, quantizer):
    pipe = make_pipeline(family, dtype=torch.bfloat16)
    q = QUANTIZERS[quantizer]()
    transformer = pipe.transformer
    plan = select_layers(q, transformer)
    predicted = {name: plan.direct_bytes(m) for name, m in transformer.named_modules()}
    predicted_total = plan.total_bytes()
    last = plan.to_pack[-1]
    one = quantized_direct_bytes(q, last.module, component=transformer)
    summary = quantize_component(q, transformer, weight_dtype=None)
    actual = {
        name: nbytes(t for t in [*m._parameters.values(), *m._buffers.values()] if t is not None)
        for name, m in transformer.named_modules()
    }
    assert predicted == actual
    assert predicted_total == summary.bytes_after < summary.bytes_before
    assert (
        one == actual[last.path] < 2 * (last.module.bias.numel() + last.module.in_features * last.module.out_features)
    )


def test_pack_results_that_break_the_contract_are_plugin_bugs():
    class FloatPayload(Quantizer):
        name = "floaty"

        def pack(self, weight):
            return {"weight_packed": weight.to(torch.float8_e4m3fn)}

    class Subclassed(Quantizer):
        name = "subclassed"

        def pack(self, weight):
            return {"weight_packed": nn.Parameter(weight.to(torch.int8), requires_grad=False)}

    with pytest.raises(TypeError, match="integer dtype"):
        quantize_component(FloatPayload(), nn.Linear(16, 16), weight_dtype=None)
    with pytest.raises(TypeError, match="plain torch.Tensor"):
        quantize_component(Subclassed(), nn.Linear(16, 16), weight_dtype=None)


# -- a third-party quantizer is a page ------------------------------------------------------------------------


def test_a_third_party_quantizer_needs_only_pack_and_unpack(qint8):
    reference = run(make_pipeline("wan22", dtype=torch.bfloat16), "wan22")
    pipe = make_pipeline("wan22", dtype=torch.bfloat16)
    handle = memmode.apply(pipe, "model_group_offload_and_qint8")
    out = run(pipe, "wan22")
    report = handle.report().quantization["transformer_2"]
    assert report["quantizer"] == "qint8" and report["packed_layers"] == 20
    assert pipe.transformer_2.blocks[0].attn1.to_q.weight_packed.dtype == torch.int8
    assert sqnr_db(reference, out) > 25


# -- misuse ---------------------------------------------------------------------------------------------------


def test_quantizing_after_torch_compile_is_refused_untouched():
    pipe = make_pipeline("wan22")
    pipe.transformer.compile(backend="eager")
    with pytest.raises(IncompatibleModeError, match="torch.compile"):
        memmode.apply(pipe, "model_full_load_and_qfloat8")
    assert not any(packed_record(m) for m in pipe.transformer.modules())
    assert not any(packed_record(m) for m in pipe.transformer_2.modules())


def test_the_same_quantizer_twice_is_a_no_op():
    pipe = make_pipeline("wan22", dtype=torch.bfloat16)
    memmode.apply(pipe, "model_full_load_and_qfloat8")
    first = run(pipe, "wan22")
    payloads = [m._parameters.get("weight_packed") for m in linears(pipe.transformer).values()]
    handle = memmode.apply(pipe, "model_cpu_offload_and_qfloat8")
    summary = handle.quantized["transformer"]
    assert summary.no_op and summary.packed_layers == 0 and summary.already_packed_layers == 20
    assert [m._parameters.get("weight_packed") for m in linears(pipe.transformer).values()] == payloads
    assert torch.equal(run(pipe, "wan22"), first)


def test_another_quantizer_is_refused_before_anything_is_touched():
    reference = make_pipeline("wan22", dtype=torch.bfloat16)
    memmode.apply(reference, "model_cpu_offload_and_qfloat8")
    expected = [run(reference, "wan22", 0), run(reference, "wan22", 1)]
    pipe = make_pipeline("wan22", dtype=torch.bfloat16)
    handle = memmode.apply(pipe, "model_cpu_offload_and_qfloat8")
    assert torch.equal(run(pipe, "wan22", 0), expected[0])
    state = {n: t.clone() for n, t in pipe.transformer.state_dict().items()}
    with pytest.raises(IncompatibleModeError, match="already quantized with qfloat8"):
        memmode.apply(pipe, "model_group_offload_and_qfloat4")
    assert handle.active and memmode.handle.handle_of(pipe) is handle
    torch.testing.assert_close(pipe.transformer.state_dict(), state, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(run(pipe, "wan22", 1), expected[1])


def test_remove_says_quantization_is_not_undone(caplog):
    pipe = make_pipeline("wan22")
    handle = memmode.apply(pipe, "model_cpu_offload_and_qfloat4")
    with caplog.at_level(logging.WARNING, logger="memmode"):
        handle.remove()
    assert "not undone" in caplog.text and "qfloat4" in caplog.text
    assert packed_record(pipe.transformer.blocks[0].attn1.to_q) is not None
    assert torch.isfinite(run(pipe, "wan22")).all()  # still runs, quantized, without a placement


# -- converting ahead (the FSDP order), without FSDP ------------------------------------------------------------


def test_convert_then_preconverted_equals_qfloat8():
    reference_pipe = make_pipeline("wan22", dtype=torch.bfloat16)
    memmode.apply(reference_pipe, "model_full_load_and_qfloat8")
    expected = run(reference_pipe, "wan22")

    pipe = make_pipeline("wan22", dtype=torch.bfloat16)
    summary = convert(pipe.transformer)
    convert(pipe.transformer_2)
    assert summary.packed_layers == 20 and summary.compute_dtype == ""
    with pytest.raises(AttributeError, match="weight"):  # a converted layer never computes with raw bytes
        run(pipe, "wan22")
    handle = memmode.apply(pipe, "model_full_load_and_qfloat8_preconverted")
    assert handle.quantized["transformer"].already_packed_layers == 20
    assert torch.equal(run(pipe, "wan22"), expected)
    assert convert(pipe.transformer).no_op


def test_preconverted_refuses_a_model_that_was_not_converted():
    pipe = make_pipeline("wan22")
    with pytest.raises(IncompatibleModeError, match=r"convert\('qfloat8', model\)"):
        memmode.apply(pipe, "model_cpu_offload_and_qfloat8_preconverted")
    assert not any(packed_record(m) for m in pipe.transformer.modules())


def test_convert_refuses_another_format_and_non_modules():
    model = Blocks()
    quantize_component(QFloat4(), model, weight_dtype=None)
    with pytest.raises(IncompatibleModeError, match="already quantized with qfloat4"):
        convert(model)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        convert(make_pipeline("wan22"))


def test_state_dicts_carry_the_stand_in_and_refuse_full_precision_weights():
    model = Blocks(widths=(32, 32))
    quantize_component(QFloat8(), model, weight_dtype=None)
    state = model.state_dict()
    stand_in = state["blocks.0.0.weight"]
    layer = model.blocks[0][0]
    record = layer._memmode_packed
    dequantized = record.codec.unpack({n: getattr(layer, n) for n in record.names}, record.shape, record.compute_dtype)
    assert stand_in.shape == (32, 32) and torch.equal(stand_in, dequantized), "its values are the dequantized weight"
    assert state["blocks.0.0.weight_packed"].dtype == torch.uint8
    x = torch.randn(2, 16)
    before = model(x)
    model.load_state_dict(state)  # a quantized model's own state dict loads back
    assert_bit_equal(model(x), before, "after load_state_dict")  # the same packed values, copied in place
    saved = io.BytesIO()
    torch.save(state, saved)  # pickled as plain tensors: loadable with weights_only, and back into the model
    saved.seek(0)
    loaded = torch.load(saved, weights_only=True)
    assert type(loaded["blocks.0.0.weight"]) is torch.Tensor and torch.equal(loaded["blocks.0.0.weight"], dequantized)
    model.load_state_dict(loaded)
    assert_bit_equal(model(x), before, "after torch.load")
    state["blocks.0.0.weight"] = torch.randn(32, 32)
    with pytest.raises(RuntimeError, match="cannot load a full-precision weight into a layer quantized with qfloat8"):
        model.load_state_dict(state)
