"""The group engine: what moves together (``groups``, laid out by ``laying_out``), moving it (``runtime``:
``moving``, ``changes``, ``forwards``), the named hooks it installs (``hooks``, ``pipeline_hooks``), and its
helpers (``inputs``, ``reads``, ``watch``, ``ledger``, ``staging``, ``streams``).

Resting and quantized weights are stand-ins (``standins``), served by ``standin_dispatch``: imported here, so
that the stand-in classes' hooks are set before any module of the engine can make one."""

from memmode_core.engine import standin_dispatch  # noqa: F401 - sets the stand-in classes' hooks
