"""Converting a model to qfloat8 ahead of ``apply`` — the order FSDP2 sharding needs.

Per-channel scales must be computed on whole weights. A model that is sharded with
``torch.distributed.fsdp.fully_shard`` is therefore converted first, on every rank, while its
weights are whole; ``fully_shard`` then shards the packed ``uint8`` payload like any parameter (the
scales are buffers, replicated), and ``apply(..., "<placement>_and_qfloat8_preconverted")`` installs
the dequantizing forward on the sharded model.

"Converted" means, for each packed ``nn.Linear``: its ``weight`` parameter is replaced by a
``weight_packed`` parameter holding the E4M3 bits as ``uint8`` of the original shape, a
``weight_scale`` float32 buffer of shape ``(out_features, 1)`` sits beside it, and the layer's record
says format ``qfloat8``. Until the forward is installed a converted layer has no ``weight`` and
cannot run: it never computes with the raw bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from memmode_core.plugin import DEFAULT_EXCLUDE, QuantizationSummary
from memmode_core.plugin import convert as convert_ahead

from .format import QFloat8


def convert(
    module: nn.Module, *, exclude: Iterable[str] = (), default_exclude: Iterable[str] = DEFAULT_EXCLUDE
) -> QuantizationSummary:
    """Pack ``module``'s ``nn.Linear`` weights to qfloat8 in place, without installing the forward.

    ``exclude`` and ``default_exclude`` mean what they mean to ``apply``. Call it on whole weights
    (before ``fully_shard``); a module that is already sharded, or quantized in another format, is
    refused with ``IncompatibleModeError``; converting twice does nothing the second time.
    """
    return convert_ahead(QFloat8(), module, exclude=exclude, default_exclude=default_exclude)
