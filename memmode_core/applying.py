"""``prepare``, ``apply`` and ``remove``: a mode planned for a target, executed on it, and taken off again.

``prepare(target, mode, **kw)`` builds the request once (:meth:`~memmode_core.planning.request.Request.build`)
and prepares it while the target is untouched: a concrete mode is laid out, claimed, selected and sized by the
planning layer (:func:`~memmode_core.planning.prepared.prepare_target`); a mode whose placement slot names a
resolver (``auto``) is handed to that resolver (:meth:`Resolver.resolve`), which returns the candidate it
chose, prepared. The plan is sealed: ``apply(target, mode, **kw)`` is ``execute(prepare(target, mode, **kw))``,
and :func:`execute` reads, in the order of the contract:

1. find the modes placing the target now (:func:`memmode_core.handover.placing`);
2. make room in the storage, while nothing has been touched;
3. take the old modes off;
4. pack what the plan selects (:func:`memmode_core.layer_packing.pack`: from the weights in memory, or, for
   ``load``, from the checkpoint they are views of, which it names with a
   :class:`~memmode_core.layer_packing.FromCheckpoint`);
5. install the engine, and return the handle.

Applying a mode to a target that already has one replaces the placement cleanly: the old one is removed
(weights back in ordinary memory) only after the new one has been fully validated, and if the new one fails
after that, the old one is put back (:mod:`memmode_core.handover`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from memmode_core import quantization
from memmode_core.contracts.targets import Target
from memmode_core.discovery.grammar import lookup
from memmode_core.discovery.plugins import current
from memmode_core.engine.ledger import Ledger
from memmode_core.engine.placement_layout import Relayout
from memmode_core.engine.runtime import Runtime
from memmode_core.files import give_back_freed_memory
from memmode_core.handle import Handle, handle_of
from memmode_core.handover import placing, put_back, say_moves
from memmode_core.layer_packing import FromCheckpoint, lent_while_storing, pack, refuse_stale_selection
from memmode_core.planning.prepared import Prepared, prepare_target
from memmode_core.planning.request import Request

logger = logging.getLogger("memmode")


def prepare(
    target: Any,
    mode: str,
    *,
    device: Any = None,
    weight_dtype: torch.dtype | None = None,
    storage: str | None = None,
    offload_dir: Any = None,
    components: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    unplaced: Iterable[str] | None = None,
    strict: bool = False,
    reserve: Any = None,
    **options: Any,
) -> Prepared:
    """Resolve, check, lay out, claim, select and size ``mode`` for ``target`` (a diffusers pipeline or an
    ``nn.Module``) without touching it; arguments are those of :func:`apply`, which executes the result:
    ``memmode.apply(memmode.prepare(pipe, mode))`` is ``memmode.apply(pipe, mode)``."""
    request = Request.build(
        mode,
        device=device,
        weight_dtype=weight_dtype,
        storage=storage,
        offload_dir=offload_dir,
        components=components,
        exclude=exclude,
        unplaced=unplaced,
        strict=strict,
        reserve=reserve,
        options=options,
    )
    return prepare_request(target, request)


def prepare_request(target: Any, request: Request) -> Prepared:
    """:func:`prepare` for a request built already (``load`` builds it before the model exists)."""
    Target.of(target)  # what cannot be a target is refused first
    if request.resolver is not None:
        return request.resolver.resolve(target, request)
    return prepare_target(target, request)


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
    unplaced: Iterable[str] | None = None,
    strict: bool = False,
    reserve: Any = None,
    **options: Any,
) -> Handle:
    """Put ``target`` (a diffusers pipeline or an ``nn.Module``) into ``mode``; see the user guide.

    ``apply(prepared)`` executes a plan made by :func:`memmode_core.prepare` (inspected first, say).

    ``components`` and ``exclude`` choose what a quantizer touches: which components (default: the
    denoisers), and fragments of layer names it keeps at full precision. ``unplaced`` names pipeline
    components the placement leaves exactly where they are (diffusers' ``exclude_modules``): no hooks,
    nothing stored, nothing moved.

    ``strict=True``: refuse (``IncompatibleModeError``) rather than adjust the placement's layout where
    the model or the pipeline declares it must be (a component with ``_supports_group_offloading =
    False`` moved whole, one in the pipeline's ``_exclude_from_cpu_offload`` kept on the device; each
    adjustment is otherwise logged and noted in ``report().placement_notes``).

    ``reserve``: what to keep free on the device for what memmode does not own (another application, a model
    placed without memmode), as bytes (``"2GiB"``) or a share of its memory (``0.1``, ``"10%"``). Every handle on
    an accelerator shares its memory (:mod:`memmode_core.engine.device_share`): before each call the free memory is
    read again, and what the call needs is made room for, from what idle handles keep first.
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
        unplaced=unplaced,
        strict=strict,
        reserve=reserve,
        **options,
    )
    return execute(prepared)


