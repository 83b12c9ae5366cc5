"""How a component is cut into groups: sets of weights that move together.

A placement describes *what* moves as a list of :class:`GroupSpec`; the runtime decides nothing
about structure. The planner reads the same specs, so its predictions and the ledger of a real
call are computed from one structure.

Every module that owns tensors directly (its own parameters and buffers, not its children's)
belongs to exactly one group. A group is onloaded when one of its *entry* modules starts its
forward and, for streaming groups, offloaded when one of its *exit* modules finishes. Whatever a
component leaves resident when its own forward returns is offloaded then, so a group whose exit
module was skipped never stays on the device.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from torch import nn

from memmode_core.contracts.errors import InvalidOptionError


class Policy(enum.Enum):
    #: onloaded when the placement is applied, stays until it is removed
    RESIDENT = "resident"
    #: onloaded when entered, offloaded when an exit module's forward returns
    STREAM = "stream"
    #: onloaded when entered, stays until a group of another component needs the device
    EXCLUSIVE = "exclusive"


@dataclass(eq=False)
class GroupSpec:
    key: str
    component: str
    owners: list[nn.Module]
    entries: list[nn.Module] = field(default_factory=list)
    exits: list[nn.Module] = field(default_factory=list)
    policy: Policy = Policy.STREAM
    #: whether the group takes part in prefetching (a component's rest group is entered first anyway)
    prefetchable: bool = True


#: ``(path, module) -> True`` for modules whose tensors must stay on the device
KeepResident = Callable[[str, nn.Module], bool]


def owns_tensors(module: nn.Module) -> bool:
    return any(t is not None for t in module._parameters.values()) or any(
        t is not None for t in module._buffers.values()
    )


def _owners(modules: Iterable[nn.Module]) -> list[nn.Module]:
    return [m for m in modules if owns_tensors(m)]


def _key(component: str, path: str) -> str:
    return f"{component}/{path}" if path else component


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.Sequential))


def has_forward(module: nn.Module) -> bool:
    """Whether ``module`` can be called: its class defines a forward (``ModuleList``, ``ModuleDict``,
    ``ParameterList`` and a module that only holds tensors for its parent do not)."""
    return type(module).forward is not nn.Module.forward


def _component_entries(module: nn.Module) -> list[nn.Module]:
    """The component and its direct children: methods other than ``forward`` (a VAE's ``decode``
    calls ``post_quant_conv`` and ``decoder``) enter the component through one of these."""
    return [module, *(c for c in module.children() if not _is_container(c))]


def whole_component(component: str, module: nn.Module, policy: Policy) -> GroupSpec:
    """One group for the whole component (model_cpu_offload, full load)."""
    return GroupSpec(
        key=component,
        component=component,
        owners=_owners(module.modules()),
        entries=_component_entries(module) if policy is not Policy.RESIDENT else [],
        policy=policy,
        prefetchable=False,
    )


def leaf_groups(component: str, module: nn.Module, keep_resident: KeepResident | None = None) -> list[GroupSpec]:
    """One streaming group per module that owns tensors directly: leaves with weights, and parents
    with loose parameters or buffers. Modules ``keep_resident`` selects form one resident group.

    A module that owns tensors but is never called (no forward: a ``ParameterList``, a holder of a
    parent's statistics) cannot enter a group of its own, so its tensors join the group of its
    nearest ancestor that is called (the component itself at least), onloaded when that ancestor is
    entered: its parent's forward, or any of the component's methods, reads them.
    """
    groups: dict[str, GroupSpec] = {}
    kept: list[nn.Module] = []
    named = dict(module.named_modules())
    for path, sub in named.items():
        if not owns_tensors(sub):
            continue
        if keep_resident is not None and keep_resident(path, sub):
            kept.append(sub)
            continue
        host = path
        while host and not has_forward(named[host]):
            host = host.rpartition(".")[0]
        spec = groups.get(host)
        if spec is None:
            entry = named[host]
            spec = groups[host] = GroupSpec(_key(component, host or "<root>"), component, [], [entry], [entry])
        spec.owners.append(sub)
    groups = list(groups.values())
    if kept:
        groups.insert(
            0, GroupSpec(_key(component, "<resident>"), component, kept, policy=Policy.RESIDENT, prefetchable=False)
        )
    return groups


def block_groups(
    component: str, module: nn.Module, *, num_blocks_per_group: int = 1, block_modules: Iterable[str] = ()
) -> list[GroupSpec]:
    """Runs of blocks plus one "rest" group per scope.

    A scope is the component itself, or a submodule named in ``block_modules`` (diffusers' convention
    for a VAE's encoder and decoder). Inside a scope, the outermost ``ModuleList``/``Sequential``
    containers are found at any depth (a text encoder keeps its layers in ``encoder.layer``) and
    their children are chunked into groups of ``num_blocks_per_group``. Everything else in the scope
    forms the scope's rest group, onloaded when the scope (or any module of the rest, called directly)
    is entered and offloaded when the scope's forward returns.
    """
    named = dict(module.named_modules())
    missing = [p for p in block_modules if p not in named]
    if missing:
        raise InvalidOptionError(
            f"block_modules: component {component!r} has no submodule {', '.join(map(repr, missing))}"
        )
    scopes = [""] + [p for p in dict.fromkeys(block_modules) if p]
    scope_ids = {id(named[p]) for p in scopes}
    groups: list[GroupSpec] = []
    for scope in scopes:
        root = named[scope]
        rest: list[nn.Module] = []
        containers: list[tuple[str, nn.Module]] = []
        _walk_scope(root, scope, scope_ids, rest, containers, top=True)
        entries = _component_entries(root) if not scope else [root]
        # every called module of the rest enters it too: a pipeline calls some directly (a text encoder's
        # final_layer_norm for clip_skip), and the rest holds few modules
        entries += [m for m in _owners(rest) if m not in entries and has_forward(m)]
        groups.append(
            GroupSpec(
                key=_key(component, scope or "<rest>"),
                component=component,
                owners=_owners(rest),
                entries=entries,
                exits=[root],
                prefetchable=False,
            )
        )
        for path, container in containers:
            children = list(_blocks_of(container, path))
            for start in range(0, len(children), num_blocks_per_group):
                chunk = children[start : start + num_blocks_per_group]
                blocks = [m for _, m in chunk]
                first, last = chunk[0][0], chunk[-1][0]
                groups.append(
                    GroupSpec(
                        key=_key(component, first if first == last else f"{first}-{last[len(path) + 1 :]}"),
                        component=component,
                        owners=_owners(m for b in blocks for m in _modules_within(b, scope_ids)),
                        entries=blocks,
                        exits=[blocks[-1]],
                    )
                )
    return [g for g in groups if g.owners]


def _blocks_of(container: nn.Module, path: str) -> Iterator[tuple[str, nn.Module]]:
    """The blocks of a container: its children, with nested containers opened.

    A block is something that is *called*. A ``ModuleList`` inside a ``ModuleList`` (stages of
    blocks), or a ``ModuleDict``, has no forward of its own, so as a block it would never be entered
    and its weights would never be onloaded; its own children are the blocks instead. (A
    ``Sequential`` is called.)
    """
    for name, child in container.named_children():
        child_path = f"{path}.{name}"
        if not has_forward(child) and not owns_tensors(child):
            yield from _blocks_of(child, child_path)
        else:
            yield child_path, child


def _walk_scope(
    module: nn.Module,
    path: str,
    scope_ids: set[int],
    rest: list[nn.Module],
    containers: list[tuple[str, nn.Module]],
    top: bool = False,
) -> None:
    if not top and id(module) in scope_ids:
        return  # a nested scope has groups of its own
    if not top and _is_container(module):
        containers.append((path, module))
        return
    rest.append(module)
    for name, child in module.named_children():
        _walk_scope(child, f"{path}.{name}" if path else name, scope_ids, rest, containers)


def _modules_within(block: nn.Module, scope_ids: set[int]) -> Iterator[nn.Module]:
    """A block's modules, minus any nested scope."""
    yield block
    for child in block.children():
        if id(child) not in scope_ids:
            yield from _modules_within(child, scope_ids)
