"""apply / remove / Handle: the order of validation, quantization and placement, and what is left behind."""

from __future__ import annotations

import logging
import re
from itertools import chain

import pytest
import torch
from torch import nn

import memmode_core as memmode
from fake_plugins import FailingStorage, Int8Rows, StoragePlugin
from helpers import (
    assert_bit_equal,
    assert_refused,
    assert_same_outputs,
    assert_same_tensors,
    hook_count,
    nbytes,
    snapshot,
    state_of,
    tensors_of,
)
from memmode_core import StorageUnavailableError, hookimpl
from memmode_core.contracts.errors import IncompatibleModeError, InvalidOptionError, MemmodeError, UnknownModeError
from memmode_core.contracts.targets import Target
from memmode_core.engine.hooks import is_wrapped
from memmode_core.engine.pipeline_hooks import ExecutionDeviceHook
from memmode_core.quantization import quantize_component
from tiny_models import make_blocks
from tiny_pipelines import full_load_outputs, make_pipeline, run, two_calls


class RecordingQuantizer(Int8Rows):
    """int8 rows, recording what it saw when it was called: the order contract (validate, quantize,
    place) is observable."""

    name = "recorder"
    description = "test quantizer: int8 rows, records its calls"

    def __init__(self):
        self.calls = []

    def quantize(self, component, *, weight_dtype, exclude, options):
        hooks = sum(is_wrapped(m) for m in component.modules())
        self.calls.append((component, hooks, weight_dtype, exclude))
        return quantize_component(self, component, weight_dtype=weight_dtype, exclude=exclude, options=options)


@pytest.fixture
def recorder():
    quantizer = RecordingQuantizer()

    class Plugin:
        @hookimpl
        def memmode_register_quantizers(self, register):
            register(quantizer)

    with memmode.temporary_plugin(Plugin(), name="recorder", distribution="tests"):
        yield quantizer


# -- model_cpu_offload equals full load ------------------------------------------------------------


@pytest.mark.parametrize("storage", ["ram", "poison"])
def test_model_cpu_offload_equals_full_load_call_after_call(family, storage, poison_storage):
    pipe = make_pipeline(family)
    handle = memmode.apply(pipe, "model_cpu_offload", device="cpu", storage=storage)
    assert_same_outputs(two_calls(pipe, family), full_load_outputs(family))
    report = handle.report()
    sizes = [nbytes(chain(m.parameters(), m.buffers())) for m in Target.of(pipe).components.values()]
    assert report.peak_device_bytes == max(sizes)  # one component resident at a time
    assert report.bytes_transferred >= sum(sizes)
    handle.remove()
    assert_same_outputs((run(pipe, family, 0),), full_load_outputs(family)[:1])


def test_remove_leaves_the_pipeline_as_it_was(poison_storage):
    pipe = make_pipeline("wan22")
    before = snapshot(pipe, data=False)
    handle = memmode.apply(pipe, "model_cpu_offload", device="cpu", storage="poison")
    assert isinstance(pipe.transformer._hf_hook, ExecutionDeviceHook)
    assert pipe._execution_device == torch.device("cpu")
    run(pipe, "wan22")
    handle.remove()
    # same tensor objects, devices, dtypes and shapes; no hooks and no attributes left
    assert snapshot(pipe, data=False) == before
    assert hook_count(pipe) == 0
    assert not handle.active and memmode.remove(pipe) is False
    handle.remove()  # idempotent


def test_remove_function_and_bare_module_targets():
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 8)
    expected = net(x)
    handle = memmode.apply(net, "model_cpu_offload", device="cpu")
    torch.testing.assert_close(net(x), expected, rtol=0, atol=0)
    assert handle.report().onloads == 1
    assert memmode.remove(net) is True
    assert hook_count(net) == 0 and not hasattr(net, "_memmode_handle")


# -- refusals touch nothing ---------------------------------------------------------------------------


REFUSALS = [
    (dict(mode=5), TypeError),
    (dict(mode="nonsense"), UnknownModeError),
    (dict(mode="model_cpu_offload_and_qint2"), UnknownModeError),
    (dict(mode="model_cpu_offload", storage="nope"), UnknownModeError),
    (dict(mode="model_cpu_offload", storage=3), TypeError),
    (dict(mode="model_full_load", storage="ram"), IncompatibleModeError),
    (dict(mode="model_cpu_offload", device="banana"), InvalidOptionError),
    (dict(mode="model_cpu_offload", device="meta"), InvalidOptionError),
    (dict(mode="model_cpu_offload", weight_dtype=torch.int8), InvalidOptionError),
    (dict(mode="model_cpu_offload", unknown_option=1), InvalidOptionError),
    (dict(mode="model_group_offload", num_blocks_per_group=0), InvalidOptionError),
    (dict(mode="model_group_offload", offload_type="block"), InvalidOptionError),
    (dict(mode="model_group_offload", block_modules=["no_such_module"]), InvalidOptionError),
    (dict(mode="model_group_offload", use_stream=True), InvalidOptionError),
    (dict(mode="model_cpu_offload", components=["transformer"]), InvalidOptionError),
    (dict(mode="model_cpu_offload", exclude=["norm"]), InvalidOptionError),
    (dict(mode="model_cpu_offload", offload_dir="/tmp/x"), InvalidOptionError),
    (dict(mode="model_cpu_offload_and_recorder", components=["no_such_component"]), InvalidOptionError),
]


