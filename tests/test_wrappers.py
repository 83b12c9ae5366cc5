"""Every wrapper memmode installs looks like what it wraps: signature, name, docstring, ``__wrapped__``.

Pipelines inspect their components' signatures to decide what to pass (Stable Video Diffusion passes
``num_frames`` to its VAE's decode only if ``inspect.signature(vae.forward)`` names it), so a wrapper that
answered ``(*args, **kwargs)`` would change what they call. Checked on methods of every parameter kind, on
every wrapper a placement installs (forwards, the other entry methods, the weight-editing methods, the
pipeline guards), and on a pipeline that asks.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from diffusers import DiffusionPipeline
from torch import nn

import memmode_core as memmode
from helpers import OFFLOADING_PLACEMENTS, placement_id
from memmode_core.engine.hooks import MethodWrapper
from memmode_core.engine.pipeline_hooks import watches_call_end
from tiny_pipelines import make_pipeline, run


class Kinds(nn.Module):
    def forward(self, x, /, scale=1.0, *extra, num_frames: int, chunk: int | None = None, **options):
        """Positional-only, defaulted, variadic, keyword-only and keyword-variadic parameters."""
        return x * scale

    def decode(self, z: torch.Tensor, num_frames: int = 1) -> torch.Tensor:
        """Decode, knowing the frame count."""
        return z * num_frames

    def helper(self, *args, **kwargs):
        return args, kwargs


class PassThrough(MethodWrapper):
    kind = "tests.pass_through"

    def __call__(self, *args, **kwargs):
        return self.original(*args, **kwargs)


class LazyPassThrough(PassThrough):
    eager = False


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("method", ["forward", "decode", "helper"])
def test_a_method_wrapper_keeps_signature_name_docstring_and_wrapped(method, eager):
    module = Kinds()
    original = getattr(module, method)
    wrapper = (PassThrough if eager else LazyPassThrough)(module, method).install()
    wrapped = getattr(module, method)
    assert wrapped is not original and wrapped is wrapper.function
    assert inspect.signature(wrapped) == inspect.signature(original)
    assert wrapped.__name__ == method and wrapped.__doc__ == original.__doc__
    assert inspect.unwrap(wrapped) == original.__func__ or inspect.unwrap(wrapped) == original
    wrapper.remove()
    assert getattr(module, method) == original


class FrameVAE(nn.Module):
    """An SVD-style temporal VAE: its forward takes ``num_frames``, its decode needs it."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Linear(4, 4)

    def decode(self, z, num_frames):
        return self.decoder(z) * num_frames

    def forward(self, sample, num_frames=1):
        return self.decode(sample, num_frames)


class AskingPipeline(DiffusionPipeline):
    """What StableVideoDiffusionPipeline.decode_latents does: pass ``num_frames`` only if the VAE says it takes it."""

    def __init__(self, vae: FrameVAE) -> None:
        super().__init__()
        self.register_modules(vae=vae)

    def __call__(self, z):
        kwargs = {"num_frames": 3} if "num_frames" in inspect.signature(self.vae.forward).parameters else {}
        out = self.vae.decode(z, **kwargs)
        self.maybe_free_model_hooks()
        return out


@pytest.mark.parametrize("placement", OFFLOADING_PLACEMENTS[:4], ids=placement_id)
def test_a_pipeline_that_inspects_a_components_signature_sees_the_real_one(placement):
    mode, options = placement
    torch.manual_seed(0)
    pipe = AskingPipeline(FrameVAE())
    z = torch.randn(2, 4)
    with torch.no_grad():
        expected = pipe(z)
        handle = memmode.apply(pipe, mode, device="cpu", storage="disk", **options)
        assert torch.equal(pipe(z), expected)
    handle.remove()


@pytest.mark.parametrize("placement", OFFLOADING_PLACEMENTS, ids=placement_id)
def test_every_wrapper_a_placement_installs_keeps_the_signature(placement):
    mode, options = placement
    pipe = make_pipeline("flux")
    handle = memmode.apply(pipe, mode, device="cpu", **options)
    wrappers = [w for ws in handle.runtime.forwards.wrappers.values() for w in ws]
    wrappers += handle.runtime.forwards.edit_wrappers + [
        g for g in handle.runtime.pipeline_hooks.guards if isinstance(g, MethodWrapper)
    ]
    assert {w.method for w in wrappers} >= {
        "forward",
        "encode",
        "decode",
        "load_lora_weights",
        "enable_model_cpu_offload",
        "enable_group_offload",
    }
    call = type(pipe).__call__  # the end of a call is watched on the class (Python calls type(pipe).__call__)
    assert watches_call_end(type(pipe))
    assert inspect.signature(pipe.__call__) == inspect.signature(call.__wrapped__.__get__(pipe))
    for wrapper in wrappers:
        unbound = getattr(type(wrapper.owner), wrapper.method)
        expected = inspect.signature(unbound.__get__(wrapper.owner, type(wrapper.owner)))
        current = getattr(wrapper.owner, wrapper.method)
        assert inspect.signature(current) == expected, f"{type(wrapper.owner).__name__}.{wrapper.method}"
        assert current.__name__ == wrapper.method
    handle.remove()


def test_the_class_wide_call_wrapper_serves_placed_instances_only_and_leaves_with_the_last():
    from diffusers import FluxPipeline

    class OwnFlux(FluxPipeline):  # a class of this test's own: no other test's pipeline counts
        pass

    placed, other = make_pipeline("flux"), make_pipeline("flux")
    placed.__class__ = other.__class__ = OwnFlux
    first = memmode.apply(placed, "model_cpu_offload", device="cpu")
    second = memmode.apply(other, "model_cpu_offload", device="cpu")
    assert watches_call_end(OwnFlux)
    assert OwnFlux.__call__.__memmode_original__ is inspect.unwrap(
        FluxPipeline.__call__, stop=lambda f: not getattr(f, "__memmode_call_end__", False)
    ), "wraps the pipeline's own __call__, not another wrapper"
    first.remove()
    assert watches_call_end(OwnFlux), "still placed: the other pipeline"
    second.remove()
    assert not watches_call_end(OwnFlux) and "__call__" not in vars(OwnFlux)
    assert torch.isfinite(run(placed, "flux", 0)).all()
