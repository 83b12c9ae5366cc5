"""A weight decoded a band of rows at a time, straight into the compute dtype.

A packed layer's forward decodes its weight on every call. Decoding a whole 5120 x 13824 layer in float32 and
then rounding it to bfloat16 keeps 270 MiB of float32 beside the 135 MiB result (and the decoder's own
temporaries, often as large again) — more than the layer's group of packed weights itself, so a placement that
bounds host memory by groups (``model_group_offload`` with ``mmap``) would be bounded by the decode instead.

:func:`decode_by_rows` asks a codec for its float32 values a band of rows at a time (about :data:`BAND_VALUES`
values) and writes each band, rounded once, into the result: the values are the same bits as a whole decode
rounded once (each value is computed by the same elementwise operations, and a row never depends on another
row), and only the result and one band's temporaries are ever alive. Every codec whose rows decode independently
uses it: the rows of a payload, with a scale per row, per block of a row, or of the whole tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

#: values decoded at a time: 4 Mi (16 MiB of float32), large enough that each band's vectorised steps amortise
#: their launches, small enough that a band's temporaries are a few tens of MiB
BAND_VALUES = 1 << 22


def decode_by_rows(
    shape: torch.Size | tuple[int, ...], dtype: torch.dtype, decode: Callable[[slice], torch.Tensor]
) -> torch.Tensor:
    """The ``shape`` weight in ``dtype``, from ``decode(rows)``: the float32 values of the rows ``rows`` (a slice of
    the first dimension, shaped ``[rows, *shape[1:]]`` or any shape of that many values).

    In float32, or when the weight is one band, it is one call (the result is the float32 values themselves)."""
    shape = torch.Size(shape)
    rows = shape[0] if len(shape) else 1
    per_row = math.prod(shape[1:]) if len(shape) > 1 else 1
    step = max(1, BAND_VALUES // max(per_row, 1))
    if dtype == torch.float32 or rows <= step:
        values = decode(slice(0, rows)).reshape(shape)
        return values if values.dtype == dtype else values.to(dtype)
    band = decode(slice(0, step))
    out = torch.empty(shape, dtype=dtype, device=band.device)
    out[:step] = band.reshape(step, *shape[1:])
    del band
    for start in range(step, rows, step):
        stop = min(start + step, rows)
        out[start:stop] = decode(slice(start, stop)).reshape(stop - start, *shape[1:])
    return out
