"""memmode_core's layers, bottom to top, one folder each (documented in ``memmode_core/__init__.py``).

``tests/test_import_layers.py`` checks that imports only point down these layers; ``benchmarks/call_path.py``
counts the calls that go up them at run time.

0. ``contracts/`` — interfaces and vocabulary: errors, typed options, hookspecs, devices, costs, the
   placement, quantizer, reader, resolver and storage contracts, targets, the group vocabulary
   (``group_specs``), packing, the one table of deprecated names;
1. mechanics — ``engine/`` (groups and placement layouts; the runtime, which installs and removes every hook
   of the engine and is made of parts built on one shared state: moving (with the nesting of calls), serving
   (the stand-ins of ``standins/``), changes (the one owner of rebuilds and edits) and forwards (the hooks
   around forwards and edit methods); pipeline hooks (the ``_hf_hook`` shim and the guards), named hooks,
   watch, inputs, ledger, staging, streams), ``files/`` (group files, checkpoints) and ``quantization/`` (the
   packed-layer mechanics);
2. ``discovery/`` — plugins, grammar, the first-party table (it checks registrations against the contracts);
3. ``planning/`` — the request, the prepared plan, the planner, storage costs;
4. ``builtin/`` — the built-in plugins (``auto`` uses the planner);
5. the top-level modules: applying (``prepare``, ``apply``), layer_packing (the stage ``apply`` and ``load``
   share), the handover (a mode applied over another), the handle, loading, the VideoX-Fun drop-in, the CLI
   and its demo pipeline, the plugin kit, the testing tools, the package itself.

Plugin distributions (``memmode_qfloat8``...) import ``memmode_core``: for calls they count above every layer.
"""

from __future__ import annotations

LAYERS = [
    ("contracts", ["contracts"]),
    ("mechanics", ["engine", "files", "quantization"]),
    ("discovery", ["discovery"]),
    ("planner", ["planning"]),
    ("builtin", ["builtin"]),
    # with ``storage`` and ``costs``: deprecated aliases at paths an earlier plugin guide taught
    (
        "top",
        [
            "applying",
            "layer_packing",
            "handover",
            "handle",
            "compat",
            "loading",
            "cli",
            "demo",
            "plugin",
            "testing",
            "storage",
            "costs",
        ]
        + ["__init__", "__main__"],
    ),
]
#: where a plugin distribution's modules count: above every layer of memmode_core
PLUGIN_LAYER = len(LAYERS)


def layer_of(module: str) -> int:
    """The layer of ``memmode_core.<module>`` (``module`` relative: ``"engine.moving"``, ``"__init__"``)."""
    best, rank = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    assert rank is not None, f"memmode_core.{module} is in no layer: add it to LAYERS in tests/layers.py"
    return rank


def layer_of_module(name: str) -> int:
    """The layer of a module by its full name: ``memmode_core.engine.moving``, ``memmode_core``, or a plugin's."""
    if name == "memmode_core":
        return layer_of("__init__")
    if name.startswith("memmode_core."):
        return layer_of(name[len("memmode_core.") :])
    return PLUGIN_LAYER
