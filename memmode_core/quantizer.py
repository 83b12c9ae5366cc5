"""The quantizer contract: *how* weights are stored.

A quantizer plugin contributes only what is specific to it — how a weight is packed into plain
tensors and unpacked back. Walking the target, the exclusion filter, swapping a Linear's weight
for the packed tensors and the dequantizing forward are core mechanics
(:mod:`memmode_core.quantization`).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from .options import Option


class Quantizer:
    name: str = ""
    description: str = ""
    options: tuple[Option, ...] = ()

    def unavailable_reason(self) -> str | None:
        """Why this quantizer cannot run in this environment, or None when it can."""
        return None

    def check(self, components: Mapping[str, nn.Module], *, weight_dtype: torch.dtype | None,
              exclude: tuple[str, ...], options: Mapping[str, object]) -> None:
        """Raise ``IncompatibleModeError`` before anything is touched if these components cannot be quantized."""

    def quantize(self, component: nn.Module, *, weight_dtype: torch.dtype | None, exclude: tuple[str, ...],
                 options: Mapping[str, object]) -> "object":
        """Quantize ``component`` in place and return a summary of what was done."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<quantizer {self.name}>"
