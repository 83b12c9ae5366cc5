"""Call arguments move to the compute device only where needed, and containers keep their identity."""

from __future__ import annotations

from collections import namedtuple

import torch

from memmode_core.engine.inputs import move_inputs

# The CPU is the only real device here; "meta" stands in for "another device".
ELSEWHERE = torch.device("meta")


def test_nothing_to_move_is_the_fast_path():
    args = (torch.ones(2, device="meta"), 3, "text")
    assert move_inputs(args, {"scale": 1.0, "x": torch.ones(1, device="meta")}, ELSEWHERE) is None


def test_tensors_move_and_a_mutable_cache_keeps_its_identity():
    cache = [None, torch.ones(2), [torch.zeros(1)]]
    index = [0]
    x = torch.ones(3)
    (new_args, new_kwargs) = move_inputs((x,), {"feat_cache": cache, "feat_idx": index}, ELSEWHERE)
    assert new_args[0].device == ELSEWHERE
    assert new_kwargs["feat_cache"] is cache and new_kwargs["feat_idx"] is index
    assert cache[1].device == ELSEWHERE and cache[2][0].device == ELSEWHERE  # moved in place
    cache.append("filled later by the model")  # the model's in-place writes stay visible to the caller
    assert new_kwargs["feat_cache"][-1] == "filled later by the model"


def test_tuples_are_rebuilt_only_when_something_moved():
    Pair = namedtuple("Pair", "a b")
    still = (torch.ones(1, device="meta"), 2)
    moved = Pair(torch.ones(1), 2)
    args, kwargs = move_inputs((still, moved), {}, ELSEWHERE)
    assert args[0] is still
    assert isinstance(args[1], Pair) and args[1].a.device == ELSEWHERE and args[1].b == 2


def test_other_objects_pass_through_untouched():
    class Cache:
        def __init__(self):
            self.tensor = torch.ones(1)

    cache = Cache()
    args, kwargs = move_inputs((torch.ones(1),), {"cache": cache}, ELSEWHERE)
    assert kwargs["cache"] is cache and cache.tensor.device.type == "cpu"
