"""How a diffusers pipeline learns where its components compute.

A pipeline creates its latents and embeddings on ``pipe._execution_device``. When weights rest on
the CPU between calls, ``pipe.device`` would say "cpu"; diffusers then looks for an accelerate-style
hook object at ``component._hf_hook`` with an ``execution_device`` attribute, and calls its
``pre_forward`` before a VAE's ``encode``/``decode``. memmode puts such an object on each component
for as long as a mode is applied, so pipelines compute on the device that was asked for. If
diffusers itself removes it (``pipe.remove_all_hooks()``), the memmode placement is removed with it.

More guards, on the pipeline and its components (:func:`install_guards`):

* diffusers frees every model at the end of a pipeline call: memmode offloads what the call left on
  the device (a ``model_cpu_offload`` placement's last component) when the pipeline's ``__call__``
  returns, unless the placement keeps it. ``__call__`` is looked up on the class (Python calls
  ``type(pipe).__call__``), so the class gets one wrapper, shared by its placed instances and removed
  with the last of them; an instance memmode does not place calls straight through. (diffusers' own
  ``maybe_free_model_hooks`` is not the end: AudioLDM 2 runs its vocoder after it.) Each placed pipeline's
  registration with that wrapper is its ``memmode.call_end`` hook (:class:`CallEndGuard`).
* diffusers' own offloading (``enable_model_cpu_offload``, ``enable_sequential_cpu_offload``,
  ``enable_group_offload``, on the pipeline or a component) would fight memmode over the weights: it is
  refused at that call with :class:`IncompatibleModeError`, before anything changes: one
  ``memmode.offloading_guard:<method>`` hook (:class:`OffloadingGuard`) per such method;
* ``save_pretrained`` of quantized layers is refused before anything is written (:class:`SaveGuard`):
  ``memmode.save_quantized`` writes them.

The guards are named hooks (:mod:`~memmode_core.engine.hooks`): ``hooks_of(pipe)`` lists them. One runtime's shim
and guards are one :class:`PipelineHooks`, which the runtime installs (:meth:`Runtime.attach
<memmode_core.engine.runtime.Runtime.attach>`) and removes with every other hook of its own.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memmode_core.contracts.errors import IncompatibleModeError
from memmode_core.engine.hooks import Hook, MethodWrapper

ATTRIBUTE = "_hf_hook"


class ExecutionDeviceHook:
    #: memmode's, not the model's: left out of copies (``engine.copying``)
    __memmode_uncopied__ = True

    def __init__(self, device: torch.device, on_detach: Callable[[], None]) -> None:
        self.execution_device = device
        self._on_detach = on_detach

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module

    def pre_forward(self, module: nn.Module, *args, **kwargs):
        return args, kwargs

    def post_forward(self, module: nn.Module, output):
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        self._on_detach()
        # accelerate deletes the attribute itself right after this call; removing the placement
        # already deleted it, so put it back for that deletion to succeed.
        setattr(module, ATTRIBUTE, self)
        return module


def refuse_foreign_offloading(components: dict[str, nn.Module]) -> None:
    """Another offloading scheme (accelerate's or diffusers' own hooks) already owns these weights.

    Checked on every module of every component, for pipelines and bare modules alike: accelerate's
    sequential offload hooks each leaf (``_hf_hook`` on submodules) and leaves meta tensors behind,
    which memmode must never try to store.
    """
    for name, component in components.items():
        for path, sub in component.named_modules():
            where = f"{name}.{path}" if path else name
            hook = getattr(sub, ATTRIBUTE, None)
            if hook is not None and not isinstance(hook, ExecutionDeviceHook):
                raise IncompatibleModeError(
                    f"{where!r} already has accelerate offloading hooks ({type(hook).__name__}, from "
                    f"enable_model_cpu_offload, enable_sequential_cpu_offload, accelerate.cpu_offload or a "
                    f"device_map); remove them first (pipe.remove_all_hooks(), or "
                    f"accelerate.hooks.remove_hook_from_module(module, recurse=True)) and load the weights back"
                )
            registry = getattr(sub, "_diffusers_hook", None)
            if (
                registry is not None
                and getattr(registry, "get_hook", None)
                and registry.get_hook("group_offloading") is not None
            ):
                raise IncompatibleModeError(
                    f"{where!r} already uses diffusers' group offloading; remove it first (build the component "
                    f"again, or call its _diffusers_hook.remove_hook('group_offloading', recurse=True))"
                )


#: diffusers' own offloading: the methods of a pipeline, and of a model, that install it
FOREIGN_PIPELINE_OFFLOADING = ("enable_model_cpu_offload", "enable_sequential_cpu_offload", "enable_group_offload")
FOREIGN_MODEL_OFFLOADING = ("enable_group_offload",)
#: pipeline class -> (its ``__call__`` wrapper, whether the class defined ``__call__`` itself, the original)
_CALL_WRAPPERS: dict[type, tuple[Callable[..., Any], bool, Callable[..., Any]]] = {}
#: placed pipeline -> what to run when its call returns
_CALL_ENDS: weakref.WeakKeyDictionary[Any, Callable[[], None]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class CallEndGuard(Hook):
    """``memmode.call_end``: the end of one placed pipeline's calls (see the module docstring).

    Python calls ``type(pipe).__call__``, so what runs is a plain function on the class (:func:`_call_wrapper`,
    one per class, shared by its placed instances); this hook is the pipeline's registration with it.
    """

    kind = "memmode.call_end"
    default_method = "__call__"
    __slots__ = ("_on_call_end",)

    def __init__(self, pipeline: Any, on_call_end: Callable[[], None]) -> None:
        super().__init__(pipeline, "__call__")
        self._on_call_end = on_call_end

    def install(self) -> CallEndGuard:
        pipeline = self.owner
        cls = type(pipeline)
        with _lock:
            if cls not in _CALL_WRAPPERS:
                # a class inheriting a wrapped __call__ (a parent class placed too) wraps the original, once
                original = getattr(cls.__call__, "__memmode_original__", cls.__call__)
                _CALL_WRAPPERS[cls] = (_call_wrapper(original), "__call__" in vars(cls), cls.__call__)
                cls.__call__ = _CALL_WRAPPERS[cls][0]
            _CALL_ENDS[pipeline] = self._on_call_end
        self.active = True
        self.register()
        return self

    def remove(self) -> None:
        pipeline = self.owner
        with _lock:
            _CALL_ENDS.pop(pipeline, None)
            for cls, (wrapper, own, original) in list(_CALL_WRAPPERS.items()):
                if any(type(p) is cls for p in list(_CALL_ENDS.keys())):
                    continue
                if vars(cls).get("__call__") is wrapper:
                    if own:
                        cls.__call__ = original
                    else:
                        delattr(cls, "__call__")
                del _CALL_WRAPPERS[cls]
        self.active = False
        self.unregister(pipeline)

    def describe(self) -> str:
        return "when the call returns, offloads what it left on the device (unless the placement keeps it)"


class OffloadingGuard(MethodWrapper):
    """``memmode.offloading_guard:<method>``: refuses diffusers' own offloading (``enable_model_cpu_offload``,
    ...) while a memmode mode is applied, before anything changes (see the module docstring)."""

    kind = "memmode.offloading_guard"
    __slots__ = ("label", "mode")

    def __init__(self, owner: Any, method: str, label: str, mode: str) -> None:
        super().__init__(owner, method)
        self.label = label
        self.mode = mode

    def __call__(self, *args, **kwargs):
        if not self.active:
            return self.original(*args, **kwargs)
        raise IncompatibleModeError(
            f"{self.label}.{self.method}(): memmode mode {self.mode!r} is applied here, and a second offloading "
            f"scheme would fight it over the weights; nothing was changed. Call memmode.remove(...) "
            f"(handle.remove()) first, or let memmode place it: memmode.apply(pipe, 'model_cpu_offload' / "
            f"'sequential_cpu_offload' / 'model_group_offload')"
        )

    def where(self) -> str:
        return self.label

    def describe(self) -> str:
        return f"refuses diffusers' own offloading while memmode mode {self.mode!r} is applied"


class SaveGuard(MethodWrapper):
    """``memmode.save_guard``: ``save_pretrained`` of a pipeline or component holding quantized layers is refused
    before anything is written.

    diffusers and transformers would write the layers' state dict: the packed tensors next to each
    ``weight`` stand-in's dequantized values, a checkpoint that ``from_pretrained`` loads as a full-precision
    model only with "weights not used" warnings and that ``memmode.load`` cannot read as quantized.
    ``memmode.save_quantized`` writes memmode's quantized format instead (``memmode.load`` streams it back
    packed). A pipeline's ``save_pretrained`` is checked for all its components before it writes
    ``model_index.json``. Components without quantized layers save as usual: a placed model's weights read
    as their real values."""

    kind = "memmode.save_guard"
    default_method = "save_pretrained"
    __slots__ = ("label", "quantized")

    def __init__(self, owner: Any, label: str, quantized: Callable[[], list[str]]) -> None:
        super().__init__(owner, "save_pretrained")
        self.label = label
        #: the names of what holds quantized layers now (the owner, or a pipeline's components)
        self.quantized = quantized

    def __call__(self, *args, **kwargs):
        if self.active:
            held = self.quantized()
            if held:
                raise IncompatibleModeError(
                    f"{self.label}.save_pretrained(): {', '.join(held)} holds layers quantized by memmode, which "
                    f"save_pretrained would write as packed tensors beside their dequantized weights; nothing was "
                    f"written. Save it with memmode.save_quantized(target, path) (memmode.load(path, mode) reads "
                    f"it back quantized), or save the model before applying the quantizer"
                )
        return (self.original if self.active else self.passthrough())(*args, **kwargs)

    def where(self) -> str:
        return self.label

    def describe(self) -> str:
        return "refuses save_pretrained while it holds quantized layers (memmode.save_quantized writes them)"


def _call_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            on_end = _CALL_ENDS.get(self)
            if on_end is not None:
                on_end()

    __call__.__memmode_call_end__ = True
    __call__.__memmode_original__ = original
    return __call__


def watches_call_end(cls: type) -> bool:
    """Whether ``cls.__call__`` is memmode's end-of-call wrapper."""
    return getattr(vars(cls).get("__call__"), "__memmode_call_end__", False)


