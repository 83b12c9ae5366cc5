"""``apply`` and ``remove``: the orchestration of one mode on one target.

The order is the contract: resolve and validate everything first (the target is untouched if
anything is refused), then quantize, then place. Applying a mode to a target that already has one
replaces the placement cleanly: the old one is removed (weights back in ordinary memory) only after
the new one has been fully validated.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memmode_core import quantization
from memmode_core.contracts.devices import resolve_device
from memmode_core.contracts.errors import IncompatibleModeError, InvalidOptionError
from memmode_core.contracts.options import resolve_options
from memmode_core.contracts.placement import lay_out
from memmode_core.contracts.targets import Target, refuse_compiled, refuse_scripted
from memmode_core.discovery.grammar import Resolved, lookup, resolve
from memmode_core.discovery.plugins import current
from memmode_core.engine import pipeline_hooks
from memmode_core.engine.ledger import Ledger, Report, clock
from memmode_core.engine.runtime import Runtime

logger = logging.getLogger("memmode")

#: attribute set on a pipeline / module (and on each placed component) that points to its handle
HANDLE_ATTRIBUTE = "_memmode_handle"


class Handle:
    """What ``apply`` returns: the applied mode, its ledger, and the way back."""

    def __init__(
        self,
        target: Target,
        resolved: Resolved,
        device: torch.device,
        runtime: Runtime,
        ledger: Ledger,
        quantized: dict[str, Any],
        notes: Mapping[str, str] | None = None,
    ) -> None:
        self._target = weakref.ref(target.obj) if _weakrefable(target.obj) else (lambda obj=target.obj: obj)
        self._components = target.components
        self._is_pipeline = target.is_pipeline
        #: how to place the target again the same way (set by apply)
        self._placing: Placing | None = None
        self.mode = str(resolved.mode)
        #: what was asked for: differs from ``mode`` when ``auto`` chose
        self.requested_mode = self.mode
        #: the planner's entry ``auto`` chose, else None
        self.choice = None
        self.placement = resolved.placement.name
        self.quantizer = resolved.quantizer.name if resolved.quantizer else None
        self.storage = resolved.storage.name if resolved.storage else None
        self.device = device
        #: component name -> the quantizer's summary of what it did there
        self.quantized = quantized
        #: component name -> what core placed differently from the placement's layout, and why
        #: (``_supports_group_offloading = False``, ``_exclude_from_cpu_offload``; see ``lay_out``)
        self.notes = dict(notes or {})
        self._runtime = runtime
        self._ledger = ledger
        self._removed = False
        self._guards: list = []

    @property
    def target(self) -> Any:
        return self._target()

    @property
    def active(self) -> bool:
        return not self._removed

    def report(self) -> Report:
        session = self._runtime.session
        return Report(
            mode=self.mode,
            storage=self.storage,
            device=str(self.device),
            peak_device_bytes=self._ledger.peak,
            resident_device_bytes=self._ledger.resident,
            bytes_transferred=self._ledger.transferred,
            transfer_seconds=self._ledger.seconds,
            onloads=self._ledger.onloads,
            offloads=self._ledger.offloads,
            storage_bytes=session.stats() if session is not None else {},
            quantization={name: _as_dict(summary) for name, summary in self.quantized.items()},
            component_calls={name: self._runtime.calls.count(name) for name in self._components},
            call_sequence=list(self._runtime.calls),
            placement_notes=dict(self.notes),
        )

    def reset_stats(self) -> None:
        """Start counting afresh (the peak restarts from what is resident now)."""
        self._ledger.reset_peak()
        self._runtime.calls.clear()

    def refresh(self) -> None:
        """Take every weight from the model as it is now.

        memmode notices on its own when parameters, buffers or submodules are added, removed or
        replaced, and it wraps the LoRA and projection-fusing methods of diffusers and
        transformers. What it cannot notice is a write into a tensor's existing memory
        (``module.weight.data.mul_(2)``, ``copy_``): call this after such edits.
        """
        self._runtime.refresh()

    def save(self, path) -> Any:
        """Save the target quantized, as it is now (see :func:`memmode_core.save_quantized`); ``load(path,
        mode)`` streams it back without quantizing again. Nothing is moved or removed."""
        from memmode_core.loading.save import save_quantized

        return save_quantized(self.target, path)

    def start_trace(self) -> None:
        """Record resident device bytes after every onload and offload from now on (see :meth:`trace`)."""
        self._ledger.trace = [(clock(), self._ledger.resident)]

    def trace(self) -> list[tuple[float, int]]:
        """``(seconds since start_trace, resident device bytes)`` samples; empty when not tracing."""
        samples = self._ledger.trace
        if not samples:
            return []
        samples = [*samples, (clock(), self._ledger.resident)]  # "until now": a flat trace has two points
        return [(t - samples[0][0], b) for t, b in samples]

    def _attach(self) -> None:
        """Mark the target and its placed components as placed by this handle."""
        if self._is_pipeline:
            pipeline_hooks.install(self._components, self.device, self.remove)
        self._guards = pipeline_hooks.install_guards(
            self.target if self._is_pipeline else None, self._components, self.mode, self._runtime.end_call
        )
        for obj in [self.target, *self._components.values()]:
            setattr(obj, HANDLE_ATTRIBUTE, self)

    def remove(self) -> None:
        """Take every hook off and leave the weights in ordinary CPU memory. Idempotent.

        If some groups' stored copies were lost (a deleted or damaged file), every other weight is
        still restored and the mode is still fully removed; then :class:`RestoreError` names the
        groups that could not be given back.
        """
        if self._removed:
            return
        self._removed = True
        try:
            self._runtime.remove()
        finally:
            pipeline_hooks.remove_guards(self._guards)
            pipeline_hooks.uninstall(self._components)
            target = self.target
            for obj in [target, *self._components.values()]:
                if obj is not None and getattr(obj, HANDLE_ATTRIBUTE, None) is self:
                    delattr(obj, HANDLE_ATTRIBUTE)
        if self.quantized:
            logger.warning(
                "memmode: removed %s; quantization of %s (%s) is not undone, the weights stay quantized",
                self.mode,
                ", ".join(self.quantized),
                self.quantizer,
            )

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<memmode.Handle {self.mode} storage={self.storage} device={self.device} {state}>"


def _as_dict(summary: Any) -> dict:
    if hasattr(summary, "as_dict"):
        return summary.as_dict()
    return dict(summary) if isinstance(summary, dict) else {"summary": str(summary)}


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
        return True
    except TypeError:
        return False


def _check_dtype(weight_dtype: Any) -> None:
    if weight_dtype is not None and not (isinstance(weight_dtype, torch.dtype) and weight_dtype.is_floating_point):
        raise InvalidOptionError(f"weight_dtype={weight_dtype!r} must be a floating torch.dtype such as torch.bfloat16")


def _names(value: Any, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    try:
        values = tuple(value)
    except TypeError:
        raise InvalidOptionError(f"{what}= must be a string or a list of strings") from None
    if not all(isinstance(v, str) for v in values):
        raise InvalidOptionError(f"{what}= must be a string or a list of strings")
    return values


def handle_of(target: Any) -> Handle | None:
    """The active handle applied to ``target`` itself (not one applied to a pipeline it belongs to)."""
    handle = getattr(target, HANDLE_ATTRIBUTE, None)
    if isinstance(handle, Handle) and handle.active and handle.target is target:
        return handle
    return None


def apply(
    target: Any,
    mode: str,
    *,
    device: Any = None,
    weight_dtype: torch.dtype | None = None,
    storage: str | None = None,
    offload_dir: str | None = None,
    components: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    exclude_components: Iterable[str] | None = None,
    strict: bool = False,
    **options: Any,
) -> Handle:
    """Put ``target`` (a diffusers pipeline or an ``nn.Module``) into ``mode``; see the user guide.

    ``exclude_components`` names pipeline components the placement leaves exactly where they are
    (diffusers' ``exclude_modules``): no hooks, nothing stored, nothing moved.

    ``strict=True``: refuse (``IncompatibleModeError``) rather than adjust the placement's layout where
    the model or the pipeline declares it must be (a component with ``_supports_group_offloading =
    False`` moved whole, one in the pipeline's ``_exclude_from_cpu_offload`` kept on the device; each
    adjustment is otherwise logged and noted in ``report().placement_notes``).
    """
    # -- resolve and validate: nothing is touched until all of this has passed ----------------------
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a string such as 'model_cpu_offload_and_qfloat8', not {type(mode).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, not {type(strict).__name__}")
    whole = Target.of(target)
    dev = resolve_device(device)
    _check_dtype(weight_dtype)
    if storage is not None and not isinstance(storage, str):
        raise TypeError(f"storage must be a storage name such as 'ram', not {type(storage).__name__}")
    if offload_dir is not None and not isinstance(offload_dir, (str, bytes)) and not hasattr(offload_dir, "__fspath__"):
        raise TypeError("offload_dir must be a path")
    component_names = _names(components, "components")
    excluded = _names(exclude, "exclude") or ()
    left_alone = _names(exclude_components, "exclude_components") or ()
    tgt = whole.without(left_alone)
    refuse_scripted(tgt.components)
    pipeline_hooks.refuse_foreign_offloading(tgt.components)
    resolved = resolve(mode, storage=storage, device=dev, plugins=current(), storage_given=storage is not None)
    placement = resolved.placement.obj
    quantizer = resolved.quantizer.obj if resolved.quantizer else None
    storage_obj = resolved.storage.obj if resolved.storage else None

    declared = [(f"placement {placement.name}", placement.options)]
    if storage_obj is not None:
        declared.append((f"storage {storage_obj.name}", storage_obj.options))
    if quantizer is not None:
        declared.append((f"quantizer {quantizer.name}", quantizer.options))
    routed = resolve_options(declared, options)
    placement_options = routed[f"placement {placement.name}"]
    storage_options = routed.get(f"storage {storage_obj.name}", {}) if storage_obj is not None else {}
    quantizer_options = routed.get(f"quantizer {quantizer.name}", {}) if quantizer is not None else {}

    if getattr(placement, "delegates", False):
        return _apply_choice(
            target,
            tgt,
            mode,
            placement,
            placement_options,
            resolved,
            dev,
            storage=storage,
            weight_dtype=weight_dtype,
            offload_dir=offload_dir,
            components=component_names,
            exclude=excluded,
            exclude_components=left_alone,
            strict=strict,
            extra={k: v for k, v in options.items() if k not in placement_options},
        )
    if quantizer is None and (component_names is not None or excluded):
        raise InvalidOptionError(
            f"components= and exclude= choose what a quantizer touches, and mode {mode!r} has no quantizer"
        )
    if offload_dir is not None and not getattr(storage_obj, "uses_offload_dir", False):
        raise InvalidOptionError(
            f"offload_dir= is for storages that write files (disk, mmap); storage "
            f"{resolved.storage.name if resolved.storage else None!r} does not use it"
        )
    # a component left out of the placement is still quantized when it is named explicitly
    quantize_targets = (whole if component_names is not None else tgt).select(component_names) if quantizer else {}
    if quantizer is not None:
        if not quantize_targets:
            raise InvalidOptionError(
                f"{tgt.label} has no denoiser to quantize (no component's forward takes a timestep); "
                f"name the components with components=[...] (it has {', '.join(tgt.components)})"
            )
        refuse_compiled(quantize_targets, f"quantize with {quantizer.name}")
    previous = handle_of(target)
    _refuse_foreign_handles(tgt, previous)
    layout = lay_out(placement, tgt, placement_options, dev, strict=strict)
    specs = layout.specs
    if quantizer is not None:
        quantization.check(
            quantizer, quantize_targets, weight_dtype=weight_dtype, exclude=excluded, options=quantizer_options
        )
    placing = Placing(tgt, placement, placement_options, storage_obj, storage_options, dev, offload_dir, strict)
    session = placing.open_session()
    reserved = None
    if session is not None:
        from memmode_core.planning.planner import stored_sizes

        try:  # room for what will be stored, before quantizing: a refusal leaves the target untouched
            reserved = stored_sizes(tgt, specs, quantizer, quantize_targets, excluded, quantizer_options)
            session.reserve(reserved)
        except BaseException:
            session.close()
            raise

    # -- act: replace the old placement, quantize, place -------------------------------------------
    quantized = {}
    try:
        if previous is not None:
            previous.remove()
        if quantizer is not None:
            for name, module in quantize_targets.items():
                quantized[name] = quantization.quantize(
                    quantizer, module, weight_dtype=weight_dtype, exclude=excluded, options=quantizer_options, name=name
                )
        runtime, ledger = placing.install(specs, session, reserved)
    except BaseException as exc:
        if session is not None:
            session.close()
        if previous is not None:
            _revive(previous, exc, quantized)
        raise
    if quantized:
        logger.info("memmode: %s quantized %s with %s", tgt.label, ", ".join(quantized), quantizer.name)
    handle = Handle(tgt, resolved, dev, runtime, ledger, quantized, layout.notes)
    handle._placing = placing
    handle._attach()
    return handle


@dataclass(eq=False)
class Placing:
    """Everything needed to place a target again the same way (a refused re-apply revives the old mode)."""

    target: Target
    placement: Any
    options: Mapping[str, Any]
    storage: Any
    storage_options: Mapping[str, Any]
    device: torch.device
    offload_dir: Any
    strict: bool = False

    def lay_out(self):
        return lay_out(self.placement, self.target, self.options, self.device, strict=self.strict)

    def open_session(self):
        if self.storage is None:
            return None
        return self.storage.open(device=self.device, offload_dir=self.offload_dir, options=self.storage_options)

    def install(self, specs, session, reserved=None) -> tuple[Runtime, Ledger]:
        tgt, placement, options = self.target, self.placement, self.options
        ledger = Ledger()
        runtime = Runtime(
            tgt.components,
            specs,
            device=self.device,
            session=session,
            ledger=ledger,
            prefetch=placement.prefetch(options, self.device),
            offload_after_call=placement.offloads_after_call(options),
            relayout=lambda name: [spec for spec in self.lay_out().specs if spec.component == name],
            pipeline=tgt.obj if tgt.is_pipeline else None,
            refuse_edit=_refuse_fusing_packed,
        )
        runtime.install(reserved)
        return runtime, ledger


def _revive(previous: Handle, failure: BaseException, quantized: dict) -> None:
    """A re-apply failed after the old mode was removed: put the old mode back, so that a refused
    apply changes nothing. The old handle becomes active again."""
    if not previous._removed:
        return
    placing = previous._placing
    try:
        session = placing.open_session()
        try:
            specs = placing.lay_out().specs
            runtime, ledger = placing.install(specs, session)
        except BaseException:
            if session is not None:
                session.close()
            raise
    except BaseException as again:
        logger.error(
            "memmode: the new mode failed (%s) and the previous mode %s could not be put back (%s); "
            "the weights are in ordinary memory",
            failure,
            previous.mode,
            again,
        )
        return
    previous._runtime, previous._ledger, previous._removed = runtime, ledger, False
    previous._attach()
    if quantized:
        logger.warning(
            "memmode: the new mode failed after quantizing %s; the previous mode %s is back, on the quantized weights",
            ", ".join(quantized),
            previous.mode,
        )


def _apply_choice(
    target,
    tgt: Target,
    mode: str,
    placement,
    placement_options,
    resolved: Resolved,
    device: torch.device,
    *,
    storage,
    weight_dtype,
    offload_dir,
    components,
    exclude,
    exclude_components,
    strict,
    extra,
) -> Handle:
    """``auto``: let the placement choose a mode with the planner, then apply that."""
    if offload_dir is not None and storage is None:
        raise InvalidOptionError(
            "with auto and offload_dir=, name the storage that writes there: storage='disk' or storage='mmap'"
        )
    choice = placement.choose(
        tgt,
        placement_options,
        device=device,
        quantizer=resolved.quantizer.name if resolved.quantizer else None,
        storage=storage,
        weight_dtype=weight_dtype,
        components=components,
        exclude=exclude,
    )
    handle = apply(
        target,
        choice.mode,
        device=device,
        weight_dtype=weight_dtype,
        storage=choice.storage,
        offload_dir=offload_dir,
        components=components,
        exclude=exclude or None,
        exclude_components=exclude_components or None,
        strict=strict,
        **choice.options,
        **extra,
    )
    handle.requested_mode = mode
    handle.choice = choice
    logger.info(
        "memmode: %s chose %s with storage %s (peak %d bytes on the device)",
        mode,
        choice.label(),
        choice.storage,
        choice.peak_device_bytes,
    )
    return handle


#: edits that add a delta into the existing weights
FUSING_METHODS = ("fuse_lora", "fuse_qkv_projections")


def _refuse_fusing_packed(method: str, components: dict[str, nn.Module]) -> None:
    """Fusing into a quantized weight would add to packed codes. memmode refuses rather than
    dequantize-add-requantize: the unfused adapter runs at ``weight_dtype`` on top of the dequantized
    base, exactly, at the cost of its two small matmuls (docs/quantizers.md has the measurements)."""
    if method not in FUSING_METHODS:
        return
    from memmode_core.quantization import packed_record

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


def _refuse_foreign_handles(tgt: Target, previous: Handle | None) -> None:
    """A component placed through another target (a pipeline sharing it) cannot be placed twice."""
    for name, module in tgt.components.items():
        other = getattr(module, HANDLE_ATTRIBUTE, None)
        if isinstance(other, Handle) and other.active and other is not previous:
            owner = other.target
            raise IncompatibleModeError(
                f"component {name!r} is already placed by memmode mode {other.mode!r} applied to "
                f"{type(owner).__name__}; call remove() on that first"
            )


def convert(quantizer: Any, module: nn.Module, **kwargs: Any):
    """Pack ``module``'s layers in a quantizer's format ahead of ``apply`` (the order FSDP2 needs).

    ``quantizer``: a registered name (``"qfloat4"``) or a ``Quantizer``; see
    :func:`memmode_core.quantization.layers.convert` for the rest.
    """
    if isinstance(quantizer, str):
        quantizer = lookup(current(), "quantizer", quantizer, mode=None).obj
    return quantization.convert(quantizer, module, **kwargs)


def remove(target: Any) -> bool:
    """Remove memmode from ``target``; returns whether there was anything to remove."""
    handle = handle_of(target)
    if handle is None:
        return False
    handle.remove()
    return True
