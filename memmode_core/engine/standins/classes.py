"""What a stand-in is, which tensors rest as one, and what serves it.

Two things in memmode hold a tensor whose values are not where torch would read them:

* an offloaded parameter or buffer **at rest**, whose data is a storage's placeholder (``disk`` keeps
  nothing in memory: one NaN broadcast) or, on an accelerator, a host copy the device cannot compute
  with. The parameter object keeps its identity (optimizers, adapters and tied weights hold it): while
  it rests, its class is :class:`ServedParameter` (a buffer's :class:`ServedBuffer`), swapped back to
  ``nn.Parameter`` when its group is onloaded, so a forward computes with plain tensors and pays
  nothing;
* a quantized layer's ``weight``, which does not exist at full precision
  (:class:`~memmode_core.engine.standins.quantized.WeightStandIn`).

This module is the classes, which tensors rest as them (the engine swaps a resting tensor's class and
registers what serves it), and the two objects every served read passes around: a :class:`StandInSource` (where
a stand-in's value comes from: a runtime's resting slot, :mod:`~memmode_core.engine.standins.slots`, or a
quantized layer, :mod:`~memmode_core.engine.standins.quantized`) and a :class:`StandInReader` (the code reading a
stand-in's value: one read, and where it was made). Neither is a file format's
:class:`~memmode_core.contracts.reader.Reader` nor a mapped file's source (``memmode_core.files``). What a torch
function given a stand-in does is :mod:`~memmode_core.engine.standins.dispatch`.

The dispatch makes stand-ins, so it imports this module, and this one cannot import it back: the classes
hand each torch function, pickle and deep copy to three hooks, set once by :func:`serve_with` when the
dispatch is imported — by the package ``memmode_core.engine.standins`` itself, so before any stand-in exists.
A call looks its hook up as a module global: nothing more per call.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from memmode_core.contracts.inner_tensors import STANDS_FOR, flatten, is_dtensor_class, is_wrapper, is_wrapper_class

_DISABLE = torch._C.DisableTorchFunctionSubclass


# -- what serves a stand-in, and who reads it ------------------------------------------------------------


class StandInSource:
    """Where a stand-in's value comes from: one offloaded slot, or one quantized layer's weight.

    ``name`` is what messages call it (``transformer.blocks.0.attn.out_proj.weight``), ``what`` how it
    is held (``offloaded to disk``, ``quantized (fp8_e4m3 rows)``). A source is alive while what it
    stands in for is; ``value`` and ``write`` raise a typed error once it is not (the layer is gone, the
    placement removed and the stored copy lost).
    """

    name: str = "a tensor"
    what: str = "held elsewhere"

    def value(self, reader: StandInReader) -> torch.Tensor:
        """The real value, for the read ``reader`` describes (counted, or refused under ``strict``)."""
        raise NotImplementedError

    def usable(self, reader: StandInReader) -> torch.Tensor | None:
        """A tensor to compute with as it is, or None when the value must be served: a resting tensor whose
        data holds the real values where the reader computes (a host copy read outside any call: nothing
        is counted), or one onloaded into the call that is running (counted)."""
        return None

    def replaced(self) -> None:
        """The resting tensor was given other data from outside (``p.data = x``, ``module.to(dtype)``): it no
        longer rests, and what it holds now is stored at the component's next call."""

    def make_writable(self) -> torch.Tensor:
        """The tensor that stands in, made to hold memory that a write may change in place and that the model
        keeps (for a write memmode carries through: re-quantizing a layer's packed tensors)."""
        raise NotImplementedError

    def write(self, func, name: str, args: tuple, kwargs: dict, target: torch.Tensor) -> Any:
        """Apply the in-place write ``func(*args, **kwargs)`` aimed at ``target`` (a stand-in of this source)
        to what the source stands in for; return what the write returns on a plain tensor."""
        raise NotImplementedError

    def same(self, other: StandInSource) -> bool:
        return other is self


class StandInReader:
    """The code reading a stand-in's value: the torch function, and — found only when needed, by walking the
    stack — the code that called it (for ``strict`` errors) and the module whose forward is running (the reader
    a group is learned for)."""

    __slots__ = ("operation", "frame", "counted")

    def __init__(self, operation: str, frame, *, counted: bool = True) -> None:
        self.operation = operation
        #: the frame of the torch function's caller (None: no stack to walk)
        self.frame = frame
        #: False for a read memmode makes on behalf of another (a packed tensor read to dequantize a weight,
        #: which is what is counted)
        self.counted = counted

    def code(self) -> str:
        """``path:line in function`` of the first frame outside torch and memmode, or the operation."""
        frame = self.frame
        while frame is not None:
            filename = frame.f_code.co_filename
            if not _is_machinery(filename):
                return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
            frame = frame.f_back
        return self.operation

    def module(self, belongs: Callable[[nn.Module], bool]) -> nn.Module | None:
        """The innermost module whose ``forward`` is running and for which ``belongs`` is true."""
        frame = self.frame
        while frame is not None:
            if frame.f_code.co_name == "forward":
                owner = frame.f_locals.get("self")
                if isinstance(owner, nn.Module) and belongs(owner):
                    return owner
            frame = frame.f_back
        return None


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
#: memmode_core/ (this file is memmode_core/engine/standins/classes.py)
_MEMMODE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def _is_machinery(filename: str) -> bool:
    return filename.startswith((_TORCH_DIR, _MEMMODE_DIR)) or filename.startswith("<")


