"""The four hooks a memmode plugin implements, one per kind of thing it can provide.

Each hook receives a ``register`` callback and calls it once per object it provides: a
:class:`~memmode_core.contracts.placement.Placement`, a :class:`~memmode_core.contracts.quantizer.Quantizer`, a
:class:`~memmode_core.contracts.storage.Storage` or a :class:`~memmode_core.contracts.reader.Reader` (kit 1.1).
Built-in plugins use the same hooks as installed ones.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "memmode"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def memmode_register_placements(register):
    """Call ``register(placement)`` for each placement this plugin provides."""


@hookspec
def memmode_register_quantizers(register):
    """Call ``register(quantizer)`` for each quantizer this plugin provides."""


@hookspec
def memmode_register_storages(register):
    """Call ``register(storage)`` for each storage this plugin provides."""


@hookspec
def memmode_register_readers(register):
    """Call ``register(reader)`` for each file format this plugin reads (plugin kit 1.1)."""


#: kind name -> (hook name, singular noun used in messages)
HOOK_FOR_KIND = {
    "placement": "memmode_register_placements",
    "quantizer": "memmode_register_quantizers",
    "storage": "memmode_register_storages",
    "reader": "memmode_register_readers",
}
