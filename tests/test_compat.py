"""The VideoX-Fun drop-in: same signature and mode strings, better where it can be."""

from __future__ import annotations

import logging

import pytest
from helpers import assert_same_outputs
from tiny_pipelines import full_load_outputs, make_pipeline, two_calls

from memmode_core.compat import apply_gpu_memory_mode
from memmode_core.contracts.errors import InvalidOptionError, UnknownModeError


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
    assert all(g.key.count("/") == 1 for g in handle._runtime.groups)
    assert any(g.key.endswith(".to_q") for g in handle._runtime.groups)


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
