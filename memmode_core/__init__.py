"""memmode: one string decides where a diffusion pipeline's weights live, how they are stored, and
where offloaded weights wait.

    import memmode_core as memmode
    handle = memmode.apply(pipe, "model_group_offload_and_qfloat8", weight_dtype=torch.bfloat16)
    image = pipe(prompt).images[0]
    print(handle.report())
    handle.remove()

Placements, quantizers, storages and readers are plugins (entry-point group ``memmode``); see ``memmode list``.

``apply`` is ``prepare`` then execute: :func:`prepare` builds the request once (the mode's names resolved,
every argument checked, each plugin's typed options built), lays the target out, claims the groups, selects
the layers to quantize and sizes what will be stored — into an inspectable :class:`Prepared` — and executing it
quantizes and installs the engine. The planner prices such plans, ``load`` packs while it streams and executes
one, ``auto`` (a resolver) executes the candidate it chose. Plugins import what they need from one module,
the plugin kit :mod:`memmode_core.plugin`.

The modules are layered, one folder per layer, and imports only point down, even through
``TYPE_CHECKING`` imports and ``from memmode_core import X`` (``tests/test_import_layers.py`` checks it, with
the table of ``tests/layers.py``):

0. ``contracts/``: what plugins implement and every layer shares — errors, typed options, hookspecs,
   devices, ``storage_cost``, the ``Placement``, ``Quantizer``, ``Resolver``, ``Storage`` and ``Reader``
   contracts (``reader``: what a weight file holds, stored and encoded), targets, the group vocabulary
   (``group_specs``: ``GroupSpec``, ``Policy``), ``packing`` (a group's tensors in one flat buffer), the one
   table of deprecated names (``deprecation``);
1. mechanics: ``engine/`` (``groups``: the group model and claiming; ``placement_layout``: a placement's
   layout as core adjusts it, and the engine's rebuilds; ``runtime``: the engine of one ``apply``, which
   installs and removes every hook the engine puts on a model or pipeline, made of parts that each get their
   collaborators through their constructor — ``state`` (only what several parts share), ``moving`` (with the
   nesting of calls), ``serving``, ``changes`` (the one owner of rebuilds and edits; ``replacements``: what a
   rebuild and ``remove`` store in place of a replaced tensor), ``forwards`` (the hooks, with
   ``component_hooks``); ``standins/``: every read of a resting or quantized weight gets its value, the rule
   and the four kinds of call stated in its ``__init__``; ``copying``: copies of placed objects; ``hooks``:
   named hooks and their registry; ``pipeline_hooks`` (the ``_hf_hook`` shim and the guards on a pipeline),
   ``watch``, ``inputs``, ``ledger``, ``staging``, ``streams``: the one door to the
   accelerator), ``files/`` (group files, checkpoints; what the layers above use is what
   ``memmode_core.files`` exports) and ``quantization/`` (``packed``, ``sizes``, ``forward``, ``making``: the
   one stage where a packed layer is made and its forward installed, ``selection``, ``quantizing``, ``saved``:
   the saved format's metadata, ``streaming``: packing one layer at a time into a file; everything a quantizer
   does besides packing one weight);
2. ``discovery/``: plugins, grammar, the one table of first-party names (built-in plugins are loaded by
   module name, like entry points);
3. ``planning/``: ``request`` (what was asked, resolved once, built from named arguments), ``prepared`` (the
   sealed plan of a concrete mode, what a user reads) and ``internal_plan`` (what the engine executes of
   it), and the planner: ``calls`` (the call priced for), ``replay``, ``pricing``, ``candidates``,
   ``budgets``, ``choosing``, ``planner`` (``plan``), ``measuring`` (what a storage costs, measured where it
   is not declared), ``residency``, ``timing``, ``trace``;
4. ``builtin/``: the built-in plugins (the placements, the ``auto`` resolver, the ``ram`` storage, the
   ``comfy`` reader of ComfyUI's files);
5. top level: ``applying`` (``prepare``, ``apply``: prepare -> pack -> execute; remove, convert),
   ``layer_packing`` (the stage that packs a plan's layers, for ``apply`` and ``load``), ``handover`` (a
   mode applied over another: what is taken off and put back), ``handle`` (the ``Handle``), ``plugin`` (the
   plugin kit), ``loading/`` (``load`` and ``save_quantized``: its package docstring lists its modules),
   ``compat`` (the VideoX-Fun drop-in), ``cli/``, ``demo``, ``testing/`` (the
   strict model of asynchronous copies), and ``storage``/``costs``: deprecated aliases.
"""

from __future__ import annotations

from memmode_core.applying import apply, convert, prepare, remove
from memmode_core.contracts.deprecation import MemmodeDeprecationWarning
from memmode_core.contracts.errors import (
    CheckpointError,
    DeviceMemoryError,
    DuplicatePluginError,
    IncompatibleModeError,
    InvalidOptionError,
    MemmodeError,
    ModelBuildError,
    OffloadedWeightReadError,
    OffloadedWeightWriteError,
    PluginKitError,
    PluginLoadError,
    PluginNotInstalledError,
    QuantizedWeightWriteError,
    RestoreError,
    StagingError,
    StandInReadError,
    StorageUnavailableError,
    UnknownModeError,
)
from memmode_core.contracts.group_specs import GroupSpec, Policy, block_groups, leaf_groups, whole_component
from memmode_core.contracts.hookspecs import hookimpl
from memmode_core.contracts.options import Option, Options, option
from memmode_core.contracts.placement import Placement
from memmode_core.contracts.quantizer import Quantizer
from memmode_core.contracts.reader import EncodedTensor, FileContents, QuantizedFolder, Reader, StoredTensor
from memmode_core.contracts.resolver import Budgets, Resolver
from memmode_core.contracts.storage import Storage, StorageSession, Tensors, is_placeholder, placeholder
from memmode_core.contracts.storage_cost import StorageCost
from memmode_core.contracts.targets import Target
from memmode_core.contracts.versions import CORE_VERSION as __version__
from memmode_core.discovery.grammar import Mode, parse_mode
from memmode_core.discovery.plugins import list_plugins
from memmode_core.discovery.registrations import PluginInfo
from memmode_core.discovery.sources import temporary_plugin
from memmode_core.engine.hooks import hooks_of
from memmode_core.engine.ledger import Report
from memmode_core.engine.standins.placeholders import placeholder_trap
from memmode_core.handle import Handle
from memmode_core.loading.load import load
from memmode_core.loading.save import save_quantized
from memmode_core.planning.choosing import NoModeFitsError
from memmode_core.planning.planner import plan
from memmode_core.planning.prepared import Prepared, PreparedGroup, QuantizationOutline
from memmode_core.planning.pricing import PlanEntry

__all__ = [
    "apply",
    "prepare",
    "Prepared",
    "PreparedGroup",
    "QuantizationOutline",
    "remove",
    "convert",
    "load",
    "save_quantized",
    "CheckpointError",
    "DeviceMemoryError",
    "ModelBuildError",
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
    "Reader",
    "StoredTensor",
    "EncodedTensor",
    "FileContents",
    "QuantizedFolder",
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
    "PluginKitError",
    "IncompatibleModeError",
    "StagingError",
    "StorageUnavailableError",
    "DuplicatePluginError",
    "InvalidOptionError",
    "OffloadedWeightReadError",
    "OffloadedWeightWriteError",
    "StandInReadError",
    "RestoreError",
    "QuantizedWeightWriteError",
    "MemmodeDeprecationWarning",
    "__version__",
]
