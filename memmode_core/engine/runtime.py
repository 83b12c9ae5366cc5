"""The group engine: onloads and offloads groups around forwards, and keeps the ledger.

One :class:`Runtime` serves one ``apply``. It takes the groups ``prepare`` claimed (a placement's
:class:`GroupSpec` list made into :class:`~memmode_core.engine.groups.Group` objects) and binds them to
the tensors the model holds now (:func:`~memmode_core.engine.groups.bind_groups`), stores the offloaded
copies through the storage session, hooks the forwards of entry and exit modules, and undoes all of it
on ``remove``. It is the composition of one part per job, each in its own module:

* :mod:`~memmode_core.engine.groups` — the group data model and claiming (:func:`claim_groups`);
* :class:`~memmode_core.engine.moving.Moving` — onloading, offloading, prefetching, the end of a call;
* :class:`~memmode_core.engine.changes.Changes` — noticing changed weights and rebuilding, edits,
  placeholders;
* :class:`~memmode_core.engine.forwards.Forwards` — the hooks around forwards and entry methods (named
  objects, see :mod:`~memmode_core.engine.hooks`);
* :class:`~memmode_core.engine.serving.Serving` — resting tensors as stand-ins that serve every read of
  their value (see :mod:`~memmode_core.engine.standins`).

The parts share this object's state (components, groups, storage session, lock); each part's
``_init_*`` sets the state it owns.

Threads: calls of one runtime's components, the edit methods it wraps, ``refresh`` and ``remove``
hold one re-entrant lock (``lock``; see :mod:`~memmode_core.engine.forwards`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from memmode_core.contracts.errors import IncompatibleModeError, RestoreError
from memmode_core.contracts.layout import Policy
from memmode_core.contracts.storage import StorageSession, data_class, has_own_bytes, placeholder
from memmode_core.engine import watch
from memmode_core.engine.changes import Changes
from memmode_core.engine.forwards import Forwards
from memmode_core.engine.groups import Group, Part, bind_groups
from memmode_core.engine.laying_out import Relayout
from memmode_core.engine.ledger import Ledger
from memmode_core.engine.moving import Moving
from memmode_core.engine.serving import Serving
from memmode_core.engine.standins import raw_access


class Runtime(Forwards, Changes, Moving, Serving):
    def __init__(
        self,
        components: dict[str, nn.Module],
        groups: Iterable[Group],
        *,
        device: torch.device,
        session: StorageSession | None,
        ledger: Ledger,
        prefetch: bool = False,
        lookahead: Mapping[str, int] | None = None,
        offload_after_call: bool = True,
        relayout: Relayout | None = None,
        pipeline: object | None = None,
        refuse_edit: Callable[[str, dict[str, nn.Module]], None] | None = None,
        strict: bool = False,
        storage: str | None = None,
    ) -> None:
        self.components = components
        #: live groups of the ones ``prepare`` claimed, their slots taken from the model as it is now
        self.groups: list[Group] = bind_groups(list(groups), components)
        #: component -> its groups (kept in step with ``groups``)
        self._groups_of: dict[str, list[Group]] = {}
        self._index_groups()
        #: calls of each component since apply or ``reset_calls`` (a nested call counts once), in order
        self.calls: list[str] = []
        #: serializes calls of this runtime's components, edits, refresh and remove across threads
        self.lock = threading.RLock()
        self._init_moving(
            device, session, ledger, prefetch=prefetch, lookahead=lookahead, offload_after_call=offload_after_call
        )
        self._init_changes(device, relayout=relayout, refuse_edit=refuse_edit)
        self._init_forwards(pipeline)
        self._init_serving(strict=strict, storage=storage)

    def _index_groups(self) -> None:
        self._groups_of = {name: [g for g in self.groups if g.component == name] for name in self.components}

    # -- install / remove ---------------------------------------------------------------------------

    def install(self, reserved: dict[str, int] | None = None) -> None:
        """Store the offloaded copies, then release the originals and hook the modules.

        Everything that can fail (space, permissions, memory for copies) happens in the first phase,
        while the model still holds its own tensors; a failure there leaves the model as it was.
        ``reserved``: the group sizes the session was already asked to make room for (``apply`` does
        that before quantizing, from the planner's prediction); only groups of another size are
        reserved again.
        """
        stored = [g for g in self.groups if g.policy is not Policy.RESIDENT]
        if stored and self.session is None:
            raise RuntimeError("a placement that offloads needs a storage session")
        try:
            if stored:
                self._refuse_without_bytes(stored)
                sizes = {g.key: g.nbytes for g in stored}
                missing = {k: n for k, n in sizes.items() if (reserved or {}).get(k) != n}
                if missing:
                    self.session.reserve(missing)
                for group in stored:
                    group.parts = [Part(group.key, tuple(s.name for s in group.slots))]
                    group.at_rest = self.session.put(group.key, group.tensors(), group.readable)
                    unservable = self.unservable(group, group.at_rest)
                    if unservable is not None:
                        raise IncompatibleModeError(
                            f"{self._storage_name} keeps no value of {unservable} at rest, and memmode can "
                            f"serve reads of a resting weight only for plain parameters and buffers; use a "
                            f"storage that keeps values at rest (ram, mmap) for this model"
                        )
                self.session.flush()
        except BaseException:
            if self.session is not None:
                self.session.close()
            raise
        for group in stored:
            group.rest(group.at_rest)
            self.rest_as_stand_ins(group)
        for group in self.groups:
            if group.policy is Policy.RESIDENT:
                self._onload_resident(group)
        for name in self.components:
            self._install_hooks(name)
            self._note_placeholders(name)
        self._install_edit_wrappers()
        self._index_members()
        watch.watch(self)

    def _refuse_without_bytes(self, stored: list[Group]) -> None:
        """A tensor with no bytes of its own (a ``DTensor`` shard of FSDP2 or tensor parallelism, a library's
        wrapped tensor) can rest only where nothing is copied: under a storage that copies a resting weight's
        bytes (to a file, a slab, another device), it is refused before anything is stored or released."""
        if self.session.zero_copy(self.device):
            return
        for group in stored:
            for slot in group.slots:
                if not has_own_bytes(slot.tensor):
                    raise IncompatibleModeError(
                        f"{group.key}: {slot.name} is a {data_class(slot.tensor).__name__} (sharded by FSDP2 or "
                        f"tensor parallelism, or a library's wrapped tensor), and storage {self._storage_name!r} "
                        f"copies a resting weight's bytes, which such a tensor does not hold in one place. Leave it "
                        f"in place with storage='ram' on a CPU device, leave its component out with unplaced=[...], "
                        f"or offload it with the sharding library's own option (FSDP2's CPUOffloadPolicy)"
                    )

    def remove(self) -> None:
        """Unhook, and leave every weight in ordinary CPU memory.

        Every group that can be restored is, whatever happens to the others; a group whose stored
        copy is lost (a deleted or damaged file) is left holding placeholders — never a mapping of
        a broken file — and one :class:`RestoreError` names all of them once everything else is
        undone (hooks off, storage closed).
        """
        with self.lock:
            self._remove()

    @raw_access
    def _remove(self) -> None:
        watch.unwatch(self)
        self._remove_all_hooks()
        if self._async:
            self.streams.synchronize(self.device)
        failed: dict[str, str] = {}
        for group in self.groups:
            try:
                if group.policy is Policy.RESIDENT:
                    group.assign({n: self.streams.to_host(t) for n, t in group.tensors().items()})
                else:
                    restored = self._restore(group)
                    restored.update(self._replaced_since(group, restored))
                    group.assign(restored)
                    self._restore_replacements(group, restored)
            except Exception as exc:  # noqa: BLE001 - every failure is reported, after the other groups
                failed[group.key] = str(exc) or type(exc).__name__
                group.assign({s.name: placeholder(s.tensor.data) for s in group.slots})
                self.rest_lost(group, failed[group.key])
            else:
                self.wake_all(group)
            finally:
                group.at_rest = {}  # the storage's copies (a file mapping, pinned memory) go with the session
                if group.resident:
                    group.resident = False
                    group.ready_event = None
                    self.ledger.offloaded(group.nbytes, 0.0)
        for resident in self._resident.values():
            resident.clear()
        self._removed_runtime = True
        if self.session is not None:
            self.session.close()
        if failed:
            raise RestoreError(failed)
