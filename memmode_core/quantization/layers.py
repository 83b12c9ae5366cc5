"""Quantization mechanics shared by every quantizer: which layers, how they are packed, how they run.

A :class:`~memmode_core.quantization.quantizer.Quantizer` plugin only packs and unpacks one weight. This module
does the rest, the same way for every format:

**Which layers.** Every ``nn.Linear`` of a component whose class does not override ``forward``,
minus, in this order: the modules the model itself declares precision-sensitive
(``_keep_in_fp32_modules``, honoured as diffusers' own quantizers honour it), the default exclusions
below, the user's ``exclude=`` fragments (a fragment excludes every layer whose qualified name
contains it), and the shapes the format cannot hold (``Quantizer.skip_reason``, e.g. NVFP4 needs an
input width that is a multiple of 16). Each layer left at full precision is reported with its reason.

**Default exclusions** (``DEFAULT_EXCLUDE``): the layers *outside the repeated blocks* of a
transformer — the stem that embeds the timestep, the text and the latent patches, and the head
(``norm_out`` / ``proj_out``) that produces the prediction. Measured by quantizing one group of
layers at a time and reading the error power it adds to the transformer's output, relative to the
output's power (``benchmarks/quant_accuracy.py --ablation``: a Wan-shaped model, hidden 768, 40
blocks, bf16):

=========================  ========  =============  =============
group (alone quantized)    bytes     qfloat8 noise  qfloat4 noise
=========================  ========  =============  =============
head (``proj_out``)        0.02%     7.4e-4         8.9e-3
text embedder              0.37%     2.9e-4         1.5e-3
time projection            1.10%     1.6e-4         4.8e-4
all 40 blocks              97.6%     4.4e-4         2.5e-3
=========================  ========  =============  =============

The stem and the head hold 1.5% of the bytes and three quarters of the error: they feed every
block at once (the time projection drives every block's modulation) or land on the prediction
unattenuated. Sparing them takes the output from 28.8 to 33.6 dB SQNR (qfloat8) and from 19.2 to
26.0 dB (qfloat4) for 0.7% and 1.1% more bytes; on the five tiny diffusers families the head and
the patch embedding (Flux ``x_embedder``, Qwen-Image ``img_in``, LTX ``proj_in``) dominate the error
the same way. The modulation projections *inside* the blocks (Flux's ``norm1.linear``, Qwen-Image's
``img_mod``) are quantized: on Flux they are 23% of the bytes and add about as much error per byte
as the rest of a block, so sparing them would cost far more than it gains. Norm weights and
modulation *tables* (``scale_shift_table``) are not ``nn.Linear`` and are never packed. ``exclude=``
adds fragments; the quantizer option ``default_exclude=()`` quantizes the stem and head too.

**How they are packed.** ``Quantizer.pack`` returns plain tensors. The ``weight_packed`` entry
takes the place of the layer's ``weight`` parameter (same position in ``named_parameters()``), the
others become buffers of the layer. The payload must have an integer dtype: floating-point
machinery then leaves it alone — diffusers' ``ModelMixin.dtype`` (which pipelines use to create
latents) skips it and keeps reporting the compute dtype, ``module.to(dtype)`` does not cast it, and
FSDP2 neither casts it under a ``MixedPrecisionPolicy`` nor needs a float8 collective (it
all-gathers mixed dtypes as bytes, which gloo supports). The payload is not called ``weight``
because its shape need not be the weight's (NVFP4 packs two values per byte) and its values are
not weights: a state dict of a quantized model has no ``weight`` key to be loaded, by mistake, into
a full-precision one.

**How they run.** The layer keeps its identity — placements computed their layout from module
objects before quantization, and hooks, adapters and references held elsewhere must keep working —
and its class is changed to a cached subclass of its own class, :class:`QuantizedLinear`, whose
``forward`` unpacks the weight from whatever the layer's attributes hold *at call time*. That is
what lets every placement and storage move quantized weights without knowing about them (the
engine swaps the tensors' ``.data``), keeps ``isinstance(layer, nn.Linear)`` true (peft finds the
layer to wrap a LoRA around), and stays traceable by ``torch.compile`` after ``apply``. A forward
hook would have to mutate ``weight`` around each call, which neither FSDP nor compiled graphs
tolerate; swapping the module for another object would orphan the placement's layout. The class
also answers ``layer.weight`` with a memory-free stand-in of the full-precision shape and the
compute dtype (see :attr:`QuantizedLinear.weight`), which is what LoRA loaders and dtype-sniffing
model code need: it reads as NaN, and an in-place write into it (``weight.data += delta``) is written
through to the packed tensors (dequantize, write, re-quantize) or refused before anything changes.

**Converting ahead.** :func:`convert` packs without installing the forward, for a model that is
sharded with FSDP2 ``fully_shard`` afterwards (scales must be computed on whole weights). A
quantizer with ``packs = False`` (``qfloat8_preconverted``) then installs only the forward; a packing
quantizer of the same format does the same on a converted model, since quantizing twice is a no-op.
"""

