"""The saved format: the metadata a quantized checkpoint carries, written by ``save_quantized`` and read by ``load``.

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

Packing into files while streaming is another idea: :mod:`memmode_core.quantization.streaming`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from memmode_core.contracts.errors import CheckpointError
from memmode_core.quantization.packed import packed_record

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
