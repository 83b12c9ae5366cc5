"""What ``layer.weight`` is on a quantized layer: a memory-free stand-in, and the writes it carries through.

A quantized layer has no full-precision weight, but code written for full-precision layers still reads one —
diffusers' LoRA loaders check its shape, peft casts an adapter to its dtype and moves it to its device, model
code casts activations to it — and some writes into one in place (merging a LoRA: VideoX-Fun's
``weight.data += delta``). The layer answers ``weight`` with a :class:`WeightStandIn`: the full-precision
shape, the compute dtype, the packed tensors' device, no memory (one NaN broadcast). A write into it is a
write into the layer — dequantize, write, quantize again — or a refusal before anything changes; the forward
never reads it. :class:`WeightStandInMixin` is the part of the packed layer's class that answers ``weight``
(and keeps state dicts consistent with it); the dequantizing forward itself is in
:mod:`memmode_core.quantization.forward`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from memmode_core.contracts.errors import QuantizedWeightWriteError
from memmode_core.contracts.quantizer import Quantizer
from memmode_core.contracts.storage import is_placeholder
from memmode_core.quantization.packed import PackedLayer, is_dtensor, packed_record
from memmode_core.quantization.sizes import PackedSizes, pack_checked


class WeightStandInMixin:
    """What a packed layer's class (:class:`~memmode_core.quantization.forward.QuantizedLinear`) answers for
    ``weight``, and how its state dicts carry that answer. A layer of this class is one a stand-in can write
    through to."""

    @property
    def weight(self) -> torch.Tensor:
        """A stand-in for the full-precision weight, for the code that inspects one or writes into it.

        Loaders, adapters and models read ``layer.weight``'s shape (diffusers' LoRA loaders check
        it against the adapter's), dtype (peft casts an adapter to it; transformers and diffusers
        cast activations to it) and device (peft moves an adapter there). The stand-in has the
        full-precision shape, the compute dtype and the packed tensors' current device, and holds
        no memory: one NaN broadcast to that shape. Code that reads its values gets NaN; the forward
        never reads it. Code that writes into it in place — merging an adapter into the base weight,
        VideoX-Fun's ``weight.data += delta`` — writes into the layer: the weight is dequantized,
        the write applied to it, and the result quantized again into the layer's packed tensors
        (:class:`WeightStandIn` says which writes, and which are refused before anything changes).
        State dicts carry it under ``weight`` too (diffusers' LoRA loaders look the weight up
        there); loading it back is a no-op, loading a real full-precision weight into the layer is
        an error.
        """
        record: PackedLayer = self._memmode_packed
        payload = self.weight_packed
        nan = torch.full((), float("nan"), dtype=record.compute_dtype, device=payload.device).expand(record.shape)
        stand_in = nan.as_subclass(WeightStandIn)
        stand_in._memmode_format = record.format
        stand_in._memmode_layer = weakref.ref(self)
        stand_in._memmode_whole = True
        return stand_in

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
            if _is_stand_in(incoming):
                state_dict.pop(key)  # what _save_to_state_dict wrote: nothing to load
            else:
                error_msgs.append(
                    f"{key}: cannot load a full-precision weight into a layer quantized with "
                    f"{self._memmode_packed.format}; load the weights before applying the mode"
                )
                state_dict.pop(key)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


#: in-place Python operators (``t += x`` calls ``t.__iadd__``) and the setters of ``t[...] = x``, ``t.data = x``
_WRITING_DUNDERS = frozenset(
    {
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__imatmul__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__setitem__",
        "__set__",
    }
)
#: in-place methods that change no values
_HARMLESS_IN_PLACE = frozenset({"requires_grad_", "share_memory_", "retain_grad", "detach_"})
#: ``Tensor.data``'s getter and setter, as ``__torch_function__`` receives them (``func == ...``)
_DATA_GET = torch.Tensor.data.__get__
_DATA_SET = torch.Tensor.data.__set__
#: functions whose result, when it has the source's shape and dtype, is the whole source again
_WHOLE_VIEWS = frozenset({"detach", "alias", "view", "view_as", "reshape", "reshape_as", "expand", "expand_as"})


class WeightStandIn(torch.Tensor):
    """The type of :attr:`WeightStandInMixin.weight`: a NaN broadcast that writes through to the packed weight.

    Code written for full-precision layers merges deltas into the weight in place — VideoX-Fun's
    ``merge_lora`` / ``unmerge_lora`` do ``layer.weight.data += up @ down`` (``-=``), others
    ``weight.data.copy_(...)``, ``weight[...] = ...``, ``torch.add(..., out=weight)`` or
    ``nn.init.zeros_(weight)``. Such a write into the stand-in — or into ``.data``, ``.detach()`` or
    any other view of the whole of it (``[...]``, ``[:]``, ``view``/``reshape`` to its own shape) —
    is a write into the layer (:func:`_write_through`): the packed weight is dequantized to float32
    (float64 if the layer computes in it), the same operation runs on that full tensor, the result
    is quantized again with the layer's quantizer, and the new packed tensors are copied into the
    layer's existing ones, in place — so a storage that keeps the at-rest tensor itself (``ram``,
    ``pinned``) holds the new values, exactly as after an in-place write into a full-precision
    weight under the same placement (a copy resident on the device, or ``mmap``, needs
    ``handle.refresh()`` the same way). The packed names, shapes and dtypes never change. The cost
    is a second rounding to the format (docs/videox-fun.md has the measurement). ``t.data = x`` on
    the stand-in is the same write as ``t.data.copy_(x)``; assigning it its own write's result
    (Python's ``t.data += x`` ends with ``t.data = <that result>``) does nothing.

    Refused with :class:`~memmode_core.contracts.errors.QuantizedWeightWriteError` (an
    ``IncompatibleModeError`` and a ``RuntimeError``) *before anything changes* — the layer's
    packed tensors are written only once every step has succeeded:

    * a write into part of the weight through a view of a part (``weight[0].add_(x)``,
      ``weight.data[:, :4].copy_(x)``, ``weight.t().mul_(2)``): the stand-in cannot tell which
      part a view of its single element is. Index the whole instead: ``weight.data[0] = x`` works;
    * a layer whose packed tensors are not in the module — offloaded to the ``disk`` storage
      (placeholders), on the meta device, or sharded (DTensor): there is nothing to dequantize;
    * a result that is not finite, e.g. computed from another quantized layer's stand-in (NaN), and
      an operation that changes the tensor's layout instead of its values (``t_``, ``resize_`` to
      another shape);
    * a stand-in whose layer is gone or no longer quantized, and any other ``__set__``
      (``weight.requires_grad = ...``).

    Out-of-place results are plain tensors (of NaN). Reading shape, dtype and device works as on
    any tensor.
    """

    _memmode_format = "a packed format"
    #: a weak reference to the packed layer whose weight this stands in for (None: unlinked)
    _memmode_layer: weakref.ref[nn.Module] | None = None
    #: whether this tensor is the whole weight (the stand-in itself, ``.data``, ``.detach()``, ...)
    _memmode_whole = False

    def __getstate__(self):
        """Pickled (``torch.save`` of a state dict) without the link: a stand-in loaded back writes into nothing."""
        return {key: value for key, value in self.__dict__.items() if key != "_memmode_layer"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        stand_ins = [a for a in args if isinstance(a, WeightStandIn)]
        out = kwargs.get("out")
        if name == "__set__" and args and isinstance(args[0], WeightStandIn):
            if func == _DATA_SET:
                return _assign_data(args[0], args[1])
            raise _refusal(name, args[0], "a stand-in only takes writes of values")
        if isinstance(out, (tuple, list)) and any(isinstance(o, WeightStandIn) for o in out):
            raise _refusal(
                name,
                next(o for o in out if isinstance(o, WeightStandIn)),
                "an operation with several outputs cannot write into it",
            )
        writes = name in _WRITING_DUNDERS or (
            name.endswith("_") and not name.startswith("_") and name not in _HARMLESS_IN_PLACE
        )
        if isinstance(out, WeightStandIn) or (writes and args and isinstance(args[0], WeightStandIn)):
            target = out if isinstance(out, WeightStandIn) else args[0]
            return _write_through(target, func, name, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
            if isinstance(result, torch.Tensor) and stand_ins and not isinstance(result, WeightStandIn):
                alias = _aliased_stand_in(func, name, args, stand_ins, result)
                if alias is not None:  # a view (``.data``, ``.detach()``, indexing): writes into it write through
                    result = result.as_subclass(WeightStandIn)
                    result._memmode_format = alias._memmode_format
                    result._memmode_layer = alias._memmode_layer
                    result._memmode_whole = alias._memmode_whole and _keeps_whole(func, name, args, alias, result)
        return result


def _aliased_stand_in(
    func, name: str, args: tuple, stand_ins: list[WeightStandIn], result: torch.Tensor
) -> WeightStandIn | None:
    """The stand-in among ``args`` whose single element ``result`` is a view of, if any."""
    if result.layout != torch.strided:
        return None
    if result.is_meta:  # every meta tensor has address 0: only the whole-weight views of the source are linked
        source = args[0] if args and isinstance(args[0], WeightStandIn) else None
        return source if source is not None and _keeps_whole(func, name, args, source, result) else None
    pointer = result.untyped_storage().data_ptr()
    return next((a for a in stand_ins if a.is_meta is False and a.untyped_storage().data_ptr() == pointer), None)


def _keeps_whole(func, name: str, args: tuple, source: WeightStandIn, result: torch.Tensor) -> bool:
    """Whether ``result`` of ``func(source, ...)`` is all of ``source``, element for element (not a
    transpose or a part, which a view of a single element cannot tell apart from the whole)."""
    if not args or args[0] is not source or result.shape != source.shape or result.dtype != source.dtype:
        return False
    if func == _DATA_GET or name in _WHOLE_VIEWS:
        return True
    if name == "__getitem__" and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return all(i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in index)
    return False


def _refusal(name: str, target: WeightStandIn, why: str) -> QuantizedWeightWriteError:
    return QuantizedWeightWriteError(
        f"{name or 'write'}: cannot write into the weight of a layer quantized with {target._memmode_format}: {why}. "
        f"Nothing was changed. Merge the LoRA before applying the quantized mode, or load it unfused "
        f"(pipe.load_lora_weights(...), which runs it at weight_dtype on the dequantized weight)."
    )


def _linked_layer(name: str, target: WeightStandIn) -> tuple[nn.Module, PackedLayer]:
    """The layer ``target`` writes through to, or the refusal that says why there is none."""
    layer = target._memmode_layer() if target._memmode_layer is not None else None
    if layer is None:
        raise _refusal(
            name,
            target,
            "this stand-in is linked to no layer (its layer is gone, or it was not obtained "
            "from `layer.weight`), so the write has nothing to write into",
        )
    record = packed_record(layer)
    if not isinstance(layer, WeightStandInMixin) or record is None or record.codec is None:
        raise _refusal(name, target, f"{type(layer).__name__} is no longer quantized; write into its own `weight`")
    if not target._memmode_whole or target.shape != record.shape:
        raise _refusal(
            name,
            target,
            "the target is a view of part of the weight (indexing, `t()`, `narrow`, ...), "
            "which the stand-in cannot locate; write through the whole weight instead "
            "(`weight.data[index] = value`, `weight.data += full_delta`)",
        )
    return layer, record


def _packed_tensors(name: str, target: WeightStandIn, layer: nn.Module, record: PackedLayer) -> dict[str, torch.Tensor]:
    """The layer's packed tensors, refused unless each holds real values in the module."""
    tensors = {}
    for key in record.names:
        tensor = getattr(layer, key, None)
        if not isinstance(tensor, torch.Tensor):
            raise _refusal(name, target, f"its packed tensor {key!r} is missing")
        if tensor.is_meta or is_placeholder(tensor) or is_dtensor(tensor):
            where = (
                "on the meta device"
                if tensor.is_meta
                else "sharded (DTensor)"
                if is_dtensor(tensor)
                else "a placeholder: the weight is offloaded to a storage that keeps nothing in the module (disk)"
            )
            raise _refusal(
                name,
                target,
                f"its packed tensor {key!r} is {where}, so there is no weight to dequantize and write into",
            )
        tensors[key] = tensor
    return tensors


