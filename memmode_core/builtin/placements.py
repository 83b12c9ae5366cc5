"""The placements built into memmode-core, registered through the same hook as any plugin.

Each one only describes groups (see :mod:`memmode_core.contracts.group_specs`); the engine moves them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from memmode_core.builtin.auto import Auto
from memmode_core.contracts.errors import IncompatibleModeError, InvalidOptionError
from memmode_core.contracts.group_specs import GroupSpec, Policy, block_groups, leaf_groups, whole_component
from memmode_core.contracts.hookspecs import hookimpl
from memmode_core.contracts.options import (
    Options,
    boolean,
    boolean_or_none,
    byte_size,
    names_list,
    one_of,
    option,
    positive_int,
)
from memmode_core.contracts.placement import Placement
from memmode_core.contracts.targets import Target, is_fsdp_wrapped
from memmode_core.contracts.versions import KIT_VERSION
from memmode_core.engine.streams import active

TEXT_ENCODER_PREFIX = "text_encoder"

#: Name fragments of small tensors that are read on every step and cost more in copy latency than
#: they save in memory: RoPE frequency tables and modulation / scale-shift tables.
SMALL_TABLES = ("rope", "freqs", "modulation", "scale_shift_table")


class ModelFullLoad(Placement):
    name = "model_full_load"
    description = "every component on the device, all the time (the fastest, and the most memory)"
    offloads = False

    def layout(self, target: Target, options: Options) -> list[GroupSpec]:
        return [whole_component(name, module, Policy.RESIDENT) for name, module in target.components.items()]


@dataclass(frozen=True)
class CpuOffloadOptions(Options):
    keep_last_on_device: bool = option(
        False,
        "leave the last component a pipeline call used on the device after the call returns (the next call starts "
        "without onloading it)",
        boolean,
    )


class ModelCpuOffload(Placement):
    name = "model_cpu_offload"
    description = (
        "one whole component on the device at a time; it stays until another one is called, and "
        "leaves when the pipeline call returns"
    )
    options = CpuOffloadOptions

    def offloads_after_call(self, options: CpuOffloadOptions) -> bool:
        return not options.keep_last_on_device

    def layout(self, target: Target, options: Options) -> list[GroupSpec]:
        return [whole_component(name, module, Policy.EXCLUSIVE) for name, module in target.components.items()]


def _block_module_names(value: object) -> tuple[str, ...] | None:
    return None if value is None else names_list(value)


@dataclass(frozen=True)
class GroupOffloadOptions(Options):
    offload_type: str = option(
        "block_level",
        "'block_level' (runs of blocks) or 'leaf_level' (single modules)",
        one_of("block_level", "leaf_level"),
    )
    num_blocks_per_group: int = option(1, "blocks that move together at block level", positive_int)
    block_modules: tuple[str, ...] | None = option(
        None,
        "submodule names treated as block containers (default: the component's _group_offload_block_modules, e.g. "
        "a VAE's encoder and decoder)",
        _block_module_names,
    )
    use_stream: bool | None = option(
        None,
        "copy the next group on a side stream while the current one computes (default: on when computing on an "
        "accelerator with streams)",
        boolean_or_none,
    )
    vram_budget: int | None = option(
        None,
        "bytes of weights the device may hold (e.g. '20GiB'): groups stay on the device while their component runs "
        "up to it, only the rest stream (spread between the kept ones), and prefetch looks as far ahead as the room "
        "left allows (default: every group streams)",
        byte_size,
    )


class ModelGroupOffload(Placement):
    name = "model_group_offload"
    description = "every component streamed in groups of blocks (or leaf modules), prefetched on an accelerator"
    options = GroupOffloadOptions
    #: the planner prices both granularities
    plan_variants = ({"offload_type": "block_level"}, {"offload_type": "leaf_level"})

    def check(self, target: Target, options: GroupOffloadOptions, device: torch.device) -> None:
        if options.use_stream and not active().has_streams(device):
            raise InvalidOptionError(
                f"use_stream=True needs an accelerator with streams (CUDA, ROCm, XPU...); the compute device is "
                f"{device}"
            )

    def prefetch(self, options: GroupOffloadOptions, device: torch.device) -> bool:
        return active().has_streams(device) if options.use_stream is None else bool(options.use_stream)

    def layout(self, target: Target, options: GroupOffloadOptions) -> list[GroupSpec]:
        specs: list[GroupSpec] = []
        for name, module in target.components.items():
            if options.offload_type == "leaf_level":
                specs += leaf_groups(name, module)
            else:
                block_modules = options.block_modules
                if block_modules is None:
                    block_modules = default_block_modules(module)
                specs += block_groups(
                    name, module, num_blocks_per_group=options.num_blocks_per_group, block_modules=block_modules
                )
        return specs


def default_block_modules(module: nn.Module) -> list[str]:
    """The model's own ``_group_offload_block_modules`` that it actually has.

    A model class lists every submodule it *may* have; a configuration can leave some out (a Flux
    VAE is built with ``use_quant_conv=False``, so its ``quant_conv`` is None). Those are skipped,
    as diffusers does; only names the user passes are checked.
    """
    present = dict(module.named_modules())
    return [name for name in getattr(module, "_group_offload_block_modules", None) or () if name in present]


def _small_table_filter(fragments: tuple[str, ...]):
    def keep(path: str, module: nn.Module) -> bool:
        names = [path.rsplit(".", 1)[-1], *module._parameters, *module._buffers]
        return any(fragment in name for name in names for fragment in fragments)

    return keep


@dataclass(frozen=True)
class SequentialOptions(Options):
    keep_resident: tuple[str, ...] = option(
        SMALL_TABLES,
        "name fragments of small tables kept on the device (RoPE frequencies, modulation / scale-shift tables)",
        names_list,
    )


class SequentialCpuOffload(Placement):
    name = "sequential_cpu_offload"
    description = "one leaf module on the device at a time, synchronously (the least memory, the slowest)"
    options = SequentialOptions

    def layout(self, target: Target, options: SequentialOptions) -> list[GroupSpec]:
        keep = _small_table_filter(tuple(options.keep_resident))
        return [g for name, module in target.components.items() for g in leaf_groups(name, module, keep)]


class TextEncoderOffload(Placement):
    name = "text_encoder_offload"
    description = "everything resident except the text encoders, which stream module by module for their one pass"

    def _encoders(self, target: Target) -> dict[str, nn.Module]:
        return {n: m for n, m in target.components.items() if n.startswith(TEXT_ENCODER_PREFIX)}

    def check(self, target: Target, options: Options, device: torch.device) -> None:
        encoders = self._encoders(target)
        if not encoders:
            raise IncompatibleModeError(
                f"text_encoder_offload streams the '{TEXT_ENCODER_PREFIX}*' components, and {target.label} has none "
                f"(it has {', '.join(target.components)}); use model_full_load or model_cpu_offload"
            )
        for name, module in encoders.items():
            if is_fsdp_wrapped(module):
                raise IncompatibleModeError(
                    f"text_encoder_offload cannot stream {name!r}: it is FSDP-wrapped, and only FSDP can move its "
                    f"shards. Leave the text encoder unsharded so memmode can stream it, or shard it with FSDP's "
                    f"own CPU offload and use model_full_load for the rest"
                )

    def layout(self, target: Target, options: Options) -> list[GroupSpec]:
        encoders = self._encoders(target)
        specs: list[GroupSpec] = []
        for name, module in target.components.items():
            if name in encoders:
                specs += leaf_groups(name, module)
            else:
                specs.append(whole_component(name, module, Policy.RESIDENT))
        return specs


PLACEMENTS = (ModelFullLoad, ModelCpuOffload, ModelGroupOffload, SequentialCpuOffload, TextEncoderOffload)


#: a built-in plugin is built for the kit of its own core
MEMMODE_KIT = KIT_VERSION


@hookimpl
def memmode_register_placements(register):
    for placement in PLACEMENTS:
        register(placement())
    register(Auto())
