"""Pipelines made with diffusers' ``from_pipe`` from a placed pipeline: they share its component modules.

Under the old placement the new pipeline computes right (the hooks are on the shared modules); applying a mode
to it moves the placement there (the old handle becomes inactive), transactionally: a refused or failed apply
leaves the old placement in place and working. The user guide says what does not follow the modules
(docs/getting-started.md, "Pipelines that share components", under `apply`).
"""

from __future__ import annotations

import logging

import pytest
import torch
from diffusers import FluxImg2ImgPipeline, FluxPipeline

import memmode_core as memmode
from fake_plugins import FailingStorage, StoragePlugin
from helpers import assert_bit_equal, hook_count, snapshot, tensors_of
from memmode_core.contracts.errors import (
    IncompatibleModeError,
    InvalidOptionError,
    StorageUnavailableError,
    UnknownModeError,
)
from memmode_core.engine.pipeline_hooks import ExecutionDeviceHook
from memmode_core.handle import handle_of
from tiny_pipelines import call_kwargs, make_pipeline, run

MODES = ("model_cpu_offload", "model_group_offload")
STORAGES = ("ram", "disk")
#: what from_pipe makes of a Flux pipeline: the same class, and one that takes an image too
CLASSES = (FluxPipeline, FluxImg2ImgPipeline)

pytestmark = pytest.mark.usefixtures("private_tmp")  # the disk storage's default folder: the test's own


def from_pipe(cls, pipe):
    new = cls.from_pipe(pipe)
    new.set_progress_bar_config(disable=True)
    return new


def call(pipe, seed: int) -> torch.Tensor:
    """One call of a Flux text-to-image or image-to-image pipeline, call seed ``seed``."""
    if not isinstance(pipe, FluxImg2ImgPipeline):
        return run(pipe, "flux", seed)
    image = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(100 + seed))
    generator = torch.Generator(device="cpu").manual_seed(seed)
    output = pipe(**call_kwargs("flux", seed), image=image, strength=0.75, generator=generator, return_dict=False)[0]
    return output.detach().to(device="cpu", dtype=torch.float32)


