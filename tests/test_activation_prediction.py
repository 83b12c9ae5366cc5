"""The activation memory of a real call, predicted before it runs (``memmode_core.planning.trace``).

Each prediction comes from the component's forward run on fake tensors; it is compared with the same forward
run for real, on the inputs a real pipeline call gave it, its live tensors counted by the same dispatch-level
counter (``LiveBytes``: every storage an operation makes, from its first tensor to its last). The profiler's
CPU memory events are not the reference here: on this CPU build they record a few dozen bytes of allocations
for a call that allocates tens of kilobytes.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_flatten

import memmode_core as memmode
from memmode_core.planning.trace import LiveBytes, call_activations, trace_call
from tiny_pipelines import make_pipeline, run

#: family -> the call's shapes (video families take frames)
SHAPES = {"wan22": {"height": 32, "width": 32, "num_frames": 5}, "flux": {"height": 32, "width": 32}, "sd3": {}}


def recorded_inputs(pipe, family: str, component: str, method: str = "forward") -> tuple[tuple, dict]:
    """The arguments of ``component``'s first ``method`` call in a real call of the pipeline."""
    calls = []
    module = getattr(pipe, component)
    original = getattr(module, method)

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    setattr(module, method, record)
    try:
        run(pipe, family)
    finally:
        vars(module).pop(method)
    return calls[0]


def real_peak(call, inputs) -> int:
    live = LiveBytes()
    for value in tree_flatten(inputs)[0]:
        if isinstance(value, torch.Tensor):
            live.add(value)
    with torch.no_grad(), live:
        call()
    return live.peak


@pytest.mark.parametrize(
    "family, component, method",
    [
        ("wan22", "transformer", "forward"),
        ("flux", "transformer", "forward"),
        ("sd3", "transformer", "forward"),
        ("flux", "vae", "decode"),
        ("wan22", "vae", "decode"),
        ("sd3", "text_encoder_3", "forward"),
    ],
)
def test_the_fake_run_predicts_the_real_peak_within_15_percent(family, component, method):
    pipe = make_pipeline(family)
    args, kwargs = recorded_inputs(pipe, family, component, method)
    module = getattr(pipe, component)
    measured = real_peak(lambda: getattr(module, method)(*args, **kwargs), (args, kwargs))
    traces = trace_call(module, lambda: getattr(module, method)(*args, **kwargs))
    (trace,) = traces.values()
    assert trace.calls == 1
    assert trace.activation_peak == pytest.approx(measured, rel=0.15)
    assert trace.flops, "the FLOPs of each module are counted too"


def test_a_pipeline_call_is_traced_without_computing_or_touching_weights():
    pipe = make_pipeline("wan22")
    before = {name: p.clone() for name, p in pipe.transformer.named_parameters()}
    peaks = call_activations(pipe, **SHAPES["wan22"])
    assert set(peaks) >= {"transformer", "text_encoder", "vae"} and all(v > 0 for v in peaks.values())
    assert all(torch.equal(p, before[name]) for name, p in pipe.transformer.named_parameters())
    larger = call_activations(pipe, height=64, width=64, num_frames=5)
    assert larger["transformer"] > peaks["transformer"], "four times the latent, more activations"


def test_plan_with_shapes_counts_activations_against_the_budget():
    pipe = make_pipeline("flux")
    weights_only = memmode.plan(pipe, device="cpu")
    shaped = memmode.plan(pipe, device="cpu", **SHAPES["flux"])
    full = next(e for e in shaped if e.placement == "model_full_load")
    assert full.activation_bytes > 0 and full.device_bytes == full.peak_device_bytes + full.activation_bytes
    assert all(e.activation_bytes == 0 for e in weights_only)
    between = full.peak_device_bytes + full.activation_bytes // 2
    assert next(e for e in memmode.plan(pipe, device="cpu", vram_budget=between) if e is not None).fits in (True, False)
    fits = {e.placement for e in memmode.plan(pipe, device="cpu", vram_budget=between) if e.fits}
    fits_shaped = {
        e.placement for e in memmode.plan(pipe, device="cpu", vram_budget=between, **SHAPES["flux"]) if e.fits
    }
    assert "model_full_load" in fits and "model_full_load" not in fits_shaped


def test_shapes_need_a_pipeline_that_takes_them():
    with pytest.raises(memmode.MemmodeError, match="takes no num_frames"):
        call_activations(make_pipeline("flux"), num_frames=5)
