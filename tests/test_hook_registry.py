"""Every wrapper memmode installs is a named hook object: listed by ``memmode.hooks_of(obj)`` with a ``repr``
that says what it does, found and removed by name, and gone with the mode. One owner installs and removes them
all: the handle's runtime (the ``_hf_hook`` shim and the guards on the pipeline included); the handle asks it."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

import memmode_core as memmode
from memmode_core import RestoreError, handle
from memmode_core.engine.hooks import MARKER, REGISTRY_ATTRIBUTE, is_wrapped
from memmode_core.engine.pipeline_hooks import ATTRIBUTE, ExecutionDeviceHook
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


def _memmode_left_on(pipe) -> list[str]:
    """Everything of memmode's on ``pipe`` and its components' modules: named hooks (the pipeline's
    ``memmode.call_end`` registration included: the ``__call__`` wrapper on its class is shared by every placed
    instance, and goes with the last of them), wrappers in an instance's ``__dict__``, the ``_hf_hook`` shim."""
    found = []
    objects = [("pipe", pipe)] + [
        (f"{name}.{path}" if path else name, module)
        for name, component in pipe.components.items()
        if isinstance(component, torch.nn.Module)
        for path, module in component.named_modules()
    ]
    for where, obj in objects:
        found += [f"{where}: {hook.name}" for hook in memmode.hooks_of(obj)]
        found += [f"{where}.{k} (wrapper)" for k, v in vars(obj).items() if getattr(v, MARKER, None) is not None]
        if isinstance(getattr(obj, ATTRIBUTE, None), ExecutionDeviceHook):
            found.append(f"{where}.{ATTRIBUTE} (shim)")
        if REGISTRY_ATTRIBUTE in vars(obj):
            found.append(f"{where}.{REGISTRY_ATTRIBUTE}")
    return found


@pytest.mark.parametrize("mode", ["model_cpu_offload_and_qfloat8", "sequential_cpu_offload"])
def test_the_runtime_owns_every_hook_and_remove_leaves_none(mode):
    """Each hook on the pipeline, its class and its components is one the runtime installed and keeps (the forward
    and edit wrappers, the shim, the guards), and ``handle.remove()`` leaves nothing of memmode's behind."""
    pipe = make_pipeline("flux")
    handle = memmode.apply(pipe, mode, device="cpu")
    runtime = handle.runtime
    owned = {id(w) for ws in runtime.forwards.wrappers.values() for w in ws}
    owned |= {id(w) for w in runtime.forwards.edit_wrappers} | {id(g) for g in runtime.pipeline_hooks.guards}
    objects = [pipe, *(m for c in handle.components.values() for m in c.modules())]
    installed = [hook for obj in objects for hook in memmode.hooks_of(obj)]
    assert installed and all(id(hook) in owned for hook in installed), "a hook the runtime does not keep"
    names = {hook.name for hook in installed}
    assert {"memmode.call_end", "memmode.save_guard", "memmode.offloading_guard:enable_model_cpu_offload"} <= names
    assert all(isinstance(getattr(c, ATTRIBUTE), ExecutionDeviceHook) for c in handle.components.values())
    handle.remove()
    assert _memmode_left_on(pipe) == []
    assert not runtime.pipeline_hooks.guards


def test_a_remove_that_cannot_restore_a_group_still_takes_every_hook_off(monkeypatch):
    pipe = make_pipeline("flux")
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="ram")

    def lost(group):
        raise OSError(f"{group.key}: the stored copy is gone")

    monkeypatch.setattr(handle.runtime.changes, "restore", lost)
    with pytest.raises(RestoreError):
        handle.remove()
    assert _memmode_left_on(pipe) == [] and not handle.active


def test_the_handle_installs_no_hook_itself():
    """``Handle.attach``/``remove`` ask the runtime: the handle module reaches no hook machinery of its own."""
    tree = ast.parse(inspect.getsource(handle))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"memmode_core.engine.hooks", "memmode_core.engine.pipeline_hooks"}
    assert not any(isinstance(node, ast.Import) and "pipeline_hooks" in ast.unparse(node) for node in ast.walk(tree))
