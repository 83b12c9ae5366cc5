"""The quantizer contract: *how* weights are stored.

A quantizer plugin contributes only what is specific to its format:

- :meth:`Quantizer.pack` turns one full-precision ``nn.Linear`` weight into a few plain tensors,
- :meth:`Quantizer.unpack` turns those tensors back into a weight of the compute dtype,
- optionally :meth:`Quantizer.skip_reason`, for weight shapes the format cannot hold.

Everything else is core mechanics, in :mod:`memmode_core.quantization`: which layers of a component are
quantized (the exclusion filter), replacing a layer's weight by the packed tensors, the forward that unpacks
them at call time, the checks that refuse a misuse before anything is touched, the summary
``handle.report().quantization`` shows, and the size predictions of the planner. Because the predictions run
the same :meth:`pack` on meta tensors, a plugin cannot make them drift from what a real quantization stores.

A quantizer that works differently — one that replaces whole modules, say — overrides :meth:`Quantizer.check`
and :meth:`Quantizer.quantize`; core calls them in place of its layer-by-layer mechanics
(:func:`memmode_core.quantization.check` and :func:`memmode_core.quantization.quantize` are the entry
points that decide). This module is the vocabulary only: it imports nothing from the mechanics, which sit
above it.

A complete third-party quantizer is therefore a page::

    class Int8Rows(memmode_core.Quantizer):
        name = "qint8"
        description = "int8, one scale per output channel"

        def pack(self, weight):
            scale = weight.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
            q = (weight.float() / scale).round().clamp(-127, 127).to(torch.int8)
            return {"weight_packed": q, "weight_scale": scale}

        def unpack(self, packed, shape, dtype):
            return packed["weight_packed"].to(dtype) * packed["weight_scale"].to(dtype)

    @memmode_core.hookimpl
    def memmode_register_quantizers(register):
        register(Int8Rows())
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from memmode_core.contracts.options import Option, names_list

#: the key of :meth:`Quantizer.pack`'s result that takes the place of the layer's ``weight`` parameter
PAYLOAD = "weight_packed"

#: The default-exclusion rule "layers outside the repeated blocks" (a rule, not a name fragment).
OUTSIDE_BLOCKS = "<outside blocks>"

#: What every quantizer leaves at full precision unless told otherwise: the layers outside the repeated
#: blocks, measured in docs/quantizers.md ("Default exclusions, measured"). ``exclude=`` adds to it; the
#: ``default_exclude`` option replaces it.
DEFAULT_EXCLUDE: tuple[str, ...] = (OUTSIDE_BLOCKS,)

#: The option every quantizer accepts. A plugin that declares options of its own extends
#: ``Quantizer.options`` (``options = Quantizer.options + (Option(...),)``) rather than replacing it.
DEFAULT_EXCLUDE_OPTION = Option(
    "default_exclude",
    DEFAULT_EXCLUDE,
    f"what stays at full precision besides exclude= and the model's _keep_in_fp32_modules: name fragments, "
    f"and {OUTSIDE_BLOCKS!r} for the layers outside the repeated transformer blocks (the default); pass () "
    f"to quantize those too",
    names_list,
)


class Quantizer:
    """Base class of every quantizer. Subclasses set ``name`` and ``description`` and implement
    :meth:`pack` and :meth:`unpack`; the rest is core's."""

    name: str = ""
    description: str = ""
    options: tuple[Option, ...] = (DEFAULT_EXCLUDE_OPTION,)

    #: Name of the packed format. Layers remember the format they were packed in, not the
    #: quantizer: two quantizers that share a format (``qfloat8`` and ``qfloat8_preconverted``)
    #: accept each other's layers. Defaults to ``name``.
    format: str = ""

    #: False for a quantizer that only installs the dequantizing forward on layers converted
    #: beforehand (see :func:`memmode_core.quantization.convert`); it refuses a component that holds
    #: no layer in its format instead of converting it.
    packs: bool = True

    # -- what a plugin implements ----------------------------------------------------------------

    def pack(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Pack a 2-D ``(out_features, in_features)`` weight into plain tensors.

        The result maps attribute names to tensors on the weight's device. ``"weight_packed"``
        (:data:`PAYLOAD`) is required: it takes the ``weight`` parameter's place and must have an
        *integer* dtype (docs/quantizers.md, "How it works", says why). Every other entry becomes a
        buffer of the layer under its key, which must start with ``"weight_"``. ``weight`` may be of any
        floating dtype and may live on the meta device: the planner calls ``pack`` on meta tensors to
        learn the packed sizes, so use only tensor operations (no ``.item()``, no data-dependent shapes).
        """
        raise NotImplementedError

    def unpack(self, packed: Mapping[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The weight of ``shape`` in ``dtype``, from the tensors :meth:`pack` returned.

        Called on every forward, with whatever the layer's attributes hold at that moment (the
        placement may have moved them), so it must not cache anything derived from them.
        """
        raise NotImplementedError

    def skip_reason(self, shape: torch.Size) -> str | None:
        """Why a weight of ``shape`` must stay at full precision in this format, or None."""
        return None

    # -- environment ---------------------------------------------------------------------------------

    def unavailable_reason(self) -> str | None:
        """Why this quantizer cannot run in this environment, or None when it can."""
        return None

    @property
    def format_name(self) -> str:
        return self.format or self.name

    # -- optional overrides: without them, core quantizes layer by layer --------------------------------

    def check(
        self,
        components: Mapping[str, nn.Module],
        *,
        weight_dtype: torch.dtype | None,
        exclude: tuple[str, ...],
        options: Mapping[str, object],
    ) -> None:
        """Override only to replace core's checks: raise ``IncompatibleModeError`` before anything is
        touched if these components cannot be quantized.

        Not overridden, core checks layer by layer with :meth:`pack`, :meth:`skip_reason` and the
        exclusions; callers go through :func:`memmode_core.quantization.check`, which decides.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not override check(): core checks layer by layer; "
            f"call memmode_core.quantization.check(quantizer, components, ...)"
        )

    def quantize(
        self,
        component: nn.Module,
        *,
        weight_dtype: torch.dtype | None,
        exclude: tuple[str, ...],
        options: Mapping[str, object],
    ) -> Any:
        """Override only to replace core's quantizing: quantize ``component`` in place and return a summary
        of what was done (``handle.report().quantization`` shows it: a
        :class:`memmode_core.quantization.QuantizationSummary`, or any object with ``as_dict()``).

        Not overridden, core packs layer by layer with :meth:`pack` and installs the forward that calls
        :meth:`unpack`; callers go through :func:`memmode_core.quantization.quantize`, which decides.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not override quantize(): core quantizes layer by layer; "
            f"call memmode_core.quantization.quantize(quantizer, component, ...)"
        )

    def __repr__(self) -> str:
        return f"<quantizer {self.name}>"
