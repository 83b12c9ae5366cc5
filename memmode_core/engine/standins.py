"""Stand-ins: what a tensor is while its value is elsewhere, and how every read of it gets the value.

Two things in memmode hold a tensor whose values are not where torch would read them:

* an offloaded parameter or buffer **at rest**, whose data is a storage's placeholder (``disk`` keeps
  nothing in memory: one NaN broadcast) or, on an accelerator, a host copy the device cannot compute
  with. The parameter object keeps its identity (optimizers, adapters and tied weights hold it): while
  it rests, its class is :class:`ServedParameter` (a buffer's :class:`ServedBuffer`), swapped back to
  ``nn.Parameter`` when its group is onloaded, so a forward computes with plain tensors and pays
  nothing;
* a quantized layer's ``weight``, which does not exist at full precision
  (:class:`~memmode_core.quantization.standin.WeightStandIn`).

The rule for both, by construction: **a read of a value gets the real value, or a typed error**,
whichever code reads it — a parent module (``nn.MultiheadAttention`` reading ``out_proj.weight``, an
attention pool concatenating ``q_proj.bias``), ``state_dict()`` and ``save_pretrained``, ``deepcopy``,
``torch.save``, a script printing a weight. Every torch function given a stand-in comes through
:func:`dispatch` (``__torch_function__``), which sorts it into one of four kinds:

* **metadata** (shape, dtype, device, strides, ``data_ptr``, ``*_like`` allocations): answered from the
  stand-in itself, free, as before. ``detach()``, ``.data`` and views of the whole stay lazy stand-ins of
  the same value (``state_dict()`` holds them without reading anything);
* **a read** of values (any other function): each stand-in among the arguments is replaced by its value
  (:meth:`Source.value`: onloaded into the running call, read from the storage, or dequantized), the
  function runs on plain tensors, and a result that is a view of a value read for it is a
  :class:`ServedView`, whose reads are plain and whose writes are refused (a write into a temporary
  copy would be lost without a word);
* **a write** into a stand-in (``p.copy_(x)``, ``p.data += d``, ``p[...] = x``, ``out=p``): written
  through to what it stands in for (:meth:`Source.write`: an offloaded weight gets its own memory and
  is stored again at the component's next call; a quantized weight is dequantized, written and
  quantized again), or refused with a typed error before anything changes (a write into part of a
  lazy stand-in, which cannot be located);
* **pickling and copying** (``torch.save``, ``copy.deepcopy``): the value, as a plain tensor or
  parameter, so nothing memmode-specific is ever written to disk.

Every value served outside the forward that owns it is counted in the handle's report
(``reads_served``, ``bytes_served``); ``apply(..., strict=True)`` turns it into
:class:`~memmode_core.contracts.errors.StandInReadError` naming the tensor and the code that read it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from memmode_core.contracts.errors import OffloadedWeightWriteError
from memmode_core.engine.operations import (
    CONVERSIONS,
    METADATA,
    VALUE_PROPERTIES,
    WHOLE_VIEWS,
    operation_name,
    writes,
)
from memmode_core.engine.sources import Reader, Source

_DISABLE = torch._C.DisableTorchFunctionSubclass
# -- the stand-in classes -------------------------------------------------------------------------------


class _Serves:
    """What every stand-in class shares: every torch function goes through :func:`dispatch`, and pickles and
    copies hold the value as a plain tensor. No slots of its own, so a parameter's class can be swapped."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs)

    def __reduce_ex__(self, protocol):
        return _plain_reduction(self, protocol)

    def __deepcopy__(self, memo):
        return _plain_copy(self, memo)


class StandIn(_Serves, torch.Tensor):
    """A lazy stand-in for a whole value (``p.detach()`` of a resting parameter, a quantized layer's
    ``weight``): the raw tensor it wraps holds no real values (a placeholder, one NaN broadcast); its
    metadata is the value's, and ``_memmode_source`` serves it. A view of part of it is a read (a part of
    a broadcast cannot be located), which gives a :class:`ServedView`."""

    _memmode_source: Source | None = None


class ServedView(_Serves, torch.Tensor):
    """A view of a value served for one read (a copy read from a storage, a dequantized weight): its values
    are real and read as any tensor's, but a write into it would change a temporary copy and be lost, so
    writes are refused (:class:`~memmode_core.contracts.errors.OffloadedWeightWriteError`)."""

    _memmode_source: Source | None = None