@pytest.mark.parametrize("kwargs, error", REFUSALS, ids=[str(k) for k, _ in REFUSALS])
def test_refusals_are_typed_and_leave_the_pipeline_untouched(kwargs, error, recorder):
    pipe = make_pipeline("wan22")
    before = snapshot(pipe)
    kwargs = dict(kwargs)
    mode = kwargs.pop("mode")
    kwargs.setdefault("device", "cpu")
    with pytest.raises(error):
        memmode.apply(pipe, mode, **kwargs)
    assert snapshot(pipe) == before
    assert not recorder.calls
    assert_same_outputs((run(pipe, "wan22", 0),), full_load_outputs("wan22")[:1])


@pytest.mark.parametrize("budget", [float("inf"), "1e400GB"], ids=["inf", "1e400GB"])
def test_an_infinite_vram_budget_is_refused(budget):
    """vram_budget=float('inf') or '1e400GB' with mode "auto" is an InvalidOptionError (not an
    OverflowError), with the model untouched."""
    assert_refused(make_blocks(0), InvalidOptionError, mode="auto", vram_budget=budget)


@pytest.mark.parametrize("device", ["xla", "mps"])
def test_an_unavailable_accelerator_is_refused_at_apply(device):
    """device="xla" / "mps" where that backend is not available is an InvalidOptionError at
    apply saying it is not available (not a failure at the first forward)."""
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("MPS is available here")
    err = assert_refused(make_blocks(0), InvalidOptionError, device=device, mode="model_cpu_offload")
    assert re.search(r"not available|unavailable|no \S+ device is available", str(err)), str(err)


@pytest.mark.parametrize("device", ["privateuseone", "xpu", "hpu"])
def test_an_unknown_or_unavailable_device_type_is_refused_at_apply(device):
    """device types torch can name but this machine cannot compute on (privateuseone without
    a registered backend, xpu / hpu without their runtime) are an InvalidOptionError at apply."""
    if device == "xpu" and getattr(torch, "xpu", None) is not None and torch.xpu.is_available():
        pytest.skip("XPU is available here")
    assert_refused(make_blocks(0), InvalidOptionError, device=device, mode="model_cpu_offload")


def test_a_refused_replacement_keeps_the_current_mode(recorder):
    pipe = make_pipeline("flux")
    handle = memmode.apply(pipe, "model_group_offload", device="cpu")
    before = snapshot(pipe)
    with pytest.raises(MemmodeError):
        memmode.apply(pipe, "model_cpu_offload", device="cpu", storage="nope")
    assert snapshot(pipe) == before and handle.active
    assert_same_outputs(two_calls(pipe, "flux"), full_load_outputs("flux"))


def test_quantizing_a_compiled_transformer_is_refused_untouched(recorder):
    pipe = make_pipeline("flux")
    pipe.transformer = torch.compile(pipe.transformer)
    before = snapshot(pipe)
    with pytest.raises(IncompatibleModeError, match="torch.compile"):
        memmode.apply(pipe, "model_cpu_offload_and_recorder", device="cpu")
    assert snapshot(pipe) == before and not recorder.calls


def test_a_target_that_is_neither_pipeline_nor_module_is_a_type_error():
    with pytest.raises(TypeError):
        memmode.apply(object(), "model_full_load")


