"""What a call computes, without computing it: each component's forwards run on fake tensors.

The planner needs, for the shapes of a real call, what weights alone do not say: the activation memory each
component needs on the device (its peak of live tensors during a forward, inputs and kernel workspace
included) and the work each module does (FLOPs). :func:`trace_call` runs the pipeline call itself —
tokenizers, schedulers, the pipeline's own tensor code, on real tensors — with every component's forward (and
entry methods such as a VAE's ``decode``) replaced by the same forward run under PyTorch's ``FakeTensorMode``
(what stands in for what: :mod:`memmode_core.planning.fake_inputs`): every tensor it makes has shape, dtype and
strides but no memory, counted by :class:`~memmode_core.planning.live_bytes.LiveBytes` and by PyTorch's
``FlopCounterMode``. The component hands back zeros of the fake output's shape, so the pipeline goes on as it
would. Nothing of the model's weights is copied or changed; a call at 81 frames of 720p costs what the
pipeline's own small tensors cost. What cannot be traced is a :class:`TraceError`, before anything is applied.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from memmode_core.contracts.errors import InvalidOptionError, MemmodeError
from memmode_core.contracts.targets import Target
from memmode_core.engine.forwards import entry_methods
from memmode_core.engine.hooks import hooks_of
from memmode_core.planning.fake_inputs import HOST, RealIndices, fake_input, has_meta, meta_as_fake, pipeline_on_host
from memmode_core.planning.live_bytes import LiveBytes


@dataclass
class ComponentTrace:
    """One component over a traced call: how often it ran, the peak of its activations and kernel workspace
    (the largest of its calls), the FLOPs of each of its modules (by path within the component, summed over
    its calls), and the operations whose workspace on the device is not in that peak."""

    calls: int = 0
    activation_peak: int = 0
    flops: dict[str, int] = field(default_factory=dict)
    unmodelled: set[str] = field(default_factory=set)

    def flops_per_call(self) -> dict[str, float]:
        return {path: count / max(self.calls, 1) for path, count in self.flops.items()}


def _attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


#: FLOP formulas PyTorch's counter lacks: attention as the CPU runs it (a call traced on host tensors reaches
#: this kernel; without it a Wan 14B forward at 480p counts 785 of its 1,678 TFLOPs, its attention missing)
_MORE_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops}


def _to_zeros(value: Any) -> Any:
    if isinstance(value, FakeTensor):
        return torch.zeros(value.shape, dtype=value.dtype)
    return value


class TraceError(InvalidOptionError):
    """The call cannot be traced at the shapes given: a component's forward needs what fake tensors do not have
    (the values of its tensors), or the pipeline's own code failed. The message names where and why; planning
    without the call's shapes still works (``vram_budget`` then counts weights only)."""


_WITHOUT_SHAPES = (
    "its activations cannot be predicted: plan without the call's shapes (vram_budget then counts weights only)"
)


def _failed(where: str, error: Exception) -> TraceError:
    if isinstance(error, (DataDependentOutputException, DynamicOutputShapeException)):
        why = f"depends on the values of its tensors ({error.func}), which a run on fake tensors does not have"
    else:
        why = f"failed on fake tensors ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    return TraceError(f"{where} {why}; {_WITHOUT_SHAPES}")


def _traced(
    component: nn.Module,
    label: str,
    name: str,
    original: Callable,
    trace: ComponentTrace,
    inside: list,
    device: torch.device,
) -> Callable:
    """``original`` (a bound method of ``component``) run on fake tensors. ``forward`` is entered through the
    module's ``__call__`` (its hooks, and FlopCounterMode's naming of submodules by path, need it); the
    re-entry from ``__call__`` reaches ``original`` itself, as does any call of the component's methods from
    within one (``inside``, shared by them: a VAE's ``decode`` calling its ``forward`` is one call)."""
    # FlopCounterMode names the modules below the one it was entered through by their path from it; entered
    # through another method, the top ones are named by their class: map those back to their attribute
    by_class = {type(child).__name__: attr for attr, child in component.named_children()}
    root = type(component).__name__

    def path_of(key: str) -> str | None:
        head, _, rest = key.partition(".")
        if name == "forward":
            return rest if head == root else None
        attr = by_class.get(head)
        return None if attr is None else ".".join(part for part in (attr, rest) if part)

    def run_fake(*args, **kwargs):
        if inside:
            return original(*args, **kwargs)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, meta_as_fake(component, mode):
            fake = tree_map(lambda v: fake_input(mode, v), (args, kwargs))
            live = LiveBytes(device)
            for value in tree_flatten(fake)[0]:
                if isinstance(value, torch.Tensor):
                    live.add(value)
            inside.append(True)
            try:
                with (
                    torch.no_grad(),
                    RealIndices(),
                    FlopCounterMode(display=False, custom_mapping=_MORE_FLOP_FORMULAS) as counter,
                    live,
                ):
                    out = component(*fake[0], **fake[1]) if name == "forward" else original(*fake[0], **fake[1])
            except MemmodeError:
                raise
            except Exception as error:
                raise _failed(f"{label}.{name}", error) from error
            finally:
                inside.pop()
        trace.calls += 1
        trace.activation_peak = max(trace.activation_peak, live.peak)
        trace.unmodelled |= live.unmodelled
        for key, ops in counter.get_flop_counts().items():
            path = path_of(key)
            if path is not None:
                trace.flops[path] = trace.flops.get(path, 0) + sum(ops.values())
        return tree_map(_to_zeros, out)

    # the method's own signature shows through (pipelines ask which arguments a component's forward takes)
    return functools.update_wrapper(run_fake, original)


