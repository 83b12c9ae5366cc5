"""Which models a folder holds, and what each one is read from: checked, built as a skeleton, ready to bind.

``load`` and ``skeleton`` (what ``plan`` prices) share this front half — :func:`component_files` splits the files
given for components from the placement's options, :func:`open_components` reads every model's
:class:`~memmode_core.loading.sources.WeightSource` and builds its skeleton with the layers that rest packed made
(:func:`~memmode_core.quantization.making.make_placeholders`, their forward installed there, once), and
:meth:`Components.assemble` puts the pipeline together — so that what is refused (a truncated shard, a file of
another architecture, a format no installed quantizer or reader reads) is refused for both before a weight is
bound. A model is read from its subfolder's checkpoint (saved quantized by memmode or not), by its own library
where only the library can convert its names, from one file given in its place
(:mod:`memmode_core.loading.single_file`), or, where its folder was saved quantized by a library (its config's
``quantization_config``), by the reader of that library's format (:mod:`memmode_core.loading.quantized_folders`):
the last two take one road from the reader's tensors on.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memmode_core.contracts.errors import CheckpointError, InvalidOptionError
from memmode_core.contracts.targets import MODULE_COMPONENT, takes_timestep
from memmode_core.files import Checkpoint
from memmode_core.loading.binding import Binding, binding_for, model_tensors
from memmode_core.loading.dtypes import pipeline_dtype_keyword, resolve_dtype
from memmode_core.loading.quantized_folders import open_quantized_folder, quantization_config
from memmode_core.loading.single_file import OpenedFile, open_weights, weights_for_model
from memmode_core.loading.skeleton import Skeleton, build, is_weight_module_class, model_class, pipeline_index
from memmode_core.loading.sources import WeightSource, checkpoint_weights
from memmode_core.quantization.making import make_placeholders
from memmode_core.quantization.quantizing import encoded_by_a_file

logger = logging.getLogger("memmode")


@dataclass
class ComponentLoad:
    """One model of the folder, checked and ready to bind."""

    name: str
    #: the folder its config is read from
    folder: Path
    cls: type
    skeleton: Skeleton
    #: its weights: a folder's checkpoint, or one file's tensors under the model's names
    weights: WeightSource
    #: the ``torch_dtype`` it is built with: ``"auto"`` resolved to its checkpoint's dtype (but for
    #: transformers, which applies its own ``"auto"``)
    torch_dtype: torch.dtype | str | None = None
    #: what each of its tensors is read from (None: loaded by its library's own ``from_pretrained``, see
    #: :func:`_needs_library_loader`)
    binding: Binding | None = None

    @property
    def library_loaded(self) -> bool:
        return self.binding is None


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


@dataclass(frozen=True)
class Components:
    """What a folder holds (and the files given in place of its models), every model opened and checked."""

    folder: Path
    #: its ``model_index.json`` (None: one model's folder, or one file)
    index: dict | None
    loads: list[ComponentLoad]
    #: what the pipeline's other parts are loaded with (``"auto"`` resolved per model is in each load)
    torch_dtype: torch.dtype | str | None

    def assemble(self) -> Any:
        """The pipeline (or the one model) of the loads' models: what ``load`` places and ``plan`` prices."""
        if self.index is None:
            return self.loads[0].skeleton.module
        import diffusers

        pipeline_cls = getattr(diffusers, self.index.get("_class_name", ""), None)
        if pipeline_cls is None:
            raise CheckpointError(
                f"{self.folder}/model_index.json names {self.index.get('_class_name')!r}, not a diffusers pipeline"
            )
        built = {item.name: item.skeleton.module for item in self.loads}
        # every model is passed in; what is left (tokenizers, schedulers) takes no dtype, and "auto" is not one
        # diffusers 0.42 knows
        kwargs = {pipeline_dtype_keyword(): self.torch_dtype} if isinstance(self.torch_dtype, torch.dtype) else {}
        return pipeline_cls.from_pretrained(self.folder, **built, **kwargs)

    def release(self) -> None:
        """Drop every checkpoint's mappings (what was bound keeps its own alive)."""
        for item in self.loads:
            item.weights.release()


