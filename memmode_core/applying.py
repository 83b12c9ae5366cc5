"""``prepare``, ``apply`` and ``remove``: a mode planned for a target, executed on it, and taken off again.

``prepare(target, mode, **kw)`` builds the request once (:class:`~memmode_core.planning.request.Request`) and
prepares it while the target is untouched: a concrete mode is laid out, claimed, selected and sized by the
planning layer (:func:`~memmode_core.planning.prepared.prepare_target`); a mode whose placement slot names a
resolver (``auto``) is handed to that resolver (:meth:`Resolver.resolve`), which returns the candidate it
chose, prepared. ``apply(target, mode, **kw)`` is ``execute(prepare(target, mode, **kw))``: :func:`execute`
acts in the order of the contract — make room in the storage, take the old mode off, quantize, place.
Applying a mode to a target that already has one replaces the placement cleanly: the old one is removed
(weights back in ordinary memory) only after the new one has been fully validated, and if the new one fails
after that, the old one is put back.

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
from memmode_core.engine.laying_out import Relayout
from memmode_core.engine.ledger import Ledger
from memmode_core.engine.runtime import Runtime
from memmode_core.files.borrowed import lending, source_of_mapping
from memmode_core.files.made_once import MadeOnce
from memmode_core.files.node import ranks_share_a_machine
from memmode_core.files.streamed import give_back_freed_memory
from memmode_core.handle import HANDLE_ATTRIBUTE, Handle, handle_of
from memmode_core.planning.prepared import Prepared, prepare_again, prepare_target
from memmode_core.planning.request import Request
from memmode_core.quantization import saved

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
    **options: Any,
) -> Prepared:
    """Resolve, check, lay out, claim, select and size ``mode`` for ``target`` (a diffusers pipeline or an
    ``nn.Module``) without touching it; arguments are those of :func:`apply`, which executes the result:
    ``memmode.apply(memmode.prepare(pipe, mode))`` is ``memmode.apply(pipe, mode)``."""
    request = Request.from_call(locals())
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
    """
    if isinstance(target, Prepared) and mode is None:
        return execute(target)
    request = Request.from_call(locals())
    return execute(prepare_request(target, request))


def execute(prepared: Prepared) -> Handle:
    """Act on a prepared plan: make room in the storage, take the old mode off, quantize, place."""
    placing = _placing(prepared._whole)
    _refuse_stale_quantization(prepared)
    session = open_session(prepared)
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
        quantized, streamed = _quantize(prepared)
        with lending(_lent(prepared, streamed)):
            runtime, ledger = install(prepared, session, prepared.stored_sizes)
    except BaseException as exc:
        if session is not None:
            session.close()
        for previous in placing:
            _revive(previous, exc, quantized)
        raise
    finally:
        give_back_freed_memory()  # what quantizing and storing freed: the heap kept GiBs past apply
    if quantized:
        logger.info(
            "memmode: %s quantized %s with %s", prepared._target.label, ", ".join(quantized), prepared.quantizer
        )
        _say_each_rank_holds_its_own_copy(prepared, quantized)
    handle = Handle(prepared, runtime, ledger, quantized)
    handle._attach()
    _log_moves(prepared, placing)
    return handle


def open_session(prepared: Prepared):
    """A storage session for executing ``prepared`` (None when the placement offloads nothing)."""
    request = prepared._request
    if request.storage is None:
        return None
    return request.storage.obj.open(
        device=request.device, offload_dir=request.offload_dir, options=request.storage_options
    )


def _quantize(prepared: Prepared) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Quantize each component as selected, and the mappings of the files it streamed packed layers into.

    A component quantized already (``load`` packs while streaming) only gets its dequantizing forward. Where
    the storage keeps the offloaded bytes elsewhere than in memory (a file, page-locked slabs), the layers are
    packed one at a time into a streamed file (:func:`~memmode_core.quantization.saved.stream_quantize`) that
    the storage then keeps or copies, instead of all at once in memory before the first group is stored: a
    14B transformer's packed layers took 13.6 GiB of anonymous memory that way."""
    request = prepared._request
    if request.quantizer is None:
        return {}, []
    quantizer = request.quantizer.obj
    ahead = dict(prepared._packed_ahead)
    pending = [name for name in prepared._selections if name not in ahead]  # not packed ahead by ``load``
    streamed = None
    # ranks of one machine: each component packed once, one copy for all (None: not one of N ranks)
    made_once = MadeOnce.for_ranks(request.offload_dir) if pending and request.packs_once_per_machine else None
    if pending and (_streams_packing(request) or made_once is not None):
        checked = {name: _checked(prepared, name, prepared._selections[name]) for name in pending}
        # what names the weights, for the ranks to agree on one file: a digest of them, taken only when shared
        sources = None if made_once is None else {name: saved.weights_source(s) for name, s in checked.items()}
        streamed = saved.stream_quantize(
            checked, staging_dir=request.offload_dir, device=request.device, made_once=made_once, sources=sources
        )
        ahead |= streamed.packed
        prepared._packed_by_ranks.update(streamed.shared)
    done: dict[str, Any] = {}
    targets = prepared._whole.components
    for name, selection in prepared._selections.items():
        module = targets[name]
        if name in ahead:
            packed_now, bytes_before = ahead[name]
            quantization.install_forwards(module, quantizer, request.weight_dtype)
            done[name] = quantization.summarize(quantizer, selection, packed_now, bytes_before)
        else:
            done[name] = quantization.quantize(
                quantizer,
                module,
                weight_dtype=request.weight_dtype,
                exclude=request.exclude,
                options=request.quantizer_options,
                name=name,
                selection=selection,
            )
    return done, streamed.mappings if streamed is not None else []


