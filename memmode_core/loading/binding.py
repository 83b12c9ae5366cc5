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
from memmode_core.files import file_size, staging_folder, write_pieces
from memmode_core.loading.skeleton import Skeleton

if TYPE_CHECKING:
    from memmode_core.loading.sources import WeightSource

logger = logging.getLogger("memmode")


@dataclass
class ModelTensor:
    """One tensor of the model, with every module and name it is registered under (a tied tensor has several)."""

    owners: list[tuple[nn.Module, str]]
    is_buffer: bool
    keys: list[str]
    current: torch.Tensor

    def assign(self, value: torch.Tensor) -> None:
        """Register ``value`` under every name of the tensor (one Parameter object for all: ties stay tied)."""
        if not self.is_buffer:
            value = nn.Parameter(value, requires_grad=self.current.requires_grad)
        for owner, name in self.owners:
            (owner._buffers if self.is_buffer else owner._parameters)[name] = value


@dataclass
class Binding:
    tensors: list[ModelTensor]
    #: tensor index -> the source's key it is read from
    source: dict[int, str]
    #: tensor index -> dtype it is converted to (absent: bound as a view)
    convert: dict[int, torch.dtype]
    unexpected: list[str] = field(default_factory=list)
    #: the mappings of the streamed files converted tensors were bound from (set by :func:`bind`)
    streamed: list[torch.Tensor] = field(default_factory=list)

    def conversion_specs(self) -> dict[str, torch.Tensor]:
        """The layout of the streamed file the converted tensors go to (meta tensors)."""
        return {
            str(i): torch.empty(self.tensors[i].current.shape, dtype=dtype, device="meta")
            for i, dtype in self.convert.items()
        }

    @property
    def staging_bytes(self) -> int:
        """Bytes the conversion writes to the staging folder (0: every tensor is bound as a view)."""
        return file_size(self.conversion_specs())


def model_tensors(module: nn.Module) -> list[ModelTensor]:
    """Every parameter and persistent buffer of ``module``, tied ones once with all their names."""
    found: dict[int, ModelTensor] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, param in sub._parameters.items():
            if param is None:
                continue
            tensor = found.setdefault(id(param), ModelTensor([], False, [], param))
            tensor.owners.append((sub, name))
            tensor.keys.append(dot + name)
        for name, buffer in sub._buffers.items():
            if buffer is None or name in sub._non_persistent_buffers_set:
                continue
            tensor = found.setdefault(id(buffer), ModelTensor([], True, [], buffer))
            tensor.owners.append((sub, name))
            tensor.keys.append(dot + name)
    return list(found.values())


def binding_for(skeleton: Skeleton, weights: WeightSource, *, where: str) -> Binding:
    """What to read for each tensor of the skeleton from ``weights``; refuses weights that do not fit it."""
    tensors = model_tensors(skeleton.module)
    source, convert, missing, wrong = {}, {}, [], []
    wanted = set()
    for index, tensor in enumerate(tensors):
        key = next((k for k in tensor.keys if k in weights), None)
        wanted.update(tensor.keys)
        if key is None:
            if tensor.current.is_meta:
                missing.append(tensor.keys[0])
            continue  # a buffer built for real in __init__ and not saved: kept as built
        record = weights.record(key)
        if tuple(record.shape) != tuple(tensor.current.shape):
            wrong.append(f"{key}: {list(record.shape)} in the checkpoint, {list(tensor.current.shape)} in the model")
            continue
        source[index] = key
        target = skeleton.dtypes.get(key, record.dtype) if record.dtype.is_floating_point else record.dtype
        # a tensor a single file holds as several runs of rows, or encoded, is assembled at load: it goes to the
        # staging file as a converted one does, rather than into anonymous memory
        if target != record.dtype or not record.is_view:
            convert[index] = target
    unexpected = sorted(set(weights.keys()) - wanted)
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
    return Binding(tensors, source, convert, unexpected)


def bind(skeleton: Skeleton, weights: WeightSource, binding: Binding, *, staging_dir=None) -> None:
    """Bind every tensor: views of the weights' pages, or of a streamed file for the converted ones."""
    values: dict[int, torch.Tensor] = {}
    if binding.convert:
        specs = binding.conversion_specs()
        _say_what_is_converted(skeleton, weights, binding, file_size(specs), staging_dir)

        def pieces():
            for i, dtype in binding.convert.items():
                yield {str(i): weights.view(binding.source[i]).to(dtype)}

        streamed = write_pieces(specs, pieces(), folder=staging_dir)
        binding.streamed.extend(streamed.flats)
        values.update({int(name): tensor for name, tensor in streamed.items()})
    for index, key in binding.source.items():
        binding.tensors[index].assign(values[index] if index in values else weights.view(key))
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


def _say_what_is_converted(skeleton: Skeleton, weights: WeightSource, binding: Binding, size: int, staging_dir) -> None:
    pairs: dict[tuple[torch.dtype, torch.dtype], int] = {}
    for i, dtype in binding.convert.items():
        record = weights.record(binding.source[i])
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
