"""The engine's parts stand alone: each is a plain class that gets the runtime's state and the parts it calls
through its constructor, so one can be built and driven without the others.

``Moving(state)`` onloads and offloads a group of a tiny model with no other part built; ``Serving(state,
moving)`` serves a read of a resting weight (from the storage outside a call, onloaded into a running one)
with no hooks or change detection. And no part is a mixin: none has a base class of memmode's, and none
calls a method of another part through ``self``.

Each thing has one owner: a rebuild and an edit are ``Changes``'s from start to end (the hooks only ask it), the
nesting of calls is ``Moving``'s (the others read it), and the shared state holds only what several parts use.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest
import torch
from torch import nn

import memmode_core as memmode
from fake_plugins import PoisonSession
from memmode_core import StandInReadError, block_groups, is_placeholder
from memmode_core.contracts.group_specs import Policy
from memmode_core.engine import changes, forwards, moving, serving
from memmode_core.engine.changes import Changes
from memmode_core.engine.forwards import Forwards
from memmode_core.engine.groups import Group, Part, bind_groups, claim_groups
from memmode_core.engine.ledger import Ledger
from memmode_core.engine.moving import Moving
from memmode_core.engine.runtime import Runtime
from memmode_core.engine.serving import Serving
from memmode_core.engine.standins.classes import ServedParameter, is_stand_in
from memmode_core.engine.state import EngineState

PARTS = (Moving, Serving, Changes, Forwards)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _resting_state(model: nn.Module) -> EngineState:
    """A state whose streamed groups rest in a storage that keeps placeholders (what ``Runtime.install`` does
    before it hooks anything)."""
    components = {"model": model}
    groups = bind_groups(claim_groups(components, block_groups("model", model)), components)
    state = EngineState(components, groups, torch.device("cpu"), PoisonSession(), Ledger(), storage_name="poison")
    for group in state.groups:
        if group.policy is not Policy.RESIDENT:
            group.parts = [Part(group.key, tuple(s.name for s in group.slots))]
            group.at_rest = state.session.put(group.key, group.tensors(), group.readable)
            group.rest(group.at_rest)
    return state


def _block(state: EngineState, index: int) -> Group:
    return next(g for g in state.groups if g.key == f"model/blocks.{index}")


def test_moving_onloads_and_offloads_a_group_alone():
    model = Tiny()
    weight = model.blocks[0].weight
    expected = weight.detach().clone()
    state = _resting_state(model)
    group = _block(state, 0)
    assert is_placeholder(weight.data), "the weight rests as the storage's placeholder"
    part = Moving(state)
    part.ensure(group)
    assert group.resident and torch.equal(weight.data, expected)
    assert state.ledger.resident == group.nbytes
    part.offload(group)
    assert not group.resident and is_placeholder(weight.data)
    assert state.ledger.resident == 0 and state.ledger.onloads == 1 and state.ledger.offloads == 1


@pytest.mark.parametrize("strict", [False, True])
def test_serving_serves_a_read_of_a_resting_weight_without_hooks(strict):
    model = Tiny()
    weight = model.blocks[1].weight
    expected = weight.detach().clone()
    state = _resting_state(model)
    group = _block(state, 1)
    moving = Moving(state)
    part = Serving(state, moving, strict=strict)
    part.rest_as_stand_ins(group)
    try:
        assert type(weight) is ServedParameter and is_stand_in(weight)
        if strict:
            with pytest.raises(StandInReadError, match="blocks.1.weight"):
                weight.sum()
            return
        assert torch.equal(weight * 1, expected), "outside a call: the value, read from the storage"
        assert state.ledger.reads_served == 1 and not group.resident
        assert moving.enter("model")  # inside a call of the component: the group is onloaded into it
        assert torch.equal(weight * 1, expected) and group.resident
        assert type(weight) is nn.Parameter, "onloaded, it is a plain parameter again"
    finally:
        while moving.depth["model"]:
            moving.leave("model")
        part.wake_all(group)


def test_each_part_gets_what_it_uses_through_its_constructor():
    """The signatures say who depends on whom: moving on nothing but the state, forwards on every other part."""
    needs = {part: [p for p in inspect.signature(part).parameters if p not in ("self",)] for part in PARTS}
    assert needs[Moving][0] == "state" and not {"serving", "changes", "forwards"} & set(needs[Moving])
    assert needs[Serving][:2] == ["state", "moving"]
    assert needs[Changes][:3] == ["state", "moving", "serving"]
    assert needs[Forwards][:4] == ["state", "moving", "serving", "changes"]


def test_no_part_is_a_mixin():
    """No class of the engine's parts (nor the runtime) has a base class of memmode's: each is composed, not
    inherited (``tests/test_structure.py`` holds every class of memmode_core to at most one)."""
    for cls in (*PARTS, Runtime, EngineState):
        ours = [base for base in cls.__bases__ if base.__module__.startswith("memmode_core")]
        assert len(ours) <= 1 and not ours, f"{cls.__name__} has bases of memmode's: {ours}"


def test_no_part_calls_another_parts_method_through_self():
    """A part reaches another through the attribute its constructor set (``self.moving.ensure``), never as
    ``self.ensure``: each module's ``self.<name>`` is a name its own class defines."""
    modules = {Moving: moving, Serving: serving, Changes: changes, Forwards: forwards}
    methods = {part: {name for name, _ in inspect.getmembers(part, inspect.isfunction)} for part in PARTS}
    for part, module in modules.items():
        tree = ast.parse(inspect.getsource(module))
        used = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        }
        others = set().union(*(methods[other] for other in PARTS if other is not part)) - methods[part]
        assert not used & others, f"{part.__name__} calls other parts' methods through self: {used & others}"


