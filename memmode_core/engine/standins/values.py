"""A stand-in's value as a plain tensor, for code that needs it outside a torch function, and the typed errors
when it has none or a write cannot go through.

Most reads reach a value through the dispatch (:mod:`~memmode_core.engine.standins.dispatch`). Some need it
directly: the engine writing a value through (:mod:`~memmode_core.engine.standins.slots`), a quantized weight
dequantized from its packed tensors (:mod:`~memmode_core.engine.standins.quantized`), a stand-in registered as a
parameter (:func:`registered_value`), and **pickling and copying** (``torch.save``, ``copy.deepcopy``), which
hold the value as a plain tensor or parameter, so nothing memmode-specific is ever written to disk.

A stand-in with no value (its placement or layer is gone) is a typed error (:func:`gone`), and so is a write
that cannot go through (:func:`refusal`: the source's own error when it has one, a quantized weight's).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from memmode_core.contracts.errors import OffloadedWeightReadError, OffloadedWeightWriteError
from memmode_core.engine.flattened import map_leaves
from memmode_core.engine.standins.classes import PLAIN_CLASS, ServedView, StandIn, StandInReader, is_stand_in, source_of

_DISABLE = torch._C.DisableTorchFunctionSubclass


def value_of(tensor: torch.Tensor, operation: str = "value", *, counted: bool = True) -> torch.Tensor:
    """The real value of ``tensor`` as a plain tensor: itself if it is not a stand-in. ``counted=False`` for a read
    memmode makes on behalf of another one that is counted (the packed tensors of a dequantized weight)."""
    if not is_stand_in(tensor):
        return tensor
    if isinstance(tensor, ServedView):
        with _DISABLE():
            return tensor.as_subclass(torch.Tensor)
    source = source_of(tensor)
    if source is None:
        raise gone(tensor)
    reader = StandInReader(operation, sys._getframe(1), counted=counted)
    usable = source.usable(reader)
    if usable is not None:
        with _DISABLE():
            return usable.data
    return source.value(reader)


def writable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or — a resting stand-in — the tensor made to hold memory a write may change (see
    :meth:`StandInSource.make_writable`)."""
    if type(tensor) not in PLAIN_CLASS:
        return tensor
    source = source_of(tensor)
    if source is None:
        raise gone(tensor)
    return source.make_writable()


def registered_value(value: object) -> torch.Tensor | None:
    """What is registered in place of ``value`` when code registers a stand-in as a parameter or buffer
    (``nn.Parameter(layer.weight)``, ``module.x = nn.Parameter(self.x.to(device))``): a plain one holding a copy
    of its value, in memory of its own. None for anything else (registered as it is)."""
    if not isinstance(value, (StandIn, ServedView)):
        return None
    copied = map_leaves(value_of(value, "register").detach(), torch.clone)
    with _DISABLE():
        if isinstance(value, nn.Parameter):
            return nn.Parameter(copied, requires_grad=value.requires_grad)
        return copied


def plain_reduction(tensor: torch.Tensor, protocol):
    """Pickled as the plain tensor (or parameter) of its value: ``torch.save`` never writes a memmode class."""
    value = value_of(tensor, "__reduce_ex__")
    with _DISABLE():
        if isinstance(tensor, nn.Parameter):
            plain = nn.Parameter(value.detach(), requires_grad=tensor.requires_grad)
            return plain.__reduce_ex__(protocol)
        return value.detach().__reduce_ex__(protocol)


def plain_copy(tensor: torch.Tensor, memo):
    """``copy.deepcopy``: a plain tensor (or parameter) holding a copy of the value."""
    if id(tensor) in memo:
        return memo[id(tensor)]
    value = value_of(tensor, "__deepcopy__")
    with _DISABLE():
        copied = map_leaves(value.detach(), torch.clone)  # a library's quantized tensor: its class, its inner copies
        result = (
            nn.Parameter(copied, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else copied
        )
    memo[id(tensor)] = result
    return result


def _describe(target: torch.Tensor) -> str:
    source = source_of(target)
    return f"{source.name} ({source.what})" if source is not None else "a stand-in"


def refusal(name: str, target: torch.Tensor, why: str) -> Exception:
    source = source_of(target)
    refuse = getattr(source, "refusal", None)
    if refuse is not None:
        return refuse(name, why)
    return OffloadedWeightWriteError(
        f"{name or 'write'}: cannot write into {_describe(target)}: {why}. Nothing was changed."
    )


def gone(tensor: torch.Tensor) -> Exception:
    shape = tuple(tensor.shape)
    return OffloadedWeightReadError(
        f"a {shape} tensor stood in for a weight whose placement or layer is gone (removed without its stored "
        f"copy, or the model was dropped), so its value cannot be read"
    )
