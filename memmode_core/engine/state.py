"""What the parts of one runtime share: its components and groups, where they compute, the storage session,
the books, the lock, and the few facts more than one part reads.

A :class:`~memmode_core.engine.runtime.Runtime` is made of parts, one per job — moving groups
(:class:`~memmode_core.engine.moving.Moving`), serving reads of resting tensors
(:class:`~memmode_core.engine.serving.Serving`), noticing changes and rebuilding, edits
(:class:`~memmode_core.engine.changes.Changes`), the hooks around forwards
(:class:`~memmode_core.engine.forwards.Forwards`) — each a plain class that gets this state and the parts it
calls through its constructor. So that a newcomer can see who touches what, state lives here only when more
than one part reads or writes it, and each field says who writes it; what one part alone keeps is that part's
own: what is resident and how deeply calls are nested (``Moving``; the others read ``Moving.depth``), what was
learned of readers (``Serving``), edits (``Changes``), the hooks and the calls counted (``Forwards``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from memmode_core.contracts.storage import StorageSession
from memmode_core.engine.groups import Group
from memmode_core.engine.ledger import Ledger
from memmode_core.engine.streams import Streams, active


@dataclass(eq=False)
class EngineState:
    """One runtime's shared state (see the module docstring).

    Set once, when the runtime is built, and read by every part: ``components``, ``device``, ``session``,
    ``ledger`` (its counts are written by whichever part moves bytes), ``storage_name``, ``streams``, ``lock``.
    Written afterwards, each by one owner: ``groups`` and ``groups_of`` (a rebuild, :meth:`replace_groups`),
    ``member_of`` (:meth:`index_members`: the runtime's install, then each rebuild), ``removed`` (the runtime's
    ``remove``), the changes marked (any part marks one, :meth:`mark_changed`; only ``Changes`` reads and clears
    them).
    """

    #: component name -> its root module
    components: dict[str, nn.Module]
    #: live groups, their slots taken from the model as it is now (``bind_groups``); a rebuild replaces a
    #: component's groups (:meth:`replace_groups`, by ``Changes``), so read it from here, never keep a copy
    groups: list[Group]
    #: where the components compute
    device: torch.device
    #: where offloaded groups rest (None: nothing is offloaded)
    session: StorageSession | None
    #: what is on the device, and the copies and reads it took
    ledger: Ledger
    #: the storage's name, for messages
    storage_name: str = "its storage"
    #: component -> its groups (kept in step with ``groups`` by :meth:`replace_groups`)
    groups_of: dict[str, list[Group]] = field(default_factory=dict)
    #: serializes calls of this runtime's components, edits, refresh and remove across threads
    lock: threading.RLock = field(default_factory=threading.RLock)
    #: id(module) -> the component it belongs to (kept by :meth:`index_members`: the runtime's install, a rebuild)
    member_of: dict[int, str] = field(default_factory=dict)
    #: streams, events and copies (the real accelerator API, or a test double)
    streams: Streams = field(default_factory=active)
    #: set by the runtime's ``remove()``: what still stands in for a tensor has nothing left to serve from
    removed: bool = False
    #: components to rebuild before their next call: a module registered a new tensor or submodule (``Changes``),
    #: a resting tensor was given new data or memory of its own (``Serving``, its stand-ins), a replaced tensor
    #: was found at offload (``Moving``); read and cleared by ``Changes`` alone
    _changed: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.groups_of = {name: [g for g in self.groups if g.component == name] for name in self.components}

    def replace_groups(self, component: str, new: list[Group]) -> None:
        """``component``'s groups are ``new`` from now on (a rebuild)."""
        self.groups = [g for g in self.groups if g.component != component] + new
        self.groups_of[component] = [g for g in self.groups if g.component == component]

    def index_members(self) -> None:
        self.member_of = {id(m): name for name, root in self.components.items() for m in root.modules()}

    def mark_changed(self, component: str) -> None:
        """Rebuild ``component`` before its next call."""
        self._changed.add(component)

    def marked_changed(self, component: str) -> bool:
        """Whether ``component`` was marked changed since its last rebuild."""
        return component in self._changed

    def clear_changed(self, components: Iterable[str]) -> None:
        """``components`` are rebuilt now: what was marked of them is dealt with."""
        self._changed.difference_update(components)