class ServedParameter(_Serves, nn.Parameter):
    """The class of an offloaded parameter while it rests (see the module docstring); never constructed
    directly: ``type(p)(data)`` (accelerate's and diffusers' way to rebuild a parameter) gives a plain one."""

    def __new__(cls, data=None, requires_grad=True):
        return nn.Parameter(data, requires_grad)


class ServedBuffer(_Serves, torch.Tensor):
    """The class of an offloaded buffer while it rests on the host of an accelerator (see
    :class:`ServedParameter`)."""


#: the class a resting tensor takes, by its own class; tensors of other classes are never swapped
SERVED_CLASS: dict[type, type] = {nn.Parameter: ServedParameter, torch.Tensor: ServedBuffer}
#: the class a served tensor goes back to
PLAIN_CLASS: dict[type, type] = {served: plain for plain, served in SERVED_CLASS.items()}

#: id(resting tensor) -> a callable giving its Source from the tensor (None if it is not that tensor's, or gone).
#: Nothing here holds a tensor or its model (no weak reference either: ``torch.utils.swap_tensors``, PyTorch's
#: swap conversion, refuses tensors that have one): a model dropped without ``remove()`` is freed.
_RESTING: dict[int, Callable[[torch.Tensor], Source | None]] = {}
#: the attribute of a tensor whose stored copy was lost, holding its Source (it outlives the placement)
_LOST = "_memmode_lost"


