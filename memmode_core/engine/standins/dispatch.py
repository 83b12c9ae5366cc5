"""How every torch function given a stand-in is served: the routing behind the stand-ins' ``__torch_function__``.

Every torch function given a stand-in (:mod:`~memmode_core.engine.standins.classes`) comes through
:func:`dispatch`, which sorts it by the tables below (the names torch's ``__torch_function__`` protocol passes:
a method's name, ``__get__:shape`` for a property's getter) into one of three kinds:

* **metadata** (shape, dtype, device, strides, ``data_ptr``, ``*_like`` allocations): answered from the
  stand-in itself, free. ``detach()``, ``.data`` and views of the whole stay lazy stand-ins of the same value
  (``state_dict()`` holds them without reading anything). A function not listed as metadata reads values, so a
  new torch function is served, never handed a placeholder;
* **a read** of values (any other function): each stand-in among the arguments is replaced by its value
  (:meth:`StandInSource.value <memmode_core.engine.standins.classes.StandInSource.value>`: onloaded into the
  running call, read from the storage, or dequantized), the function runs on plain tensors, and a result that
  is a view of a value read for it is a :class:`~memmode_core.engine.standins.classes.ServedView`, whose reads
  are plain and whose writes are refused (a write into a temporary copy would be lost without a word);
* **a write** into a stand-in (``p.copy_(x)``, ``p.data += d``, ``p[...] = x``, ``out=p``): written
  through to what it stands in for (:meth:`StandInSource.write`: an offloaded weight gets its own memory and
  is stored again at the component's next call; a quantized weight is dequantized, written and
  quantized again), or refused with a typed error before anything changes (a write into part of a
  lazy stand-in, which cannot be located).

Pickling and copying, the fourth kind, are :mod:`~memmode_core.engine.standins.values`. Importing this module
sets the stand-in classes' hooks (:func:`~memmode_core.engine.standins.classes.serve_with`) to :func:`dispatch`
and those two; the package ``memmode_core.engine.standins`` imports it, so no stand-in is ever used without
them.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils import _pytree as pytree

from memmode_core.contracts.inner_tensors import is_wrapper, leaves
from memmode_core.engine.standins.classes import (
    ServedView,
    StandIn,
    StandInReader,
    forget,
    is_stand_in,
    lazy,
    raw,
    serve_with,
    served_view,
    source_of,
)
from memmode_core.engine.standins.values import gone, plain_copy, plain_reduction, refusal, value_of

_DISABLE = torch._C.DisableTorchFunctionSubclass

# -- the tables ----------------------------------------------------------------------------------------------

#: functions that read a tensor's metadata or allocate a tensor like it, never its values
METADATA = frozenset(
    {
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "stride",
        "storage_offset",
        "data_ptr",
        "element_size",
        "is_floating_point",
        "is_complex",
        "is_contiguous",
        "is_signed",
        "is_pinned",
        "is_shared",
        "is_inference",
        "is_set_to",
        "untyped_storage",
        "_typed_storage",
        "storage",
        "get_device",
        "__len__",
        "__hash__",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "rand_like",
        "randn_like",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
        "new_tensor",
        "requires_grad_",
        "retain_grad",
        "register_hook",
        "share_memory_",
        "_has_compatible_shallow_copy_type",
        "dim_order",
    }
)
#: properties whose getter gives a view of the values, not metadata
VALUE_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
#: functions whose result, with the source's shape and dtype, is the whole source again: a lazy stand-in
WHOLE_VIEWS = frozenset({"detach", "alias", "view", "view_as", "reshape", "reshape_as", "expand_as"})
#: conversions that return the tensor itself when nothing changes (``t.to(t.dtype) is t``)
CONVERSIONS = frozenset({"to", "type", "float", "double", "half", "bfloat16", "cpu", "cuda", "type_as"})
#: in-place methods that change no values
HARMLESS_IN_PLACE = frozenset({"requires_grad_", "share_memory_", "retain_grad", "detach_"})
#: in-place Python operators and item assignment
WRITING_DUNDERS = frozenset(
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
    }
)


def operation_name(func) -> str:
    """The name the tables use: ``add_``, ``__get__:shape``, ``__set__:data``."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        prop = getattr(getattr(func, "__self__", None), "__name__", "")
        return f"{name}:{prop}"
    return name


