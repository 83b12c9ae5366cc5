"""Noticing that a component's weights changed, laying it out again, and edits: the one owner of rebuilds and edits.

The :class:`Changes` part of the :class:`~memmode_core.engine.runtime.Runtime` (it needs the runtime's
:class:`~memmode_core.engine.state.EngineState`, its :class:`~memmode_core.engine.moving.Moving` and
:class:`~memmode_core.engine.serving.Serving` parts). When a component's tensors changed — an adapter was
injected, a parameter replaced (see :mod:`memmode_core.engine.watch` for how that is noticed; any part marks a
change with ``state.mark_changed``, this one alone reads and clears the marks) — its groups are rebuilt before
its next call: the component's entry hook asks :meth:`Changes.rebuild_if_changed`, which decides
(:meth:`Changes.changed`) and rebuilds (:meth:`Changes.rebuild`): refuses what cannot be rebuilt, offloads the
component, takes its hooks off, lays it out again and stores what changed, and puts its hooks back. The hooks are
the :class:`~memmode_core.engine.forwards.Forwards` part's, which is built on this one and so is handed over as
an argument (:class:`Rehooking`) by whoever asks. A rebuild keeps every stored part whose tensors did not change,
so loading a LoRA stores the adapter's weights and nothing else. The weight-editing methods of diffusers and
transformers run inside :meth:`Changes.editing`: refused if the mode cannot take them, offloaded (and given real
values for those that write into the weights) before, rebuilt after.

A storage that keeps nothing of an offloaded tensor in memory leaves a placeholder in it (see
:mod:`memmode_core.engine.standins.placeholders`). Nothing computed from a placeholder may become a weight: a
registration of one is refused (:meth:`Changes.note_registration`), a rebuild stores the real value instead
(:meth:`Changes._real_value`; ``remove()`` too: :mod:`~memmode_core.engine.replacements`), and a non-finite
result of a component resting on placeholders is explained (:meth:`Changes.explain_non_finite`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from memmode_core.contracts.errors import OffloadedWeightReadError
from memmode_core.contracts.group_specs import Policy
from memmode_core.contracts.inner_tensors import stored_bytes
from memmode_core.contracts.storage import Tensors, is_placeholder
from memmode_core.engine import watch
from memmode_core.engine.groups import Group, Part, Slot, claim_groups, module_path
from memmode_core.engine.hooks import not_traced
from memmode_core.engine.moving import Moving
from memmode_core.engine.pipeline_hooks import refuse_foreign_offloading
from memmode_core.engine.placement_layout import Relayout
from memmode_core.engine.replacements import computed_from_placeholder, derived_from_placeholder
from memmode_core.engine.serving import Serving
from memmode_core.engine.standins.classes import forget, raw_access, raw_reads
from memmode_core.engine.standins.placeholders import PlaceholderTrap, non_finite
from memmode_core.engine.state import EngineState


class Rehooking(Protocol):
    """What a rebuild asks of the hooks on a component's modules: the runtime's
    :class:`~memmode_core.engine.forwards.Forwards` part. It is built on this part (its hooks call
    :meth:`Changes.rebuild_if_changed` and :meth:`Changes.editing`), so whoever asks for a rebuild or an edit hands
    it over as an argument: the hooks themselves, or the runtime's ``refresh``."""

    def remove_hooks(self, component: str) -> list: ...

    def install_hooks(self, component: str, retired: Iterable = ()) -> None: ...

    def wrapped_over(self, component: str) -> bool: ...


