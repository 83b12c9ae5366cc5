"""Which torch functions read a stand-in's metadata, which read its values, and which write into it.

:func:`~memmode_core.engine.standin_dispatch.dispatch` sorts every torch function given a stand-in by these tables: the
names torch's ``__torch_function__`` protocol passes (a method's name, ``__get__:shape`` for a property's
getter). A function not listed as metadata reads values, so a new torch function is served, never handed a
placeholder.
"""

from __future__ import annotations

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
