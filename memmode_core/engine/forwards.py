"""The forward wrappers: the hooks that onload a placed module's groups around its forward.

The :class:`Forwards` part of the :class:`~memmode_core.engine.runtime.Runtime` installs, for each
component, one hook per module that enters or exits one of its groups (see
:mod:`~memmode_core.engine.hooks` for what every hook guarantees):

* ``memmode.groups`` (:class:`GroupHook`, :class:`GroupsHook`) on a module inside a component:
  onload the groups it enters before its forward, offload the streamed groups it exits after;
* ``memmode.component_entry`` (:class:`ComponentEntryHook`) on a component's root: one call of the
  component at a time (the runtime's lock), its groups rebuilt first if its weights changed, the call
  counted, and on return whatever it left on the device offloaded (its own exit is that leave step);
* ``memmode.entry_method:<name>`` (:class:`EntryMethodHook`) on the component's other entry points
  (:func:`entry_methods`): called from outside the component it enters it as the forward does,
  called from inside it is the method itself;
* ``memmode.weight_edit:<name>`` (:class:`WeightEditHook`) on the weight-editing methods of the
  pipeline and the components: offload before, rebuild after (see :meth:`Changes.editing`).

Threads: calls of one runtime's components, the edit methods it wraps, ``refresh`` and ``remove``
hold one re-entrant lock, so two threads calling one placed pipeline run one call at a time and
never see each other's half-done onloads (the group bookkeeping is not thread-safe by itself).

A forward that computed with a weight left on the offload side (read outside the forward of the
module that owns it) fails on CUDA with a device mismatch, which the hooks turn into
:class:`OffloadedWeightReadError` (:meth:`Forwards.offloaded_read`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from torch import nn

from memmode_core.contracts.errors import OffloadedWeightReadError
from memmode_core.contracts.layout import Policy
from memmode_core.engine import watch
from memmode_core.engine.groups import Group, module_path
from memmode_core.engine.hooks import MethodWrapper
from memmode_core.engine.inputs import move_inputs
from memmode_core.engine.reads import non_finite

#: methods besides ``forward`` through which a pipeline calls a component, wherever they are defined
#: (every method the model's own classes define is an entry point too: see :func:`entry_methods`)
COMPONENT_METHODS = ("encode", "decode")
#: component calls remembered for the report (a long video run makes a few thousand)
MAX_RECORDED_CALLS = 100_000


def _keys(groups: Iterable[Group], shown: int = 4) -> str:
    keys = [group.key for group in groups]
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return (", ".join(keys[:shown]) + more) or "nothing"


class GroupsHook(MethodWrapper):
    """``memmode.groups``: onload the groups ``owner`` enters before its forward, offload those it exits after
    (the streamed ones: a resident group stays)."""

    kind = "memmode.groups"
    default_method = "forward"
    __slots__ = ("runtime", "enters", "exits", "ensure", "offload", "move", "device")

    def __init__(self, runtime, module: nn.Module, enters: list[Group], exits: list[Group], method: str = "forward"):
        super().__init__(module, method)
        self.runtime = runtime
        self.enters = enters
        self.exits = exits
        self.ensure = runtime.ensure
        self.offload = runtime.offload
        self.move = runtime.device.type != "cpu"  # on a CPU device every input already is where it computes
        self.device = runtime.device

    def __call__(self, *args, **kwargs):
        if not self.active:
            return self.passthrough()(*args, **kwargs)
        return self._step(args, kwargs)

    def _step(self, args, kwargs):
        try:
            for group in self.enters:
                if group.needs_ensure():
                    self.ensure(group)
            if self.move and (moved := move_inputs(args, kwargs, self.device)) is not None:
                args, kwargs = moved
            return self.original(*args, **kwargs)
        except RuntimeError as exc:
            if is_device_mismatch(exc):
                raise self.runtime.offloaded_read(self.owner, exc) from exc
            raise
        finally:
            for group in self.exits:
                if group.resident and group.ready_event is None:
                    self.offload(group)

    def where(self) -> str:
        return module_path(self.runtime.components, self.owner)

    def describe(self) -> str:
        return f"onloads {_keys(self.enters)} before, offloads {_keys(self.exits)} after"


class GroupHook(GroupsHook):
    """``memmode.groups`` in the common case (a leaf, or a single block): one group, entered and exited by
    ``owner``; one frame, a few attribute reads per call."""

    __slots__ = ("group",)

    def __init__(self, runtime, module: nn.Module, enters: list[Group], exits: list[Group], method: str = "forward"):
        super().__init__(runtime, module, enters, exits, method)
        (self.group,) = enters

    def __call__(self, *args, **kwargs):
        if not self.active:
            return self.passthrough()(*args, **kwargs)
        group = self.group
        if group.needs_ensure():
            self.ensure(group)
        if self.move and (moved := move_inputs(args, kwargs, self.device)) is not None:
            args, kwargs = moved
        try:
            return self.original(*args, **kwargs)
        except RuntimeError as exc:
            if is_device_mismatch(exc):
                raise self.runtime.offloaded_read(self.owner, exc) from exc
            raise
        finally:
            if group.resident and group.ready_event is None:
                self.offload(group)


class ComponentEntryHook(GroupsHook):
    """``memmode.component_entry``, on a component's root: a call of the component (see the module docstring)."""

    kind = "memmode.component_entry"
    __slots__ = ("component", "depth", "calls", "lock", "leave")

    def __init__(self, runtime, module: nn.Module, enters: list[Group], component: str, method: str = "forward"):
        super().__init__(runtime, module, enters, [], method)  # its exit is the leave step
        self.component = component
        self.depth = runtime._depth
        self.calls = runtime.calls
        self.lock = runtime.lock
        self.leave = runtime._leave

    def enter(self, *args, **kwargs):
        if not self.active:
            return self.passthrough()(*args, **kwargs)
        runtime, component, depth = self.runtime, self.component, self.depth
        with self.lock:  # one call of this handle's components at a time (see the module docstring)
            if depth[component] == 0 and not runtime._editing and runtime.changed(component):
                runtime.rebuild(component)
                return getattr(self.owner, self.method)(*args, **kwargs)  # through the rebuilt wrappers
            depth[component] += 1
            if depth[component] == 1 and len(self.calls) < MAX_RECORDED_CALLS:
                self.calls.append(component)
            try:
                result = self._step(args, kwargs)
            finally:
                self.leave(component)
            if (
                runtime._check_results
                and not depth[component]
                and not runtime._diagnosing
                and component in runtime._placeholdered
                and non_finite(result)
            ):
                runtime.explain_non_finite(component, self.owner, self.method, args, kwargs)
            return result

    __call__ = enter

    def where(self) -> str:
        return self.component

    def describe(self) -> str:
        return (
            f"enters component {self.component!r}: rebuilds its groups if its weights changed, onloads "
            f"{_keys(self.enters)}; on return offloads the streamed groups it left on the device"
        )


