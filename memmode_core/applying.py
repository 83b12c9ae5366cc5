"""``apply`` and ``remove``: executing a prepared plan on its target, and taking it off again.

``apply(target, mode, **kw)`` is ``execute(prepare(target, mode, **kw))``: everything is resolved,
checked, laid out and sized by :func:`~memmode_core.planning.prepare.prepare` while the target is
untouched, then :func:`execute` acts in the order of the contract — make room in the storage, take
the old mode off, quantize, place. Applying a mode to a target that already has one replaces the
placement cleanly: the old one is removed (weights back in ordinary memory) only after the new one
has been fully validated, and if the new one fails after that, the old one is put back.

"The old one" is every handle now placing the target or any of its components: its own, and that of
another pipeline sharing the components (``NewPipeline.from_pipe(placed)``). Applying a mode to the
new pipeline moves the placement there, as diffusers' ``enable_model_cpu_offload`` on it takes the
old hooks off the shared components first; the old handle becomes inactive. A bare module placed as
one component of a pipeline is refused instead: placing it alone would unplace the rest of that
pipeline.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from memmode_core import quantization
from memmode_core.contracts.errors import IncompatibleModeError
from memmode_core.contracts.targets import Target
from memmode_core.discovery.grammar import lookup
from memmode_core.discovery.plugins import current
from memmode_core.engine.ledger import Ledger
from memmode_core.engine.runtime import Runtime
from memmode_core.handle import HANDLE_ATTRIBUTE, Handle, handle_of
from memmode_core.planning.prepare import prepare
from memmode_core.planning.prepared import Prepared

logger = logging.getLogger("memmode")


def apply(
    target: Any,
    mode: str | None = None,
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

    ``apply(prepared)`` executes a plan made by :func:`memmode_core.prepare` (inspected first, say).

    ``exclude_components`` names pipeline components the placement leaves exactly where they are
    (diffusers' ``exclude_modules``): no hooks, nothing stored, nothing moved.

    ``strict=True``: refuse (``IncompatibleModeError``) rather than adjust the placement's layout where
    the model or the pipeline declares it must be (a component with ``_supports_group_offloading =
    False`` moved whole, one in the pipeline's ``_exclude_from_cpu_offload`` kept on the device; each
    adjustment is otherwise logged and noted in ``report().placement_notes``).
    """
    if isinstance(target, Prepared) and mode is None:
        return execute(target)
    prepared = prepare(
        target,
        mode,
        device=device,
        weight_dtype=weight_dtype,
        storage=storage,
        offload_dir=offload_dir,
        components=components,
        exclude=exclude,
        exclude_components=exclude_components,
        strict=strict,
        **options,
    )
    return execute(prepared)


def execute(prepared: Prepared) -> Handle:
    """Act on a prepared plan: make room in the storage, take the old mode off, quantize, place."""
    placing = _placing(prepared.whole)
    _refuse_stale_quantization(prepared)
    session = prepared.open_session()
    try:  # room for what will be stored, before quantizing: a refusal leaves the target untouched
        if session is not None:
            session.reserve(prepared.stored_sizes)
    except BaseException:
        session.close()
        raise

    quantized: dict[str, Any] = {}
    try:
        for previous in placing:
            previous.remove()
        quantized = _quantize(prepared)
        runtime, ledger = install(prepared, session, prepared.stored_sizes)
    except BaseException as exc:
        if session is not None:
            session.close()
        for previous in placing:
            _revive(previous, exc, quantized)
        raise
    if quantized:
        logger.info(
            "memmode: %s quantized %s with %s", prepared.target.label, ", ".join(quantized), prepared.quantizer.name
        )
    handle = Handle(prepared, runtime, ledger, quantized)
    handle._attach()
    _log_moves(prepared, placing)
    return handle


def _quantize(prepared: Prepared) -> dict[str, Any]:
    """Quantize each component as planned; a component quantized already (``load`` packs while streaming)
    only gets its dequantizing forward."""
    quantizer = prepared.quantizer
    if quantizer is None:
        return {}
    request = prepared.request
    done: dict[str, Any] = {}
    targets = prepared.whole.components
    for name, plan in prepared.quantization.items():
        module = targets[name]
        if name in prepared.packed_ahead:
            packed_now, bytes_before = prepared.packed_ahead[name]
            quantization.install_forwards(module, quantizer, request.weight_dtype)
            done[name] = quantization.summarize(quantizer, plan, packed_now, bytes_before)
        else:
            done[name] = quantization.quantize(
                quantizer,
                module,
                weight_dtype=request.weight_dtype,
                exclude=request.exclude,
                options=request.quantizer_options,
                name=name,
                plan=plan,
            )
    return done


def _refuse_stale_quantization(prepared: Prepared) -> None:
    """A plan says which layers to pack; one of them packed since (the plan executed already, or the model
    quantized another way) would be packed twice. Refused before anything changes: prepare again."""
    for name, plan in prepared.quantization.items():
        if name in prepared.packed_ahead or not plan.packs_anything:
            continue
        done = [layer.path for layer in plan.to_pack if quantization.packed_record(layer.module) is not None]
        if done:
            raise IncompatibleModeError(
                f"this plan of {prepared.mode} was prepared before {name}.{done[0]} was quantized (it was executed "
                f"already, or the model was quantized since); prepare it again"
            )


