"""What ``layer.weight`` is on a quantized layer: a lazy stand-in that reads as the dequantized weight.

A quantized layer has no full-precision weight, but code written for full-precision layers still reads one —
diffusers' LoRA loaders check its shape, peft casts an adapter to its dtype and moves it to its device, model
code casts activations to it, a parent module computes with it (``nn.MultiheadAttention`` passes
``out_proj.weight`` to ``F.multi_head_attention_forward``, an attention pool ``q_proj.weight``), ``state_dict()``
holds it — and some writes into one in place (merging a LoRA: VideoX-Fun's ``weight.data += delta``). The layer
answers ``weight`` with a :class:`WeightStandIn`: a lazy stand-in (:func:`~.classes.lazy`) with
the full-precision shape, the compute dtype and the packed tensors' device, holding no memory. Its metadata
is free; a read of its values gets the weight dequantized from the packed tensors as they are now (onloaded
into the running call if they rest offloaded), counted in the handle's report and refused under
``strict=True``; a write into it is a write into the layer — dequantize, write, quantize again — or a refusal
before anything changes. The layer's own forward never reads it.
:class:`WeightStandInMixin` is the part of the packed layer's class that answers ``weight`` (and keeps state
dicts consistent with it); the dequantizing forward itself is in :mod:`memmode_core.quantization.forward`,
and the packed tensors' record in :mod:`memmode_core.quantization.packed` (both layer 1, as the engine: this
module is the stand-ins' side of a packed layer, kept with the other stand-ins).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from memmode_core.contracts.errors import QuantizedWeightWriteError
from memmode_core.contracts.quantizer import Quantizer
from memmode_core.engine import watch
from memmode_core.engine.groups import module_path
from memmode_core.engine.standins.classes import (
    StandIn,
    StandInReader,
    StandInSource,
    is_stand_in,
    lazy,
    serve_by_default,
    source_of,
)
from memmode_core.engine.standins.values import value_of, writable
from memmode_core.quantization.packed import PackedLayer, is_dtensor, packed_record
from memmode_core.quantization.sizes import PackedSizes, pack_checked


class WeightStandInMixin:
    """What a packed layer's class (:class:`~memmode_core.quantization.forward.QuantizedLinear`) answers for
    ``weight``, and how its state dicts carry that answer. A layer of this class is one a stand-in can write
    through to."""

    @property
    def weight(self) -> torch.Tensor:
        """A stand-in for the full-precision weight: its shape, the compute dtype, the packed tensors' current
        device, no memory of its own; its values, when read, are the dequantized weight (see the module
        docstring). State dicts carry it under ``weight`` too (diffusers' LoRA loaders look the weight up
        there); loading it back, or the dequantized values a saved state dict holds, is a no-op; loading
        another full-precision weight into the layer is an error."""
        record: PackedLayer = packed_record(self)
        payload = self.weight_packed
        with torch._C.DisableTorchFunctionSubclass():
            nan = torch.full((), float("nan"), dtype=record.compute_dtype, device=payload.device).expand(record.shape)
        return lazy(nan, PackedWeight(self), WeightStandIn)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # ``<layer>.weight`` stays in state dicts, as the stand-in: diffusers' LoRA loaders look a
        # layer's weight up in ``transformer.state_dict()`` to read its shape and device.
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "weight"
        incoming = state_dict.get(key)
        if incoming is not None:
            if not self._holds(incoming):
                error_msgs.append(
                    f"{key}: cannot load a full-precision weight into a layer quantized with "
                    f"{packed_record(self).format}; load the weights before applying the mode"
                )
            state_dict.pop(key)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _holds(self, incoming: torch.Tensor) -> bool:
        """Whether ``incoming`` is what this layer's ``weight`` is: a stand-in (what ``_save_to_state_dict``
        wrote), or the dequantized values a saved state dict holds (``torch.save(model.state_dict())``)."""
        if is_stand_in(incoming):
            return True
        record: PackedLayer = packed_record(self)
        if tuple(incoming.shape) != tuple(record.shape):
            return False
        try:
            current = PackedWeight(self).dequantized(StandInReader("load_state_dict", None), count=False)
        except Exception:  # noqa: BLE001 - nothing to compare with: not the layer's own weight
            return False
        with torch._C.DisableTorchFunctionSubclass():
            return bool(torch.equal(incoming.to(device=current.device, dtype=current.dtype), current))


class WeightStandIn(StandIn):
    """The type of :attr:`WeightStandInMixin.weight`: a lazy stand-in whose value is the dequantized weight.

    A read of its values dequantizes the packed weight (``codec.unpack``) into the compute dtype, on the
    packed tensors' device; a view of part of that value is a read too, whose result refuses writes. A
    write into the stand-in — or into ``.data``, ``.detach()`` or another whole view of it
    (``view``/``reshape`` to its own shape) — is a write into the layer (:meth:`PackedWeight.write`): the
    packed weight is dequantized to float32 (float64 if the layer computes in it), the same operation runs
    on that full tensor, the result is quantized again with the layer's quantizer, and the new packed
    tensors are copied into the layer's existing ones, in place — so a storage that keeps the at-rest
    tensor itself (``ram``, ``pinned``) holds the new values, exactly as after an in-place write into a
    full-precision weight under the same placement; under ``disk`` the packed tensors get memory of their
    own and are stored again at the next call (a copy resident on the device, or ``mmap``, needs
    ``handle.refresh()`` the same way). The packed names, shapes and dtypes never change. The cost is a
    second rounding to the format (docs/videox-fun.md has the measurement). ``t.data = x`` is the same
    write as ``t.data.copy_(x)``; assigning it its own write's result (Python's ``t.data += x`` ends with
    ``t.data = <that result>``) does nothing.

    Refused with :class:`~memmode_core.contracts.errors.QuantizedWeightWriteError` (an
    ``IncompatibleModeError`` and a ``RuntimeError``) *before anything changes* — the layer's packed
    tensors are written only once every step has succeeded:

    * a write into part of the weight through a view of a part (``weight[0].add_(x)``,
      ``weight.data[:, :4].copy_(x)``, ``weight.t().mul_(2)``): such a view is of a dequantized copy.
      Index the whole instead: ``weight.data[0] = x`` works;
    * a layer whose packed tensors are on the meta device or sharded (DTensor);
    * a result that is not finite, and an operation that changes the tensor's layout instead of its values
      (``t_``, ``resize_`` to another shape);
    * a stand-in whose layer is gone or no longer quantized, and any other ``__set__``
      (``weight.requires_grad = ...``).
    """


class PackedWeight(StandInSource):
    """The source of a quantized layer's ``weight`` stand-in: the layer (held weakly) and its packed tensors."""

    def __init__(self, layer: nn.Module | None) -> None:
        self._layer = weakref.ref(layer) if layer is not None else _no_layer
        record = packed_record(layer) if layer is not None else None
        self._format = record.format if record is not None else "a packed format"
        self.what = f"quantized with {self._format}"

    @property
    def name(self) -> str:
        layer = self._layer()
        return (_path_of(layer) if layer is not None else None) or f"the weight of a {self._format} layer"

    def same(self, other: StandInSource | None) -> bool:
        return isinstance(other, PackedWeight) and other._layer() is self._layer() and self._layer() is not None

    def refusal(self, name: str, why: str) -> QuantizedWeightWriteError:
        return QuantizedWeightWriteError(
            f"{name or 'write'}: cannot write into the weight of a layer quantized with {self._format}: {why}. "
            f"Nothing was changed. Merge the LoRA before applying the quantized mode, or load it unfused "
            f"(pipe.load_lora_weights(...), which runs it at weight_dtype on the dequantized weight)."
        )

    def usable(self, reader: StandInReader) -> torch.Tensor | None:
        return None

    def value(self, reader: StandInReader) -> torch.Tensor:
        return self.dequantized(reader, count=True)

    def dequantized(self, reader: StandInReader, *, count: bool) -> torch.Tensor:
        """The weight unpacked from the packed tensors as they are now, in the compute dtype."""
        layer, record = self._linked(reader.operation)
        tensors = {key: _readable(self, reader.operation, key, getattr(layer, key, None)) for key in record.names}
        with torch._C.DisableTorchFunctionSubclass():
            full = record.codec.unpack(tensors, record.shape, record.compute_dtype)
        if count:
            runtime = _runtime_of(layer)
            if runtime is not None:
                runtime.count_read(self, full.numel() * full.element_size(), reader)
        return full

    def _linked(self, name: str) -> tuple[nn.Module, PackedLayer]:
        layer = self._layer()
        if layer is None:
            raise self.refusal(
                name,
                "this stand-in is linked to no layer (its layer is gone, or it was not obtained from "
                "`layer.weight`), so the write has nothing to write into",
            )
        record = packed_record(layer)
        if not isinstance(layer, WeightStandInMixin) or record is None or record.codec is None:
            raise self.refusal(name, f"{type(layer).__name__} is no longer quantized; write into its own `weight`")
        return layer, record

    def write(self, func, name: str, args: tuple, kwargs: dict, target: torch.Tensor) -> Any:
        return _write_through(self, target, func, name, args, kwargs)


