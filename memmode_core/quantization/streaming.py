"""Packing while streaming: a component's layers packed one at a time straight into a file that is mapped back.

Peak memory is one layer in full precision plus its packed form, where
:func:`~memmode_core.quantization.quantizing.quantize_component` holds every packed layer at once. ``load``
streams from the checkpoint's mapping; ``apply`` streams when the mode's storage keeps the offloaded bytes
elsewhere than in memory (a 14B model's packed layers were all in anonymous memory before the first was
stored). Ranks of one machine loading the same checkpoint pack each component once between them
(:mod:`memmode_core.files.made_once`): the file is named by how it is made, so the first rank packs and the
others map its file. Each layer is made packed, and running, by the one stage that makes packed layers
(:mod:`memmode_core.quantization.making`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from memmode_core.contracts.storage import is_placeholder
from memmode_core.engine.streams import active
from memmode_core.files.file_layout import FileLayout
from memmode_core.files.made_once import MadeOnce, recipe_of
from memmode_core.files.naming import content_name
from memmode_core.files.streamed import check_room, file_size, write_pieces
from memmode_core.quantization.making import make_selected
from memmode_core.quantization.selection import LayerSelection
from memmode_core.quantization.sizes import component_bytes, pack_checked


def _pack_specs(selection: LayerSelection) -> tuple[dict[int, str], dict[str, torch.Tensor]]:
    """The first path of each packed weight (tied ones are packed once), and the streamed file's layout."""
    firsts: dict[int, str] = {}
    specs: dict[str, torch.Tensor] = {}
    for layer in selection.to_pack:
        weight = layer.module.weight
        if id(weight) in firsts:
            continue
        firsts[id(weight)] = layer.path
        for name, (shape, dtype) in selection.sizes.specs(weight.shape, weight.dtype).items():
            specs[f"{layer.path}.{name}"] = torch.empty(shape, dtype=dtype, device="meta")
    return firsts, specs


def stream_pack_bytes(selection: LayerSelection) -> int:
    """Bytes :func:`stream_pack` writes to the staging folder for ``selection`` (known before packing a layer)."""
    return file_size(_pack_specs(selection)[1])