class EntryMethodHook(ComponentEntryHook):
    """``memmode.entry_method:<name>``: a component's entry method other than ``forward``. Called from outside
    the component it enters it as the forward does; called from inside (the component is entered) it is the
    method itself, traceable by torch.compile without a graph break (so only the entering path is eager)."""

    kind = "memmode.entry_method"
    default_method = None
    eager = False
    __slots__ = ("_enter",)

    def install(self) -> EntryMethodHook:
        self._enter = torch.compiler.disable(self.enter, recursive=False)
        return super().install()

    def __call__(self, *args, **kwargs):
        if not self.active:
            return self.passthrough()(*args, **kwargs)
        if self.depth[self.component]:
            return self.original(*args, **kwargs)
        return self._enter(*args, **kwargs)

    def describe(self) -> str:
        return (
            f"called from outside component {self.component!r}, enters it as its forward does (onloads "
            f"{_keys(self.enters)}); from inside, calls the method itself"
        )


class WeightEditHook(MethodWrapper):
    """``memmode.weight_edit:<name>``, on a method that adds, removes or rewrites weights (``watch.EDIT_METHODS``):
    runs it inside :meth:`Changes.editing` of ``components``."""

    kind = "memmode.weight_edit"
    __slots__ = ("runtime", "components")

    def __init__(self, runtime, owner: object, method: str, components: list[str]):
        super().__init__(owner, method)
        self.runtime = runtime
        self.components = components

    def __call__(self, *args, **kwargs):
        if not self.active:
            return self.passthrough()(*args, **kwargs)
        runtime = self.runtime
        with runtime.lock, runtime.editing(self.components, self.method):
            return self.original(*args, **kwargs)

    def describe(self) -> str:
        its = "its" if len(self.components) == 1 else "their"
        return f"offloads {', '.join(self.components)} before the edit, rebuilds {its} groups after"


