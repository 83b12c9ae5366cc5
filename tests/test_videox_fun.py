"""The VideoX-Fun drop-in (``memmode_core.compat.apply_gpu_memory_mode``): the signature and mode strings of
VideoX-Fun's scripts, better where it can be; and VideoX-Fun as a real client: its six GPU_memory_mode call
patterns, its LoRA merge before and after the mode (after a quantized mode: written through into the packed
weights), against the drop-in, on tiny Wan 2.1 (one transformer) and Wan 2.2 (two experts) pipelines.

VideoX-Fun's own code is re-implemented in ``videox_fun_models`` (its if/elif chain, merge_lora/unmerge_lora).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import memmode_core as memmode
import videox_fun_models as vf
from helpers import assert_same_outputs, assert_same_tensors, sqnr_db, state_of
from memmode_core.compat import _component_names, apply_gpu_memory_mode
from memmode_core.contracts.errors import (
    InvalidOptionError,
    QuantizedWeightWriteError,
    UnknownModeError,
)
from memmode_core.quantization import WeightStandIn, is_quantized, packed_record
from tiny_pipelines import full_load_outputs, make_pipeline, two_calls

LOSSLESS = ("model_full_load", "model_cpu_offload", "model_group_offload", "sequential_cpu_offload")
QFLOAT8 = ("model_full_load_and_qfloat8", "model_cpu_offload_and_qfloat8")

_CACHE: dict = {}


# -- the drop-in's modes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode",
    ["model_full_load", "model_cpu_offload", "model_group_offload", "sequential_cpu_offload", "text_encoder_offload"],
)
def test_reference_modes_equal_full_load(mode):
    pipe = make_pipeline("wan22")
    handle = apply_gpu_memory_mode(pipe, mode, "cpu")
    assert handle.mode == mode
    assert_same_outputs(two_calls(pipe, "wan22"), full_load_outputs("wan22"))
    handle.remove()


def test_group_offload_is_leaf_level_as_in_the_reference():
    handle = apply_gpu_memory_mode(make_pipeline("wan22"), "model_group_offload", "cpu")
    assert all(g.key.count("/") == 1 for g in handle.runtime.groups)
    assert any(g.key.endswith(".to_q") for g in handle.runtime.groups)


def test_group_offload_with_a_quantizer_works():
    pipe = make_pipeline("wan22")
    handle = apply_gpu_memory_mode(pipe, "model_group_offload_and_qfloat8", "cpu")
    assert handle.quantizer == "qfloat8" and set(handle.report().quantization) == {"transformer", "transformer_2"}


def test_quant_tag_overrides_and_transformers_select_components():
    pipe = make_pipeline("wan22")
    handle = apply_gpu_memory_mode(pipe, "model_cpu_offload_and_qfloat8", "cpu", transformers=[pipe.transformer])
    assert set(handle.report().quantization) == {"transformer"}
    with pytest.raises(InvalidOptionError, match="not one of the pipeline's components"):
        apply_gpu_memory_mode(pipe, "model_cpu_offload_and_qfloat8", "cpu", transformers=[pipe.transformer.blocks[0]])


def test_unknown_placement_warns_loudly_and_full_loads(caplog):
    pipe = make_pipeline("flux")
    with caplog.at_level(logging.WARNING, logger="memmode.compat"):
        handle = apply_gpu_memory_mode(pipe, "model_offload_everything", "cpu")
    assert "NO offloading" in caplog.text and "strict=True" in caplog.text
    assert handle.mode == "model_full_load" and handle.requested_mode == "model_offload_everything"


def test_strict_and_unknown_quantizers_raise():
    pipe = make_pipeline("flux")
    with pytest.raises(UnknownModeError):
        apply_gpu_memory_mode(pipe, "model_offload_everything", "cpu", strict=True)
    with pytest.raises(UnknownModeError):
        apply_gpu_memory_mode(pipe, "model_cpu_offload_and_qint3", "cpu")
    with pytest.raises(TypeError):
        apply_gpu_memory_mode(pipe, None, "cpu")
    assert not hasattr(pipe.transformer, "_memmode_handle")


# -- VideoX-Fun's own code beside the drop-in --------------------------------------------------------------


def merged_reference(family: str) -> torch.Tensor:
    """VideoX-Fun's model_full_load with its LoRA merged: what every lossless pattern must give."""
    if family not in _CACHE:
        pipe = vf.make(family)
        vf.merge_loras(pipe, vf.loras_for(pipe))
        vf.videox_fun_chain(pipe, "model_full_load")
        _CACHE[family] = vf.run(pipe)
    return _CACHE[family]


