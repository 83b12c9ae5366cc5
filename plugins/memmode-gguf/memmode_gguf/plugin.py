"""The ``memmode`` entry point of memmode-gguf: registers the ``gguf`` reader."""

from __future__ import annotations

from memmode_core.plugin import hookimpl

from .reader import GgufReader

#: the plugin kit this plugin is built for (memmode_core.plugin.KIT_VERSION; docs/versioning.md): 1.1 added readers
MEMMODE_KIT = "1.1"


@hookimpl
def memmode_register_readers(register):
    register(GgufReader())
