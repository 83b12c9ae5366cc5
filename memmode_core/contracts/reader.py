"""The reader contract: *which files* a model's weights can come from.

memmode reads safetensors itself. A file in another format — a GGUF file, a ComfyUI "fp8 scaled" safetensors
file — is read by a reader plugin, found through the same entry points as quantizers and storages, so that
``pip install memmode-gguf`` is what makes ``load(folder, mode, transformer="x-Q4_K_M.gguf")`` work.

A reader contributes only what is specific to its format: it parses the file's header — never its tensors —
and says where each tensor lies and how its bytes are read:

- a **stored** tensor (:class:`StoredTensor`) is a plain tensor: its bytes, viewed as ``dtype`` and ``shape``,
  are its value (a GGUF F32/F16/BF16 tensor, a bias, a norm);
- an **encoded** tensor (:class:`EncodedTensor`) is one whose value a codec computes from one or more stored
  tensors (a GGUF Q4_K weight: blocks of scales and 4-bit codes; an fp8 weight and its scale). Its codec is a
  :class:`~memmode_core.contracts.quantizer.Quantizer` whose ``unpack`` decodes the stored bytes: a layer whose
  weight is an encoded tensor *rests packed*, under every placement and storage, exactly as a layer memmode
  quantized itself, and is decoded by the forward on the compute device.

Core does the rest, for every format alike: it maps the tensors' names (a community file keeps the original
checkpoint's names; diffusers' own single-file conversion says what they are called in the model), checks the
file against the model before anything is bound, binds each stored tensor as a view of the file's pages, makes
each ``nn.Linear`` whose weight is encoded a packed layer holding views of the encoded bytes, decodes at load
the few encoded tensors that are not a linear layer's weight (a patch embedding), and prices the result for
``plan`` from the header alone.

A complete reader of a made-up format "rows8" — int8 codes with one float32 scale per row, the codes at
``<key>`` and the scales at ``<key>.scale`` of a safetensors-like file parsed elsewhere — is::

    class Rows8Codec(memmode_core.Quantizer):
        name = format = "rows8"
        packs = False                                      # a codec of files: it never packs weights itself

        def unpack(self, packed, shape, dtype):
            codes, scale = packed["weight_packed"], packed["weight_scale"]
            return (codes.float() * scale.float()[:, None]).reshape(shape).to(dtype)

    class Rows8Reader(memmode_core.Reader):
        name = "rows8"
        description = "int8 rows with a float32 scale each"
        suffixes = (".rows8",)

        def reads(self, path, head):
            return head.startswith(b"ROWS8")

        def read(self, path):
            stored, encoded = parse_my_header(path)        # StoredTensor and EncodedTensor records
            return memmode_core.FileContents(stored, encoded, metadata={}, size=path.stat().st_size)

A reader may also read **folders a library saved quantized** (kit 1.2): a component folder whose ``config.json``
holds ``"quantization_config": {"quant_method": ...}`` (diffusers' ``save_pretrained`` of a model quantized with
bitsandbytes, quanto, ModelOpt, ...). Core opens the folder's safetensors checkpoint (every shard) and shows the
reader a :class:`QuantizedFolder` — the config and every stored tensor — and the reader whose
:attr:`Reader.quant_methods` names the method says, in :meth:`Reader.read_folder`, which stored tensors are the
model's and which are decoded from parts. From there a folder is read exactly as a file is.

docs/writing-a-plugin.md has the page in full.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memmode_core.contracts.quantizer import PAYLOAD, Quantizer


@dataclass(frozen=True)
class StoredTensor:
    """One tensor's bytes in a file: ``dtype`` and ``shape`` say how the bytes from ``start`` to ``end``
    (absolute offsets in the file) are viewed. For a plain tensor that is its value, so ``shape`` is its real
    shape (a tensor a tool stored reshaped is given back in its real shape: the bytes are the same)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class EncodedTensor:
    """A tensor whose value ``codec.unpack(parts, shape, dtype)`` computes from stored tensors.

    ``parts`` maps each name ``unpack`` reads (:data:`~memmode_core.contracts.quantizer.PAYLOAD` first, the
    others ``weight_*``) to the key of the stored tensor that holds it. Core keeps the encoded tensor packed
    where it is a linear layer's weight: the payload takes the weight's place (an integer dtype, as for every
    packed layer: a float8 payload is stored viewed as ``uint8``), the other parts become buffers.

    Splitting along rows: diffusers' conversion of an original checkpoint splits some weights along their
    first dimension (Flux's fused ``qkv``). A part whose stored first dimension equals ``shape[0]`` is split
    with it (the codes of whole rows, a scale per row); a part of one element is shared (a scale for the whole
    tensor). Any other part cannot follow a split: such a tensor is decoded whole at load when split.
    """

    key: str
    shape: tuple[int, ...]
    #: the dtype ``unpack`` decodes exactly in (float32 for GGUF blocks and fp8 with a float32 scale)
    dtype: torch.dtype
    codec: Quantizer
    parts: Mapping[str, str]

    def __post_init__(self) -> None:
        if next(iter(self.parts), None) != PAYLOAD:
            raise ValueError(f"{self.key}: an encoded tensor's parts start with {PAYLOAD!r}, got {list(self.parts)}")


