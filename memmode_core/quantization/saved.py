"""Packed layers in files: the metadata a quantized checkpoint carries, and quantizing while streaming.

A quantized checkpoint is an ordinary safetensors file whose packed layers are stored as their packed
tensors (``<layer>.weight_packed``, ``<layer>.weight_scale``, … — the attribute names the layer holds)
and whose ``__metadata__`` records what is needed to rebuild the layers without the full-precision
weights: the format, and each packed layer's full-precision shape, dtype and compute dtype. Anything a
reader needs beyond that is the format's codec (its ``unpack``): a quantizer's, or a reader's for a layer
loaded from a community file (a GGUF's blocks, :meth:`~memmode_core.contracts.reader.Reader.codecs`), which is
why a checkpoint in a format nothing installed reads is refused by name rather than guessed at.

Version ``"1"`` holds one format for the whole component (``memmode.format``). A component whose layers rest
in several formats — a GGUF file mixes block types — is written as version ``"2"``: each layer's entry names
its own format, and ``memmode.format`` lists them all (comma-separated). A component in one format is still
written as version ``"1"``, which every memmode reads; this one reads both.

Quantizing while streaming packs one layer at a time straight into a file (:mod:`memmode_core.files.streamed`):
peak memory is one layer in full precision plus its packed form, where
:func:`~memmode_core.quantization.quantizing.quantize_component` holds every packed layer at once. ``load``
streams from the checkpoint's mapping; ``apply`` streams when the mode's storage keeps the offloaded bytes
elsewhere than in memory (a 14B model's packed layers were all in anonymous memory before the first was
stored). Ranks of one machine loading the same checkpoint pack each component once between them
(:mod:`memmode_core.files.made_once`): the file is named by how it is made, so the first rank packs and the
others map its file.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from memmode_core.contracts.errors import CheckpointError
from memmode_core.contracts.quantizer import PAYLOAD, Quantizer
from memmode_core.contracts.storage import is_placeholder
from memmode_core.engine.streams import active
from memmode_core.files.file_layout import FileLayout
from memmode_core.files.made_once import MadeOnce, recipe_of
from memmode_core.files.naming import content_name
from memmode_core.files.streamed import check_room, file_size, write_pieces
from memmode_core.quantization.packed import attach_packed, packed_record
from memmode_core.quantization.selection import LayerSelection
from memmode_core.quantization.sizes import PackedSizes, component_bytes, pack_checked

FORMAT_KEY = "memmode.format"
LAYERS_KEY = "memmode.layers"
VERSION_KEY = "memmode.version"
#: the version written for a component in one format (what every memmode reads), and the one for several formats
VERSION = "1"
MIXED_VERSION = "2"
VERSIONS = (VERSION, MIXED_VERSION)


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in a quantized checkpoint's metadata")
    return dtype


@dataclass(frozen=True)
class SavedLayer:
    """What the metadata says of one packed layer."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    compute_dtype: torch.dtype | None
    names: tuple[str, ...]
    #: the format its packed tensors are in (version 1: the component's one format)
    format: str = ""


def packed_metadata(module: nn.Module) -> dict[str, str]:
    """The ``__metadata__`` describing every packed layer of ``module`` (empty if none is packed): version 1 for
    one format, version 2 (each layer's format in its entry) for several."""
    layers, formats = {}, {}
    for path, sub in module.named_modules():
        record = packed_record(sub)
        if record is None:
            continue
        formats[path] = record.format
        layers[path] = {
            "shape": list(record.shape),
            "dtype": _dtype_name(record.dtype),
            "compute_dtype": _dtype_name(record.compute_dtype),
            "names": list(record.names),
        }
    if not layers:
        return {}
    distinct = sorted(set(formats.values()))
    if len(distinct) == 1:
        version = VERSION
    else:
        version = MIXED_VERSION
        for path, entry in layers.items():
            entry["format"] = formats[path]
    return {
        FORMAT_KEY: ",".join(distinct),
        LAYERS_KEY: json.dumps(layers, separators=(",", ":")),
        VERSION_KEY: version,
    }


def saved_format(metadata: Mapping[str, str]) -> str | None:
    """The format a checkpoint was saved quantized in (version 2: its formats, comma-separated), or None for a
    checkpoint memmode did not save quantized."""
    return metadata.get(FORMAT_KEY)


def saved_layers(metadata: Mapping[str, str], where: str) -> list[SavedLayer]:
    version = metadata.get(VERSION_KEY)
    if version not in VERSIONS:
        raise CheckpointError(
            f"{where}: quantized by memmode format version {version!r}; this "
            f"memmode reads versions {', '.join(VERSIONS)}"
        )
    try:
        layers = json.loads(metadata[LAYERS_KEY])
        return [
            SavedLayer(
                path,
                tuple(int(d) for d in entry["shape"]),
                _dtype(entry["dtype"]),
                _dtype(entry.get("compute_dtype")),
                tuple(entry["names"]),
                metadata[FORMAT_KEY] if version == VERSION else str(entry["format"]),
            )
            for path, entry in layers.items()
        ]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{where}: the quantized layers' metadata cannot be read ({exc})") from None


