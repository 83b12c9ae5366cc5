"""Community checkpoints the size users run, made here: GGUF files of a Wan 2.2 A14B expert under the original
checkpoint's names, as city96's / QuantStack's files are, in a type mix like theirs.

- :func:`wan_gguf_specs`: every tensor of a Wan transformer under its original name, with the GGML type a
  ``Q4_K_M`` (or ``Q8_0``, ...) file stores it in: 1-D and small tensors F32 (as the converter keeps them), the
  feed-forward's down projection of every other block Q6_K in ``Q4_K_M`` (llama.cpp's ``_M`` rule gives more bits
  to some ``ffn_down``), the rest of the matrices in the asked type.
- :func:`write_gguf_file`: the file, either *sparse* (a real header, its data a hole: no disk, for ``plan``,
  which reads headers only) or filled with random valid blocks, written tensor by tensor (for ``load``).
"""

from __future__ import annotations

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
    # the f16 scales' places in each block (d first for the 32-value types, Q4_K/Q5_K and the i-quants; last for
    # Q2_K..Q6_K)
    where = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q5_0: [0], Q.Q4_1: [0, 2], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2]}
    where |= {Q.IQ4_NL: [0], Q.IQ4_XS: [0]}
    where |= {Q.Q2_K: [size - 4, size - 2], Q.Q3_K: [size - 2], Q.Q6_K: [size - 2]}
    for at in where[qtype]:
        blocks[:, at : at + 2] = scale
    return blocks.tobytes()
