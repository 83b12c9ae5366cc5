"""A drop-in for VideoX-Fun's ``apply_gpu_memory_mode``: switch a script by changing one import.

    # from videox_fun.utils.gpu_memory_mode import apply_gpu_memory_mode
    from memmode_core.compat import apply_gpu_memory_mode

    apply_gpu_memory_mode(pipeline, GPU_memory_mode, device, weight_dtype=weight_dtype)

Same signature (the mode second, or as ``GPU_memory_mode=`` / ``mode=``), same mode strings, same
placements (``model_group_offload`` streams leaf by leaf with CUDA streams, as the original does), and
VideoX-Fun's ``safe_enable_group_offload`` arguments with their meaning. ``transformers=`` takes the
modules a script holds, wrapped (FSDP, DDP, ``torch.compile``) or not; ``exclude_module_name`` matches by
substring as VideoX-Fun does (``""`` matches everything: nothing is quantized). LoRAs must be merged
before a quantized mode: an in-place merge into a quantized layer afterwards (VideoX-Fun's ``merge_lora``)
is refused before anything changes (docs/videox-fun.md). Where it behaves better:

- ``model_group_offload_and_<quant>`` works (the original refuses the pair): the quantized bytes
  stream.
- any installed quantizer or storage plugin is available, and a first-party one that is missing
  says what to ``pip install``.
- ``weight_dtype=None`` with a quantizer computes in the model's own dtype instead of raising.
- it returns a :class:`memmode_core.Handle` (``.report()``, ``.remove()``).

Like the original, an unknown *placement* with ``strict=False`` logs a loud warning and falls back
to a full load (pass ``strict=True`` to raise instead), and an unknown *quantizer* always raises.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from memmode_core.applying import apply
from memmode_core.builtin.placements import SMALL_TABLES
from memmode_core.contracts.devices import resolve_device
from memmode_core.contracts.errors import InvalidOptionError
from memmode_core.contracts.targets import Target
from memmode_core.discovery.first_party import DEFAULT_STORAGE
from memmode_core.discovery.grammar import SEPARATOR, lookup
from memmode_core.discovery.plugins import current
from memmode_core.engine.streams import active
from memmode_core.handle import Handle

logger = logging.getLogger("memmode.compat")


#: VideoX-Fun's ``safe_enable_group_offload`` arguments the drop-in takes (see :func:`apply_gpu_memory_mode`)
GROUP_OFFLOAD_ARGUMENTS = (
    "onload_device",
    "offload_device",
    "use_stream",
    "offload_type",
    "num_blocks_per_group",
    "low_cpu_mem_usage",
)


def apply_gpu_memory_mode(
    pipeline: Any,
    GPU_memory_mode: str | None = None,
    device: Any = None,
    weight_dtype: torch.dtype | None = None,
    *,
    mode: str | None = None,
    transformers: Iterable[nn.Module] | None = None,
    exclude_module_name: Iterable[str] = ("modulation",),
    quant_tag: str | None = None,
    strict: bool = False,
    storage: str | None = None,
    onload_device: Any = None,
    offload_device: Any = None,
    use_stream: bool | None = None,
    offload_type: str | None = None,
    num_blocks_per_group: int | None = None,
    low_cpu_mem_usage: bool | None = None,
) -> Handle:
    """Quantize (if the mode asks for it) and place ``pipeline`` on ``device``; see the module docstring.

    The mode is the second positional argument, or the keyword ``GPU_memory_mode=`` (VideoX-Fun's scripts'
    variable) or ``mode=`` (the reference signature's name); giving both is a ``TypeError``.

    ``exclude_module_name``: fragments matched as VideoX-Fun matches them, by substring of the qualified
    layer name; an empty string is a substring of every name, so (as in VideoX-Fun, whose
    ``convert_model_weight_to_float8`` then converts nothing) the quantizer is skipped altogether and the
    placement runs alone (logged at INFO).

    The group-offload arguments of VideoX-Fun's ``safe_enable_group_offload`` are accepted with their
    meaning under ``model_group_offload`` (ignored, with an INFO line, under other placements):
    ``onload_device`` is ``device`` (both given and different: ``InvalidOptionError``); ``offload_device``
    must be the CPU (memmode's offloaded weights live in the ``storage``); ``offload_type`` and
    ``num_blocks_per_group`` go to the placement (default ``"leaf_level"``, as VideoX-Fun); ``use_stream``
    goes to the placement on CUDA and is ignored with an INFO line elsewhere; ``low_cpu_mem_usage=True``
    (diffusers: no up-front pinned copy) selects the ``ram`` storage unless ``storage=`` is given.
    """
    if mode is not None and GPU_memory_mode is not None:
        raise TypeError("apply_gpu_memory_mode() got the mode twice: pass GPU_memory_mode or mode=, not both")
    requested = GPU_memory_mode if GPU_memory_mode is not None else mode
    if requested is None:
        raise TypeError("apply_gpu_memory_mode() missing the mode: pass it second, or as GPU_memory_mode= / mode=")
    if not isinstance(requested, str):
        raise TypeError(f"GPU_memory_mode must be a string, got {type(requested).__name__}")
    placement, separator, quantizer = requested.rpartition(SEPARATOR)
    if not separator:
        placement, quantizer = requested, None
    if quant_tag is not None:
        quantizer = quant_tag
    plugins = current()
    if quantizer is not None:
        lookup(plugins, "quantizer", quantizer, mode=requested)  # an unknown quantizer always raises
    if plugins.get("placement", placement) is None:
        if strict:
            lookup(plugins, "placement", placement, mode=requested)
        logger.warning(
            "Unknown GPU_memory_mode placement %r (from %r); falling back to model_full_load with NO offloading. "
            "Installed placements: %s. Pass strict=True to turn this into an error.",
            placement,
            requested,
            ", ".join(plugins.names("placement")),
        )
        placement = "model_full_load"
    if isinstance(exclude_module_name, str):
        exclude_module_name = (exclude_module_name,)
    exclude = tuple(exclude_module_name or ())
    if quantizer is not None and "" in exclude:
        logger.info(
            "exclude_module_name contains '', which (as in VideoX-Fun) matches every layer name: nothing "
            "is quantized, %r runs as %r",
            requested,
            placement,
        )
        quantizer = None
        exclude = tuple(f for f in exclude if f)
    device = _onload_device(device, onload_device)
    group_arguments = {
        "offload_device": offload_device,
        "use_stream": use_stream,
        "offload_type": offload_type,
        "num_blocks_per_group": num_blocks_per_group,
        "low_cpu_mem_usage": low_cpu_mem_usage,
    }
    options: dict[str, Any] = {}
    if placement == "model_group_offload":
        options, storage = _group_offload_options(device, storage, **group_arguments)
    else:
        given = [name for name, value in group_arguments.items() if value is not None]
        if given:
            logger.info("%s: ignored, they apply to model_group_offload only (mode %r)", ", ".join(given), requested)
        if placement == "sequential_cpu_offload":
            options["keep_resident"] = tuple(dict.fromkeys(SMALL_TABLES + exclude))
    full_mode = placement if quantizer is None else f"{placement}{SEPARATOR}{quantizer}"
    handle = apply(
        pipeline,
        full_mode,
        device=device,
        weight_dtype=weight_dtype,
        storage=storage,
        components=_component_names(pipeline, transformers) if quantizer is not None else None,
        exclude=exclude if quantizer is not None else None,
        **options,
    )
    handle.requested_mode = requested
    return handle


def _onload_device(device: Any, onload_device: Any) -> Any:
    if onload_device is None:
        return device
    if device is not None and torch.device(device) != torch.device(onload_device):
        raise InvalidOptionError(
            f"device={device!r} and onload_device={onload_device!r} differ; they are the same "
            f"thing (the compute device): pass one"
        )
    return onload_device


def _group_offload_options(
    device: Any,
    storage: str | None,
    *,
    offload_device: Any,
    use_stream: bool | None,
    offload_type: str | None,
    num_blocks_per_group: int | None,
    low_cpu_mem_usage: bool | None,
) -> tuple[dict[str, Any], str | None]:
    """VideoX-Fun's ``safe_enable_group_offload`` arguments as memmode placement options and storage."""
    if offload_device is not None and torch.device(offload_device).type != "cpu":
        raise InvalidOptionError(
            f"offload_device={offload_device!r}: memmode offloads to CPU memory, in the storage you choose "
            f"(storage='ram' / 'pinned' / 'disk' / 'mmap'); pass offload_device='cpu' or leave it out"
        )
    options: dict[str, Any] = {"offload_type": offload_type or "leaf_level"}
    if num_blocks_per_group is not None:
        options["num_blocks_per_group"] = num_blocks_per_group
    if use_stream is not None:
        compute = torch.device(device) if device is not None else resolve_device(None)
        if use_stream and not active().has_streams(compute):
            logger.info(
                "use_stream=True ignored: streams need an accelerator as the compute device (device=%r)", device
            )
        else:
            options["use_stream"] = use_stream
    if low_cpu_mem_usage and storage is None:
        storage = DEFAULT_STORAGE  # diffusers' low_cpu_mem_usage: no pinned copy of the whole model up front
    return options, storage


def _component_names(pipeline: Any, transformers: Iterable[nn.Module] | None) -> list[str] | None:
    """The original takes modules; memmode names components. Map one to the other by identity."""
    if transformers is None:
        return None
    components = Target.of(pipeline).components
    names = []
    for module in transformers:
        if module is None:
            continue
        name = next((n for n, m in components.items() if _same_model(m, module)), None)
        if name is None:
            raise InvalidOptionError(
                f"transformers=: a {type(module).__name__} that is not one of the pipeline's components "
                f"({', '.join(components)}) nor the module one of them wraps; memmode quantizes whole components"
            )
        if name not in names:
            names.append(name)
    return names


#: attributes under which wrappers keep the module they wrap: FSDP1 (``module``, ``_fsdp_wrapped_module``),
#: DDP (``module``), ``torch.compile`` (``_orig_mod``)
_WRAPPED = ("_fsdp_wrapped_module", "module", "_orig_mod")


def _unwrapped(module: Any) -> list[Any]:
    """``module`` and the modules it wraps, outermost first."""
    chain = [module]
    while True:
        inner = next(
            (getattr(chain[-1], a, None) for a in _WRAPPED if isinstance(getattr(chain[-1], a, None), nn.Module)), None
        )
        if inner is None or any(inner is seen for seen in chain):
            return chain
        chain.append(inner)


def _same_model(component: Any, module: Any) -> bool:
    """Whether ``module`` is ``component``, by identity, or one wraps the other. After VideoX-Fun's FSDP
    path (``shard_model``) the script's local ``transformer`` is the inner module while the pipeline holds
    the wrapper (or the other way round)."""
    if not isinstance(component, nn.Module):
        return False
    outer, inner = _unwrapped(component), _unwrapped(module)
    return any(a is b for a in outer for b in inner)
