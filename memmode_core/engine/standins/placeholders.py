"""Catching a placeholder that reaches a computation: the rule's safety net, for a tensor that is no stand-in.

A storage that keeps nothing of an offloaded parameter in memory (``disk``) leaves a
:func:`~memmode_core.contracts.storage.placeholder` in it: one NaN broadcast to the weight's shape.
The engine onloads a group before any of its entry points runs, so a model computes with real
weights; a placeholder can still reach a computation when code reads a weight outside every entry
point memmode knows of (a model reading another module's weight directly, a pipeline computing
with a component's parameter itself). What it computes is then NaN, and nothing else would say so.

Two tools catch it:

* :class:`PlaceholderTrap`, a ``TorchFunctionMode`` that raises :class:`OffloadedWeightReadError`
  at the first torch function given a placeholder (its shape, dtype and device may be read: only
  values count), naming the tensor. It costs a Python call per operation, so it is a debugging and
  testing tool (``with memmode_core.placeholder_trap(): pipe(...)``), and what the engine uses to
  explain a non-finite result;
* :func:`non_finite`, which the engine applies to what a component's call returns on a CPU device
  while some of its tensors rest as placeholders: one ``isfinite`` per returned tensor. Only when it
  finds a NaN or an infinity does the engine call the component again under the trap: a placeholder
  read then raises the typed error naming the module and the tensor; a result that is non-finite
  for another reason (a model that overflows) is returned unchanged.

On a CUDA device the same read is a device mismatch (the placeholder lives on the CPU), which the
engine already reports as :class:`OffloadedWeightReadError`.

A parameter or buffer resting on a placeholder is a stand-in, whose reads get the value (see the package
docstring); these tools catch a raw placeholder that reaches a computation all the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from memmode_core.contracts.errors import OffloadedWeightReadError
from memmode_core.contracts.storage import is_known_placeholder
from memmode_core.engine.hooks import not_traced
from memmode_core.engine.standins.classes import is_stand_in
from memmode_core.engine.standins.dispatch import METADATA

#: functions that read a tensor's metadata (shape, dtype, device, strides, address) or allocate a tensor like it,
#: never its values: a placeholder may go through them (the stand-ins' table, and what the trap also lets a raw
#: placeholder do: its property getters and setters, a detached alias, its repr, pickling and copying)
METADATA_FUNCTIONS = METADATA | {
    "__get__",
    "__set__",
    "detach",
    "is_nonzero_metadata",
    "__repr__",
    "__format__",
    "__reduce_ex__",
    "__deepcopy__",
}


class PlaceholderTrap(TorchFunctionMode):
    """Raise :class:`OffloadedWeightReadError` when a torch function is given a placeholder's values.

    ``describe(tensor)`` names a placeholder (``"transformer.pos_embed (group transformer/<root>)"``);
    by default the live placements are asked (:func:`describe_placeholder`).
    """

    def __init__(self, describe: Callable[[torch.Tensor], str | None] | None = None, *, where: str = "") -> None:
        super().__init__()
        self._describe = describe or describe_placeholder
        self._where = where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in METADATA_FUNCTIONS:
            for value in pytree.tree_leaves((args, kwargs)):
                if isinstance(value, torch.Tensor) and not is_stand_in(value) and is_known_placeholder(value):
                    raise self._error(func, value)
        return func(*args, **kwargs)

    def _error(self, func, tensor: torch.Tensor) -> OffloadedWeightReadError:
        name = self._describe(tensor) or f"a {tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')} tensor"
        operation = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        where = f" in {self._where}" if self._where else ""
        return OffloadedWeightReadError(
            f"{operation}{where} computed with the offloaded placeholder of {name}: that weight was read "
            f"outside every entry point memmode onloads it for (the forward, or another method, of the "
            f"component that owns it), so the computation would have used NaN instead of the weight. "
            f"Keep this component whole (model_cpu_offload), leave it out with unplaced=[...], "
            f"or use a storage that keeps real values at rest (ram, pinned, mmap)"
        )


def describe_placeholder(tensor: torch.Tensor) -> str | None:
    """The name of the placed tensor whose at-rest placeholder ``tensor`` is, asking every live runtime."""
    from memmode_core.engine import watch

    for runtime in watch.live_runtimes():
        name = runtime.placeholder_name(tensor)
        if name is not None:
            return name
    return None


def placeholder_trap() -> PlaceholderTrap:
    """``with placeholder_trap(): pipe(...)``: any offloaded placeholder that reaches a computation raises
    :class:`OffloadedWeightReadError` naming it (slow: a Python call per operation; for tests and debugging)."""
    return PlaceholderTrap()


@not_traced
def non_finite(output: Any) -> bool:
    """Whether any floating-point tensor in ``output`` (a tensor, a tuple, a model output, a distribution
    object holding tensors) holds a NaN or an infinity. Never traced: under ``torch.compile`` it ran as a
    traced frame whose graph break (``bool`` of a tensor) made dynamo realize the walked output's attributes
    recursively, past Python's recursion limit (seen once, in a fresh clone's run of the suite)."""
    return any(not bool(torch.isfinite(t).all()) for t in _floating_tensors(output, depth=0))


def _floating_tensors(value: Any, depth: int) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if (value.is_floating_point() or value.is_complex()) and value.numel() and value.device.type != "meta":
            yield value
        return
    if depth > 3 or value is None or isinstance(value, (str, bytes, int, float, bool, torch.nn.Module)):
        return
    if isinstance(value, dict):
        children = list(value.values())
    elif isinstance(value, (list, tuple)):
        children = list(value)
    elif hasattr(value, "__dict__"):
        children = list(vars(value).values())  # e.g. a VAE's DiagonalGaussianDistribution
    else:
        return
    for child in children:
        yield from _floating_tensors(child, depth + 1)
