"""The call a plan is priced for: which components run, in which order, and at which shapes.

A *call* is a profile of component calls: counts, ``calls={"text_encoder": 1, "transformer": 30}`` (run in
the pipeline's component order), or the exact sequence, ``calls=["text_encoder", "transformer",
"transformer", ...]``. The default profile for a pipeline is one forward of each text encoder and of the VAE
(a decode: an autoencoder's encoder side does not run in a text-to-image/video call), and ``steps`` denoiser
forwards shared between the denoisers (Wan 2.2's two experts split the steps). For an exact comparison with a
real call, pass that call's own sequence: ``plan(pipe, calls=handle.report().call_sequence)``.

Given the call's shapes, the call is traced once on fake tensors (:class:`CallTrace`): the activations it
needs on the device and the compute of each group, which every candidate's pricing then shares.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from memmode_core.contracts.errors import InvalidOptionError
from memmode_core.contracts.targets import Target
from memmode_core.planning.trace import ComponentTrace, trace_pipeline_call

#: Denoising steps of the default call profile.
DEFAULT_STEPS = 20

_DENOISER = re.compile(r"^(transformer|unet|prior|decoder_transformer)(_\d+)?$")


def default_calls(target: Target, steps: int = DEFAULT_STEPS) -> dict[str, int]:
    """The default profile (see the module docstring): a bare module is called once."""
    if not target.is_pipeline:
        return {name: 1 for name in target.components}
    denoisers = [n for n in target.components if _DENOISER.match(n)]
    calls = {}
    for name in target.components:
        if name in denoisers:
            calls[name] = max(1, math.ceil(steps / len(denoisers)))
        else:
            calls[name] = 1
    return calls


def call_sequence(target: Target, calls: Mapping[str, int] | Iterable[str]) -> list[str]:
    """The component calls of one call, in order. Counts run in the pipeline's ``model_cpu_offload_seq``
    order (then the remaining components), each component's calls back to back."""
    if isinstance(calls, Mapping):
        sequence = getattr(target.obj, "model_cpu_offload_seq", None) or ""
        ordered = [n for n in sequence.split("->") if n in target.components]
        ordered += [n for n in target.components if n not in ordered]
        unknown = set(calls) - set(target.components)
        result = [n for n in ordered for _ in range(int(calls.get(n, 0)))]
    else:
        result = list(calls)
        unknown = set(result) - set(target.components)
    if unknown:
        raise InvalidOptionError(f"calls= names no component {', '.join(sorted(unknown))} of {target.label}")
    return result


def call_shapes(
    height: int | None = None, width: int | None = None, num_frames: int | None = None, batch: int | None = None
) -> dict[str, int]:
    """The call's shapes that were given (what :class:`CallTrace` traces the call at)."""
    given = dict(height=height, width=width, num_frames=num_frames, batch=batch)
    return {name: value for name, value in given.items() if value is not None}


@dataclass(frozen=True)
class CallTrace:
    """A call at given shapes, traced once on fake tensors (:mod:`memmode_core.planning.trace`) and handed to
    what prices and judges the candidates: the traces (compute per group), the activation peak over the
    components the call sequence runs, and the operations whose workspace that peak leaves out. Without
    shapes nothing is traced and activations count 0 (``vram_budget`` counts weights only)."""

    traces: Mapping[str, ComponentTrace] | None = None
    activation_bytes: int = 0
    unmodelled_workspace: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        target: Any,
        sequence: list[str],
        device: torch.device,
        shapes: Mapping[str, int],
        context_parallel: int = 1,
    ) -> CallTrace:
        """The call traced at ``shapes``; with ``context_parallel`` ranks splitting the sequence of each component
        diffusers can split (one with a ``_cp_plan``: its transformer), that component's activations are that
        share of the traced ones on each rank (an estimate: Ulysses splits every activation but attention's by
        tokens, and attention's by heads)."""
        if not shapes:
            return cls()
        shapes = dict(shapes)
        batch = shapes.pop("batch", 1)
        traces = trace_pipeline_call(target, batch=batch, device=device, **shapes)
        components = Target.of(target).components
        peaks = {
            name: -(-traces[name].activation_peak // context_parallel)
            if getattr(components.get(name), "_cp_plan", None) is not None
            else traces[name].activation_peak
            for name in set(sequence)
            if name in traces
        }
        return cls(
            traces,
            max(peaks.values(), default=0),
            tuple(sorted(set().union(*(traces[name].unmodelled for name in peaks)))),
        )

    def weights_budget(self, vram: int) -> int:
        """What a device budget of ``vram`` bytes leaves for weights once the call's activations have theirs."""
        return max(vram - self.activation_bytes, 1)

    def mark(self, entries: Iterable[Any]) -> None:
        """Give each priced entry the call's activations and the workspace they leave out."""
        for entry in entries:
            entry.activation_bytes = self.activation_bytes
            entry.unmodelled_workspace = self.unmodelled_workspace