def _no_layer() -> None:
    return None


#: what a stand-in made by hand (``t.as_subclass(WeightStandIn)``) serves: nothing, and every write says so
serve_by_default(WeightStandIn, PackedWeight(None))


def _readable(source: PackedWeight, name: str, key: str, tensor: torch.Tensor | None) -> torch.Tensor:
    """A packed tensor's values as a plain tensor: itself, or (resting offloaded) onloaded into the running call
    or read from its storage — not counted: the dequantized weight is what is counted."""
    if not isinstance(tensor, torch.Tensor):
        raise source.refusal(name, f"its packed tensor {key!r} is missing")
    if tensor.is_meta or is_dtensor(tensor):
        where = "on the meta device" if tensor.is_meta else "sharded (DTensor)"
        raise source.refusal(name, f"its packed tensor {key!r} is {where}, so there is no weight to dequantize")
    return value_of(tensor, name, counted=False)


def _path_of(layer: nn.Module) -> str | None:
    runtime = _runtime_of(layer)
    return f"{module_path(runtime.components, layer)}.weight" if runtime is not None else None


def _runtime_of(layer: nn.Module):
    """The live runtime placing the component ``layer`` belongs to, if any."""
    for runtime in watch.live_runtimes():
        if runtime.component_of(layer) is not None:
            return runtime
    return None


