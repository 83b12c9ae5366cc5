"""The decoding forward of one Wan-14B-sized linear layer in each ComfyUI weight format: memmode's packed layer
against comfy-kitchen's eager dequantize + matmul, and against the same layer in bf16.

For each format a ``--size`` x ``--size`` bf16 weight (5120: a Wan 2.1/2.2 14B attention projection) is quantized
by comfy-kitchen (ComfyUI's kernels; awq_w4a16, calibrated offline, gets random codes, scales and zeros: its
time does not depend on them) and written as ComfyUI saves a layer; then, interleaved round by round, on a batch
of ``--tokens`` bf16 activations:

- **memmode**: the layer memmode makes of the file — the ``comfy`` reader's parts, views of the file's bytes,
  attached to an ``nn.Linear`` whose forward decodes them (``QuantizedLinear``) and computes in bf16;
- **comfy-kitchen**: ``F.linear(x, qt.dequantize())`` of the same quantized tensor on its eager backend (the
  fallback ComfyUI takes where no fused kernel runs: every CPU, and GPUs without the format's hardware);
- **bf16**: ``F.linear`` of the unquantized weight.

The median and the spread (min-max) of ``--rounds`` calls each are printed, and the ratios of the medians.

    python benchmarks/comfy_formats.py [--size 5120] [--tokens 512] [--rounds 7] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from memmode_core.builtin.comfy.reader import ComfyReader
from memmode_core.contracts.quantizer import PAYLOAD
from memmode_core.quantization import attach_packed, install_forward

#: format -> (its layer config, comfy-kitchen's layout and options; None: made by hand)
FORMATS = {
    "nvfp4": ({"format": "nvfp4"}, ("TensorCoreNVFP4Layout", {})),
    "mxfp8": ({"format": "mxfp8"}, ("TensorCoreMXFP8Layout", {})),
    "float8_e4m3fn": ({"format": "float8_e4m3fn"}, ("TensorCoreFP8Layout", {})),
    "int8_tensorwise": ({"format": "int8_tensorwise"}, ("TensorWiseINT8Layout", {})),
    "int8 per row": ({"format": "int8_tensorwise"}, ("TensorWiseINT8Layout", {"per_channel": True})),
    "int8 ConvRot 256": (
        {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256},
        ("TensorWiseINT8Layout", {"per_channel": True, "convrot": True, "convrot_groupsize": 256}),
    ),
    "awq_w4a16 (g64)": ({"format": "awq_w4a16", "group_size": 64}, None),
}


def quantized(weight: torch.Tensor, layout) -> object:
    from comfy_kitchen.registry import registry
    from comfy_kitchen.tensor import QuantizedTensor, TensorCoreAWQW4A16Layout

    if layout is None:  # awq: random codes, a scale and zero per group of 64 columns, bf16
        rows, columns = weight.shape
        generator = torch.Generator().manual_seed(0)
        qdata = torch.randint(-128, 128, (rows, columns // 2), dtype=torch.int8, generator=generator)
        scale = (torch.rand(columns // 64, rows, generator=generator) * 0.01).to(torch.bfloat16)
        zero = (torch.randn(columns // 64, rows, generator=generator) * 0.01).to(torch.bfloat16)
        params = TensorCoreAWQW4A16Layout.Params(
            scale=scale, orig_dtype=weight.dtype, orig_shape=tuple(weight.shape), zeros=zero, group_size=64
        )
        return QuantizedTensor(qdata, "TensorCoreAWQW4A16Layout", params)
    name, options = layout
    with registry.use_backend("eager"):
        return QuantizedTensor.from_float(weight, name, **options)


def memmode_layer(path: Path, rows: int, columns: int, device: str) -> nn.Linear:
    """The packed layer memmode makes of the one-layer file: the reader's parts, the codec's forward, bf16."""
    contents = ComfyReader().read(path)
    (encoded,) = contents.encoded.values()
    parts = {}
    with open(path, "rb") as file:
        for name, key in encoded.parts.items():
            stored = contents.stored[key]
            file.seek(stored.start)
            data = bytearray(file.read(stored.nbytes))
            parts[name] = torch.frombuffer(data, dtype=stored.dtype).reshape(stored.shape).to(device)
    layer = nn.Linear(columns, rows, bias=False, device="meta")
    payload = nn.Parameter(parts.pop(PAYLOAD), requires_grad=False)
    attach_packed(layer, encoded.codec.format_name, torch.Size(encoded.shape), torch.bfloat16, payload, parts)
    install_forward(layer, encoded.codec, torch.bfloat16)
    return layer


def timed(fn, device: str) -> float:
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        fn()
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=5120)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--formats", nargs="*", default=list(FORMATS))
    args = parser.parse_args()
    from comfy_kitchen.registry import registry

    torch.manual_seed(0)
    device, size = args.device, args.size
    weight = (torch.randn(size, size) * 0.02).to(torch.bfloat16)
    x = torch.randn(args.tokens, size, dtype=torch.bfloat16, device=device)
    dense = weight.to(device)
    print(
        f"{size}x{size} linear, {args.tokens} bf16 tokens, {device}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; {args.rounds} rounds, interleaved; seconds per call: median [min-max]"
    )
    with tempfile.TemporaryDirectory() as folder:
        for fmt in args.formats:
            config, layout = FORMATS[fmt]
            qt = quantized(weight, layout)
            path = Path(folder) / "layer.safetensors"
            tensors = {k: v.contiguous() for k, v in qt.state_dict("layer.weight").items()}
            tensors["layer.comfy_quant"] = torch.tensor(list(json.dumps(config).encode()), dtype=torch.uint8)
            save_file(tensors, str(path))
            layer = memmode_layer(path, size, size, device)
            qt_device = qt.to(device) if device != "cpu" else qt
            runs = {
                "memmode": lambda layer=layer: layer(x),
                "comfy-kitchen": lambda qt=qt_device: F.linear(x, qt.dequantize()),
                "bf16": lambda: F.linear(x, dense),
            }
            with registry.use_backend("eager"):
                for run in runs.values():  # warm-up
                    timed(run, device)
                times = {name: [] for name in runs}
                for _ in range(args.rounds):
                    for name, run in runs.items():
                        times[name].append(timed(run, device))
            medians = {name: statistics.median(t) for name, t in times.items()}
            cells = "  ".join(f"{name} {medians[name]:.4f} [{min(t):.4f}-{max(t):.4f}]" for name, t in times.items())
            ratios = (
                f"memmode/ck {medians['memmode'] / medians['comfy-kitchen']:.2f}x, "
                f"memmode/bf16 {medians['memmode'] / medians['bf16']:.2f}x"
            )
            print(f"{fmt:18s} {cells}  | {ratios}", flush=True)


if __name__ == "__main__":
    main()
