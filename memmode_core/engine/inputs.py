"""Moving call arguments to the compute device, only where needed, without copying containers.

Some models pass a mutable cache through their submodules and fill it in place (the Wan VAE's
``feat_cache`` list). Copying such a container on the way in — which is what a generic
``send_to_device`` does — silently breaks the cache. Here, a container is never rebuilt: lists and
dicts whose tensors must move are updated in place (so they keep their identity), tuples are
rebuilt only when something in them actually moved, and everything else is passed through.
"""

from __future__ import annotations

from typing import Any

import torch


def _needs_move(value: Any, device: torch.device, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device != device and value.device.type != "meta"
    if depth > 4:
        return False
    if isinstance(value, (list, tuple)):
        return any(_needs_move(v, device, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_needs_move(v, device, depth + 1) for v in value.values())
    return False


def _move(value: Any, device: torch.device, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device != device and value.device.type != "meta":
            return value.to(device)
        return value
    if depth > 4:
        return value
    if isinstance(value, list):
        for i, v in enumerate(value):
            moved = _move(v, device, depth + 1)
            if moved is not v:
                value[i] = moved
        return value
    if isinstance(value, dict):
        for k, v in value.items():
            moved = _move(v, device, depth + 1)
            if moved is not v:
                value[k] = moved
        return value
    if isinstance(value, tuple):
        items = [_move(v, device, depth + 1) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


@torch.compiler.disable
def move_inputs(args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` with tensors on ``device``, or None when nothing needs to move (the fast path)."""
    if not _needs_move(args, device) and not _needs_move(kwargs, device):
        return None
    return _move(args, device), _move(kwargs, device)