# -- the hooks ------------------------------------------------------------------------------------------


def _not_served(*args, **kwargs):
    raise RuntimeError("a stand-in was used before memmode_core.engine.standins.dispatch was imported")


#: what the classes hand on: every torch function, pickle and deep copy (see the module docstring)
_dispatch: Callable = _not_served
_reduce: Callable = _not_served
_copy: Callable = _not_served


def serve_with(dispatch: Callable, reduce: Callable, copy: Callable) -> None:
    """Set the hooks: ``dispatch(func, args, kwargs)`` for every torch function given a stand-in,
    ``reduce(tensor, protocol)`` for its pickles and ``copy(tensor, memo)`` for its deep copies. Called once, by
    :mod:`~memmode_core.engine.standins.dispatch` as it is imported."""
    global _dispatch, _reduce, _copy
    _dispatch, _reduce, _copy = dispatch, reduce, copy


# -- the stand-in classes -------------------------------------------------------------------------------


class _Serves:
    """What every stand-in class shares: every torch function goes through the dispatch, and pickles and copies
    hold the value as a plain tensor (both through the hooks, see :func:`serve_with`). No slots of its own, so
    a parameter's class can be swapped."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs)

    def __reduce_ex__(self, protocol):
        return _reduce(self, protocol)

    def __deepcopy__(self, memo):
        return _copy(self, memo)


class StandIn(_Serves, torch.Tensor):
    """A lazy stand-in for a whole value (``p.detach()`` of a resting parameter, a quantized layer's
    ``weight``): the raw tensor it wraps holds no real values (a placeholder, one NaN broadcast); its
    metadata is the value's, and ``_memmode_source`` serves it. A view of part of it is a read (a part of
    a broadcast cannot be located), which gives a :class:`ServedView`."""

    _memmode_source: StandInSource | None = None


class ServedView(_Serves, torch.Tensor):
    """A view of a value served for one read (a copy read from a storage, a dequantized weight): its values
    are real and read as any tensor's, but a write into it would change a temporary copy and be lost, so
    writes are refused (:class:`~memmode_core.contracts.errors.OffloadedWeightWriteError`)."""

    _memmode_source: StandInSource | None = None


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

#: id(resting tensor) -> a callable giving its StandInSource from the tensor (None if it is not that tensor's, or gone).
#: Nothing here holds a tensor or its model (no weak reference either: ``torch.utils.swap_tensors``, PyTorch's
#: swap conversion, refuses tensors that have one): a model dropped without ``remove()`` is freed.
_RESTING: dict[int, Callable[[torch.Tensor], StandInSource | None]] = {}
#: the attribute of a tensor whose stored copy was lost, holding its StandInSource (it outlives the placement)
_LOST = "_memmode_lost"


def served_class(cls: type) -> type | None:
    """The class a resting tensor of class ``cls`` takes (None: it rests as it is, never swapped).

    A parameter's class of another library — diffusers' ``GGUFParameter`` (bytes of its own, and attributes such
    as its ``quant_type``), a wrapper subclass that flattens into inner tensors (torchao's and quanto's quantized
    weights) — gets one made once (:func:`_standing_for`)."""
    served = SERVED_CLASS.get(cls)
    if served is not None or cls in PLAIN_CLASS or issubclass(cls, _Serves):
        return served
    if is_dtensor_class(cls):
        return None
    if not (issubclass(cls, nn.Parameter) or is_wrapper_class(cls)):
        return None
    served = SERVED_CLASS[cls] = _standing_for(cls, _Serves, "Served")
    PLAIN_CLASS[served] = cls
    return served


#: (a wrapper subclass's class, a lazy stand-in class) -> the lazy stand-in class of that wrapper class
_LAZY_CLASS: dict[tuple[type, type], type] = {}


def _standing_for(cls: type, base: type, prefix: str) -> type:
    """A class that stands in for ``cls`` (``base`` first: the stand-in's ``__torch_function__``, then ``cls``), so
    the object keeps its attributes and ``isinstance``. For a wrapper subclass: the library's ``__torch_dispatch__``
    sees its own class (torchao keys its tables by the exact class, and torch checks that an alias it returns has
    its input's class), a library that builds a tensor of ``type(self)`` builds one of its own class, and every
    public method the library defines (``dequantize()``, quanto's ``save_to_state_dict``) runs on the value, as a
    torch function would: a method reading the inner tensors directly would read the placeholders."""
    namespace: dict[str, Any] = {"__module__": __name__, "__qualname__": f"{prefix}{cls.__name__}", STANDS_FOR: cls}

    def __new__(stand_in_cls, *args, **kwargs):  # noqa: N807 - type(p)(...) builds the library's own class
        return cls(*args, **kwargs)

    namespace["__new__"] = __new__
    if is_wrapper_class(cls):

        def __torch_dispatch__(stand_in_cls, func, types, args=(), kwargs=None):  # noqa: N807
            args, kwargs = pytree.tree_map_only(stand_in_cls, raw, (args, kwargs or {}))
            return cls.__torch_dispatch__(func, tuple(cls if t is stand_in_cls else t for t in types), args, kwargs)

        namespace["__torch_dispatch__"] = classmethod(__torch_dispatch__)
        for name in _library_methods(cls):
            namespace[name] = _on_the_value(name)
    return type(f"{prefix}{cls.__name__}", (base, cls), namespace)


def _library_methods(cls: type) -> set[str]:
    """The public methods ``cls`` and its bases define, other than torch's own."""
    names = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == "torch" or klass is object:
            continue
        names.update(n for n, attr in vars(klass).items() if not n.startswith("_") and inspect.isfunction(attr))
    return names


def _on_the_value(name: str) -> Callable:
    def call(tensor, *args, **kwargs):
        return getattr(tensor, name)(*args, **kwargs)

    call.__name__ = name

    def method(self, *args, **kwargs):
        return _dispatch(call, (self, *args), kwargs)

    method.__name__ = name
    return method


def can_serve(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s class can be swapped for a served one while it rests: plain parameters and buffers, and
    a library's parameter classes (:func:`served_class`)."""
    cls = type(tensor)
    return cls in PLAIN_CLASS or served_class(cls) is not None


def rest_served(tensor: torch.Tensor, source: Callable[[torch.Tensor], StandInSource | None]) -> None:
    """``tensor`` rests from now on, served by ``source(tensor)`` (which must not hold ``tensor``): its class
    becomes the served one."""
    _RESTING[id(tensor)] = source
    tensor.__dict__.pop(_LOST, None)
    served = served_class(type(tensor))
    if served is not None:
        tensor.__class__ = served


def rest_lost(tensor: torch.Tensor, source: StandInSource) -> None:
    """``tensor`` has no value any more (its stored copy was lost): every read of it asks ``source``, which
    refuses it, for as long as the tensor lives."""
    _RESTING.pop(id(tensor), None)
    tensor.__dict__[_LOST] = source
    served = served_class(type(tensor))
    if served is not None:
        tensor.__class__ = served


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


def source_of(tensor: torch.Tensor) -> StandInSource | None:
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


def lazy(raw: torch.Tensor, source: StandInSource, cls: type[StandIn] = StandIn) -> StandIn:
    """A lazy stand-in of ``source`` over ``raw`` (a tensor with the value's metadata and no real values). Over a
    wrapper subclass (a library's quantized weight) it is that object, its class one standing for the library's
    that is also ``cls`` (a wrapper's tensor is its Python object: it has no other to make)."""
    if is_wrapper(raw):
        plain = vars(type(raw)).get(STANDS_FOR, type(raw))
        if not issubclass(cls, plain):
            key = (plain, cls)
            if key not in _LAZY_CLASS:
                _LAZY_CLASS[key] = _standing_for(plain, cls, "Lazy")
            cls = _LAZY_CLASS[key]
        raw.__class__ = cls
        raw._memmode_source = source
        return raw
    with _DISABLE():
        stand_in = raw.as_subclass(cls)
    stand_in._memmode_source = source
    return stand_in


def served_view(value: torch.Tensor, source: StandInSource | None) -> ServedView:
    """``value`` (real values, served for one read) as a :class:`ServedView` of ``source``: reads are plain, writes
    are refused."""
    view = value.as_subclass(ServedView)
    view._memmode_source = source
    return view


def serve_by_default(cls: type[StandIn], source: StandInSource) -> None:
    """What a stand-in of ``cls`` made by hand (``t.as_subclass(cls)``, not through :func:`lazy`) serves."""
    cls._memmode_source = source


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
    """The tensor a stand-in wraps, as a plain tensor (metadata only; never its values). A wrapper subclass's is one
    of its library's own class over the same inner tensors."""
    if is_wrapper(tensor):
        tree, leaves = flatten(tensor)
        return tree.rebuild(leaves)
    with _DISABLE():
        return tensor.data if isinstance(tensor, nn.Parameter) else tensor.as_subclass(torch.Tensor)
