"""A component built from its config with no weight allocated: the shape the checkpoint is poured into.

Parameters are created on the meta device and the initializers do not run: building a 14B transformer
this way costs its config, not 57 GB and a minute of random numbers. Buffers are built for real (a
rotary table or ``position_ids`` computed in ``__init__`` is not always in the checkpoint).

Which dtype each tensor ends up with is the loading library's rule, reproduced exactly, because loading
into a mode must give what ``from_pretrained`` followed by ``apply`` gives, bit for bit:

- diffusers: the model is built with ``torch_dtype`` as the default dtype; floating tensors from the
  checkpoint take ``torch_dtype`` (float32 for the modules named by ``_keep_in_fp32_modules``), or, with
  no ``torch_dtype``, the dtype the module was built with.
- transformers: its own ``from_pretrained(device_map="meta")`` builds the skeleton, so its rules (``dtype``
  from the config, ``_keep_in_fp32_modules``, tied weights) are the ones applied; non-persistent buffers
  come from a second build with parameters on meta. Where ``from_pretrained`` hands the model to the hub
  kernels library (transformers 5.25 does by default, and ``kernels`` refuses the meta device), the skeleton is
  built with ``use_kernels=False`` and kernelized as ``from_pretrained`` does, once its weights are bound.

A library that cannot build a model this way (an update changed what it accepts) is a
:class:`~memmode_core.contracts.errors.ModelBuildError` naming the component and the library's version, never
the library's own exception from deep inside it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memmode_core.contracts.errors import CheckpointError, MemmodeError, ModelBuildError

#: the key of a model config under which a quantizing library says how it saved the weights
QUANTIZATION_CONFIG = "quantization_config"

_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside: every parameter registered on a module goes to the meta device; initializers do nothing."""
    register = nn.Module.register_parameter
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS if hasattr(nn.init, name)}

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    def skip(tensor, *args, **kwargs):
        return tensor

    nn.Module.register_parameter = on_meta
    for name in saved:
        setattr(nn.init, name, skip)
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        for name, function in saved.items():
            setattr(nn.init, name, function)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None or not dtype.is_floating_point:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@dataclass
class Skeleton:
    """A module with meta parameters, and the dtype each checkpoint tensor must be bound in."""

    module: nn.Module
    library: str
    #: state-dict key -> dtype it takes when loaded (floating tensors only; others keep the checkpoint's)
    dtypes: dict[str, torch.dtype]
    #: built with hub kernels off because its library kernelizes what it loads and cannot on the meta device:
    #: :func:`complete` kernelizes it, as ``from_pretrained`` does, once its weights are bound
    kernelize_when_bound: bool = False


def model_class(library: str, class_name: str) -> type:
    try:
        module = importlib.import_module(library)
        return getattr(module, class_name)
    except (ImportError, AttributeError) as exc:
        raise CheckpointError(f"{library}.{class_name} cannot be imported ({exc})") from None


def is_transformers_class(cls: type) -> bool:
    return _is_transformers(cls)


def is_weight_module_class(cls: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, nn.Module)


def build(cls: type, folder: Path, torch_dtype: torch.dtype | str | None, component: str) -> Skeleton:
    """The skeleton of the model class ``cls`` saved in ``folder`` (its config.json), the pipeline's
    ``component``. ``torch_dtype="auto"`` is passed on to transformers only (its own rule); a diffusers model
    takes a dtype, resolved by the caller."""
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder}: no config.json for {cls.__name__}")
    if _is_transformers(cls):
        library, build_with = "transformers", _transformers_skeleton
    elif hasattr(cls, "from_config") and hasattr(cls, "load_config"):
        library, build_with = "diffusers", _diffusers_skeleton
    else:
        raise CheckpointError(
            f"{cls.__module__}.{cls.__name__} is neither a diffusers nor a transformers model: "
            f"memmode cannot build it from {folder}"
        )
    with _library_errors(component, cls, library, "build it from its config without weights"):
        return build_with(cls, folder, torch_dtype)


def complete(skeleton: Skeleton, component: str) -> None:
    """What the library's ``from_pretrained`` does to a model after its weights are loaded, done once the
    skeleton's weights are bound: kernelizing it where the meta build could not (see the module docstring)."""
    if not skeleton.kernelize_when_bound:
        return
    cls = type(skeleton.module)
    with _library_errors(component, cls, skeleton.library, "hand it to the hub kernels, as from_pretrained does"):
        # the call from_pretrained makes (no kernel config, the mode from the model, the device it is on: the CPU)
        skeleton.module.set_use_kernels(True)


def library_version(library: str) -> str:
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return getattr(importlib.import_module(library), "__version__", "of unknown version")


