"""A packed layer's state: the packed tensors in place of ``weight``, and the record that says how to read them.

This is the one representation every path produces — quantizing in memory, converting ahead for FSDP2,
loading a quantized checkpoint, quantizing while streaming one — so that everything above (the forward, the
weight stand-in, the checks, saving) has a single thing to recognise.

``Quantizer.pack`` returns plain tensors. The ``weight_packed`` entry (:data:`PAYLOAD`) takes the place of
the layer's ``weight`` parameter (same position in ``named_parameters()``), the others become buffers of the
layer. The payload must have an integer dtype: floating-point machinery then leaves it alone — diffusers'
``ModelMixin.dtype`` (which pipelines use to create latents) skips it and keeps reporting the compute dtype,
``module.to(dtype)`` does not cast it, and FSDP2 neither casts it under a ``MixedPrecisionPolicy`` nor needs a
float8 collective (it all-gathers mixed dtypes as bytes, which gloo supports). The payload is not called
``weight`` because its shape need not be the weight's (NVFP4 packs two values per byte) and its values are
not weights: a state dict of a quantized model has no ``weight`` key to be loaded, by mistake, into a
full-precision one.

Plain attributes and a record in the module's ``__dict__`` — no tensor subclass, no wrapper module — are
what let every placement and storage move quantized weights without knowing about them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from memmode_core.contracts.errors import IncompatibleModeError
from memmode_core.contracts.quantizer import PAYLOAD, Quantizer
from memmode_core.contracts.storage import data_class

#: attribute of a packed ``nn.Linear`` holding its :class:`PackedLayer` record
PACKED_ATTRIBUTE = "_memmode_packed"

#: dtypes a dequantized weight can be computed in
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(eq=False)
class PackedLayer:
    """What a packed ``nn.Linear`` remembers: enough to unpack it, nothing derived from its data."""

    #: the packed format (``Quantizer.format_name``)
    format: str
    #: shape and dtype of the full-precision weight
    shape: torch.Size
    dtype: torch.dtype
    #: attribute names of the packed tensors, ``"weight"`` first
    names: tuple[str, ...]
    #: the quantizer whose ``unpack`` the forward calls (set when the forward is installed)
    codec: Quantizer | None = None
    #: the dtype the forward computes in (set when the forward is installed)
    compute_dtype: torch.dtype | None = None
    #: the file whose encoding the layer holds, when a reader's codec decodes it (a GGUF's blocks): None for a
    #: layer memmode packed itself
    encoded_by: str | None = None


def packed_record(module: nn.Module) -> PackedLayer | None:
    """The module's :class:`PackedLayer` if its weight is packed (converted or quantized), else None."""
    record = module.__dict__.get(PACKED_ATTRIBUTE)
    return record if isinstance(record, PackedLayer) else None


def is_quantized(module: nn.Module) -> bool:
    """Whether any layer of ``module`` holds packed weights (converted or quantized)."""
    return any(packed_record(m) is not None for m in module.modules())


def attach_packed(
    module: nn.Module,
    fmt: str,
    shape: torch.Size,
    dtype: torch.dtype,
    payload: nn.Parameter,
    buffers: Mapping[str, torch.Tensor],
    path: str = "layer",
) -> None:
    """Make ``module`` a packed layer holding ``payload`` (in place of ``weight``) and ``buffers``.

    The packed tensors may come from :meth:`Quantizer.pack` or from a file (loading a quantized
    checkpoint, or quantizing while streaming one): a layer is the same whichever way it was filled.
    The forward is installed separately (:func:`memmode_core.quantization.forward.install_forward`).
    """
    clash = [n for n in (PAYLOAD, *buffers) if hasattr(module, n)]
    if clash:
        raise RuntimeError(f"{path} already has an attribute {clash[0]!r}; cannot store the packed tensor")
    _replace_parameter(module, "weight", PAYLOAD, payload)
    for buffer_name, tensor in buffers.items():
        module.register_buffer(buffer_name, tensor, persistent=True)
    module.__dict__[PACKED_ATTRIBUTE] = PackedLayer(fmt, torch.Size(shape), dtype, (PAYLOAD, *buffers))


def _replace_parameter(module: nn.Module, old: str, new: str, parameter: nn.Parameter) -> None:
    """Put ``parameter`` under ``new`` in place of ``old``, after the layer's other parameters.

    Last, because models read a child's first parameter for the dtype to cast its input to: diffusers' Wan
    embeds the timestep with ``timestep.to(next(iter(self.time_embedder.parameters())).dtype)``, and a
    packed payload there (a GGUF file quantizes the time embedder) cast the timestep to ``uint8``. After the
    floating bias, that reads the dtype the layer computes in. The order is the same on every rank, which is
    all FSDP2 needs of it; diffusers' ``ModelMixin.dtype`` skips integer tensors wherever they are."""
    entries = [(name, value) for name, value in module._parameters.items() if name != old]
    module._parameters.clear()
    module._parameters.update(entries)
    module._parameters[new] = parameter


# -- what a weight tensor really is (a packed layer's tensors must be plain, whole and present) ----------


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is sharded (``torch.distributed``'s DTensor, recognised without importing it)."""
    return data_class(t).__name__ == "DTensor"


#: edits that add a delta into the existing weights
FUSING_METHODS = ("fuse_lora", "fuse_qkv_projections")


def refuse_fusing_packed(method: str, components: dict[str, nn.Module]) -> None:
    """Fusing into a quantized weight would add to packed codes. memmode refuses rather than
    dequantize-add-requantize: the unfused adapter runs at ``weight_dtype`` on top of the dequantized
    base, exactly, at the cost of its two small matmuls (docs/quantizers.md has the measurements).
    The engine calls this before it runs one of :data:`FUSING_METHODS` on a placed component."""
    if method not in FUSING_METHODS:
        return
    for name, component in components.items():
        for path, module in component.named_modules():
            base = getattr(module, "base_layer", None) if method == "fuse_lora" else module
            if isinstance(base, nn.Module) and packed_record(base) is not None:
                what = "LoRA adapters" if method == "fuse_lora" else "projections"
                raise IncompatibleModeError(
                    f"{method}: {name}.{path} is quantized, and fusing {what} into packed weights would corrupt them. "
                    f"Keep the adapter unfused (it runs at weight_dtype on the dequantized weight), or fuse before "
                    f"applying the quantizer."
                )
