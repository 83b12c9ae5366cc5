"""A model's weights given as one file — a GGUF, a ComfyUI fp8 file, a safetensors file with the original
checkpoint's names — read as the model's tensors, with what the file keeps encoded kept packed.

Community files differ from a diffusers folder in three ways, and each is answered once, here:

- **The format.** Which reader parses the file is asked of the installed reader plugins
  (:mod:`memmode_core.contracts.reader`), before core's own safetensors reading; a file that only an
  uninstalled first-party reader reads (``.gguf`` without memmode-gguf) is refused naming what to install.
- **The names.** The file keeps the original checkpoint's names; :func:`~memmode_core.loading.original_keys.
  diffusers_names` says which rows of which of its tensors each of the model's tensors is (diffusers' own
  conversion, traced), so a tensor diffusers splits (Flux's fused ``qkv``) is a run of rows of the file's.
- **The encoding.** A linear layer whose weight the file holds encoded (GGUF blocks, fp8 and a scale) rests
  packed (a :class:`~memmode_core.quantization.making.PackedSpec` of the file's codec): its parts are bound, like
  any tensor, as views of the file's pages, and its forward decodes on the compute device. What cannot stay
  encoded — an encoded tensor that is not a linear layer's weight (a patch embedding), or rows a split cannot
  cut out of the encoding — is decoded at load, one tensor at a time, into the staging file that converted
  tensors go to.

:class:`WeightsFile` is the file as a :class:`~memmode_core.loading.sources.WeightSource`, under the model's names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from memmode_core.contracts.errors import CheckpointError, PluginLoadError, PluginNotInstalledError
from memmode_core.contracts.quantizer import Quantizer
from memmode_core.contracts.reader import EncodedTensor, Reader
from memmode_core.discovery.first_party import DISTRIBUTIONS
from memmode_core.files import Checkpoint
from memmode_core.files.checkpoint import CheckpointFile
from memmode_core.loading.binding import model_tensors
from memmode_core.loading.original_keys import Rows, diffusers_names
from memmode_core.loading.skeleton import Skeleton
from memmode_core.quantization.making import PackedSpec

#: how many bytes of a file a reader is shown to recognise it
HEAD_BYTES = 64
#: file name endings first-party readers read: named when none installed reads such a file
FIRST_PARTY_SUFFIXES = {".gguf": "gguf"}


@dataclass(frozen=True)
class OpenedFile:
    """A weight file whose header was read: its stored tensors as a checkpoint, the encoded ones beside."""

    checkpoint: Checkpoint
    encoded: Mapping[str, EncodedTensor]
    #: the reader plugin's name, or "safetensors" for core's own reading
    reader: str

    @classmethod
    def of(cls, checkpoint: Checkpoint, encoded: Mapping[str, EncodedTensor], reader: str) -> OpenedFile:
        """What a reader found (a file's, or a quantized folder's: :mod:`~memmode_core.loading.quantized_folders`),
        checked: every part of an encoded tensor is a stored tensor it gave."""
        for tensor in encoded.values():
            absent = [key for key in tensor.parts.values() if key not in checkpoint]
            if absent:
                raise CheckpointError(
                    f"{checkpoint.where}: the {reader} reader encodes {tensor.key!r} from {absent[0]!r}, "
                    f"which it did not find in the file"
                )
        return cls(checkpoint, dict(encoded), reader)

    def part_keys(self) -> set[str]:
        """The stored tensors that are parts of an encoded one (not tensors of the model themselves)."""
        return {key for tensor in self.encoded.values() for key in tensor.parts.values()}

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the model the file holds, by the file's name: the encoded ones, and the stored ones
        that are not a part of one."""
        parts = self.part_keys()
        shapes = {key: tuple(t.shape) for key, t in self.encoded.items()}
        for record in self.checkpoint.records():
            if record.key not in parts and record.key not in shapes:
                shapes[record.key] = tuple(record.shape)
        return shapes

    def floating_dtype(self, skip_modules: tuple[str, ...] = ()) -> torch.dtype | None:
        """What ``torch_dtype="auto"`` loads the model in: the dtype of the file's plain tensors (an encoded tensor's
        parts do not count), and where they mix, the widest of them: a city96 GGUF keeps norms and biases F32 beside
        F16 tensors it did not quantize, so its model computes in float32 unless told, rounding nothing."""
        return self.checkpoint.floating_dtype(skip_modules, leaving_out=self.part_keys(), widest=True)


def open_weights(path: Path, plugins) -> OpenedFile:
    """Read the header of weight file ``path`` with the installed reader that reads it, else as safetensors."""
    try:
        with open(path, "rb") as file:
            head = file.read(HEAD_BYTES)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    reader = _reader_of_file(path, head, plugins)
    if reader is None:
        return OpenedFile(Checkpoint.open(path), {}, "safetensors")
    contents = reader.read(path)
    file = CheckpointFile.of_records(path, contents.stored.values(), contents.metadata, contents.size)
    return OpenedFile.of(Checkpoint([file], path), contents.encoded, reader.name)


