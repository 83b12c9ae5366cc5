"""A second mode applied over a first: under every storage, the same as the second mode on a fresh model.

A second ``apply`` is prepared (checked, laid out, selected, sized) while the first mode still places the model,
and the first is removed only when the second executes. Under a storage that keeps nothing in memory (``disk``,
the test storage ``poison``) a resting weight's ``.data`` is then memmode's own lazy stand-in of the stored
value, not the tensor itself: the quantizer's checks took it for another library's wrapped tensor and refused
every quantizing mode over such a placement ("0.weight is a StandIn, not a plain tensor"). These tests apply
modes in both orders, on a bare module and on a pipeline, and compare with the second mode applied to a fresh
copy, bit for bit; a second mode refused leaves the first in place and working.
"""

from __future__ import annotations

import pytest
import torch

import memmode_core as memmode
from fake_plugins import FailingStorage, StoragePlugin
from helpers import assert_bit_equal, assert_same_tensors, files_under, hook_count, snapshot, tensors_of
from memmode_core.contracts.errors import IncompatibleModeError, StorageUnavailableError
from memmode_core.quantization import is_quantized
from tiny_models import make_blocks, make_inputs
from tiny_pipelines import make_pipeline, run, two_calls

pytestmark = pytest.mark.usefixtures("poison_storage", "private_tmp")

#: the storages whose resting weights are lazy stand-ins (nothing of them in memory), and one that keeps a copy
RESTING_ELSEWHERE = ["disk", "poison"]


def outputs(model, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(x) for x in inputs]