@contextlib.contextmanager
def tracing(target: Target, device: torch.device | None = None) -> Iterator[dict[str, ComponentTrace]]:
    """Within the block, every component of ``target`` computes on fake tensors (see the module docstring),
    its kernels' workspace counted as on ``device`` (default: where the component's weights are)."""
    traces = {name: ComponentTrace() for name in target.components}
    patched: list[tuple[nn.Module, str]] = []
    try:
        for name, component in target.components.items():
            inside: list = []
            where = device if device is not None else _device_of(component)
            for method in ("forward", *entry_methods(component)):
                original = getattr(component, method)
                label = f"{name} ({type(component).__name__})"
                setattr(component, method, _traced(component, label, method, original, traces[name], inside, where))
                patched.append((component, method))
        yield traces
    finally:
        for component, method in patched:
            vars(component).pop(method, None)


def _device_of(component: nn.Module) -> torch.device:
    first = next(component.parameters(), None)
    return first.device if first is not None and first.device.type != "meta" else HOST


def _refuse_placed(target: Target) -> None:
    """A target under a memmode mode is not traced: its weights are offloaded or quantized and its hooks would
    move them during the call. Refused before anything runs, saying how to get the prediction."""
    placed = [name for name, component in target.components.items() if any(hooks_of(m) for m in component.modules())]
    if placed or (target.is_pipeline and hooks_of(target.obj)):
        raise InvalidOptionError(
            f"the call's shapes (height=, width=, num_frames=, batch=) are traced on the model as loaded, but "
            f"{', '.join(placed) or 'the pipeline'} is under a memmode mode now: plan or apply 'auto' with the "
            "shapes before applying a mode, or remove() it first"
        )


def trace_call(target: Any, run: Callable[[], Any], device: torch.device | None = None) -> dict[str, ComponentTrace]:
    """Each component's activation peak and FLOPs over ``run()`` (a call of the pipeline or model), with the
    kernels' workspace on ``device`` (default: where each component's weights are). A target under a memmode
    mode is refused (:class:`InvalidOptionError`)."""
    subject = Target.of(target)
    _refuse_placed(subject)
    with tracing(subject, device) as traces:
        try:
            run()
        except MemmodeError:
            raise
        except Exception as error:
            raise _failed(f"the call of {subject.label}, outside its components,", error) from error
    return traces


def call_activations(
    pipe: Any, *, batch: int = 1, steps: int = 2, device: torch.device | None = None, **shapes: int | None
) -> dict[str, int]:
    """Each component's activation peak in a call of ``pipe`` at ``shapes`` (see :func:`trace_pipeline_call`)."""
    traces = trace_pipeline_call(pipe, batch=batch, steps=steps, device=device, **shapes)
    return {name: trace.activation_peak for name, trace in traces.items() if trace.calls}


def trace_pipeline_call(
    pipe: Any, *, batch: int = 1, steps: int = 2, device: torch.device | None = None, **shapes: int | None
) -> dict[str, ComponentTrace]:
    """Each component's trace over a call of ``pipe`` at ``shapes`` (``height``, ``width``, ``num_frames``) for
    ``batch`` prompts, with ``steps`` denoising steps (two: Wan 2.2's experts each take one) and the pipeline's
    other defaults; workspace as on ``device`` (see :func:`trace_call`)."""
    target = Target.of(pipe)
    if not target.is_pipeline:
        raise InvalidOptionError(
            "height=, width=, num_frames= and batch= describe a pipeline call; the target is a model"
        )
    accepted = inspect.signature(pipe.__call__).parameters
    given = {name: value for name, value in shapes.items() if value is not None}
    unknown = [name for name in given if name not in accepted]
    if unknown:
        raise InvalidOptionError(f"{type(pipe).__name__} takes no {', '.join(unknown)}")
    kwargs: dict[str, Any] = dict(given)
    if "prompt" in accepted:
        kwargs["prompt"] = ["a photo"] * batch
    if "num_inference_steps" in accepted:
        kwargs["num_inference_steps"] = steps
    if "generator" in accepted:
        kwargs["generator"] = torch.Generator().manual_seed(0)
    progress = getattr(pipe, "set_progress_bar_config", None)
    if progress is not None:
        progress(disable=True)
    skeleton = any(has_meta(c) for c in target.components.values())
    with pipeline_on_host(pipe, target.components.values()) if skeleton else contextlib.nullcontext():
        return trace_call(pipe, lambda: pipe(**kwargs), device)
