"""Which dtype each model of a folder loads in, and the keyword each library takes it by.

``load`` takes the dtype as ``from_pretrained`` does, under either of its names (``torch_dtype``, and
``dtype``, which diffusers now asks for), resolves ``"auto"`` per component from its checkpoint, and passes
it on to diffusers under the keyword the installed release takes without a deprecation warning.
"""

from __future__ import annotations

import logging

import torch

from memmode_core.contracts.errors import InvalidOptionError
from memmode_core.files import Checkpoint
from memmode_core.loading.skeleton import is_transformers_class, library_version

logger = logging.getLogger("memmode")


def one_dtype(torch_dtype, dtype):
    """The dtype asked for by either name (``dtype``, diffusers' current keyword, or ``torch_dtype``, with its
    default ``"auto"``), checked; both given is an error, as it is in diffusers."""
    if dtype is not None:
        if torch_dtype != "auto":
            raise InvalidOptionError(
                f"dtype={dtype!r} and torch_dtype={torch_dtype!r} are one argument under two names: give one "
                f"(dtype, the name diffusers now uses)"
            )
        torch_dtype, name = dtype, "dtype"
    else:
        name = "torch_dtype"
    if torch_dtype == "auto" or torch_dtype is None:
        return torch_dtype
    if not (isinstance(torch_dtype, torch.dtype) and torch_dtype.is_floating_point):
        raise InvalidOptionError(
            f"{name}={torch_dtype!r} must be 'auto' (each model in its checkpoint's dtype), a floating "
            f"torch.dtype, or None (diffusers' default: float32)"
        )
    return torch_dtype


def resolve_dtype(torch_dtype, cls: type, checkpoint: Checkpoint, name: str):
    """``"auto"``: the dtype of the component's checkpoint, so that nothing is converted (a bfloat16 checkpoint
    built in diffusers' default float32 converts every tensor, twice its size, into a staging file). Where its
    tensors mix dtypes (outside the class's ``_keep_in_fp32_modules``), the checkpoint says which one
    (:meth:`Checkpoint.floating_dtype`: a folder the dtype most of its bytes are in, a single file the widest of
    its plain tensors'), and binding converts the others to it: the model has one floating dtype, but for the
    modules its class keeps in float32. Transformers applies its own ``"auto"`` (the config's dtype, else the
    weights')."""
    if torch_dtype != "auto":
        return torch_dtype
    if is_transformers_class(cls):
        return "auto"
    dtype = checkpoint.floating_dtype(tuple(getattr(cls, "_keep_in_fp32_modules", None) or ()))
    if dtype is not None:
        logger.info(
            "memmode: %s is loaded in %s, its checkpoint's dtype (torch_dtype='auto'; every tensor in another "
            "dtype is converted to it, but the modules the class keeps in float32)",
            name,
            str(dtype).removeprefix("torch."),
        )
    return dtype


def pipeline_dtype_keyword() -> str:
    """The name a pipeline's ``from_pretrained`` takes its dtype by: ``dtype`` from diffusers 0.40 on, where
    ``torch_dtype`` warns that it is deprecated; ``torch_dtype`` before."""
    from packaging.version import Version

    return "dtype" if Version(library_version("diffusers")) >= Version("0.40") else "torch_dtype"
