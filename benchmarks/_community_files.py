"""Community checkpoints the size users run, made here: GGUF files of a Wan 2.2 A14B expert under the original
checkpoint's names, as city96's / QuantStack's files are, in a type mix like theirs.

- :func:`wan_gguf_specs`: every tensor of a Wan transformer under its original name, with the GGML type a
  ``Q4_K_M`` (or ``Q8_0``, ...) file stores it in: 1-D and small tensors F32 (as the converter keeps them), the
  feed-forward's down projection of every other block Q6_K in ``Q4_K_M`` (llama.cpp's ``_M`` rule gives more bits
  to some ``ffn_down``), the rest of the matrices in the asked type.
- :func:`write_gguf_file`: the file, either *sparse* (a real header, its data a hole: no disk, for ``plan``,
  which reads headers only) or filled with random valid blocks, written tensor by tensor (for ``load``).
- :func:`comfy_specs` and :func:`write_comfy_file`: the same model as a ComfyUI mixed-precision safetensors file
  (``int8_tensorwise`` or ``nvfp4`` layers declared in ``_quantization_metadata``, the rest bf16), written
  tensor by tensor.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

#: what the converter keeps in F32 (``QUANTIZATION_THRESHOLD``) and the Wan names it keeps at high precision
SMALL_ELEMENTS = 1024
HIGH_PRECISION = (".modulation", "head.modulation")


def original_wan_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The original (Wan-repository) names and shapes of a Wan transformer of diffusers ``config``."""
    import torch
    from diffusers import WanTransformer3DModel

    tests = str(Path(__file__).resolve().parent.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)  # the inverse of diffusers' Wan conversion, which the suite's fixtures keep
    from original_checkpoints import PREFIX, to_original, wan_plan

    with torch.device("meta"):
        model = WanTransformer3DModel(**config)
    state = {key: torch.empty(t.shape, device="meta") for key, t in model.state_dict().items()}
    return {key.removeprefix(PREFIX): tuple(t.shape) for key, t in to_original(wan_plan(list(state)), state).items()}


def wan_gguf_specs(shapes: dict[str, tuple[int, ...]], qtype: str) -> dict[str, tuple[tuple[int, ...], Q]]:
    """name -> (torch shape, stored type) for a file of ``qtype`` (``Q4_K_M``, ``Q8_0``, ``Q6_K``, ...)."""
    asked = Q[qtype.removesuffix("_M").removesuffix("_S")]
    specs = {}
    for name, shape in shapes.items():
        elements = int(np.prod(shape)) if shape else 1
        if len(shape) <= 1 or elements <= SMALL_ELEMENTS or len(shape) > 4 or any(h in name for h in HIGH_PRECISION):
            specs[name] = (shape, Q.F32)
            continue
        block = gguf.GGML_QUANT_SIZES[asked][0]
        if shape[-1] % block:
            specs[name] = (shape, Q.F16)
            continue
        kind = asked
        if qtype.endswith("_M") and ".ffn.2." in name and int(name.split(".")[1]) % 2 == 0:
            kind = Q.Q6_K
        specs[name] = (shape, kind)
    return specs


def _byte_shape(shape: tuple[int, ...], qtype: Q) -> tuple[int, ...]:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return (*shape[:-1], shape[-1] // block * size)


def write_gguf_file(path: Path, specs: dict[str, tuple[tuple[int, ...], Q]], *, sparse: bool, seed: int = 0) -> int:
    """Write ``specs`` as a GGUF file at ``path`` (sparse, or random valid blocks); its size in bytes."""
    writer = gguf.GGUFWriter(path=None, arch="wan")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, (shape, qtype) in specs.items():
        byte_shape = _byte_shape(shape, qtype)
        nbytes = int(np.prod(byte_shape))
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    (out,) = writer.fout
    writer.write_padding(out, out.tell())
    start = out.tell()
    alignment = writer.data_alignment
    rng = np.random.default_rng(seed)
    offset = 0
    for shape, qtype in specs.values():
        nbytes = int(np.prod(_byte_shape(shape, qtype)))
        if not sparse:
            out.seek(start + offset)
            out.write(_random_blocks(rng, shape, qtype, nbytes))
        offset += nbytes + (-nbytes % alignment)
    out.truncate(start + offset)
    out.close()
    return os.path.getsize(path)


def _random_blocks(rng: np.random.Generator, shape: tuple[int, ...], qtype: Q, nbytes: int) -> bytes:
    """Valid blocks of ``qtype`` whose values are small (as trained weights are): random codes, and every f16
    scale set to a small value so that nothing overflows."""
    if qtype == Q.F32:
        return (rng.standard_normal(int(np.prod(shape)), dtype=np.float32) * 0.02).tobytes()
    if qtype in (Q.F16, Q.BF16):
        values = rng.standard_normal(int(np.prod(shape)), dtype=np.float32) * 0.02
        return (
            values.astype(np.float16).tobytes()
            if qtype == Q.F16
            else (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        )
    raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, size)
    scale = np.frombuffer(np.float16(0.0005).tobytes(), dtype=np.uint8)
    # the f16 scales' places in each block (d first for the 32-value types, Q4_K/Q5_K and the i-quants but IQ1_M;
    # last for Q2_K..Q6_K)
    where = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q5_0: [0], Q.Q4_1: [0, 2], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2]}
    where |= {Q.IQ4_NL: [0], Q.IQ4_XS: [0], Q.IQ2_XXS: [0], Q.IQ2_XS: [0], Q.IQ2_S: [0], Q.IQ3_XXS: [0]}
    where |= {Q.IQ3_S: [0], Q.IQ1_S: [0], Q.IQ1_M: []}
    where |= {Q.Q2_K: [size - 4, size - 2], Q.Q3_K: [size - 2], Q.Q6_K: [size - 2]}
    for at in where[qtype]:
        blocks[:, at : at + 2] = scale
    if qtype == Q.IQ1_M:  # its d is the top nibbles of its last four u16 words, lowest first
        words = blocks[:, size - 8 :].copy().view(np.uint16)
        bits = np.float16(0.0005).view(np.uint16)
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
        blocks[:, size - 8 :] = words.view(np.uint8)
    return blocks.tobytes()


