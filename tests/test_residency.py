"""Group offload fitted to a device budget: ``vram_budget`` keeps groups on the device while their component
runs and streams only the rest (``memmode_core.planning.residency``).

For budgets of 30%, 60% and 90% of the largest component's weights: the outputs equal full load bit for bit,
the ledger's peak of weight bytes on the device never passes the budget, and the bytes it moves per call are
what the planner predicted for that call. On the CPU directly, and on the accelerator path (prefetch looking
ahead as far as the budget allows) under the strict model of asynchronous copies.
"""

from __future__ import annotations

import pytest
import torch

import memmode_core as memmode
from helpers import ACCELERATOR, assert_bit_equal, nbytes, on_accelerator, snapshot
from memmode_core.contracts.group_specs import Policy
from memmode_core.planning.residency import BudgetTooSmallError, spread
from tiny_components import deep_wan_inputs, deep_wan_transformer
from tiny_loras import load_lora
from tiny_pipelines import full_load_outputs, make_pipeline, run, two_calls

SHARES = (0.3, 0.6, 0.9)
FAMILY = "wan22"


def forward(model, seed: int) -> torch.Tensor:
    with torch.no_grad():
        return model(**deep_wan_inputs(seed))[0]


def group_offload(entries: list[memmode.PlanEntry], offload_type: str = "block_level") -> memmode.PlanEntry:
    """The planner's entry for ``model_group_offload`` at ``offload_type``."""
    (entry,) = [
        e for e in entries if e.placement == "model_group_offload" and e.options["offload_type"] == offload_type
    ]
    return entry


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("offload_type, storage", [("block_level", "ram"), ("leaf_level", "disk")])
def test_the_budget_holds_and_the_planner_predicts_the_moves(offload_type, storage, share):
    model = deep_wan_transformer()
    expected = [forward(model, seed) for seed in (0, 1)]
    budget = int(nbytes(model.parameters()) * share)
    handle = memmode.apply(
        model, "model_group_offload", device="cpu", storage=storage, offload_type=offload_type, vram_budget=budget
    )
    residency = handle.prepared.internal.residency
    assert residency is not None and residency.kept
    assert any(g.policy is Policy.STREAM for g in handle.runtime.groups), "a budget below the model streams"
    for seed, want in enumerate(expected):
        assert_bit_equal(forward(model, seed), want, f"call {seed + 1}")
    handle.reset_stats()
    forward(model, 0)
    report = handle.report()
    assert report.peak_device_bytes <= budget
    handle.remove()
    entries = memmode.plan(model, device="cpu", storage=storage, vram_budget=budget, calls=report.call_sequence)
    entry = group_offload(entries, offload_type)
    assert entry.fits and entry.peak_device_bytes <= budget
    assert report.bytes_transferred == pytest.approx(entry.transfer_bytes_per_call, rel=0.05)
    assert report.peak_device_bytes == pytest.approx(entry.peak_device_bytes, rel=0.05)


def test_a_larger_budget_moves_less():
    moved = []
    for share in (0.0, *SHARES):
        model = deep_wan_transformer()
        options = {"vram_budget": int(nbytes(model.parameters()) * share)} if share else {}
        handle = memmode.apply(model, "model_group_offload", device="cpu", storage="ram", **options)
        forward(model, 0)
        handle.reset_stats()
        forward(model, 1)
        moved.append(handle.report().bytes_transferred)
        handle.remove()
    assert moved[0] > moved[1] > moved[2] > moved[3], moved


def feasible_budget(pipe, shares=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)) -> int:
    """The smallest share of the largest component's weights every component of ``pipe`` fits in."""
    largest = max(nbytes(c.parameters()) for c in memmode.Target.of(pipe).components.values())
    for share in shares:
        try:
            memmode.prepare(pipe, "model_group_offload", device="cpu", storage="ram", vram_budget=int(largest * share))
        except BudgetTooSmallError:
            continue
        return int(largest * share)
    return largest


def test_the_components_of_a_pipeline_share_the_budget_in_turn():
    """Wan 2.2's experts, text encoder and VAE each fit the whole budget while they run: what one keeps goes when
    the next takes the device."""
    pipe = make_pipeline(FAMILY)
    budget = feasible_budget(pipe)
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="ram", vram_budget=budget)
    for got, want in zip(two_calls(pipe, FAMILY), full_load_outputs(FAMILY)):
        assert_bit_equal(got, want)
    assert handle.report().peak_device_bytes <= budget
    handle.reset_stats()
    run(pipe, FAMILY, 1)
    report = handle.report()
    handle.remove()
    entries = memmode.plan(pipe, device="cpu", storage="ram", vram_budget=budget, calls=report.call_sequence)
    entry = group_offload(entries)
    assert report.bytes_transferred == pytest.approx(entry.transfer_bytes_per_call, rel=0.05)
    assert report.peak_device_bytes <= entry.peak_device_bytes <= budget


