"""The plugin kit: everything a placement, quantizer, resolver or storage plugin needs, in one public place.

A plugin imports from here and from nowhere else in memmode — the first-party plugins do too (a test checks
every file under ``plugins/`` and the four complete packages of docs/writing-a-plugin.md), so a third-party
storage can do what ``disk`` does with the same parts. What is exported here is public: it keeps working,
or stays importable as a deprecated alias that says what replaced it, for at least one release. Where each
name is explained: docs/writing-a-plugin.md.

The kit has a version of its own, :data:`KIT_VERSION` (``MAJOR.MINOR``: a minor adds, a major removes; see
docs/versioning.md). A plugin states the one it was built for as ``MEMMODE_KIT = "1.0"`` in its entry-point
module; a plugin built for a kit this core does not provide is refused, with a
:class:`~memmode_core.PluginKitError` naming both versions, before any of its hooks run.

- versions: :data:`KIT_VERSION`, the kit this memmode-core provides;

- registering: :func:`hookimpl` (the four hooks take a ``register`` callback), :func:`temporary_plugin`
  for tests;
- options: :class:`Option`, :class:`Options`, :func:`option` and the checks the built-in plugins use
  (:func:`byte_size`, :func:`boolean`, :func:`one_of`, :func:`positive_int`);
- refusing: :class:`MemmodeError` and the errors a plugin raises;
- placements: :class:`Placement`, :class:`Target`, :class:`GroupSpec`, :class:`Policy` and the layout
  helpers the built-in placements use;
- resolvers: :class:`Resolver`, :class:`PricingResolver` (chooses among the planner's priced candidates:
  write ``budgets`` and ``choose``), :class:`Budgets`, :class:`Request`, :class:`PlanEntry`,
  :class:`NoModeFitsError`;
- quantizers: :class:`Quantizer`, :data:`DEFAULT_EXCLUDE`, core's mechanics for an override that wraps them
  (:func:`check_components`, :func:`quantize_component`), :func:`convert` (pack ahead of ``apply``) and
  :class:`QuantizationSummary`;
- readers (kit 1.1): :class:`Reader` (a format of weight files ``load`` reads: parse a header into
  :class:`FileContents` of :class:`StoredTensor` and :class:`EncodedTensor` records), :data:`PAYLOAD` (the part
  of an encoded tensor that takes a weight's place), :class:`CheckpointError` (what a damaged file raises);
  kit 1.2 adds folders a library saved quantized: :attr:`Reader.quant_methods` and :meth:`Reader.read_folder`,
  shown a :class:`QuantizedFolder` (its ``quantization_config`` and every stored tensor);
- storages: :class:`Storage`, :class:`StorageSession`, :data:`Tensors`, what a parameter holds at rest
  (:func:`placeholder`, :func:`is_placeholder`, :func:`host_copy`), :class:`StorageCost` and
  :func:`copying_cost`, :func:`resolve_device`, ``packing`` (how a group's tensors lie in one flat buffer);
- the accelerator: :func:`active_streams` (the one door to streams, events, copies and page-locked memory,
  which ``memmode_core.testing.StrictStreams`` replaces in tests) and :class:`Streams`;
- group files — the machinery of the ``disk`` and ``mmap`` storages, in core so that any storage that keeps
  groups in files shares it rather than copies it: :class:`GroupFileStorage` (subclass it and write
  ``session``), :class:`GroupFileSession` (the bookkeeping; subclass it and write ``put``/``fetch``/
  ``restore``), :class:`GroupFileStore`, :class:`GroupFileOptions`, :class:`GroupFile`;
- ranks of ``torch.distributed`` on one machine: :func:`ranks_share_a_machine`, and :func:`shared_folder`, the
  folder every rank of the job on this machine uses for a purpose (learnt from ``torch.distributed``'s store),
  so that their files are one copy (the file storages use it when no ``offload_dir`` is given), and
  :func:`shared_memory`, the machine's shared-memory filesystem (``pinned`` keeps the ranks' one copy there).
"""

from __future__ import annotations

from memmode_core.applying import convert
from memmode_core.builtin.auto import PricingResolver
from memmode_core.contracts import packing
from memmode_core.contracts.devices import resolve_device
from memmode_core.contracts.errors import (
    CheckpointError,
    IncompatibleModeError,
    InvalidOptionError,
    MemmodeError,
    StorageUnavailableError,
)
from memmode_core.contracts.group_specs import GroupSpec, Policy, block_groups, leaf_groups, whole_component
from memmode_core.contracts.hookspecs import hookimpl
from memmode_core.contracts.options import Option, Options, boolean, byte_size, one_of, option, positive_int
from memmode_core.contracts.placement import Placement
from memmode_core.contracts.quantizer import DEFAULT_EXCLUDE, PAYLOAD, Quantizer
from memmode_core.contracts.reader import EncodedTensor, FileContents, QuantizedFolder, Reader, StoredTensor
from memmode_core.contracts.resolver import Budgets, Resolver
from memmode_core.contracts.storage import Storage, StorageSession, Tensors, host_copy, is_placeholder, placeholder
from memmode_core.contracts.storage_cost import StorageCost, copying_cost
from memmode_core.contracts.targets import Target
from memmode_core.contracts.versions import KIT_VERSION
from memmode_core.discovery.sources import temporary_plugin
from memmode_core.engine.host_pins import host_pins
from memmode_core.engine.streams import Streams
from memmode_core.engine.streams import active as active_streams
from memmode_core.files.file_options import GroupFileOptions
from memmode_core.files.groupfile import GroupFile
from memmode_core.files.node import ranks_share_a_machine, shared_folder, shared_memory
from memmode_core.files.sessions import GroupFileSession, GroupFileStorage
from memmode_core.files.store import GroupFileStore
from memmode_core.planning.choosing import NoModeFitsError
from memmode_core.planning.pricing import PlanEntry
from memmode_core.planning.request import Request
from memmode_core.quantization import QuantizationSummary, check_components, quantize_component

__all__ = [
    # versions
    "KIT_VERSION",
    # registering
    "hookimpl",
    "temporary_plugin",
    # options
    "Option",
    "Options",
    "option",
    "byte_size",
    "boolean",
    "one_of",
    "positive_int",
    # refusing
    "MemmodeError",
    "IncompatibleModeError",
    "InvalidOptionError",
    "StorageUnavailableError",
    # placements
    "Placement",
    "Target",
    "GroupSpec",
    "Policy",
    "whole_component",
    "block_groups",
    "leaf_groups",
    # resolvers
    "Resolver",
    "PricingResolver",
    "Budgets",
    "Request",
    "PlanEntry",
    "NoModeFitsError",
    # quantizers
    "Quantizer",
    "DEFAULT_EXCLUDE",
    "check_components",
    "quantize_component",
    "convert",
    "QuantizationSummary",
    # readers
    "Reader",
    "StoredTensor",
    "EncodedTensor",
    "FileContents",
    "QuantizedFolder",
    "PAYLOAD",
    "CheckpointError",
    # storages
    "Storage",
    "StorageSession",
    "Tensors",
    "placeholder",
    "is_placeholder",
    "host_copy",
    "StorageCost",
    "copying_cost",
    "resolve_device",
    "packing",
    # the accelerator
    "active_streams",
    "host_pins",
    "Streams",
    # group files
    "GroupFileStorage",
    "GroupFileSession",
    "GroupFileStore",
    "GroupFileOptions",
    "GroupFile",
    # ranks of torch.distributed on one machine
    "ranks_share_a_machine",
    "shared_folder",
    "shared_memory",
]
