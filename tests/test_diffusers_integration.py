"""How a placement meets the rest of diffusers: which components a quantizer takes by default, what is left on
the device when a pipeline call returns, diffusers' own offloading called after ``apply``, hooks diffusers
installs after ``apply`` (``enable_layerwise_casting``), and accelerate's offloading found on a module."""

from __future__ import annotations

import diffusers
import pytest
import torch
from diffusers import DiffusionPipeline, FluxTransformer2DModel, ModelMixin
from diffusers.configuration_utils import ConfigMixin, register_to_config
from packaging.version import Version
from torch import nn

import memmode_core as memmode
from helpers import (
    OFFLOADING_PLACEMENTS,
    STORAGES,
    assert_bit_equal,
    assert_same_tensors,
    nbytes,
    placement_id,
    snapshot,
    state_of,
    tensors_of,
)
from memmode_core import IncompatibleModeError, InvalidOptionError
from memmode_core.contracts.group_specs import Policy
from tiny_components import FLUX_BLOCKS, configured, seeded
from tiny_pipelines import ALL_FAMILIES as FAMILIES

pytestmark = pytest.mark.usefixtures("qint8")


# -- which components a quantizer takes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, denoisers",
    [
        ("wan22", ["transformer", "transformer_2"]),
        ("sd15", ["unet"]),
        ("controlnet", ["controlnet", "unet"]),
        ("kandinsky22_prior", ["prior"]),
        ("wuerstchen_decoder", ["decoder"]),
        ("stable_cascade_prior", ["prior"]),
        ("dance_diffusion", ["unet"]),
    ],
)
def test_a_quantizer_takes_the_pipelines_denoisers_whatever_they_are_called(family, denoisers):
    pipe = FAMILIES[family].make(0)
    handle = memmode.apply(pipe, "model_full_load_and_qint8", device="cpu")
    assert sorted(handle.quantized) == denoisers
    assert sorted(handle.report().quantization) == denoisers
    assert all(handle.report().quantization[name]["packed_layers"] > 0 for name in denoisers)
    assert torch.isfinite(FAMILIES[family].run(pipe, 0)).all()


class Denoiser(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(2))

    def forward(self, sample, timestep):
        for block in self.blocks:
            sample = block(sample) + timestep
        return sample


class Decoder(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.out = nn.Linear(width, width)

    def forward(self, sample):
        return self.out(sample)


class CustomPipeline(DiffusionPipeline):
    def __init__(self, denoiser: nn.Module, decoder: nn.Module) -> None:
        super().__init__()
        self.register_modules(denoiser=denoiser, decoder=decoder)

    def __call__(self, x):
        for t in range(2):
            x = self.denoiser(x, t)
        out = self.decoder(x)
        self.maybe_free_model_hooks()
        return out


def test_a_denoiser_under_another_name_is_found_and_a_pipeline_without_one_is_refused_untouched():
    torch.manual_seed(0)
    pipe = CustomPipeline(Denoiser(), Decoder())
    handle = memmode.apply(pipe, "model_cpu_offload_and_qint8", device="cpu")
    assert list(handle.quantized) == ["denoiser"]
    handle.remove()
    pipe = CustomPipeline(Decoder(), Decoder())
    before = state_of(pipe)
    with pytest.raises(InvalidOptionError, match="no denoiser.*components=\\[...\\]"):
        memmode.apply(pipe, "model_cpu_offload_and_qint8", device="cpu")
    assert_same_tensors(state_of(pipe), before)


# -- what a pipeline call leaves on the device ------------------------------------------------------------


@pytest.mark.parametrize("family", ["sd15", "wan22", "kandinsky22"])
@pytest.mark.parametrize(
    "mode, options", [("model_cpu_offload", {}), ("model_group_offload", {}), ("sequential_cpu_offload", {})]
)
def test_nothing_streamed_stays_on_the_device_after_a_pipeline_call(family, mode, options):
    spec = FAMILIES[family]
    pipe = spec.make(0)
    handle = memmode.apply(pipe, mode, device="cpu", storage="ram", **options)
    spec.run(pipe, 0)
    report = handle.report()
    kept = sum(g.nbytes for g in handle.runtime.groups if g.policy is Policy.RESIDENT)
    assert report.resident_device_bytes == kept
    assert report.peak_device_bytes > kept
    handle.remove()


def test_keep_last_on_device_leaves_the_last_component_for_the_next_call():
    spec = FAMILIES["sd15"]
    pipe = spec.make(0)
    expected = FAMILIES["sd15"].run(FAMILIES["sd15"].make(0), 0)
    handle = memmode.apply(pipe, "model_cpu_offload", device="cpu", keep_last_on_device=True)
    assert torch.equal(spec.run(pipe, 0), expected)
    vae_bytes = nbytes([*pipe.vae.parameters(), *pipe.vae.buffers()])
    assert handle.report().resident_device_bytes == vae_bytes, "the VAE ran last and stays"
    handle.remove()
    with pytest.raises(InvalidOptionError, match="keep_last_on_device"):
        memmode.apply(pipe, "model_cpu_offload", device="cpu", keep_last_on_device="yes")


# -- diffusers' own offloading after apply ----------------------------------------------------------------

#: whether diffusers' own group offloading runs on this machine: before 0.41 it reads the type of
#: ``torch.accelerator.current_accelerator()``, which is None on a machine without one
DIFFUSERS_GROUP_OFFLOADS_HERE = torch.accelerator.current_accelerator() is not None or Version(
    diffusers.__version__
) >= Version("0.41")


@pytest.mark.parametrize(
    "call",
    [
        lambda pipe: pipe.enable_model_cpu_offload(device="cpu"),
        lambda pipe: pipe.enable_sequential_cpu_offload(device="cpu"),
        lambda pipe: pipe.enable_group_offload(torch.device("cpu"), offload_type="leaf_level"),
        lambda pipe: pipe.transformer.enable_group_offload(torch.device("cpu"), offload_type="leaf_level"),
    ],
    ids=[
        "pipe.enable_model_cpu_offload",
        "pipe.enable_sequential_cpu_offload",
        "pipe.enable_group_offload",
        "transformer.enable_group_offload",
    ],
)
def test_diffusers_offloading_after_apply_is_refused_at_that_call_with_nothing_changed(call, request):
    spec = FAMILIES["flux"]
    pipe = spec.make(0)
    expected = spec.run(spec.make(0), 0)
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="disk")
    groups = list(handle.runtime.groups)
    with pytest.raises(IncompatibleModeError, match="memmode mode 'model_group_offload' is applied"):
        call(pipe)
    assert handle.active and handle.runtime.groups == groups
    assert torch.equal(spec.run(pipe, 0), expected)
    handle.remove()
    if "group_offload" in request.node.callspec.id and not DIFFUSERS_GROUP_OFFLOADS_HERE:
        pytest.skip(f"diffusers {diffusers.__version__}'s own group offloading needs an accelerator (0.41 runs on CPU)")
    call(pipe)  # memmode is gone: diffusers' own offloading is the user's again