@pytest.mark.parametrize("order", ["merge_before", "merge_after"])
@pytest.mark.parametrize("mode", LOSSLESS)
@pytest.mark.parametrize("family", vf.FAMILIES)
def test_lossless_patterns_are_exact(family, mode, order):
    expected = merged_reference(family)
    outputs = {}
    for who in ("videox_fun", "drop_in"):
        if who == "videox_fun" and mode == "sequential_cpu_offload":
            continue  # accelerate's sequential offload fails on a CPU compute device (set_module_tensor_to_device)
        pipe = vf.make(family)
        loras = vf.loras_for(pipe)
        if order == "merge_before":
            vf.merge_loras(pipe, loras)
        if who == "videox_fun":
            vf.videox_fun_chain(pipe, mode, "cpu")
        else:
            apply_gpu_memory_mode(pipe, mode, "cpu", torch.float32)
        if order == "merge_after":
            vf.merge_loras(pipe, loras)
        outputs[who] = vf.run(pipe)
    for who, output in outputs.items():
        assert torch.equal(output, expected), who


@pytest.mark.parametrize("mode", QFLOAT8)
@pytest.mark.parametrize("family", vf.FAMILIES)
def test_qfloat8_merge_before_apply_is_accurate(family, mode):
    pipe = vf.make(family)
    vf.merge_loras(pipe, vf.loras_for(pipe))
    handle = apply_gpu_memory_mode(pipe, mode, "cpu", torch.float32)
    assert set(handle.report().quantization) == (
        {"transformer"} if family == "wan21" else {"transformer", "transformer_2"}
    )
    assert sqnr_db(merged_reference(family), vf.run(pipe)) > 30


def dequantized(layer: nn.Module) -> torch.Tensor:
    record = packed_record(layer)
    return record.codec.unpack({name: getattr(layer, name) for name in record.names}, record.shape, torch.float32)


def packed_layout(layers: dict[str, nn.Module]) -> dict[str, dict[str, tuple]]:
    """Names, shapes, dtypes and addresses of each layer's packed tensors: a write-through changes none of them."""
    return {
        path: {
            name: (getattr(layer, name).shape, getattr(layer, name).dtype, getattr(layer, name).data_ptr())
            for name in packed_record(layer).names
        }
        for path, layer in layers.items()
    }


def merged_weights(family: str) -> dict:
    """The exactly merged (full-precision) model: its LoRA layers' weights and its transformers' forward."""
    key = ("merged_weights", family)
    if key not in _CACHE:
        pipe = vf.make(family)
        vf.merge_loras(pipe, vf.loras_for(pipe))
        _CACHE[key] = (
            {path: layer.weight.detach().clone() for path, layer in vf.lora_layers(pipe).items()},
            vf.forward(pipe),
        )
    return _CACHE[key]


