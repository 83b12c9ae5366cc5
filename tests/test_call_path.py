"""``apply``'s request goes down the layers once: no module entered again, no call up a layer.

``tests/call_tracing.py`` traces ``apply`` on the built-in tiny pipeline (``benchmarks/call_path.py`` prints
the same figures). Before the planning layer was cut by job, the request went into ``planning.prepared``
twice (to be made, then to be prepared), and for ``auto`` planning called the resolver's ``budgets`` and
``choose``, up into the built-in plugins; the engine's rebuilds called back into planning for a layout.
"""

from __future__ import annotations

import pytest

from call_tracing import DEFAULT_MODES, trace_apply
from memmode_core.cli.demo_pipeline import make_demo_pipeline


@pytest.mark.parametrize("mode", ["model_group_offload", "model_group_offload_and_qfloat8"])
def test_the_request_of_load_enters_each_module_once_and_nothing_calls_up(mode, tmp_path):
    """``load`` builds its request before the model exists and executes the plan (``applying``, which packs while
    the checkpoint is read: ``layer_packing``): each module once, nothing up a layer."""
    from call_tracing import trace_load

    make_demo_pipeline("tiny", seed=0).save_pretrained(tmp_path / "pipe")
    path = trace_load(tmp_path / "pipe", mode, device="cpu")
    modules = [module for module, _ in path.stops]
    assert modules[0] == "memmode_core.loading.load" and "memmode_core.applying" in modules
    assert path.entered_again == {}, path.stops
    assert not path.calls_up, dict(path.calls_up)


@pytest.mark.parametrize("mode", DEFAULT_MODES)
def test_the_request_enters_each_module_once_and_nothing_calls_up(mode):
    path = trace_apply(make_demo_pipeline("tiny", seed=0), mode, device="cpu")
    modules = [module for module, _ in path.stops]
    assert modules[0] == "memmode_core.applying" and "memmode_core.handle" in modules
    assert path.entered_again == {}, path.stops
    assert not path.calls_up, dict(path.calls_up)


def test_planning_calls_no_resolver():
    """``auto``'s resolution is the resolver's own (``PricingResolver.resolve``, called by ``prepare``): the
    planning layer prices candidates and never calls into ``builtin.auto``."""
    path = trace_apply(make_demo_pipeline("tiny", seed=0), "auto", device="cpu")
    from_planning = {callee for caller, callee, _ in path.plugin_calls if caller.startswith("memmode_core.planning")}
    assert "memmode_core.builtin.auto" not in from_planning
    assert ("memmode_core.builtin.auto", "PricingResolver.resolve") in path.stops


def test_a_rebuild_and_a_refused_fuse_call_nothing_above_the_engine():
    """After ``apply``, the engine lays a changed component out again with its own ``Relayout`` (once it called
    back into planning for that), and refuses fusing into packed weights with quantization's check (once a
    function of ``applying`` handed down)."""
    import torch
    from torch import nn

    import memmode_core as memmode
    from call_tracing import trace
    from memmode_core.cli.demo_pipeline import demo_call

    pipe = make_demo_pipeline("tiny", seed=0)
    handle = memmode.apply(pipe, "model_group_offload_and_qfloat8", device="cpu", offload_type="leaf_level")
    block = pipe.transformer.blocks[0]
    old = block.ffn.net[2]
    block.ffn.net[2] = nn.Linear(old.in_features, old.out_features, dtype=old.bias.dtype)  # a replaced layer
    path, output = trace(demo_call, pipe, steps=1)
    assert torch.isfinite(output).all() and not path.calls_up, dict(path.calls_up)
    relaid = ("memmode_core.engine.placement_layout", "memmode_core.builtin.placements", "ModelGroupOffload.layout")
    assert relaid in path.plugin_calls, "the component was not laid out again"
    with pytest.raises(memmode.IncompatibleModeError, match="fuse_qkv_projections") as refused:
        trace(pipe.transformer.fuse_qkv_projections)
    assert not refused.value.call_path.calls_up, dict(refused.value.call_path.calls_up)
    handle.remove()