def stream_pack(
    selection: LayerSelection,
    *,
    staging_dir=None,
    mappings: list | None = None,
    device: torch.device | None = None,
    made_once: MadeOnce | None = None,
    source: object = None,
    weight_dtype: torch.dtype | None = None,
) -> int:
    """Pack what ``selection`` says one layer at a time into a streamed file and make the layers hold views
    of it, running in ``weight_dtype`` (else each in its own dtype). Returns the number of layers packed. Tied
    weights are packed once and stay shared. The file's mapping is appended to ``mappings`` when given.

    With ``made_once`` (ranks of one machine), the file is the one the ranks share, named by ``source`` (what
    names the weights: the checkpoint's files and the dtype they are read in) and by how they are packed: the
    first rank to ask packs, the others map its file.

    With an accelerator ``device`` each weight is packed there — uploaded, packed, its packed bytes brought
    back — instead of on the CPU's few cores (a 14B model packs at ~42 M parameters/s on two CPU cores): only
    one layer's weight and packed tensors are on the device at a time."""
    quantizer = selection.quantizer
    firsts, specs = _pack_specs(selection)
    streams = active()
    on_device = device is not None and streams.has_streams(device)

    def packed_here(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        if not on_device:
            return pack_checked(quantizer, selection.sizes, weight)
        packed = pack_checked(quantizer, selection.sizes, streams.to_device(weight.detach(), device))
        return {name: streams.to_host(tensor) for name, tensor in packed.items()}

    def pieces() -> Iterator[dict[str, torch.Tensor]]:
        for layer in selection.to_pack:
            if firsts[id(layer.module.weight)] == layer.path:
                packed = packed_here(layer.module.weight)
                yield {f"{layer.path}.{name}": tensor for name, tensor in packed.items()}

    if not specs:
        return 0
    if made_once is None:
        mapped = write_pieces(specs, pieces(), folder=staging_dir)
    elif source is None:
        raise ValueError("packing once for the ranks of a machine needs the source that names the weights")
    else:
        layout = FileLayout.of(specs)
        recipe = _recipe(selection, source, layout, device.type if on_device else "cpu")
        mapped = made_once.mapped(recipe, layout, lambda into: write_pieces(specs, pieces(), into=into))
    if mappings is not None:
        mappings.extend(mapped.flats)
    return make_selected(
        selection,
        lambda path, weight: {
            name: mapped[f"{path}.{name}"] for name in selection.sizes.specs(weight.shape, weight.dtype)
        },
        weight_dtype=weight_dtype,
    )


def _recipe(selection: LayerSelection, source: object, layout: FileLayout, where: str) -> str:
    """What names a component's packed file before it is packed: the weights' source, the quantizer (its name,
    format, module and version), where it packs, each packed layer's path, shape and dtype, and the file's
    layout."""
    quantizer = selection.quantizer
    package = sys.modules.get(type(quantizer).__module__.partition(".")[0])
    layers = [
        (layer.path, tuple(layer.module.weight.shape), str(layer.module.weight.dtype)) for layer in selection.to_pack
    ]
    return recipe_of(
        source,
        quantizer.name,
        quantizer.format_name,
        type(quantizer).__module__,
        getattr(package, "__version__", None),
        where,
        layers,
        layout.header,
    )


@dataclass
class Streamed:
    """What :func:`stream_quantize` did: component -> (layers packed, bytes before), the mappings of the files
    the packed layers are views of, and the bytes written to them (or found written by another rank)."""

    packed: dict[str, tuple[int, int]]
    mappings: list[torch.Tensor]
    nbytes: int
    #: the files the ranks of this machine share, when this process is one of them, and the components packed there
    made_once: MadeOnce | None = None
    shared: frozenset[str] = frozenset()


def stream_bytes(selections: Mapping[str, LayerSelection]) -> dict[str, int]:
    """Bytes :func:`stream_quantize` writes for each component that has layers to pack."""
    return {name: stream_pack_bytes(s) for name, s in selections.items() if s.packs_anything}


def stream_quantize(
    selections: Mapping[str, LayerSelection],
    *,
    staging_dir=None,
    device: torch.device | None = None,
    made_once: MadeOnce | None = None,
    sources: Mapping[str, object] | None = None,
    weight_dtype: torch.dtype | None = None,
) -> Streamed:
    """Quantize each component as ``selections`` say, one layer at a time into streamed files (see the module
    docstring): the packed layers are views of those files' pages, never all in anonymous memory. Their room
    is checked first, before a layer is packed. With ``made_once``, each component's file is packed once by the
    ranks of this machine (``sources``: component -> what names its weights; see :func:`stream_pack`)."""
    sizes = stream_bytes(selections)
    if sizes:
        quantizer = next(iter(selections.values())).quantizer
        where = made_once.path if made_once is not None else staging_dir
        check_room(where, sum(sizes.values()), f"quantizing {', '.join(sizes)} with {quantizer.name}")
    packed: dict[str, tuple[int, int]] = {}
    mappings: list[torch.Tensor] = []
    shared = set()
    for name in sizes:
        selection = selections[name]
        before = component_bytes(selection.component)
        source = None if sources is None else sources.get(name)
        once = made_once if source is not None else None  # weights nothing names are packed by each rank
        count = stream_pack(
            selection,
            staging_dir=staging_dir,
            mappings=mappings,
            device=device,
            made_once=once,
            source=source,
            weight_dtype=weight_dtype,
        )
        packed[name] = (count, before)
        if once is not None:
            shared.add(name)
    return Streamed(packed, mappings, sum(sizes.values()), made_once, frozenset(shared))


def weights_source(selection: LayerSelection) -> str | None:
    """What names the weights ``selection`` packs when no checkpoint does (``apply`` on weights in memory): a
    digest of their bytes (BLAKE3, ~6 GB/s per core, against ~0.1 GB/s to pack them), or None where they are
    not all in CPU memory."""
    weights = {}
    for layer in selection.to_pack:
        weight = layer.module.weight
        if weight.device.type != "cpu" or is_placeholder(weight):
            return None
        weights.setdefault(f"{layer.path}.weight", weight.detach())
    return content_name(FileLayout.of(weights), weights) if weights else None
