"""Where a packed layer is made: the one stage that turns a linear layer into a packed one and makes it run.

Every road to a packed layer comes through here — packing in memory (``apply``), packing one layer at a time
into a streamed file (``apply`` with a file storage, ``load``), and the layers a source of weights keeps packed
(a checkpoint memmode saved quantized, a GGUF or ComfyUI file: placeholders that binding fills like any other
tensor). So the forward is installed once, where the layer is made, with its compute dtype decided by one rule
(:func:`compute_dtype_for`); nothing later has to remember to install it:

- :func:`make_packed`: a layer holding given packed tensors (``attach_packed``), running (``install_forward``)
  unless it is converted ahead for FSDP2, which packs and installs nothing (``runs=False``);
- :func:`make_selected`: every layer a quantizer's selection packs, from packed tensors computed once per weight
  (in memory, or read back from a streamed file), a tied weight's layers sharing them;
- :func:`make_placeholders`: the layers a :class:`PackedSpec` list describes, holding meta tensors of their
  parts' shapes, checked against the model first (nothing is changed when one does not fit);
- :func:`run_packed`: the forward of layers packed before (converted ahead, or quantized by an earlier
  ``apply``), where it is missing or ``weight_dtype`` asks for another compute dtype.

A structure test holds the line: ``attach_packed`` and ``install_forward`` are called from this module only, and
:func:`make_packed` from :func:`make_selected` and :func:`make_placeholders` alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from memmode_core.contracts.errors import CheckpointError
from memmode_core.contracts.quantizer import PAYLOAD, Quantizer
from memmode_core.quantization.forward import QuantizedLinear, install_forward
from memmode_core.quantization.packed import PackedLayer, attach_packed, packed_record

if TYPE_CHECKING:
    from memmode_core.quantization.selection import LayerSelection


@dataclass(frozen=True)
class PackedSpec:
    """A layer that rests packed, as a source of weights describes it before anything is read."""

    #: the layer's path in its model
    path: str
    #: what decodes it: a quantizer, or a reader's codec (``packs = False``: a GGUF block type)
    codec: Quantizer
    #: shape and dtype of the full-precision weight
    shape: tuple[int, ...]
    dtype: torch.dtype
    #: part name (``weight_packed`` first) -> its shape and dtype, as stored
    parts: Mapping[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    #: the dtype its forward computes in without a ``weight_dtype`` (None: ``dtype``); a checkpoint memmode
    #: saved records it
    compute_dtype: torch.dtype | None = None
    #: the file whose encoding the layer holds (a GGUF's blocks), None for memmode's own packing
    encoded_by: str | None = None


def compute_dtype_for(weight_dtype: torch.dtype | None, record: PackedLayer | PackedSpec) -> torch.dtype:
    """The dtype a packed layer computes in: ``weight_dtype`` when one is asked for, else the one the layer
    computed in before (recorded when it was saved or first ran), else its full-precision weight's."""
    return weight_dtype or record.compute_dtype or record.dtype


def make_packed(
    module: nn.Module,
    codec: Quantizer,
    shape: torch.Size,
    dtype: torch.dtype,
    payload: nn.Parameter,
    buffers: Mapping[str, torch.Tensor],
    *,
    path: str,
    weight_dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
    encoded_by: str | None = None,
    runs: bool = True,
) -> None:
    """Make ``module`` a packed layer holding ``payload`` (in place of its weight) and ``buffers``, decoded by
    ``codec``; unless ``runs`` is False (converted ahead), its forward is installed, computing in
    :func:`compute_dtype_for` of ``weight_dtype``."""
    attach_packed(module, codec.format_name, shape, dtype, payload, buffers, path)
    record = packed_record(module)
    record.encoded_by = encoded_by
    record.compute_dtype = compute_dtype
    if runs:
        install_forward(module, codec, compute_dtype_for(weight_dtype, record))


def make_selected(
    selection: LayerSelection,
    packed_of: Callable[[str, torch.Tensor], Mapping[str, torch.Tensor]],
    *,
    weight_dtype: torch.dtype | None,
    runs: bool = True,
) -> int:
    """Make every layer ``selection`` packs a packed layer (see :func:`make_packed`); returns how many.
    ``packed_of(path, weight)`` gives a weight's packed tensors, asked once per weight: the layers of a tied
    weight share one set, as they shared the weight."""
    shared: dict[int, tuple[nn.Parameter, dict[str, torch.Tensor], torch.Tensor]] = {}
    for layer in selection.to_pack:
        weight = layer.module.weight
        if id(weight) not in shared:
            parts = dict(packed_of(layer.path, weight))
            # the weight is kept beside its parts: its id stays its own while later layers are made
            shared[id(weight)] = (nn.Parameter(parts.pop(PAYLOAD), requires_grad=False), parts, weight)
        payload, buffers, _ = shared[id(weight)]
        make_packed(
            layer.module,
            selection.quantizer,
            weight.shape,
            weight.dtype,
            payload,
            buffers,
            path=layer.path,
            weight_dtype=weight_dtype,
            runs=runs,
        )
    return len(selection.to_pack)


def make_placeholders(
    module: nn.Module, specs: Iterable[PackedSpec], *, where: str, weight_dtype: torch.dtype | None
) -> None:
    """Make each layer of ``specs`` a running packed layer holding meta tensors of its parts' shapes, for
    binding to fill like any other tensor. Every layer is checked first — there, an ``nn.Linear`` of the spec's
    shape — and a misfit is a :class:`CheckpointError` naming ``where``, before any layer is changed."""
    specs = list(specs)
    wrong = []
    for spec in specs:
        try:
            sub = module.get_submodule(spec.path)
        except AttributeError:
            raise CheckpointError(f"{where}: packed layer {spec.path!r} is not in {type(module).__name__}") from None
        weight = getattr(sub, "weight", None)
        if not isinstance(sub, nn.Linear) or weight is None or tuple(weight.shape) != tuple(spec.shape):
            model = list(weight.shape) if isinstance(weight, torch.Tensor) else "no weight"
            wrong.append(f"{spec.path}: a {list(spec.shape)} weight in the file, {type(sub).__name__} {model} here")
        elif not spec.parts or next(iter(spec.parts)) != PAYLOAD:
            raise CheckpointError(f"{where}: {spec.path} holds {list(spec.parts)}, not {PAYLOAD!r} first")
    if wrong:
        raise CheckpointError(
            f"{where} does not fit {type(module).__name__}: {'; '.join(wrong[:5])}"
            f"{f'; and {len(wrong) - 5} more' if len(wrong) > 5 else ''}"
        )
    for spec in specs:
        meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in spec.parts.items()}
        payload = nn.Parameter(meta.pop(PAYLOAD), requires_grad=False)
        make_packed(
            module.get_submodule(spec.path),
            spec.codec,
            torch.Size(spec.shape),
            spec.dtype,
            payload,
            meta,
            path=spec.path,
            weight_dtype=weight_dtype,
            compute_dtype=spec.compute_dtype,
            encoded_by=spec.encoded_by,
        )


def run_packed(component: nn.Module, codec: Quantizer, weight_dtype: torch.dtype | None) -> None:
    """The forward of every packed layer of ``component`` that has none yet (converted ahead), or, when
    ``weight_dtype`` is given, computes in another dtype (a mode applied again with another ``weight_dtype``)."""
    for module in component.modules():
        record = packed_record(module)
        if record is None:
            continue
        dtype = compute_dtype_for(weight_dtype, record)
        if isinstance(module, QuantizedLinear) and record.codec is codec and record.compute_dtype == dtype:
            continue
        install_forward(module, codec, dtype)
