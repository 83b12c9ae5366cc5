"""Fitting group offload to the device: which groups stay, which stream, how far prefetch looks ahead.

Plain group offload moves every group on every forward, whatever the device holds: a 28 GB model on a 24 GB
card moves 28 GB per step where 4 GB would do. Given ``vram_budget`` (bytes of weights the device may hold),
:func:`fit` keeps groups on the device for as long as their component runs (``Policy.EXCLUSIVE``: onloaded
when first entered, left there until another component needs the device or the pipeline call ends) and
streams only the rest:

- the groups a component enters first and holds through its whole call (its "rest" group, its own loose
  parameters) are on the device during the call anyway: keeping them costs no peak and saves their move
  on every forward, so they are always kept;
- of the groups entered one after another (blocks, leaves), as few as possible are streamed, and those
  are spread evenly among the kept ones, each at the end of a run of kept groups: its copy is issued when
  the streamed group before it is entered, and overlaps the compute of that group and of the whole run of
  kept groups before it, instead of only one group's. Given each group's compute for the call (the planner's
  trace, when the call's shapes are known), the runs are chosen by compute, not count (see :func:`spread`):
  where blocks differ (Flux's double and single blocks) no copy is left with little compute to hide behind;
- what the budget leaves once the kept groups are chosen goes to prefetch depth: with room for ``k`` more
  streamed groups, prefetch runs ``1 + k`` groups ahead (at most as many as stream).

The device serves one component at a time (a component taking the device offloads what idle ones left),
so each component is fitted to the whole budget in turn: Wan 2.2's two experts, its text encoder and its VAE
share it across a call. Groups placed resident for good (``Policy.RESIDENT``) count against it for all.

Peak weight bytes of a component's call are then, exactly as the planner's replay and the ledger count them:
resident + its kept groups + (1 + lookahead) x its largest streamed group (1 x without prefetch). A budget
below what streaming every group needs is refused, before anything is touched, saying what it needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from torch import nn

from memmode_core.contracts.errors import InvalidOptionError
from memmode_core.contracts.group_specs import GroupSpec, Policy
from memmode_core.contracts.units import format_bytes
from memmode_core.engine.groups import Group
from memmode_core.engine.placement_layout import keep_while_running


class BudgetTooSmallError(InvalidOptionError):
    """``vram_budget`` is below what streaming every group needs; the message says what it needs."""


@dataclass(frozen=True)
class Residency:
    """What :func:`fit` decided: the keys of the groups kept while their component runs, how many groups
    ahead each component prefetches, and each component's predicted peak of weight bytes."""

    budget: int
    kept: frozenset[str] = frozenset()
    lookahead: Mapping[str, int] = field(default_factory=dict)
    peaks: Mapping[str, int] = field(default_factory=dict)

    def apply(self, items: Iterable[Group | GroupSpec]) -> None:
        """Make the kept groups stay while their component runs."""
        keep_while_running(items, self.kept)

    def describe(self) -> str:
        depth = sorted(set(self.lookahead.values()))
        ahead = f", prefetching {'/'.join(map(str, depth))} ahead" if depth else ""
        return f"vram_budget {format_bytes(self.budget)}: {len(self.kept)} groups kept{ahead}"


def idle_roots(component: nn.Module) -> list[nn.Module]:
    """Submodules a default call does not run: an autoencoder's encoder side (a text-to-image/video
    call only decodes) and a vision-language text encoder's vision tower (the prompt is text)."""
    roots = []
    if callable(getattr(component, "decode", None)) and isinstance(getattr(component, "decoder", None), nn.Module):
        roots += [m for name in ("encoder", "quant_conv") if isinstance(m := getattr(component, name, None), nn.Module)]
    for path, module in component.named_modules():
        if path.split(".")[-1] == "visual" and path.count(".") <= 1:
            roots.append(module)
    return roots


def encloses(group: Group, root: nn.Module) -> bool:
    """Whether ``group`` is on the device for its component's whole call: entered at the component itself
    (not prefetchable: a rest group), or holding the component's own parameters."""
    return not group.prefetchable or any(slot.owner is root for slot in group.slots)


def idle_groups(groups: Iterable[Group], components: Mapping[str, nn.Module]) -> set[int]:
    """``id`` of the groups a default call never enters (see :func:`idle_roots`)."""
    idle_ids = {
        name: {id(m) for root in idle_roots(component) for m in root.modules()}
        for name, component in components.items()
    }
    return {id(g) for g in groups if g.slots and all(id(slot.owner) in idle_ids[g.component] for slot in g.slots)}


def spread(count: int, streamed: int, weights: Sequence[float] | None = None) -> list[int]:
    """Indices of ``streamed`` of ``count`` groups in sequence, each at the end of a run of kept ones.

    The copy of a streamed group overlaps the compute from the streamed group before it (or the call's start)
    up to itself: its window. Without ``weights`` (or all zero) the runs are even in count. With each group's
    compute as ``weights``, the choice that hides the worst-hidden copy best is taken, whatever the ratio of
    copy to compute time turns out to be: of the runs even in count, even in compute, and the two ways of
    making the smallest window as large as it can be (windows closed as early, or as late, as they can), the
    one whose windows, smallest first, are largest (leximin)."""
    if not streamed:
        return []
    by_count = [round((k + 1) * count / streamed) - 1 for k in range(streamed)]
    total = sum(weights) if weights is not None else 0
    if total <= 0:
        return by_count
    ends = list(accumulate(weights))

    def windows(picks: list[int]) -> list[float]:
        starts = [0, *picks[:-1]]
        return sorted((ends[p - 1] if p else 0.0) - (ends[s - 1] if s else 0.0) for s, p in zip(starts, picks))

    largest_smallest = _largest_smallest_window(weights, streamed)
    candidates = [
        by_count,
        _even_shares(ends, streamed),
        _closed_early(weights, streamed, largest_smallest),
        _closed_late(weights, streamed, largest_smallest),
    ]
    return max((c for c in candidates if len(c) == streamed), key=windows)


