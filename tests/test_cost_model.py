"""The cost model with compute in it (``memmode_core.planning.timing``): a copy is hidden exactly as far as the
compute it overlaps covers it — no fixed share.

The layouts are those ``prepare`` gives a 12-block Wan transformer; the copy and compute seconds per group are
set here so that each expectation follows from the engine's issue order by hand.
"""

from __future__ import annotations

import pytest
import torch

import memmode_core as memmode
from memmode_core.contracts.group_specs import Policy
from memmode_core.contracts.storage_cost import StorageCost
from memmode_core.planning.residency import fit, spread
from memmode_core.planning.timing import exposed_seconds, group_flops
from memmode_core.planning.trace import trace_call
from tiny_components import deep_wan_inputs, deep_wan_transformer

BANDWIDTH = 1e6  # bytes/s: a block's copy takes its bytes in microseconds


def layout(model, **options):
    prepared = memmode.prepare(model, "model_group_offload", device="cpu", storage="ram", **options)
    blocks = [g for g in prepared.internal.groups if "/blocks." in g.key]
    rest = [g for g in prepared.internal.groups if "/blocks." not in g.key]
    return prepared, blocks, rest


def waited(prepared, compute, *, prefetch=True, lookahead=None) -> float:
    return exposed_seconds(
        prepared.internal.groups,
        prepared.internal.group_bytes,
        set(),
        ["module"],
        prepared.internal.target.components,
        prefetch=prefetch,
        lookahead=lookahead or {},
        compute=compute,
        cost=StorageCost("pinned", fetch_bytes_per_second=BANDWIDTH),
    )


def copy_seconds(prepared, group) -> float:
    return prepared.internal.group_bytes[group.key] / BANDWIDTH


def test_compute_longer_than_each_copy_hides_every_prefetched_copy():
    prepared, blocks, rest = layout(deep_wan_transformer())
    block_copy = copy_seconds(prepared, blocks[0])
    compute = {g.key: 2 * block_copy for g in blocks}
    unhidden = sum(copy_seconds(prepared, g) for g in rest) + block_copy  # the rest group, and the first prefetch
    assert waited(prepared, compute) == pytest.approx(unhidden)
    assert waited(prepared, {}) == pytest.approx(sum(copy_seconds(prepared, g) for g in prepared.internal.groups))
    assert waited(prepared, compute, prefetch=False) == pytest.approx(waited(prepared, {}))


def test_compute_shorter_than_each_copy_leaves_the_difference():
    prepared, blocks, rest = layout(deep_wan_transformer())
    block_copy = copy_seconds(prepared, blocks[0])
    compute = {g.key: block_copy / 4 for g in blocks}
    expected = sum(copy_seconds(prepared, g) for g in rest) + block_copy + (len(blocks) - 1) * block_copy * 3 / 4
    assert waited(prepared, compute) == pytest.approx(expected)


def test_spreading_the_streamed_blocks_hides_more_than_keeping_the_first_ones():
    """Half the blocks kept, a block's copy twice its compute: spread, each copy overlaps a kept block's compute
    and the streamed one before it; kept first, the streamed blocks overlap only each other."""
    model = deep_wan_transformer()
    budget = int(0.6 * sum(p.numel() * p.element_size() for p in model.parameters()))
    prepared, blocks, _ = layout(model, vram_budget=budget)
    streamed = [i for i, g in enumerate(blocks) if g.policy is Policy.STREAM]
    assert streamed == spread(len(blocks), len(streamed))
    compute = {g.key: copy_seconds(prepared, blocks[0]) / 2 for g in blocks}
    spread_wait = waited(prepared, compute)
    for i, g in enumerate(blocks):  # the same number kept, the first ones
        keep = i < len(blocks) - len(streamed)
        g.policy = Policy.EXCLUSIVE if keep else Policy.STREAM
    first_wait = waited(prepared, compute)
    assert spread_wait < first_wait


def test_the_flops_of_a_call_are_spread_over_the_groups_that_compute_them():
    model = deep_wan_transformer(layers=4)
    prepared, blocks, rest = layout(model)
    traces = trace_call(model, lambda: model(**deep_wan_inputs()))
    flops = group_flops(prepared.internal.groups, prepared.internal.target.components, traces)
    assert sum(flops.values()) == traces["module"].flops[""], "every FLOP lands in one group"
    assert len({flops[g.key] for g in blocks}) == 1 and flops[blocks[0].key] > flops[rest[0].key] > 0


