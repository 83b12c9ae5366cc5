"""Pouring a checkpoint into a skeleton: each tensor bound as a view of the file, or converted on the way.

A tensor whose checkpoint dtype is the dtype the model wants is bound as a view of the checkpoint's
private mapping: no anonymous memory, nothing written. The others are converted one at a time into a
streamed file (:mod:`memmode_core.files.streamed`) and bound as views of it. Tied weights (one
parameter under several names, often saved once) are bound once and stay tied. A tensor the model
needs that the checkpoint lacks, or a shape that differs, is a :class:`CheckpointError` naming it —
raised before the skeleton is touched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from memmode_core.contracts.errors import CheckpointError
from memmode_core.contracts.units import format_bytes
from memmode_core.files import Checkpoint, file_size, staging_folder, write_pieces
from memmode_core.loading.skeleton import Skeleton

if TYPE_CHECKING:
    from memmode_core.loading.single_file import WeightsFile

logger = logging.getLogger("memmode")


@dataclass
class Slot:
    """Where one tensor of the model is registered (every name of a tied tensor)."""

    owners: list[tuple[nn.Module, str]]
    is_buffer: bool
    keys: list[str]
    current: torch.Tensor

    def assign(self, value: torch.Tensor) -> None:
        """Register ``value`` under every name of the slot (one Parameter object for all: ties stay tied)."""
        if not self.is_buffer:
            value = nn.Parameter(value, requires_grad=self.current.requires_grad)
        for owner, name in self.owners:
            (owner._buffers if self.is_buffer else owner._parameters)[name] = value


@dataclass
class Binding:
    slots: list[Slot]
    #: slot index -> checkpoint key it is read from
    source: dict[int, str]
    #: slot index -> dtype it is converted to (absent: bound as a view)
    convert: dict[int, torch.dtype]
    unexpected: list[str] = field(default_factory=list)
    #: the mappings of the streamed files converted tensors were bound from (set by :func:`bind`)
    streamed: list[torch.Tensor] = field(default_factory=list)

    def conversion_specs(self) -> dict[str, torch.Tensor]:
        """The layout of the streamed file the converted tensors go to (meta tensors)."""
        return {
            str(i): torch.empty(self.slots[i].current.shape, dtype=dtype, device="meta")
            for i, dtype in self.convert.items()
        }

    @property
    def staging_bytes(self) -> int:
        """Bytes the conversion writes to the staging folder (0: every tensor is bound as a view)."""
        return file_size(self.conversion_specs())


def slots_of(module: nn.Module) -> list[Slot]:
    """Every parameter and persistent buffer of ``module``, tied ones once with all their names."""
    found: dict[int, Slot] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, param in sub._parameters.items():
            if param is None:
                continue
            slot = found.setdefault(id(param), Slot([], False, [], param))
            slot.owners.append((sub, name))
            slot.keys.append(dot + name)
        for name, buffer in sub._buffers.items():
            if buffer is None or name in sub._non_persistent_buffers_set:
                continue
            slot = found.setdefault(id(buffer), Slot([], True, [], buffer))
            slot.owners.append((sub, name))
            slot.keys.append(dot + name)
    return list(found.values())


def binding_for(skeleton: Skeleton, checkpoint: Checkpoint | WeightsFile, *, where: str) -> Binding:
    """What to read for each tensor of the skeleton; refuses a checkpoint that does not fit it. ``checkpoint`` may
    be a single file's tensors under the model's names (:class:`~memmode_core.loading.single_file.WeightsFile`):
    it answers the same questions."""
    slots = slots_of(skeleton.module)
    source, convert, missing, wrong = {}, {}, [], []
    wanted = set()
    for index, slot in enumerate(slots):
        key = next((k for k in slot.keys if k in checkpoint), None)
        wanted.update(slot.keys)
        if key is None:
            if slot.current.is_meta:
                missing.append(slot.keys[0])
            continue  # a buffer built for real in __init__ and not saved: kept as built
        record = checkpoint.record(key)
        if tuple(record.shape) != tuple(slot.current.shape):
            wrong.append(f"{key}: {list(record.shape)} in the checkpoint, {list(slot.current.shape)} in the model")
            continue
        source[index] = key
        target = skeleton.dtypes.get(key, record.dtype) if record.dtype.is_floating_point else record.dtype
        # a tensor a single file holds as several runs of rows, or encoded, is assembled at load: it goes to the
        # staging file as a converted one does, rather than into anonymous memory
        if target != record.dtype or not getattr(record, "is_view", True):
            convert[index] = target
    unexpected = sorted(set(checkpoint.keys()) - wanted)
    if missing or wrong:
        lines = [*(f"{k}: missing from the checkpoint" for k in missing[:5]), *wrong[:5]]
        more = len(missing) + len(wrong) - len(lines)
        extra = (
            f". The checkpoint has {len(unexpected)} tensors the model does not (e.g. {', '.join(unexpected[:3])}): "
            f"is it another architecture than the config?"
            if missing and unexpected
            else ""
        )
        raise CheckpointError(
            f"{where} does not fit {type(skeleton.module).__name__}: {'; '.join(lines)}"
            f"{f'; and {more} more' if more > 0 else ''}{extra}"
        )
    return Binding(slots, source, convert, unexpected)


def bind(skeleton: Skeleton, checkpoint: Checkpoint, binding: Binding, *, staging_dir=None) -> None:
    """Bind every tensor: views of the checkpoint, or of a streamed file for the converted ones."""
    values: dict[int, torch.Tensor] = {}
    if binding.convert:
        specs = binding.conversion_specs()
        _say_what_is_converted(skeleton, checkpoint, binding, file_size(specs), staging_dir)

        def pieces():
            for i, dtype in binding.convert.items():
                yield {str(i): checkpoint.view(binding.source[i]).to(dtype)}

        streamed = write_pieces(specs, pieces(), folder=staging_dir)
        binding.streamed.extend(streamed.flats)
        values.update({int(name): tensor for name, tensor in streamed.items()})
    for index, key in binding.source.items():
        binding.slots[index].assign(values[index] if index in values else checkpoint.view(key))
    if binding.unexpected:
        logger.warning(
            "memmode: %d tensors of the checkpoint are not used by %s (e.g. %s)",
            len(binding.unexpected),
            type(skeleton.module).__name__,
            binding.unexpected[0],
        )


#: a conversion writing at least this much is a warning, not an info line: it costs disk and time that a
#: torch_dtype matching the checkpoint would not
LARGE_CONVERSION = 1 << 30


def _say_what_is_converted(
    skeleton: Skeleton, checkpoint: Checkpoint, binding: Binding, size: int, staging_dir
) -> None:
    pairs: dict[tuple[torch.dtype, torch.dtype], int] = {}
    for i, dtype in binding.convert.items():
        record = checkpoint.record(binding.source[i])
        pairs[(record.dtype, dtype)] = pairs.get((record.dtype, dtype), 0) + 1
    how = ", ".join(f"{n} from {a} to {b}".replace("torch.", "") for (a, b), n in pairs.items())
    (logger.warning if size >= LARGE_CONVERSION else logger.info)(
        "memmode: %s: converting %d tensors (%s): writes %s (%d bytes) to a staging file in %s",
        type(skeleton.module).__name__,
        len(binding.convert),
        how,
        format_bytes(size),
        size,
        staging_folder(staging_dir),
    )