def _even_shares(ends: list[float], streamed: int) -> list[int]:
    """Each pick the group whose end is closest to the next even share of the compute (later on a tie)."""
    picks: list[int] = []
    for k in range(1, streamed + 1):
        low, high = (picks[-1] + 1 if picks else 0), len(ends) - (streamed - k) - 1
        target = k * ends[-1] / streamed
        picks.append(min(range(low, high + 1), key=lambda i: (abs(ends[i] - target), -i)))
    return picks


def _closed_early(weights: Sequence[float], streamed: int, threshold: float) -> list[int]:
    """Picks closing each window as soon as it reaches ``threshold`` (fewer than ``streamed`` if it cannot)."""
    picks: list[int] = []
    window = 0.0
    for i, weight in enumerate(weights):
        if len(picks) == streamed:
            break
        if window >= threshold:
            picks.append(i)
            window = 0.0
        window += weight
    return picks


def _closed_late(weights: Sequence[float], streamed: int, threshold: float) -> list[int]:
    """Picks from the last group backwards, each as late as leaves the window after it at ``threshold``."""
    picks = [len(weights) - 1]
    window = 0.0
    for i in range(len(weights) - 2, -1, -1):
        if len(picks) == streamed:
            break
        window += weights[i]
        if window >= threshold and i > 0:
            picks.append(i)
            window = 0.0
    picks.reverse()
    first_window = sum(weights[: picks[0]])
    return picks if len(picks) == streamed and first_window >= threshold else []


def _largest_smallest_window(weights: Sequence[float], streamed: int) -> float:
    """The largest threshold that ``streamed`` consecutive windows can each reach (bisection)."""
    low, high = 0.0, float(sum(weights))
    for _ in range(60):
        middle = (low + high) / 2
        if len(_closed_early(weights, streamed, middle)) == streamed:
            low = middle
        else:
            high = middle
    return low


def _weigh(
    sequence: list[Group], sizes: Mapping[str, int], base: int, picked: set[int], prefetch: bool
) -> tuple[int, int, int]:
    """(peak with one group ahead, bytes staying, the largest streamed group) with the ``picked`` indices of
    ``sequence`` streamed and the rest kept beside ``base``."""
    moving = [sizes[g.key] for i, g in enumerate(sequence) if i in picked]
    staying = sum(sizes[g.key] for i, g in enumerate(sequence) if i not in picked)
    largest = max(moving, default=0)
    depth = min(1, len(picked)) if prefetch else 0
    return (base + staying + (1 + depth) * largest if moving else base + staying), staying, largest


def fit(
    groups: list[Group],
    sizes: Mapping[str, int],
    components: Mapping[str, nn.Module],
    budget: int,
    *,
    prefetch: bool,
    compute: Mapping[str, float] | None = None,
) -> Residency:
    """Choose what stays and what streams within ``budget`` bytes of weights (see the module docstring);
    ``compute``: each group's compute in the call (FLOPs or seconds), to spread the streamed groups by."""
    idle = idle_groups(groups, components)
    resident = sum(sizes[g.key] for g in groups if g.policy is Policy.RESIDENT)
    room = budget - resident
    kept: set[str] = set()
    lookahead: dict[str, int] = {}
    peaks: dict[str, int] = {}
    for name, root in components.items():
        mine = [g for g in groups if g.component == name and g.policy is Policy.STREAM and id(g) not in idle]
        held = [g for g in mine if encloses(g, root)]
        sequence = [g for g in mine if not encloses(g, root)]
        base = sum(sizes[g.key] for g in held)
        smallest = None

        # as few streamed as fit, counted with runs even in count (cheap); then, given the call's compute,
        # the same number placed by compute if that fits too (its groups may differ in size)
        for streamed in range(len(sequence) + 1):
            picked = set(spread(len(sequence), streamed))
            peak, staying, largest = _weigh(sequence, sizes, base, picked, prefetch)
            if peak <= room:
                break
            smallest = peak if smallest is None else min(smallest, peak)
        else:
            raise BudgetTooSmallError(
                f"vram_budget={format_bytes(budget)} is too small for component {name!r}: its groups need at least "
                f"{format_bytes(resident + smallest)} of weights on the device"
                + (f" ({format_bytes(resident)} resident for good)" if resident else "")
            )
        if compute and streamed:
            by_compute = set(spread(len(sequence), streamed, [compute.get(g.key, 0.0) for g in sequence]))
            weighed = _weigh(sequence, sizes, base, by_compute, prefetch)
            if weighed[0] <= room:
                picked, (peak, staying, largest) = by_compute, weighed
        if prefetch and largest:  # the room left goes to looking further ahead
            depth = min(streamed, 1 + (room - peak) // largest)
            peak = base + staying + (1 + depth) * largest
        kept.update(g.key for g in held)
        kept.update(g.key for i, g in enumerate(sequence) if i not in picked)
        if prefetch and largest:
            lookahead[name] = depth
        peaks[name] = resident + peak
    return Residency(budget, frozenset(kept), lookahead, peaks)