def can_serve(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s class can be swapped for a served one while it rests (plain parameters and buffers)."""
    return type(tensor) in SERVED_CLASS or type(tensor) in PLAIN_CLASS


def rest_served(tensor: torch.Tensor, source: Callable[[torch.Tensor], Source | None]) -> None:
    """``tensor`` rests from now on, served by ``source(tensor)`` (which must not hold ``tensor``): its class
    becomes the served one."""
    _RESTING[id(tensor)] = source
    tensor.__dict__.pop(_LOST, None)
    cls = type(tensor)
    if cls in SERVED_CLASS:
        tensor.__class__ = SERVED_CLASS[cls]


def rest_lost(tensor: torch.Tensor, source: Source) -> None:
    """``tensor`` has no value any more (its stored copy was lost): every read of it asks ``source``, which
    refuses it, for as long as the tensor lives."""
    _RESTING.pop(id(tensor), None)
    tensor.__dict__[_LOST] = source
    cls = type(tensor)
    if cls in SERVED_CLASS:
        tensor.__class__ = SERVED_CLASS[cls]


def wake(tensor: torch.Tensor) -> None:
    """``tensor`` no longer rests as a stand-in: its class is the plain one again (its data is what the caller
    sets next). Cheap: the engine calls it for each slot of each onload."""
    cls = type(tensor)
    if cls in PLAIN_CLASS:
        tensor.__class__ = PLAIN_CLASS[cls]


def forget(tensor: torch.Tensor) -> None:
    """``tensor`` leaves the engine (``remove()``, a rebuild that no longer holds it): plain, unregistered."""
    wake(tensor)
    _RESTING.pop(id(tensor), None)
    tensor.__dict__.pop(_LOST, None)


def source_of(tensor: torch.Tensor) -> Source | None:
    """The source a stand-in serves from (None for a tensor that is not one, or whose source is gone)."""
    if isinstance(tensor, (StandIn, ServedView)):
        return tensor._memmode_source
    if type(tensor) in PLAIN_CLASS:
        lost = tensor.__dict__.get(_LOST)
        if lost is not None:
            return lost
        find = _RESTING.get(id(tensor))
        return find(tensor) if find is not None else None
    return None


def is_stand_in(value: object) -> bool:
    return isinstance(value, (StandIn, ServedView)) or type(value) in PLAIN_CLASS


def lazy(raw: torch.Tensor, source: Source, cls: type[StandIn] = StandIn) -> StandIn:
    """A lazy stand-in of ``source`` over ``raw`` (a tensor with the value's metadata and no real values)."""
    with _DISABLE():
        stand_in = raw.as_subclass(cls)
    stand_in._memmode_source = source
    return stand_in


def raw_reads():
    """A context in which stand-ins answer as the plain tensors they wrap: engine code reading what a resting
    tensor holds (its raw data), never the value it serves."""
    return _DISABLE()


def raw_access(method):
    """``method`` run under :func:`raw_reads` (the engine's own bookkeeping on resting tensors)."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        with _DISABLE():
            return method(*args, **kwargs)

    return run


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a stand-in wraps, as a plain tensor (metadata only; never its values)."""
    with _DISABLE():
        return tensor.data if isinstance(tensor, nn.Parameter) else tensor.as_subclass(torch.Tensor)


# -- dispatch ---------------------------------------------------------------------------------------------


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
        raise _gone(tensor)
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
            raise _refusal(name, target, "a stand-in only takes writes of values")
        with _DISABLE():
            return func(target, value)
    source = source_of(target)
    if isinstance(target, ServedView):
        raise _refusal(name, target, "`.data = ` of a view of a served value, which would change a temporary copy")
    if source is None:
        raise _gone(target)
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
        raise _refusal(name, next(o for o in out if is_stand_in(o)), "an operation with several outputs")
    else:
        target = args[0]
    if isinstance(target, ServedView):
        raise _refusal(
            name,
            target,
            "the target is a view of part of the weight (indexing, `t()`, `narrow`, ...) or of a value served for "
            "one read, so the write would change a temporary copy; write through the whole weight instead "
            "(`weight.data[index] = value`, `weight.data += full_delta`)",
        )
    source = source_of(target)
    if source is None:
        raise _gone(target)
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
            raise _gone(leaf)
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
            raise _gone(tensor)
        return lazy(raw(tensor), source)
    return tensor


def registered_value(value: object) -> torch.Tensor | None:
    """What is registered in place of ``value`` when code registers a stand-in as a parameter or buffer
    (``nn.Parameter(layer.weight)``, ``module.x = nn.Parameter(self.x.to(device))``): a plain one holding a copy
    of its value, in memory of its own. None for anything else (registered as it is)."""
    if not isinstance(value, (StandIn, ServedView)):
        return None
    copied = value_of(value, "register").detach().clone()
    with _DISABLE():
        if isinstance(value, nn.Parameter):
            return nn.Parameter(copied, requires_grad=value.requires_grad)
        return copied


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


# -- errors, pickling, copies -------------------------------------------------------------------------------


def _describe(target: torch.Tensor) -> str:
    source = source_of(target)
    return f"{source.name} ({source.what})" if source is not None else "a stand-in"


def _refusal(name: str, target: torch.Tensor, why: str) -> Exception:
    source = source_of(target)
    refuse = getattr(source, "refusal", None)
    if refuse is not None:
        return refuse(name, why)
    return OffloadedWeightWriteError(
        f"{name or 'write'}: cannot write into {_describe(target)}: {why}. Nothing was changed."
    )


def _gone(tensor: torch.Tensor) -> Exception:
    from memmode_core.contracts.errors import OffloadedWeightReadError

    shape = tuple(tensor.shape)
    return OffloadedWeightReadError(
        f"a {shape} tensor stood in for a weight whose placement or layer is gone (removed without its stored "
        f"copy, or the model was dropped), so its value cannot be read"
    )


def value_of(tensor: torch.Tensor, operation: str = "value", *, counted: bool = True) -> torch.Tensor:
    """The real value of ``tensor`` as a plain tensor: itself if it is not a stand-in. ``counted=False`` for a read
    memmode makes on behalf of another one that is counted (the packed tensors of a dequantized weight)."""
    if not is_stand_in(tensor):
        return tensor
    if isinstance(tensor, ServedView):
        with _DISABLE():
            return tensor.as_subclass(torch.Tensor)
    source = source_of(tensor)
    if source is None:
        raise _gone(tensor)
    reader = Reader(operation, sys._getframe(1), counted=counted)
    usable = source.usable(reader)
    if usable is not None:
        with _DISABLE():
            return usable.data
    return source.value(reader)


def writable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or — a resting stand-in — the tensor made to hold memory a write may change (see
    :meth:`Source.make_writable`)."""
    if type(tensor) not in PLAIN_CLASS:
        return tensor
    source = source_of(tensor)
    if source is None:
        raise _gone(tensor)
    return source.make_writable()


def _plain_reduction(tensor: torch.Tensor, protocol):
    """Pickled as the plain tensor (or parameter) of its value: ``torch.save`` never writes a memmode class."""
    value = value_of(tensor, "__reduce_ex__")
    with _DISABLE():
        if isinstance(tensor, nn.Parameter):
            plain = nn.Parameter(value.detach(), requires_grad=tensor.requires_grad)
            return plain.__reduce_ex__(protocol)
        return value.detach().__reduce_ex__(protocol)


def _plain_copy(tensor: torch.Tensor, memo):
    """``copy.deepcopy``: a plain tensor (or parameter) holding a copy of the value."""
    if id(tensor) in memo:
        return memo[id(tensor)]
    value = value_of(tensor, "__deepcopy__")
    with _DISABLE():
        copied = value.detach().clone()
        result = (
            nn.Parameter(copied, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else copied
        )
    memo[id(tensor)] = result
    return result
