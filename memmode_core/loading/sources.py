"""What a component's weights are read from: one declared source, whatever the format.

``load`` reads a model from its folder's checkpoint, from a checkpoint memmode saved quantized, or from one file
given in its place (a GGUF, a ComfyUI file, a safetensors file with the original checkpoint's names; the formats
of reader plugins to come). Each is a :class:`WeightSource`, and everything after — binding, making packed layers,
lending pages to file storages, the report — asks only what the protocol declares:

- its tensors under the model's names (``keys``, ``record`` with shape, dtype and whether it is bound as a view,
  ``view``);
- the layers that rest packed (``packed``: :class:`~memmode_core.quantization.making.PackedSpec`, each with its
  codec, shape and compute dtype), which :func:`~memmode_core.quantization.making.make_placeholders` makes before
  binding fills them;
- its files and their mappings, what names it (``identity``: the ranks of one machine agree on a packed file by
  it), ``release``, and what it says of itself in ``report().loading`` (``summary``).

:class:`CheckpointWeights` is a folder's safetensors checkpoint, its saved packed layers read from its metadata
(:mod:`memmode_core.quantization.saved`); :class:`~memmode_core.loading.single_file.WeightsFile` is one file.
"""

from __future__ import annotations

from typing import Protocol

import torch

from memmode_core.contracts.errors import CheckpointError, IncompatibleModeError
from memmode_core.contracts.quantizer import PAYLOAD, Quantizer
from memmode_core.files import Checkpoint
from memmode_core.files.checkpoint import CheckpointFile
from memmode_core.quantization import saved
from memmode_core.quantization.making import PackedSpec
from memmode_core.quantization.sizes import PackedSizes


class TensorRecordLike(Protocol):
    """What a source says of one tensor before reading it."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def is_view(self) -> bool:
        """Whether reading it gives a view of the file's pages (else it is assembled or decoded at load)."""


class WeightSource(Protocol):
    """A component's weights, under the model's names (see the module docstring)."""

    #: where they are, for messages
    where: str
    #: the layers that rest packed
    packed: tuple[PackedSpec, ...]

    def keys(self) -> list[str]: ...

    def __contains__(self, key: str) -> bool: ...

    def record(self, key: str) -> TensorRecordLike: ...

    def view(self, key: str) -> torch.Tensor: ...

    @property
    def files(self) -> list[CheckpointFile]: ...

    def identity(self) -> tuple: ...

    def release(self) -> None: ...

    def summary(self) -> dict | None:
        """What ``report().loading["files"]`` says of it (None: nothing beyond the folder)."""


class CheckpointWeights:
    """A folder's safetensors checkpoint as a :class:`WeightSource`: its tensors as stored, and, for a checkpoint
    memmode saved quantized, its packed layers (:func:`checkpoint_weights` reads them)."""

    def __init__(self, checkpoint: Checkpoint, packed: tuple[PackedSpec, ...] = ()) -> None:
        self.checkpoint = checkpoint
        self.where = str(checkpoint.where)
        self.packed = packed

    def keys(self) -> list[str]:
        return self.checkpoint.keys()

    def __contains__(self, key: str) -> bool:
        return key in self.checkpoint

    def record(self, key: str):
        return self.checkpoint.record(key)

    def view(self, key: str) -> torch.Tensor:
        return self.checkpoint.view(key)

    @property
    def files(self) -> list[CheckpointFile]:
        return self.checkpoint.files

    def identity(self) -> tuple:
        return self.checkpoint.identity()

    def release(self) -> None:
        self.checkpoint.release()

    def summary(self) -> dict | None:
        return None


def checkpoint_weights(checkpoint: Checkpoint, plugins, quantizer: Quantizer | None) -> CheckpointWeights:
    """``checkpoint`` as a source: for one memmode saved quantized, each packed layer with the codec of its format
    (see :func:`codec_of_saved_format`) and its parts' shapes — the quantizer's, or, for a reader's codec, which
    packs nothing, as the checkpoint stores them."""
    metadata = checkpoint.metadata
    if saved.saved_format(metadata) is None:
        return CheckpointWeights(checkpoint)
    where = str(checkpoint.where)
    layers = saved.saved_layers(metadata, where)
    formats = sorted({layer.format for layer in layers})
    codecs = {fmt: codec_of_saved_format(fmt, plugins, quantizer, where) for fmt in formats}
    sizes: dict[int, PackedSizes] = {}
    specs = []
    for layer in layers:
        codec = codecs[layer.format]
        encoded = not getattr(codec, "packs", True)
        if encoded:
            parts = _stored_parts(checkpoint, layer, where)
        else:
            packs = sizes.setdefault(id(codec), PackedSizes(codec)).specs(torch.Size(layer.shape), layer.dtype)
            parts = {PAYLOAD: packs[PAYLOAD], **{n: s for n, s in packs.items() if n != PAYLOAD}}
            if tuple(parts) != layer.names:
                raise CheckpointError(
                    f"{where}: {layer.path} holds {list(layer.names)} and {codec.name} packs "
                    f"{list(parts)}: another version of the format"
                )
        specs.append(
            PackedSpec(
                layer.path,
                codec,
                layer.shape,
                layer.dtype,
                parts,
                compute_dtype=layer.compute_dtype,
                encoded_by=where if encoded else None,
            )
        )
    return CheckpointWeights(checkpoint, tuple(specs))


def _stored_parts(checkpoint: Checkpoint, layer: saved.SavedLayer, where: str) -> dict[str, tuple]:
    """The packed tensors of a layer a reader's codec decodes, as the checkpoint stores them."""
    if not layer.names or layer.names[0] != PAYLOAD:
        raise CheckpointError(f"{where}: {layer.path} holds {list(layer.names)}, not {PAYLOAD!r} first")
    parts = {}
    for name in layer.names:
        key = f"{layer.path}.{name}"
        if key not in checkpoint:
            raise CheckpointError(f"{where}: {key} ({layer.format}) is not in the checkpoint")
        record = checkpoint.record(key)
        parts[name] = (tuple(record.shape), record.dtype)
    return parts


def codec_of_saved_format(fmt: str, plugins, quantizer: Quantizer | None, where: str) -> Quantizer:
    """The codec of saved format ``fmt``: the mode's quantizer, which must write it; else an installed quantizer
    writing it, or a reader's codec of it (a layer loaded from a GGUF file and saved: :meth:`Reader.codecs`)."""
    codecs = [
        reg.obj for reg in plugins.registrations["quantizer"].values() if getattr(reg.obj, "format_name", None) == fmt
    ]
    if not codecs:
        for reg in plugins.registrations["reader"].values():
            codec = reg.obj.codecs().get(fmt)
            if codec is not None:
                codecs.append(codec)
    if quantizer is not None:
        if quantizer.format_name != fmt:
            if codecs and not getattr(codecs[0], "packs", True):
                raise IncompatibleModeError(
                    f"{where} holds layers a file encoded in {fmt}; memmode does not quantize again what the "
                    f"file quantized: use the mode without '_and_{quantizer.name}' (the layers rest packed under "
                    f"every placement and storage)"
                )
            raise IncompatibleModeError(
                f"{where} is saved quantized in {fmt}; the mode's quantizer {quantizer.name} "
                f"writes {quantizer.format_name}, and memmode does not re-quantize a quantized "
                f"model: use a mode with a {fmt} quantizer, or none"
            )
        return quantizer
    if not codecs:
        raise CheckpointError(
            f"{where} is saved quantized in format {fmt!r}, which no installed quantizer reads, nor any "
            f"installed reader's codec (pip install memmode-{fmt.split('_')[0]}?)"
        )
    return codecs[0]
