"""The ``memmode`` entry point of memmode-qfloat4: registers ``qfloat4``."""

from __future__ import annotations

from memmode_core.plugin import hookimpl

from .format import QFloat4


@hookimpl
def memmode_register_quantizers(register):
    register(QFloat4())
