"""The :class:`Handle` ``apply`` returns: the applied mode, its ledger, and the way back.

A handle is tied to the :class:`~memmode_core.planning.prepared.Prepared` it executed (``handle.prepared``):
what was resolved, laid out and planned, and what a refused re-apply puts back.
"""

from __future__ import annotations

import logging
from typing import Any

from memmode_core.engine import pipeline_hooks
from memmode_core.engine.ledger import Ledger, Report, clock
from memmode_core.engine.runtime import Runtime
from memmode_core.planning.prepared import Prepared
from memmode_core.quantization import is_quantized

logger = logging.getLogger("memmode")

#: attribute set on a pipeline / module (and on each placed component) that points to its handle
HANDLE_ATTRIBUTE = "_memmode_handle"


class Handle:
    """What ``apply`` returns: the applied mode, its ledger, and the way back."""

    #: a copy of a placed object has no placement (``engine.copying``)
    __memmode_uncopied__ = True

    def __init__(self, prepared: Prepared, runtime: Runtime, ledger: Ledger, quantized: dict[str, Any]) -> None:
        #: the plan this handle executed: what a refused re-apply puts back, and rebuilds lay out again
        self.prepared = prepared
        self.mode = prepared.mode
        #: what was asked for: differs from ``mode`` when ``auto`` chose
        self.requested_mode = prepared.requested_mode
        #: the planner's entry ``auto`` chose, else None
        self.choice = prepared.choice
        self.placement = prepared.placement
        self.quantizer = prepared.quantizer
        self.storage = prepared.storage
        self.device = prepared.device
        #: component name -> the quantizer's summary of what it did there
        self.quantized = quantized
        #: component name -> what core placed differently from the placement's layout, and why
        #: (``_supports_group_offloading = False``, ``_exclude_from_cpu_offload``; see ``lay_out``)
        self.notes = prepared.notes
        #: what ``load`` did on the way (see :attr:`Report.loading`); empty after ``apply``
        self.loading: dict[str, Any] = {}
        self._runtime = runtime
        self._ledger = ledger
        self._removed = False
        self._guards: list = []

    @property
    def target(self) -> Any:
        return self.prepared._target.obj

    @property
    def _components(self) -> dict:
        return self.prepared._target.components

    @property
    def active(self) -> bool:
        return not self._removed

    def report(self) -> Report:
        session = self._runtime.session
        return Report(
            mode=self.mode,
            storage=self.storage,
            device=str(self.device),
            peak_device_bytes=self._ledger.peak,
            resident_device_bytes=self._ledger.resident,
            bytes_transferred=self._ledger.transferred,
            transfer_seconds=self._ledger.seconds,
            onloads=self._ledger.onloads,
            offloads=self._ledger.offloads,
            storage_bytes=session.stats() if session is not None else {},
            quantization={name: _as_dict(summary) for name, summary in self.quantized.items()},
            component_calls={name: self._runtime.calls.count(name) for name in self._components},
            call_sequence=list(self._runtime.calls),
            placement_notes=dict(self.notes),
            loading=dict(self.loading),
            reads_served=self._ledger.reads_served,
            bytes_served=self._ledger.bytes_served,
            served=dict(self._ledger.served_names),
        )

    def reset_stats(self) -> None:
        """Start counting afresh (the peak restarts from what is resident now)."""
        self._ledger.reset_peak()
        self._runtime.calls.clear()

    def refresh(self) -> None:
        """Take every weight from the model as it is now.

        memmode notices on its own when parameters, buffers or submodules are added, removed or
        replaced, and it wraps the LoRA and projection-fusing methods of diffusers and
        transformers. What it cannot notice is a write into a tensor's existing memory
        (``module.weight.data.mul_(2)``, ``copy_``): call this after such edits.
        """
        self._runtime.refresh()

    def save(self, path) -> Any:
        """Save the target quantized, as it is now (see :func:`memmode_core.save_quantized`); ``load(path,
        mode)`` streams it back without quantizing again. Nothing is moved or removed."""
        from memmode_core.loading.save import save_quantized

        return save_quantized(self.target, path)

    def start_trace(self) -> None:
        """Record resident device bytes after every onload and offload from now on (see :meth:`trace`)."""
        self._ledger.trace = [(clock(), self._ledger.resident)]

    def trace(self) -> list[tuple[float, int]]:
        """``(seconds since start_trace, resident device bytes)`` samples; empty when not tracing."""
        samples = self._ledger.trace
        if not samples:
            return []
        samples = [*samples, (clock(), self._ledger.resident)]  # "until now": a flat trace has two points
        return [(t - samples[0][0], b) for t, b in samples]

    def _attach(self) -> None:
        """Mark the target and its placed components as placed by this handle."""
        is_pipeline = self.prepared._target.is_pipeline
        if is_pipeline:
            pipeline_hooks.install(self._components, self.device, self.remove)
        self._guards = pipeline_hooks.install_guards(
            self.target if is_pipeline else None,
            self._components,
            self.mode,
            self._runtime.end_call,
            quantized=is_quantized,
        )
        for obj in [self.target, *self._components.values()]:
            setattr(obj, HANDLE_ATTRIBUTE, self)

    def remove(self) -> None:
        """Take every hook off and leave the weights in ordinary CPU memory. Idempotent.

        If some groups' stored copies were lost (a deleted or damaged file), every other weight is
        still restored and the mode is still fully removed; then :class:`RestoreError` names the
        groups that could not be given back.
        """
        if self._removed:
            return
        self._removed = True
        try:
            self._runtime.remove()
        finally:
            pipeline_hooks.remove_guards(self._guards)
            pipeline_hooks.uninstall(self._components)
            target = self.target
            for obj in [target, *self._components.values()]:
                if obj is not None and getattr(obj, HANDLE_ATTRIBUTE, None) is self:
                    delattr(obj, HANDLE_ATTRIBUTE)
        if self.quantized:
            logger.warning(
                "memmode: removed %s; quantization of %s (%s) is not undone, the weights stay quantized",
                self.mode,
                ", ".join(self.quantized),
                self.quantizer,
            )

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<memmode.Handle {self.mode} storage={self.storage} device={self.device} {state}>"


def _as_dict(summary: Any) -> dict:
    if hasattr(summary, "as_dict"):
        return summary.as_dict()
    return dict(summary) if isinstance(summary, dict) else {"summary": str(summary)}


def handle_of(target: Any) -> Handle | None:
    """The active handle applied to ``target`` itself (not one applied to a pipeline it belongs to)."""
    handle = getattr(target, HANDLE_ATTRIBUTE, None)
    if isinstance(handle, Handle) and handle.active and handle.target is target:
        return handle
    return None
