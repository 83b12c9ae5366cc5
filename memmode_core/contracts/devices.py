"""Which device computes: ``apply(device=...)`` and ``plan(device=...)`` resolve it here, before
anything is touched. An accelerator that is not available in this process is refused now rather
than at the first forward."""

from __future__ import annotations

from typing import Any

import torch

from memmode_core.contracts.errors import InvalidOptionError


def resolve_device(device: Any) -> torch.device:
    """The compute device: ``device`` checked, with the current index filled in for the process's accelerator;
    None means that accelerator (CUDA, ROCm, XPU, ... through ``torch.accelerator``) when there is one, else the CPU."""
    if device is None:
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if accelerator is None:
            return torch.device("cpu")
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidOptionError(f"device={device!r} is not a torch device: {exc}") from None
    if dev.type == "meta":
        raise InvalidOptionError("device='meta' cannot compute anything")
    if dev.type == "cpu":
        return dev
    if not _accelerator_available(dev.type):
        raise InvalidOptionError(
            f"device={device!r}: no {dev.type} device is available in this process (torch.{dev.type} is missing or "
            f"reports none); memmode would fail at the first forward"
        )
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if dev.index is None and accelerator is not None and accelerator.type == dev.type:
        dev = torch.device(dev.type, torch.accelerator.current_device_index())
    return dev


def _accelerator_available(kind: str) -> bool:
    """Whether torch can compute on devices of this type here (``mps``, ``xpu``, ``xla``, ...)."""
    if kind == "mps":
        return bool(torch.backends.mps.is_available())
    backend = getattr(torch, kind, None)
    is_available = getattr(backend, "is_available", None)
    try:
        return bool(is_available()) if callable(is_available) else False
    except Exception:  # noqa: BLE001 - a backend that cannot even answer is not available
        return False
