"""The group engine: onloads and offloads groups around forwards, and keeps the ledger.

One :class:`Runtime` serves one ``apply``. It turns the placement's :class:`GroupSpec` list into
:class:`Group` objects holding the actual tensors, stores the offloaded copies through the storage
session, wraps the forwards of entry and exit modules, and undoes all of it on ``remove``.

Weights are swapped through ``tensor.data``, so parameters and buffers keep their identity: code
that holds a reference to a parameter (an optimizer, an adapter, a tied weight) keeps seeing it.

Prefetching (CUDA only): during a component's first call the order in which its groups are
onloaded is recorded. From then on, onloading a group also starts copying the next one in that
order on a side stream; an event recorded after those copies is what the compute stream waits on
before the next group's modules run, and every prefetched tensor is marked as used by the compute
stream (``record_stream``) so the caching allocator never hands its memory to a new copy while a
kernel may still read it. A group that was not prefetched (first call, a layer skipped or called
out of order) is simply onloaded on the compute stream when it is entered.

Threads: calls of one runtime's components, the edit methods it wraps, ``refresh`` and ``remove``
hold one re-entrant lock, so two threads calling one placed pipeline run one call at a time and
never see each other's half-done onloads (the group bookkeeping is not thread-safe by itself).

Changing weights (see :mod:`memmode_core.engine.watch`): when a component's tensors changed — an
adapter was injected, a parameter replaced — its groups are rebuilt before its next call. A rebuild
lays the component out again and keeps every stored part whose tensors did not change, so loading
a LoRA stores the adapter's weights and nothing else.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterable

import torch
from torch import nn

from memmode_core.contracts.errors import OffloadedWeightReadError, RestoreError
from memmode_core.contracts.layout import GroupSpec, Policy
from memmode_core.contracts.storage import StorageSession, Tensors, is_placeholder, placeholder
from memmode_core.engine import watch
from memmode_core.engine.groups import Group, Part, Slot, claim_groups
from memmode_core.engine.hooks import MethodWrapper
from memmode_core.engine.inputs import move_inputs
from memmode_core.engine.ledger import Ledger, clock
from memmode_core.engine.pipeline_hooks import refuse_foreign_offloading
from memmode_core.engine.reads import PlaceholderTrap, non_finite


def _not_traced(function):
    """The engine's bookkeeping runs eagerly under torch.compile: its Python state (books, flags,
    swapped ``.data``) is not something to trace, and guards on it would fail at every call."""
    return torch.compiler.disable(function, recursive=True)


#: methods besides ``forward`` through which a pipeline calls a component, wherever they are defined
#: (every method the model's own classes define is an entry point too: see :func:`entry_methods`)
COMPONENT_METHODS = ("encode", "decode")
#: component calls remembered for the report (a long video run makes a few thousand)
MAX_RECORDED_CALLS = 100_000


class Runtime:
    def __init__(
        self,
        components: dict[str, nn.Module],
        specs: Iterable[GroupSpec],
        *,
        device: torch.device,
        session: StorageSession | None,
        ledger: Ledger,
        prefetch: bool = False,
        offload_after_call: bool = True,
        relayout: Callable[[str], list[GroupSpec]] | None = None,
        pipeline: object | None = None,
        refuse_edit: Callable[[str, dict[str, nn.Module]], None] | None = None,
    ) -> None:
        self.components = components
        self.device = device
        self.session = session
        self.ledger = ledger
        self.groups = claim_groups(components, list(specs))
        #: component -> its groups (kept in step with ``groups``)
        self._groups_of: dict[str, list[Group]] = {}
        self._index_groups()
        self.active: str | None = None
        self._relayout = relayout
        self._pipeline = pipeline
        self._refuse_edit = refuse_edit
        self._depth: dict[str, int] = {name: 0 for name in components}
        #: calls of each component since apply or ``reset_calls`` (a nested call counts once), in order
        self.calls: list[str] = []
        #: component -> its groups resident now (a dict: ordered, O(1) removal)
        self._resident: dict[str, dict[Group, None]] = {name: {} for name in components}
        self._wrappers: dict[str, list[MethodWrapper]] = {name: [] for name in components}
        self._edit_wrappers: list[MethodWrapper] = []
        self._cuda = device.type == "cuda"
        #: the storage's copies are the device tensors: onload and offload only keep the books
        self._zero_copy = session is not None and session.zero_copy(device)
        self._prefetch = prefetch
        self._offload_after_call = offload_after_call
        #: where prefetches are copied; without CUDA a prefetch is a synchronous early onload
        self._copy_stream = torch.cuda.Stream(device) if prefetch and self._cuda else None
        #: component -> groups in the order of their first onload during the component's first call
        self._recording: dict[str, list[Group]] = {name: [] for name in components} if prefetch else {}
        #: CUDA (start, end) events of copies whose duration is not yet added to the ledger
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        #: components whose modules registered a new parameter, buffer or submodule
        self._dirty: set[str] = set()
        self._member_of: dict[int, str] = {}
        self._editing = 0
        self._generation = 0
        #: on a CPU device a non-finite result of a component whose tensors rest as placeholders is
        #: explained (see :mod:`memmode_core.engine.reads`); on CUDA the same read is a device mismatch
        self._check_results = device.type == "cpu"
        #: components some of whose tensors rest as placeholders (no real value at rest)
        self._placeholdered: set[str] = set()
        #: > 0 while a call runs again under the placeholder trap
        self._diagnosing = 0
        #: serializes calls of this runtime's components, edits, refresh and remove across threads
        self.lock = threading.RLock()

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
                sizes = {g.key: g.nbytes for g in stored}
                missing = {k: n for k, n in sizes.items() if (reserved or {}).get(k) != n}
                if missing:
                    self.session.reserve(missing)
                for group in stored:
                    group.parts = [Part(group.key, tuple(s.name for s in group.slots))]
                    group.at_rest = self.session.put(group.key, group.tensors(), group.readable)
        except BaseException:
            if self.session is not None:
                self.session.close()
            raise
        for group in stored:
            group.rest(group.at_rest)
        for group in self.groups:
            if group.policy is Policy.RESIDENT:
                self._onload_resident(group)
        for name in self.components:
            self._install_hooks(name)
            self._note_placeholders(name)
        self._install_edit_wrappers()
        self._index_members()
        watch.watch(self)

    def remove(self) -> None:
        """Unhook, and leave every weight in ordinary CPU memory.

        Every group that can be restored is, whatever happens to the others; a group whose stored
        copy is lost (a deleted or damaged file) is left holding placeholders — never a mapping of
        a broken file — and one :class:`RestoreError` names all of them once everything else is
        undone (hooks off, storage closed).
        """
        with self.lock:
            self._remove()

    def _remove(self) -> None:
        watch.unwatch(self)
        for wrapper in self._edit_wrappers:
            wrapper.remove()
        self._edit_wrappers.clear()
        for wrappers in self._wrappers.values():
            for wrapper in wrappers:
                wrapper.remove()
            wrappers.clear()
        if self._cuda:
            torch.cuda.synchronize(self.device)
        failed: dict[str, str] = {}
        for group in self.groups:
            try:
                if group.policy is Policy.RESIDENT:
                    group.assign({n: t.to("cpu") for n, t in group.tensors().items()})
                else:
                    restored = self._restore(group)
                    restored.update(self._replaced_since(group, restored))
                    group.assign(restored)
                    self._restore_replacements(group, restored)
            except Exception as exc:  # noqa: BLE001 - every failure is reported, after the other groups
                failed[group.key] = str(exc) or type(exc).__name__
                group.assign({s.name: placeholder(s.tensor.data) for s in group.slots})
            finally:
                group.at_rest = {}  # the storage's copies (a file mapping, pinned memory) go with the session
                if group.resident:
                    group.resident = False
                    group.ready_event = None
                    self.ledger.offloaded(group.nbytes, 0.0)
        for resident in self._resident.values():
            resident.clear()
        if self.session is not None:
            self.session.close()
        if failed:
            raise RestoreError(failed)

    def _replaced_since(self, group: Group, restored: Tensors) -> Tensors:
        """Slots whose data was replaced since it was stored (``param.data = x``, a cast by ``module.to(dtype)``):
        the newest value is what ``remove()`` gives back. One computed from the at-rest placeholder (all NaN:
        the cast of a placeholder) is the stored value put through the same cast."""
        newest: Tensors = {}
        for slot in group.slots:
            expected = slot.live_ptr if (group.resident and not self._zero_copy) else slot.rest_ptr
            current = slot.tensor.data
            if current.data_ptr() == expected or slot.name not in restored:
                continue
            if _computed_from_placeholder(current, group.at_rest.get(slot.name)):
                newest[slot.name] = restored[slot.name].to(dtype=current.dtype)
            else:
                newest[slot.name] = current if current.device.type == "cpu" else current.to("cpu")
        return newest

    def _restore_replacements(self, group: Group, restored: Tensors) -> None:
        """Tensors registered since the last rebuild in place of this group's ones (a component's ``to()``
        or ``_apply`` making new parameters) go back to ordinary CPU memory too, and one computed from
        the at-rest placeholder (all NaN) gets the stored value, in its own dtype: nothing computed from
        a placeholder outlives ``remove()``."""
        for slot in group.slots:
            if slot.registered():
                continue
            registry = slot.owner._buffers if slot.is_buffer else slot.owner._parameters
            now = registry.get(slot.attr)
            if now is None or slot.name not in restored:
                continue
            if _computed_from_placeholder(now, group.at_rest.get(slot.name)):
                now.data = restored[slot.name].to(dtype=now.dtype)
            elif now.device.type not in ("cpu", "meta"):  # meta: another library's (accelerate's) to give back
                now.data = now.data.to("cpu")

    # -- moving -------------------------------------------------------------------------------------

    def _onload_resident(self, group: Group) -> None:
        start = clock()
        group.assign({n: t.to(self.device) for n, t in group.tensors().items()})
        group.resident = True
        self.ledger.onloaded(group.nbytes, clock() - start)

    def real_values(self, component: str) -> dict[int, torch.Tensor]:
        """``id(registered tensor) -> its real value on the CPU`` for every tensor of ``component`` whose
        registered value is not its real one right now (offloaded: a placeholder or a storage's view).

        For reading a placed model's weights without removing the mode (saving it). Nothing is moved.
        """
        with self.lock:
            found: dict[int, torch.Tensor] = {}
            for group in self._groups_of.get(component, []):
                if group.policy is Policy.RESIDENT or group.resident:
                    continue
                values = self._restore(group)
                for slot in group.slots:
                    if slot.name in values:
                        found[id(slot.tensor)] = values[slot.name]
            return found

    def _restore(self, group: Group) -> Tensors:
        tensors: Tensors = {}
        for part in group.parts:
            self.session.check(part.key)
            tensors.update(part.translate(self.session.restore(part.key)))
        return tensors

    @_not_traced
    def ensure(self, group: Group) -> None:
        """Make ``group`` usable by the compute stream: onload it, or wait for its prefetch."""
        if group.resident:
            event = group.ready_event
            if event is not None:
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(event)
                for slot in group.slots:
                    slot.tensor.data.record_stream(stream)
                group.ready_event = None
        else:
            if group.component != self.active:
                self._switch_to(group.component)
            self._fetch(group, None)
        if self._recording and group.component in self._recording:
            self._record(group)
        nxt = group.next
        if nxt is not None and not nxt.resident:
            self._fetch(nxt, self._copy_stream)

    def _fetch(self, group: Group, stream: torch.cuda.Stream | None) -> None:
        for part in group.parts:  # a broken file is a typed error here, never wrong bytes or a SIGBUS
            self.session.check(part.key)
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                start.record()
                tensors = self._fetch_parts(group, stream)
                end.record()
            self._timings.append((start, end))
            group.ready_event = end if stream is not None else None
            seconds = 0.0
        elif self._zero_copy:
            tensors, seconds = None, 0.0
        else:
            began = clock()
            tensors = self._fetch_parts(group, None)
            seconds = clock() - began
        if tensors is not None:
            group.onload(tensors)
        group.resident = True
        self._resident[group.component][group] = None
        self.ledger.onloaded(group.nbytes, seconds)

    def _fetch_parts(self, group: Group, stream) -> Tensors:
        parts = group.parts
        if len(parts) == 1 and not parts[0].rename:
            return self.session.fetch(parts[0].key, self.device, stream)
        tensors: Tensors = {}
        for part in parts:
            tensors.update(part.translate(self.session.fetch(part.key, self.device, stream)))
        return tensors

    @_not_traced
    def offload(self, group: Group) -> None:
        if self._zero_copy:
            seconds = 0.0
        else:
            start = clock()
            replaced = group.offload_at_rest()
            seconds = clock() - start
            if replaced:  # kept, in ordinary memory; the component's next call stores them (see changed())
                for slot in replaced:
                    if slot.tensor.device.type != "cpu":
                        slot.tensor.data = slot.tensor.data.to("cpu")
                self._dirty.add(group.component)
        group.resident = False
        group.ready_event = None
        del self._resident[group.component][group]
        self.ledger.offloaded(group.nbytes, seconds)

    def _switch_to(self, component: str) -> None:
        """Another component needs the device: offload what idle components left resident."""
        for name, resident in self._resident.items():
            if name != component and resident and self._depth[name] == 0:
                for group in list(resident):
                    self.offload(group)
        self.active = component

    def end_call(self) -> None:
        """A pipeline call returned (see :mod:`~memmode_core.engine.pipeline_hooks`): offload what it left on
        the device, as diffusers frees its models then — unless the placement keeps it (``keep_last_on_device``)."""
        if not self._offload_after_call:
            return
        with self.lock:
            if any(self._depth.values()):
                return  # called from inside a component's call: not the end of the pipeline's
            for name in self.components:
                self._offload_component(name)
            self.active = None

    def _offload_component(self, component: str) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)  # prefetches in flight land before their groups leave
        for group in list(self._resident[component]):
            self.offload(group)

    def settle(self) -> None:
        """Add the measured duration of finished asynchronous copies to the ledger."""
        if not self._timings:
            return
        pending = []
        for start, end in self._timings:
            if end.query():
                self.ledger.seconds += start.elapsed_time(end) / 1000.0
            else:
                pending.append((start, end))
        self._timings = pending

    # -- execution order (prefetch) ------------------------------------------------------------------

    def _record(self, group: Group) -> None:
        order = self._recording[group.component]
        if group not in order:
            order.append(group)

    def _finish_recording(self, component: str) -> None:
        """After a component's first call: link each group to the next prefetchable one."""
        order = self._recording.pop(component, None)
        if not order:
            return
        following: Group | None = None
        for group in reversed(order):
            group.next = following
            if group.prefetchable and group.policy is Policy.STREAM:
                following = group

    # -- noticing changes ----------------------------------------------------------------------------

    def _index_groups(self) -> None:
        self._groups_of = {name: [g for g in self.groups if g.component == name] for name in self.components}

    def _index_members(self) -> None:
        self._member_of = {id(m): name for name, root in self.components.items() for m in root.modules()}

    def note_registration(self, module: nn.Module, name: str | None = None, value: object = None) -> None:
        """Called for every parameter, buffer or submodule registration in the process (see watch).

        A tensor computed from the placeholder it replaces (all NaN, where ``name`` holds an offloaded
        placeholder now) is refused before it is registered: it would become the weight for good.
        """
        component = self._member_of.get(id(module))
        if component is None or self._editing:
            return
        if isinstance(value, torch.Tensor) and name is not None:
            current = module._parameters.get(name) if name in module._parameters else module._buffers.get(name)
            if (
                current is not None
                and is_placeholder(current)
                and value.shape == current.shape
                and _derived_from_placeholder(value, current)
            ):
                where = self._path_of(module, component)
                raise OffloadedWeightReadError(
                    f"{where}.{name}: the new value was computed from its offloaded placeholder (it is all NaN), "
                    f"not from the weight; refused before anything changed. Code that rebuilds a component's "
                    f"parameters from their values (a to() override, nn.Parameter(self.x.to(...))) must run "
                    f"inside one of the component's methods, which memmode onloads it for"
                )
        self._dirty.add(component)

    def _path_of(self, module: nn.Module, component: str | None = None) -> str:
        """``component.path.to.module``, searched in ``component`` or in every component."""
        for name in [component] if component is not None else self.components:
            for path, sub in self.components[name].named_modules():
                if sub is module:
                    return f"{name}.{path}" if path else name
        return f"{component}.<{type(module).__name__}>" if component is not None else type(module).__name__

    def _note_placeholders(self, component: str) -> None:
        """Remember whether ``component`` has tensors resting as placeholders (what its results are checked for)."""
        if any(is_placeholder(t) for g in self._groups_of.get(component, ()) for t in g.at_rest.values()):
            self._placeholdered.add(component)
        else:
            self._placeholdered.discard(component)

    def placeholder_name(self, tensor: torch.Tensor) -> str | None:
        """``"<slot name> (group <key>)"`` if ``tensor`` holds the at-rest placeholder of one of this runtime's
        slots."""
        pointer = tensor.data_ptr()
        for group in self.groups:
            for slot in group.slots:
                rest = group.at_rest.get(slot.name)
                if rest is not None and rest.data_ptr() == pointer and is_placeholder(rest):
                    qualified = slot.name if len(self.components) > 1 else f"{group.component}.{slot.name}"
                    return f"{qualified} (group {group.key})"
        return None

    def explain_non_finite(self, component: str, module: nn.Module, method: str, args, kwargs) -> None:
        """A call of ``component`` returned NaN or infinity while some of its tensors rest as placeholders:
        run it again under the :class:`PlaceholderTrap`, which raises naming the placeholder if one was
        read. If none was, the model itself produced the values, and the caller returns them unchanged."""
        where = f"{self._path_of(module, component)}.{method}"
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

    @_not_traced
    def changed(self, component: str) -> bool:
        """Whether ``component``'s tensors are no longer the ones its groups were built from.

        Runs at each call of the component: a registration was reported, or a tracked tensor is no
        longer registered where it was, or an offloaded one no longer holds its at-rest data, or a
        hook was wrapped around one of the engine's (diffusers' ``enable_layerwise_casting`` after
        ``apply``): the rebuild then installs the engine's wrappers outside it, so weights are
        onloaded before that hook sees them and offloaded after it is done with them.
        """
        if component in self._dirty:
            return True
        for wrapper in self._wrappers[component]:
            if not wrapper.on_top():  # a hook installed after apply wraps ours: rebuild puts ours outside it
                return True
        for group in self._groups_of[component]:
            check_data = not group.resident and group.policy is not Policy.RESIDENT and not self._zero_copy
            for slot in group.slots:
                if not slot.registered() or (check_data and slot.tensor.data_ptr() != slot.rest_ptr):
                    return True
        return False

    @contextlib.contextmanager
    def editing(self, components: list[str], method: str):
        """Around a method that edits weights: offload first (and give writing methods real values),
        rebuild the groups after."""
        outermost = self._editing == 0
        if outermost:
            if self._refuse_edit is not None:
                self._refuse_edit(method, {name: self.components[name] for name in components})
            for name in components:
                self._offload_component(name)
                if method in watch.WRITES_WEIGHTS:
                    self._materialize(name)
        self._editing += 1
        try:
            yield
        finally:
            self._editing -= 1
            if outermost:
                self._dirty.difference_update(components)
                for name in components:
                    self.rebuild(name)

    def _materialize(self, component: str) -> None:
        """Give every offloaded tensor of ``component`` whose at-rest value is a placeholder its real
        value, so that a method writing into the weights writes into real memory."""
        for group in self._groups_of[component]:
            if group.policy is Policy.RESIDENT:
                continue
            if any(is_placeholder(t) for t in group.at_rest.values()):
                group.assign(self._restore(group))

    def refresh(self) -> None:
        """Take every weight from the model as it is now (for edits memmode cannot notice).

        A group resident on the device right now may have been edited there: its device copy is
        what is taken, not the stored one.
        """
        with self.lock:
            self._refresh()

    def _refresh(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)
        for name in self.components:
            for group in list(self._resident[name]):
                group.assign({n: t.to("cpu") for n, t in group.tensors().items()})
                group.resident = False
                group.ready_event = None
                del self._resident[name][group]
                self.ledger.offloaded(group.nbytes, 0.0)
            self.rebuild(name, keep_parts=False)

    @_not_traced
    def rebuild(self, component: str, *, keep_parts: bool = True) -> None:
        """Lay ``component`` out again and store what changed; keep the parts that did not change."""
        if self._relayout is None:
            raise RuntimeError("this runtime cannot rebuild: it was built without a layout function")
        # another offloading scheme installed since apply would fight memmode over the weights; refuse
        # before anything moves (remove() still gives every weight back from the storage)
        refuse_foreign_offloading({component: self.components[component]})
        self._offload_component(component)
        retired = list(self._wrappers[component])
        for wrapper in retired:
            wrapper.remove()
        self._wrappers[component].clear()
        old = self._groups_of[component]
        new = claim_groups(self.components, self._relayout(component), names=self.components)
        previous = {id(slot.tensor): (group, slot) for group in old for slot in group.slots}
        # a tensor registered where an old one was (``_apply`` or a ``to()`` override making new parameters)
        previous.update({slot.place(): (group, slot) for group in old for slot in group.slots})
        kept: set[str] = set()
        for group in new:
            if group.policy is Policy.RESIDENT:
                self._onload_resident(group)
            else:
                kept.update(self._store_rebuilt(group, previous, keep_parts))
        for group in old:
            if group.resident:  # a resident group (full load) is not offloaded: its bytes leave now
                self.ledger.offloaded(group.nbytes, 0.0)
            for part in group.parts:
                if part.key not in kept:
                    self.session.discard(part.key)
        self.groups = [g for g in self.groups if g.component != component] + new
        self._index_groups()
        self._resident[component].clear()  # resident groups were offloaded above; RESIDENT ones are not tracked
        if self._prefetch:
            self._recording[component] = []
        self._install_hooks(component)
        successors = {(id(w.module), w.method): w for w in self._wrappers[component]}
        for wrapper in retired:  # a caller holding a retired wrapper (bound before the rebuild) reaches the new one,
            successor = successors.get((id(wrapper.module), wrapper.method))  # unless a hook installed since
            if successor is not None and successor.original == wrapper.original:  # calls the retired one itself
                wrapper.successor = successor
        self._note_placeholders(component)
        self._index_members()
        self._dirty.discard(component)

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
            self.session.reserve({key: sum(v.numel() * v.element_size() for v in values.values())})
            at_rest.update(self.session.put(key, values, readable))
            parts.append(Part(key, tuple(values)))
        group.parts = parts
        group.rest(at_rest)
        return {p.key for p in parts}

    def _real_value(self, group: Group, slot: Slot, current: torch.Tensor) -> torch.Tensor:
        """What an offloaded tensor really holds now, for storing it again.

        Its at-rest placeholder, still in place: the stored value. A tensor computed *from* the
        placeholder while the weight was offloaded — ``module.to(dtype)`` by a hook installed after
        ``apply`` turns the one-element NaN into a full NaN tensor — is the stored value put through
        the same cast; storing it would lose the weights. Anything else is a real new value.
        """
        if is_placeholder(current) or _computed_from_placeholder(current, group.at_rest.get(slot.name)):
            return self._restore_one(group, slot.name).to(current.dtype)
        return current

    def _restore_one(self, group: Group, name: str) -> torch.Tensor:
        for part in group.parts:
            tensors = part.translate(self.session.restore(part.key))
            if name in tensors:
                return tensors[name]
        raise KeyError(name)

    # -- hooks --------------------------------------------------------------------------------------

    def _install_hooks(self, component: str) -> None:
        """One forward wrapper per module that enters or exits a group of ``component`` or is its root."""
        plans: dict[int, tuple[nn.Module, list[Group], list[Group], str | None]] = {}

        def plan(module: nn.Module):
            return plans.setdefault(id(module), (module, [], [], None))

        for group in self._groups_of[component]:
            if group.policy is Policy.RESIDENT:
                continue
            for module in group.entries:
                plan(module)[1].append(group)
            if group.policy is Policy.STREAM:
                for module in group.exits:
                    plan(module)[2].append(group)
        root = self.components[component]
        entry = plan(root)
        # a component's own exit is its leave step: it offloads whatever the component left resident
        plans[id(root)] = (root, entry[1], [], component)
        wrappers = self._wrappers[component]
        for module, enters, exits, root_of in plans.values():
            wrappers.append(MethodWrapper(module, self._forward_maker(module, "forward", enters, exits, root_of)))
            if root_of is not None:
                # a component's other entry points: a VAE's decode() never calls its forward(), a prior's
                # post_process_latents() reads the prior's statistics (see entry_methods)
                for method in entry_methods(module):
                    wrappers.append(
                        MethodWrapper(module, self._method_maker(module, method, enters, root_of), method, eager=False)
                    )

    def _method_maker(self, module: nn.Module, method: str, enters: list[Group], component: str):
        """A component's entry method other than ``forward``: called from outside the component it enters
        it as the forward does; called from inside (the component is entered) it is the method itself,
        traceable by torch.compile without a graph break."""
        depth = self._depth
        root_path = self._forward_maker(module, method, enters, [], component)

        def make(original, wrapper: MethodWrapper):
            enter = torch.compiler.disable(root_path(original, wrapper), recursive=False)

            def entry(*args, **kwargs):
                if not wrapper.active:
                    return wrapper.passthrough()(*args, **kwargs)
                if depth[component]:
                    return original(*args, **kwargs)
                return enter(*args, **kwargs)

            return entry

        return make

    def _forward_maker(
        self, module: nn.Module, method: str, enters: list[Group], exits: list[Group], component: str | None
    ):
        ensure, offload, leave = self.ensure, self.offload, self._leave
        depth, calls = self._depth, self.calls
        move = self.device.type != "cpu"  # on a CPU device every input already is where it computes
        device = self.device
        runtime = self
        lock = self.lock

        def make(original, wrapper: MethodWrapper):
            if component is None and len(enters) == 1 and exits == enters:
                (group,) = enters  # the common case (a leaf or a single block): one group in and out

                def forward(*args, **kwargs):
                    if not wrapper.active:
                        return wrapper.passthrough()(*args, **kwargs)
                    if not group.resident or group.ready_event is not None:
                        ensure(group)
                    if move and (moved := move_inputs(args, kwargs, device)) is not None:
                        args, kwargs = moved
                    try:
                        return original(*args, **kwargs)
                    except RuntimeError as exc:
                        if is_device_mismatch(exc):
                            raise runtime.offloaded_read(module, exc) from exc
                        raise
                    finally:
                        if group.resident and group.ready_event is None:
                            offload(group)

                return forward

            def step(args, kwargs):
                try:
                    for group in enters:
                        if not group.resident or group.ready_event is not None:
                            ensure(group)
                    if move and (moved := move_inputs(args, kwargs, device)) is not None:
                        args, kwargs = moved
                    return original(*args, **kwargs)
                except RuntimeError as exc:
                    if is_device_mismatch(exc):
                        raise runtime.offloaded_read(module, exc) from exc
                    raise
                finally:
                    for group in exits:
                        if group.resident and group.ready_event is None:
                            offload(group)

            if component is None:

                def forward(*args, **kwargs):
                    if not wrapper.active:
                        return wrapper.passthrough()(*args, **kwargs)
                    return step(args, kwargs)

                return forward

            def forward(*args, **kwargs):
                if not wrapper.active:
                    return wrapper.passthrough()(*args, **kwargs)
                with lock:  # one call of this handle's components at a time (see the module docstring)
                    if depth[component] == 0 and not runtime._editing and runtime.changed(component):
                        runtime.rebuild(component)
                        return getattr(module, method)(*args, **kwargs)  # through the rebuilt wrappers
                    depth[component] += 1
                    if depth[component] == 1 and len(calls) < MAX_RECORDED_CALLS:
                        calls.append(component)
                    try:
                        result = step(args, kwargs)
                    finally:
                        leave(component)
                    if (
                        runtime._check_results
                        and not depth[component]
                        and not runtime._diagnosing
                        and component in runtime._placeholdered
                        and non_finite(result)
                    ):
                        runtime.explain_non_finite(component, module, method, args, kwargs)
                    return result

            return forward

        return make

    @_not_traced
    def _leave(self, component: str) -> None:
        """A component's forward returned: offload what it left resident, once it is no longer nested."""
        self._depth[component] -= 1
        if self._depth[component]:
            return
        for group in list(self._resident[component]):
            if group.policy is Policy.STREAM:
                self.offload(group)
        if component in self._recording:
            self._finish_recording(component)
        if self._timings:
            self.settle()

    def offloaded_read(self, module: nn.Module, error: RuntimeError) -> OffloadedWeightReadError:
        """The clear error for a forward that computed with a weight left on the offload side (on
        CUDA the at-rest copies are CPU tensors, so torch reports a device mismatch)."""
        where = self._path_of(module)
        component = where.split(".", 1)[0]
        offloaded = [
            g.key for g in self._groups_of.get(component, ()) if not g.resident and g.policy is not Policy.RESIDENT
        ]
        shown = ", ".join(offloaded[:6]) + (f" and {len(offloaded) - 6} more" if len(offloaded) > 6 else "")
        return OffloadedWeightReadError(
            f"{where} ({type(module).__name__}) computed with a tensor that is not on {self.device}: the model reads "
            f"a weight outside the forward of the module that owns it, and memmode had that weight offloaded "
            f"(groups offloaded at that moment: {shown or 'none'}). Move this component whole (model_cpu_offload) "
            f"or leave it out with exclude_components=[{component!r}]. Original error: {error}"
        )

    def _install_edit_wrappers(self) -> None:
        """Wrap the weight-editing methods of the pipeline (all components) and of each component."""
        owners: list[tuple[object, list[str]]] = [(m, [n]) for n, m in self.components.items()]
        if self._pipeline is not None:
            owners.insert(0, (self._pipeline, list(self.components)))
        for owner, names in owners:
            for method in watch.EDIT_METHODS:
                if callable(getattr(type(owner), method, None)):
                    self._edit_wrappers.append(MethodWrapper(owner, self._edit_maker(names, method), method))

    def _edit_maker(self, components: list[str], method: str):
        def make(original, wrapper: MethodWrapper):
            def edit(*args, **kwargs):
                if not wrapper.active:
                    return wrapper.passthrough()(*args, **kwargs)
                with self.lock, self.editing(components, method):
                    return original(*args, **kwargs)

            return edit

        return make


def entry_methods(module: nn.Module) -> list[str]:
    """The methods of a component, besides ``forward``, that enter it: ``encode``/``decode`` and every
    plain method its own model classes define.

    A pipeline calls more of a component than its forward: a prior's ``post_process_latents`` reads
    the prior's ``clip_mean``/``clip_std``, an image normalizer's ``scale``/``unscale`` and its ``to()``
    override read ``mean``/``std``, a renderer's ``decode_to_image`` runs its layers. Any of them may
    read the component's weights, and which do cannot be known in advance, so the rule is general:
    a method defined by the model's own classes — those in its MRO before the framework's bases
    (``torch.nn.Module``, diffusers' ``ModelMixin``, transformers' ``PreTrainedModel``), whose methods
    are machinery (saving, hooks, configuration), not model code — enters the component when called
    from outside it, exactly as its forward does. A call from inside (the forward calling a helper)
    passes straight through. The weight-editing methods keep their own wrappers (``watch``).
    """
    names: list[str] = [m for m in COMPONENT_METHODS if callable(getattr(type(module), m, None))]
    for cls in type(module).__mro__:
        if cls is nn.Module or _is_framework_base(cls):
            break
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            continue
        for name, value in vars(cls).items():
            if (
                inspect.isfunction(value)
                and not name.startswith("__")
                and name != "forward"
                and name not in names
                and name not in watch.EDIT_METHODS
            ):
                names.append(name)
    return names


#: modules defining the framework base classes whose methods are not model code (see entry_methods)
_FRAMEWORK_MODULES = ("diffusers.models.modeling_utils", "transformers.modeling_utils")


def _is_framework_base(cls: type) -> bool:
    module = getattr(cls, "__module__", "") or ""
    return module in _FRAMEWORK_MODULES or module == "torch" or module.startswith("torch.")


#: what torch says when one operation gets tensors on two devices
_DEVICE_MISMATCH = ("Expected all tensors to be on the same device", "found at least two devices")


def is_device_mismatch(error: BaseException) -> bool:
    message = str(error)
    return any(text in message for text in _DEVICE_MISMATCH)


def _computed_from_placeholder(current: torch.Tensor, at_rest: torch.Tensor | None) -> bool:
    """Whether ``current`` holds nothing but what the at-rest placeholder ``at_rest`` gives: that placeholder
    (or a view of it), or a tensor computed from it (a cast). What stands in for it is the stored value."""
    return (
        at_rest is not None
        and is_placeholder(at_rest)
        and current.shape == at_rest.shape
        and (is_placeholder(current) or _derived_from_placeholder(current, at_rest))
    )


def _derived_from_placeholder(current: torch.Tensor, at_rest: torch.Tensor) -> bool:
    """Whether ``current`` holds nothing but the placeholder's fill (NaN for floats): a value
    computed from the placeholder. Real weights are never entirely NaN."""
    if (
        not (current.dtype.is_floating_point and at_rest.dtype.is_floating_point)
        or current.numel() == 0
        or current.is_meta
    ):
        return False
    return bool(torch.isnan(current).all())
