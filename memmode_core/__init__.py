"""memmode: one string decides where a diffusion pipeline's weights live, how they are stored, and
where offloaded weights wait.

    import memmode_core as memmode
    handle = memmode.apply(pipe, "model_group_offload_and_qfloat8", weight_dtype=torch.bfloat16)
    image = pipe(prompt).images[0]
    print(handle.report())
    handle.remove()

Placements, quantizers and storages are plugins (entry-point group ``memmode``); see ``memmode list``.

The modules are layered, one folder per layer, and imports only point down
(``tests/test_import_layers.py`` checks it):

0. ``contracts/``: errors, options, hookspecs, devices, costs, storage, placement, quantizer, targets, layout
   (groups and policies), packing;
1. mechanics: ``engine/`` (runtime, hooks, reads outside forward, ledger, staging, pipeline hooks), ``files/``
   (group files) and
   ``quantization/`` (everything a quantizer does besides packing one weight: which layers, the packed
   layer and its forward, sizes, the checks, and the ``check``/``quantize`` entry points);
2. ``discovery/``: plugins, grammar (built-in plugins are loaded by module name, like entry points);
3. ``planning/``: the planner;
4. ``builtin/``: the built-in plugins (the placements, ``auto`` among them, and the ``ram`` storage);
5. top level: ``api`` (apply, remove, convert), ``compat`` (the VideoX-Fun drop-in), ``cli``, ``demo``.
"""

from __future__ import annotations

from memmode_core.applying import apply, convert, remove
from memmode_core.contracts.costs import StorageCost
from memmode_core.contracts.errors import (
    CheckpointError,
    DuplicatePluginError,
    IncompatibleModeError,
    InvalidOptionError,
    MemmodeError,
    OffloadedWeightReadError,
    PluginLoadError,
    PluginNotInstalledError,
    QuantizedWeightWriteError,
    RestoreError,
    StorageUnavailableError,
    UnknownModeError,
)
from memmode_core.contracts.hookspecs import hookimpl
from memmode_core.contracts.layout import GroupSpec, Policy, block_groups, leaf_groups, whole_component
from memmode_core.contracts.options import Option, Options, option
from memmode_core.contracts.placement import Placement
from memmode_core.contracts.quantizer import Quantizer
from memmode_core.contracts.resolver import Budgets, Resolver
from memmode_core.contracts.storage import Storage, StorageSession, Tensors, is_placeholder, placeholder
from memmode_core.contracts.targets import Target
from memmode_core.discovery.grammar import Mode, parse_mode
from memmode_core.discovery.plugins import CORE_VERSION as __version__
from memmode_core.discovery.plugins import PluginInfo, list_plugins, temporary_plugin
from memmode_core.engine.hooks import hooks_of
from memmode_core.engine.ledger import Report
from memmode_core.engine.reads import placeholder_trap
from memmode_core.handle import Handle
from memmode_core.loading.load import load
from memmode_core.loading.save import save_quantized
from memmode_core.planning.planner import NoModeFitsError, PlanEntry, plan
from memmode_core.planning.prepare import prepare
from memmode_core.planning.prepared import Prepared

__all__ = [
    "apply",
    "prepare",
    "Prepared",
    "remove",
    "convert",
    "load",
    "save_quantized",
    "CheckpointError",
    "plan",
    "PlanEntry",
    "NoModeFitsError",
    "Handle",
    "Report",
    "parse_mode",
    "Mode",
    "list_plugins",
    "PluginInfo",
    "hookimpl",
    "temporary_plugin",
    "Placement",
    "Quantizer",
    "Storage",
    "StorageSession",
    "StorageCost",
    "Option",
    "Options",
    "option",
    "Resolver",
    "Budgets",
    "GroupSpec",
    "Policy",
    "block_groups",
    "leaf_groups",
    "whole_component",
    "Target",
    "Tensors",
    "placeholder",
    "is_placeholder",
    "placeholder_trap",
    "hooks_of",
    "MemmodeError",
    "UnknownModeError",
    "PluginNotInstalledError",
    "PluginLoadError",
    "IncompatibleModeError",
    "StorageUnavailableError",
    "DuplicatePluginError",
    "InvalidOptionError",
    "OffloadedWeightReadError",
    "RestoreError",
    "QuantizedWeightWriteError",
    "__version__",
]