def test_streamed_groups_are_spread_between_kept_ones():
    assert spread(10, 0) == []
    assert spread(10, 1) == [9]
    assert spread(10, 2) == [4, 9]
    assert spread(9, 3) == [2, 5, 8]
    model = deep_wan_transformer()
    prepared = memmode.prepare(
        model, "model_group_offload", device="cpu", vram_budget=int(nbytes(model.parameters()) * 0.6)
    )
    blocks = [g for g in prepared.groups if "/blocks." in g.key]
    streamed = [i for i, g in enumerate(blocks) if g.policy is Policy.STREAM]
    assert streamed and len(streamed) < len(blocks)
    assert streamed == spread(len(blocks), len(streamed)), "the streamed blocks end even runs of kept ones"
    rest = [g for g in prepared.groups if "/blocks." not in g.key]
    assert rest and all(g.policy is Policy.EXCLUSIVE for g in rest), "what a call holds anyway is kept"


def test_a_budget_too_small_is_refused_before_anything_is_touched():
    pipe = make_pipeline(FAMILY)
    before = snapshot(pipe)
    with pytest.raises(BudgetTooSmallError, match=r"vram_budget=.* too small for component '\w+'.*need at least"):
        memmode.apply(pipe, "model_group_offload", device="cpu", vram_budget=1000)
    assert snapshot(pipe) == before
    entries = [e for e in memmode.plan(pipe, device="cpu", vram_budget=1000) if e.placement == "model_group_offload"]
    assert entries and not any(e.fits for e in entries), "priced as it streams everything, and judged not to fit"


def test_lora_under_a_budget_keeps_its_groups_and_equals_full_load():
    reference = make_pipeline(FAMILY)
    load_lora(reference, FAMILY, "first", seed=1)
    expected = two_calls(reference, FAMILY)
    pipe = make_pipeline(FAMILY)
    budget = feasible_budget(pipe, shares=(0.9,))
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="ram", vram_budget=budget)
    kept = {g.key for g in handle.runtime.groups if g.policy is Policy.EXCLUSIVE}
    load_lora(pipe, FAMILY, "first", seed=1)
    for got, want in zip(two_calls(pipe, FAMILY), expected):
        assert_bit_equal(got, want)
    assert {g.key for g in handle.runtime.groups if g.policy is Policy.EXCLUSIVE} == kept
    handle.remove()


@on_accelerator
@pytest.mark.parametrize("storage", ["pinned", "disk"])
@pytest.mark.parametrize("share", SHARES)
def test_prefetch_looks_ahead_within_the_budget(share, storage, strict_streams):
    model = deep_wan_transformer()
    expected = [forward(model, seed) for seed in (0, 1)]
    budget = int(nbytes(model.parameters()) * share)
    handle = memmode.apply(
        model, "model_group_offload", device=ACCELERATOR, storage=storage, use_stream=True, vram_budget=budget
    )
    residency = handle.prepared.internal.residency
    assert residency.lookahead and all(depth >= 1 for depth in residency.lookahead.values())
    for seed, want in enumerate(expected):
        assert_bit_equal(forward(model, seed), want)
    assert handle.report().peak_device_bytes <= budget
    if strict_streams is not None:
        assert strict_streams.counts["async_copies"] > 0 and strict_streams.counts["waits"] > 0
    handle.remove()


def test_under_a_quantizer_the_budget_counts_packed_bytes():
    """The budget is in the bytes the device holds, packed ones under a quantizer (a fifth of the float32 model
    still keeps groups), and the output equals quantized full load."""
    reference = deep_wan_transformer()
    memmode.apply(reference, "model_full_load_and_qfloat8", device="cpu")
    expected = [forward(reference, seed) for seed in (0, 1)]
    model = deep_wan_transformer()
    budget = int(nbytes(model.parameters()) * 0.2)
    handle = memmode.apply(model, "model_group_offload_and_qfloat8", device="cpu", storage="ram", vram_budget=budget)
    assert handle.prepared.internal.residency.kept
    for seed, want in enumerate(expected):
        assert_bit_equal(forward(model, seed), want)
    assert handle.report().peak_device_bytes <= budget
    handle.remove()