@pytest.mark.parametrize("where", ["whole", "submodule"])
def test_torchscript_targets_are_refused_untouched(where, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    if where == "whole":
        target = torch.jit.script(model)
    else:
        target = nn.Sequential(torch.jit.script(model), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    expected = target(x)
    before = state_of(target)
    with pytest.raises(IncompatibleModeError, match="TorchScript"):
        memmode.apply(target, "model_group_offload", device="cpu", storage="disk", offload_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    assert_same_tensors(state_of(target), before)
    assert torch.equal(target(x), expected)


# -- the order: validate, quantize, place ------------------------------------------------------------------


def test_quantizer_runs_before_placement_on_the_default_components(recorder):
    pipe = make_pipeline("wan22")
    handle = memmode.apply(pipe, "model_cpu_offload_and_recorder", device="cpu", weight_dtype=torch.bfloat16)
    assert [call[0] for call in recorder.calls] == [pipe.transformer, pipe.transformer_2]
    assert all(hooks == 0 for _, hooks, _, _ in recorder.calls)  # not placed yet when quantized
    assert all(dtype == torch.bfloat16 for _, _, dtype, _ in recorder.calls)
    assert handle.mode == "model_cpu_offload_and_recorder" and handle.quantizer == "recorder"
    assert set(handle.report().quantization) == {"transformer", "transformer_2"}
    handle.remove()


def test_components_and_exclude_reach_the_quantizer(recorder, caplog):
    pipe = make_pipeline("flux")
    handle = memmode.apply(
        pipe, "model_full_load_and_recorder", device="cpu", components=["text_encoder_2"], exclude=["norm"]
    )
    assert [(c, e) for c, _, _, e in recorder.calls] == [(pipe.text_encoder_2, ("norm",))]
    with caplog.at_level(logging.WARNING, logger="memmode"):
        handle.remove()
    assert "not undone" in caplog.text


def test_a_pipeline_without_default_quantizer_targets_must_name_them(recorder):
    with pytest.raises(InvalidOptionError, match="components="):
        memmode.apply(make_pipeline("wan22").vae, "model_full_load_and_recorder", device="cpu", components=["x"])


# -- replacing and sharing ---------------------------------------------------------------------------------


def test_applying_a_second_mode_replaces_the_first_cleanly(poison_storage):
    pipe = make_pipeline("sd3")
    first = memmode.apply(pipe, "model_cpu_offload", device="cpu", storage="poison")
    run(pipe, "sd3")
    second = memmode.apply(pipe, "model_group_offload", device="cpu", storage="poison", offload_type="leaf_level")
    assert not first.active and second.active
    reference = make_pipeline("sd3")
    memmode.apply(reference, "model_group_offload", device="cpu", storage="poison", offload_type="leaf_level")
    assert hook_count(pipe) == hook_count(reference)
    assert_same_outputs(two_calls(pipe, "sd3"), full_load_outputs("sd3"))
    second.remove()
    assert hook_count(pipe) == 0


@pytest.mark.usefixtures("poison_storage", "private_tmp")
@pytest.mark.parametrize("first", ["disk", "poison", "mmap"])
def test_a_failed_re_apply_leaves_the_previous_mode_active(first):
    expected = run(make_pipeline("flux"), "flux", 0)
    pipe = make_pipeline("flux")
    before = tensors_of(pipe)
    old = memmode.apply(pipe, "model_group_offload", device="cpu", storage=first)
    with memmode.temporary_plugin(StoragePlugin(FailingStorage()), name="failing", distribution="tests"):
        with pytest.raises(StorageUnavailableError, match="no room left"):
            memmode.apply(pipe, "sequential_cpu_offload", device="cpu", storage="failing")
    assert old.active and pipe._memmode_handle is old and pipe.transformer._memmode_handle is old
    assert old.mode == "model_group_offload" and old.storage == first
    assert_bit_equal(run(pipe, "flux", 0), expected)
    assert old.report().onloads > 0
    old.remove()
    assert hook_count(pipe) == 0
    assert_same_tensors(tensors_of(pipe), before)


def test_a_component_placed_through_a_pipeline_is_refused_alone():
    """A pipeline sharing the components takes the placement over (tests/test_from_pipe.py); one of them alone
    would unplace the rest of the pipeline placing it."""
    pipe = make_pipeline("flux")
    first = memmode.apply(pipe, "model_cpu_offload", device="cpu")
    sibling = type(pipe)(**pipe.components)
    with pytest.raises(IncompatibleModeError, match="already placed"):
        memmode.apply(pipe.transformer, "model_full_load", device="cpu")
    moved = memmode.apply(sibling, "model_full_load", device="cpu")
    assert not first.active and moved.active
    with pytest.raises(IncompatibleModeError, match="already placed"):
        memmode.apply(sibling.transformer, "model_full_load", device="cpu")


def test_diffusers_removing_its_hooks_removes_the_placement():
    """pipe.enable_model_cpu_offload() calls accelerate's remove_hook_from_module on every component."""
    pipe = make_pipeline("flux")
    handle = memmode.apply(pipe, "model_group_offload", device="cpu")
    for component in Target.of(pipe).components.values():  # what accelerate does
        if hasattr(component, "_hf_hook"):
            component._hf_hook.detach_hook(component)
            delattr(component, "_hf_hook")
    assert not handle.active and hook_count(pipe) == 0


def test_report_fields():
    pipe = make_pipeline("ltx")
    handle = memmode.apply(pipe, "model_group_offload", device="cpu")
    run(pipe, "ltx")
    report = handle.report()
    data = report.as_dict()
    assert {
        "mode",
        "storage",
        "device",
        "peak_device_bytes",
        "bytes_transferred",
        "transfer_seconds",
        "resident_device_bytes",
        "onloads",
        "offloads",
        "storage_bytes",
    } <= data.keys()
    assert data["mode"] == "model_group_offload" and data["storage"] == "ram" and data["device"] == "cpu"
    assert 0 < report.peak_device_bytes < report.bytes_transferred
    assert report.onloads >= report.offloads > 0
    assert "model_group_offload" in str(report)
    handle.reset_stats()
    assert handle.report().bytes_transferred == 0
