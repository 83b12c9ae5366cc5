"""The group engine: what moves together (``groups``, laid out by ``placement_layout``), moving it (``runtime``:
one object made of parts that share a ``state`` — ``moving``, ``serving``, ``changes``, ``forwards`` — which
installs and removes every hook the engine puts on a model or pipeline), the named hooks it installs (``hooks``,
``component_hooks``, ``pipeline_hooks``), and its helpers (``inputs``, ``watch``, ``replacements``, ``ledger``,
``staging``, ``streams``, ``copying``).

Resting and quantized weights are stand-ins: the package ``standins``, imported here, so that the stand-in
classes' hooks are set before any module of the engine can make one."""

from memmode_core.engine import standins  # noqa: F401 - sets the stand-in classes' hooks
