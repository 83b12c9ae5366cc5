"""The group engine: onloads and offloads groups around forwards, and keeps the ledger.

One :class:`Runtime` serves one ``apply``. It takes the groups ``prepare`` claimed (a placement's
:class:`GroupSpec` list made into :class:`~memmode_core.engine.groups.Group` objects) and binds them to
the tensors the model holds now (:func:`~memmode_core.engine.groups.bind_groups`), stores the offloaded
copies through the storage session, hooks the forwards of entry and exit modules and the weight-editing
methods (:meth:`Runtime.install`), puts the ``_hf_hook`` shim and the guards on the pipeline and its components
once a handle exists (:meth:`Runtime.attach`), and undoes all of it on :meth:`Runtime.remove`: every hook the
engine installs, the runtime installs and removes (a handle asks it). It is made of one part per job, each a
plain class in its own module that gets what it uses through its constructor — the shared
:class:`~memmode_core.engine.state.EngineState`, and the parts it calls:

* ``moving`` — :class:`Moving(state) <memmode_core.engine.moving.Moving>`: onloading, offloading,
  prefetching, the calls running now (their nesting), the end of a call;
* ``serving`` — :class:`Serving(state, moving) <memmode_core.engine.serving.Serving>`: resting tensors as
  stand-ins that serve every read of their value (see :mod:`memmode_core.engine.standins`);
* ``changes`` — :class:`Changes(state, moving, serving) <memmode_core.engine.changes.Changes>`: the one owner
  of rebuilds and edits — noticing changed weights, laying a component out again (its hooks taken off and put
  back through ``forwards``, handed to it), what an edit method does; placeholders;
* ``forwards`` — :class:`Forwards(state, moving, serving, changes) <memmode_core.engine.forwards.Forwards>`: the
  hooks around forwards, entry methods and edit methods (it installs and removes them), and what a hooked call
  does besides a rebuild or an edit.

Besides the parts, it keeps the hooks on the pipeline itself (``pipeline_hooks``:
:class:`~memmode_core.engine.pipeline_hooks.PipelineHooks`).

This object builds them in that order and runs the runtime's life: :meth:`Runtime.install`,
:meth:`Runtime.attach`, :meth:`Runtime.refresh`, :meth:`Runtime.remove`; what the rest of memmode asks of the
engine it asks here.

Threads: calls of one runtime's components, the edit methods it wraps, ``refresh`` and ``remove``
hold one re-entrant lock (``lock``; see :mod:`~memmode_core.engine.forwards`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from memmode_core.contracts.errors import IncompatibleModeError, RestoreError
from memmode_core.contracts.group_specs import Policy
from memmode_core.contracts.inner_tensors import unstorable
from memmode_core.contracts.storage import StorageSession, placeholder
from memmode_core.engine import watch
from memmode_core.engine.changes import Changes
from memmode_core.engine.device_room import DeviceRoom
from memmode_core.engine.device_share import DeviceShare
from memmode_core.engine.flattened import FlattenedSession, map_leaves
from memmode_core.engine.forwards import Forwards
from memmode_core.engine.groups import Group, Part, bind_groups
from memmode_core.engine.ledger import Ledger
from memmode_core.engine.moving import Moving
from memmode_core.engine.pipeline_hooks import PipelineHooks
from memmode_core.engine.placement_layout import Relayout
from memmode_core.engine.replacements import replaced_since, restore_replacements
from memmode_core.engine.serving import Serving
from memmode_core.engine.standins.classes import StandInReader, StandInSource, raw_access
from memmode_core.engine.state import EngineState


class Runtime:
    """One ``apply``'s engine: the shared state and the four parts built on it (see the module docstring)."""

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
        label: str = "a model",
        reserve: int | float | None = None,
        activations: Mapping[str, int] | None = None,
    ) -> None:
        #: what the parts share (live groups of the ones ``prepare`` claimed, their slots taken from the model
        #: as it is now)
        self.state = EngineState(
            components,
            bind_groups(list(groups), components),
            device,
            FlattenedSession(session) if session is not None else None,
            ledger,
            storage_name=storage or "its storage",
        )
        self.moving = Moving(self.state, prefetch=prefetch, lookahead=lookahead, offload_after_call=offload_after_call)
        #: this runtime's tenancy of its device's share (None on a host device, and for a storage whose onloads copy
        #: nothing); ``label`` names the handle to the others, ``reserve`` is kept free for what memmode does not own,
        #: ``activations`` are the predicted activation peaks of the components' calls (where the plan has them)
        share = None if self.moving.zero_copy else DeviceShare.of(self.state.streams, device)
        self.room = (
            DeviceRoom(self.state, self.moving, share, label=label, reserve=reserve, activations=activations)
            if share
            else None
        )
        self.moving.room = self.room
        self.serving = Serving(self.state, self.moving, strict=strict)
        self.changes = Changes(self.state, self.moving, self.serving, relayout=relayout, refuse_edit=refuse_edit)
        self.forwards = Forwards(self.state, self.moving, self.serving, self.changes, pipeline=pipeline)
        #: the ``_hf_hook`` shim and the guards on the pipeline and its components (installed by :meth:`attach`)
        self.pipeline_hooks = PipelineHooks(pipeline, components, device)

    # -- what the rest of memmode reads -----------------------------------------------------------------

    @property
    def components(self) -> dict[str, nn.Module]:
        return self.state.components

    @property
    def groups(self) -> list[Group]:
        """The live groups (a rebuild replaces a component's: read them here, never keep the list)."""
        return self.state.groups

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def session(self) -> StorageSession | None:
        """The storage's own session (the engine's parts talk to it through a
        :class:`~memmode_core.engine.flattened.FlattenedSession`, which hands it plain tensors only)."""
        return self.state.session.session if self.state.session is not None else None

    @property
    def ledger(self) -> Ledger:
        return self.state.ledger

    @property
    def calls(self) -> list[str]:
        """Calls of each component since apply or :meth:`reset_calls`, in order (the component hooks count them)."""
        return self.forwards.calls

    def reset_calls(self) -> None:
        """Count calls afresh (``handle.reset_stats()``)."""
        self.forwards.calls.clear()

    @property
    def lock(self) -> threading.RLock:
        return self.state.lock

    @property
    def removed(self) -> bool:
        """Whether :meth:`remove` ran."""
        return self.state.removed

    def component_of(self, module: nn.Module) -> str | None:
        """The component ``module`` belongs to, if it is one of this runtime's."""
        return self.state.member_of.get(id(module))

    def end_call(self) -> None:
        """A pipeline call returned: offload what it left on the device (see :meth:`Moving.end_call`)."""
        self.moving.end_call()

    def real_values(self, component: str) -> dict[int, torch.Tensor]:
        """``id(registered tensor) -> its real value on the CPU`` for ``component``'s offloaded tensors (see
        :meth:`Changes.real_values`)."""
        return self.changes.real_values(component)

    def count_read(self, source: StandInSource, nbytes: int, reader: StandInReader) -> None:
        """A read served by a stand-in of another kind (a quantized weight): counted, or refused under strict."""
        self.serving.count_read(source, nbytes, reader)

    def note_registration(self, module: nn.Module, name: str | None = None, value: object = None) -> None:
        """A registration anywhere in the process (:mod:`~memmode_core.engine.watch`): see
        :meth:`Changes.note_registration`."""
        self.changes.note_registration(module, name, value)

    def placeholder_name(self, tensor: torch.Tensor) -> str | None:
        """What ``tensor`` is the at-rest placeholder of, if it is one of this runtime's (for the trap)."""
        return self.changes.placeholder_name(tensor)

    # -- install / refresh / remove -----------------------------------------------------------------------

    def install(self, reserved: dict[str, int] | None = None) -> None:
        """Store the offloaded copies, then release the originals and hook the modules.

        Everything that can fail (space, permissions, memory for copies) happens in the first phase,
        while the model still holds its own tensors; a failure there leaves the model as it was.
        ``reserved``: the group sizes the session was already asked to make room for (``apply`` does
        that before quantizing, from the planner's prediction); only groups of another size are
        reserved again.
        """
        state, session = self.state, self.state.session
        stored = [g for g in state.groups if g.policy is not Policy.RESIDENT]
        if stored and session is None:
            raise RuntimeError("a placement that offloads needs a storage session")
        try:
            if stored:
                self._refuse_without_bytes(stored)
                sizes = {g.key: g.nbytes for g in stored}
                missing = {k: n for k, n in sizes.items() if (reserved or {}).get(k) != n}
                if missing:
                    session.reserve(missing)
                for group in stored:
                    group.parts = [Part(group.key, tuple(s.name for s in group.slots))]
                    given = group.tensors()
                    group.at_rest = session.put(group.key, given, group.readable)
                    self._refuse_copied(group, given)
                    unservable = self.serving.unservable(group, group.at_rest)
                    if unservable is not None:
                        raise IncompatibleModeError(
                            f"{state.storage_name} keeps no value of {unservable} at rest, and memmode can "
                            f"serve reads of a resting weight only for plain parameters and buffers; use a "
                            f"storage that keeps values at rest (ram, mmap) for this model"
                        )
                session.flush()
            # the groups placed on the device for good go there now, while the stored ones are still the model's
            # own: a device too small for them (a typed DeviceMemoryError) takes back what went, and leaves the model
            # as it was
            onloaded: list[Group] = []
            try:
                for group in state.groups:
                    if group.policy is Policy.RESIDENT:
                        self.moving.onload_resident(group)
                        onloaded.append(group)
            except BaseException:
                for group in onloaded:
                    self.moving.offload_resident(group)
                raise
        except BaseException:
            if session is not None:
                session.close()
            raise
        for group in stored:
            group.rest(group.at_rest)
            self.serving.rest_as_stand_ins(group)
        for name in state.components:
            self.forwards.install_hooks(name)
            self.changes.note_placeholders(name)
        self.forwards.install_edit_wrappers()
        state.index_members()
        watch.watch(self)

    def _refuse_without_bytes(self, stored: list[Group]) -> None:
        """A tensor whose values are not bytes memmode can copy (a ``DTensor`` shard of FSDP2 or tensor parallelism,
        a wrapper subclass without torch's flatten protocol: :func:`~memmode_core.contracts.inner_tensors.unstorable`)
        can rest only where nothing is copied: under a storage that copies a resting weight's bytes (to a file, a
        slab, another device), it is refused before anything is stored or released. A library's quantized tensor
        that implements the protocol is stored by its inner tensors (:mod:`~memmode_core.engine.flattened`).

        A storage whose onloads copy nothing may still have copied at ``put`` (``mmap`` on the CPU wrote the file it
        maps): that one is refused after its ``put``, still before anything is released (:meth:`_refuse_copied`)."""
        if self.state.session.zero_copy(self.state.device):
            return
        for group in stored:
            for slot in group.slots:
                why = unstorable(slot.tensor)
                if why is not None:
                    raise self._cannot_store(group, slot.name, why)

    def _refuse_copied(self, group: Group, given: dict[str, torch.Tensor]) -> None:
        """After ``put``: a tensor that cannot be stored must rest as the very tensor it was (``ram`` on the CPU)."""
        for slot in group.slots:
            why = unstorable(slot.tensor)
            if why is not None and group.at_rest.get(slot.name) is not given[slot.name]:
                raise self._cannot_store(group, slot.name, why)

    def _cannot_store(self, group: Group, name: str, why: str) -> IncompatibleModeError:
        return IncompatibleModeError(
            f"{group.key}: {name} is {why}, and storage {self.state.storage_name!r} copies a resting weight's bytes, "
            f"which such a tensor does not hold in one place. Leave it in place with storage='ram' on a CPU device, "
            f"leave its component out with unplaced=[...], or offload it with the sharding library's own option "
            f"(FSDP2's CPUOffloadPolicy)"
        )

    def attach(
        self, on_detach: Callable[[], None], *, mode: str, quantized: Callable[[nn.Module], bool] | None = None
    ) -> None:
        """Install the hooks that need a handle, once :meth:`install` is done: the ``_hf_hook`` shim on a pipeline's
        components (``on_detach``: what diffusers' ``remove_all_hooks`` runs, the handle's ``remove``), and the
        guards — the end of a pipeline's call, refusing diffusers' own offloading while ``mode`` is applied, and
        refusing ``save_pretrained`` of what ``quantized(module)`` says holds quantized layers
        (:class:`~memmode_core.engine.pipeline_hooks.PipelineHooks`). :meth:`remove` takes them off."""
        self.pipeline_hooks.install(mode=mode, on_detach=on_detach, on_call_end=self.end_call, quantized=quantized)

    def refresh(self) -> None:
        """Take every weight from the model as it is now (for edits memmode cannot notice).

        A group resident on the device right now may have been edited there: its device copy is
        what is taken, not the stored one.
        """
        with self.state.lock:
            self._refresh()

    @raw_access
    def _refresh(self) -> None:
        self.moving.synchronize()
        for name in self.state.components:
            self.moving.bring_back(name)
            self.changes.rebuild(name, self.forwards, keep_parts=False)

    def remove(self) -> None:
        """Take off every hook this runtime installed, and leave every weight in ordinary CPU memory.

        Every group that can be restored is, whatever happens to the others; a group whose stored
        copy is lost (a deleted or damaged file) is left holding placeholders — never a mapping of
        a broken file — and one :class:`RestoreError` names all of them once everything else is
        undone (hooks off, storage closed). The shim and the guards (:meth:`attach`) come off last,
        whatever happened before.
        """
        try:
            with self.state.lock:
                self._remove()
        finally:
            self.pipeline_hooks.remove()

    @raw_access
    def _remove(self) -> None:
        state, streams = self.state, self.state.streams
        watch.unwatch(self)
        self.forwards.remove_all_hooks()
        self.moving.synchronize()
        failed: dict[str, str] = {}
        for group in state.groups:
            try:
                if group.policy is Policy.RESIDENT:
                    group.assign({n: map_leaves(t, streams.to_host) for n, t in group.tensors().items()})
                else:
                    restored = self.changes.restore(group)
                    restored.update(replaced_since(group, restored, streams, zero_copy=self.moving.zero_copy))
                    group.assign(restored)
                    restore_replacements(group, restored, streams)
            except Exception as exc:  # noqa: BLE001 - every failure is reported, after the other groups
                failed[group.key] = str(exc) or type(exc).__name__
                group.assign({s.name: placeholder(s.tensor.data) for s in group.slots})
                self.serving.rest_lost(group, failed[group.key])
            else:
                self.serving.wake_all(group)
            finally:
                group.at_rest = {}  # the storage's copies (a file mapping, pinned memory) go with the session
                if group.resident:
                    group.resident = False
                    group.ready_event = None
                    state.ledger.offloaded(group.nbytes, 0.0)
        self.moving.forget_resident()
        if self.room is not None:
            self.room.leave()
        state.removed = True
        if state.session is not None:
            state.session.close()
        if failed:
            raise RestoreError(failed)
