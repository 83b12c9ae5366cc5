"""Quantizing a component: refuse what cannot be quantized, pack what the selection says, install the forward,
and say what was done.

``apply`` validates everything before it touches anything, so the refusals (:func:`check_component`) run on
the selection alone and run again, on the same selection, right before packing (:func:`quantize_component`): a caller
that decided once — ``load`` packs while streaming, the planner sizes — passes its selection instead of having it
made a second time. :func:`summarize` is what ``handle.report().quantization`` shows, whoever packed.

:func:`check` and :func:`quantize` are what callers call: they run a quantizer's own ``check`` /
``quantize`` where it overrides the contract's, else these mechanics (the contract's defaults only say so).

**Converting ahead.** :func:`convert` packs without installing the forward, for a model that is sharded with
FSDP2 ``fully_shard`` afterwards (scales must be computed on whole weights). A quantizer with ``packs = False``
(``qfloat8_preconverted``) then installs only the forward; a packing quantizer of the same format does the
same on a converted model, since quantizing twice is a no-op.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memmode_core.contracts.errors import IncompatibleModeError, InvalidOptionError
from memmode_core.contracts.quantizer import DEFAULT_EXCLUDE, Quantizer
from memmode_core.contracts.storage import data_class
from memmode_core.contracts.targets import is_fsdp1
from memmode_core.engine.standins.classes import is_stand_in, raw_reads
from memmode_core.files.streamed import give_back_freed_memory
from memmode_core.quantization.making import make_selected, run_packed
from memmode_core.quantization.packed import COMPUTE_DTYPES, is_dtensor, packed_record
from memmode_core.quantization.selection import LayerSelection, select_layers
from memmode_core.quantization.sizes import component_bytes, pack_checked

#: set while sizing from a checkpoint's headers (``memmode plan --model``): weights on the meta device
#: have the shapes and dtypes a check needs, and none of the values it does not
SIZES_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("memmode_sizes_only", default=False)


# -- the summary --------------------------------------------------------------------------------------


@dataclass
class QuantizationSummary:
    """What quantizing one component did (``handle.report().quantization[name]``)."""

    quantizer: str
    format: str
    #: the dtype(s) the packed layers compute in ("" after ``convert``, which installs no forward)
    compute_dtype: str
    #: layers packed by this call
    packed_layers: int
    #: layers that were packed before this call (converted ahead, or quantized by an earlier apply)
    already_packed_layers: int
    #: layer path -> why it stays at full precision
    full_precision: dict[str, str]
    bytes_before: int
    bytes_after: int

    @property
    def no_op(self) -> bool:
        return self.packed_layers == 0 and self.already_packed_layers > 0

    def as_dict(self) -> dict:
        return {
            "quantizer": self.quantizer,
            "format": self.format,
            "compute_dtype": self.compute_dtype,
            "packed_layers": self.packed_layers,
            "already_packed_layers": self.already_packed_layers,
            "full_precision_layers": len(self.full_precision),
            "full_precision": dict(self.full_precision),
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
        }

    def __str__(self) -> str:
        ratio = self.bytes_after / self.bytes_before if self.bytes_before else 1.0
        return (
            f"{self.quantizer}: {self.packed_layers + self.already_packed_layers} layers in {self.format}, "
            f"{len(self.full_precision)} at full precision, {ratio:.2f}x the bytes"
        )


def summarize(
    quantizer: Quantizer, selection: LayerSelection, packed_now: int, bytes_before: int
) -> QuantizationSummary:
    """What following ``selection`` did to its component: ``packed_now`` layers packed by this call (0 when the
    component was packed already), ``bytes_before`` the component's bytes before it; the rest is read from
    the selection and from the component as it is now."""
    full_precision = {p.path: p.reason for p in selection.kept}
    if not selection.packs_anything:
        for p in selection.to_pack:
            full_precision[p.path] = "left at full precision when the component was first converted or quantized"
    dtypes = set()
    for module in selection.component.modules():
        record = packed_record(module)
        if record is not None and record.compute_dtype is not None:
            dtypes.add(str(record.compute_dtype).replace("torch.", ""))
    return QuantizationSummary(
        quantizer=quantizer.name,
        format=quantizer.format_name,
        compute_dtype=", ".join(sorted(dtypes)),
        packed_layers=packed_now,
        already_packed_layers=0 if selection.packs_anything else len(selection.packed),
        full_precision=dict(sorted(full_precision.items())),
        bytes_before=bytes_before,
        bytes_after=component_bytes(selection.component),
    )


# -- checks (before anything is touched) ----------------------------------------------------------------


def check_weight_dtype(weight_dtype: torch.dtype | None) -> None:
    if weight_dtype is not None and weight_dtype not in COMPUTE_DTYPES:
        raise InvalidOptionError(
            f"weight_dtype={weight_dtype} cannot be a compute dtype; quantized weights are dequantized to "
            f"one of {', '.join(str(d).replace('torch.', '') for d in COMPUTE_DTYPES)}"
        )


def weight_class(weight: torch.Tensor) -> type:
    """The class of a weight's data, as quantizing it will find it: seen through memmode's own stand-in of a
    weight resting under a placement (a mode applied over another is prepared while the old one still places
    the model, and is only removed, its weights back in ordinary memory, when the new one executes). Under a
    storage that keeps nothing in memory (``disk``) ``weight.data`` is then a lazy ``StandIn`` of the stored
    value; what it stands in for is the tensor it wraps (only plain parameters and buffers rest as stand-ins:
    a library's wrapped tensor keeps its class, and is refused as one)."""
    if is_stand_in(weight):
        with raw_reads():
            return data_class(weight)
    return data_class(weight)


def encoded_by_a_file(quantizer: Quantizer, name: str, formats: list[str]) -> IncompatibleModeError:
    """The refusal of a quantizer over a component whose layers a weight file encoded (``formats``, one per
    layer): ``load`` raises it before binding, ``apply`` (on a pipeline loaded so) from the checks."""
    return IncompatibleModeError(
        f"{name!r} was loaded from a file that keeps {len(formats)} layers encoded "
        f"({', '.join(sorted(set(formats)))}); memmode does not quantize again what the file quantized, nor "
        f"quantize the layers it left at full precision (its tools leave norms, embeddings and small layers so "
        f"on purpose). Use the mode without '_and_{quantizer.name}': the file's layers rest packed under every "
        f"placement and storage."
    )


def _decodes_a_file(module: nn.Module) -> bool:
    """Whether a packed layer holds what a weight file encoded (a GGUF's blocks, say), not memmode's packing."""
    record = packed_record(module)
    return record is not None and record.encoded_by is not None


def check_component(
    quantizer: Quantizer,
    name: str,
    component: nn.Module,
    *,
    exclude: Iterable[str] = (),
    options: Mapping[str, object] | None = None,
    selection: LayerSelection | None = None,
) -> LayerSelection:
    """Refuse with ``IncompatibleModeError`` what cannot be quantized; return the selection otherwise.

    ``selection``: one :func:`select_layers` made already for this quantizer and component (then ``exclude``
    and ``options`` are not read again); checked, and returned, instead of a new one.
    """
    fmt = quantizer.format_name
    if is_fsdp1(component):
        raise IncompatibleModeError(
            f"cannot quantize {name!r} with {quantizer.name}: it is wrapped in FSDP1 (FullyShardedDataParallel), "
            f"whose flat parameters cannot hold packed weights. Convert it, then shard it with FSDP2 "
            f"(torch.distributed.fsdp.fully_shard)."
        )
    if selection is None:
        selection = select_layers(quantizer, component, exclude=exclude, options=options)
    elif selection.quantizer is not quantizer or selection.component is not component:
        raise ValueError(f"the selection given for {name!r} was made for another quantizer or component")
    others = sorted({p.format for p in selection.packed} - {fmt})
    from_file = [p for p in selection.packed if p.format != fmt and _decodes_a_file(p.module)]
    if from_file:
        raise encoded_by_a_file(quantizer, name, [p.format for p in from_file])
    if others:
        raise IncompatibleModeError(
            f"{name!r} is already quantized with {', '.join(others)}; memmode does not re-quantize a quantized "
            f"model (and remove() does not undo quantization). Load the model again to use {quantizer.name}."
        )
    if not selection.packs_anything:  # converted ahead, or quantized by an earlier apply
        return selection
    if not quantizer.packs:
        raise IncompatibleModeError(
            f"{quantizer.name} only installs the dequantizing forward on layers converted to {fmt} beforehand, and "
            f"{name!r} holds no {fmt} layer. Convert it while its weights are whole, before any sharding "
            f"(memmode_core.convert({fmt!r}, model)), or use {fmt} on an unsharded model."
        )
    wrapped = [
        p
        for p in selection.to_pack
        if weight_class(p.module.weight) is not torch.Tensor and not is_dtensor(p.module.weight)
    ]
    if wrapped:
        raise IncompatibleModeError(
            f"cannot quantize {name!r} with {quantizer.name}: {wrapped[0].path}.weight is a "
            f"{weight_class(wrapped[0].module.weight).__name__}, not a plain tensor (another library quantized or "
            f"wrapped it)"
        )
    sharded = [p.path for p in selection.to_pack if is_dtensor(p.module.weight)]
    if sharded:
        raise IncompatibleModeError(
            f"cannot quantize {name!r} with {quantizer.name}: its weights are already sharded (DTensor, e.g. "
            f"{sharded[0]}.weight), and scales must be computed on whole weights. Convert before sharding: "
            f"memmode_core.convert({fmt!r}, model) on every rank while the weights are whole, then "
            f"fully_shard, then apply the mode."
        )
    meta = [p.path for p in selection.to_pack if p.module.weight.is_meta]
    if meta and not SIZES_ONLY.get():
        raise IncompatibleModeError(f"cannot quantize {name!r}: {meta[0]}.weight is on the meta device (not loaded)")
    if not selection.to_pack:
        if not selection.layers:
            why = "it has no nn.Linear layer"
        else:
            listed = "; ".join(f"{p.path}: {p.reason}" for p in selection.kept[:3])
            why = (
                f"every nn.Linear layer stays at full precision ({listed}{'; ...' if len(selection.kept) > 3 else ''})"
            )
        raise IncompatibleModeError(f"{quantizer.name} has nothing to quantize in {name!r}: {why}")
    return selection


def check_components(
    quantizer: Quantizer,
    components: Mapping[str, nn.Module],
    *,
    weight_dtype: torch.dtype | None,
    exclude: Iterable[str] = (),
    options: Mapping[str, object] | None = None,
) -> None:
    """Core's checks for every component (what :func:`check` runs unless the quantizer overrides ``check``)."""
    check_weight_dtype(weight_dtype)
    for name, component in components.items():
        check_component(quantizer, name, component, exclude=exclude, options=options)


# -- acting ---------------------------------------------------------------------------------------------


def _pack_all(selection: LayerSelection, *, weight_dtype: torch.dtype | None, runs: bool) -> int:
    """Pack every layer the selection says in memory, running in ``weight_dtype`` unless ``runs`` is False
    (converted ahead); returns how many (a tied weight is packed once)."""
    quantizer = selection.quantizer
    return make_selected(
        selection,
        lambda path, weight: pack_checked(quantizer, selection.sizes, weight),
        weight_dtype=weight_dtype,
        runs=runs,
    )


def convert(
    quantizer: Quantizer | str,
    module: nn.Module,
    *,
    exclude: Iterable[str] = (),
    default_exclude: Iterable[str] = DEFAULT_EXCLUDE,
) -> QuantizationSummary:
    """Pack ``module``'s layers in ``quantizer``'s format (a ``Quantizer`` instance; for a registered name,
    ``memmode_core.convert``) without installing the forward.

    This is the order FSDP2 needs: scales are computed here on whole weights, ``fully_shard`` then
    shards the packed payload like any parameter (the scales are buffers, replicated), and
    ``apply`` installs the forward — with the packing quantizer (quantizing a converted model again
    is a no-op) or with a forward-only one such as ``qfloat8_preconverted``. Until then a converted
    layer has no ``weight`` and cannot run: it never computes with packed bytes. ``exclude`` and
    ``default_exclude`` mean what they mean to ``apply``; converting a module that holds layers of this
    format already does nothing.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert() takes a torch.nn.Module such as pipe.transformer, not {type(module).__name__}")
    if isinstance(quantizer, str):
        raise TypeError(
            f"quantization.convert() takes a Quantizer instance; for a registered name use "
            f"memmode_core.convert({quantizer!r}, module)"
        )
    options = {"default_exclude": tuple(default_exclude)}
    selection = check_component(quantizer, type(module).__name__, module, exclude=tuple(exclude), options=options)
    before = component_bytes(module)
    packed_now = _pack_all(selection, weight_dtype=None, runs=False) if selection.packs_anything else 0
    return summarize(quantizer, selection, packed_now, before)


def quantize_component(
    quantizer: Quantizer,
    component: nn.Module,
    *,
    weight_dtype: torch.dtype | None,
    exclude: Iterable[str] = (),
    options: Mapping[str, object] | None = None,
    name: str = "module",
    selection: LayerSelection | None = None,
) -> QuantizationSummary:
    """Pack what :func:`select_layers` says (or ``selection``, made already) and install the forward on every
    packed layer. What :func:`check_component` refuses is refused here too, before anything changes.

    On a component that holds layers of this format already — converted ahead, or quantized by an
    earlier ``apply`` — nothing is packed again (the same quantizer twice is a no-op): the forward
    is installed where it is missing, and an explicit ``weight_dtype`` becomes the compute dtype.
    Otherwise each layer computes in ``weight_dtype``, or in its own dtype before packing.
    """
    check_weight_dtype(weight_dtype)
    selection = check_component(quantizer, name, component, exclude=exclude, options=options, selection=selection)
    before = component_bytes(component)
    packed_now = _pack_all(selection, weight_dtype=weight_dtype, runs=True) if selection.packs_anything else 0
    run_packed(component, quantizer, weight_dtype)  # the layers packed before (converted ahead)
    return summarize(quantizer, selection, packed_now, before)


# -- the entry points: a quantizer's override, or the mechanics above -------------------------------------


def overrides(quantizer: Quantizer, method: str) -> bool:
    """Whether ``quantizer`` replaces the contract's ``check`` or ``quantize`` with its own."""
    return getattr(type(quantizer), method) is not getattr(Quantizer, method)


def check(
    quantizer: Quantizer,
    components: Mapping[str, nn.Module],
    *,
    weight_dtype: torch.dtype | None,
    exclude: Iterable[str] = (),
    options: Mapping[str, object] | None = None,
) -> None:
    """Raise before anything is touched if ``quantizer`` cannot quantize ``components`` (name -> module):
    the quantizer's own ``check`` if it overrides the contract's, else :func:`check_components`."""
    options = {} if options is None else options
    if overrides(quantizer, "check"):
        quantizer.check(components, weight_dtype=weight_dtype, exclude=tuple(exclude), options=options)
    else:
        check_components(quantizer, components, weight_dtype=weight_dtype, exclude=exclude, options=options)


def quantize(
    quantizer: Quantizer,
    component: nn.Module,
    *,
    weight_dtype: torch.dtype | None,
    exclude: Iterable[str] = (),
    options: Mapping[str, object] | None = None,
    name: str = "module",
    selection: LayerSelection | None = None,
) -> QuantizationSummary | Any:
    """Quantize ``component`` (called ``name`` in messages) in place and return the summary: the
    quantizer's own ``quantize`` if it overrides the contract's (it receives neither ``name`` nor
    ``selection``), else :func:`quantize_component`."""
    options = {} if options is None else options
    try:
        if overrides(quantizer, "quantize"):
            return quantizer.quantize(component, weight_dtype=weight_dtype, exclude=tuple(exclude), options=options)
        return quantize_component(
            quantizer,
            component,
            weight_dtype=weight_dtype,
            exclude=exclude,
            options=options,
            name=name,
            selection=selection,
        )
    finally:
        # the full-precision weights and the packing temporaries are freed by now, but glibc keeps freed heap
        # memory (and, past its raised mmap threshold, serves later temporaries from the heap too): without a
        # trim the process kept GiBs that no tensor holds (see give_back_freed_memory)
        give_back_freed_memory()
