"""The activation memory of a real call, predicted before it runs (``memmode_core.planning.trace``).

Each prediction comes from the component's forward run on fake tensors; the reference is the same forward run
for real, on the inputs a real pipeline call gave it, under ``torch.profiler`` with ``profile_memory=True``:
the peak of its allocation timeline (every allocation and free the CPU allocator reported, kernels'
workspace included) plus the inputs, which are on the device throughout.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torch.utils._pytree import tree_flatten

import memmode_core as memmode
from helpers import in_slice
from memmode_core.contracts.targets import Target
from memmode_core.engine.forwards import entry_methods
from memmode_core.handle import handle_of
from memmode_core.planning.trace import TraceError, call_activations, trace_call
from memmode_core.planning.workspace import workspace_bytes
from tiny_pipelines import ALL_FAMILIES, make_pipeline, run

aten = torch.ops.aten
CPU = torch.device("cpu")

#: family -> the call's shapes (video families take frames)
SHAPES = {
    "wan22": {"height": 32, "width": 32, "num_frames": 5},
    "flux": {"height": 32, "width": 32},
    "sd3": {},
    "qwenimage": {"height": 32, "width": 32},
    "ltx": {"height": 32, "width": 32, "num_frames": 9},
}


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


def profiled_peak(call) -> int:
    """The peak, over ``call()``, of the bytes the profiler saw allocated and not yet freed since it began."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
        pending.extend(event.children)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


def input_bytes(inputs) -> int:
    storages = {
        v.untyped_storage()._cdata: v.untyped_storage().nbytes()
        for v in tree_flatten(inputs)[0]
        if isinstance(v, torch.Tensor)
    }
    return sum(storages.values())


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
    measured = profiled_peak(lambda: getattr(module, method)(*args, **kwargs)) + input_bytes((args, kwargs))
    traces = trace_call(module, lambda: getattr(module, method)(*args, **kwargs))
    (trace,) = traces.values()
    assert trace.calls == 1
    assert trace.activation_peak == pytest.approx(measured, rel=0.15)
    assert trace.flops, "the FLOPs of each module are counted too"
    assert not trace.unmodelled, "float32 on the CPU: every kernel's workspace is modelled"


def test_views_of_weights_are_not_activations():
    """``linear`` transposes its weight: a view of memory that was there before, not a new activation."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    x = torch.randn(2, 256)
    (trace,) = trace_call(model, lambda: model(x)).values()
    weight = 256 * 256 * 4
    assert trace.activation_peak < weight
    assert trace.activation_peak == profiled_peak(lambda: model(x)) + x.nbytes


CONVOLUTIONS = {
    # name: (input shape, weight shape, stride, padding, dilation, groups, input layout, prediction)
    "slow 3x3": ((1, 16, 16, 16), (8, 16, 3, 3), 1, 1, 1, 1, "contiguous", "exact"),
    "slow strided": ((1, 3, 64, 64), (32, 3, 3, 3), 2, 1, 1, 1, "contiguous", "exact"),
    "slow 1x1": ((1, 4, 8, 8), (4, 4, 1, 1), 1, 0, 1, 1, "contiguous", "exact"),
    "slow, input transposed": ((1, 16, 16, 16), (8, 16, 3, 3), 1, 1, 1, 1, "transposed", "exact"),
    "slow, channels last": ((1, 16, 16, 16), (16, 16, 3, 3), 1, 1, 1, 1, "channels_last", "exact"),
    "dilated": ((1, 32, 16, 16), (32, 32, 3, 3), 1, 2, 2, 1, "contiguous", "exact"),
    "slow 3d": ((1, 16, 3, 8, 8), (8, 16, 3, 3, 3), 1, 1, 1, 1, "contiguous", "exact"),
    "onednn wide": ((1, 128, 64, 64), (128, 128, 3, 3), 1, 1, 1, 1, "contiguous", "exact"),
    "onednn 1x1 widening": ((2, 16, 8, 8), (64, 16, 1, 1), 1, 0, 1, 1, "contiguous", "exact"),
    "onednn, odd channels": ((2, 16, 16, 16), (8, 16, 3, 3), 1, 1, 1, 1, "contiguous", "bound"),
    "onednn depthwise": ((2, 32, 16, 16), (32, 1, 3, 3), 1, 1, 1, 32, "contiguous", "bound"),
    "onednn, channels last": ((2, 64, 8, 8), (64, 64, 3, 3), 1, 1, 1, 1, "channels_last", "bound"),
}


@pytest.mark.parametrize("name", CONVOLUTIONS)
def test_convolution_workspace_is_what_the_kernel_allocates(name):
    """Exact for the slow kernels and for oneDNN's aligned, contiguous case (the large layers of real models);
    an upper bound, never under, for oneDNN's other cases (checked over the 604 distinct convolutions and
    attention calls of the pipeline sweep: none under)."""
    shape, weight_shape, stride, padding, dilation, groups, layout, expected = CONVOLUTIONS[name]
    spatial = len(shape) - 2
    x, w = torch.randn(shape), torch.randn(weight_shape)
    if layout == "transposed":
        x = torch.randn(tuple(reversed(shape))).permute(*reversed(range(len(shape))))
    elif layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    args = (x, w, None, [stride] * spatial, [padding] * spatial, [dilation] * spatial, False, [0] * spatial, groups)
    out = aten.convolution.default(*args)
    measured = profiled_peak(lambda: aten.convolution.default(*args)) - out.untyped_storage().nbytes()
    predicted = workspace_bytes(aten.convolution.default, args, {}, CPU)
    if expected == "exact":
        assert predicted == measured
    else:
        assert measured <= predicted <= 3 * measured + 8192


@pytest.mark.parametrize("shape", [(1, 2, 16, 32), (1, 4, 256, 64), (1, 3, 77, 40), (2, 2, 800, 32)])
def test_cpu_flash_attention_workspace_is_what_the_kernel_allocates(shape):
    query = torch.randn(shape)
    key = torch.randn(*shape[:2], shape[2] + 5, shape[3])
    func = aten._scaled_dot_product_flash_attention_for_cpu.default
    outputs = func(query, key, key)
    measured = profiled_peak(lambda: func(query, key, key)) - sum(o.nbytes for o in outputs)
    assert workspace_bytes(func, (query, key, key), {}, CPU) == measured


def test_workspace_that_is_not_modelled_is_named_not_guessed():
    """Reduced precision on the CPU, and any accelerator's convolution: the trace names the operation."""
    conv = torch.nn.Conv2d(8, 8, 3, padding=1)
    x = torch.randn(1, 8, 16, 16)
    (f32,) = trace_call(conv, lambda: conv(x)).values()
    assert not f32.unmodelled
    (on_cuda,) = trace_call(conv, lambda: conv(x), device=torch.device("cuda")).values()
    assert on_cuda.unmodelled == {"aten.convolution"}
    assert on_cuda.activation_peak < f32.activation_peak, "no workspace guessed for it"
    conv.to(torch.bfloat16)
    (bf16,) = trace_call(conv, lambda: conv(x.bfloat16())).values()
    assert bf16.unmodelled == {"aten.convolution"}


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
    fits = {e.placement for e in memmode.plan(pipe, device="cpu", vram_budget=between) if e.fits}
    fits_shaped = {
        e.placement for e in memmode.plan(pipe, device="cpu", vram_budget=between, **SHAPES["flux"]) if e.fits
    }
    assert "model_full_load" in fits and "model_full_load" not in fits_shaped
    assert full.unmodelled_workspace == ()
    pipe.to(torch.bfloat16)
    in_bf16 = memmode.plan(pipe, device="cpu", **SHAPES["flux"])
    assert all("aten.convolution" in e.unmodelled_workspace for e in in_bf16), "the VAE's convolutions"


