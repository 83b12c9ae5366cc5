"""The forward wrappers: where the engine hooks a placed component, and what a hooked call does besides a rebuild.

The :class:`Forwards` part of the :class:`~memmode_core.engine.runtime.Runtime` (it needs the runtime's
:class:`~memmode_core.engine.state.EngineState` and its three other parts: it calls
:class:`~memmode_core.engine.moving.Moving` around forwards and :class:`~memmode_core.engine.serving.Serving` when a
call ends, and hands :class:`~memmode_core.engine.changes.Changes` to the hooks) installs, for each component, one
hook (:mod:`~memmode_core.engine.component_hooks`) per module that enters or exits one of its groups, one on its
root and on each of its other entry points (:func:`entry_methods`), and one on each weight-editing method of the
pipeline and the components (see :mod:`~memmode_core.engine.hooks` for what every hook guarantees). It owns those
hooks: it puts them on and takes them off (:meth:`Forwards.install_hooks`, :meth:`Forwards.remove_hooks`), and
records the components' calls (``calls``). The hooks call back: a call's end offloads what is left and applies
what was learned of its readers (:meth:`Forwards.leave`); whether a component is rebuilt before its call, and
what an edit does, is the one owner's of rebuilds and edits, :class:`~memmode_core.engine.changes.Changes`
(:meth:`~memmode_core.engine.changes.Changes.rebuild_if_changed`,
:meth:`~memmode_core.engine.changes.Changes.editing`), which takes these hooks off and puts them back through
this part.

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

from torch import nn

from memmode_core.contracts.errors import OffloadedWeightReadError
from memmode_core.contracts.group_specs import Policy
from memmode_core.engine import watch
from memmode_core.engine.changes import Changes
from memmode_core.engine.component_hooks import (
    ComponentEntryHook,
    EntryMethodHook,
    GroupHook,
    GroupsHook,
    WeightEditHook,
)
from memmode_core.engine.groups import Group, module_path
from memmode_core.engine.hooks import MethodWrapper, not_traced
from memmode_core.engine.moving import Moving
from memmode_core.engine.serving import Serving
from memmode_core.engine.state import EngineState

#: methods besides ``forward`` through which a pipeline calls a component, wherever they are defined
#: (every method the model's own classes define is an entry point too: see :func:`entry_methods`)
COMPONENT_METHODS = ("encode", "decode")


class Forwards:
    """Installing and removing the hooks of each component of ``state``, and of the weight-editing methods (of
    the components, and of ``pipeline`` if there is one); and what those hooks do beyond moving groups (through
    ``moving``) and beyond rebuilds and edits (``changes``, handed to them): counting calls, learning the readers
    of resting groups at the end of a call (``serving``)."""

    def __init__(
        self,
        state: EngineState,
        moving: Moving,
        serving: Serving,
        changes: Changes,
        *,
        pipeline: object | None = None,
    ) -> None:
        self.state = state
        self.moving = moving
        self.serving = serving
        self.changes = changes
        self._pipeline = pipeline
        #: component -> the hooks on its modules (forwards and other entry methods)
        self.wrappers: dict[str, list[GroupsHook]] = {name: [] for name in state.components}
        #: calls of each component since apply or ``Runtime.reset_calls`` (a nested call counts once), in order;
        #: appended by the component entry hooks
        self.calls: list[str] = []
        #: the hooks on the weight-editing methods of the pipeline and the components
        self.edit_wrappers: list[WeightEditHook] = []

    # -- a component's call ------------------------------------------------------------------------------

    @not_traced
    def leave(self, component: str) -> None:
        """A component's forward returned (:meth:`Moving.leave`); once no call runs, the modules that read resting
        groups during it enter them from now on (:meth:`relearn`)."""
        learned = self.serving.learned
        if self.moving.leave(component) and learned:
            depth = self.moving.depth
            for name in [n for n in learned if not depth[n]]:
                self.relearn(name)

    def relearn(self, component: str) -> None:
        """Apply what :class:`Serving` learned of ``component``'s readers, and hook the modules again."""
        if self.serving.apply_learned(component):
            retired = self.remove_hooks(component)
            self.install_hooks(component, retired)

    # -- the hooks ----------------------------------------------------------------------------------------

    def install_hooks(self, component: str, retired: Iterable[MethodWrapper] = ()) -> None:
        """One forward wrapper per module that enters or exits a group of ``component`` or is its root.

        ``retired``: the hooks a rebuild took off; a caller holding one (a method bound before the rebuild)
        reaches its successor.
        """
        plans: dict[int, tuple[nn.Module, list[Group], list[Group], str | None]] = {}

        def plan(module: nn.Module):
            return plans.setdefault(id(module), (module, [], [], None))

        for group in self.state.groups_of[component]:
            if group.policy is Policy.RESIDENT:
                continue
            for module in group.entries:
                plan(module)[1].append(group)
            if group.policy is Policy.STREAM:
                for module in group.exits:
                    plan(module)[2].append(group)
        root = self.state.components[component]
        entry = plan(root)
        # a component's own exit is its leave step: it offloads whatever the component left resident
        plans[id(root)] = (root, entry[1], [], component)
        wrappers = self.wrappers[component]
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

    def remove_hooks(self, component: str) -> list[GroupsHook]:
        """Take ``component``'s hooks off; returns them (retired)."""
        retired = list(self.wrappers[component])
        for wrapper in retired:
            wrapper.remove()
        self.wrappers[component].clear()
        return retired

    def wrapped_over(self, component: str) -> bool:
        """Whether a hook was installed around one of ``component``'s since (diffusers' layerwise casting)."""
        return any(not wrapper.on_top() for wrapper in self.wrappers[component])

    def install_edit_wrappers(self) -> None:
        """Wrap the weight-editing methods of the pipeline (all components) and of each component."""
        components = self.state.components
        owners: list[tuple[object, list[str]]] = [(m, [n]) for n, m in components.items()]
        if self._pipeline is not None:
            owners.insert(0, (self._pipeline, list(components)))
        for owner, names in owners:
            for method in watch.EDIT_METHODS:
                if callable(getattr(type(owner), method, None)):
                    self.edit_wrappers.append(WeightEditHook(self, owner, method, names).install())

    def remove_all_hooks(self) -> None:
        for wrapper in self.edit_wrappers:
            wrapper.remove()
        self.edit_wrappers.clear()
        for component in self.wrappers:
            self.remove_hooks(component)

    def offloaded_read(self, module: nn.Module, error: RuntimeError) -> OffloadedWeightReadError:
        """The clear error for a forward that computed with a weight left on the offload side (on
        CUDA the at-rest copies are CPU tensors, so torch reports a device mismatch)."""
        where = module_path(self.state.components, module)
        component = where.split(".", 1)[0]
        offloaded = [
            g.key for g in self.state.groups_of.get(component, ()) if not g.resident and g.policy is not Policy.RESIDENT
        ]
        shown = ", ".join(offloaded[:6]) + (f" and {len(offloaded) - 6} more" if len(offloaded) > 6 else "")
        return OffloadedWeightReadError(
            f"{where} ({type(module).__name__}) computed with a tensor that is not on {self.state.device}: the model "
            f"reads a weight outside the forward of the module that owns it, and memmode had that weight offloaded "
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