from __future__ import annotations

import contextvars
import re
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from memmode_core.contracts.errors import IncompatibleModeError, InvalidOptionError, QuantizedWeightWriteError
from memmode_core.contracts.storage import is_placeholder
from memmode_core.contracts.targets import is_fsdp1

if TYPE_CHECKING:  # the contract sits above these mechanics: its default check/quantize call them
    from memmode_core.quantization.quantizer import Quantizer

#: the key of ``Quantizer.pack``'s result that takes the place of the layer's ``weight`` parameter
PAYLOAD = "weight_packed"

#: The default-exclusion rule "layers outside the repeated blocks" (a rule, not a name fragment).
OUTSIDE_BLOCKS = "<outside blocks>"

#: What every quantizer leaves at full precision unless told otherwise (measured; see the module
#: docstring). ``exclude=`` adds to it; the ``default_exclude`` option replaces it.
DEFAULT_EXCLUDE: tuple[str, ...] = (OUTSIDE_BLOCKS,)

#: attribute of a packed ``nn.Linear`` holding its :class:`PackedLayer` record
PACKED_ATTRIBUTE = "_memmode_packed"

#: dtypes a dequantized weight can be computed in
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_BUFFER_NAME = re.compile(r"^weight_[A-Za-z0-9_]+$")


# -- the record a packed layer carries ----------------------------------------------------------------


@dataclass(eq=False)
class PackedLayer:
    """What a packed ``nn.Linear`` remembers: enough to unpack it, nothing derived from its data."""

    #: the packed format (``Quantizer.format_name``)
    format: str
    #: shape and dtype of the full-precision weight
    shape: torch.Size
    dtype: torch.dtype
    #: attribute names of the packed tensors, ``"weight"`` first
    names: tuple[str, ...]
    #: the quantizer whose ``unpack`` the forward calls (set when the forward is installed)
    codec: Quantizer | None = None
    #: the dtype the forward computes in (set when the forward is installed)
    compute_dtype: torch.dtype | None = None


def packed_record(module: nn.Module) -> PackedLayer | None:
    """The module's :class:`PackedLayer` if its weight is packed (converted or quantized), else None."""
    record = module.__dict__.get(PACKED_ATTRIBUTE)
    return record if isinstance(record, PackedLayer) else None


def is_quantized(module: nn.Module) -> bool:
    """Whether any layer of ``module`` holds packed weights (converted or quantized)."""
    return any(packed_record(m) is not None for m in module.modules())


# -- the dequantizing forward ---------------------------------------------------------------------------


class QuantizedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is packed; ``forward`` unpacks it from the current attributes.

    Layers become instances of this class (or of a cached subclass of their own class) by a class
    change, never by replacement. The matmul runs in the layer's compute dtype and the output comes
    back in the input's dtype, so a layer computing in bfloat16 drops into a float32 model; under
    autocast, the dtypes are autocast's business and nothing is cast here.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        record: PackedLayer = self._memmode_packed
        dtype = record.compute_dtype
        weight = record.codec.unpack({name: getattr(self, name) for name in record.names}, record.shape, dtype)
        autocast = torch.is_autocast_enabled(input.device.type)
        x = input if autocast or input.dtype == dtype else input.to(dtype)
        bias = self.bias
        if bias is not None and not autocast and bias.dtype != dtype:
            bias = bias.to(dtype)
        output = F.linear(x, weight, bias)
        if not autocast and output.dtype != input.dtype:
            output = output.to(input.dtype)
        return output

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

    def _apply(self, fn, recurse=True):
        """``module.to(dtype)`` / ``.half()`` / ``.float()`` move a quantized layer's tensors but keep their dtypes.

        The packed codes and their scales must keep theirs (a float32 scale cast to bfloat16 silently
        changes every dequantized value; NVFP4's float8 block scales would be cast too), and the bias keeps
        its own as well: the layer computes in its compute dtype whatever its storage holds, and code that
        casts a layer before writing into its weight (VideoX-Fun's ``merge_lora``: ``layer.to(device,
        dtype)``, then ``layer.weight.data += ...``, written through by :class:`WeightStandIn`) changes
        nothing but the codes the write re-quantizes. Devices change as asked. The cast copies made by
        ``fn`` are discarded (scales and biases: small).
        """
        originals = {
            name: (t.data if isinstance(t, nn.Parameter) else t)
            for name, t in (*self._parameters.items(), *self._buffers.items())
            if t is not None
        }
        result = super()._apply(fn, recurse)
        for name, original in originals.items():
            if name in self._parameters and self._parameters[name] is not None:
                current = self._parameters[name]
                if current.dtype != original.dtype:
                    current.data = original.to(device=current.device)
            elif name in self._buffers and self._buffers[name] is not None:
                current = self._buffers[name]
                if current.dtype != original.dtype:
                    self._buffers[name] = original.to(device=current.device)
        return result

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

    def extra_repr(self) -> str:
        record = packed_record(self)
        dtype = str(record.compute_dtype).replace("torch.", "")
        return f"{super().extra_repr()}, {record.format} -> {dtype}"


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
    """The type of :attr:`QuantizedLinear.weight`: a NaN broadcast that writes through to the packed weight.

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
    #: a weak reference to the :class:`QuantizedLinear` whose weight this stands in for (None: unlinked)
    _memmode_layer: weakref.ref[QuantizedLinear] | None = None
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


def _linked_layer(name: str, target: WeightStandIn) -> tuple[QuantizedLinear, PackedLayer]:
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
    if not isinstance(layer, QuantizedLinear) or record is None or record.codec is None:
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


def _packed_tensors(
    name: str, target: WeightStandIn, layer: QuantizedLinear, record: PackedLayer
) -> dict[str, torch.Tensor]:
    """The layer's packed tensors, refused unless each holds real values in the module."""
    tensors = {}
    for key in record.names:
        tensor = getattr(layer, key, None)
        if not isinstance(tensor, torch.Tensor):
            raise _refusal(name, target, f"its packed tensor {key!r} is missing")
        if tensor.is_meta or is_placeholder(tensor) or _is_dtensor(tensor):
            where = (
                "on the meta device"
                if tensor.is_meta
                else "sharded (DTensor)"
                if _is_dtensor(tensor)
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
    """A :attr:`QuantizedLinear.weight` stand-in: NaN broadcast from a single element."""
    return (
        tensor.dim() == 2
        and tensor.numel() > 0
        and tensor.is_floating_point()
        and tensor.stride() == (0, 0)
        and bool(torch.isnan(tensor[0, 0]))
    )


_SUBCLASSES: dict[type, type] = {nn.Linear: QuantizedLinear}


def quantized_class(cls: type) -> type:
    """The class a layer of class ``cls`` takes when its forward is installed (cached per class).

    It derives from ``cls`` as well, so ``isinstance`` checks against the layer's own class (FSDP2's
    ``FSDPLinear``, a library's ``nn.Linear`` subclass that does not override ``forward``) keep holding.
    """
    if issubclass(cls, QuantizedLinear):
        return cls
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(f"Quantized{cls.__name__}", (QuantizedLinear, cls), {"__module__": __name__})
        _SUBCLASSES[cls] = sub
    return sub


def install_forward(module: nn.Module, codec: Quantizer, compute_dtype: torch.dtype) -> None:
    """Make a packed layer run: it unpacks with ``codec`` and computes in ``compute_dtype``."""
    record = packed_record(module)
    if record is None:
        raise RuntimeError(f"{type(module).__name__} holds no packed weight")
    record.codec = codec
    record.compute_dtype = compute_dtype
    module.__class__ = quantized_class(type(module))


# -- which layers -----------------------------------------------------------------------------------


@dataclass
class LayerPlan:
    """The decision for one ``nn.Linear``."""

    path: str
    module: nn.Module
    #: "pack" (to be packed), "packed" (packed already, in ``format``) or "keep" (full precision)
    action: str
    #: why the layer stays at full precision ("keep")
    reason: str | None = None
    #: the format of an already packed layer ("packed")
    format: str | None = None


def _block_paths(component: nn.Module) -> list[str]:
    """Paths of the repeated blocks.

    The classes a diffusers or transformers model declares as its blocks (``_repeated_blocks``,
    ``_no_split_modules``); for a model that declares none, the children of any ``ModuleList`` /
    ``Sequential`` holding at least two modules of one class.
    """
    declared = set(getattr(component, "_repeated_blocks", None) or ())
    declared |= set(getattr(component, "_no_split_modules", None) or ())
    if declared:
        # by the class or a base of it: FSDP2 wraps a sharded block's class in a subclass of its own
        paths = [
            path
            for path, module in component.named_modules()
            if path and any(cls.__name__ in declared for cls in type(module).__mro__)
        ]
        if paths:
            return paths
    paths = []
    for path, module in component.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.named_children())
            classes = [type(child) for _, child in children]
            if any(classes.count(c) >= 2 for c in set(classes)):
                paths += [f"{path}.{name}" if path else name for name, _ in children]
    return paths


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root + ".") for root in roots)