@pytest.mark.parametrize("family", SHAPES)
def test_a_skeleton_predicts_what_the_loaded_pipeline_does(family, tmp_path):
    """Before loading: the pipeline built from config files, its weights on the meta device, is traced with
    them standing in as fake tensors and its own code on the host (LTX's pipeline reads its VAE's checkpoint
    buffer ``latents_mean`` itself: zeros of its shape stand in) — and is left as it was."""
    from memmode_core.loading.load import skeleton

    pipe = make_pipeline(family)
    pipe.save_pretrained(tmp_path)
    empty = skeleton(tmp_path)
    cls = type(empty)
    modules = [c for c in empty.components.values() if isinstance(c, torch.nn.Module)]
    meta_buffers = [b for c in modules for b in c.buffers() if b.device.type == "meta"]
    assert call_activations(empty, **SHAPES[family]) == call_activations(pipe, **SHAPES[family])
    assert type(empty) is cls
    assert all(p.device.type == "meta" for c in modules for p in c.parameters())
    buffers_after = {id(b) for c in modules for b in c.buffers()}
    assert all(id(b) in buffers_after for b in meta_buffers), "the checkpoint's buffers are put back"


def test_shapes_need_a_pipeline_that_takes_them():
    with pytest.raises(memmode.MemmodeError, match="takes no num_frames"):
        call_activations(make_pipeline("flux"), num_frames=5)


def test_auto_given_the_shapes_fits_weights_and_activations():
    """``apply(pipe, "auto", vram_budget=..., height=..., width=...)``: the budget is the whole device's, the
    choice is the one ``plan`` marks for the same shapes, and the output is full load's."""
    pipe = make_pipeline("flux")
    expected = run(pipe, "flux")
    full = next(e for e in memmode.plan(pipe, device="cpu", **SHAPES["flux"]) if e.placement == "model_full_load")
    budget = full.activation_bytes + full.peak_device_bytes // 2  # all weights fit, not with the activations
    planned = next(e for e in memmode.plan(pipe, device="cpu", vram_budget=budget, **SHAPES["flux"]) if e.chosen)
    handle = memmode.apply(pipe, "auto", device="cpu", vram_budget=budget, **SHAPES["flux"])
    try:
        choice = handle.prepared.choice
        assert choice.placement != "model_full_load" and choice.fits
        assert (choice.placement, choice.storage, choice.options) == (
            planned.placement,
            planned.storage,
            planned.options,
        )
        assert choice.activation_bytes == full.activation_bytes
        assert choice.peak_device_bytes + choice.activation_bytes <= budget
        assert torch.equal(run(pipe, "flux"), expected)
    finally:
        handle.remove()
    weights_only = memmode.apply(pipe, "auto", device="cpu", vram_budget=budget)
    assert weights_only.prepared.choice.placement == "model_full_load", "without shapes the budget is for weights"
    weights_only.remove()


