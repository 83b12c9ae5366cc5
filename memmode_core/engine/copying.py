"""Copies of placed objects: ``copy.deepcopy`` and ``pickle`` of a placed module or pipeline give it without memmode.

A placed module holds memmode's hooks in its ``__dict__`` (its ``forward`` wrapper, a registry, the handle,
diffusers' ``_hf_hook`` stand-in), and those hold the runtime, its lock and its storage session: copied as
they are, ``copy.deepcopy(component)`` raised ``TypeError: cannot pickle '_thread.RLock' object``, and a copy
sharing the runtime would move the original's weights. So every object memmode hooks gets one more
instance attribute while it has hooks, ``__reduce_ex__`` (:class:`CleanReduction`), which ``copy`` and
``pickle`` call before anything else: the object is reduced as it normally is, minus what memmode put
there. The copy is the model as it computes — every weight its real value (a resting stand-in copies its
value, see :mod:`memmode_core.engine.standins.values`; a quantized layer stays quantized) — and it has no placement.
"""

from __future__ import annotations

import copyreg
from typing import Any

#: an attribute value whose type says this is memmode's, not the model's: left out of copies
UNCOPIED = "__memmode_uncopied__"
#: the instance attribute a hooked object's copies and pickles go through
REDUCTION = "__reduce_ex__"


class CleanReduction:
    """``obj.__reduce_ex__`` while memmode hooks ``obj``: its usual reduction, without memmode's attributes."""

    __memmode_uncopied__ = True
    __slots__ = ("owner",)

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def __call__(self, protocol: int):
        owner = self.owner
        reduced = copyreg.__reduce_ex__(owner, protocol) if protocol < 2 else object.__reduce_ex__(owner, protocol)
        reduction = list(reduced)
        if len(reduction) > 2 and reduction[2] is not None:
            reduction[2] = _clean(reduction[2])
        return tuple(reduction)


def _clean(state):
    if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots)
        return (_clean(state[0]), state[1])
    if not isinstance(state, dict):
        return state
    kept = {}
    for key, value in state.items():
        if key == REDUCTION:
            continue
        hook = getattr(value, "__memmode_wrapper__", None) if callable(value) else None
        if hook is not None:  # a wrapper memmode put in the instance: what was there before, if anything
            if getattr(hook, "had_instance_attribute", False):
                kept[key] = hook.original
            continue
        if getattr(type(value), UNCOPIED, False):
            continue
        kept[key] = value
    return kept


def install(owner: Any) -> None:
    """Copies and pickles of ``owner`` leave memmode out (see the module docstring)."""
    owner.__dict__[REDUCTION] = CleanReduction(owner)


def uninstall(owner: Any) -> None:
    if isinstance(owner.__dict__.get(REDUCTION), CleanReduction):
        del owner.__dict__[REDUCTION]
