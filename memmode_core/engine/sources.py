"""What serves a stand-in, and who reads it.

A :class:`Source` is where a stand-in's value comes from (:mod:`memmode_core.engine.serving`'s slot of a runtime,
:mod:`memmode_core.quantization.standin`'s packed layer); a :class:`Reader` is one read, which finds — only
when asked, by walking the stack — the code that made it (for ``strict`` errors and the log) and the module
whose forward is running (the reader a group is learned for).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Source:
    """Where a stand-in's value comes from: one offloaded slot, or one quantized layer's weight.

    ``name`` is what messages call it (``transformer.blocks.0.attn.out_proj.weight``), ``what`` how it
    is held (``offloaded to disk``, ``quantized (fp8_e4m3 rows)``). A source is alive while what it
    stands in for is; ``value`` and ``write`` raise a typed error once it is not (the layer is gone, the
    placement removed and the stored copy lost).
    """

    name: str = "a tensor"
    what: str = "held elsewhere"

    def value(self, reader: Reader) -> torch.Tensor:
        """The real value, for the read ``reader`` describes (counted, or refused under ``strict``)."""
        raise NotImplementedError

    def usable(self, reader: Reader) -> torch.Tensor | None:
        """A tensor to compute with as it is, or None when the value must be served: a resting tensor whose
        data holds the real values where the reader computes (a host copy read outside any call: nothing
        is counted), or one onloaded into the call that is running (counted)."""
        return None

    def replaced(self) -> None:
        """The resting tensor was given other data from outside (``p.data = x``, ``module.to(dtype)``): it no
        longer rests, and what it holds now is stored at the component's next call."""

    def make_writable(self) -> torch.Tensor:
        """The tensor that stands in, made to hold memory that a write may change in place and that the model
        keeps (for a write memmode carries through: re-quantizing a layer's packed tensors)."""
        raise NotImplementedError

    def write(self, func, name: str, args: tuple, kwargs: dict, target: torch.Tensor) -> Any:
        """Apply the in-place write ``func(*args, **kwargs)`` aimed at ``target`` (a stand-in of this source)
        to what the source stands in for; return what the write returns on a plain tensor."""
        raise NotImplementedError

    def same(self, other: Source) -> bool:
        return other is self


class Reader:
    """Who is reading: the torch function, and — found only when needed, by walking the stack — the code
    that called it (for ``strict`` errors) and the module whose forward is running (the reader a group is
    learned for)."""

    __slots__ = ("operation", "_frame", "counted")

    def __init__(self, operation: str, frame, *, counted: bool = True) -> None:
        self.operation = operation
        self._frame = frame
        #: False for a read memmode makes on behalf of another (a packed tensor read to dequantize a weight,
        #: which is what is counted)
        self.counted = counted

    def code(self) -> str:
        """``path:line in function`` of the first frame outside torch and memmode, or the operation."""
        frame = self._frame
        while frame is not None:
            filename = frame.f_code.co_filename
            if not _is_machinery(filename):
                return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
            frame = frame.f_back
        return self.operation

    def module(self, belongs: Callable[[nn.Module], bool]) -> nn.Module | None:
        """The innermost module whose ``forward`` is running and for which ``belongs`` is true."""
        frame = self._frame
        while frame is not None:
            if frame.f_code.co_name == "forward":
                owner = frame.f_locals.get("self")
                if isinstance(owner, nn.Module) and belongs(owner):
                    return owner
            frame = frame.f_back
        return None


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_MEMMODE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _is_machinery(filename: str) -> bool:
    return filename.startswith((_TORCH_DIR, _MEMMODE_DIR)) or filename.startswith("<")