def _write_through(target: WeightStandIn, func, name: str, args: tuple, kwargs: dict):
    """Apply the in-place write ``func(*args, **kwargs)`` aimed at ``target`` to its layer: dequantize,
    write, quantize again, and only then copy the new packed values into the layer's tensors.

    Returns what the write returns on a real tensor: the target (in-place methods, ``out=``) or None
    (``__setitem__``)."""
    from torch.utils._pytree import tree_map

    layer, record = _linked_layer(name, target)
    codec = record.codec
    tensors = _packed_tensors(name, target, layer, record)
    work_dtype = torch.promote_types(torch.promote_types(torch.float32, record.compute_dtype), record.dtype)

    def operand(value):
        if not isinstance(value, WeightStandIn):
            return value
        if value is target or (
            value._memmode_whole
            and value._memmode_layer is not None
            and value._memmode_layer() is layer
            and value.shape == record.shape
        ):
            return full
        raise _refusal(
            name,
            target,
            "an operand is a quantized weight's stand-in for a part of this weight or for "
            "another layer, whose values are not available (NaN)",
        )

    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        full = codec.unpack(dict(tensors), record.shape, work_dtype).to(work_dtype, copy=True).contiguous()
        layout = (full.shape, full.stride(), full.data_ptr())
        func(*tree_map(operand, args), **tree_map(operand, kwargs))
        if (full.shape, full.stride(), full.data_ptr()) != layout:
            raise _refusal(name, target, "the operation changes the tensor's shape or layout, not its values")
        if not bool(torch.isfinite(full).all()):
            raise _refusal(name, target, "the result is not finite (NaN or infinity), which the format cannot hold")
        packed = _repacked(codec, full, tensors, record)
        for key, tensor in tensors.items():  # every check passed: the only step that changes the layer
            tensor.data.copy_(packed[key])
    return None if name == "__setitem__" else target


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