def install(prepared: Prepared, session, reserved: dict[str, int] | None = None) -> tuple[Runtime, Ledger]:
    """Install the engine for ``prepared``'s placement on its (quantized) target."""
    target = prepared.target
    ledger = Ledger()
    runtime = Runtime(
        target.components,
        prepared.groups,
        device=prepared.device,
        session=session,
        ledger=ledger,
        prefetch=prepared.prefetch,
        lookahead=prepared.residency.lookahead if prepared.residency is not None else None,
        offload_after_call=prepared.offload_after_call,
        relayout=prepared.relayout,
        pipeline=target.obj if target.is_pipeline else None,
        refuse_edit=_refuse_fusing_packed,
        strict=prepared.request.strict,
        storage=prepared.request.storage.name if prepared.request.storage is not None else None,
    )
    runtime.install(reserved)
    return runtime, ledger


def _revive(previous: Handle, failure: BaseException, quantized: dict) -> None:
    """A re-apply failed after the old mode was removed: put the old mode back, so that a refused
    apply changes nothing. The old handle becomes active again."""
    if not previous._removed:
        return
    try:
        prepared = previous.prepared.refreshed()  # the weights may have changed since it was prepared
        session = prepared.open_session()
        try:
            runtime, ledger = install(prepared, session)
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
    previous.prepared = prepared
    previous._runtime, previous._ledger, previous._removed = runtime, ledger, False
    previous._attach()
    if quantized:
        logger.warning(
            "memmode: the new mode failed after quantizing %s; the previous mode %s is back, on the quantized weights",
            ", ".join(quantized),
            previous.mode,
        )


#: edits that add a delta into the existing weights
FUSING_METHODS = ("fuse_lora", "fuse_qkv_projections")


def _refuse_fusing_packed(method: str, components: dict[str, nn.Module]) -> None:
    """Fusing into a quantized weight would add to packed codes. memmode refuses rather than
    dequantize-add-requantize: the unfused adapter runs at ``weight_dtype`` on top of the dequantized
    base, exactly, at the cost of its two small matmuls (docs/quantizers.md has the measurements)."""
    if method not in FUSING_METHODS:
        return
    for name, component in components.items():
        for path, module in component.named_modules():
            base = getattr(module, "base_layer", None) if method == "fuse_lora" else module
            if isinstance(base, nn.Module) and quantization.packed_record(base) is not None:
                what = "LoRA adapters" if method == "fuse_lora" else "projections"
                raise IncompatibleModeError(
                    f"{method}: {name}.{path} is quantized, and fusing {what} into packed weights would corrupt them. "
                    f"Keep the adapter unfused (it runs at weight_dtype on the dequantized weight), or fuse before "
                    f"applying the quantizer."
                )


def _placing(whole: Target) -> list[Handle]:
    """The active handles now placing ``whole`` or any of its components, its own first: what ``execute``
    takes off before placing, and puts back if that fails.

    Another target's handle is there when pipelines share components (``from_pipe``): the placement moves
    to this pipeline. A bare module placed as a component of a pipeline is refused: placing it alone would
    take the mode off the rest of that pipeline (diffusers refuses a model-level offload there too).
    """
    own = handle_of(whole.obj)
    handles = [own] if own is not None else []
    for module in whole.components.values():
        other = getattr(module, HANDLE_ATTRIBUTE, None)
        if not isinstance(other, Handle) or not other.active or any(other is h for h in handles):
            continue
        if not whole.is_pipeline:
            raise IncompatibleModeError(
                f"{type(module).__name__} is already placed by memmode mode {other.mode!r} applied to "
                f"{type(other.target).__name__}, as its component {_name_in(other, module)!r}; placing it alone "
                f"would take that mode off the rest of the pipeline. Call remove() on that first, or apply the "
                f"mode to a pipeline that has this component (the placement then moves to it)"
            )
        handles.append(other)
    return handles


def _name_in(handle: Handle, module: nn.Module) -> str:
    return next((name for name, m in handle._components.items() if m is module), "?")


def _log_moves(prepared: Prepared, placing: list[Handle]) -> None:
    """Say which placements moved here from another target, and what they placed that is placed no more."""
    obj = prepared.whole.obj
    placed = {id(m) for m in prepared.target.components.values()}
    for old in placing:
        if old.target is obj:
            continue
        left = [name for name, m in old._components.items() if id(m) not in placed]
        unplaced = f"; its {', '.join(left)} no longer placed (not placed by the new mode)" if left else ""
        logger.info(
            "memmode: the placement moved from %s (mode %s) to %s (mode %s)%s",
            _describe(old.target),
            old.mode,
            _describe(obj),
            prepared.mode,
            unplaced,
        )


def _describe(obj: Any) -> str:
    return f"{type(obj).__name__} at {id(obj):#x}"


def convert(quantizer: Any, module: nn.Module, **kwargs: Any):
    """Pack ``module``'s layers in a quantizer's format ahead of ``apply`` (the order FSDP2 needs).

    ``quantizer``: a registered name (``"qfloat4"``) or a ``Quantizer``; see
    :func:`memmode_core.quantization.convert` for the rest.
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