class PipelineHooks:
    """The hooks one runtime puts on its target besides the forward wrappers: the ``_hf_hook`` shim on a pipeline's
    components (:class:`ExecutionDeviceHook`) and the guards (:func:`install_guards`). The runtime owns them:
    :meth:`Runtime.attach <memmode_core.engine.runtime.Runtime.attach>` installs them once a handle exists (the
    shim's detach removes that handle), :meth:`Runtime.remove <memmode_core.engine.runtime.Runtime.remove>` takes
    them off with the rest.

    ``pipeline``: the placed pipeline (None for a bare module: no shim, no end-of-call guard)."""

    def __init__(self, pipeline: Any, components: dict[str, nn.Module], device: torch.device) -> None:
        self._pipeline = pipeline
        self._components = components
        self._device = device
        #: the guards installed now, in the order they were installed
        self.guards: list[Hook] = []

    def install(
        self,
        *,
        mode: str,
        on_detach: Callable[[], None],
        on_call_end: Callable[[], None],
        quantized: Callable[[nn.Module], bool] | None = None,
    ) -> None:
        """Put the shim on the pipeline's components and install the guards; on a failure, take off what was put
        on."""
        try:
            if self._pipeline is not None:
                for component in self._components.values():
                    setattr(component, ATTRIBUTE, ExecutionDeviceHook(self._device, on_detach))
            install_guards(self._pipeline, self._components, mode, on_call_end, quantized=quantized, into=self.guards)
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Take the guards and the shim off (a second call finds nothing to take off)."""
        for guard in self.guards:
            guard.remove()
        self.guards.clear()
        for component in self._components.values():
            if isinstance(getattr(component, ATTRIBUTE, None), ExecutionDeviceHook):
                delattr(component, ATTRIBUTE)


def install_guards(
    pipeline: Any,
    components: dict[str, nn.Module],
    mode: str,
    on_call_end: Callable[[], None],
    quantized: Callable[[nn.Module], bool] | None = None,
    *,
    into: list[Hook],
) -> None:
    """Watch the end of a pipeline's calls, refuse diffusers' offloading, and refuse ``save_pretrained`` of
    quantized layers (``quantized(module)`` says whether a module holds any; see the module docstring). Each guard
    is appended to ``into`` as soon as it is installed, so that what a failure leaves installed can be removed."""
    if quantized is not None:
        for name, module in components.items():
            if callable(getattr(type(module), "save_pretrained", None)):
                held = functools.partial(_quantized_names, {name: module}, quantized)
                into.append(SaveGuard(module, name, held).install())
        if pipeline is not None and callable(getattr(type(pipeline), "save_pretrained", None)):
            held = functools.partial(_quantized_names, components, quantized)
            into.append(SaveGuard(pipeline, type(pipeline).__name__, held).install())
    owners: list[tuple[Any, str, tuple[str, ...]]] = [
        (module, name, FOREIGN_MODEL_OFFLOADING) for name, module in components.items()
    ]
    if pipeline is not None:
        owners.insert(0, (pipeline, type(pipeline).__name__, FOREIGN_PIPELINE_OFFLOADING))
        if callable(type(pipeline)) and not isinstance(pipeline, nn.Module):
            into.append(CallEndGuard(pipeline, on_call_end).install())
    for owner, label, methods in owners:
        for method in methods:
            if callable(getattr(type(owner), method, None)):
                into.append(OffloadingGuard(owner, method, label, mode).install())


def _quantized_names(components: dict[str, nn.Module], quantized: Callable[[nn.Module], bool]) -> list[str]:
    return [name for name, module in components.items() if quantized(module)]
