"""How a placement meets the rest of diffusers: which components a quantizer takes by default, what is left on
the device when a pipeline call returns, and diffusers' own offloading called after ``apply``."""

from __future__ import annotations

import pytest
import torch
from diffusers import DiffusionPipeline, ModelMixin
from diffusers.configuration_utils import ConfigMixin, register_to_config
from fakes import Int8Plugin
from pipeline_families import FAMILIES
from torch import nn

import memmode_core as memmode
from memmode_core import IncompatibleModeError, InvalidOptionError
from memmode_core.contracts.layout import Policy


@pytest.fixture(autouse=True)
def qint8():
    with memmode.temporary_plugin(Int8Plugin(), name="qint8", distribution="tests"):
        yield


def _state(pipe) -> dict[str, torch.Tensor]:
    return {
        f"{c}.{n}": t.detach().clone()
        for c, m in pipe.components.items()
        if isinstance(m, nn.Module)
        for n, t in m.state_dict().items()
    }


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
    before = _state(pipe)
    with pytest.raises(InvalidOptionError, match="no denoiser.*components=\\[...\\]"):
        memmode.apply(pipe, "model_cpu_offload_and_qint8", device="cpu")
    assert all(torch.equal(t, before[n]) for n, t in _state(pipe).items())


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
    kept = sum(g.nbytes for g in handle._runtime.groups if g.policy is Policy.RESIDENT)
    assert report.resident_device_bytes == kept
    assert report.peak_device_bytes > kept
    handle.remove()


def test_keep_last_on_device_leaves_the_last_component_for_the_next_call():
    spec = FAMILIES["sd15"]
    pipe = spec.make(0)
    expected = FAMILIES["sd15"].run(FAMILIES["sd15"].make(0), 0)
    handle = memmode.apply(pipe, "model_cpu_offload", device="cpu", keep_last_on_device=True)
    assert torch.equal(spec.run(pipe, 0), expected)
    vae_bytes = sum(t.numel() * t.element_size() for t in [*pipe.vae.parameters(), *pipe.vae.buffers()])
    assert handle.report().resident_device_bytes == vae_bytes, "the VAE ran last and stays"
    handle.remove()
    with pytest.raises(InvalidOptionError, match="keep_last_on_device"):
        memmode.apply(pipe, "model_cpu_offload", device="cpu", keep_last_on_device="yes")


# -- diffusers' own offloading after apply ----------------------------------------------------------------


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
def test_diffusers_offloading_after_apply_is_refused_at_that_call_with_nothing_changed(call):
    spec = FAMILIES["flux"]
    pipe = spec.make(0)
    expected = spec.run(spec.make(0), 0)
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="disk")
    groups = list(handle._runtime.groups)
    with pytest.raises(IncompatibleModeError, match="memmode mode 'model_group_offload' is applied"):
        call(pipe)
    assert handle.active and handle._runtime.groups == groups
    assert torch.equal(spec.run(pipe, 0), expected)
    handle.remove()
    call(pipe)  # memmode is gone: diffusers' own offloading is the user's again


def test_group_offload_enabled_on_a_placed_bare_module_is_refused():
    torch.manual_seed(0)
    model = Denoiser()
    handle = memmode.apply(model, "model_group_offload", device="cpu")
    with pytest.raises(IncompatibleModeError, match="module.enable_group_offload"):
        model.enable_group_offload(torch.device("cpu"), offload_type="leaf_level")
    assert handle.active
    handle.remove()