def _data_type(t: torch.Tensor) -> type:
    return type(t.data) if isinstance(t, nn.Parameter) else type(t)


def _is_dtensor(t: torch.Tensor) -> bool:
    return _data_type(t).__name__ == "DTensor"


def _unpackable_reason(module: nn.Module) -> str | None:
    """Why an ``nn.Linear`` cannot be packed in any format; None when it can."""
    if type(module).forward is not nn.Linear.forward:
        return f"{type(module).__name__} has its own forward"
    weight = module.weight
    if weight is None or weight.dim() != 2:
        return "it has no 2-D weight"
    if weight.dtype not in COMPUTE_DTYPES:
        return f"its weight is {weight.dtype}, not a full-precision float"
    return None


def plan_layers(
    quantizer: Quantizer,
    component: nn.Module,
    *,
    exclude: Iterable[str] = (),
    default_exclude: Iterable[str] = DEFAULT_EXCLUDE,
) -> list[LayerPlan]:
    """The decision for each ``nn.Linear`` of ``component``, in the order of the module docstring."""
    exclude = tuple(exclude)
    default_exclude = tuple(default_exclude)
    keep_fp32 = tuple(getattr(component, "_keep_in_fp32_modules", None) or ())
    fragments = tuple(f for f in default_exclude if f != OUTSIDE_BLOCKS)
    blocks = _block_paths(component) if OUTSIDE_BLOCKS in default_exclude else []
    plans: list[LayerPlan] = []
    for path, module in component.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        record = packed_record(module)
        if record is not None:
            plans.append(LayerPlan(path, module, "packed", format=record.format))
            continue
        segments = path.split(".")
        reason = _unpackable_reason(module)
        if reason is None and (name := next((n for n in keep_fp32 if n in segments), None)):
            reason = f"kept in float32 by the model (_keep_in_fp32_modules: {name!r})"
        if reason is None and blocks and not _inside(path, blocks):
            reason = "outside the repeated blocks (default exclusion)"
        if reason is None and (name := next((f for f in fragments if f in path), None)):
            reason = f"default exclusion {name!r}"
        if reason is None and (name := next((f for f in exclude if f in path), None)):
            reason = f"exclude={name!r}"
        if reason is None:
            reason = quantizer.skip_reason(module.weight.shape)
        plans.append(LayerPlan(path, module, "keep" if reason else "pack", reason))
    return plans


# -- sizes: the planner's predictions and the real path share them -------------------------------------


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _direct_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in module._parameters.items():
        if t is not None:
            yield name, t
    for name, t in module._buffers.items():
        if t is not None:
            yield name, t


def _direct_bytes(module: nn.Module) -> int:
    return tensor_bytes(t for _, t in _direct_tensors(module))


def component_bytes(component: nn.Module) -> int:
    """Bytes of the component's tensors, each counted once (a tied weight is stored once)."""
    unique = {id(t): t for m in component.modules() for _, t in _direct_tensors(m)}
    return tensor_bytes(unique.values())


def _validate_packed(quantizer: Quantizer, packed: Any) -> None:
    """A plugin's ``pack`` result must follow the contract; a violation is a bug in the plugin."""
    where = f"{type(quantizer).__name__}.pack ({quantizer.name})"
    if not isinstance(packed, dict) or PAYLOAD not in packed:
        raise TypeError(f"{where} must return a dict with a {PAYLOAD!r} entry")
    for name, t in packed.items():
        if not isinstance(name, str) or (name != PAYLOAD and not _BUFFER_NAME.match(name)):
            raise TypeError(f"{where}: packed tensor name {name!r} must be {PAYLOAD!r} or start with 'weight_'")
        if type(t) is not torch.Tensor:
            raise TypeError(f"{where}: {name!r} must be a plain torch.Tensor, not {type(t).__name__}")
    payload = packed[PAYLOAD]
    if payload.dtype.is_floating_point or payload.dtype.is_complex or payload.dtype == torch.bool:
        raise TypeError(
            f"{where}: the {PAYLOAD!r} payload must have an integer dtype, not {payload.dtype} "
            f"(store float8 bits as uint8)"
        )