def calls(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    return call(pipe, 0), call(pipe, 1)


_EXPECTED: dict[type, tuple[torch.Tensor, torch.Tensor]] = {}


def expected(cls) -> tuple[torch.Tensor, torch.Tensor]:
    """Calls 1 and 2 of ``cls.from_pipe`` of a fresh, untouched Flux pipeline: the full-load output."""
    if cls not in _EXPECTED:
        _EXPECTED[cls] = calls(from_pipe(cls, make_pipeline("flux")))
    return _EXPECTED[cls]


def assert_full_load(got: tuple[torch.Tensor, ...], cls) -> None:
    for index, (g, e) in enumerate(zip(got, expected(cls)), start=1):
        assert_bit_equal(g, e, f"call {index}")


def assert_placed_by(pipe, handle) -> None:
    """Every module component of ``pipe`` is placed by ``handle``, and diffusers sees its device."""
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            assert component._memmode_handle is handle, name
            assert isinstance(component._hf_hook, ExecutionDeviceHook), name


# -- (a) the new pipeline under the old placement ----------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("mode", MODES)
def test_a_from_pipe_pipeline_runs_under_the_placement_it_shares(mode, storage, cls):
    pipe = make_pipeline("flux")
    before = tensors_of(pipe)
    handle = memmode.apply(pipe, mode, device="cpu", storage=storage)
    new = from_pipe(cls, pipe)
    assert_full_load(calls(new), cls)
    assert handle.active and handle_of(pipe) is handle and handle_of(new) is None
    assert_placed_by(new, handle)
    assert new._execution_device == torch.device("cpu")
    if mode == "model_cpu_offload":
        # the end-of-call offload is the placed pipeline's (docs): the new one's last component stays on the
        # device until another component needs it
        assert handle.report().resident_device_bytes > 0
        assert_bit_equal(call(pipe, 0), expected(FluxPipeline)[0], "the placed pipeline's call")
        assert handle.report().resident_device_bytes == 0
    assert memmode.remove(new) is False  # nothing was applied to it
    assert handle.active
    handle.remove()
    assert hook_count(pipe) == 0 and hook_count(new) == 0
    assert all(not hasattr(c, "_hf_hook") for c in new.components.values())
    assert_same(tensors_of(new), before)


def test_diffusers_offloading_on_the_new_pipeline_takes_the_old_mode_off():
    """Not refused there (the guard is the placed pipeline's): diffusers takes the hooks off the shared components
    first, which removes the mode and gives the weights back before its own hooks go on."""
    pipe = make_pipeline("flux")
    handle = memmode.apply(pipe, "model_group_offload", device="cpu")
    new = from_pipe(FluxPipeline, pipe)
    new.enable_model_cpu_offload(device="cpu")
    assert not handle.active and handle_of(pipe) is None
    assert all(not hasattr(c, "_memmode_handle") for c in new.components.values())
    assert_full_load(calls(new), FluxPipeline)
    new.remove_all_hooks()


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        assert tensor.device.type == "cpu" and tensor.dtype == want[name].dtype, name
        assert torch.equal(tensor, want[name]), f"{name} changed"


# -- (b) apply to the new pipeline moves the placement ----------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize(("old_mode", "new_mode"), [(m, m) for m in MODES] + [MODES, MODES[::-1]])
def test_apply_to_a_from_pipe_pipeline_moves_the_placement(old_mode, new_mode, storage, cls, caplog):
    pipe = make_pipeline("flux")
    before = tensors_of(pipe)
    old = memmode.apply(pipe, old_mode, device="cpu", storage=storage)
    new = from_pipe(cls, pipe)
    with caplog.at_level(logging.INFO, logger="memmode"):
        handle = memmode.apply(new, new_mode, device="cpu", storage=storage)
    moved = [r.getMessage() for r in caplog.records if "placement moved" in r.getMessage()]
    assert len(moved) == 1, caplog.text
    assert f"from FluxPipeline at {id(pipe):#x} (mode {old_mode})" in moved[0]
    assert f"to {cls.__name__} at {id(new):#x} (mode {new_mode})" in moved[0]
    assert "no longer placed" not in moved[0]  # the new pipeline has every component of the old one

    assert not old.active and handle.active and handle.mode == new_mode
    assert handle_of(pipe) is None and not hasattr(pipe, "_memmode_handle")
    assert handle_of(new) is handle
    assert_placed_by(new, handle)
    assert_full_load(calls(new), cls)
    assert handle.report().onloads > 0

    old.remove()  # inactive: a no-op, the new placement stays
    assert handle.active and handle_of(new) is handle
    if storage == "ram":
        assert memmode.remove(new) is True
    else:
        handle.remove()
    assert not handle.active and memmode.remove(new) is False and memmode.remove(pipe) is False
    assert hook_count(new) == 0 and hook_count(pipe) == 0
    assert all(not hasattr(c, "_hf_hook") for c in new.components.values())
    assert_same(tensors_of(new), before)


def test_components_the_new_pipeline_does_not_share_are_unplaced_and_said(caplog):
    pipe = make_pipeline("flux")
    own_encoder = pipe.text_encoder
    encoder_before = tensors_of(own_encoder)
    old = memmode.apply(pipe, "model_group_offload", device="cpu")
    new = FluxPipeline.from_pipe(pipe, text_encoder=make_pipeline("flux").text_encoder)
    new.set_progress_bar_config(disable=True)
    with caplog.at_level(logging.INFO, logger="memmode"):
        handle = memmode.apply(new, "model_group_offload", device="cpu")
    assert "its text_encoder no longer placed" in caplog.text
    assert not old.active
    assert hook_count(own_encoder) == 0 and not hasattr(own_encoder, "_hf_hook")
    assert not hasattr(own_encoder, "_memmode_handle")
    assert_same(tensors_of(own_encoder), encoder_before)  # back in ordinary memory, as it was
    assert_full_load(calls(new), FluxPipeline)

    # and back: the old pipeline takes the placement over again; the new one's own encoder is let go
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="memmode"):
        back = memmode.apply(pipe, "model_cpu_offload", device="cpu")
    assert f"to FluxPipeline at {id(pipe):#x}" in caplog.text and "its text_encoder no longer placed" in caplog.text
    assert not handle.active and handle_of(pipe) is back and handle_of(new) is None
    assert hook_count(new.text_encoder) == 0
    assert_full_load(calls(pipe), FluxPipeline)
    back.remove()
    assert hook_count(pipe) == 0 and hook_count(new) == 0


