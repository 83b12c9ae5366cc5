"""Sizes of packed tensors, and the check that a plugin's ``pack`` keeps to them.

The planner predicts what a quantized model weighs before anything is quantized, and a storage reserves room
on that prediction. Both come from running the quantizer's own ``pack`` on meta tensors (:class:`PackedSizes`),
and every real ``pack`` result is checked against that prediction (:func:`pack_checked`): a plugin whose
packed shapes depended on the data would otherwise make the planner and the storages wrong without anyone
noticing. The same check enforces the rest of the ``pack`` contract (names, plain integer payload).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from memmode_core.contracts.quantizer import PAYLOAD, Quantizer

_BUFFER_NAME = re.compile(r"^weight_[A-Za-z0-9_]+$")


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def direct_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s own parameters and buffers (not its children's), by attribute name."""
    for name, t in module._parameters.items():
        if t is not None:
            yield name, t
    for name, t in module._buffers.items():
        if t is not None:
            yield name, t


def direct_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s own parameters and buffers (not its children's)."""
    return tensor_bytes(t for _, t in direct_tensors(module))


def component_bytes(component: nn.Module) -> int:
    """Bytes of the component's tensors, each counted once (a tied weight is stored once)."""
    unique = {id(t): t for m in component.modules() for _, t in direct_tensors(m)}
    return tensor_bytes(unique.values())


def _validate_packed(quantizer: Quantizer, packed: Any) -> None:
    """A plugin's ``pack`` result must follow the contract; a violation is a bug in the plugin."""
    where = f"{type(quantizer).__name__}.pack ({quantizer.name})"
    if not isinstance(packed, dict) or PAYLOAD not in packed:
        raise TypeError(f"{where} must return a dict with a {PAYLOAD!r} entry")
    for name, t in packed.items():
        if not isinstance(name, str) or (name != PAYLOAD and not _BUFFER_NAME.match(name)):
            raise TypeError(f"{where}: packed tensor name {name!r} must be {PAYLOAD!r} or start with 'weight_'")
        if type(t) is not torch.Tensor:
            raise TypeError(f"{where}: {name!r} must be a plain torch.Tensor, not {type(t).__name__}")
    payload = packed[PAYLOAD]
    if payload.dtype.is_floating_point or payload.dtype.is_complex or payload.dtype == torch.bool:
        raise TypeError(
            f"{where}: the {PAYLOAD!r} payload must have an integer dtype, not {payload.dtype} "
            f"(store float8 bits as uint8)"
        )


class PackedSizes:
    """Shapes and dtypes of a quantizer's packed tensors, learned by running its ``pack`` on meta
    tensors (cached per weight shape and dtype). The real path checks every ``pack`` result against
    them, so a prediction cannot differ from what quantizing stores."""

    def __init__(self, quantizer: Quantizer) -> None:
        self.quantizer = quantizer
        self._cache: dict[tuple[torch.Size, torch.dtype], dict[str, tuple[torch.Size, torch.dtype]]] = {}

    def specs(self, shape: torch.Size, dtype: torch.dtype) -> dict[str, tuple[torch.Size, torch.dtype]]:
        key = (torch.Size(shape), dtype)
        if key not in self._cache:
            with torch.no_grad():
                packed = self.quantizer.pack(torch.empty(key[0], dtype=dtype, device="meta"))
            _validate_packed(self.quantizer, packed)
            self._cache[key] = {name: (t.shape, t.dtype) for name, t in packed.items()}
        return self._cache[key]

    def nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        return sum(s.numel() * d.itemsize for s, d in self.specs(shape, dtype).values())


def pack_checked(quantizer: Quantizer, sizes: PackedSizes, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``quantizer.pack(weight)``, refused unless it follows the contract and matches ``sizes``' prediction
    (same names, shapes and dtypes as on the meta device) and stays on the weight's device."""
    expected = sizes.specs(weight.shape, weight.dtype)
    with torch.no_grad():
        packed = quantizer.pack(weight.detach())
    _validate_packed(quantizer, packed)
    got = {name: (t.shape, t.dtype) for name, t in packed.items()}
    if got != expected:
        raise RuntimeError(
            f"{type(quantizer).__name__}.pack returned {got} for a {tuple(weight.shape)} {weight.dtype} weight but "
            f"{expected} on the meta device: shapes and dtypes must not depend on the data"
        )
    moved = [name for name, t in packed.items() if t.device != weight.device]
    if moved:
        raise RuntimeError(f"{type(quantizer).__name__}.pack put {moved[0]!r} on another device than the weight")
    return dict(packed)