def _streams_packing(request: Request) -> bool:
    """Whether to pack into streamed files: core packs, and the storage is other than ``ram`` (which keeps the
    offloaded bytes in memory: there the packed layers are the stored copy)."""
    return request.core_packs and request.storage is not None and request.storage.name != "ram"


def _say_each_rank_holds_its_own_copy(prepared: Prepared, quantized: dict[str, Any]) -> None:
    """Ranks of one machine that keep packed weights in their own memory hold one copy each: said, with the
    storage that keeps one copy for all of them. The components packed into a file the ranks share
    (:mod:`memmode_core.files.made_once`) are one copy already; those whose weights nothing names (not all in CPU
    memory) or that a quantizer packs its own way are not."""
    own = [name for name in quantized if name not in prepared._packed_by_ranks]
    if not (own and prepared._request.packed_rest_on_host and ranks_share_a_machine()):
        return
    logger.warning(
        "memmode: rank %d keeps the packed weights of %s in its own memory, and so does every rank of this "
        "machine: storage='mmap' keeps one copy for all of them (the page cache)",
        torch.distributed.get_rank(),
        ", ".join(own),
    )


def _checked(prepared: Prepared, name: str, selection):
    """``selection`` after core's refusals for the component as it is now (``quantize_component`` runs them
    right before it packs; streaming packs too)."""
    request = prepared._request
    return quantization.check_component(
        request.quantizer.obj,
        name,
        prepared._whole.components[name],
        exclude=request.exclude,
        options=request.quantizer_options,
        selection=selection,
    )


def _lent(prepared: Prepared, mappings: list[torch.Tensor]) -> list:
    """The streamed files' mappings, lent to a file storage so that it keeps the groups lying in them instead of
    writing them again (``files.borrowed``); none when the files must outlive the session (``keep_files``)."""
    if getattr(prepared._request.storage_options, "keep_files", False):
        return []
    return [source_of_mapping(flat, None) for flat in mappings]


def _refuse_stale_quantization(prepared: Prepared) -> None:
    """A plan says which layers to pack; one of them packed since (the plan executed already, or the model
    quantized another way) would be packed twice. Refused before anything changes: prepare again."""
    for name, selection in prepared._selections.items():
        if name in prepared._packed_ahead or not selection.packs_anything:
            continue
        done = [layer.path for layer in selection.to_pack if quantization.packed_record(layer.module) is not None]
        if done:
            raise IncompatibleModeError(
                f"this plan of {prepared.mode} was prepared before {name}.{done[0]} was quantized (it was executed "
                f"already, or the model was quantized since); prepare it again"
            )


def install(prepared: Prepared, session, reserved: dict[str, int] | None = None) -> tuple[Runtime, Ledger]:
    """Install the engine for ``prepared``'s placement on its (quantized) target."""
    target, request, residency = prepared._target, prepared._request, prepared._residency
    ledger = Ledger()
    runtime = Runtime(
        target.components,
        prepared._groups,
        device=request.device,
        session=session,
        ledger=ledger,
        prefetch=prepared._prefetch,
        lookahead=residency.lookahead if residency is not None else None,
        offload_after_call=prepared._offload_after_call,
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
    )
    runtime.install(reserved)
    return runtime, ledger


def _revive(previous: Handle, failure: BaseException, quantized: dict) -> None:
    """A re-apply failed after the old mode was removed: put the old mode back, so that a refused
    apply changes nothing. The old handle becomes active again."""
    if not previous._removed:
        return
    try:
        prepared = prepare_again(previous.prepared)  # the weights may have changed since it was prepared
        session = open_session(prepared)
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
    obj = prepared._whole.obj
    placed = {id(m) for m in prepared._target.components.values()}
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
