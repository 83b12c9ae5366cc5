"""The quantizer contract (``memmode_core.Quantizer``, in ``contracts/``): a plugin packs and unpacks one
weight; core checks, plans and quantizes, unless the quantizer overrides ``check`` or ``quantize``."""

from __future__ import annotations

import pytest
import torch

import memmode_core as memmode
from memmode_core import quantization
from memmode_core.contracts.quantizer import DEFAULT_EXCLUDE
from tiny_pipelines import make_pipeline, run


class Int8Rows(memmode.Quantizer):
    name = "rows8"
    description = "int8, one scale per output channel (test quantizer)"

    def pack(self, weight):
        scale = weight.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        return {"weight_packed": (weight.float() / scale).round().to(torch.int8), "weight_scale": scale}

    def unpack(self, packed, shape, dtype):
        return packed["weight_packed"].to(dtype) * packed["weight_scale"].to(dtype)


class OwnQuantize(Int8Rows):
    """A quantizer with its own procedure: it uses core's layer mechanics, and records that it ran."""

    name = "own"

    def __init__(self):
        self.calls = []

    def check(self, components, *, weight_dtype, exclude, options):
        self.calls.append(("check", tuple(components)))

    def quantize(self, component, *, weight_dtype, exclude, options):
        self.calls.append(("quantize", type(component).__name__))
        return quantization.quantize_component(self, component, weight_dtype=weight_dtype, exclude=exclude)


def registered(quantizer):
    class Plugin:
        @memmode.hookimpl
        def memmode_register_quantizers(self, register):
            register(quantizer)

    return memmode.temporary_plugin(Plugin(), name=quantizer.name, distribution="tests")


def test_the_contract_only_packs_and_unpacks():
    quantizer = Int8Rows()
    assert quantizer.format_name == "rows8" and quantizer.options[0].name == "default_exclude"
    assert quantizer.options[0].default == DEFAULT_EXCLUDE
    for method in ("check", "quantize"):
        assert not quantization.overrides(quantizer, method)
    with pytest.raises(NotImplementedError, match="core"):
        quantizer.quantize(torch.nn.Linear(4, 4), weight_dtype=None, exclude=(), options={})


def test_core_quantizes_unless_the_quantizer_overrides_it():
    pipe = make_pipeline("flux")
    with registered(Int8Rows()):
        handle = memmode.apply(pipe, "model_cpu_offload_and_rows8", device="cpu")
    assert handle.quantized["transformer"].packed_layers > 0 and torch.isfinite(run(pipe, "flux")).all()
    handle.remove()

    own = OwnQuantize()
    pipe = make_pipeline("flux")
    with registered(own):
        handle = memmode.apply(pipe, "model_cpu_offload_and_own", device="cpu")
    assert own.calls == [("check", ("transformer",)), ("quantize", "FluxTransformer2DModel")]
    assert handle.quantized["transformer"].packed_layers > 0
    handle.remove()


def test_a_layer_selection_made_once_is_followed_not_made_again(monkeypatch):
    pipe = make_pipeline("flux")
    quantizer = Int8Rows()
    selection = quantization.check_component(quantizer, "transformer", pipe.transformer)
    made = []
    monkeypatch.setattr(quantization.quantizing, "select_layers", lambda *a, **k: made.append(a))
    summary = quantization.quantize_component(quantizer, pipe.transformer, weight_dtype=None, selection=selection)
    assert made == [] and summary.packed_layers == len(selection.to_pack)
    assert summary == quantization.summarize(quantizer, selection, summary.packed_layers, summary.bytes_before)
    with pytest.raises(ValueError):  # a selection of another component is not followed
        quantization.quantize_component(
            quantizer, make_pipeline("flux").transformer, weight_dtype=None, selection=selection
        )
