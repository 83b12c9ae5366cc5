"""The main job behind ``memmode run``: one pipeline under one or more modes, measured side by side.

Each mode gets a freshly loaded pipeline (a quantizer changes the weights for good), one warm-up
call (it records the execution order that prefetching follows), then one measured call whose
ledger is reported. With ``keep_going`` (``memmode run --compare``) a mode that ``apply`` refuses
(any ``MemmodeError``: an unknown name, an incompatible combination, an option its plugins do not
declare) gets a result with ``refused`` set to the one-line reason, and the other modes still run.
"""

from __future__ import annotations

import gc
import inspect
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import memmode_core as memmode
from memmode_core.engine.streams import active


@dataclass
class RunResult:
    """One mode's measured call; a refused mode has ``refused`` (the reason) and ``None`` figures."""

    requested: str
    mode: str | None
    storage: str | None
    device: str | None
    seconds_per_call: float | None
    peak_device_bytes: int | None
    bytes_transferred: int | None
    transfer_seconds: float | None
    offloaded_ram_bytes: int | None
    #: bytes on disk that hold the offloaded weights: the storage's group files, and the streamed files memmode
    #: wrote that the stored groups lie in (a quantizer's packed layers, kept there in place: ``staged_bytes``)
    disk_bytes: int | None
    output_shape: tuple[int, ...] | None
    trace: list[tuple[float, int]] = field(default_factory=list, repr=False)
    refused: str | None = None
    #: of ``disk_bytes``, those of the streamed files (``report().storage_bytes["staged_bytes"]``)
    staged_bytes: int | None = None
    #: what left the device in the measured call for room, and the out-of-memory errors recovered from
    #: (``report().evictions``, ``report().recoveries``)
    evictions: list[dict] = field(default_factory=list)
    recoveries: list[dict] = field(default_factory=list)

    @classmethod
    def refusal(cls, requested: str, error: BaseException) -> RunResult:
        reason = " ".join(str(error).split()) or type(error).__name__  # one line
        return cls(
            requested=requested,
            mode=None,
            storage=None,
            device=None,
            seconds_per_call=None,
            peak_device_bytes=None,
            bytes_transferred=None,
            transfer_seconds=None,
            offloaded_ram_bytes=None,
            disk_bytes=None,
            output_shape=None,
            refused=reason,
        )

    @property
    def ran(self) -> bool:
        return self.refused is None

    def as_dict(self, with_trace: bool = False) -> dict:
        data = asdict(self)
        if not with_trace:
            data.pop("trace")
        return data


def accepts_step_callback(pipe: Any) -> bool:
    try:
        return "callback_on_step_end" in inspect.signature(pipe.__call__).parameters
    except (TypeError, ValueError):
        return False


def _resolves(mode: str) -> bool:
    """Whether ``mode``'s placement is a resolver (``auto``): one that takes the call's shapes."""
    from memmode_core.contracts.resolver import Resolver
    from memmode_core.discovery.plugins import current

    try:
        registration = current().get("placement", memmode.parse_mode(mode).placement)
    except (TypeError, ValueError):
        return False
    return registration is not None and isinstance(registration.obj, Resolver)


def run_modes(
    load: Callable[[], Any],
    call: Callable[..., torch.Tensor],
    modes: list[str],
    *,
    device: Any = None,
    storage: str | None = None,
    steps: int,
    progress: bool = True,
    trace: bool = False,
    apply_options: dict | None = None,
    keep_going: bool = False,
    load_into: Callable[..., Any] | None = None,
    call_shapes: dict | None = None,
) -> list[RunResult]:
    """Measure ``call(pipe, callback=...)`` on a fresh ``load()`` under each of ``modes``.

    ``apply_options`` go to ``memmode_core.apply`` as keywords for every mode. With ``keep_going``, a
    mode ``apply`` refuses becomes a ``RunResult.refusal`` instead of an exception. ``load_into(mode,
    device=, storage=, **options) -> Handle``, when given, replaces ``load()`` + ``apply`` (a folder loaded
    straight into the mode). ``call_shapes`` (``height``, ``width``, ``num_frames`` of the call) go to a mode
    whose placement is a resolver (``auto``), which then counts the call's activations against its budget.
    """
    from tqdm.auto import tqdm

    results = []
    for mode in modes:
        pipe = None if load_into is not None else load()
        options = dict(apply_options or {})
        if call_shapes and _resolves(mode):
            options = dict(call_shapes) | options  # what the user gave with --option wins
        try:
            if load_into is not None:
                handle = load_into(mode, device=device, storage=storage, **options)
                pipe = handle.target
            else:
                handle = memmode.apply(pipe, mode, device=device, storage=storage, **options)
        except memmode.MemmodeError as error:
            if not keep_going:
                raise
            results.append(RunResult.refusal(mode, error))
            del pipe
            gc.collect()
            continue
        bar = tqdm(total=2 * steps, desc=f"{handle.mode}", unit="step", disable=not progress, leave=False)
        callback = _step_callback(bar) if accepts_step_callback(pipe) else None
        try:
            call(pipe, callback=callback)  # warm-up: records the execution order
            if callback is None:
                bar.update(steps)
            handle.reset_stats()
            if trace:
                handle.start_trace()
            _synchronize(handle.device)
            start = time.perf_counter()
            output = call(pipe, callback=callback)
            _synchronize(handle.device)
            seconds = time.perf_counter() - start
            if callback is None:
                bar.update(steps)
        finally:
            bar.close()
        report = handle.report()
        held = report.storage_bytes
        results.append(
            RunResult(
                requested=mode,
                mode=handle.mode,
                storage=handle.storage,
                device=str(handle.device),
                seconds_per_call=seconds,
                peak_device_bytes=report.peak_device_bytes,
                bytes_transferred=report.bytes_transferred,
                transfer_seconds=report.transfer_seconds,
                offloaded_ram_bytes=held.get("pageable_bytes", 0) + held.get("pinned_bytes", 0),
                disk_bytes=held.get("disk_bytes", 0) + held.get("staged_bytes", 0),
                staged_bytes=held.get("staged_bytes", 0),
                output_shape=tuple(output.shape),
                trace=handle.trace() if trace else [],
                evictions=report.evictions,
                recoveries=report.recoveries,
            )
        )
        handle.remove()
        del pipe, handle
        gc.collect()
    return results


def _step_callback(bar):
    def callback(pipe, step, timestep, callback_kwargs):
        bar.update(1)
        return callback_kwargs

    return callback


def _synchronize(device: torch.device) -> None:
    streams = active()
    if streams.has_streams(device):
        streams.synchronize(device)