def writes(name: str, args: tuple, kwargs: dict, is_target) -> bool:
    """Whether the function called ``name`` writes into a tensor ``is_target`` says is a stand-in: an in-place
    method or operator on it, or ``out=`` it."""
    out = kwargs.get("out")
    if out is not None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if any(is_target(o) for o in outs):
            return True
    in_place = name in WRITING_DUNDERS or (
        name.endswith("_") and not name.startswith("_") and name not in HARMLESS_IN_PLACE
    )
    return in_place and bool(args) and is_target(args[0])


# -- the routing ---------------------------------------------------------------------------------------------


def dispatch(func, args=(), kwargs=None):
    """What every stand-in's ``__torch_function__`` does (see the module docstring)."""
    kwargs = kwargs or {}
    name = operation_name(func)
    if name.startswith("__set__:"):
        return _set(func, name, args)
    if name.startswith("__get__:"):
        prop = name[len("__get__:") :]
        if prop not in VALUE_PROPERTIES:
            with _DISABLE():
                return func(*args, **kwargs)
        if prop == "data":
            return _data(args[0])
        # T, mT, H, real, imag: views of the values
    elif name in METADATA:
        with _DISABLE():
            return func(*args, **kwargs)
    elif name in WHOLE_VIEWS and args and is_stand_in(args[0]):
        kept = _whole_view(func, name, args, kwargs)
        if kept is not None:
            return kept
    elif name in CONVERSIONS and args and is_stand_in(args[0]) and not isinstance(args[0], ServedView):
        if _unchanged_by(func, args[0], args, kwargs):
            return _unconverted(args[0])
    if writes(name, args, kwargs, is_stand_in):
        return _write(func, name, args, kwargs)
    return _read(func, name, args, kwargs)


def _reader(name: str) -> StandInReader:
    return StandInReader(name, sys._getframe(1))


def _data(tensor: torch.Tensor) -> torch.Tensor:
    """``t.data``: for a resting tensor, its data if it holds real values (or once onloaded into the running
    call), else a lazy stand-in of the same source; a lazy stand-in answers itself (whole)."""
    if isinstance(tensor, StandIn):
        return lazy(raw(tensor), source_of(tensor), type(tensor))
    if isinstance(tensor, ServedView):
        with _DISABLE():
            return served_view(tensor.data, source_of(tensor))
    source = source_of(tensor)
    if source is None:
        raise gone(tensor)
    usable = source.usable(_reader("data"))
    if usable is not None:
        with _DISABLE():
            return usable.data
    return lazy(raw(tensor), source)


