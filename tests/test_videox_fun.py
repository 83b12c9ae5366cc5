"""VideoX-Fun as a real client (issue 14): its six GPU_memory_mode call patterns, its LoRA merge before and
after the mode, against the drop-in, on tiny Wan 2.1 (one transformer) and Wan 2.2 (two experts) pipelines.

VideoX-Fun's own code is re-implemented in ``videox_fun_models`` (its if/elif chain, merge_lora/unmerge_lora).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import videox_fun_models as vf
from memmode_core.compat import _component_names, apply_gpu_memory_mode
from memmode_core.contracts.errors import IncompatibleModeError, InvalidOptionError, MemmodeError
from memmode_core.quantization.layers import is_quantized

LOSSLESS = ("model_full_load", "model_cpu_offload", "model_group_offload", "sequential_cpu_offload")
QFLOAT8 = ("model_full_load_and_qfloat8", "model_cpu_offload_and_qfloat8")

_CACHE: dict = {}


def merged_reference(family: str) -> torch.Tensor:
    """VideoX-Fun's model_full_load with its LoRA merged: what every lossless pattern must give."""
    if family not in _CACHE:
        pipe = vf.make(family)
        vf.merge_loras(pipe, vf.loras_for(pipe))
        vf.videox_fun_chain(pipe, "model_full_load")
        _CACHE[family] = vf.run(pipe)
    return _CACHE[family]


def snapshot(pipe) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": value.clone() for name, component in pipe.components.items()
            if isinstance(component, nn.Module) for key, value in component.state_dict().items()}


def assert_same_state(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        other = after[key]
        assert value.dtype == other.dtype, key
        # the quantized layers' `weight` stand-ins are NaN: compare bits where values are not comparable
        assert torch.equal(value.nan_to_num(), other.nan_to_num()) and torch.equal(value.isnan(), other.isnan()), key


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
    assert set(handle.report().quantization) == ({"transformer"} if family == "wan21" else {"transformer", "transformer_2"})
    assert vf.sqnr_db(vf.run(pipe), merged_reference(family)) > 30


@pytest.mark.parametrize("merge_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("mode", QFLOAT8)
@pytest.mark.parametrize("family", vf.FAMILIES)
def test_qfloat8_merge_after_is_refused_with_nothing_changed(family, mode, merge_dtype):
    """VideoX-Fun's order: merge_lora (in-place ``weight.data +=``, after ``layer.to(device, dtype)``) once the
    mode is set. Refused at the first quantized layer, before that layer or any other is touched; the
    bfloat16 merge dtype on a float32 model is the cast that used to change the first layer's scales."""
    pipe = vf.make(family)
    apply_gpu_memory_mode(pipe, mode, "cpu", torch.float32)
    expected = vf.run(pipe)
    loras = vf.loras_for(pipe)
    before = snapshot(pipe)
    for unmerge in (False, True):
        with pytest.raises(IncompatibleModeError, match="Merge the LoRA before applying") as refused:
            vf.merge_loras(pipe, loras, dtype=merge_dtype, unmerge=unmerge)
        assert isinstance(refused.value, MemmodeError) and "load it unfused" in str(refused.value)
        assert_same_state(before, snapshot(pipe))
    fresh = vf.make(family)  # the refused pipeline computes what a pipeline that never saw the LoRA does
    apply_gpu_memory_mode(fresh, mode, "cpu", torch.float32)
    assert torch.equal(vf.run(pipe, 1), vf.run(fresh, 1))
    assert torch.equal(vf.run(vf.make(family), 0), expected) is False


def test_other_in_place_writes_into_a_quantized_weight_are_refused():
    pipe = vf.make("wan21")
    apply_gpu_memory_mode(pipe, "model_full_load_and_qfloat8", "cpu", torch.float32)
    layer = pipe.transformer.blocks[0].attn1.to_q
    before = snapshot(pipe)
    delta = torch.zeros(layer.weight.shape)
    writes = [lambda: layer.weight.data.copy_(delta), lambda: layer.weight.detach().sub_(delta),
              lambda: layer.weight.data.__setitem__(0, 1.0), lambda: torch.add(delta, delta, out=layer.weight.data)]
    for write in writes:
        with pytest.raises(IncompatibleModeError, match="cannot write into the weight"):
            with torch.no_grad():
                write()
    layer.to(torch.bfloat16)  # moves, never casts, the packed codes, their scales and the bias
    pipe.transformer.half()
    for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
        assert tensor.dtype == before[f"transformer.blocks.0.attn1.to_q.{name}"].dtype, name
    assert layer.weight.shape == (32, 32) and layer.weight.dtype == torch.float32  # reads work


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
    assert apply_gpu_memory_mode(vf.make("wan21"), GPU_memory_mode="model_full_load", device="cpu").mode == \
        "model_full_load"
    pipe = vf.make("wan21")
    with pytest.raises(TypeError, match="twice"):
        apply_gpu_memory_mode(pipe, "model_full_load", "cpu", mode="model_full_load")
    with pytest.raises(TypeError, match="missing the mode"):
        apply_gpu_memory_mode(pipe, device="cpu")
    assert not hasattr(pipe.transformer, "_memmode_handle")


def test_videox_fun_group_offload_arguments(caplog):
    pipe = vf.make("wan22")
    with caplog.at_level(logging.INFO, logger="memmode.compat"):
        handle = apply_gpu_memory_mode(pipe, "model_group_offload", None, onload_device="cpu", offload_device="cpu",
                                       use_stream=True, offload_type="block_level", num_blocks_per_group=2,
                                       low_cpu_mem_usage=True)
    assert "use_stream=True ignored" in caplog.text
    assert handle.storage == "ram" and str(handle.device) == "cpu"
    assert any(g.key.endswith("blocks.0-1") or "blocks" in g.key for g in handle._runtime.groups)
    assert not any(g.key.endswith(".to_q") for g in handle._runtime.groups)  # block level, not leaf level
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