@contextlib.contextmanager
def _library_errors(component: str, cls: type, library: str, doing: str) -> Iterator[None]:
    """A library's own exception while building ``component`` becomes a :class:`ModelBuildError` that names
    the component, the class and the library's version (what changed under memmode)."""
    try:
        yield
    except MemmodeError:
        raise
    except Exception as exc:
        version = library_version(library)
        raise ModelBuildError(
            f"{component} ({cls.__module__}.{cls.__name__}): {library} {version} could not {doing}: "
            f"{type(exc).__name__}: {exc}. memmode.load builds each model on the meta device before reading a "
            f"byte of it, and this release of {library} refuses that; loading with {library}'s from_pretrained "
            f"and then memmode.apply still works (it needs the whole model in memory once). Please report it "
            f"with this message.",
            component=component,
            library=library,
            library_version=version,
        ) from exc


def _is_transformers(cls: type) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return issubclass(cls, PreTrainedModel)


def _diffusers_skeleton(cls: type, folder: Path, torch_dtype: torch.dtype | None) -> Skeleton:
    if not (torch_dtype is None or isinstance(torch_dtype, torch.dtype)):
        raise TypeError(f"a diffusers skeleton is built in a dtype or None, not {torch_dtype!r}")
    # a folder a library saved quantized: memmode reads its format (loading/quantized_folders), the model is the
    # plain one it is decoded into, so the config's quantization_config is not the model's to act on
    config = {key: value for key, value in cls.load_config(folder).items() if key != QUANTIZATION_CONFIG}
    with parameters_on_meta(), default_dtype(torch_dtype):
        module = cls.from_config(config)
    module.eval()
    keep = list(getattr(cls, "_keep_in_fp32_modules", None) or [])
    dtypes = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if not tensor.is_floating_point():
            continue
        if torch_dtype is None:
            dtypes[key] = tensor.dtype
        elif any(name in key.split(".") for name in keep):
            dtypes[key] = torch.float32
        else:
            dtypes[key] = torch_dtype
    return Skeleton(module, "diffusers", dtypes)


def _transformers_skeleton(cls: type, folder: Path, torch_dtype: torch.dtype | None) -> Skeleton:
    import transformers

    quiet = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        kwargs = {"device_map": "meta"}
        config = _without_quantization(cls, folder)
        if config is not None:
            # the checkpoint holds the library's tensors (a 4-bit weight's packed codes [n/2, 1]), whose shapes are
            # not the model's: the folder's reader maps them, so transformers is not to check them against it
            kwargs.update(config=config, ignore_mismatched_sizes=True)
        if torch_dtype is not None:
            kwargs["dtype"] = torch_dtype  # "auto" too: transformers' own rule (the config's dtype, else the weights')
        module, kernelize_when_bound = _transformers_on_meta(cls, folder, kwargs)
        meta_buffers = [name for name, b in module.named_buffers() if b.is_meta]
        if meta_buffers:  # built for real once more, parameters on meta: the buffers __init__ computes
            with parameters_on_meta():
                fresh = cls._from_config(
                    module.config, **({"dtype": torch_dtype} if isinstance(torch_dtype, torch.dtype) else {})
                )
            real = dict(fresh.named_buffers())
            for name in meta_buffers:
                owner, _, leaf = name.rpartition(".")
                target = module.get_submodule(owner) if owner else module
                value = real.get(name)
                if value is not None and not value.is_meta:
                    target._buffers[leaf] = value.to(target._buffers[leaf].dtype)
    finally:
        transformers.logging.set_verbosity(quiet)
    module.eval()
    dtypes = {key: t.dtype for key, t in module.state_dict(keep_vars=True).items() if t.is_floating_point()}
    return Skeleton(module, "transformers", dtypes, kernelize_when_bound)


def _without_quantization(cls: type, folder: Path):
    """The transformers config of ``folder`` without its ``quantization_config`` (see :func:`_diffusers_skeleton`),
    or None where it has none (``from_pretrained`` reads the config itself)."""
    try:
        saved = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or QUANTIZATION_CONFIG not in saved:
        return None
    config = cls.config_class.from_pretrained(folder)
    if hasattr(config, QUANTIZATION_CONFIG):
        delattr(config, QUANTIZATION_CONFIG)
    return config


def _transformers_on_meta(cls: type, folder: Path, kwargs: dict) -> tuple[nn.Module, bool]:
    """``cls.from_pretrained`` on the meta device, as the library does it by default; and whether the model
    must be kernelized once bound.

    transformers 5.25 kernelizes every model it loads unless ``USE_HUB_KERNELS`` says no, and the kernels
    library refuses a model on the meta device. Asking the library as it is, first, keeps its own choice (an
    environment that turned kernels off, a release that does not kernelize); where that build fails and one
    with ``use_kernels=False`` succeeds, kernelizing is what failed, and it is done after binding instead."""
    try:
        return cls.from_pretrained(folder, **kwargs), False
    except Exception:
        if not hasattr(cls, "set_use_kernels"):  # a release without hub kernels: the failure is something else
            raise
    return cls.from_pretrained(folder, use_kernels=False, **kwargs), True


def pipeline_index(folder: Path) -> dict[str, Any]:
    path = folder / "model_index.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot be read as a diffusers pipeline index ({exc})") from None