def test_plan_with_shapes_prices_with_compute():
    from tiny_pipelines import make_pipeline

    pipe = make_pipeline("wan22")
    shaped = memmode.plan(pipe, device="cpu", height=32, width=32, num_frames=5)
    entries = {(e.label(), e.storage): e for e in shaped}
    block = entries[("model_group_offload[offload_type=block_level]", "disk")]
    leaf = entries[("model_group_offload[offload_type=leaf_level]", "disk")]
    assert 0 < block.seconds_per_call < leaf.seconds_per_call, "more onloads, more latency and less to overlap"


def test_attention_on_the_cpu_is_counted():
    """A call traced on host tensors reaches the CPU's flash-attention kernel, which PyTorch's counter has no
    formula for: without one, a long sequence's compute was counted at half (its attention missing)."""
    import torch
    from torch.utils.flop_counter import sdpa_flop_count

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64)

        def forward(self, x):
            q = self.proj(x).view(1, 256, 4, 16).transpose(1, 2)
            return torch.nn.functional.scaled_dot_product_attention(q, q, q)

    model = Attention()
    (trace,) = trace_call(model, lambda: model(torch.randn(1, 256, 64))).values()
    shape = (1, 4, 256, 16)
    assert trace.flops[""] == 2 * 256 * 64 * 64 + sdpa_flop_count(shape, shape, shape)


class _Block(torch.nn.Module):
    """One linear layer applied ``repeat`` times: the same bytes, ``repeat`` times the compute."""

    def __init__(self, repeat: int):
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)
        self.repeat = repeat

    def forward(self, x):
        for _ in range(self.repeat):
            x = self.linear(x)
        return x


class _Uneven(torch.nn.Module):
    """Four heavy blocks then four light ones (Flux's double blocks before its single ones, in miniature)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(4) for _ in range(4)] + [_Block(1) for _ in range(4)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_uneven_blocks_are_streamed_where_their_copies_are_hidden_best():
    """Three of eight blocks stream. Even in count they would be the 3rd, 5th and 8th, and the last copy would
    overlap three light blocks; chosen by compute (what the planner's trace gives) the smallest compute any copy
    overlaps is as large as it can be — and the call waits less."""
    model = _Uneven()
    traces = trace_call(model, lambda: model(torch.randn(16, 64)))
    prepared, blocks, _ = layout(model)
    flops = group_flops(prepared.internal.groups, prepared.internal.target.components, traces)
    block_bytes = prepared.internal.group_bytes[blocks[0].key]
    rest = sum(prepared.internal.group_bytes[g.key] for g in prepared.internal.groups) - 8 * block_bytes
    budget = rest + 7 * block_bytes  # five kept, one streamed block computing and one arriving
    light = flops[blocks[-1].key]
    # a light block computes in a fifth of a block's copy, a heavy one in four fifths
    compute = {key: count / light * copy_seconds(prepared, blocks[0]) / 5 for key, count in flops.items()}

    laid_out = {g.key: g.policy for g in prepared.internal.groups}

    def streamed_and_waited(weights):
        for g in prepared.internal.groups:
            g.policy = laid_out[g.key]
        residency = fit(
            prepared.internal.groups,
            prepared.internal.group_bytes,
            prepared.internal.target.components,
            budget,
            prefetch=True,
            compute=weights,
        )
        residency.apply(prepared.internal.groups)
        picked = [i for i, g in enumerate(blocks) if g.policy is Policy.STREAM]
        return picked, waited(prepared, compute, lookahead=residency.lookahead)

    by_count, count_wait = streamed_and_waited(None)
    by_compute, compute_wait = streamed_and_waited(flops)
    assert by_count == [2, 4, 7] and by_compute == [2, 3, 7]
    assert compute_wait < count_wait


def test_spread_by_compute_keeps_the_even_runs_of_uniform_blocks():
    assert spread(12, 4, [1.0] * 12) == spread(12, 4) == [2, 5, 8, 11]
    assert spread(8, 3, [4, 4, 4, 4, 1, 1, 1, 1]) == [2, 3, 7]
    assert spread(6, 0, [1.0] * 6) == [] and spread(4, 4, [1, 2, 3, 4]) == [0, 1, 2, 3]