class PackedSizes:
    """Shapes and dtypes of a quantizer's packed tensors, learned by running its ``pack`` on meta
    tensors (cached per weight shape and dtype). The real path checks every ``pack`` result against
    them, so a prediction cannot differ from what quantizing stores."""

    def __init__(self, quantizer: Quantizer) -> None:
        self.quantizer = quantizer
        self._cache: dict[tuple[torch.Size, torch.dtype], dict[str, tuple[torch.Size, torch.dtype]]] = {}

    def specs(self, shape: torch.Size, dtype: torch.dtype) -> dict[str, tuple[torch.Size, torch.dtype]]:
        key = (torch.Size(shape), dtype)
        if key not in self._cache:
            with torch.no_grad():
                packed = self.quantizer.pack(torch.empty(key[0], dtype=dtype, device="meta"))
            _validate_packed(self.quantizer, packed)
            self._cache[key] = {name: (t.shape, t.dtype) for name, t in packed.items()}
        return self._cache[key]

    def nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        return sum(s.numel() * d.itemsize for s, d in self.specs(shape, dtype).values())


@dataclass
class QuantizationPlan:
    """Every decision quantizing one component makes, computed from shapes without touching it."""

    quantizer: Quantizer
    component: nn.Module
    layers: list[LayerPlan]
    sizes: PackedSizes
    _by_module: dict[int, LayerPlan] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._by_module = {id(p.module): p for p in self.layers}

    @property
    def to_pack(self) -> list[LayerPlan]:
        return [p for p in self.layers if p.action == "pack"]

    @property
    def packed(self) -> list[LayerPlan]:
        return [p for p in self.layers if p.action == "packed"]

    @property
    def kept(self) -> list[LayerPlan]:
        return [p for p in self.layers if p.action == "keep"]

    @property
    def packs_anything(self) -> bool:
        """False when the component is packed already: quantizing it again is a no-op."""
        return not self.packed

    def direct_bytes(self, module: nn.Module) -> int:
        """Bytes of ``module``'s own parameters and buffers once the component is quantized."""
        plan = self._by_module.get(id(module))
        if plan is None or plan.action != "pack" or not self.packs_anything or packed_record(module) is not None:
            return _direct_bytes(module)  # not to be packed, or packed since the plan was made
        rest = tensor_bytes(t for name, t in _direct_tensors(module) if name != "weight")
        return rest + self.sizes.nbytes(module.weight.shape, module.weight.dtype)

    def total_bytes(self) -> int:
        """Bytes of the component's tensors once quantized (the sum of every module's ``direct_bytes``;
        a tensor tied between two modules counts for each)."""
        return sum(self.direct_bytes(m) for m in self.component.modules())


def plan_quantization(
    quantizer: Quantizer,
    component: nn.Module,
    *,
    exclude: Iterable[str] = (),
    options: Mapping[str, object] | None = None,
) -> QuantizationPlan:
    """Which layers of ``component`` quantizing packs, which it keeps and why, and the sizes that
    leads to. :func:`quantize_component` follows exactly this plan."""
    default_exclude = tuple((options or {}).get("default_exclude", DEFAULT_EXCLUDE))
    layers = plan_layers(quantizer, component, exclude=exclude, default_exclude=default_exclude)
    return QuantizationPlan(quantizer, component, layers, PackedSizes(quantizer))


def quantized_direct_bytes(
    quantizer: Quantizer,
    module: nn.Module,
    *,
    exclude: Iterable[str] = (),
    component: nn.Module | None = None,
    options: Mapping[str, object] | None = None,
) -> int:
    """Bytes of ``module``'s own tensors (not its children's) after quantization, without quantizing.

    ``component`` is the quantizer's target that contains ``module`` (default: ``module`` itself):
    exclusions are decided in its context, as ``apply`` decides them. To size many modules of one
    component, call :func:`plan_quantization` once and ask its ``direct_bytes``.
    """
    plan = plan_quantization(
        quantizer, component if component is not None else module, exclude=exclude, options=options
    )
    return plan.direct_bytes(module)


