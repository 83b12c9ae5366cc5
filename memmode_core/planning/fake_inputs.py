"""What stands in for what while a call is traced on fake tensors (:mod:`memmode_core.planning.trace`).

- A component's floating inputs become fake tensors; its integer and boolean inputs (masks, ids, lengths) stay
  real, and operations on them alone run for real (:class:`RealIndices`), so a forward that reads their values
  can be traced.
- A skeleton's weights (on the meta device, built from config files before loading) stand in as fake host
  tensors for the call (:func:`meta_as_fake`), and its pipeline runs its own code on the host
  (:func:`pipeline_on_host`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

#: where a skeleton's pipeline code and fake weights live while its call is traced
HOST = torch.device("cpu")


def fake_of(mode: FakeTensorMode, value: torch.Tensor) -> torch.Tensor:
    """``value`` as a fake tensor of ``mode``; one on the meta device (a skeleton's) as a fake host tensor."""
    if value.device.type == "meta":
        return mode.fake_tensor_converter.from_meta_and_device(mode, value, HOST)
    return mode.from_tensor(value)


@contextlib.contextmanager
def meta_as_fake(component: nn.Module, mode: FakeTensorMode) -> Iterator[None]:
    """Within the block, the parameters and buffers of ``component`` that are on the meta device (a skeleton
    built from config files, :func:`memmode_core.loading.load.skeleton`) are fake host tensors of ``mode``, so
    they compute with the fake inputs; put back after."""
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for module in component.modules():
            for table in (module._parameters, module._buffers):
                for key, value in table.items():
                    if value is not None and value.device.type == "meta":
                        swapped.append((table, key, value))
                        table[key] = fake_of(mode, value)
        yield
    finally:
        for table, key, value in reversed(swapped):
            table[key] = value


def has_meta(component: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*component.parameters(), *component.buffers()))


@contextlib.contextmanager
def pipeline_on_host(pipe: Any, components: Iterable[nn.Module]) -> Iterator[None]:
    """Within the block, a pipeline whose weights are on the meta device runs its own code (latents,
    schedulers, prompt handling) on the host: its ``device`` and ``_execution_device``, which it reads from its
    components' weights, say the host instead of meta (a dynamic subclass, the original class put back after),
    and the components' buffers that came from the checkpoint (LTX's VAE ``latents_mean``, which the pipeline
    reads itself) are zeros of their shape on the host. Their values do not change a shape; no weight is read."""
    original = type(pipe)
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for component in components:
            for module in component.modules():
                for key, value in module._buffers.items():
                    if value is not None and value.device.type == "meta":
                        swapped.append((module._buffers, key, value))
                        module._buffers[key] = torch.zeros(value.shape, dtype=value.dtype, device=HOST)
        pipe.__class__ = type(
            original.__name__,
            (original,),
            {"device": property(lambda self: HOST), "_execution_device": property(lambda self: HOST)},
        )
        yield
    finally:
        pipe.__class__ = original
        for table, key, value in reversed(swapped):
            table[key] = value


class RealIndices(TorchDispatchMode):
    """Under the fake-tensor mode: an operation whose tensors are all real and none floating (an attention
    mask, token ids, sequence lengths: the component's integer and boolean inputs stay real) runs for real, so
    that a forward which reads their values (``mask.sum().item()`` for Lumina 2's sequence lengths,
    ``mask.nonzero()`` in Mochi) can be traced. Weights and activations are floating and stay fake."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) or t.is_floating_point() for t in tensors):
            with _disable_current_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def fake_input(mode: FakeTensorMode, value: Any) -> Any:
    """A component's input as the fake run takes it: floating tensors fake, integer and boolean ones real
    (see :class:`RealIndices`)."""
    if not isinstance(value, torch.Tensor) or (not value.is_floating_point() and value.device.type != "meta"):
        return value
    return fake_of(mode, value)
