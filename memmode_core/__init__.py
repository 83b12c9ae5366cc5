"""memmode: one string decides where a diffusion pipeline's weights live, how they are stored, and
where offloaded weights wait.

    import memmode_core as memmode
    handle = memmode.apply(pipe, "model_group_offload_and_qfloat8", weight_dtype=torch.bfloat16)
    image = pipe(prompt).images[0]
    print(handle.report())
    handle.remove()

Placements, quantizers and storages are plugins (entry-point group ``memmode``); see ``memmode list``.

The modules are layered, and imports only point down (``tests/test_import_layers.py`` checks it):

0. contracts: ``errors``, ``options``, ``hookspecs``, ``devices``, ``costs``, ``storage``, ``placement``,
   ``targets``, ``engine.layout`` (groups and policies), ``packing``;
1. mechanics: the engine (``engine``, ``ledger``, ``staging``, ``files``, ``pipeline_hooks``) and
   quantization (``quantization``, and the ``quantizer`` base class whose defaults use it);
2. discovery: ``plugins``, ``grammar`` (built-in plugins are loaded by module name, like entry points);
3. ``planner``;
4. the built-in plugins (``builtin``: the placements, ``auto`` among them, and the ``ram`` storage);
5. ``api`` (apply, remove, convert), ``compat`` (the VideoX-Fun drop-in), ``cli``, ``demo``.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .api import Handle, apply, convert, remove
from .costs import StorageCost
from .engine.layout import GroupSpec, Policy, block_groups, leaf_groups, whole_component
from .errors import (DuplicatePluginError, IncompatibleModeError, InvalidOptionError, MemmodeError,
                     OffloadedWeightReadError, PluginLoadError, PluginNotInstalledError, QuantizedWeightWriteError,
                     RestoreError, StorageUnavailableError, UnknownModeError)
from .grammar import Mode, parse_mode
from .hookspecs import hookimpl
from .ledger import Report
from .options import Option
from .placement import Placement
from .planner import NoModeFitsError, PlanEntry, plan
from .plugins import PluginInfo, list_plugins, temporary_plugin
from .quantizer import Quantizer
from .storage import Storage, StorageSession, Tensors, is_placeholder, placeholder
from .targets import Target

__all__ = [
    "apply", "remove", "convert", "plan", "PlanEntry", "NoModeFitsError", "Handle", "Report", "parse_mode", "Mode", "list_plugins", "PluginInfo", "hookimpl",
    "temporary_plugin", "Placement", "Quantizer", "Storage", "StorageSession", "StorageCost", "Option",
    "GroupSpec", "Policy", "block_groups", "leaf_groups", "whole_component", "Target", "Tensors", "placeholder", "is_placeholder",
    "MemmodeError", "UnknownModeError", "PluginNotInstalledError", "PluginLoadError", "IncompatibleModeError",
    "StorageUnavailableError", "DuplicatePluginError", "InvalidOptionError", "OffloadedWeightReadError",
    "RestoreError", "QuantizedWeightWriteError", "__version__",
]
