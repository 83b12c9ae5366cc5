"""The demo pipeline's transformer written as a community file: what ``memmode run --transformer FILE`` runs on a
machine that has no model downloaded.

A GGUF file as llama.cpp's Python package writes one (gguf-py, which memmode-gguf brings): the denoiser's weights
under the names a ComfyUI file gives them (``model.diffusion_model.`` and the model's own names), matrices in the
asked block type, one-dimensional and small tensors in F32 as city96's converter keeps them. The weights are the
demo's own (the same seed), so the run compares with the built-in pipeline's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from memmode_core.contracts.errors import PluginNotInstalledError

#: the types gguf-py quantizes itself (the K types it only reads)
DEMO_TYPES = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "F16", "BF16")
#: city96's converter keeps tensors of at most this many elements in F32
SMALL_ELEMENTS = 1024
PREFIX = "model.diffusion_model."


def write_demo_gguf(
    path: str | os.PathLike, qtype: str = "Q8_0", *, size: str = "small", seed: int = 0, component: str = "transformer"
) -> Path:
    """Write the demo pipeline's ``component`` (``transformer`` or ``transformer_2``) of ``size`` built with ``seed``
    as a GGUF file of ``qtype`` at ``path``; returns the path. Needs gguf-py (``pip install memmode-gguf``)."""
    try:
        import gguf
        import numpy as np
    except ImportError:
        raise PluginNotInstalledError(
            "writing a GGUF file needs llama.cpp's gguf package: pip install memmode-gguf (which reads the file too)"
        ) from None
    from memmode_core.cli.demo_pipeline import make_demo_pipeline

    if qtype not in DEMO_TYPES:
        raise ValueError(f"qtype={qtype!r}: the demo file is written in one of {', '.join(DEMO_TYPES)}")
    asked = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[asked][0]
    model = getattr(make_demo_pipeline(size, seed=seed), component)
    writer = gguf.GGUFWriter(path=None, arch="wan")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, tensor in model.state_dict().items():
        values = tensor.detach().to(torch.float32).numpy()
        small = values.ndim <= 1 or values.size <= SMALL_ELEMENTS or values.ndim > 4
        kind = gguf.GGMLQuantizationType.F32 if small or values.shape[-1] % block else asked
        data = gguf.quants.quantize(np.ascontiguousarray(values), kind)
        writer.add_tensor(PREFIX + name, data, raw_dtype=kind)
    path = Path(path)
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
