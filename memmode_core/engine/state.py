"""What the parts of one runtime share: its components and groups, where they compute, the storage session,
the books, the lock, and the few facts more than one part reads.

A :class:`~memmode_core.engine.runtime.Runtime` is made of parts, one per job — moving groups
(:class:`~memmode_core.engine.moving.Moving`), serving reads of resting tensors
(:class:`~memmode_core.engine.serving.Serving`), noticing changes and laying out again
(:class:`~memmode_core.engine.changes.Changes`), the hooks around forwards
(:class:`~memmode_core.engine.forwards.Forwards`) — each a plain class that gets this state and the parts it
calls through its constructor. So that a newcomer can see who touches what, state lives here only when more
than one part reads or writes it; what one part alone keeps (what is resident, what was learned, the hooks) is
that part's own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch import nn

from memmode_core.contracts.storage import StorageSession
from memmode_core.engine.groups import Group
from memmode_core.engine.ledger import Ledger
from memmode_core.engine.streams import Streams, active


@dataclass(eq=False)
class EngineState:
    """One runtime's shared state (see the module docstring)."""

    #: component name -> its root module
    components: dict[str, nn.Module]
    #: live groups, their slots taken from the model as it is now (``bind_groups``); a rebuild replaces a
    #: component's groups, so read it from here, never keep a copy
    groups: list[Group]
    #: where the components compute
    device: torch.device
    #: where offloaded groups rest (None: nothing is offloaded)
    session: StorageSession | None
    #: what is on the device, and the copies and reads it took
    ledger: Ledger
    #: the storage's name, for messages
    storage_name: str = "its storage"
    #: component -> its groups (kept in step with ``groups`` by :meth:`index_groups`)
    groups_of: dict[str, list[Group]] = field(default_factory=dict)
    #: calls of each component since apply or ``reset_calls`` (a nested call counts once), in order
    calls: list[str] = field(default_factory=list)
    #: serializes calls of this runtime's components, edits, refresh and remove across threads
    lock: threading.RLock = field(default_factory=threading.RLock)
    #: component -> how deeply its calls are nested now (0: not in a call)
    depth: dict[str, int] = field(default_factory=dict)
    #: id(module) -> the component it belongs to (kept by :meth:`index_members`)
    member_of: dict[int, str] = field(default_factory=dict)
    #: components to rebuild before their next call: a module registered a new tensor or submodule, a
    #: resting tensor was given new data, a write gave one memory of its own
    dirty: set[str] = field(default_factory=set)
    #: streams, events and copies (the real accelerator API, or a test double)
    streams: Streams = field(default_factory=active)
    #: set by ``remove()``: what still stands in for a tensor has nothing left to serve from
    removed: bool = False

    def __post_init__(self) -> None:
        self.depth = {name: 0 for name in self.components}
        self.index_groups()

    def index_groups(self) -> None:
        self.groups_of = {name: [g for g in self.groups if g.component == name] for name in self.components}

    def index_members(self) -> None:
        self.member_of = {id(m): name for name, root in self.components.items() for m in root.modules()}

    def mark_changed(self, component: str) -> None:
        """Rebuild ``component`` before its next call."""
        self.dirty.add(component)

    def in_call(self) -> bool:
        """Whether a call of one of the components is running now."""
        return any(self.depth.values())
