"""The ``memmode`` entry point of memmode-qfloat8: registers ``qfloat8`` and ``qfloat8_preconverted``."""

from __future__ import annotations

from memmode_core.plugin import hookimpl

from .format import QFloat8, QFloat8Preconverted

#: the plugin kit this plugin is built for (memmode_core.plugin.KIT_VERSION; docs/versioning.md)
MEMMODE_KIT = "1.0"


@hookimpl
def memmode_register_quantizers(register):
    register(QFloat8())
    register(QFloat8Preconverted())
