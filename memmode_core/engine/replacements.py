"""Tensors replaced while their group rested offloaded, and values computed from a placeholder: what a rebuild
stores and what ``remove()`` gives back in their place.

Code may give an offloaded tensor new data (``param.data = x``, a cast by ``module.to(dtype)``) or register a new
tensor where it was (a component's ``to()`` or ``_apply`` making new parameters). The newest value is the one
that counts — unless it was computed from the at-rest placeholder (a storage that keeps nothing in memory leaves
one NaN broadcast there: see :mod:`memmode_core.engine.standins.placeholders`), which holds nothing of the
weight: then the stored value, put through the same cast, stands in for it. The rule is that nothing computed
from a placeholder becomes a weight: :class:`~memmode_core.engine.changes.Changes` refuses such a registration
and stores the real value in a rebuild, and the runtime's ``remove()`` gives back what this module says.
"""

from __future__ import annotations

import torch

from memmode_core.contracts.storage import Tensors, is_placeholder
from memmode_core.engine.groups import Group
from memmode_core.engine.streams import Streams


def replaced_since(group: Group, restored: Tensors, streams: Streams, *, zero_copy: bool) -> Tensors:
    """Slots of ``group`` whose data was replaced since it was stored (``param.data = x``, a cast by
    ``module.to(dtype)``): the newest value is what ``remove()`` gives back. One computed from the at-rest
    placeholder (all NaN: the cast of a placeholder) is the stored value (``restored``) put through the same cast.
    ``zero_copy``: the storage's copies are the device tensors (a resident group's data is its at-rest data)."""
    newest: Tensors = {}
    for slot in group.slots:
        expected = slot.live_ptr if (group.resident and not zero_copy) else slot.rest_ptr
        current = slot.tensor.data
        if current.data_ptr() == expected or slot.name not in restored:
            continue
        if computed_from_placeholder(current, group.at_rest.get(slot.name)):
            newest[slot.name] = restored[slot.name].to(dtype=current.dtype)
        else:
            newest[slot.name] = current if streams.is_host(current.device) else streams.to_host(current)
    return newest


def restore_replacements(group: Group, restored: Tensors, streams: Streams) -> None:
    """Tensors registered since the last rebuild in place of ``group``'s ones (a component's ``to()`` or
    ``_apply`` making new parameters) go back to ordinary CPU memory too, and one computed from the at-rest
    placeholder (all NaN) gets the stored value (``restored``), in its own dtype: nothing computed from a
    placeholder outlives ``remove()``."""
    for slot in group.slots:
        if slot.registered():
            continue
        registry = slot.owner._buffers if slot.is_buffer else slot.owner._parameters
        now = registry.get(slot.attr)
        if now is None or slot.name not in restored:
            continue
        if computed_from_placeholder(now, group.at_rest.get(slot.name)):
            now.data = restored[slot.name].to(dtype=now.dtype)
        elif not now.is_meta and not streams.is_host(now.device):  # meta: accelerate's to give back
            now.data = streams.to_host(now.data)


def computed_from_placeholder(current: torch.Tensor, at_rest: torch.Tensor | None) -> bool:
    """Whether ``current`` holds nothing but what the at-rest placeholder ``at_rest`` gives: that placeholder
    (or a view of it), or a tensor computed from it (a cast). What stands in for it is the stored value."""
    return (
        at_rest is not None
        and is_placeholder(at_rest)
        and current.shape == at_rest.shape
        and (is_placeholder(current) or derived_from_placeholder(current, at_rest))
    )


def derived_from_placeholder(current: torch.Tensor, at_rest: torch.Tensor) -> bool:
    """Whether ``current`` holds nothing but the placeholder's fill (NaN for floats): a value
    computed from the placeholder. Real weights are never entirely NaN."""
    if (
        not (current.dtype.is_floating_point and at_rest.dtype.is_floating_point)
        or current.numel() == 0
        or current.is_meta
    ):
        return False
    return bool(torch.isnan(current).all())