def _reader_of_file(path: Path, head: bytes, plugins) -> Reader | None:
    for registration in plugins.registrations["reader"].values():
        reader: Reader = registration.obj
        if not reader.reads(path, head):
            continue
        reason = registration.unavailable_reason()
        if reason is not None:
            raise CheckpointError(
                f"{path}: the {reader.name} reader ({registration.distribution}) cannot run: {reason}"
            )
        return reader
    if path.suffix.lower() == ".safetensors" or _looks_like_safetensors(head):
        return None
    name = FIRST_PARTY_SUFFIXES.get(path.suffix.lower())
    failed = [f for f in plugins.failures if "reader" in f.kinds]
    if failed:
        raise PluginLoadError(
            f"{path}: no installed reader reads it, and the reader plugin {failed[0].name} "
            f"({failed[0].distribution}) failed to load: {failed[0].reason}"
        )
    if name is not None:
        distribution = DISTRIBUTIONS[("reader", name)]
        raise PluginNotInstalledError(
            f"{path} is a {name.upper()} file, which the {name} reader reads: pip install {distribution}"
        )
    readers = ", ".join(plugins.names("reader")) or "none"
    raise CheckpointError(
        f"{path}: not a safetensors file, and no installed reader reads it (installed readers: {readers})"
    )


def _looks_like_safetensors(head: bytes) -> bool:
    return len(head) > 9 and head[8:9] == b"{"


# -- the file's tensors under the model's names ---------------------------------------------------------------


@dataclass(frozen=True)
class FileTensor:
    """One tensor of the model, as rows of the file's tensors: the rows of ``pieces`` along dimension 0, in
    order. ``decoded``: the pieces are rows of encoded tensors (or of both kinds), decoded at load."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Rows, ...]
    decoded: bool = False

    @property
    def is_view(self) -> bool:
        """Bound as a view of the file's pages (one run of rows, nothing decoded), else copied at load."""
        return len(self.pieces) == 1 and not self.decoded


@dataclass(frozen=True)
class PackedFromFile:
    """A linear layer whose weight the file keeps encoded: it rests packed, its parts views of the file."""

    path: str
    codec: Quantizer
    shape: tuple[int, ...]
    #: part name (``weight_packed`` first) -> the tensor the layer registers under that name
    parts: Mapping[str, FileTensor]

    def spec(self, dtype: torch.dtype, where: str) -> PackedSpec:
        """What it is to the stage that makes packed layers: its weight computes in ``dtype``."""
        parts = {name: (part.shape, part.dtype) for name, part in self.parts.items()}
        return PackedSpec(self.path, self.codec, self.shape, dtype, parts, encoded_by=where)


class WeightsFile:
    """A component's weights in one file, as the model names them: a
    :class:`~memmode_core.loading.sources.WeightSource` (see the module docstring). ``unused``: the file's tensors
    no tensor of the model is made of."""

    def __init__(
        self,
        opened: OpenedFile,
        tensors: Mapping[str, FileTensor],
        packed: tuple[PackedSpec, ...],
        unused: tuple[str, ...],
    ) -> None:
        self.opened = opened
        self.where = str(opened.checkpoint.where)
        self.tensors = dict(tensors)
        self.packed = packed
        self.unused = unused

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def record(self, key: str) -> FileTensor:
        return self.tensors[key]

    def view(self, key: str) -> torch.Tensor:
        """The tensor: a view of the file's pages where it is one run of stored rows, else assembled (decoded
        where encoded) in memory — one tensor at a time, as binding converts them."""
        tensor = self.tensors[key]
        values = [self._rows(piece, tensor.dtype, tensor.decoded) for piece in tensor.pieces]
        value = values[0] if len(values) == 1 else torch.cat(values)
        return value.reshape(tensor.shape)

    def _rows(self, piece: Rows, dtype: torch.dtype, decoded: bool) -> torch.Tensor:
        """Rows of a stored tensor (a plain tensor, or a part of a packed layer: a reader may name a part as its
        encoded tensor, ``<layer>.weight`` for an fp8 payload), or, for a decoded tensor, of the model's tensor
        the file names ``piece.key``: encoded ones decoded whole."""
        encoded = self.opened.encoded.get(piece.key) if decoded else None
        if encoded is None:
            whole = self.opened.checkpoint.view(piece.key)
        else:
            parts = {name: self.opened.checkpoint.view(key) for name, key in encoded.parts.items()}
            whole = encoded.codec.unpack(parts, torch.Size(encoded.shape), encoded.dtype)
        rows = (
            whole
            if (piece.start, piece.stop) == (0, whole.shape[0] if whole.dim() else 1)
            else whole[piece.start : piece.stop]
        )
        return rows.to(dtype) if rows.dtype != dtype else rows

    def summary(self) -> dict:
        """What the file gave (``handle.report().loading["files"]``): its path and reader, the layers resting packed
        by format, and the tensors decoded at load (encoded, but not a linear layer's weight, or split otherwise
        than by whole rows)."""
        formats: dict[str, int] = {}
        for layer in self.packed:
            formats[layer.codec.format_name] = formats.get(layer.codec.format_name, 0) + 1
        return {
            "path": str(self.opened.checkpoint.where),
            "reader": self.opened.reader,
            "packed_layers": dict(sorted(formats.items())),
            "decoded_tensors": sum(1 for tensor in self.tensors.values() if tensor.decoded),
            "unused_tensors": len(self.unused),
        }

    @property
    def files(self) -> list[CheckpointFile]:
        return self.opened.checkpoint.files

    def identity(self) -> tuple:
        return self.opened.checkpoint.identity()

    def release(self) -> None:
        self.opened.checkpoint.release()


