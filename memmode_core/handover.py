"""The handover: a mode applied to a target another mode places already — what is taken off, put back, said.

"The old mode" is every handle now placing the target or any of its components: its own, and that of another
pipeline sharing the components (``NewPipeline.from_pipe(placed)``). Applying a mode to the new pipeline moves
the placement there, as diffusers' ``enable_model_cpu_offload`` on it takes the old hooks off the shared
components first; the old handle becomes inactive. A bare module placed as one component of a pipeline is
refused instead: placing it alone would unplace the rest of that pipeline.

``execute`` takes the old handles off only once the new mode is fully validated (:func:`placing` finds them
first), puts them back if anything fails after that (:func:`put_back`), and says where a placement moved
(:func:`say_moves`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from memmode_core.contracts.errors import IncompatibleModeError
from memmode_core.contracts.targets import HANDLE_ATTRIBUTE, Target
from memmode_core.engine.ledger import Ledger
from memmode_core.engine.runtime import Runtime
from memmode_core.handle import Handle, handle_of
from memmode_core.planning.prepared import Prepared, prepare_again

logger = logging.getLogger("memmode")

#: installs the engine for a plan: ``(prepared) -> (runtime, ledger)`` (``applying.install_prepared``)
Installer = Callable[[Prepared], tuple[Runtime, Ledger]]


def placing(whole: Target) -> list[Handle]:
    """The active handles now placing ``whole`` or any of its components, its own first: what ``execute``
    takes off before placing, and puts back if that fails.

    Another target's handle is there when pipelines share components (``from_pipe``): the placement moves
    to this pipeline. A bare module placed as a component of a pipeline is refused: placing it alone would
    take the mode off the rest of that pipeline (diffusers refuses a model-level offload there too).
    """
    own = handle_of(whole.obj)
    handles = [own] if own is not None else []
    for module in whole.components.values():
        other = getattr(module, HANDLE_ATTRIBUTE, None)
        if not isinstance(other, Handle) or not other.active or any(other is h for h in handles):
            continue
        if not whole.is_pipeline:
            raise IncompatibleModeError(
                f"{type(module).__name__} is already placed by memmode mode {other.mode!r} applied to "
                f"{type(other.target).__name__}, as its component {_name_in(other, module)!r}; placing it alone "
                f"would take that mode off the rest of the pipeline. Call remove() on that first, or apply the "
                f"mode to a pipeline that has this component (the placement then moves to it)"
            )
        handles.append(other)
    return handles


def put_back(previous: Handle, failure: BaseException, quantized: dict, install: Installer) -> None:
    """A re-apply failed after the old mode was removed: put the old mode back (installed by ``install``), so that
    a refused apply changes nothing. The old handle becomes active again."""
    if previous.active:
        return
    try:
        prepared = prepare_again(previous.prepared)  # the weights may have changed since it was prepared
        runtime, ledger = install(prepared)
    except BaseException as again:
        logger.error(
            "memmode: the new mode failed (%s) and the previous mode %s could not be put back (%s); "
            "the weights are in ordinary memory",
            failure,
            previous.mode,
            again,
        )
        return
    previous.put_back(prepared, runtime, ledger)
    if quantized:
        logger.warning(
            "memmode: the new mode failed after quantizing %s; the previous mode %s is back, on the quantized weights",
            ", ".join(quantized),
            previous.mode,
        )


def say_moves(prepared: Prepared, taken_off: list[Handle]) -> None:
    """Say which placements moved here from another target, and what they placed that is placed no more."""
    obj = prepared.internal.whole.obj
    placed = {id(m) for m in prepared.internal.target.components.values()}
    for old in taken_off:
        if old.target is obj:
            continue
        left = [name for name, m in old.components.items() if id(m) not in placed]
        unplaced = f"; its {', '.join(left)} no longer placed (not placed by the new mode)" if left else ""
        logger.info(
            "memmode: the placement moved from %s (mode %s) to %s (mode %s)%s",
            _describe(old.target),
            old.mode,
            _describe(obj),
            prepared.mode,
            unplaced,
        )


def _name_in(handle: Handle, module: nn.Module) -> str:
    return next((name for name, m in handle.components.items() if m is module), "?")


def _describe(obj: Any) -> str:
    return f"{type(obj).__name__} at {id(obj):#x}"