def test_group_offload_enabled_on_a_placed_bare_module_is_refused():
    torch.manual_seed(0)
    model = Denoiser()
    handle = memmode.apply(model, "model_group_offload", device="cpu")
    with pytest.raises(IncompatibleModeError, match="module.enable_group_offload"):
        model.enable_group_offload(torch.device("cpu"), offload_type="leaf_level")
    assert handle.active
    handle.remove()


# -- hooks installed after apply ------------------------------------------------------------------------


def tiny_flux_transformer() -> FluxTransformer2DModel:
    """One dual- and one single-stream block."""
    config = {"in_channels": 4, "num_layers": 1, "num_single_layers": 1, "pooled_projection_dim": 32}
    return seeded(configured(FluxTransformer2DModel, FLUX_BLOCKS, config, {"axes_dims_rope": [4, 4, 8]}))


def flux_inputs():
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(1, 16, 4, generator=g),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g),
        timestep=torch.tensor([1.0]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(8, 3),
        return_dict=False,
    )


def layerwise_cast(model: nn.Module) -> None:
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)


@pytest.mark.usefixtures("poison_storage", "private_tmp")
@pytest.mark.parametrize("order", ["after_apply", "before_apply"])
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("placement", OFFLOADING_PLACEMENTS[:4], ids=placement_id)
def test_layerwise_casting_composes_with_every_mode(placement, storage, order):
    mode, options = placement
    reference = tiny_flux_transformer()
    layerwise_cast(reference)
    with torch.no_grad():
        expected = reference(**flux_inputs())[0]
        target = tiny_flux_transformer()
        if order == "before_apply":
            layerwise_cast(target)
        handle = memmode.apply(target, mode, device="cpu", storage=storage, **options)
        if order == "after_apply":
            layerwise_cast(target)  # diffusers' documented order: hooks on top of memmode's
        for _ in range(2):
            assert_bit_equal(target(**flux_inputs())[0], expected)
        handle.remove()
        assert_same_tensors(tensors_of(target), tensors_of(reference))  # float8 weights, not NaN, not the uncast ones
        assert_bit_equal(target(**flux_inputs())[0], expected)  # diffusers' hooks still work without memmode


@pytest.mark.usefixtures("private_tmp")
def test_another_offloading_scheme_installed_after_apply_is_refused_at_the_next_call():
    target = tiny_flux_transformer()
    with torch.no_grad():
        expected = target(**flux_inputs())[0]
    before = tensors_of(target)
    handle = memmode.apply(target, "model_group_offload", device="cpu", storage="disk")
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module

    add_hook_to_module(target, AlignDevicesHook(execution_device="cpu"))
    with pytest.raises(IncompatibleModeError, match="accelerate"):
        target(**flux_inputs())
    handle.remove()
    assert_same_tensors(tensors_of(target), before)
    remove_hook_from_module(target)
    with torch.no_grad():
        assert_bit_equal(target(**flux_inputs())[0], expected)


# -- accelerate's offloading on a bare module ------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["cpu_offload", "sequential_hooks"])
@pytest.mark.usefixtures("private_tmp")
def test_accelerate_offloading_on_a_bare_module_is_refused_untouched(scheme):
    from accelerate import cpu_offload
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    target = tiny_flux_transformer()
    if scheme == "cpu_offload":
        cpu_offload(target, execution_device="cpu")
    else:  # one hook per leaf, as enable_sequential_cpu_offload leaves them
        add_hook_to_module(target.proj_out, AlignDevicesHook(execution_device="cpu"))
    before = snapshot(target)
    with pytest.raises(IncompatibleModeError, match="accelerate"):
        memmode.apply(target, "model_group_offload", device="cpu", storage="disk")
    assert snapshot(target) == before
