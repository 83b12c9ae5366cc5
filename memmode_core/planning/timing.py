"""How long a call waits for weights, with compute in the model: copies hide behind the compute they overlap.

Given the call's shapes, :mod:`~memmode_core.planning.trace` counted each module's FLOPs; divided by the
device's measured rate (:func:`compute_rate`: a matrix product timed once per process), they give each
group's compute seconds. :func:`exposed_seconds` then plays one steady-state call on two clocks, the compute
stream's and the copy engine's, the way the engine issues copies:

- a group that is not on the device when entered (a component's rest group, a kept group after another
  component had the device, every streamed group without prefetch) is copied then, and compute waits for it;
- with prefetch, the copy of the ``j + lookahead``-th streamed group is issued when the ``j``-th is entered (the
  first ``lookahead`` ones when the component starts), queued behind the copies before it on the one copy
  engine, and the compute stream waits for it only if it has not landed when its group is entered.

What a call spends waiting for copies — the time the copies add to pure compute — is the figure ``auto``
minimises (``seconds_per_call``): there is no fixed share of hidden copy time, a copy is hidden exactly as far
as the compute it overlaps covers it. Without shapes there is no compute to overlap, and the planner falls
back to hiding a fixed share of a prefetching placement's copies.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from memmode_core.contracts.group_specs import Policy
from memmode_core.contracts.storage_cost import StorageCost
from memmode_core.engine.groups import Group
from memmode_core.engine.streams import Streams, active
from memmode_core.planning.residency import encloses
from memmode_core.planning.trace import ComponentTrace


def compute_rate(device: torch.device) -> float:
    """FLOP/s of a float32 matrix product on ``device`` (measured once per process and backend)."""
    return _measured_rate(active(), device)


@functools.cache
def _measured_rate(streams: Streams, device: torch.device, size: int = 512) -> float:
    host = torch.randn(size, size)
    a = host if streams.is_host(device) else streams.to_device(host, device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ a
        if streams.has_streams(device):
            streams.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / max(best, 1e-9)


def _nearest(path: str, present: Mapping[str, object]) -> str | None:
    """``path``'s nearest proper ancestor in ``present`` (the component itself is ``""``)."""
    while path:
        path = path.rpartition(".")[0]
        if path in present:
            return path
    return None


def group_flops(
    groups: Iterable[Group], components: Mapping[str, nn.Module], traces: Mapping[str, ComponentTrace]
) -> dict[str, float]:
    """FLOPs per call of each group. A module's count includes its children's; what it does itself goes to the
    group that holds the module or, for a module that holds no weight (an attention processor's container),
    to the group of its nearest ancestor that does; what reaches no group (the component's own code) goes to
    the group holding the component's own parameters, or its first group."""
    groups = list(groups)
    flops: dict[str, float] = {g.key: 0.0 for g in groups}
    for name, component in components.items():
        trace = traces.get(name)
        if trace is None or not trace.calls:
            continue
        paths = {id(m): path for path, m in component.named_modules()}
        holder = {paths[id(m)]: g.key for g in groups if g.component == name for m, _ in g.owners if id(m) in paths}
        mine = [g.key for g in groups if g.component == name]
        per_call = trace.flops_per_call()
        own = dict(per_call)
        for path, count in per_call.items():
            parent = _nearest(path, per_call)
            if parent is not None:
                own[parent] -= count
        for path, count in own.items():
            probe: str | None = path
            while probe is not None and probe not in holder:
                probe = _nearest(probe, holder) if probe else None
            key = holder[probe] if probe is not None else holder.get("", mine[0] if mine else None)
            if key is not None and count > 0:
                flops[key] += count
    return flops


def exposed_seconds(
    groups: list[Group],
    sizes: Mapping[str, int],
    idle: set[int],
    sequence: list[str],
    roots: Mapping[str, nn.Module],
    *,
    prefetch: bool,
    lookahead: Mapping[str, int],
    compute: Mapping[str, float],
    cost: StorageCost | None,
) -> float:
    """Seconds one steady-state call waits for copies (see the module docstring); ``compute``: seconds per group."""
    if cost is None:
        return 0.0

    def copy(group: Group) -> float:
        return cost.fetch_seconds(sizes[group.key], 1)

    resident = {g.key for g in groups if g.policy is Policy.RESIDENT}
    owner: dict[str, str] = {}  # kept group -> the component whose call left it on the device
    waited = 0.0
    for _ in range(2):  # the first call settles what stays (kept groups); the second is measured
        waited = 0.0
        for name in sequence:
            for key in [k for k, comp in owner.items() if comp != name]:  # another component takes the device
                resident.discard(key)
                del owner[key]
            mine = [g for g in groups if g.component == name and g.policy is not Policy.RESIDENT and id(g) not in idle]
            waited += _component_call(
                name, mine, roots[name], resident, owner, lookahead.get(name, 1) if prefetch else 0, compute, copy
            )
    return waited


def _component_call(
    name: str,
    mine: list[Group],
    root: nn.Module,
    resident: set[str],
    owner: dict[str, str],
    ahead: int,
    compute: Mapping[str, float],
    copy: Callable[[Group], float],
) -> float:
    """One call of a component on the two clocks; what it waits for copies. Updates what stays resident."""
    held = [g for g in mine if encloses(g, root)]
    ordered = [g for g in mine if not encloses(g, root)]
    streamed = [g for g in ordered if g.policy is Policy.STREAM]
    clock = engine = waited = 0.0
    ready: dict[int, float] = {}

    def arrive(group: Group) -> None:  # copied when entered: compute waits for all of it
        nonlocal clock, waited
        clock += copy(group)
        waited += copy(group)
        if group.policy is Policy.EXCLUSIVE:
            resident.add(group.key)
            owner[group.key] = name

    def issue(index: int) -> None:  # a prefetch queued on the copy engine
        nonlocal engine
        if index < len(streamed) and index not in ready:
            engine = max(clock, engine) + copy(streamed[index])
            ready[index] = engine

    for g in held:  # entered first
        if g.key not in resident:
            arrive(g)
    for index in range(ahead):
        issue(index)
    for g in ordered:
        if g.policy is Policy.STREAM and ahead:
            index = streamed.index(g)
            issue(index)
            waited += max(0.0, ready[index] - clock)
            clock = max(clock, ready[index])
            issue(index + ahead)
        elif g.policy is Policy.STREAM or g.key not in resident:
            arrive(g)
        clock += compute.get(g.key, 0.0)
    for g in held:
        clock += compute.get(g.key, 0.0)
    return waited