def assert_same_as(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for index, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_bit_equal(g, e, f"call {index}")


def on_fresh_copy(mode: str, inputs, **kwargs) -> tuple[list[torch.Tensor], memmode.Handle]:
    """``mode`` applied to a fresh model (the same weights), its outputs and handle."""
    model = make_blocks(0)
    handle = memmode.apply(model, mode, device="cpu", **kwargs)
    return outputs(model, inputs), handle


@pytest.mark.parametrize("first_storage", RESTING_ELSEWHERE + ["mmap", "ram"])
@pytest.mark.parametrize("first", ["model_group_offload", "sequential_cpu_offload"])
@pytest.mark.parametrize(
    "second, storage",
    [
        ("model_group_offload_and_qfloat8", None),
        ("model_group_offload_and_qfloat8", "disk"),
        ("model_group_offload_and_qfloat4", "mmap"),
        ("sequential_cpu_offload_and_qfloat8", "disk"),
        ("model_cpu_offload_and_qfloat8", "ram"),
    ],
)
def test_a_quantizing_mode_over_another_equals_it_on_a_fresh_model(first, first_storage, second, storage, private_tmp):
    inputs = make_inputs(0, count=2)
    model = make_blocks(0)
    old = memmode.apply(model, first, device="cpu", storage=first_storage)
    outputs(model, inputs)  # the first mode ran: its weights rest where its storage keeps them
    kwargs = {} if storage is None else {"storage": storage}
    new = memmode.apply(model, second, device="cpu", **kwargs)
    assert not old.active and new.active and model._memmode_handle is new
    expected, reference = on_fresh_copy(second, inputs, **kwargs)
    assert_same_as(outputs(model, inputs), expected)
    assert new.storage == reference.storage
    assert new.report().quantization == reference.report().quantization
    new.remove()
    reference.remove()
    assert hook_count(model) == 0
    assert files_under(private_tmp) == [], "the first mode's files and the second's are gone"


@pytest.mark.parametrize("first_storage", RESTING_ELSEWHERE)
@pytest.mark.parametrize(
    "second, storage",
    [("model_group_offload", "disk"), ("model_group_offload", None), ("sequential_cpu_offload", "disk")],
)
def test_a_mode_over_a_quantizing_one_keeps_the_packed_weights(first_storage, second, storage):
    """The reverse order: ``remove()`` does not undo quantization, so the second mode places the packed weights,
    as it would on a model quantized by the first mode alone; nothing is packed twice."""
    inputs = make_inputs(0, count=2)
    model = make_blocks(0)
    memmode.apply(model, "model_group_offload_and_qfloat8", device="cpu", storage=first_storage)
    outputs(model, inputs)
    kwargs = {} if storage is None else {"storage": storage}
    new = memmode.apply(model, second, device="cpu", **kwargs)
    expected, _ = on_fresh_copy("model_full_load_and_qfloat8", inputs)
    assert_same_as(outputs(model, inputs), expected)
    assert new.quantizer is None and is_quantized(model.blocks[0][0])
    # the same quantizer once more is a no-op on the packed layers, not a refusal
    again = memmode.apply(model, "model_group_offload_and_qfloat8", device="cpu", storage=first_storage)
    assert_same_as(outputs(model, inputs), expected)
    summary = again.report().quantization["module"]
    assert summary["packed_layers"] == 0 and summary["already_packed_layers"] > 0
    again.remove()


@pytest.mark.parametrize("first_storage", RESTING_ELSEWHERE)
def test_a_pipeline_takes_a_quantizing_mode_over_a_placement_on_disk(first_storage, tmp_path):
    pipe = make_pipeline("flux")
    old = memmode.apply(pipe, "model_group_offload", device="cpu", storage=first_storage)
    run(pipe, "flux", 0)
    new = memmode.apply(pipe, "model_group_offload_and_qfloat8", device="cpu", storage="disk")
    assert not old.active and new.active
    reference = make_pipeline("flux")
    fresh = memmode.apply(reference, "model_group_offload_and_qfloat8", device="cpu", storage="disk")
    for got, expected in zip(two_calls(pipe, "flux"), two_calls(reference, "flux"), strict=True):
        assert_bit_equal(got, expected)
    assert new.report().quantization == fresh.report().quantization
    # and back: the pipeline under sequential offload on disk, its transformer still packed
    last = memmode.apply(pipe, "sequential_cpu_offload", device="cpu", storage="disk")
    expected = run(reference, "flux", 0)
    assert_bit_equal(run(pipe, "flux", 0), expected)
    last.remove()
    assert hook_count(pipe) == 0


@pytest.mark.parametrize("first_storage", RESTING_ELSEWHERE)
def test_a_refused_quantizing_mode_leaves_the_placement_on_disk_untouched(first_storage):
    """Refused while it is prepared (nothing to pack; another format than the packed one): nothing changed."""
    inputs = make_inputs(0, count=2)
    expected = outputs(make_blocks(0), inputs)
    model = make_blocks(0)
    before = tensors_of(model)
    old = memmode.apply(model, "model_group_offload", device="cpu", storage=first_storage)
    outputs(model, inputs)
    placed = snapshot(model)
    with pytest.raises(IncompatibleModeError, match="nothing to quantize"):
        memmode.apply(model, "model_group_offload_and_qfloat8", device="cpu", storage="disk", exclude=["blocks"])
    assert snapshot(model) == placed and old.active and model._memmode_handle is old
    assert_same_as(outputs(model, inputs), expected)
    old.remove()
    assert_same_tensors(tensors_of(model), before)

    quantized = memmode.apply(model, "model_group_offload_and_qfloat8", device="cpu", storage=first_storage)
    expected, _ = on_fresh_copy("model_full_load_and_qfloat8", inputs)
    placed = snapshot(model)
    with pytest.raises(IncompatibleModeError, match="already quantized with qfloat8"):
        memmode.apply(model, "model_group_offload_and_qfloat4", device="cpu", storage="disk")
    assert snapshot(model) == placed and quantized.active
    assert_same_as(outputs(model, inputs), expected)
    quantized.remove()


@pytest.mark.parametrize("first_storage", RESTING_ELSEWHERE)
def test_a_quantizing_mode_failing_half_way_over_disk_puts_the_first_back(first_storage, caplog):
    """Failing while storing, after quantizing: the first mode is back, on the packed weights (said)."""
    inputs = make_inputs(0, count=2)
    model = make_blocks(0)
    old = memmode.apply(model, "model_group_offload", device="cpu", storage=first_storage)
    outputs(model, inputs)
    with memmode.temporary_plugin(StoragePlugin(FailingStorage()), name="failing", distribution="tests"):
        with pytest.raises(StorageUnavailableError, match="no room left"):
            memmode.apply(model, "model_group_offload_and_qfloat8", device="cpu", storage="failing")
    assert old.active and model._memmode_handle is old and old.storage == first_storage
    assert "previous mode model_group_offload is back" in caplog.text
    expected, _ = on_fresh_copy("model_full_load_and_qfloat8", inputs)
    assert_same_as(outputs(model, inputs), expected)
    old.remove()
    assert hook_count(model) == 0
