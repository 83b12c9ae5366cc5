"""Which models a folder holds, and what each one is read from: checked, built as a skeleton, ready to bind.

``load`` and ``skeleton`` (what ``plan`` prices) both start here, so that what is refused — a truncated shard, a
file of another architecture, a format no installed quantizer or reader reads — is refused for both before a
weight is bound. A model is read from its subfolder's checkpoint, from a quantized checkpoint memmode saved
(:mod:`memmode_core.quantization.saved`), by its own library where only the library can convert its names, or
from one file given in its place (:mod:`memmode_core.loading.single_file`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memmode_core.contracts.errors import CheckpointError, IncompatibleModeError, InvalidOptionError
from memmode_core.contracts.targets import MODULE_COMPONENT, takes_timestep
from memmode_core.files import Checkpoint
from memmode_core.loading.binding import Binding, binding_for, slots_of
from memmode_core.loading.dtypes import resolve_dtype
from memmode_core.loading.single_file import (
    PackedFromFile,
    WeightsFile,
    open_weights,
    prepare_packed_layers,
    weights_for_model,
)
from memmode_core.loading.skeleton import Skeleton, build, is_weight_module_class, model_class, pipeline_index
from memmode_core.quantization import install_forward, packed_record, saved
from memmode_core.quantization.quantizing import encoded_by_a_file

logger = logging.getLogger("memmode")


@dataclass
class ComponentLoad:
    """One model of the folder, checked and ready to bind."""

    name: str
    folder: Path
    skeleton: Skeleton
    #: its weights: a folder's checkpoint, or one file's tensors under the model's names
    checkpoint: Checkpoint | WeightsFile
    binding: Binding | None = None
    #: the format it was saved in by ``save_quantized``, and the quantizer that reads it
    saved_format: str | None = None
    reader: Any = None
    saved_layers: list = dataclasses.field(default_factory=list)
    #: loaded by its library's own ``from_pretrained`` (see :func:`_needs_library_loader`)
    library_loaded: bool = False
    cls: type | None = None
    #: the ``torch_dtype`` it is built with: ``"auto"`` resolved to its checkpoint's dtype (but for
    #: transformers, which applies its own ``"auto"``)
    torch_dtype: torch.dtype | str | None = None
    #: given as one file: the layers it keeps encoded, which rest packed (see :mod:`~memmode_core.loading.single_file`)
    file_layers: tuple[PackedFromFile, ...] = ()


@dataclass(frozen=True)
class QuantizerTargets:
    """Which components the mode's quantizer would take, known before the pipeline exists: those named by
    ``components=``, else the denoisers (a model whose forward takes the step), or a bare model."""

    quantizer: Any = None
    components: tuple[str, ...] | None = None

    def takes(self, name: str, module) -> bool:
        if self.quantizer is None:
            return False
        if self.components is not None:
            return name in self.components or name == MODULE_COMPONENT
        return name == MODULE_COMPONENT or takes_timestep(module)


def component_loads(
    folder: Path,
    index: dict | None,
    torch_dtype,
    variant,
    plugins,
    quantizer,
    files: dict[str, Path],
    quantizing: QuantizerTargets = QuantizerTargets(),
) -> list[ComponentLoad]:
    if index is None:
        cls = _single_model_class(folder)
        entries = [(MODULE_COMPONENT, folder, cls)]
    else:
        entries = []
        for name, value in index.items():
            if name.startswith("_") or not isinstance(value, (list, tuple)) or len(value) != 2 or value[0] is None:
                continue
            library, class_name = value
            cls = model_class(library, class_name)
            if is_weight_module_class(cls):
                entries.append((name, folder / name, cls))
        not_models = sorted(set(files) - {name for name, _, _ in entries})
        if not_models:
            raise InvalidOptionError(
                f"{not_models[0]}= names no model of the pipeline in {folder} (a file can take the place of "
                f"{', '.join(name for name, _, _ in entries)})"
            )
    loads = []
    for name, sub, cls in entries:
        if name in files:
            loads.append(_file_load(name, sub, cls, files[name], torch_dtype, plugins, quantizing))
            continue
        checkpoint = Checkpoint.open(sub, variant=variant)
        dtype = resolve_dtype(torch_dtype, cls, checkpoint, name)
        skeleton = build(cls, sub, dtype, name)
        item = ComponentLoad(name, sub, skeleton, checkpoint, torch_dtype=dtype)
        fmt = saved.saved_format(checkpoint.metadata)
        if fmt is not None:
            item.saved_format = fmt
            item.saved_layers = saved.saved_layers(checkpoint.metadata, str(sub))
            formats = sorted({layer.format for layer in item.saved_layers}) or [fmt]
            codecs = {f: _reader_for(f, plugins, quantizer, sub) for f in formats}
            saved.prepare_packed(skeleton.module, codecs, item.saved_layers, str(sub), _stored_in(checkpoint))
            if len(codecs) == 1:
                item.reader = codecs[formats[0]]
            else:  # several formats (a model loaded from a GGUF file): each layer's forward decodes with its own
                item.file_layers = tuple(
                    PackedFromFile(layer.path, codecs[layer.format], layer.shape, {}, layer.compute_dtype)
                    for layer in item.saved_layers
                )
        item.cls = cls
        if fmt is None and _needs_library_loader(skeleton, checkpoint):
            logger.info(
                "memmode: %s (%s) is loaded by %s itself: its checkpoint names tensors otherwise than "
                "the model, which only the library converts; it is read as from_pretrained reads it",
                name,
                cls.__name__,
                skeleton.library,
            )
            item.library_loaded = True
        else:
            item.binding = binding_for(skeleton, checkpoint, where=str(sub))
        loads.append(item)
    return loads


def _file_load(
    name: str, config_folder: Path, cls: type, file: Path, torch_dtype, plugins, quantizing: QuantizerTargets
) -> ComponentLoad:
    """A component given as one file: its header read by the reader that reads it, the model built from
    ``config_folder``'s config, the file's names mapped to the model's and its encoded layers made packed. A
    quantizer of the mode that would take the component is refused here, before anything is bound."""
    opened = open_weights(file, plugins)
    dtype = resolve_dtype(torch_dtype, cls, opened, name)
    skeleton = build(cls, config_folder, dtype, name)
    where = str(file)
    weights = weights_for_model(opened, skeleton, dict(getattr(skeleton.module, "config", None) or {}), where)
    if weights.packed and quantizing.takes(name, skeleton.module):
        raise encoded_by_a_file(quantizing.quantizer, name, [layer.codec.format_name for layer in weights.packed])
    prepare_packed_layers(skeleton, weights, where)
    item = ComponentLoad(name, config_folder, skeleton, weights, torch_dtype=dtype, cls=cls)
    item.binding = binding_for(skeleton, weights, where=where)
    item.file_layers = weights.packed
    if weights.unused:
        logger.warning(
            "memmode: %d tensors of %s are not used by %s (e.g. %s)",
            len(weights.unused),
            file,
            cls.__name__,
            weights.unused[0],
        )
    return item


def component_files(path: Path, config, options: dict) -> tuple[Path, dict[str, Path], dict]:
    """Split ``load``'s keywords into the components given as one file and the placement's options, and say
    which folder the configs are read from: ``path`` itself, or for a bare model file, ``config``."""
    if path.is_file():
        if config is None:
            raise InvalidOptionError(
                f"{path} is one file: give the model's config as config= (its model folder, or its config.json)"
            )
        config_path = Path(config)
        folder = config_path.parent if config_path.is_file() else config_path
        if config_path.is_file() and config_path.name != "config.json":
            raise InvalidOptionError(f"config={config!r} must be a model folder or a file named config.json")
        if (folder / "model_index.json").is_file():
            raise InvalidOptionError(
                f"config={config!r} is a pipeline folder: give the folder of the model the file holds "
                f"(its transformer/, say), or load the pipeline folder with the file as that component"
            )
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"config={config!r}: no config.json there")
        return folder, {MODULE_COMPONENT: path}, options
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or folder (load() takes a folder saved with save_pretrained)")
    if config is not None:
        raise InvalidOptionError(f"config= is for a bare model file; {path} is a folder, whose configs are used")
    names = set()
    if (path / "model_index.json").is_file():
        names = {name for name in pipeline_index(path) if not name.startswith("_")}
    files, rest = {}, {}
    for key, value in options.items():
        if key in names:
            if not isinstance(value, (str, os.PathLike)):
                raise InvalidOptionError(
                    f"{key}= takes the path of one weight file for that component, not {type(value).__name__}"
                )
            file = Path(value)
            if not file.is_file():
                raise CheckpointError(f"{key}={str(value)!r}: no such file")
            files[key] = file
        else:
            rest[key] = value
    return path, files, rest


def _needs_library_loader(skeleton: Skeleton, checkpoint: Checkpoint) -> bool:
    """A checkpoint that names its tensors otherwise than the model does: transformers 5 renames, merges and
    splits tensors of many architectures while loading, and diffusers renames the attention weights of
    older checkpoints (``_fix_state_dict_keys_on_load``). Only the library itself can load those."""
    names = {key for slot in slots_of(skeleton.module) for key in slot.keys}
    return any(key not in names for key in checkpoint.keys())


def _reader_for(fmt: str, plugins, quantizer, where: Path):
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


def _stored_in(checkpoint: Checkpoint):
    """``key`` -> the shape and dtype of the checkpoint's tensor ``key``, or None where it has none."""

    def stored(key: str):
        if key not in checkpoint:
            return None
        record = checkpoint.record(key)
        return tuple(record.shape), record.dtype

    return stored


def _single_model_class(folder: Path) -> type:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: neither model_index.json nor a readable config.json ({exc})") from None
    if "_class_name" in config:
        import diffusers

        cls = getattr(diffusers, config["_class_name"], None)
    else:
        import transformers

        architectures = config.get("architectures") or []
        cls = getattr(transformers, architectures[0], None) if architectures else None
    if cls is None:
        raise CheckpointError(f"{folder}/config.json names no model class memmode can import")
    return cls


def install_file_forwards(loads: list[ComponentLoad], weight_dtype: torch.dtype | None) -> None:
    """The forward of each layer a file keeps encoded: it decodes with the file's reader's codec, computing in
    ``weight_dtype`` or the dtype the model was built in."""
    for item in loads:
        for layer in item.file_layers:
            module = item.skeleton.module.get_submodule(layer.path)
            install_forward(module, layer.codec, weight_dtype or layer.compute_dtype or packed_record(module).dtype)