class Fusable(Tiny):
    """A model with a weight-editing method (one of ``watch.EDIT_METHODS``, which writes into the weights)."""

    def fuse_qkv_projections(self):
        with torch.no_grad():
            self.blocks[0].weight.mul_(2)


def test_a_rebuild_and_an_edit_have_one_owner(monkeypatch):
    """A changed component is rebuilt, and an edit method runs, through ``Changes`` alone: the hooks ask it
    (handing it the ``Forwards`` whose hooks it takes off and puts back), and ``Forwards`` has no half of either."""
    for half in ("rebuild", "changed", "editing", "rebuild_if_changed"):
        assert not hasattr(Forwards, half), f"Forwards.{half}: a rebuild or an edit has one owner, Changes"
    for half in ("begin_edit", "end_edit", "release", "regroup"):
        assert not hasattr(Changes, half), f"Changes.{half}: a half of a rebuild or an edit, called from outside"
    rebuilds: list[tuple[str, object]] = []
    rebuild = Changes.rebuild

    def counted(self, component, hooks, **kwargs):
        rebuilds.append((component, hooks))
        return rebuild(self, component, hooks, **kwargs)

    monkeypatch.setattr(Changes, "rebuild", counted)
    model, reference = Fusable(), Fusable()
    x = torch.randn(3, 4)
    handle = memmode.apply(model, "model_group_offload", device="cpu", storage="disk")
    runtime, (name,) = handle.runtime, handle.components  # a bare module is one component
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
        assert rebuilds == []
        model.blocks[1].bias = nn.Parameter(torch.zeros(4))  # a change, noticed at the next call
        reference.blocks[1].bias = nn.Parameter(torch.zeros(4))
        assert runtime.state.marked_changed(name)
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
        assert rebuilds == [(name, runtime.forwards)] and not runtime.state.marked_changed(name)
        model.fuse_qkv_projections()  # an edit: offloaded and given real values before, rebuilt after
        reference.fuse_qkv_projections()
        assert rebuilds[1:] == [(name, runtime.forwards)] and runtime.changes.edit_depth == 0
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert len(rebuilds) == 2, "the edit's rebuild left nothing to rebuild at the next call"
    handle.remove()


def test_the_nesting_of_calls_is_movings_and_the_state_holds_only_what_is_shared():
    fields = {f.name for f in dataclasses.fields(EngineState)}
    assert not fields & {"depth", "calls", "dirty", "edit_depth"}, "one part's own state, kept in the shared one"
    state = _resting_state(Tiny())
    moving = Moving(state)
    assert moving.enter("model") and not moving.enter("model") and moving.depth["model"] == 2
    with pytest.raises(TypeError):
        moving.depth["model"] = 0  # the others read it; only Moving writes it
    assert not moving.leave("model") and moving.leave("model") and not moving.in_call()