def _whole_view(func, name: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``detach()``/``view_as``/... of a whole stand-in that keeps its shape and dtype: a lazy stand-in of the
    same source (nothing read). None when the view is not of the whole."""
    target = args[0]
    source = source_of(target)
    if source is None or isinstance(target, ServedView):
        return None
    usable = source.usable(_reader(name))
    if usable is not None:  # holds real values: the view is a plain view of them
        with _DISABLE():
            return func(usable.detach() if isinstance(target, StandIn) else usable, *args[1:], **kwargs)
    plain_args = (raw(target), *args[1:])
    with _DISABLE():
        result = func(*plain_args, **kwargs)
    if not isinstance(result, torch.Tensor) or result.shape != target.shape or result.dtype != target.dtype:
        return None
    return lazy(result, source, type(target) if isinstance(target, StandIn) else StandIn)


def _set(func, name: str, args: tuple):
    target, value = args[0], args[1]
    if name != "__set__:data":
        if isinstance(target, (StandIn, ServedView)):
            raise refusal(name, target, "a stand-in only takes writes of values")
        with _DISABLE():
            return func(target, value)
    source = source_of(target)
    if isinstance(target, ServedView):
        raise refusal(name, target, "`.data = ` of a view of a served value, which would change a temporary copy")
    if source is None:
        raise gone(target)
    if isinstance(target, StandIn):
        if is_stand_in(value) and source.same(source_of(value)):
            return None  # the end of ``t.data += x``: the write went through already
        return source.write(torch.Tensor.copy_, "__set__:data", (target, value), {}, target)
    # a resting tensor given new data (``_apply`` casting it, ``p.data = x``): it no longer rests
    if value is target or (is_stand_in(value) and source.same(source_of(value))):
        return None
    value = value_of(value, name)
    forget(target)
    source.replaced()
    with _DISABLE():
        return func(target, value)


def _write(func, name: str, args: tuple, kwargs: dict):
    out = kwargs.get("out")
    if out is not None and not isinstance(out, (tuple, list)) and is_stand_in(out):
        target = out
    elif out is not None and isinstance(out, (tuple, list)):
        raise refusal(name, next(o for o in out if is_stand_in(o)), "an operation with several outputs")
    else:
        target = args[0]
    if isinstance(target, ServedView):
        raise refusal(
            name,
            target,
            "the target is a view of part of the weight (indexing, `t()`, `narrow`, ...) or of a value served for "
            "one read, so the write would change a temporary copy; write through the whole weight instead "
            "(`weight.data[index] = value`, `weight.data += full_delta`)",
        )
    source = source_of(target)
    if source is None:
        raise gone(target)
    return source.write(func, name, args, kwargs, target)


def _read(func, name: str, args: tuple, kwargs: dict):
    reader = None
    served: list[torch.Tensor] = []
    values: dict[int, torch.Tensor] = {}

    def resolve(leaf):
        nonlocal reader
        if not is_stand_in(leaf):
            return leaf
        key = id(leaf)
        if key in values:
            return values[key]
        if isinstance(leaf, ServedView):
            with _DISABLE():
                values[key] = leaf.as_subclass(torch.Tensor)
            served.append(values[key])
            return values[key]
        source = source_of(leaf)
        if source is None:
            raise gone(leaf)
        if reader is None:
            reader = _reader(name)
        usable = source.usable(reader)
        if usable is not None:
            values[key] = usable.detach() if isinstance(leaf, StandIn) else usable
            return values[key]
        value = values[key] = source.value(reader)
        served.append(value)
        return value

    plain_args, plain_kwargs = pytree.tree_map(resolve, (args, kwargs))
    if any(is_wrapper(v) for v in values.values()):
        # a library's quantized tensor: its own __torch_function__ computes with it (no stand-in is left in the call)
        result = func(*plain_args, **plain_kwargs)
    else:
        with _DISABLE():
            result = func(*plain_args, **plain_kwargs)
    if served:
        result = _guard_aliases(result, served, args)
    return result


def _unconverted(tensor: torch.Tensor) -> torch.Tensor:
    """What a conversion that changes nothing gives: the tensor itself, as for any tensor (``module.to(device)``
    then keeps every buffer), except a resting parameter, which gives a lazy stand-in of the same value: code
    makes new parameters of it (``nn.Parameter(self.mean.to(device))``), and ``nn.Parameter`` of a parameter
    subclass needs its ``detach()`` to keep the class. ``p.data = that`` changes nothing."""
    if isinstance(tensor, nn.Parameter) and not isinstance(tensor, StandIn):
        source = source_of(tensor)
        if source is None:
            raise gone(tensor)
        return lazy(raw(tensor), source)
    return tensor


def _unchanged_by(func, leaf: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether the conversion ``func(leaf, ...)`` gives ``leaf`` itself (asked of a one-element tensor of the
    same dtype and device, so nothing is read or allocated at full size)."""
    if not args or args[0] is not leaf:
        return False
    probe = torch.empty((), dtype=leaf.dtype, device=leaf.device)
    try:
        with _DISABLE():
            rest = [a.as_subclass(torch.Tensor) if is_stand_in(a) else a for a in args[1:]]
            return func(probe, *rest, **kwargs) is probe
    except Exception:  # noqa: BLE001 - a conversion the probe cannot answer: serve the value
        return False


def _guard_aliases(result, served: list[torch.Tensor], args: tuple):
    pointers = {
        leaf.untyped_storage().data_ptr()
        for v in served
        for leaf in leaves(v)
        if leaf.layout == torch.strided and not leaf.is_meta
    }
    sources = [source_of(a) for a in args if is_stand_in(a)]
    source = next((s for s in sources if s is not None), None)

    def guard(value):
        if (
            isinstance(value, torch.Tensor)
            and not is_stand_in(value)
            and not is_wrapper(value)
            and value.layout == torch.strided
            and not value.is_meta
            and value.untyped_storage().data_ptr() in pointers
        ):
            return served_view(value, source)
        return value

    return pytree.tree_map(guard, result)


serve_with(dispatch, plain_reduction, plain_copy)
