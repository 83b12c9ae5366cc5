"""Every wrapper memmode installs is a named hook object: listed by ``memmode.hooks_of(obj)`` with a ``repr``
that says what it does, found and removed by name, and gone with the mode."""

from __future__ import annotations

import pytest
import torch

import memmode_core as memmode
from memmode_core.engine.hooks import is_wrapped
from tiny_pipelines import make_pipeline, run


def test_each_wrapper_is_a_named_hook_that_says_what_it_does():
    pipe = make_pipeline("wan22")
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", offload_type="leaf_level")
    leaf = pipe.transformer.blocks[0].attn1.to_q
    (hook,) = memmode.hooks_of(leaf)
    assert hook.name == "memmode.groups" and hook.active
    assert repr(hook) == (
        "<memmode.groups on transformer.blocks.0.attn1.to_q.forward: onloads transformer/blocks.0.attn1.to_q "
        "before, offloads transformer/blocks.0.attn1.to_q after>"
    )
    root = memmode.hooks_of(pipe.transformer)
    assert "memmode.component_entry" in root and "memmode.weight_edit:load_lora_adapter" in root
    assert "memmode.entry_method:decode" in memmode.hooks_of(pipe.vae).names()
    assert {"memmode.call_end", "memmode.offloading_guard:enable_model_cpu_offload"} <= set(
        memmode.hooks_of(pipe).names()
    )
    assert "rebuilds its groups if its weights changed" in repr(root.get("memmode.component_entry"))
    handle.remove()
    assert not hook.active and "(removed)" in repr(hook)
    for obj in (pipe, pipe.vae, pipe.transformer, leaf):
        assert len(memmode.hooks_of(obj)) == 0 and "_memmode_hooks" not in vars(obj)


def test_a_hook_is_removed_by_name_and_only_that_one():
    pipe = make_pipeline("wan22")
    expected = run(make_pipeline("wan22"), "wan22")
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", offload_type="leaf_level", storage="ram")
    leaf = pipe.transformer.blocks[0].attn1.to_q
    registry = memmode.hooks_of(leaf)
    removed = registry.remove("memmode.groups")
    assert not removed.active and not is_wrapped(leaf) and len(memmode.hooks_of(leaf)) == 0
    assert is_wrapped(pipe.transformer.blocks[0].attn1.to_k)  # its neighbours keep theirs
    with pytest.raises(KeyError, match="no memmode hook named 'memmode.groups'"):
        registry.remove("memmode.groups")
    # on a CPU device the ram storage keeps real weights at rest: the unhooked leaf still computes right
    torch.testing.assert_close(run(pipe, "wan22"), expected, rtol=0, atol=0)
    handle.remove()


def test_rebuilt_hooks_replace_the_old_ones_in_the_registry():
    pipe = make_pipeline("wan22")
    handle = memmode.apply(pipe, "model_group_offload", device="cpu")
    before = memmode.hooks_of(pipe.transformer).get("memmode.component_entry")
    handle.refresh()  # lays every component out again and reinstalls its hooks
    after = memmode.hooks_of(pipe.transformer).get("memmode.component_entry")
    assert after is not before and after.active and not before.active
    assert memmode.hooks_of(pipe.transformer).names().count("memmode.component_entry") == 1
    handle.remove()