def test_a_component_alone_is_still_refused_while_a_pipeline_places_it():
    pipe = make_pipeline("flux")
    old = memmode.apply(pipe, "model_cpu_offload", device="cpu")
    new = from_pipe(FluxPipeline, pipe)
    state = snapshot(pipe)
    with pytest.raises(IncompatibleModeError, match="already placed.*as its component 'transformer'"):
        memmode.apply(new.transformer, "model_full_load", device="cpu")
    assert old.active and snapshot(pipe) == state
    assert_full_load(calls(new), FluxPipeline)


# -- a refused or failed apply on the new pipeline keeps the old placement -----------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_refused_apply_on_the_new_pipeline_changes_nothing(mode):
    pipe = make_pipeline("flux")
    old = memmode.apply(pipe, mode, device="cpu")
    new = from_pipe(FluxPipeline, pipe)
    state = snapshot(pipe)
    with pytest.raises(InvalidOptionError):
        memmode.apply(new, "model_group_offload", device="cpu", offload_type="nonsense")
    with pytest.raises(UnknownModeError):
        memmode.apply(new, "model_group_offlaod", device="cpu")
    assert old.active and handle_of(pipe) is old and handle_of(new) is None
    assert snapshot(pipe) == state
    assert_full_load(calls(new), FluxPipeline)


@pytest.mark.parametrize("storage", STORAGES)
def test_a_failed_apply_on_the_new_pipeline_puts_the_old_placement_back(storage, caplog):
    pipe = make_pipeline("flux")
    before = tensors_of(pipe)
    old = memmode.apply(pipe, "model_group_offload", device="cpu", storage=storage)
    new = from_pipe(FluxImg2ImgPipeline, pipe)
    with memmode.temporary_plugin(StoragePlugin(FailingStorage()), name="failing", distribution="tests"):
        with caplog.at_level(logging.INFO, logger="memmode"), pytest.raises(StorageUnavailableError, match="no room"):
            memmode.apply(new, "sequential_cpu_offload", device="cpu", storage="failing")
    assert "placement moved" not in caplog.text
    assert old.active and handle_of(pipe) is old and handle_of(new) is None
    assert pipe._memmode_handle is old and not hasattr(new, "_memmode_handle")
    assert_placed_by(pipe, old)
    assert old.mode == "model_group_offload" and old.storage == storage
    assert_full_load(calls(new), FluxImg2ImgPipeline)
    assert_bit_equal(call(pipe, 0), expected(FluxPipeline)[0], "the old pipeline's call")
    old.remove()
    assert hook_count(pipe) == 0
    assert_same(tensors_of(pipe), before)


# -- quantized modes: as a re-apply on one pipeline ---------------------------------------------------------


def test_a_quantized_placement_moves_without_quantizing_twice():
    mode = "model_group_offload_and_qfloat8"
    reference = make_pipeline("flux")
    memmode.apply(reference, mode, device="cpu")
    want = (run(reference, "flux", 0), run(reference, "flux", 1))

    pipe = make_pipeline("flux")
    old = memmode.apply(pipe, mode, device="cpu")
    new = from_pipe(FluxPipeline, pipe)
    assert_bit_equal(call(new, 0), want[0], "call 1 under the old placement")

    # another quantizer on quantized weights: refused, typed, as on one pipeline; nothing changes
    state = snapshot(pipe)
    with pytest.raises(IncompatibleModeError, match="already quantized with qfloat8"):
        memmode.apply(new, "model_cpu_offload_and_qfloat4", device="cpu")
    assert old.active and snapshot(pipe) == state

    handle = memmode.apply(new, mode, device="cpu")  # the packed layers are kept, not packed again
    assert not old.active and handle_of(new) is handle and set(handle.quantized) == {"transformer"}
    assert_bit_equal(call(new, 1), want[1], "call 2 after the move")

    plain = memmode.apply(new, "model_cpu_offload", device="cpu")  # the weights stay quantized
    assert not handle.active and plain.quantized == {}
    plain.remove()
    assert hook_count(new) == 0
