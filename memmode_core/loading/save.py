"""``save_quantized``: a quantized pipeline or model written so that ``load`` streams it back without
quantizing again.

Components holding packed layers are written as their packed tensors with the format recorded in the
file's metadata (:mod:`memmode_core.quantization.saved`), next to their ``config.json``; every other
component is saved by its own ``save_pretrained``, and ``model_index.json`` by the pipeline's
``save_config``. A placed pipeline can be saved as it is: offloaded weights are read back from the
storage, nothing is moved. Files are written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memmode_core.contracts.errors import InvalidOptionError
from memmode_core.contracts.storage import is_placeholder
from memmode_core.contracts.targets import HANDLE_ATTRIBUTE, Target
from memmode_core.files import write_pieces
from memmode_core.quantization import is_quantized, saved


def save_quantized(target: Any, path: str | os.PathLike) -> Path:
    """Write ``target`` (a pipeline or model with quantized components, placed or not) to folder ``path``."""
    whole = Target.of(target)
    folder = Path(path)
    if not any(is_quantized(m) for m in whole.components.values()):
        raise InvalidOptionError(f"{whole.label} holds no quantized layer: save it with save_pretrained()")
    handle = _handle_for(target, whole)
    folder.mkdir(parents=True, exist_ok=True)
    if not whole.is_pipeline:
        _save_module(whole.obj, folder, handle, "module")
        return folder
    target.save_config(folder)
    for name, component in target.components.items():
        if not isinstance(component, nn.Module) and not hasattr(component, "save_pretrained"):
            continue  # None, or nothing to save (a plain attribute)
        sub = folder / name
        if isinstance(component, nn.Module):
            _save_module(component, sub, handle, name)
        else:
            component.save_pretrained(sub)
    return folder


def _handle_for(target, whole: Target):
    """The active memmode handle placing ``target`` or its components (looked up by attribute: ``Handle.save``
    calls this module)."""
    for obj in [target, *whole.components.values()]:
        handle = getattr(obj, HANDLE_ATTRIBUTE, None)
        if handle is not None and getattr(handle, "active", False):
            return handle
    return None


def _save_module(module: nn.Module, folder: Path, handle, name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    real = handle.runtime.real_values(name) if handle is not None and handle.active else {}
    if not is_quantized(module) and not real:
        module.save_pretrained(folder)
        return
    if hasattr(module, "save_config"):
        module.save_config(folder)
        stem = "diffusion_pytorch_model"
    elif hasattr(module, "config") and hasattr(module.config, "save_pretrained"):
        module.config.save_pretrained(folder)
        stem = "model"
    else:
        raise InvalidOptionError(
            f"{type(module).__name__} has no config to save (not a diffusers or transformers model)"
        )
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, sub in module.named_modules():
        dot = prefix + "." if prefix else ""
        for attr, tensor in [
            *sub._parameters.items(),
            *((n, b) for n, b in sub._buffers.items() if n not in sub._non_persistent_buffers_set),
        ]:
            if tensor is None or id(tensor) in seen:
                continue  # a tied tensor is saved once, under its first name (as save_pretrained does)
            seen.add(id(tensor))
            value = real.get(id(tensor), tensor)
            value = value.detach()
            if is_placeholder(value):
                raise InvalidOptionError(f"{name}: {dot}{attr} is offloaded and memmode cannot read it back")
            tensors[dot + attr] = value
    specs = {key: torch.empty(t.shape, dtype=t.dtype, device="meta") for key, t in tensors.items()}
    pieces = ({key: value.to("cpu").contiguous()} for key, value in tensors.items())
    write_pieces(specs, pieces, metadata=saved.packed_metadata(module), keep_as=folder / f"{stem}.safetensors")
