"""The ``memmode`` entry point of memmode-qfloat4: registers ``qfloat4``."""

from __future__ import annotations

from memmode_core.plugin import hookimpl

from .format import QFloat4

#: the plugin kit this plugin is built for (memmode_core.plugin.KIT_VERSION; docs/versioning.md)
MEMMODE_KIT = "1.0"


@hookimpl
def memmode_register_quantizers(register):
    register(QFloat4())