def open_components(
    folder: Path,
    files: dict[str, Path],
    *,
    torch_dtype,
    variant: str | None,
    plugins,
    quantizing: QuantizerTargets = QuantizerTargets(),
    weight_dtype: torch.dtype | None = None,
) -> Components:
    """Open every model of ``folder`` (and of ``files``, component -> the one file given in its place): its
    weights' source read and checked, its skeleton built with the layers that rest packed made, running in
    ``weight_dtype``, and what to bind from where. Nothing is bound yet."""
    index = pipeline_index(folder) if (folder / "model_index.json").is_file() else None
    if index is None:
        entries = [(MODULE_COMPONENT, folder, _single_model_class(folder))]
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
            opened = open_weights(files[name], plugins)
            loads.append(_opened_load(name, sub, cls, opened, torch_dtype, quantizing, weight_dtype))
            continue
        quantized = quantization_config(sub)
        if quantized is not None:
            opened = open_quantized_folder(sub, name, cls, quantized, plugins, variant)
            loads.append(_opened_load(name, sub, cls, opened, torch_dtype, quantizing, weight_dtype))
            continue
        checkpoint = Checkpoint.open(sub, variant=variant)
        weights = checkpoint_weights(checkpoint, plugins, quantizing.quantizer)
        dtype = resolve_dtype(torch_dtype, cls, checkpoint, name)
        skeleton = build(cls, sub, dtype, name)
        make_placeholders(skeleton.module, weights.packed, where=weights.where, weight_dtype=weight_dtype)
        item = ComponentLoad(name, sub, cls, skeleton, weights, torch_dtype=dtype)
        if not weights.packed and _needs_library_loader(skeleton, checkpoint):
            logger.info(
                "memmode: %s (%s) is loaded by %s itself: its checkpoint names tensors otherwise than "
                "the model, which only the library converts; it is read as from_pretrained reads it",
                name,
                cls.__name__,
                skeleton.library,
            )
        else:
            item.binding = binding_for(skeleton, weights, where=str(sub))
        loads.append(item)
    return Components(folder, index, loads, torch_dtype)


def _opened_load(
    name: str,
    config_folder: Path,
    cls: type,
    opened: OpenedFile,
    torch_dtype,
    quantizing: QuantizerTargets,
    weight_dtype: torch.dtype | None,
) -> ComponentLoad:
    """A component whose weights a reader read (one file given in its place, or its folder saved quantized by a
    library): the model built from ``config_folder``'s config, the reader's names mapped to the
    model's and its encoded layers made packed. A quantizer of the mode that would take the component is refused
    here, before anything is bound."""
    file = opened.checkpoint.where
    dtype = resolve_dtype(torch_dtype, cls, opened, name)
    skeleton = build(cls, config_folder, dtype, name)
    weights = weights_for_model(opened, skeleton, _config_of(skeleton.module), str(file))
    if weights.packed and quantizing.takes(name, skeleton.module):
        raise encoded_by_a_file(quantizing.quantizer, name, [layer.codec.format_name for layer in weights.packed])
    make_placeholders(skeleton.module, weights.packed, where=weights.where, weight_dtype=weight_dtype)
    item = ComponentLoad(name, config_folder, cls, skeleton, weights, torch_dtype=dtype)
    item.binding = binding_for(skeleton, weights, where=str(file))
    if weights.unused:
        logger.warning(
            "memmode: %d tensors of %s are not used by %s (e.g. %s)",
            len(weights.unused),
            file,
            cls.__name__,
            weights.unused[0],
        )
    return item


def _config_of(module) -> dict:
    """A model's config as a mapping: a diffusers config is one, a transformers config says it (``to_dict``)."""
    config = getattr(module, "config", None)
    if config is None:
        return {}
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


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
    names = {key for tensor in model_tensors(skeleton.module) for key in tensor.keys}
    return any(key not in names for key in checkpoint.keys())


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