# -- the summary --------------------------------------------------------------------------------------


@dataclass
class QuantizationSummary:
    """What quantizing one component did (``handle.report().quantization[name]``)."""

    quantizer: str
    format: str
    #: the dtype(s) the packed layers compute in ("" after ``convert``, which installs no forward)
    compute_dtype: str
    #: layers packed by this call
    packed_layers: int
    #: layers that were packed before this call (converted ahead, or quantized by an earlier apply)
    already_packed_layers: int
    #: layer path -> why it stays at full precision
    full_precision: dict[str, str]
    bytes_before: int
    bytes_after: int

    @property
    def no_op(self) -> bool:
        return self.packed_layers == 0 and self.already_packed_layers > 0

    def as_dict(self) -> dict:
        return {
            "quantizer": self.quantizer,
            "format": self.format,
            "compute_dtype": self.compute_dtype,
            "packed_layers": self.packed_layers,
            "already_packed_layers": self.already_packed_layers,
            "full_precision_layers": len(self.full_precision),
            "full_precision": dict(self.full_precision),
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
        }

    def __str__(self) -> str:
        ratio = self.bytes_after / self.bytes_before if self.bytes_before else 1.0
        return (
            f"{self.quantizer}: {self.packed_layers + self.already_packed_layers} layers in {self.format}, "
            f"{len(self.full_precision)} at full precision, {ratio:.2f}x the bytes"
        )


def _summary(quantizer: Quantizer, plan: QuantizationPlan, packed_now: int, bytes_before: int) -> QuantizationSummary:
    full_precision = {p.path: p.reason for p in plan.kept}
    if not plan.packs_anything:
        for p in plan.to_pack:
            full_precision[p.path] = "left at full precision when the component was first converted or quantized"
    dtypes = set()
    for module in plan.component.modules():
        record = packed_record(module)
        if record is not None and record.compute_dtype is not None:
            dtypes.add(str(record.compute_dtype).replace("torch.", ""))
    return QuantizationSummary(
        quantizer=quantizer.name,
        format=quantizer.format_name,
        compute_dtype=", ".join(sorted(dtypes)),
        packed_layers=packed_now,
        already_packed_layers=0 if plan.packs_anything else len(plan.packed),
        full_precision=dict(sorted(full_precision.items())),
        bytes_before=bytes_before,
        bytes_after=component_bytes(plan.component),
    )


# -- checks (before anything is touched) ----------------------------------------------------------------


def check_weight_dtype(weight_dtype: torch.dtype | None) -> None:
    if weight_dtype is not None and weight_dtype not in COMPUTE_DTYPES:
        raise InvalidOptionError(
            f"weight_dtype={weight_dtype} cannot be a compute dtype; quantized weights are dequantized to "
            f"one of {', '.join(str(d).replace('torch.', '') for d in COMPUTE_DTYPES)}"
        )


