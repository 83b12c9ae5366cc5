"""bitsandbytes NF4 checkpoints made in code, laid out as diffusers and transformers save them, for tests of an NF4
reader (the plugin guide's memmode-nf4) — without bitsandbytes, which needs an accelerator to quantize.

A model loaded with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`` and saved with
``save_pretrained`` is a safetensors file in which each 4-bit linear layer is its weight and the tensors of
bitsandbytes' ``QuantState.as_dict(packed=True)`` (``Linear4bit._save_to_state_dict`` puts them under
``<layer>.weight.``):

- ``<layer>.weight``: uint8 ``[(n + 1) // 2, 1]``, the ``n`` values' 4-bit codes two a byte, the first in the high
  nibble (``quantize_4bit``; the default backend's ``_dequantize_4bit_impl`` reads ``A >> 4`` first);
- ``.absmax``: float32, one per block of ``blocksize`` (64) values of the flattened weight;
- ``.quant_map``: float32 ``[16]``, the NF4 levels (``get_4bit_type("nf4")``);
- ``.quant_state.bitsandbytes__nf4``: uint8, the JSON bytes of ``{"quant_type", "blocksize", "dtype", "shape"}``
  (``pack_dict_to_tensor``), ``dtype`` written ``str(dtype).strip("torch.")``;
- with double quantization (``bnb_4bit_use_double_quant=True``, ``compress_statistics``): ``.absmax`` is uint8, the
  codes of ``absmax - offset`` (``offset = absmax.mean()``) quantized blockwise over 256 values with bitsandbytes'
  8-bit dynamic map, stored as ``.nested_absmax`` (float32, one per 256) and ``.nested_quant_map`` (float32
  ``[256]``), and the JSON gains ``nested_blocksize``, ``nested_dtype`` and ``nested_offset``.

Quantizing is bitsandbytes': each block's absmax, each value divided by it and given the nearest level. The
module also keeps what it quantized (:class:`Quantized`): the codes unpacked and the value each weight decodes
to, computed here from them (block by block, not from the packed bytes), the independent reference a reader's
decoding is compared with.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

#: the 16 NF4 levels, bitsandbytes' ``get_4bit_type("nf4")`` (normal quantiles scaled to [-1, 1])
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
BLOCKSIZE = 64
#: the block of the absmax' own quantization with double quantization (``quantize_blockwise(..., blocksize=256)``)
NESTED_BLOCKSIZE = 256
QUANT_STATE = "quant_state.bitsandbytes__nf4"


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (``create_dynamic_map(signed=True)``): the nested quant map."""
    data: list[float] = []
    for i in range(7):  # max_exponent_bits = 7, non_sign_bits = 7
        boundaries = torch.linspace(0.1, 1, 2**i + 1)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist() + (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 256
    return torch.tensor(sorted(data), dtype=torch.float32)


@dataclass(frozen=True)
class Quantized:
    """One weight quantized: the tensors the file holds for it (by suffix after ``<layer>.weight``, ``""`` for the
    weight itself), its codes one per value, and the float32 value each weight decodes to."""

    tensors: dict[str, torch.Tensor]
    codes: torch.Tensor
    dequantized: torch.Tensor


def _blockwise(values: torch.Tensor, levels: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (1-D float32) as the nearest of ``levels`` after dividing each block by its absmax: the codes
    (one per value) and the absmax (one per block)."""
    count = values.numel()
    blocks = -(-count // blocksize)
    padded = torch.nn.functional.pad(values, (0, blocks * blocksize - count)).view(blocks, blocksize)
    absmax = padded.abs().amax(dim=1)
    scale = torch.where(absmax > 0, 1 / absmax, torch.zeros_like(absmax))  # bitsandbytes multiplies by 1/absmax
    normalized = padded * scale[:, None]
    codes = (normalized[..., None] - levels).abs().argmin(dim=-1).reshape(-1)[:count]
    return codes.to(torch.uint8), absmax


def _decoded(codes: torch.Tensor, levels: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    """Each code's level times its block's absmax, block by block (float32, 1-D)."""
    count = codes.numel()
    blocks = absmax.numel()
    padded = torch.nn.functional.pad(levels[codes.long()], (0, blocks * blocksize - count)).view(blocks, blocksize)
    return (padded * absmax.float()[:, None]).reshape(-1)[:count]


def quantize_nf4(weight: torch.Tensor, *, blocksize: int = BLOCKSIZE, nested: bool = False) -> Quantized:
    """``weight`` as bitsandbytes' ``quantize_4bit(weight, blocksize, compress_statistics=nested, quant_type="nf4")``
    and ``QuantState.as_dict(packed=True)`` give it."""
    nf4 = torch.tensor(NF4_LEVELS, dtype=torch.float32)
    codes, absmax = _blockwise(weight.detach().float().reshape(-1), nf4, blocksize)
    even = torch.nn.functional.pad(codes, (0, codes.numel() % 2))
    packed = ((even[0::2] << 4) | even[1::2]).to(torch.uint8).unsqueeze(1)  # the first value in the high nibble
    state = {
        "quant_type": "nf4",
        "blocksize": blocksize,
        "dtype": str(weight.dtype).strip("torch."),  # sic: bitsandbytes' own spelling of the dtype's name
        "shape": tuple(weight.shape),
    }
    tensors = {"": packed, "absmax": absmax, "quant_map": nf4}
    if nested:
        dynamic = dynamic_map()
        offset = absmax.mean()
        nested_codes, nested_absmax = _blockwise(absmax - offset, dynamic, NESTED_BLOCKSIZE)
        tensors.update(absmax=nested_codes, nested_absmax=nested_absmax, nested_quant_map=dynamic)
        state.update(nested_blocksize=NESTED_BLOCKSIZE, nested_dtype="float32", nested_offset=offset.item())
        absmax = _decoded(nested_codes, dynamic, nested_absmax, NESTED_BLOCKSIZE) + state["nested_offset"]
    tensors[QUANT_STATE] = torch.tensor(list(json.dumps(state).encode("utf-8")), dtype=torch.uint8)
    dequantized = _decoded(codes, nf4, absmax, blocksize).reshape(weight.shape)
    return Quantized({k: v.contiguous() for k, v in tensors.items()}, codes, dequantized)


def write_nf4(
    path: Path,
    state: Mapping[str, torch.Tensor],
    quantized: Iterable[str],
    *,
    nested: bool = False,
    blocksize: int = BLOCKSIZE,
) -> dict[str, Quantized]:
    """Write ``state`` to ``path`` as a bitsandbytes NF4 checkpoint: the weights named in ``quantized`` in NF4,
    every other tensor as it is. Returns what each quantized weight became."""
    quantized = set(quantized)
    tensors: dict[str, torch.Tensor] = {}
    done: dict[str, Quantized] = {}
    for key, value in state.items():
        if key not in quantized:
            tensors[key] = value.detach().contiguous()
            continue
        done[key] = quantize_nf4(value, blocksize=blocksize, nested=nested)
        for suffix, tensor in done[key].tensors.items():
            tensors[f"{key}.{suffix}" if suffix else key] = tensor
    save_file(tensors, str(path), metadata={"format": "pt"})
    return done
