"""The ``memmode`` entry point of memmode-qfloat4: registers ``qfloat4``."""

from __future__ import annotations

import memmode_core

from .format import QFloat4


@memmode_core.hookimpl
def memmode_register_quantizers(register):
    register(QFloat4())
