"""The main job behind ``memmode run``: one pipeline under one or more modes, measured side by side.

Each mode gets a freshly loaded pipeline (a quantizer changes the weights for good), one warm-up
call (it records the execution order that prefetching follows), then one measured call whose
ledger is reported.
"""

from __future__ import annotations

import gc
import inspect
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from ..api import apply


@dataclass
class RunResult:
    requested: str
    mode: str
    storage: str | None
    device: str
    seconds_per_call: float
    peak_device_bytes: int
    bytes_transferred: int
    transfer_seconds: float
    offloaded_ram_bytes: int
    disk_bytes: int
    output_shape: tuple[int, ...]
    trace: list[tuple[float, int]] = field(default_factory=list, repr=False)

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


def run_modes(load: Callable[[], Any], call: Callable[..., torch.Tensor], modes: list[str], *,
              device: Any = None, storage: str | None = None, steps: int, progress: bool = True,
              trace: bool = False, apply_options: dict | None = None) -> list[RunResult]:
    """Measure ``call(pipe, callback=...)`` on a fresh ``load()`` under each of ``modes``."""
    from tqdm.auto import tqdm

    results = []
    for mode in modes:
        pipe = load()
        handle = apply(pipe, mode, device=device, storage=storage, **(apply_options or {}))
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
        results.append(RunResult(
            requested=mode, mode=handle.mode, storage=handle.storage, device=str(handle.device),
            seconds_per_call=seconds, peak_device_bytes=report.peak_device_bytes,
            bytes_transferred=report.bytes_transferred, transfer_seconds=report.transfer_seconds,
            offloaded_ram_bytes=held.get("pageable_bytes", 0) + held.get("pinned_bytes", 0),
            disk_bytes=held.get("disk_bytes", 0), output_shape=tuple(output.shape),
            trace=handle.trace() if trace else [],
        ))
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
    if device.type == "cuda":
        torch.cuda.synchronize(device)
