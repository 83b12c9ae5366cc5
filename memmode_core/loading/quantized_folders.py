"""A model's folder that a library saved quantized, read as one weight file is.

diffusers' ``save_pretrained`` of a model quantized with a ``quantization_config`` (ModelOpt's export, bitsandbytes,
quanto) writes the config into the component's ``config.json`` and the library's tensors — codes, scales, quant
states — into its safetensors checkpoint, under the model's own names. Such a folder enters the read path of single
files (:mod:`memmode_core.loading.single_file`) and nothing else: core opens the checkpoint (every shard's header
checked), the reader whose ``quant_methods`` names the folder's method says which stored tensors are the model's and
which weights its codecs decode from parts (:meth:`~memmode_core.contracts.reader.Reader.read_folder`), and the
result is an :class:`~memmode_core.loading.single_file.OpenedFile` over the checkpoint restricted to those tensors —
from there the model is built, named, made packed and bound exactly as for a file.

The method is named as diffusers names it (``DiffusersAutoQuantizer``: ``"bitsandbytes"`` with ``load_in_4bit`` is
``bitsandbytes_4bit``). Every method diffusers knows is either read by an installed reader or refused here, before
anything is bound, with the reason and what loads it instead (:data:`NOT_READ`); a method nobody knows is refused
naming it. Both are :class:`~memmode_core.contracts.errors.CheckpointError`: the folder cannot be loaded as it is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from memmode_core.contracts.errors import CheckpointError, PluginLoadError
from memmode_core.contracts.reader import QuantizedFolder, Reader, StoredTensor
from memmode_core.files import Checkpoint
from memmode_core.files.checkpoint import CheckpointFile, TensorRecord
from memmode_core.loading.single_file import OpenedFile
from memmode_core.loading.skeleton import build

#: what loads a folder memmode does not read: the model as its library loads it, handed to memmode
_INSTEAD = (
    "load the component with diffusers' from_pretrained (the library quantizes or restores it) and hand the "
    "pipeline to memmode.apply, which places it as it is (it needs the whole model in memory once)"
)
#: the methods diffusers 0.42 knows (``diffusers.quantizers.auto.AUTO_QUANTIZER_MAPPING``) that no reader of
#: memmode reads, and why
NOT_READ: Mapping[str, str] = MappingProxyType(
    {
        "torchao": "torchao saves its quantized weights as pickled tensor subclasses (a .bin checkpoint, "
        "safe_serialization=False), which memmode does not unpickle; " + _INSTEAD + " (its storages keep "
        "torchao's tensor subclasses)",
        "gguf": "diffusers cannot save a GGUF-quantized model, so this folder was not written by it; load the "
        ".gguf file itself as the component (memmode.load(folder, mode, transformer='model.gguf'), with the "
        "memmode-gguf reader), or " + _INSTEAD,
        "bfl": "diffusers cannot save a model quantized with BFL's quantizer, so this folder was not written by "
        "it; " + _INSTEAD,
        "nunchaku_lite": "Nunchaku's SVDQuant layers quantize their activations in the forward (4-bit "
        "activations, nunchaku's kernels), which memmode cannot compute as they do; " + _INSTEAD,
        "auto-round": "AutoRound's packed int4 weights (qweight, qzeros, scales of its backends) are not read by "
        "memmode; " + _INSTEAD,
        "sdnq": "SDNQ's packed weights (SD.Next's quantizer) are not read by memmode; " + _INSTEAD,
    }
)


def quantization_config(folder: Path) -> Mapping[str, Any] | None:
    """The ``quantization_config`` of ``folder/config.json``, or None where there is none (or no config: the model
    build says what is missing)."""
    path = folder / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable model config ({exc})") from None
    found = config.get("quantization_config") if isinstance(config, dict) else None
    if found is None:
        return None
    if not isinstance(found, dict):
        raise CheckpointError(f"{path}: its quantization_config is {found!r}, not an object with a quant_method")
    return found


def quant_method(config: Mapping[str, Any], folder: Path, component: str) -> str:
    """The method as diffusers names it: bitsandbytes' one config is ``bitsandbytes_4bit`` or ``_8bit`` by its flags."""
    if config.get("load_in_4bit"):
        return "bitsandbytes_4bit"
    if config.get("load_in_8bit"):
        return "bitsandbytes_8bit"
    method = config.get("quant_method")
    if not isinstance(method, str) or not method:
        raise CheckpointError(
            f"{component} ({folder}): its config.json's quantization_config names no quant_method ({dict(config)!r})"
        )
    return method


