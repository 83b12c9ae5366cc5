"""Weights that change under a mode: detected replacements, refresh(), torch.compile after apply.

The edits and ``refresh()`` run on Flux under every offloading placement with ``poison``; torch.compile
after apply runs on Wan 2.2 (``COMPILE_FAMILY``) under ``model_full_load`` and every offloading placement,
and with AOTAutograd under block-level group offload.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memmode_core as memmode
from helpers import OFFLOADING_PLACEMENTS, assert_same_outputs, hook_count, placement_id
from tiny_pipelines import make_pipeline, run

FAMILY = "flux"

pytestmark = pytest.mark.usefixtures("poison_storage")


_EDITED: dict = {}


def _edited(edit) -> torch.Tensor:
    """The output of a full-load pipeline after ``edit(pipe)`` (computed once per edit)."""
    if edit not in _EDITED:
        pipe = make_pipeline(FAMILY)
        run(pipe, FAMILY)
        edit(pipe)
        _EDITED[edit] = run(pipe, FAMILY, 1)
    return _EDITED[edit]


# The edits make new values rather than read the offloaded ones: at rest, the poison storage (like the
# disk storage) leaves placeholders in parameters, not their values.


def _replace_parameter(pipe):
    layer = pipe.transformer.proj_out
    layer.weight = nn.Parameter(torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(3)))


def _replace_data(pipe):
    layer = pipe.transformer.transformer_blocks[0].attn.to_q
    layer.weight.data = torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(4))


def _add_module(pipe):
    block = pipe.transformer.single_transformer_blocks[1]
    torch.manual_seed(7)
    extra = nn.Linear(block.proj_out.out_features, block.proj_out.out_features)
    block.proj_out = nn.Sequential(block.proj_out, extra)


@pytest.mark.parametrize("edit", [_replace_parameter, _replace_data, _add_module])
@pytest.mark.parametrize("mode, options", OFFLOADING_PLACEMENTS, ids=[placement_id(p) for p in OFFLOADING_PLACEMENTS])
def test_changes_are_noticed_without_refresh(mode, options, edit):
    """Replaced parameters, replaced data and new submodules are rebuilt before the next call."""
    pipe = make_pipeline(FAMILY)
    handle = memmode.apply(pipe, mode, device="cpu", storage="poison", **options)
    run(pipe, FAMILY)
    edit(pipe)
    assert_same_outputs((run(pipe, FAMILY, 1),), (_edited(edit),))
    assert handle.report().peak_device_bytes > 0
    handle.remove()
    assert hook_count(pipe) == 0
    assert_same_outputs((run(pipe, FAMILY, 1),), (_edited(edit),))


def test_in_place_edits_of_a_resident_copy_need_refresh():
    """An in-place write into a weight's memory cannot be seen; refresh() takes it."""

    def scale(pipe):
        with torch.no_grad():
            pipe.transformer.proj_out.weight.data.mul_(3)

    pipe = make_pipeline(FAMILY)
    handle = memmode.apply(pipe, "model_cpu_offload", device="cpu", storage="poison")
    pipe.transformer(**_transformer_inputs(pipe))  # leaves the transformer resident (its device copy)
    scale(pipe)  # edits the resident copy only
    handle.refresh()
    assert_same_outputs((run(pipe, FAMILY, 1),), (_scaled_reference(scale),))


def _scaled_reference(edit):
    pipe = make_pipeline(FAMILY)
    edit(pipe)
    return run(pipe, FAMILY, 1)


def _transformer_inputs(pipe):
    config = pipe.transformer.config
    return dict(
        hidden_states=torch.randn(1, 16, config.in_channels),
        encoder_hidden_states=torch.randn(1, 8, 32),
        pooled_projections=torch.randn(1, 32),
        timestep=torch.tensor([0.5]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(8, 3),
        guidance=torch.tensor([3.5]),
    )


def test_refresh_keeps_outputs_and_storage_consistent():
    pipe = make_pipeline(FAMILY)
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="poison")
    before = run(pipe, FAMILY, 1)
    handle.refresh()
    torch.testing.assert_close(run(pipe, FAMILY, 1), before, rtol=0, atol=0)


# -- torch.compile after apply ----------------------------------------------------------------------------


COMPILED = [("model_full_load", {}), *OFFLOADING_PLACEMENTS]

#: Tracing is what these tests spend their time on, and it grows with the graph breaks the hooks make: Wan
#: 2.2's transformer traces in about two thirds of Flux's time (17 graphs under the leaf-level placements
#: against 29).  It brings what matters here too: the compiled expert is offloaded and onloaded around the
#: other expert's steps, and the sequential placement keeps its modulation tables resident.
COMPILE_FAMILY = "wan22"
_CALLS: list[torch.Tensor] = []


def _five_calls() -> list[torch.Tensor]:
    """Calls with seeds 0 to 4 of a fresh pipeline without memmode (computed once)."""
    if not _CALLS:
        reference = make_pipeline(COMPILE_FAMILY)
        _CALLS.extend(run(reference, COMPILE_FAMILY, seed) for seed in range(5))
    return _CALLS


@pytest.fixture
def unprofiled_guards(monkeypatch):
    """Dynamo times every guard set it builds (a cache flush and an evaluation, about 30 ms each, for a
    debug log line and a metric): a quarter of these tests' tracing.  Nothing it measures is checked."""
    import torch._dynamo.guards

    monkeypatch.setattr(torch._dynamo.guards, "profile_guard_manager", lambda *args: 0.0, raising=False)


@pytest.mark.parametrize("mode, options", COMPILED, ids=[placement_id(p) for p in COMPILED])
def test_compile_after_apply_gives_the_same_output_without_recompiling(mode, options, unprofiled_guards):
    import torch._dynamo
    from torch._dynamo.utils import counters

    expected = _five_calls()
    pipe = make_pipeline(COMPILE_FAMILY)
    handle = memmode.apply(
        pipe, mode, device="cpu", **({"storage": "poison"} if mode != "model_full_load" else {}), **options
    )
    torch._dynamo.reset()
    counters.clear()
    pipe.transformer = torch.compile(pipe.transformer, backend="eager")
    graphs = []
    for seed in range(5):
        assert_same_outputs((run(pipe, COMPILE_FAMILY, seed),), (expected[seed],))
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1
    assert graphs[-1] == graphs[0], f"recompiled after the first call: graphs per call {graphs}"
    pipe.transformer = pipe.transformer._orig_mod
    handle.remove()


def test_compile_with_aot_autograd_after_group_offload(unprofiled_guards):
    """AOTAutograd functionalizes the graph: the swapped weights must still be read at call time."""
    import torch._dynamo

    expected = tuple(_five_calls()[:2])
    pipe = make_pipeline(COMPILE_FAMILY)
    memmode.apply(pipe, "model_group_offload", device="cpu", storage="poison")
    torch._dynamo.reset()
    pipe.transformer = torch.compile(pipe.transformer, backend="aot_eager")
    assert_same_outputs((run(pipe, COMPILE_FAMILY, 0), run(pipe, COMPILE_FAMILY, 1)), expected)