def prepare_packed(
    module: nn.Module,
    codecs: Quantizer | Mapping[str, Quantizer],
    layers: list[SavedLayer],
    where: str,
    stored: Callable[[str], tuple[tuple[int, ...], torch.dtype] | None] | None = None,
) -> None:
    """Turn the skeleton's layers into packed layers holding meta tensors of the packed shapes, so that
    binding the checkpoint fills them like any other tensor.

    ``codecs``: the codec of each saved format (or the one codec of them all). The packed shapes are the
    quantizer's (its ``pack`` run on meta tensors, checked against the file when binding); a reader's codec,
    which packs nothing (``packs = False``: a GGUF block type), gives none, and they are the checkpoint's own:
    ``stored(key)`` says the shape and dtype of the checkpoint's tensor ``key`` (None where it has none). Such a
    layer holds the encoding of a file it was loaded from, and rests as it did then (``encoded_by``: the
    checkpoint)."""
    one = codecs if isinstance(codecs, Quantizer) else None
    sizes: dict[int, PackedSizes] = {}
    for layer in layers:
        codec = one if one is not None else codecs.get(layer.format)
        if codec is None:
            raise CheckpointError(f"{where}: no codec for {layer.path}'s format {layer.format!r}")
        try:
            sub = module.get_submodule(layer.path)
        except AttributeError:
            raise CheckpointError(f"{where}: packed layer {layer.path!r} is not in {type(module).__name__}") from None
        if not isinstance(sub, nn.Linear) or tuple(sub.weight.shape) != layer.shape:
            raise CheckpointError(
                f"{where}: packed layer {layer.path!r} is a {list(layer.shape)} weight, the model "
                f"has {type(sub).__name__} {list(getattr(sub, 'weight', torch.empty(0)).shape)}"
            )
        encoded = not getattr(codec, "packs", True)
        if encoded:
            specs = _stored_specs(layer, stored, where)
        else:
            specs = sizes.setdefault(id(codec), PackedSizes(codec)).specs(torch.Size(layer.shape), layer.dtype)
            if (PAYLOAD, *(n for n in specs if n != PAYLOAD)) != layer.names:
                raise CheckpointError(
                    f"{where}: {layer.path} holds {list(layer.names)} and {codec.name} packs "
                    f"{list(specs)}: another version of the format"
                )
        payload_shape, payload_dtype = specs[PAYLOAD]
        payload = nn.Parameter(torch.empty(payload_shape, dtype=payload_dtype, device="meta"), requires_grad=False)
        buffers = {n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in specs.items() if n != PAYLOAD}
        attach_packed(sub, codec.format_name, torch.Size(layer.shape), layer.dtype, payload, buffers, layer.path)
        if encoded:
            packed_record(sub).encoded_by = where


def _stored_specs(
    layer: SavedLayer, stored: Callable[[str], tuple[tuple[int, ...], torch.dtype] | None] | None, where: str
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The packed tensors of a layer a reader's codec decodes, as the checkpoint stores them."""
    if not layer.names or layer.names[0] != PAYLOAD:
        raise CheckpointError(f"{where}: {layer.path} holds {list(layer.names)}, not {PAYLOAD!r} first")
    specs = {}
    for name in layer.names:
        found = None if stored is None else stored(f"{layer.path}.{name}")
        if found is None:
            raise CheckpointError(f"{where}: {layer.path}.{name} ({layer.format}) is not in the checkpoint")
        shape, dtype = found
        specs[name] = (torch.Size(shape), dtype)
    return specs


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
) -> int:
    """Pack what ``selection`` says one layer at a time into a streamed file and make the layers hold views
    of it. Returns the number of layers packed. Tied weights are packed once and stay shared. The file's
    mapping is appended to ``mappings`` when given.

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
    shared: dict[int, tuple[nn.Parameter, dict[str, torch.Tensor]]] = {}
    for layer in selection.to_pack:
        weight = layer.module.weight
        if id(weight) not in shared:
            first = firsts[id(weight)]
            names = selection.sizes.specs(weight.shape, weight.dtype)
            payload = nn.Parameter(mapped[f"{first}.{PAYLOAD}"], requires_grad=False)
            shared[id(weight)] = (payload, {n: mapped[f"{first}.{n}"] for n in names if n != PAYLOAD}, weight)
        payload, buffers, _ = shared[id(weight)]
        attach_packed(layer.module, quantizer.format_name, weight.shape, weight.dtype, payload, buffers, layer.path)
    return len(selection.to_pack)


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
            selection, staging_dir=staging_dir, mappings=mappings, device=device, made_once=once, source=source
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
