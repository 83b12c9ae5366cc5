"""The :class:`Handle` ``apply`` returns: the applied mode, its ledger, and the way back.

A handle is tied to the :class:`~memmode_core.planning.prepared.Prepared` it executed (``handle.prepared``):
what was resolved, laid out and planned, and what a refused re-apply puts back.
"""

from __future__ import annotations

import logging
from typing import Any

from memmode_core.contracts.targets import HANDLE_ATTRIBUTE
from memmode_core.engine.ledger import Ledger, Report, clock
from memmode_core.engine.runtime import Runtime
from memmode_core.layer_packing import NOTHING, Packed
from memmode_core.planning.prepared import Prepared
from memmode_core.quantization import is_quantized

logger = logging.getLogger("memmode")


class Handle:
    """What ``apply`` returns: the applied mode, its ledger, and the way back."""

    #: a copy of a placed object has no placement (``engine.copying``)
    __memmode_uncopied__ = True

    def __init__(
        self,
        prepared: Prepared,
        runtime: Runtime,
        ledger: Ledger,
        quantized: dict[str, Any],
        *,
        streamed: Packed = NOTHING,
    ) -> None:
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
        #: the layers packed into streamed files, and those files (what ``load`` reports of its packing)
        self.streamed = streamed
        #: component name -> what core placed differently from the placement's layout, and why
        #: (``_supports_group_offloading = False``, ``_exclude_from_cpu_offload``; see ``lay_out``)
        self.notes = prepared.notes
        #: what ``load`` did on the way (see :attr:`Report.loading`); empty after ``apply``
        self.loading: dict[str, Any] = {}
        #: the engine serving the mode, and its counts (memmode's own objects: no compatibility promise)
        self.runtime = runtime
        self.ledger = ledger
        self._removed = False

    @property
    def target(self) -> Any:
        return self.prepared.internal.target.obj

    @property
    def components(self) -> dict:
        """Component name -> the module the mode places."""
        return self.prepared.internal.target.components

    @property
    def active(self) -> bool:
        return not self._removed

    def report(self) -> Report:
        session = self.runtime.session
        return Report(
            mode=self.mode,
            storage=self.storage,
            device=str(self.device),
            peak_device_bytes=self.ledger.peak,
            resident_device_bytes=self.ledger.resident,
            bytes_transferred=self.ledger.transferred,
            transfer_seconds=self.ledger.seconds,
            onloads=self.ledger.onloads,
            offloads=self.ledger.offloads,
            storage_bytes=session.stats() if session is not None else {},
            quantization={name: _as_dict(summary) for name, summary in self.quantized.items()},
            component_calls={name: self.runtime.calls.count(name) for name in self.components},
            call_sequence=list(self.runtime.calls),
            placement_notes=dict(self.notes),
            loading=dict(self.loading),
            reads_served=self.ledger.reads_served,
            bytes_served=self.ledger.bytes_served,
            served=dict(self.ledger.served_names),
            evictions=[dict(e) for e in self.ledger.evictions],
            recoveries=[dict(r) for r in self.ledger.recoveries],
        )

    def reset_stats(self) -> None:
        """Start counting afresh (the peak restarts from what is resident now)."""
        self.ledger.reset_peak()
        self.runtime.reset_calls()

    def refresh(self) -> None:
        """Take every weight from the model as it is now.

        memmode notices on its own when parameters, buffers or submodules are added, removed or
        replaced, and it wraps the LoRA and projection-fusing methods of diffusers and
        transformers. What it cannot notice is a write into a tensor's existing memory
        (``module.weight.data.mul_(2)``, ``copy_``): call this after such edits.
        """
        self.runtime.refresh()

    def save(self, path) -> Any:
        """Save the target quantized, as it is now (see :func:`memmode_core.save_quantized`); ``load(path,
        mode)`` streams it back without quantizing again. Nothing is moved or removed."""
        from memmode_core.loading.save import save_quantized

        return save_quantized(self.target, path)

    def start_trace(self) -> None:
        """Record resident device bytes after every onload and offload from now on (see :meth:`trace`)."""
        self.ledger.trace = [(clock(), self.ledger.resident)]

    def trace(self) -> list[tuple[float, int]]:
        """``(seconds since start_trace, resident device bytes)`` samples; empty when not tracing."""
        samples = self.ledger.trace
        if not samples:
            return []
        samples = [*samples, (clock(), self.ledger.resident)]  # "until now": a flat trace has two points
        return [(t - samples[0][0], b) for t, b in samples]

    def put_back(self, prepared: Prepared, runtime: Runtime, ledger: Ledger) -> None:
        """Make this removed handle active again with the engine installed for ``prepared`` (its plan prepared
        again): what a refused re-apply does to the mode it had taken off (:mod:`memmode_core.handover`)."""
        if not self._removed:
            raise RuntimeError(f"{self!r} is active: only a removed handle is put back")
        self.prepared, self.runtime, self.ledger = prepared, runtime, ledger
        self._removed = False
        self.attach()

    def attach(self) -> None:
        """Have the runtime install the hooks that need this handle (:meth:`Runtime.attach`: the ``_hf_hook`` shim,
        whose detach removes this handle, and the guards), and mark the target and its placed components as placed
        by this handle (what :func:`handle_of` reads; a mark is the handle's, not a hook)."""
        self.runtime.attach(self.remove, mode=self.mode, quantized=is_quantized)
        for obj in [self.target, *self.components.values()]:
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
            self.runtime.remove()  # every hook the runtime installed, the shim and the guards included
        finally:
            target = self.target
            for obj in [target, *self.components.values()]:
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