def open_quantized_folder(
    folder: Path, component: str, cls: type, config: Mapping[str, Any], plugins, variant: str | None
) -> OpenedFile:
    """The checkpoint of ``folder``, quantized by the method its ``config`` names, as the reader of that method reads
    it: an opened file of the model's tensors. Refuses, before reading a tensor, a method no installed reader reads."""
    method = quant_method(config, folder, component)
    reader = reader_of_method(method, config.get("quant_method"), folder, component, plugins)
    checkpoint = Checkpoint.open(folder, variant=variant)
    shown = QuantizedFolder(
        where=folder,
        quantization_config=MappingProxyType(dict(config)),
        stored=MappingProxyType(
            {r.key: StoredTensor(r.key, r.dtype, r.shape, r.start, r.end) for r in checkpoint.records()}
        ),
        read=checkpoint.view,
        shapes=_ModelShapes(cls, folder, component),
    )
    try:
        contents = reader.read_folder(shown)
    finally:
        checkpoint.release()  # the windows the reader's reads mapped: the restricted checkpoint maps its own
    return OpenedFile.of(_restricted(checkpoint, contents.stored, reader), contents.encoded, reader.name)


def reader_of_method(method: str, written: Any, folder: Path, component: str, plugins) -> Reader:
    """The installed reader of ``method`` (or of the ``quant_method`` as ``written``), or the refusal: the reason a
    method diffusers knows is not read, or that nobody knows it."""
    for registration in plugins.registrations["reader"].values():
        reader: Reader = registration.obj
        if method not in reader.quant_methods and written not in reader.quant_methods:
            continue
        reason = registration.unavailable_reason()
        if reason is not None:
            raise CheckpointError(
                f"{component} ({folder}) was saved quantized with {method}, which the {reader.name} reader "
                f"({registration.distribution}) reads, but it cannot run: {reason}"
            )
        return reader
    if method in NOT_READ:
        raise CheckpointError(f"{component} ({folder}) was saved quantized with {method}: {NOT_READ[method]}")
    failed = [f for f in plugins.failures if "reader" in f.kinds]
    if failed:  # it may be the reader of this method
        raise PluginLoadError(
            f"{component} ({folder}) was saved quantized with {method}, which no installed reader reads, and the "
            f"reader plugin {failed[0].name} ({failed[0].distribution}) failed to load: {failed[0].reason}"
        )
    read = sorted({m for r in plugins.registrations["reader"].values() for m in r.obj.quant_methods})
    raise CheckpointError(
        f"{component} ({folder}): its config.json's quantization_config names quant_method {method!r}, which "
        f"memmode does not know (it reads folders quantized with {', '.join(read) or 'no method'}; diffusers' "
        f"other methods are refused with their reason: {', '.join(sorted(NOT_READ))})"
    )


def _restricted(checkpoint: Checkpoint, stored: Mapping[str, StoredTensor], reader: Reader) -> Checkpoint:
    """The checkpoint of only the tensors the reader gave, each record over bytes of the folder's own record of
    that name (a reader may view them in another dtype or shape; never outside them)."""
    where = checkpoint.where
    by_file: dict[Path, list[TensorRecord]] = {}
    for key, record in stored.items():
        if key not in checkpoint:
            raise CheckpointError(f"{where}: the {reader.name} reader gives tensor {key!r}, which is not in the folder")
        own = checkpoint.record(key)
        if not (own.start <= record.start and record.end <= own.end):
            raise CheckpointError(
                f"{where}: the {reader.name} reader reads tensor {key!r} from bytes {record.start}-{record.end}, "
                f"outside its own ({own.start}-{own.end})"
            )
        by_file.setdefault(own.path, []).append(
            TensorRecord(key, own.path, record.dtype, tuple(record.shape), record.start, record.end)
        )
    files = [
        CheckpointFile.of_records(file.path, by_file[file.path], file.metadata, file.size)
        for file in checkpoint.files
        if file.path in by_file
    ]
    return Checkpoint(files, where)


class _ModelShapes(Mapping[str, tuple[int, ...]]):
    """The model's tensor shapes from its config, the model built on the meta device when first asked."""

    def __init__(self, cls: type, folder: Path, component: str) -> None:
        self._build = (cls, folder, component)
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def _all(self) -> dict[str, tuple[int, ...]]:
        if self._shapes is None:
            module = build(*self._build[:2], None, self._build[2]).module
            self._shapes = {key: tuple(t.shape) for key, t in module.state_dict(keep_vars=True).items()}
        return self._shapes

    def __getitem__(self, key: str) -> tuple[int, ...]:
        return self._all()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())