def merged_before(family: str, mode: str) -> dict:
    """Merge before applying (the accurate order): per layer weight SQNR, forward SQNR, pipeline output SQNR."""
    key = ("merged_before", family, mode)
    if key not in _CACHE:
        weights, forward = merged_weights(family)
        pipe = vf.make(family)
        vf.merge_loras(pipe, vf.loras_for(pipe))
        apply_gpu_memory_mode(pipe, mode, "cpu", torch.float32)
        _CACHE[key] = (
            {path: sqnr_db(weights[path], dequantized(layer)) for path, layer in vf.lora_layers(pipe).items()},
            sqnr_db(forward, vf.forward(pipe)),
            sqnr_db(merged_reference(family), vf.run(pipe)),
        )
    return _CACHE[key]


@pytest.mark.parametrize("merge_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("mode", QFLOAT8)
@pytest.mark.parametrize("family", vf.FAMILIES)
def test_qfloat8_merge_after_writes_through_within_1_db_of_merge_before(family, mode, merge_dtype):
    """VideoX-Fun's order: merge_lora (``layer.to(device, dtype)``, then in-place ``weight.data +=``) once the mode
    is set. Each write dequantizes the layer, adds, quantizes again and stores the new codes and scales in the
    layer's own tensors (same names, shapes, dtypes, memory). The cost is a second FP8 rounding: within 1 dB of
    merging before applying on each merged weight and on the transformers' output (measured: 0.3 to 0.9 dB
    lower on the output); the pipeline's output, whose SQNR moves by more than 10 dB with the seed, stays above
    the 30 dB that merging before is held to. Unmerging gives back the quantized model without the LoRA up to
    the roundings of the two writes. The bfloat16 merge dtype on a float32 model is the cast that used to change
    the first layer's scales."""
    weights, forward = merged_weights(family)
    before_weights, before_forward, before_output = merged_before(family, mode)
    pipe = vf.make(family)
    apply_gpu_memory_mode(pipe, mode, "cpu", torch.float32)
    plain_forward, plain_output = vf.forward(pipe), vf.run(pipe)
    layers = vf.lora_layers(pipe)
    layout = packed_layout(layers)
    loras = vf.loras_for(pipe)

    vf.merge_loras(pipe, loras, dtype=merge_dtype)
    assert packed_layout(layers) == layout  # written in place: every storage that keeps these tensors sees it
    for path, layer in layers.items():
        assert sqnr_db(weights[path], dequantized(layer)) > before_weights[path] - 1, path
    assert sqnr_db(forward, vf.forward(pipe)) > before_forward - 1
    assert sqnr_db(merged_reference(family), vf.run(pipe)) > min(30, before_output)

    vf.merge_loras(pipe, loras, dtype=merge_dtype, unmerge=True)
    assert packed_layout(layers) == layout
    assert sqnr_db(plain_forward, vf.forward(pipe)) > 35
    assert sqnr_db(plain_output, vf.run(pipe)) > 30


def group_offload_qfloat8(pipe, storage: str, **options) -> memmode.Handle:
    """memmode's own qfloat8 group offload (not through the drop-in), computing in float32."""
    mode = "model_group_offload_and_qfloat8"
    return memmode.apply(pipe, mode, device="cpu", weight_dtype=torch.float32, storage=storage, **options)


@pytest.mark.parametrize("storage", ["ram", "mmap", "disk"])
def test_qfloat8_merge_after_under_group_offload_reaches_the_stored_weights(storage, tmp_path):
    """Under group offload a quantized layer at rest holds the storage's own tensors (``ram``: the tensors
    themselves; ``mmap``: views of a private mapping), or placeholders (``disk``: the packed tensors are read
    from the files and get memory of their own, stored again at the next call): the write-through lands there,
    and the next calls compute the merged model — the same as merging after a full load."""
    expected = vf.make("wan22")
    apply_gpu_memory_mode(expected, "model_full_load_and_qfloat8", "cpu", torch.float32)
    vf.merge_loras(expected, vf.loras_for(expected))
    pipe = vf.make("wan22")
    options = {} if storage == "ram" else {"offload_dir": str(tmp_path)}
    group_offload_qfloat8(pipe, storage, **options)
    vf.run(pipe)
    vf.merge_loras(pipe, vf.loras_for(pipe))
    assert torch.equal(vf.run(pipe), vf.run(expected))


def test_in_place_writes_into_a_quantized_weight_write_through_or_are_refused():
    pipe = vf.make("wan21")
    apply_gpu_memory_mode(pipe, "model_full_load_and_qfloat8", "cpu", torch.float32)
    layer = pipe.transformer.blocks[0].attn1.to_q
    codec = packed_record(layer).codec
    layout = packed_layout({"to_q": layer})
    value = torch.randn(32, 32, generator=torch.Generator().manual_seed(0)) * 0.1
    other = pipe.transformer.blocks[1].attn1.to_q

    def holds(expected: torch.Tensor) -> None:  # what packing ``expected`` from scratch stores, bit for bit
        packed = codec.pack(expected)
        assert all(torch.equal(getattr(layer, name), tensor) for name, tensor in packed.items())

    with torch.no_grad():
        layer.weight.data.copy_(value)
        holds(value)
        layer.weight.detach().sub_(layer.weight.data)  # the whole weight as an operand: its dequantized values
        assert torch.equal(dequantized(layer), torch.zeros(32, 32))
        layer.weight.data[0] = 1.0  # indexing the whole weight writes a part of it
        assert torch.equal(dequantized(layer)[0], torch.ones(32)) and not dequantized(layer)[1:].any()
        torch.add(value, value, out=layer.weight.data)
        holds(2 * value)
        layer.weight.data = value  # ``.data =`` a tensor of the weight's shape: the same write as ``.copy_``
        holds(value)
        nn.init.zeros_(layer.weight)
        assert not dequantized(layer).any()
        layer.weight.data.copy_(value)
        current = dequantized(layer)
        layer.weight.data.add_(other.weight)  # another quantized weight as an operand: its dequantized values
        holds(current + dequantized(other))
        layer.weight.data.copy_(layer.weight[0])  # a row of this one, broadcast
        row = dequantized(layer)[0]
        assert torch.equal(dequantized(layer), row.expand(32, 32))
        layer.weight.data.copy_(value)
    assert packed_layout({"to_q": layer}) == layout

    unlinked = torch.full((), float("nan")).expand(32, 32).as_subclass(WeightStandIn)
    before = state_of(pipe)
    refused = {
        "a view of part of the weight": [
            lambda: layer.weight[0].add_(1.0),
            lambda: layer.weight.t().mul_(2),
            lambda: layer.weight.data[:, :4].copy_(torch.zeros(32, 4)),
        ],
        "not finite": [lambda: layer.weight.data.copy_(torch.full((32, 32), float("nan")))],
        "shape or layout": [lambda: layer.weight.data.t_()],
        "linked to no layer": [lambda: unlinked.add_(1.0)],
        "takes a tensor of the weight's shape": [lambda: setattr(layer.weight, "data", torch.zeros(3, 3))],
    }
    for why, writes in refused.items():
        for write in writes:
            with pytest.raises(QuantizedWeightWriteError, match=why):
                with torch.no_grad():
                    write()
            assert_same_tensors(state_of(pipe), before, nan_equal=True)
    layer.to(torch.bfloat16)  # moves, never casts, the packed codes, their scales and the bias
    pipe.transformer.half()
    for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
        assert tensor.dtype == before[f"transformer.blocks.0.attn1.to_q.{name}"].dtype, name
    assert layer.weight.shape == (32, 32) and layer.weight.dtype == torch.float32  # reads work
    holds(value)


def test_an_empty_exclude_fragment_matches_every_layer_as_in_videox_fun(caplog):
    upstream = vf.make("wan21")
    vf.convert_model_weight_to_float8(upstream.transformer, exclude_module_name=[""])
    assert all(p.dtype == torch.float32 for p in upstream.transformer.parameters())  # nothing converted
    pipe = vf.make("wan21")
    with caplog.at_level(logging.INFO, logger="memmode.compat"):
        handle = apply_gpu_memory_mode(pipe, "model_cpu_offload_and_qfloat8", "cpu", exclude_module_name=[""])
    assert "matches every layer name" in caplog.text
    assert handle.mode == "model_cpu_offload" and handle.requested_mode == "model_cpu_offload_and_qfloat8"
    assert not is_quantized(pipe.transformer)
    assert torch.equal(vf.run(pipe), vf.run(vf.make("wan21")))


def test_the_mode_is_accepted_as_GPU_memory_mode_or_mode():
    assert apply_gpu_memory_mode(vf.make("wan21"), mode="model_cpu_offload", device="cpu").mode == "model_cpu_offload"
    assert (
        apply_gpu_memory_mode(vf.make("wan21"), GPU_memory_mode="model_full_load", device="cpu").mode
        == "model_full_load"
    )
    pipe = vf.make("wan21")
    with pytest.raises(TypeError, match="twice"):
        apply_gpu_memory_mode(pipe, "model_full_load", "cpu", mode="model_full_load")
    with pytest.raises(TypeError, match="missing the mode"):
        apply_gpu_memory_mode(pipe, device="cpu")
    assert not hasattr(pipe.transformer, "_memmode_handle")


def test_videox_fun_group_offload_arguments(caplog):
    pipe = vf.make("wan22")
    with caplog.at_level(logging.INFO, logger="memmode.compat"):
        handle = apply_gpu_memory_mode(
            pipe,
            "model_group_offload",
            None,
            onload_device="cpu",
            offload_device="cpu",
            use_stream=True,
            offload_type="block_level",
            num_blocks_per_group=2,
            low_cpu_mem_usage=True,
        )
    assert "use_stream=True ignored" in caplog.text
    assert handle.storage == "ram" and str(handle.device) == "cpu"
    assert any(g.key.endswith("blocks.0-1") or "blocks" in g.key for g in handle.runtime.groups)
    assert not any(g.key.endswith(".to_q") for g in handle.runtime.groups)  # block level, not leaf level
    assert torch.equal(vf.run(pipe), vf.run(vf.make("wan22")))
    pipe = vf.make("wan22")
    with pytest.raises(InvalidOptionError, match="offload_device"):
        apply_gpu_memory_mode(pipe, "model_group_offload", "cpu", offload_device="meta")
    with pytest.raises(InvalidOptionError, match="onload_device"):
        apply_gpu_memory_mode(pipe, "model_group_offload", "cpu", onload_device="meta")
    assert not hasattr(pipe.transformer, "_memmode_handle")


class FakeFSDP(nn.Module):
    """What VideoX-Fun's shard_model leaves: a wrapper whose ``module`` is the model the script holds."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._fsdp_wrapped_module = module

    @property
    def module(self) -> nn.Module:
        return self._fsdp_wrapped_module


def test_transformers_accepts_the_modules_videox_fun_holds():
    pipe = vf.make("wan22")
    inner = pipe.transformer
    pipe.transformer = FakeFSDP(inner)  # the pipeline holds the wrapper, the script the inner module
    assert _component_names(pipe, [inner, pipe.transformer_2]) == ["transformer", "transformer_2"]
    assert _component_names(pipe, [pipe.transformer]) == ["transformer"]
    pipe.transformer = inner
    wrapped_2 = FakeFSDP(pipe.transformer_2)  # the other way round: the script holds a wrapper
    assert _component_names(pipe, [wrapped_2]) == ["transformer_2"]
    with pytest.raises(InvalidOptionError, match="not one of the pipeline's components"):
        _component_names(pipe, [inner.blocks[0]])
    handle = apply_gpu_memory_mode(pipe, "model_full_load_and_qfloat8", "cpu", transformers=[wrapped_2])
    assert set(handle.report().quantization) == {"transformer_2"}