# == ComfyUI mixed-precision files ================================================================================

#: the formats :func:`write_comfy_file` writes, by the name ComfyUI's ``_quantization_metadata`` gives them
COMFY_FORMATS = ("int8_tensorwise", "nvfp4")
#: NVFP4's block of values sharing one E4M3 scale, and the tiles of cuBLAS' block-scale layout Comfy stores
NVFP4_BLOCK = 16
TILE_ROWS, TILE_BLOCKS = 128, 4


def comfy_specs(shapes: dict[str, tuple[int, ...]], fmt: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """tensor name -> (safetensors dtype, shape) of a ComfyUI ``fmt`` file of a model of ``shapes`` (original
    names): each large matrix a quantized layer (its weight and scales), the rest bfloat16."""
    if fmt not in COMFY_FORMATS:
        raise ValueError(f"{fmt!r}: the formats written are {COMFY_FORMATS}")
    specs: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        elements = int(np.prod(shape)) if shape else 1
        small = len(shape) != 2 or elements <= SMALL_ELEMENTS or any(h in name for h in HIGH_PRECISION)
        if small or not name.endswith(".weight") or shape[1] % 32:
            specs[name] = ("BF16", shape)
            continue
        layer = name.removesuffix(".weight")
        rows, columns = shape
        if fmt == "int8_tensorwise":
            specs[name] = ("I8", shape)
            specs[f"{layer}.weight_scale"] = ("F32", ())
        else:
            padded_rows = -(-rows // TILE_ROWS) * TILE_ROWS
            padded_blocks = -(-(columns // NVFP4_BLOCK) // TILE_BLOCKS) * TILE_BLOCKS
            specs[name] = ("U8", (rows, columns // 2))
            specs[f"{layer}.weight_scale"] = ("F8_E4M3", (padded_rows, padded_blocks))
            specs[f"{layer}.weight_scale_2"] = ("F32", ())
    return specs


def comfy_layers(specs: dict[str, tuple[str, tuple[int, ...]]], fmt: str) -> list[str]:
    """The layers of ``specs`` stored in ``fmt`` (those with a ``weight_scale``)."""
    return sorted(name.removesuffix(".weight_scale") for name in specs if name.endswith(".weight_scale"))


_ITEMSIZE = {"BF16": 2, "F32": 4, "I8": 1, "U8": 1, "F8_E4M3": 1}


def write_comfy_file(path: Path, specs: dict[str, tuple[str, tuple[int, ...]]], fmt: str, *, seed: int = 0) -> int:
    """Write ``specs`` as ComfyUI writes a mixed-precision file (the layers declared in the header's
    ``_quantization_metadata``), tensor by tensor — never more than one tensor in memory — with random values of
    a trained model's size (weights about 0.02); its size in bytes."""
    header: dict = {}
    offset = 0
    for name, (dtype, shape) in specs.items():
        nbytes = int(np.prod(shape)) * _ITEMSIZE[dtype] if shape else _ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    layers = {layer: {"format": fmt} for layer in comfy_layers(specs, fmt)}
    header["__metadata__"] = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as out:
        out.write(len(text).to_bytes(8, "little") + text)
        for name, (dtype, shape) in specs.items():
            out.write(_comfy_values(rng, name, dtype, shape))
    return os.path.getsize(path)


def _comfy_values(rng: np.random.Generator, name: str, dtype: str, shape: tuple[int, ...]) -> bytes:
    count = int(np.prod(shape)) if shape else 1
    if dtype == "BF16":
        values = rng.standard_normal(count, dtype=np.float32) * 0.02
        return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    if dtype == "F32":  # a tensor's scale: an int8 code of 127 is 0.06; an nvfp4 code of 6 with block scale 1 is 0.018
        return np.float32(0.0005 if name.endswith(".weight_scale") else 0.003).tobytes()
    if dtype == "I8":
        return rng.integers(-127, 128, count, dtype=np.int8).tobytes()
    if dtype == "U8":  # two e2m1 codes a byte, any of the 16
        return rng.integers(0, 256, count, dtype=np.uint8).tobytes()
    # E4M3 block scales between 0.5 and 1.875: exponent bits 0110/0111, any mantissa (no NaN, no zero)
    return rng.integers(0x30, 0x40, count, dtype=np.uint8).tobytes()