@pytest.mark.parametrize(
    "target, shapes, message",
    [
        ("flux", {"num_frames": 5}, "takes no num_frames"),
        ("model", {"height": 32}, "describe a pipeline call"),
    ],
)
def test_auto_refuses_shapes_its_target_cannot_take_before_touching_it(target, shapes, message):
    pipe = make_pipeline("flux")
    subject = pipe if target == "flux" else pipe.transformer
    before = {name: p.clone() for name, p in pipe.transformer.named_parameters()}
    with pytest.raises(memmode.MemmodeError, match=message):
        memmode.apply(subject, "auto", device="cpu", **shapes)
    assert not memmode.hooks_of(pipe.transformer)
    assert all(torch.equal(p, before[name]) for name, p in pipe.transformer.named_parameters())


def test_a_pipeline_under_a_mode_is_not_traced():
    """Its weights are offloaded and its hooks would move them during the traced call: refused, typed, and the
    mode keeps working; after remove() the same plan runs."""
    pipe = make_pipeline("flux")
    expected = run(pipe, "flux")
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="ram")
    with pytest.raises(memmode.MemmodeError, match="under a memmode mode"):
        memmode.plan(pipe, device="cpu", **SHAPES["flux"])
    with pytest.raises(memmode.MemmodeError, match="under a memmode mode"):
        memmode.apply(pipe, "auto", device="cpu", **SHAPES["flux"])
    assert handle_of(pipe) is handle and handle.mode == "model_group_offload"
    assert torch.equal(run(pipe, "flux"), expected)
    handle.remove()
    assert any(e.activation_bytes for e in memmode.plan(pipe, device="cpu", **SHAPES["flux"]))


#: families whose call cannot be traced on fake tensors, and why (a typed TraceError says so)
NOT_TRACEABLE = {
    "shap_e": "decode_to_image failed on fake tensors",
    # FramePack's transformer reads its index tensors' values to build its rope and its clean latents
    "framepack": "HunyuanVideoFramepackTransformer3DModel.*depends on the values of its tensors",
}


def profiled_components(pipe, family: str) -> dict[str, int]:
    """Each component's largest profiled peak (plus inputs) over a real call: its forward and entry methods,
    each wrapped (signature kept) to run under the profiler."""
    peaks: dict[str, int] = {}
    inside: list = []
    patched = []
    for name, component in Target.of(pipe).components.items():
        for method in ("forward", *entry_methods(component)):
            original = getattr(component, method)

            def profiled(*args, _original=original, _name=name, **kwargs):
                if inside:
                    return _original(*args, **kwargs)
                inside.append(True)
                out = []
                try:
                    peak = profiled_peak(lambda: out.append(_original(*args, **kwargs)))
                finally:
                    inside.pop()
                peaks[_name] = max(peaks.get(_name, 0), peak + input_bytes((args, kwargs)))
                return out[0]

            setattr(component, method, functools.update_wrapper(profiled, original))
            patched.append((component, method))
    try:
        run(pipe, family)
    finally:
        for component, method in patched:
            vars(component).pop(method)
    return peaks


def _sweep_cases() -> list:
    return [pytest.param(family, id=family) for index, family in enumerate(sorted(ALL_FAMILIES)) if in_slice(index, 0)]


@pytest.mark.parametrize("family", _sweep_cases())
def test_every_tiny_pipeline_is_predicted_never_under_its_profile(family):
    """diffusers' own test pipelines (a slice per run, all with MEMMODE_TEST_FULL_MATRIX=1): each component's
    predicted peak is at least 85% of the profiled one (the kernels whose workspace is named as not modelled
    aside) and at most 2.5 times it (oneDNN's workspace is an upper bound where it is not exact). Over all 49
    families, 139 of 151 components are within 15%, none is under by more, and the largest excess is 2.19x."""
    if family in NOT_TRACEABLE:
        pipe = make_pipeline(family)
        with pytest.raises(TraceError, match=NOT_TRACEABLE[family]):
            trace_call(pipe, lambda: run(pipe, family))
        return
    reference = profiled_components(make_pipeline(family), family)
    pipe = make_pipeline(family)
    traces = trace_call(pipe, lambda: run(pipe, family))
    assert {name for name, trace in traces.items() if trace.calls} == set(reference)
    for name, measured in reference.items():
        predicted = traces[name].activation_peak
        if not traces[name].unmodelled:
            assert predicted >= 0.85 * measured, f"{name}: {predicted} predicted, {measured} profiled"
        assert predicted <= 2.5 * measured, f"{name}: {predicted} predicted, {measured} profiled"