def _assign_data(target: WeightStandIn, value: Any) -> None:
    """``target.data = value``: nothing when ``value`` is the whole weight of the same layer (the end of
    Python's ``t.data += x``), else the write ``target.data.copy_(value)`` of a tensor of the weight's shape."""
    if isinstance(value, WeightStandIn):
        layer = target._memmode_layer() if target._memmode_layer is not None else None
        if (
            layer is not None
            and value._memmode_whole
            and value._memmode_layer is not None
            and value._memmode_layer() is layer
            and value.shape == target.shape
        ):
            return None
        raise _refusal(
            "__set__",
            target,
            "`.data = ` of a stand-in for part of a weight or for another layer, whose values are not available",
        )
    if not isinstance(value, torch.Tensor) or value.shape != target.shape:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise _refusal(
            "__set__", target, f"`.data = ` takes a tensor of the weight's shape {tuple(target.shape)}, not {shape}"
        )
    _write_through(target, torch.Tensor.copy_, "__set__", (target, value), {})
    return None


def _is_stand_in(tensor: torch.Tensor) -> bool:
    """A :attr:`WeightStandInMixin.weight` stand-in: NaN broadcast from a single element."""
    return (
        tensor.dim() == 2
        and tensor.numel() > 0
        and tensor.is_floating_point()
        and tensor.stride() == (0, 0)
        and bool(torch.isnan(tensor[0, 0]))
    )
