"""Layer 3, planning: one request, one plan per concrete mode, computed once, and what it would cost.

``request`` resolves what was asked against the installed plugins and checks it, before the target is looked
at; ``prepared`` prepares a concrete mode for a target (claimed groups, layer selections, sizes) into the
:class:`~memmode_core.planning.prepared.Prepared` that ``apply`` executes. The planner prices such plans:
``calls`` (the call priced for, traced at its shapes by ``trace``), ``replay`` (the engine's policies over
it), ``pricing`` (a ``PlanEntry``, with ``measuring``: what a storage costs, measured where it is not
declared, and ``timing``), ``candidates`` (every mode prepared and priced), ``residency`` (what a device
budget keeps), ``budgets`` and ``choosing`` (what fits, what ``auto`` takes), ``planner`` (``plan``).
Above discovery (it enumerates the installed plugins), below the built-in plugins: ``auto`` resolves its
choice with the planner, and the planning layer never calls a resolver.
"""