def check_component(
    quantizer: Quantizer,
    name: str,
    component: nn.Module,
    *,
    exclude: Iterable[str] = (),
    options: Mapping[str, object] | None = None,
) -> QuantizationPlan:
    """Refuse with ``IncompatibleModeError`` what cannot be quantized; return the plan otherwise."""
    fmt = quantizer.format_name
    if is_fsdp1(component):
        raise IncompatibleModeError(
            f"cannot quantize {name!r} with {quantizer.name}: it is wrapped in FSDP1 (FullyShardedDataParallel), "
            f"whose flat parameters cannot hold packed weights. Convert it, then shard it with FSDP2 "
            f"(torch.distributed.fsdp.fully_shard)."
        )
    plan = plan_quantization(quantizer, component, exclude=exclude, options=options)
    others = sorted({p.format for p in plan.packed} - {fmt})
    if others:
        raise IncompatibleModeError(
            f"{name!r} is already quantized with {', '.join(others)}; memmode does not re-quantize a quantized "
            f"model (and remove() does not undo quantization). Load the model again to use {quantizer.name}."
        )
    if not plan.packs_anything:  # converted ahead, or quantized by an earlier apply
        return plan
    if not quantizer.packs:
        raise IncompatibleModeError(
            f"{quantizer.name} only installs the dequantizing forward on layers converted to {fmt} beforehand, and "
            f"{name!r} holds no {fmt} layer. Convert it while its weights are whole, before any sharding "
            f"(memmode_core.convert({fmt!r}, model)), or use {fmt} on an unsharded model."
        )
    wrapped = [
        p for p in plan.to_pack if _data_type(p.module.weight) is not torch.Tensor and not _is_dtensor(p.module.weight)
    ]
    if wrapped:
        raise IncompatibleModeError(
            f"cannot quantize {name!r} with {quantizer.name}: {wrapped[0].path}.weight is a "
            f"{_data_type(wrapped[0].module.weight).__name__}, not a plain tensor (another library quantized or "
            f"wrapped it)"
        )
    sharded = [p.path for p in plan.to_pack if _is_dtensor(p.module.weight)]
    if sharded:
        raise IncompatibleModeError(
            f"cannot quantize {name!r} with {quantizer.name}: its weights are already sharded (DTensor, e.g. "
            f"{sharded[0]}.weight), and scales must be computed on whole weights. Convert before sharding: "
            f"memmode_core.convert({fmt!r}, model) on every rank while the weights are whole, then "
            f"fully_shard, then apply the mode."
        )
    meta = [p.path for p in plan.to_pack if p.module.weight.is_meta]
    if meta and not SIZES_ONLY.get():
        raise IncompatibleModeError(f"cannot quantize {name!r}: {meta[0]}.weight is on the meta device (not loaded)")
    if not plan.to_pack:
        if not plan.layers:
            why = "it has no nn.Linear layer"
        else:
            listed = "; ".join(f"{p.path}: {p.reason}" for p in plan.kept[:3])
            why = f"every nn.Linear layer stays at full precision ({listed}{'; ...' if len(plan.kept) > 3 else ''})"
        raise IncompatibleModeError(f"{quantizer.name} has nothing to quantize in {name!r}: {why}")
    return plan


def check_components(
    quantizer: Quantizer,
    components: Mapping[str, nn.Module],
    *,
    weight_dtype: torch.dtype | None,
    exclude: tuple[str, ...],
    options: Mapping[str, object],
) -> None:
    check_weight_dtype(weight_dtype)
    for name, component in components.items():
        check_component(quantizer, name, component, exclude=exclude, options=options)


#: set while planning from a checkpoint's headers (``memmode plan --model``): weights on the meta device
#: have the shapes and dtypes a check needs, and none of the values it does not
SIZES_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("memmode_sizes_only", default=False)


# -- acting ---------------------------------------------------------------------------------------------


def _pack_all(plan: QuantizationPlan) -> int:
    """Pack every layer the plan says; returns how many. A weight shared by several layers (tied)
    is packed once and the packed tensors are shared the same way."""
    quantizer = plan.quantizer
    shared: dict[int, tuple[torch.Tensor, nn.Parameter, dict[str, torch.Tensor]]] = {}
    for layer in plan.to_pack:
        module = layer.module
        weight = module.weight
        known = shared.get(id(weight))
        if known is None:
            packed = pack_checked(quantizer, plan.sizes, weight)
            payload = nn.Parameter(packed.pop(PAYLOAD), requires_grad=False)
            known = shared[id(weight)] = (weight, payload, packed)
        _, payload, buffers = known
        attach_packed(module, quantizer.format_name, weight.shape, weight.dtype, payload, buffers, layer.path)
    return len(plan.to_pack)


def attach_packed(
    module: nn.Module,
    fmt: str,
    shape: torch.Size,
    dtype: torch.dtype,
    payload: nn.Parameter,
    buffers: Mapping[str, torch.Tensor],
    path: str = "layer",
) -> None:
    """Make ``module`` a packed layer holding ``payload`` (in place of ``weight``) and ``buffers``.

    The packed tensors may come from :meth:`Quantizer.pack` or from a file (loading a quantized
    checkpoint, or quantizing while streaming one): a layer is the same whichever way it was filled.
    The forward is installed separately (:func:`install_forward`).
    """
    clash = [n for n in (PAYLOAD, *buffers) if hasattr(module, n)]
    if clash:
        raise RuntimeError(f"{path} already has an attribute {clash[0]!r}; cannot store the packed tensor")
    _replace_parameter(module, "weight", PAYLOAD, payload)
    for buffer_name, tensor in buffers.items():
        module.register_buffer(buffer_name, tensor, persistent=True)
    module.__dict__[PACKED_ATTRIBUTE] = PackedLayer(fmt, torch.Size(shape), dtype, (PAYLOAD, *buffers))