def execute(prepared: Prepared, checkpoint: FromCheckpoint | None = None) -> Handle:
    """Act on a prepared plan (see the module docstring); ``checkpoint``: the target's weights are views of a
    checkpoint ``load`` bound, and its layers are packed while they are read."""
    internal = prepared.internal
    taken_off = placing(internal.whole)
    refuse_stale_selection(internal)
    session = open_session(prepared)
    try:  # room for what will be stored, before packing: a refusal leaves the target untouched
        if session is not None:
            session.reserve(internal.stored_sizes)
    except BaseException:
        session.close()
        raise

    summaries: dict[str, Any] = {}
    try:
        for previous in taken_off:
            previous.remove()
        packing = pack(internal, checkpoint)
        summaries = packing.summaries
        with lent_while_storing(internal, packing.streamed, checkpoint):
            runtime, ledger = install(prepared, session, internal.stored_sizes)
    except BaseException as exc:
        if session is not None:
            session.close()
        for previous in taken_off:
            put_back(previous, exc, summaries, install_prepared)
        raise
    finally:
        give_back_freed_memory()  # what packing and storing freed: the heap kept GiBs past apply
    if summaries:
        logger.info("memmode: %s quantized %s with %s", internal.target.label, ", ".join(summaries), prepared.quantizer)
    handle = Handle(prepared, runtime, ledger, summaries, streamed=packing.streamed)
    handle.attach()
    say_moves(prepared, taken_off)
    return handle


def open_session(prepared: Prepared):
    """A storage session for executing ``prepared`` (None when the placement offloads nothing)."""
    request = prepared.internal.request
    if request.storage is None:
        return None
    return request.storage.obj.open(
        device=request.device, offload_dir=request.offload_dir, options=request.storage_options
    )


def install(prepared: Prepared, session, reserved: dict[str, int] | None = None) -> tuple[Runtime, Ledger]:
    """Install the engine for ``prepared``'s placement on its (packed) target, storing through ``session``."""
    internal = prepared.internal
    request, target, residency = internal.request, internal.target, internal.residency
    ledger = Ledger()
    runtime = Runtime(
        target.components,
        internal.groups,
        device=request.device,
        session=session,
        ledger=ledger,
        prefetch=internal.prefetch,
        lookahead=internal.lookahead,
        offload_after_call=internal.offload_after_call,
        relayout=Relayout(
            request.placement.obj,
            target,
            request.placement_options,
            request.device,
            strict=request.strict,
            kept=residency.kept if residency is not None else frozenset(),
        ),
        pipeline=target.obj if target.is_pipeline else None,
        refuse_edit=quantization.refuse_fusing_packed,
        strict=request.strict,
        storage=request.storage_name,
        label=target.label,
        reserve=request.reserve,
        activations={name: trace.activation_peak for name, trace in (request.traces or {}).items()},
    )
    runtime.install(reserved)
    return runtime, ledger


def install_prepared(prepared: Prepared) -> tuple[Runtime, Ledger]:
    """Open a session for ``prepared`` and install its engine (what putting a mode back does); the session is
    closed if that fails."""
    session = open_session(prepared)
    try:
        return install(prepared, session)
    except BaseException:
        if session is not None:
            session.close()
        raise


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