class Changes:
    """Change detection, rebuilds, edits and placeholders, for the groups of ``state``: it offloads and onloads
    through ``moving``, and rests what it stores again as stand-ins through ``serving``.

    ``relayout``: how a component is laid out again (None: this runtime cannot rebuild); ``refuse_edit(method,
    components)``: raises for an edit the mode cannot take (fusing into packed weights).
    """

    def __init__(
        self,
        state: EngineState,
        moving: Moving,
        serving: Serving,
        *,
        relayout: Relayout | None = None,
        refuse_edit: Callable[[str, dict[str, nn.Module]], None] | None = None,
    ) -> None:
        self.state = state
        self.moving = moving
        self.serving = serving
        self._relayout = relayout
        self._refuse_edit = refuse_edit
        #: > 0 while a weight-editing method runs (:meth:`editing`, which alone writes it): registrations are its
        #: own, and a call of the component inside it is not rebuilt first
        self.edit_depth = 0
        #: makes the storage keys of rebuilt parts unique
        self._generation = 0
        #: on a CPU device a non-finite result of a component whose tensors rest as placeholders is
        #: explained (see :mod:`memmode_core.engine.standins.placeholders`); on CUDA the same read is a device
        #: mismatch
        self.check_results = state.device.type == "cpu"
        #: components some of whose tensors rest as placeholders (no real value at rest)
        self._placeholdered: set[str] = set()
        #: > 0 while a call runs again under the placeholder trap
        self._diagnosing = 0

    @raw_access
    def note_registration(self, module: nn.Module, name: str | None = None, value: object = None) -> None:
        """Called for every parameter, buffer or submodule registration in the process (see watch).

        A tensor computed from the placeholder it replaces (all NaN, where ``name`` holds an offloaded
        placeholder now) is refused before it is registered: it would become the weight for good.
        """
        component = self.state.member_of.get(id(module))
        if component is None or self.edit_depth:
            return
        if isinstance(value, torch.Tensor) and name is not None:
            current = module._parameters.get(name) if name in module._parameters else module._buffers.get(name)
            if (
                current is not None
                and is_placeholder(current)
                and value.shape == current.shape
                and derived_from_placeholder(value, current)
            ):
                where = module_path(self.state.components, module, component)
                raise OffloadedWeightReadError(
                    f"{where}.{name}: the new value was computed from its offloaded placeholder (it is all NaN), "
                    f"not from the weight; refused before anything changed. Code that rebuilds a component's "
                    f"parameters from their values (a to() override, nn.Parameter(self.x.to(...))) must run "
                    f"inside one of the component's methods, which memmode onloads it for"
                )
        self.state.mark_changed(component)

    def note_placeholders(self, component: str) -> None:
        """Remember whether ``component`` has tensors resting as placeholders (what its results are checked for)."""
        if any(is_placeholder(t) for g in self.state.groups_of.get(component, ()) for t in g.at_rest.values()):
            self._placeholdered.add(component)
        else:
            self._placeholdered.discard(component)

    @raw_access
    def placeholder_name(self, tensor: torch.Tensor) -> str | None:
        """``"<slot name> (group <key>)"`` if ``tensor`` holds the at-rest placeholder of one of this runtime's
        slots."""
        pointer = tensor.data_ptr()
        for group in self.state.groups:
            for slot in group.slots:
                rest = group.at_rest.get(slot.name)
                if rest is not None and rest.data_ptr() == pointer and is_placeholder(rest):
                    qualified = slot.name if len(self.state.components) > 1 else f"{group.component}.{slot.name}"
                    return f"{qualified} (group {group.key})"
        return None

    def explain_if_non_finite(self, component: str, module: nn.Module, method: str, args, kwargs, result) -> None:
        """After a call of ``component`` (``module.method(*args, **kwargs)``) returned ``result``: if some of its
        tensors rest as placeholders and the result holds NaN or infinity, explain it
        (:meth:`explain_non_finite`). Asked only where ``check_results`` is set (a CPU device)."""
        if not self._diagnosing and component in self._placeholdered and non_finite(result):
            self.explain_non_finite(component, module, method, args, kwargs)

    def explain_non_finite(self, component: str, module: nn.Module, method: str, args, kwargs) -> None:
        """A call of ``component`` returned NaN or infinity while some of its tensors rest as placeholders:
        run it again under the :class:`PlaceholderTrap`, which raises naming the placeholder if one was
        read. If none was, the model itself produced the values, and the caller returns them unchanged."""
        where = f"{module_path(self.state.components, module, component)}.{method}"
        self._diagnosing += 1
        try:
            with PlaceholderTrap(self.placeholder_name, where=where):
                getattr(module, method)(*args, **kwargs)
        except OffloadedWeightReadError:
            raise
        except Exception:  # noqa: BLE001 - the second run is only an explanation; the first run's result stands
            return
        finally:
            self._diagnosing -= 1

    # -- a rebuild ----------------------------------------------------------------------------------------

    @not_traced
    def rebuild_if_changed(self, component: str, hooks: Rehooking) -> bool:
        """A call of ``component`` begins (not nested in another of its calls): rebuild it first if it changed
        (:meth:`changed`), unless an edit is running (whose end rebuilds it). Returns whether it was rebuilt (the
        caller then calls through the new hooks)."""
        if self.edit_depth or not self.changed(component, hooks):
            return False
        self.rebuild(component, hooks)
        return True

    @not_traced
    @raw_access
    def changed(self, component: str, hooks: Rehooking) -> bool:
        """Whether ``component`` must be rebuilt before its call.

        Runs at each call of the component: a change was marked (a registration was reported, a resting tensor
        was given new data or memory of its own: ``state.mark_changed``), or a tracked tensor is no longer
        registered where it was, or an offloaded one no longer holds its at-rest data, or a hook was wrapped
        around one of ``hooks`` since (diffusers' ``enable_layerwise_casting`` after ``apply``): the rebuild then
        installs ours outside it, so weights are onloaded before that hook sees them and offloaded after it is
        done with them.
        """
        if self.state.marked_changed(component) or hooks.wrapped_over(component):
            return True
        zero_copy = self.moving.zero_copy
        for group in self.state.groups_of[component]:
            check_data = not group.resident and group.policy is not Policy.RESIDENT and not zero_copy
            for slot in group.slots:
                if not slot.registered() or (check_data and slot.tensor.data_ptr() != slot.rest_ptr):
                    return True
        return False

    @not_traced
    @raw_access
    def rebuild(self, component: str, hooks: Rehooking, *, keep_parts: bool = True) -> None:
        """Lay ``component`` out again and store what changed, keeping the stored parts that did not change
        (``keep_parts=False``: store everything anew, for ``refresh()``); its hooks (``hooks``) are taken off
        before and installed again after. A rebuild that cannot be done is refused before anything moves."""
        if self._relayout is None:
            raise RuntimeError("this runtime cannot rebuild: it was built without a layout function")
        # another offloading scheme installed since apply would fight memmode over the weights; refuse
        # before anything moves (remove() still gives every weight back from the storage)
        refuse_foreign_offloading({component: self.state.components[component]})
        self.moving.offload_component(component)
        retired = hooks.remove_hooks(component)
        self._regroup(component, keep_parts)
        hooks.install_hooks(component, retired)

    # -- an edit --------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def editing(self, components: list[str], method: str, hooks: Rehooking) -> Iterator[None]:
        """Around a method that edits the weights of ``components`` (``method``, one of ``watch.EDIT_METHODS``):
        refused first if the mode cannot take it (``refuse_edit``), offloaded (and, for a method that writes into
        the weights, given real values), and rebuilt after, whatever it did. Nested edits (a pipeline's
        ``load_lora_weights`` calling a component's ``load_lora_adapter``) act once, at the outermost; while an
        edit runs, what it registers is its own (:meth:`note_registration`) and calls of the components are not
        rebuilt first."""
        outermost = self.edit_depth == 0
        if outermost:
            if self._refuse_edit is not None:
                self._refuse_edit(method, {name: self.state.components[name] for name in components})
            for name in components:
                self.moving.offload_component(name)
                if method in watch.WRITES_WEIGHTS:
                    self._materialize(name)
        self.edit_depth += 1
        try:
            yield
        finally:
            self.edit_depth -= 1
            if outermost:
                self.state.clear_changed(components)  # rebuilt now: nothing the edit did is left to notice
                for name in components:
                    self.rebuild(name, hooks)

    def _materialize(self, component: str) -> None:
        """Give every offloaded tensor of ``component`` whose at-rest value is a placeholder its real
        value, so that a method writing into the weights writes into real memory."""
        for group in self.state.groups_of[component]:
            if group.policy is Policy.RESIDENT:
                continue
            if any(is_placeholder(t) for t in group.at_rest.values()):
                group.assign(self.restore(group))

    def _regroup(self, component: str, keep_parts: bool) -> None:
        """Lay ``component`` (offloaded, its hooks off: :meth:`rebuild`) out again and store what changed; keep the
        parts that did not change."""
        state = self.state
        components = state.components
        old = state.groups_of[component]
        new = claim_groups(components, self._relayout(component), names=components)
        previous = {id(slot.tensor): (group, slot) for group in old for slot in group.slots}
        # a tensor registered where an old one was (``_apply`` or a ``to()`` override making new parameters)
        previous.update({slot.place(): (group, slot) for group in old for slot in group.slots})
        kept: set[str] = set()
        for group in new:
            if group.policy is Policy.RESIDENT:
                self.moving.onload_resident(group)
            else:
                kept.update(self._store_rebuilt(group, previous, keep_parts))
        held = {id(slot.tensor) for group in new for slot in group.slots}
        for group in old:
            if group.resident:  # a resident group (full load) is not offloaded: its bytes leave now
                state.ledger.offloaded(group.nbytes, 0.0)
            for part in group.parts:
                if part.key not in kept:
                    state.session.discard(part.key)
            for slot in group.slots:
                if id(slot.tensor) not in held:  # no longer the component's: plain again
                    forget(slot.tensor)
        state.replace_groups(component, new)
        self.moving.forget_resident(component)  # offloaded by release(); RESIDENT groups are not tracked
        self.moving.restart_recording(component)
        self.note_placeholders(component)
        state.index_members()
        state.clear_changed([component])

    def _store_rebuilt(self, group: Group, previous, keep_parts: bool) -> set[str]:
        """Store a rebuilt group: reuse an old group's parts when all of its tensors are here
        unchanged, store the rest as a new part. Returns the keys of the parts kept."""
        sources: dict[int, Group] = {}
        unchanged: set[int] = set()
        fresh: list[Slot] = []
        for slot in group.slots:
            found = previous.get(id(slot.tensor))
            if (
                keep_parts
                and found is not None
                and found[0].policy is not Policy.RESIDENT
                and slot.tensor.data_ptr() == found[1].rest_ptr
            ):
                sources[id(found[0])] = found[0]
                unchanged.add(id(slot.tensor))
            else:
                fresh.append(slot)
        # one old group, every tensor of it here and unchanged: its stored parts are still right
        reusable = len(sources) == 1 and all(id(o.tensor) in unchanged for o in next(iter(sources.values())).slots)
        parts: list[Part] = []
        at_rest: Tensors = {}
        if reusable:
            (source,) = sources.values()
            now = {id(s.tensor): s.name for s in group.slots}
            renamed = {o.name: now[id(o.tensor)] for o in source.slots}
            for part in source.parts:
                stored = {(part.rename or {}).get(n, n): n for n in part.names}  # slot name then -> stored name
                rename = {stored_name: renamed[then] for then, stored_name in stored.items()}
                parts.append(Part(part.key, part.names, {k: v for k, v in rename.items() if k != v} or None))
            at_rest.update({renamed[o.name]: source.at_rest[o.name] for o in source.slots})
        else:
            fresh = list(group.slots)
        if fresh:
            values = {}
            for slot in fresh:
                found = previous.get(id(slot.tensor)) or previous.get(slot.place())
                current = slot.tensor.data
                if found is not None and found[0].policy is not Policy.RESIDENT:
                    current = self._real_value(found[0], found[1], current)
                values[slot.name] = current
            self._generation += 1
            key = f"{group.key}@{self._generation}"
            readable = frozenset(s.name for s in fresh if s.name in group.readable)
            session = self.state.session
            session.reserve({key: sum(stored_bytes(v) for v in values.values())})
            at_rest.update(session.put(key, values, readable))
            session.flush()
            parts.append(Part(key, tuple(values)))
        group.parts = parts
        group.rest(at_rest)
        self.serving.rest_as_stand_ins(group)
        return {p.key for p in parts}

    def _real_value(self, group: Group, slot: Slot, current: torch.Tensor) -> torch.Tensor:
        """What an offloaded tensor really holds now, for storing it again.

        Its at-rest placeholder, still in place: the stored value. A tensor computed *from* the
        placeholder while the weight was offloaded — ``module.to(dtype)`` by a hook installed after
        ``apply`` turns the one-element NaN into a full NaN tensor — is the stored value put through
        the same cast; storing it would lose the weights. Anything else is a real new value.
        """
        if is_placeholder(current) or computed_from_placeholder(current, group.at_rest.get(slot.name)):
            return self._restore_one(group, slot.name).to(current.dtype)
        return current

    def _restore_one(self, group: Group, name: str) -> torch.Tensor:
        for part in group.parts:
            tensors = part.translate(self.state.session.restore(part.key))
            if name in tensors:
                return tensors[name]
        raise KeyError(name)

    def real_values(self, component: str) -> dict[int, torch.Tensor]:
        """``id(registered tensor) -> its real value on the CPU`` for every tensor of ``component`` whose
        registered value is not its real one right now (offloaded: a placeholder or a storage's view).

        For reading a placed model's weights without removing the mode (saving it). Nothing is moved.
        """
        with self.state.lock, raw_reads():
            found: dict[int, torch.Tensor] = {}
            for group in self.state.groups_of.get(component, []):
                if group.policy is Policy.RESIDENT or group.resident:
                    continue
                values = self.restore(group)
                for slot in group.slots:
                    if slot.name in values:
                        found[id(slot.tensor)] = values[slot.name]
            return found

    def restore(self, group: Group) -> Tensors:
        """The stored values of an offloaded group, read back from the storage (checked first)."""
        session = self.state.session
        tensors: Tensors = {}
        for part in group.parts:
            session.check(part.key)
            tensors.update(part.translate(session.restore(part.key)))
        return tensors