@dataclass(frozen=True)
class FileContents:
    """What a reader found in a file's header: every stored tensor, the encoded ones built on them, the file's
    metadata (strings) and its size in bytes (core checks every byte range against it before mapping).

    The tensors of the model are the encoded tensors and the stored tensors that are not a part of one."""

    stored: Mapping[str, StoredTensor]
    encoded: Mapping[str, EncodedTensor] = field(default_factory=dict)
    metadata: Mapping[str, str] = field(default_factory=dict)
    size: int = 0


@dataclass(frozen=True)
class QuantizedFolder:
    """A model's folder that a library saved quantized, as a reader is shown it.

    Core has read the folder's ``config.json`` and the headers of its safetensors checkpoint (all shards) and
    checked every byte range; no tensor data is read unless the reader asks for it with :attr:`read`."""

    #: the component's folder (for messages)
    where: Path
    #: config.json's ``"quantization_config"``, as written
    quantization_config: Mapping[str, Any]
    #: every tensor of its checkpoint (all shards), by name
    stored: Mapping[str, StoredTensor]
    #: one stored tensor's value (a view of the file's pages): for the few small tensors a reader must look at
    #: (a bitsandbytes quant_state, a scale to check)
    read: Callable[[str], torch.Tensor]
    #: the shapes of the model's tensors, by the model's (state-dict) names, from its config: for a format that
    #: does not store a weight's shape (quanto's int4 rows); the model is built on the meta device on first use
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


class Reader:
    """Base class of every reader: a format of weight files memmode can load from. Subclasses set ``name``,
    ``description`` and ``suffixes`` and implement :meth:`reads` and :meth:`read`; a reader of folders a library
    saved quantized sets :attr:`quant_methods` and implements :meth:`read_folder` (either or both)."""

    name: str = ""
    description: str = ""
    #: the file name endings of the format (``.gguf``): a file with one of them that no installed reader
    #: reads is refused naming the distribution to install
    suffixes: tuple[str, ...] = ()
    #: the ``quant_method`` values (a component config's ``quantization_config``) of the folders this reader
    #: reads with :meth:`read_folder` (kit 1.2); empty for a reader of files only
    quant_methods: tuple[str, ...] = ()

    def reads(self, path: Path, head: bytes) -> bool:
        """Whether this reader reads the file at ``path``, whose first bytes are ``head`` (at least 64 of
        them, fewer only for a shorter file). Readers are asked before core's own safetensors reading: a
        reader of a safetensors dialect (ComfyUI's fp8 scaled files) says yes only to files of its dialect.
        No file by default: a reader of quantized folders only (kit 1.2) need not write it."""
        return False

    def read(self, path: Path) -> FileContents:
        """Parse the header of ``path``: where each tensor lies and how it is read. Read no tensor data.

        A file that is damaged (truncated, a header that contradicts itself) or that holds a type the reader
        cannot decode raises :class:`~memmode_core.contracts.errors.CheckpointError` naming the file and the
        tensor; core checks every byte range against the file's size besides."""
        raise NotImplementedError

    def read_folder(self, folder: QuantizedFolder) -> FileContents:
        """The folder's tensors as :class:`FileContents` (kit 1.2; for a reader with :attr:`quant_methods`).

        ``stored`` = the stored tensors of the model and the parts of encoded tensors (records taken from
        ``folder.stored``, unchanged; what is left out is not the model's: an activation scale kept by the
        library, a marker); ``encoded`` = the model's tensors that are decoded from parts, under the model's
        names (``<layer>.weight``); ``metadata`` = anything worth reporting (strings); ``size`` is left 0 (core
        checked every shard's ranges). Raise :class:`~memmode_core.contracts.errors.CheckpointError` naming the
        folder and the tensor for anything damaged or unknown (a quant_type the reader does not decode, a
        scale of the wrong shape, a non-finite scale)."""
        raise NotImplementedError

    def codecs(self) -> Mapping[str, Quantizer]:
        """The codecs of the encoded tensors this reader makes, by format name (``Quantizer.format_name``:
        ``"gguf_q4_k"`` -> its codec). Optional (none by default): it is what lets ``load`` read back a model
        saved with :func:`memmode_core.save_quantized` whose layers rest in this reader's formats — they are
        kept packed as the file encoded them, and decoded by the same codec."""
        return {}

    def unavailable_reason(self) -> str | None:
        """Why this reader cannot run in this environment (a missing library), or None when it can."""
        return None

    def __repr__(self) -> str:
        return f"<reader {self.name}>"