def _write_through(source: PackedWeight, target: torch.Tensor, func, name: str, args: tuple, kwargs: dict):
    """Apply the in-place write ``func(*args, **kwargs)`` aimed at ``target`` (a whole stand-in of ``source``) to
    its layer: dequantize, write, quantize again, and only then copy the new packed values into the layer's
    tensors.

    Returns what the write returns on a real tensor: the target (in-place methods, ``out=``) or None
    (``__setitem__``)."""
    from torch.utils._pytree import tree_map

    layer, record = source._linked(name)
    if name == "__set__:data":
        value = args[1]
        if not isinstance(value, torch.Tensor) or value.shape != target.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise source.refusal(
                name, f"`.data = ` takes a tensor of the weight's shape {tuple(target.shape)}, not {shape}"
            )
    codec = record.codec
    current = {key: _readable(source, name, key, getattr(layer, key, None)) for key in record.names}
    work_dtype = torch.promote_types(torch.promote_types(torch.float32, record.compute_dtype), record.dtype)
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        full = codec.unpack(dict(current), record.shape, work_dtype).to(work_dtype, copy=True).contiguous()

    def operand(value):
        if value is target or (isinstance(value, StandIn) and source.same(source_of(value))):
            return full
        if is_stand_in(value):  # another weight (or a part of this one): its value, read now
            return value_of(value, name)
        return value

    operands = tree_map(operand, (args, kwargs))
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        layout = (full.shape, full.stride(), full.data_ptr())
        func(*operands[0], **operands[1])
        if (full.shape, full.stride(), full.data_ptr()) != layout:
            raise source.refusal(name, "the operation changes the tensor's shape or layout, not its values")
        if not bool(torch.isfinite(full).all()):
            raise source.refusal(name, "the result is not finite (NaN or infinity), which the format cannot hold")
        packed = _repacked(codec, full, current, record)
    # every check passed: the only step that changes the layer (a resting tensor gets memory of its own first)
    for key in record.names:
        tensor = writable(getattr(layer, key))
        with torch._C.DisableTorchFunctionSubclass():
            tensor.data.copy_(packed[key])
    return None if name in ("__setitem__", "__set__:data") else target


def _repacked(
    codec: Quantizer, full: torch.Tensor, tensors: dict[str, torch.Tensor], record: PackedLayer
) -> dict[str, torch.Tensor]:
    """``full`` packed by ``codec`` (checked by :func:`pack_checked`) into tensors of the names, shapes
    and dtypes the layer holds now. Packed from ``full``'s dtype when the format stores the same
    tensors for it (a finer scale than from a bfloat16 copy), else from the original weight dtype."""
    sizes = PackedSizes(codec)
    current = {key: (t.shape, t.dtype) for key, t in tensors.items()}
    try:
        same = sizes.specs(record.shape, full.dtype) == current
    except Exception:  # a format that packs only some dtypes: pack the weight's own
        same = False
    packed = pack_checked(codec, sizes, full if same else full.to(record.dtype))
    got = {key: (t.shape, t.dtype) for key, t in packed.items()}
    if got != current:
        raise RuntimeError(f"{type(codec).__name__}.pack returned {got} for a weight the layer holds as {current}")
    return packed