def weights_for_model(opened: OpenedFile, skeleton: Skeleton, config: Mapping, where: str) -> WeightsFile:
    """The file's tensors under ``skeleton``'s names (diffusers' conversion for its class, traced), each linear
    layer whose weight is encoded planned to rest packed."""
    module = skeleton.module
    model_tensors = module.state_dict(keep_vars=True)
    shapes = opened.tensor_shapes()
    try:
        renamed = diffusers_names(type(module), config, shapes, _names_to_find(module, shapes))
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc.__cause__
    linear = {f"{path}.weight": path for path, sub in module.named_modules() if isinstance(sub, nn.Linear) and path}
    tensors: dict[str, FileTensor] = {}
    packed: list[PackedSpec] = []
    for key, target in renamed.items():
        sources = [opened.encoded.get(piece.key) for piece in target.pieces]
        if not any(sources):
            dtype = _one_dtype(opened, target.pieces)
            tensors[key] = FileTensor(key, tuple(target.shape), dtype, tuple(target.pieces))
            continue
        layer = _packed_layer(opened, target.shape, target.pieces, linear.get(key)) if all(sources) else None
        if layer is not None:
            packed.append(layer.spec(skeleton.dtypes.get(key, model_tensors[key].dtype), where))
            tensors.update((part.key, part) for part in layer.parts.values())
        else:
            dtype = next(s.dtype for s in sources if s is not None)
            tensors[key] = FileTensor(key, tuple(target.shape), dtype, tuple(target.pieces), decoded=True)
    return WeightsFile(opened, tensors, tuple(packed), tuple(sorted(renamed.unused)))


def _names_to_find(module: nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The model's tensor names the file must hold: a tied tensor (a transformers encoder's ``shared`` and
    ``encoder.embed_tokens`` weights, saved once) under the name the file holds it by, else under all of them."""
    names = []
    for tensor in model_tensors(module):
        held = [key for key in tensor.keys if key in shapes]
        names += held[:1] or tensor.keys
    return names


def _one_dtype(opened: OpenedFile, pieces) -> torch.dtype:
    dtypes = {opened.checkpoint.record(piece.key).dtype for piece in pieces}
    dtype = dtypes.pop()
    for other in dtypes:
        dtype = torch.promote_types(dtype, other)
    return dtype


def _packed_layer(opened: OpenedFile, shape, pieces, path: str | None) -> PackedFromFile | None:
    """The packed layer ``path`` whose weight is ``pieces`` of encoded tensors, or None where it
    cannot rest packed: not a linear layer's weight, pieces in several codecs, or rows a part cannot follow (a
    part of one element — a scale of the whole tensor — is shared only by pieces of one tensor)."""
    if path is None or len(shape) != 2:
        return None
    encoded = [opened.encoded[piece.key] for piece in pieces]
    codec = encoded[0].codec
    if any(e.codec is not codec or list(e.parts) != list(encoded[0].parts) for e in encoded):
        return None
    parts: dict[str, FileTensor] = {}
    for name in encoded[0].parts:
        runs, shared = [], set()
        for piece, tensor in zip(pieces, encoded, strict=True):
            record = opened.checkpoint.record(tensor.parts[name])
            rows = record.shape[0] if record.shape else 1
            whole = (piece.start, piece.stop) == (0, tensor.shape[0])
            if record.shape and rows == tensor.shape[0]:
                runs.append(Rows(record.key, piece.start, piece.stop))
            elif math.prod(record.shape) == 1 and (whole or len(pieces) == 1 or len({p.key for p in pieces}) == 1):
                shared.add(record.key)
            elif whole:
                runs.append(Rows(record.key, 0, rows))
            else:
                return None
        if shared and (runs or len(shared) > 1):
            return None  # a scale of several tensors, or of part of one
        if shared:
            record = opened.checkpoint.record(shared.pop())
            runs = [Rows(record.key, 0, record.shape[0] if record.shape else 1)]
        first = opened.checkpoint.record(runs[0].key)
        rows = sum(run.stop - run.start for run in runs)
        part_shape = (rows, *first.shape[1:]) if first.shape else ()
        parts[name] = FileTensor(f"{path}.{name}", part_shape, first.dtype, tuple(runs))
    return PackedFromFile(path, codec, tuple(shape), parts)