def _replace_parameter(module: nn.Module, old: str, new: str, parameter: nn.Parameter) -> None:
    """Put ``parameter`` under ``new`` where ``old`` was, keeping the order of ``named_parameters()``
    (what FSDP2 groups and diffusers' dtype lookup walk)."""
    entries = [(new, parameter) if name == old else (name, value) for name, value in module._parameters.items()]
    module._parameters.clear()
    module._parameters.update(entries)


def pack_checked(quantizer: Quantizer, sizes: PackedSizes, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    expected = sizes.specs(weight.shape, weight.dtype)
    with torch.no_grad():
        packed = quantizer.pack(weight.detach())
    _validate_packed(quantizer, packed)
    got = {name: (t.shape, t.dtype) for name, t in packed.items()}
    if got != expected:
        raise RuntimeError(
            f"{type(quantizer).__name__}.pack returned {got} for a {tuple(weight.shape)} {weight.dtype} weight but "
            f"{expected} on the meta device: shapes and dtypes must not depend on the data"
        )
    moved = [name for name, t in packed.items() if t.device != weight.device]
    if moved:
        raise RuntimeError(f"{type(quantizer).__name__}.pack put {moved[0]!r} on another device than the weight")
    return dict(packed)


def convert(
    quantizer: Quantizer | str,
    module: nn.Module,
    *,
    exclude: Iterable[str] = (),
    default_exclude: Iterable[str] = DEFAULT_EXCLUDE,
) -> QuantizationSummary:
    """Pack ``module``'s layers in ``quantizer``'s format (an instance or a registered name) without
    installing the forward.

    This is the order FSDP2 needs: scales are computed here on whole weights, ``fully_shard`` then
    shards the packed payload like any parameter (the scales are buffers, replicated), and
    ``apply`` installs the forward — with the packing quantizer (quantizing a converted model again
    is a no-op) or with a forward-only one such as ``qfloat8_preconverted``. Until then a converted
    layer has no ``weight`` and cannot run: it never computes with packed bytes. ``exclude`` and
    ``default_exclude`` mean what they mean to ``apply``; converting a module that holds layers of this
    format already does nothing.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert() takes a torch.nn.Module such as pipe.transformer, not {type(module).__name__}")
    if isinstance(quantizer, str):
        raise TypeError(
            f"quantization.convert() takes a Quantizer instance; for a registered name use "
            f"memmode_core.convert({quantizer!r}, module)"
        )
    options = {"default_exclude": tuple(default_exclude)}
    plan = check_component(quantizer, type(module).__name__, module, exclude=tuple(exclude), options=options)
    before = component_bytes(module)
    packed_now = _pack_all(plan) if plan.packs_anything else 0
    return _summary(quantizer, plan, packed_now, before)


def quantize_component(
    quantizer: Quantizer,
    component: nn.Module,
    *,
    weight_dtype: torch.dtype | None,
    exclude: Iterable[str] = (),
    options: Mapping[str, object] | None = None,
    name: str = "module",
    plan: QuantizationPlan | None = None,
) -> QuantizationSummary:
    """Pack what :func:`plan_quantization` says and install the forward on every packed layer.

    On a component that holds layers of this format already — converted ahead, or quantized by an
    earlier ``apply`` — nothing is packed again (the same quantizer twice is a no-op): the forward
    is installed where it is missing, and an explicit ``weight_dtype`` becomes the compute dtype.
    Otherwise each layer computes in ``weight_dtype``, or in its own dtype before packing.
    """
    check_weight_dtype(weight_dtype)
    if plan is None:
        plan = check_component(quantizer, name, component, exclude=exclude, options=options)
    before = component_bytes(component)
    packed_now = _pack_all(plan) if plan.packs_anything else 0
    for module in component.modules():
        record = packed_record(module)
        if record is not None:
            dtype = weight_dtype or record.compute_dtype or record.dtype
            install_forward(module, quantizer, dtype)
    return _summary(quantizer, plan, packed_now, before)


__all__ = [
    "COMPUTE_DTYPES",
    "DEFAULT_EXCLUDE",
    "OUTSIDE_BLOCKS",
    "LayerPlan",
    "PackedLayer",
    "PackedSizes",
    "QuantizationPlan",
    "QuantizationSummary",
    "QuantizedLinear",
    "WeightStandIn",
    "attach_packed",
    "check_component",
    "check_components",
    "component_bytes",
    "pack_checked",
    "convert",
    "install_forward",
    "is_quantized",
    "packed_record",
    "plan_layers",
    "plan_quantization",
    "quantize_component",
    "quantized_class",
    "quantized_direct_bytes",
    "tensor_bytes",
]