class Forwards:
    """Installing and removing the hooks of each component, and of the weight-editing methods; part of the
    runtime (its components, groups, moving and change detection)."""

    def _init_forwards(self, pipeline: object | None) -> None:
        self._pipeline = pipeline
        #: component -> the hooks on its modules (forwards and other entry methods)
        self._wrappers: dict[str, list[GroupsHook]] = {name: [] for name in self.components}
        #: the hooks on the weight-editing methods of the pipeline and the components
        self._edit_wrappers: list[WeightEditHook] = []

    def _install_hooks(self, component: str, retired: Iterable[MethodWrapper] = ()) -> None:
        """One forward wrapper per module that enters or exits a group of ``component`` or is its root.

        ``retired``: the hooks a rebuild took off; a caller holding one (a method bound before the rebuild)
        reaches its successor.
        """
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
            if root_of is None:
                single = len(enters) == 1 and exits == enters
                wrappers.append((GroupHook if single else GroupsHook)(self, module, enters, exits).install())
                continue
            wrappers.append(ComponentEntryHook(self, module, enters, root_of).install())
            # a component's other entry points: a VAE's decode() never calls its forward(), a prior's
            # post_process_latents() reads the prior's statistics (see entry_methods)
            for method in entry_methods(module):
                wrappers.append(EntryMethodHook(self, module, enters, root_of, method).install())
        successors = {(id(w.owner), w.method): w for w in wrappers}
        for wrapper in retired:  # a caller holding a retired wrapper (bound before the rebuild) reaches the new one,
            successor = successors.get((id(wrapper.owner), wrapper.method))  # unless a hook installed since
            if successor is not None and successor.original == wrapper.original:  # calls the retired one itself
                wrapper.successor = successor

    def _remove_hooks(self, component: str) -> list[GroupsHook]:
        """Take ``component``'s hooks off; returns them (retired)."""
        retired = list(self._wrappers[component])
        for wrapper in retired:
            wrapper.remove()
        self._wrappers[component].clear()
        return retired

    def _wrapped_over(self, component: str) -> bool:
        """Whether a hook was installed around one of ``component``'s since (diffusers' layerwise casting)."""
        return any(not wrapper.on_top() for wrapper in self._wrappers[component])

    def _install_edit_wrappers(self) -> None:
        """Wrap the weight-editing methods of the pipeline (all components) and of each component."""
        owners: list[tuple[object, list[str]]] = [(m, [n]) for n, m in self.components.items()]
        if self._pipeline is not None:
            owners.insert(0, (self._pipeline, list(self.components)))
        for owner, names in owners:
            for method in watch.EDIT_METHODS:
                if callable(getattr(type(owner), method, None)):
                    self._edit_wrappers.append(WeightEditHook(self, owner, method, names).install())

    def _remove_all_hooks(self) -> None:
        for wrapper in self._edit_wrappers:
            wrapper.remove()
        self._edit_wrappers.clear()
        for component in self._wrappers:
            self._remove_hooks(component)

    def offloaded_read(self, module: nn.Module, error: RuntimeError) -> OffloadedWeightReadError:
        """The clear error for a forward that computed with a weight left on the offload side (on
        CUDA the at-rest copies are CPU tensors, so torch reports a device mismatch)."""
        where = module_path(self.components, module)
        component = where.split(".", 1)[0]
        offloaded = [
            g.key for g in self._groups_of.get(component, ()) if not g.resident and g.policy is not Policy.RESIDENT
        ]
        shown = ", ".join(offloaded[:6]) + (f" and {len(offloaded) - 6} more" if len(offloaded) > 6 else "")
        return OffloadedWeightReadError(
            f"{where} ({type(module).__name__}) computed with a tensor that is not on {self.device}: the model reads "
            f"a weight outside the forward of the module that owns it, and memmode had that weight offloaded "
            f"(groups offloaded at that moment: {shown or 'none'}). Move this component whole (model_cpu_offload) "
            f"or leave it out with unplaced=[{component!r}]. Original error: {error}"
        )


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
