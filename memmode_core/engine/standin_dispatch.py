"""How every torch function given a stand-in is served: the routing behind the stand-ins' ``__torch_function__``.

Every torch function given a stand-in (:mod:`~memmode_core.engine.standins`) comes through :func:`dispatch`,
which sorts it by the tables of :mod:`~memmode_core.engine.operations` into one of three kinds:

* **metadata** (shape, dtype, device, strides, ``data_ptr``, ``*_like`` allocations): answered from the
  stand-in itself, free, as before. ``detach()``, ``.data`` and views of the whole stay lazy stand-ins of
  the same value (``state_dict()`` holds them without reading anything);
* **a read** of values (any other function): each stand-in among the arguments is replaced by its value
  (:meth:`Source.value`: onloaded into the running call, read from the storage, or dequantized), the
  function runs on plain tensors, and a result that is a view of a value read for it is a
  :class:`~memmode_core.engine.standins.ServedView`, whose reads are plain and whose writes are refused (a
  write into a temporary copy would be lost without a word);
* **a write** into a stand-in (``p.copy_(x)``, ``p.data += d``, ``p[...] = x``, ``out=p``): written
  through to what it stands in for (:meth:`Source.write`: an offloaded weight gets its own memory and
  is stored again at the component's next call; a quantized weight is dequantized, written and
  quantized again), or refused with a typed error before anything changes (a write into part of a
  lazy stand-in, which cannot be located).

Pickling and copying, the fourth kind, are :mod:`~memmode_core.engine.standin_values`. Importing this module
sets the stand-in classes' hooks (:func:`~memmode_core.engine.standins.serve_with`) to :func:`dispatch` and
those two; ``memmode_core.engine`` imports it, so no stand-in is ever used without them.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils import _pytree as pytree

from memmode_core.engine.operations import (
    CONVERSIONS,
    METADATA,
    VALUE_PROPERTIES,
    WHOLE_VIEWS,
    operation_name,
    writes,
)
from memmode_core.engine.sources import Reader, Source
from memmode_core.engine.standin_values import gone, plain_copy, plain_reduction, refusal, value_of
from memmode_core.engine.standins import ServedView, StandIn, forget, is_stand_in, lazy, raw, serve_with, source_of

_DISABLE = torch._C.DisableTorchFunctionSubclass


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


def _reader(name: str) -> Reader:
    return Reader(name, sys._getframe(1))


def _data(tensor: torch.Tensor) -> torch.Tensor:
    """``t.data``: for a resting tensor, its data if it holds real values (or once onloaded into the running
    call), else a lazy stand-in of the same source; a lazy stand-in answers itself (whole)."""
    if isinstance(tensor, StandIn):
        return lazy(raw(tensor), tensor._memmode_source, type(tensor))
    if isinstance(tensor, ServedView):
        with _DISABLE():
            return _guard(tensor.data, tensor._memmode_source)
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
    pointers = {v.untyped_storage().data_ptr() for v in served if v.layout == torch.strided and not v.is_meta}
    sources = [source_of(a) for a in args if is_stand_in(a)]
    source = next((s for s in sources if s is not None), None)

    def guard(value):
        if (
            isinstance(value, torch.Tensor)
            and not is_stand_in(value)
            and value.layout == torch.strided
            and not value.is_meta
            and value.untyped_storage().data_ptr() in pointers
        ):
            return _guard(value, source)
        return value

    return pytree.tree_map(guard, result)


def _guard(value: torch.Tensor, source: Source | None) -> ServedView:
    view = value.as_subclass(ServedView)
    view._memmode_source = source
    return view


serve_with(dispatch, plain_reduction, plain_copy)
