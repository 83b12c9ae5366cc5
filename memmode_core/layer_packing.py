"""The layer-packing stage: the layers a plan selects, packed in its quantizer's format — once, for ``apply``
and ``load``, as step 4 of ``execute``. (Packing a *group*'s tensors into one flat buffer is another thing:
:mod:`memmode_core.contracts.packing`.)

A plan says which layers of each component its quantizer packs (``prepared.internal.selections``); :func:`pack`
packs them in one of two ways:

* **in memory**: each selected component packed at once, where its packed layers are the stored copy
  (``ram``, a full load);
* **one layer at a time into a streamed file** that is mapped back
  (:mod:`memmode_core.quantization.streaming`): where the storage keeps offloaded bytes elsewhere than in memory
  (a file, page-locked slabs), where the ranks of one machine pack once between them, and always for ``load``,
  whose weights are views of a checkpoint's pages (:class:`FromCheckpoint`: its staging folder and what names
  each component's weights, for the ranks to agree on one file).

Each layer is made packed, and running, by the one stage that makes packed layers
(:mod:`memmode_core.quantization.making`); what was streamed comes back as a :class:`Packed` value. Streamed
files' mappings are lent to file storages (:func:`lent_while_storing`), which keep the groups lying in them by
reference instead of writing them again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from memmode_core import quantization
from memmode_core.contracts.errors import IncompatibleModeError
from memmode_core.files import MadeOnce, lending, ranks_share_a_machine, source_of_mapping
from memmode_core.planning.internal_plan import InternalPlan
from memmode_core.quantization.streaming import stream_quantize, weights_source

logger = logging.getLogger("memmode")


@dataclass(frozen=True)
class FromCheckpoint:
    """``load``'s weights: views of a checkpoint's pages, packed while they are read into ``staging_dir``.

    ``sources``: component -> what names the weights it was bound from (the checkpoint's files, the dtype and
    variant they are read in), for the ranks of one machine to pack each component once. ``in_place``: ``load``'s
    argument, which says whether file storages may keep groups in the streamed files' pages (None: where no bit
    can change; True: wherever they lie; False: never)."""

    staging_dir: Any
    sources: Mapping[str, object]
    in_place: bool | None = None


@dataclass(frozen=True)
class Packed:
    """Layers packed into streamed files: what was done, as a value."""

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


#: nothing streamed
NOTHING = Packed()


@dataclass(frozen=True)
class Packing:
    """What :func:`pack` did: each component's quantizer summary, and what it streamed (whose mappings a file
    storage may keep groups in)."""

    summaries: dict[str, Any]
    streamed: Packed = NOTHING


def pack(internal: InternalPlan, checkpoint: FromCheckpoint | None = None) -> Packing:
    """Pack what ``internal`` selects (see the module docstring); ``checkpoint``: the weights are ``load``'s,
    views of a checkpoint.

    Where the storage keeps the offloaded bytes elsewhere than in memory (a file, page-locked slabs), the layers
    are packed one at a time into a streamed file that the storage then keeps or copies, instead of all at once
    in memory before the first group is stored: a 14B transformer's packed layers took 13.6 GiB of anonymous
    memory that way. Ranks of one machine whose packed layers rest in host memory pack each component once and
    map one file."""
    request = internal.request
    if request.quantizer is None:
        return Packing({})
    quantizer = request.quantizer.obj
    streamed = NOTHING
    if internal.selections and _streams(internal, checkpoint):
        checked = {name: _checked(internal, name) for name in internal.selections}
        if checkpoint is not None:
            staging_dir, sources = checkpoint.staging_dir, checkpoint.sources
            made_once = MadeOnce.for_ranks(staging_dir)
        else:
            staging_dir = request.offload_dir
            made_once = MadeOnce.for_ranks(staging_dir) if request.packs_once_per_machine else None
            # what names the weights, for the ranks to agree on one file: a digest of them, taken only when shared
            sources = None if made_once is None else {name: weights_source(s) for name, s in checked.items()}
        done = stream_quantize(
            checked,
            staging_dir=staging_dir,
            device=request.device,
            made_once=made_once,
            sources=sources,
            weight_dtype=request.weight_dtype,
        )
        streamed = Packed(done.packed, done.shared, tuple(done.mappings), done.nbytes, done.made_once)
    elif checkpoint is not None and internal.selections and quantization.overrides(quantizer, "quantize"):
        logger.info(
            "memmode: quantizer %s has its own quantize(); it quantizes the loaded model in memory", quantizer.name
        )
    summaries: dict[str, Any] = {}
    for name, selection in internal.selections.items():
        if name in streamed.layers:
            layers, bytes_before = streamed.layers[name]
            summaries[name] = quantization.summarize(quantizer, selection, layers, bytes_before)
        else:
            summaries[name] = quantization.quantize(
                quantizer,
                internal.whole.components[name],
                weight_dtype=request.weight_dtype,
                exclude=request.exclude,
                options=request.quantizer_options,
                name=name,
                selection=selection,
            )
    if summaries:
        _say_each_rank_holds_its_own_copy(internal, summaries, streamed.shared)
    return Packing(summaries, streamed)


def _streams(internal: InternalPlan, checkpoint: FromCheckpoint | None) -> bool:
    """Whether to pack into streamed files: core packs, and the weights are a checkpoint's, or the storage is
    other than ``ram`` (which keeps the offloaded bytes in memory: there the packed layers are the stored copy),
    or the ranks of this machine pack once between them."""
    request = internal.request
    if not request.core_packs:
        return False
    if checkpoint is not None:
        return True
    elsewhere = request.storage is not None and request.storage.name != "ram"
    return elsewhere or (request.packs_once_per_machine and ranks_share_a_machine())


def refuse_stale_selection(internal: InternalPlan) -> None:
    """A plan says which layers to pack; one of them packed since (the plan executed already, or the model
    quantized another way) would be packed twice. Refused before anything changes: prepare again."""
    for name, selection in internal.selections.items():
        if not selection.packs_anything:
            continue
        done = [layer.path for layer in selection.to_pack if quantization.packed_record(layer.module) is not None]
        if done:
            raise IncompatibleModeError(
                f"this plan of {internal.request.mode} was prepared before {name}.{done[0]} was quantized (it was "
                f"executed already, or the model was quantized since); prepare it again"
            )


@contextmanager
def lent_while_storing(
    internal: InternalPlan, streamed: Packed, checkpoint: FromCheckpoint | None = None
) -> Iterator[None]:
    """Inside, file storages may keep the groups lying in the streamed files by reference instead of writing them
    again (:mod:`memmode_core.files.borrowed`); nothing is lent when the storage's files must outlive the session
    (``keep_files``), nor when ``load`` was told ``in_place=False``, and with ``in_place=True`` a group is kept
    in place at any alignment."""
    keep_files = getattr(internal.request.storage_options, "keep_files", False)
    in_place = checkpoint.in_place if checkpoint is not None else None
    lent = [] if keep_files or in_place is False else streamed.mappings
    with lending([source_of_mapping(flat, None, any_alignment=in_place is True) for flat in lent]):
        yield


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