#: where each argument of ``apply`` goes first: to ``prepare``, which hands it by name to the request's builder
APPLY_TRAIL = [
    "memmode_core.applying.apply",
    "memmode_core.applying.prepare",
    "memmode_core.planning.request.Request.build",
]
LOAD_TRAIL = ["memmode_core.loading.load.load", "memmode_core.planning.request.Request.build"]


def _followed(tmp_path) -> dict:
    """One object per argument of the request, made here so that it is told apart from any other (but for the
    singletons, ``False`` and a dtype, followed by name and value)."""
    import torch

    return {
        "device": torch.device("cpu"),
        "weight_dtype": torch.float32,
        "storage": "".join("disk"),
        "offload_dir": str(tmp_path / "offload"),
        "components": ["transformer"],
        "exclude": ["".join("norm")],
        "unplaced": ["vae"],
        "strict": False,
    }


def test_each_argument_of_apply_is_followed_by_name_into_the_request(tmp_path):
    """A reader (or a tool) following ``device`` or ``storage`` from ``apply`` finds it under the same name in
    ``prepare`` and in ``Request.build``: no ``locals()`` bag on the way (``tests/test_structure.py`` refuses one
    anywhere in memmode_core)."""
    import memmode_core as memmode
    from call_tracing import follow_arguments

    pipe = make_demo_pipeline("tiny", seed=0)
    followed = _followed(tmp_path)
    trails, handle = follow_arguments(memmode.apply, pipe, "model_group_offload_and_qfloat8", followed=followed)
    for name, trail in trails.items():
        assert trail[: len(APPLY_TRAIL)] == APPLY_TRAIL, (name, trail)
    handle.remove()


def test_each_argument_of_load_is_followed_by_name_into_the_request(tmp_path):
    import memmode_core as memmode
    from call_tracing import follow_arguments

    folder = tmp_path / "pipe"
    make_demo_pipeline("tiny", seed=0).save_pretrained(folder)
    trails, handle = follow_arguments(
        memmode.load, folder, "model_group_offload_and_qfloat8", followed=_followed(tmp_path)
    )
    for name, trail in trails.items():
        assert trail[: len(LOAD_TRAIL)] == LOAD_TRAIL, (name, trail)
    handle.remove()


def test_load_makes_every_packed_layer_running_before_it_hands_the_plan_to_applying(tmp_path):
    """``load`` of a folder saved quantized, into a mode without a quantizer: the saved layers are made packed and
    running where they are made (``quantization.making``), before the plan exists; once ``applying`` has the
    request, nothing returns into ``load`` to install a forward (it did: a loop in ``load`` after ``prepare``)."""
    import sys

    import memmode_core as memmode

    pipe = make_demo_pipeline("tiny", seed=0)
    memmode.apply(pipe, "model_full_load_and_qfloat8", device="cpu").save(tmp_path / "saved")
    events: list[tuple[str, str, str]] = []  # (event, callee module, callee function), for the two that matter

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name in ("install_forward", "prepare_request"):
            caller = frame.f_back.f_globals.get("__name__", "")
            events.append((frame.f_code.co_name, frame.f_globals.get("__name__", ""), caller))

    sys.setprofile(profile)
    try:
        handle = memmode.load(tmp_path / "saved", "model_group_offload", device="cpu")
    finally:
        sys.setprofile(None)
    names = [name for name, _, _ in events]
    assert "install_forward" in names and names.count("prepare_request") == 1, events
    assert "install_forward" not in names[names.index("prepare_request") :], events
    assert {caller for name, _, caller in events if name == "install_forward"} == {"memmode_core.quantization.making"}
    assert memmode.quantization.packed_record(handle.target.transformer.blocks[0].attn1.to_q) is not None
    handle.remove()
