"""The layer-packing stage: the layers a plan selects, packed in its quantizer's format — written once, for
``apply`` and ``load``. (Packing a *group*'s tensors into one flat buffer is another thing:
:mod:`memmode_core.contracts.packing`.)

A plan says which layers of each component its quantizer packs (``prepared.internal.selections``); this module
packs them, fed by one of two sources:

* **weights in memory** (``apply``): :func:`pack` packs each selected component in memory, or — where the
  storage keeps offloaded bytes elsewhere than in memory (a file, page-locked slabs), or the ranks of one machine
  pack once between them — one layer at a time into a streamed file that is mapped back;
* **a checkpoint streamed layer by layer** (``load``): :func:`pack_while_streaming` packs every selected
  component into streamed files as the checkpoint's pages are read, before the plan is executed, and returns
  what it did as a :class:`Packed` value. ``execute`` hands that to :func:`pack`, which then only installs the
  dequantizing forwards of those components.

Both go through one streaming routine (:func:`_stream`); the plan is never written into: what was packed ahead
travels as a :class:`Packed` value beside it.

Streamed files' mappings are lent to file storages (:func:`lent_while_storing`), which keep the groups lying in
them by reference instead of writing them again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from memmode_core import quantization
from memmode_core.contracts.errors import IncompatibleModeError
from memmode_core.files import MadeOnce, lending, ranks_share_a_machine, source_of_mapping
from memmode_core.planning.internal_plan import InternalPlan
from memmode_core.quantization import saved

logger = logging.getLogger("memmode")


@dataclass(frozen=True)
class Packed:
    """Layers packed into streamed files ahead of installing a mode: what was done, as a value."""

    #: component -> (layers packed, bytes of the component before packing)
    layers: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    #: the components packed into a file the ranks of this machine share (one copy for all of them)
    shared: frozenset[str] = frozenset()
    #: the streamed files' mappings (the packed layers are views of them)
    mappings: tuple[torch.Tensor, ...] = ()
    #: bytes written to streamed files
    nbytes: int = 0
    #: the ranks' shared maker, when the ranks of a machine packed once between them
    made_once: MadeOnce | None = None


#: nothing packed ahead
NOTHING = Packed()


def _stream(
    selections: Mapping[str, quantization.LayerSelection],
    *,
    staging_dir: Any,
    device: torch.device,
    made_once: MadeOnce | None,
    sources: Mapping[str, object] | None,
) -> Packed:
    """Pack ``selections`` one layer at a time into streamed files (``sources``: component -> what names its
    weights, for the ranks to agree on one file; see :func:`memmode_core.quantization.saved.stream_quantize`)."""
    streamed = saved.stream_quantize(
        selections, staging_dir=staging_dir, device=device, made_once=made_once, sources=sources
    )
    return Packed(streamed.packed, streamed.shared, tuple(streamed.mappings), streamed.nbytes, streamed.made_once)


def pack_while_streaming(internal: InternalPlan, *, staging_dir: Any, sources: Mapping[str, object]) -> Packed:
    """``load``'s feed: pack every component ``internal`` selects into streamed files while its checkpoint is
    read, before executing the plan (``sources``: component -> what names the checkpoint it was bound from;
    ranks of one machine pack each component once)."""
    quantizer = internal.request.quantizer.obj if internal.request.quantizer is not None else None
    if quantizer is None or not internal.selections:
        return NOTHING
    if not internal.request.core_packs:
        if quantization.overrides(quantizer, "quantize"):
            logger.info(
                "memmode: quantizer %s has its own quantize(); it quantizes the loaded model in memory",
                quantizer.name,
            )
        return NOTHING  # a forward-only quantizer has nothing to pack
    return _stream(
        internal.selections,
        staging_dir=staging_dir,
        device=internal.request.device,
        made_once=MadeOnce.for_ranks(under=staging_dir),
        sources=sources,
    )


@dataclass(frozen=True)
class Packing:
    """What :func:`pack` did: each component's quantizer summary, and what it streamed itself (whose mappings a
    file storage may keep groups in; what was packed ahead, its caller lends already)."""

    summaries: dict[str, Any]
    streamed_now: Packed = NOTHING


def pack(internal: InternalPlan, ahead: Packed = NOTHING) -> Packing:
    """``apply``'s feed: pack what ``internal`` selects from the weights in memory, but for the components
    packed ``ahead`` (by ``load``), which only get their dequantizing forward.

    Where the storage keeps the offloaded bytes elsewhere than in memory (a file, page-locked slabs), the layers
    are packed one at a time into a streamed file that the storage then keeps or copies, instead of all at once
    in memory before the first group is stored: a 14B transformer's packed layers took 13.6 GiB of anonymous
    memory that way. Ranks of one machine whose packed layers rest in host memory pack each component once and
    map one file."""
    request = internal.request
    if request.quantizer is None:
        return Packing({})
    quantizer = request.quantizer.obj
    pending = [name for name in internal.selections if name not in ahead.layers]
    made_once = MadeOnce.for_ranks(request.offload_dir) if pending and request.packs_once_per_machine else None
    now = NOTHING
    if pending and (_streams_packing(internal) or made_once is not None):
        checked = {name: _checked(internal, name) for name in pending}
        # what names the weights, for the ranks to agree on one file: a digest of them, taken only when shared
        sources = None if made_once is None else {name: saved.weights_source(s) for name, s in checked.items()}
        now = _stream(
            checked, staging_dir=request.offload_dir, device=request.device, made_once=made_once, sources=sources
        )
    packed_layers = {**ahead.layers, **now.layers}
    summaries: dict[str, Any] = {}
    for name, selection in internal.selections.items():
        module = internal.whole.components[name]
        if name in packed_layers:
            layers, bytes_before = packed_layers[name]
            quantization.install_forwards(module, quantizer, request.weight_dtype)
            summaries[name] = quantization.summarize(quantizer, selection, layers, bytes_before)
        else:
            summaries[name] = quantization.quantize(
                quantizer,
                module,
                weight_dtype=request.weight_dtype,
                exclude=request.exclude,
                options=request.quantizer_options,
                name=name,
                selection=selection,
            )
    if summaries:
        _say_each_rank_holds_its_own_copy(internal, summaries, ahead.shared | now.shared)
    return Packing(summaries, now)


def refuse_stale_selection(internal: InternalPlan, ahead: Packed) -> None:
    """A plan says which layers to pack; one of them packed since (the plan executed already, or the model
    quantized another way) would be packed twice. Refused before anything changes: prepare again."""
    for name, selection in internal.selections.items():
        if name in ahead.layers or not selection.packs_anything:
            continue
        done = [layer.path for layer in selection.to_pack if quantization.packed_record(layer.module) is not None]
        if done:
            raise IncompatibleModeError(
                f"this plan of {internal.request.mode} was prepared before {name}.{done[0]} was quantized (it was "
                f"executed already, or the model was quantized since); prepare it again"
            )


@contextmanager
def lent_while_storing(internal: InternalPlan, mappings: Iterable[torch.Tensor]) -> Iterator[None]:
    """Inside, file storages may keep the groups lying in the streamed files' ``mappings`` by reference instead of
    writing them again (:mod:`memmode_core.files.borrowed`); nothing is lent when the storage's files must
    outlive the session (``keep_files``)."""
    keep_files = getattr(internal.request.storage_options, "keep_files", False)
    with lending([] if keep_files else [source_of_mapping(flat, None) for flat in mappings]):
        yield


def _streams_packing(internal: InternalPlan) -> bool:
    """Whether to pack into streamed files: core packs, and the storage is other than ``ram`` (which keeps the
    offloaded bytes in memory: there the packed layers are the stored copy)."""
    request = internal.request
    return request.core_packs and request.storage is not None and request.storage.name != "ram"


def _checked(internal: InternalPlan, name: str) -> quantization.LayerSelection:
    """The selection of ``name`` after core's refusals for the component as it is now (``quantize`` runs them
    right before it packs; streaming packs too)."""
    request = internal.request
    return quantization.check_component(
        request.quantizer.obj,
        name,
        internal.whole.components[name],
        exclude=request.exclude,
        options=request.quantizer_options,
        selection=internal.selections[name],
    )


def _say_each_rank_holds_its_own_copy(
    internal: InternalPlan, summaries: Mapping[str, Any], shared: frozenset[str]
) -> None:
    """Ranks of one machine that keep packed weights in their own memory hold one copy each: said, with the
    storage that keeps one copy for all of them. The components packed into a file the ranks share
    (:mod:`memmode_core.files.made_once`) are one copy already; those whose weights nothing names (not all in CPU
    memory) or that a quantizer packs its own way are not."""
    own = [name for name in summaries if name not in shared]
    if not (own and internal.request.packed_rest_on_host and ranks_share_a_machine()):
        return
    logger.warning(
        "memmode: rank %d keeps the packed weights of %s in its own memory, and so does every rank of this "
        "machine: storage='mmap' keeps one copy for all of them (the page cache)",
        torch.distributed.get_rank(),
        ", ".join(own),
    )
