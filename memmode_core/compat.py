"""A drop-in for VideoX-Fun's ``apply_gpu_memory_mode``: switch a script by changing one import.

    # from videox_fun.utils.gpu_memory_mode import apply_gpu_memory_mode
    from memmode_core.compat import apply_gpu_memory_mode

    apply_gpu_memory_mode(pipeline, GPU_memory_mode, device, weight_dtype=weight_dtype)

Same signature, same mode strings, same placements (``model_group_offload`` streams leaf by leaf
with CUDA streams, as the original does). Where it behaves better:

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
from typing import Any, Iterable

import torch
from torch import nn

from .api import Handle, apply
from .builtin.placements import SMALL_TABLES
from .errors import InvalidOptionError
from .grammar import SEPARATOR, lookup
from .plugins import current
from .targets import Target

logger = logging.getLogger("memmode.compat")


def apply_gpu_memory_mode(pipeline: Any, GPU_memory_mode: str, device: Any, weight_dtype: torch.dtype | None = None,
                          *, transformers: Iterable[nn.Module] | None = None,
                          exclude_module_name: Iterable[str] = ("modulation",), quant_tag: str | None = None,
                          strict: bool = False) -> Handle:
    """Quantize (if the mode asks for it) and place ``pipeline`` on ``device``; see the module docstring."""
    if not isinstance(GPU_memory_mode, str):
        raise TypeError(f"GPU_memory_mode must be a string, got {type(GPU_memory_mode).__name__}")
    placement, separator, quantizer = GPU_memory_mode.rpartition(SEPARATOR)
    if not separator:
        placement, quantizer = GPU_memory_mode, None
    if quant_tag is not None:
        quantizer = quant_tag
    plugins = current()
    if quantizer is not None:
        lookup(plugins, "quantizer", quantizer, mode=GPU_memory_mode)  # an unknown quantizer always raises
    if plugins.get("placement", placement) is None:
        if strict:
            lookup(plugins, "placement", placement, mode=GPU_memory_mode)
        logger.warning(
            "Unknown GPU_memory_mode placement %r (from %r); falling back to model_full_load with NO offloading. "
            "Installed placements: %s. Pass strict=True to turn this into an error.",
            placement, GPU_memory_mode, ", ".join(plugins.names("placement")))
        placement = "model_full_load"
    exclude = tuple(exclude_module_name or ())
    options: dict[str, Any] = {}
    if placement == "model_group_offload":
        options["offload_type"] = "leaf_level"
    elif placement == "sequential_cpu_offload":
        options["keep_resident"] = tuple(dict.fromkeys(SMALL_TABLES + exclude))
    mode = placement if quantizer is None else f"{placement}{SEPARATOR}{quantizer}"
    handle = apply(pipeline, mode, device=device, weight_dtype=weight_dtype,
                   components=_component_names(pipeline, transformers) if quantizer is not None else None,
                   exclude=exclude if quantizer is not None else None, **options)
    handle.requested_mode = GPU_memory_mode
    return handle


def _component_names(pipeline: Any, transformers: Iterable[nn.Module] | None) -> list[str] | None:
    """The original takes modules; memmode names components. Map one to the other by identity."""
    if transformers is None:
        return None
    components = Target.of(pipeline).components
    names = []
    for module in transformers:
        if module is None:
            continue
        name = next((n for n, m in components.items() if m is module), None)
        if name is None:
            raise InvalidOptionError(
                f"transformers=: a {type(module).__name__} that is not one of the pipeline's components "
                f"({', '.join(components)}); memmode quantizes whole components")
        names.append(name)
    return names
