"""Weight-quantization accuracy and size on a Wan-shaped transformer: memmode qfloat8 / qfloat4 against
optimum-quanto, torchao and the reference implementation's plain float8 cast.

A diffusers ``WanTransformer3DModel`` with Wan 2.x 14B proportions (40 blocks, feed-forward 2.7x the
hidden size, 128-wide heads) at a CPU-friendly hidden size (768 by default, 6 heads; 0.6 GiB), random
weights, in bfloat16 with the modules the model keeps in float32 (``_keep_in_fp32_modules``) in
float32, as ``from_pretrained`` loads it. The hidden size matters for the bytes ratios: norms,
biases and modulation tables grow with the hidden size, weights with its square, so they are 0.5%
of the bytes at hidden 768 but 0.9% at 512 and 0.05% at 14B size. Every method quantizes a copy of
the same model; each is run on the same inputs (two timesteps) and compared with the bfloat16 model:

- **SQNR**: signal-to-quantization-noise ratio of the transformer output, in dB, over both inputs;
- **bytes**: every tensor of the model's state (parameters and buffers; for tensor subclasses, the
  tensors inside them), and the ratio to the bfloat16 model;
- **forward**: median time of a forward pass; **dequant**: the time spent rebuilding every quantized
  weight in bfloat16 once (what each forward pays for weight-only quantization), measured on its own.
  Timings are interleaved — every round runs each method once, in a rotated order — so that noise
  from other processes hits all methods alike.

Methods: memmode ``qfloat8`` and ``qfloat4`` (default exclusions, and with ``default_exclude=()`` to
quantize every ``nn.Linear`` as the others do), optimum-quanto ``qfloat8`` weights, torchao
``Float8WeightOnlyConfig`` and ``NVFP4WeightOnlyConfig``, and the reference's plain cast of every
``nn.Linear`` weight to float8 without a scale (excluding ``modulation``, its default). A method whose
library is missing or cannot run on this machine is listed with the reason instead of failing.

Targets (issue 5): qfloat8 at least quanto's SQNR with at most 0.55x the bf16 bytes; qfloat4 at least
18 dB with at most 0.30x. The bytes of memmode's formats at the full Wan 2.1 14B size are predicted
too (``select_layers`` on a meta-device model: nothing is allocated).

``--ablation`` prints the table behind memmode's default exclusions: the error each group of layers
adds to the output when it alone is quantized, and its share of the bytes.

    python benchmarks/quant_accuracy.py [--heads 6] [--layers 40] [--repeat 5] [--ablation] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _models import released_wan_config, wan_transformer  # noqa: E402

TARGETS = {"qfloat8": (None, 0.55), "qfloat4": (18.0, 0.30)}  # (SQNR floor, bytes ratio ceiling)


# -- the model -------------------------------------------------------------------------------------------


def build(heads: int, layers: int) -> nn.Module:
    """The Wan-shaped transformer in bfloat16, its declared float32 modules in float32, frozen."""
    model = wan_transformer(heads=heads, head_dim=128, layers=layers, dtype=torch.float32)
    keep = set(model._keep_in_fp32_modules or ())
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and keep.isdisjoint(name.split(".")):
                tensor.data = tensor.data.to(torch.bfloat16)
    return model.eval().requires_grad_(False)


def make_inputs(model: nn.Module) -> list[dict]:
    config = model.config
    inputs = []
    for seed, timestep in ((0, 900), (1, 300)):
        generator = torch.Generator().manual_seed(seed)
        inputs.append(
            dict(
                hidden_states=torch.randn(1, config.in_channels, 3, 16, 16, generator=generator).to(torch.bfloat16),
                timestep=torch.tensor([timestep]),
                encoder_hidden_states=torch.randn(1, 64, config.text_dim, generator=generator).to(torch.bfloat16),
                return_dict=False,
            )
        )
    return inputs


def outputs(model: nn.Module, inputs: list[dict]) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(**x)[0].float() for x in inputs]


def sqnr(reference: list[torch.Tensor], approximation: list[torch.Tensor]) -> float:
    signal = sum(r.double().pow(2).sum() for r in reference)
    noise = sum((r.double() - a.double()).pow(2).sum() for r, a in zip(reference, approximation))
    return float("inf") if noise == 0 else float(10 * torch.log10(signal / noise))


def state_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, counting the plain tensors inside tensor subclasses."""
    seen: set[int] = set()

    def size(t: torch.Tensor) -> int:
        data = t.data if isinstance(t, nn.Parameter) else t
        if type(data) is not torch.Tensor and hasattr(data, "__tensor_flatten__"):
            names, _ = data.__tensor_flatten__()
            return sum(size(getattr(data, n)) for n in names)
        return data.numel() * data.element_size()

    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += size(t)
    return total


# -- methods: each quantizes a model in place and returns a function that rebuilds its weights --------------


@dataclass
class Row:
    method: str
    sqnr_db: float | None = None
    bytes: int | None = None
    ratio: float | None = None
    forward_s: float | None = None
    dequant_s: float | None = None
    note: str = ""


def _memmode(name: str, **options) -> Callable[[nn.Module], Callable[[], None]]:
    def method(model: nn.Module):
        from memmode_core.discovery.plugins import current
        from memmode_core.quantization import packed_record, quantize_component

        quantizer = current().get("quantizer", name)
        if quantizer is None:
            raise RuntimeError(f"memmode quantizer {name!r} is not installed")
        quantize_component(quantizer.obj, model, weight_dtype=torch.bfloat16, options=options or None)
        layers = [(m, packed_record(m)) for m in model.modules() if packed_record(m) is not None]

        def dequantize_all():
            for module, record in layers:
                record.codec.unpack({n: getattr(module, n) for n in record.names}, record.shape, torch.bfloat16)

        return dequantize_all

    return method


def _plain_cast(model: nn.Module):
    """The reference implementation's qfloat8: every Linear weight cast to float8, upcast per forward."""
    from memmode_core import Quantizer
    from memmode_core.quantization import packed_record, quantize_component

    class PlainCast(Quantizer):
        name = "plain_float8_cast"

        def pack(self, weight):
            return {"weight_packed": weight.to(torch.float8_e4m3fn).view(torch.uint8)}

        def unpack(self, packed, shape, dtype):
            return packed["weight_packed"].view(torch.float8_e4m3fn).to(dtype)

    quantize_component(PlainCast(), model, weight_dtype=torch.bfloat16, options={"default_exclude": ("modulation",)})
    layers = [(m, packed_record(m)) for m in model.modules() if packed_record(m) is not None]

    def dequantize_all():
        for module, record in layers:
            record.codec.unpack({n: getattr(module, n) for n in record.names}, record.shape, torch.bfloat16)

    return dequantize_all


def _subclass_dequantizer(model: nn.Module, dequantize: Callable[[torch.Tensor], torch.Tensor]):
    weights = [
        m.weight
        for m in model.modules()
        if isinstance(m, nn.Linear)
        and type(m.weight.data if isinstance(m.weight, nn.Parameter) else m.weight) is not torch.Tensor
    ]

    def dequantize_all():
        for weight in weights:
            dequantize(weight)

    return dequantize_all


def _quanto(model: nn.Module):
    from optimum.quanto import freeze, qfloat8, quantize

    quantize(model, weights=qfloat8)
    freeze(model)
    return _subclass_dequantizer(model, lambda w: w.dequantize())


def _torchao(config_name: str):
    def method(model: nn.Module):
        from torchao.quantization import quantize_

        if config_name == "Float8WeightOnlyConfig":
            from torchao.quantization import Float8WeightOnlyConfig as config
        else:
            from torchao.prototype.mx_formats import NVFP4WeightOnlyConfig as config
        quantize_(model, config())
        return _subclass_dequantizer(model, lambda w: w.dequantize(torch.bfloat16))

    return method


METHODS: dict[str, Callable] = {
    "memmode qfloat8": _memmode("qfloat8"),
    "memmode qfloat8, every Linear": _memmode("qfloat8", default_exclude=()),
    "optimum-quanto qfloat8": _quanto,
    "torchao Float8WeightOnly": _torchao("Float8WeightOnlyConfig"),
    "reference plain float8 cast": _plain_cast,
    "memmode qfloat4": _memmode("qfloat4"),
    "memmode qfloat4, every Linear": _memmode("qfloat4", default_exclude=()),
    "torchao NVFP4WeightOnly": _torchao("NVFP4WeightOnlyConfig"),
}


def prepare(
    name: str, reference_model: nn.Module, inputs: list[dict], reference: list[torch.Tensor], reference_bytes: int
) -> tuple[Row, nn.Module | None, Callable[[], None] | None]:
    """Quantize a copy of the model with ``name``; its accuracy and size, and what to time."""
    model = copy.deepcopy(reference_model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dequantize_all = METHODS[name](model)
            got = outputs(model, inputs)
    except Exception as exc:  # a competitor that cannot run here is reported, not fatal
        return Row(name, note=f"cannot run here: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"), None, None
    nbytes = state_bytes(model)
    return Row(name, sqnr(reference, got), nbytes, nbytes / reference_bytes), model, dequantize_all


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_all(
    models: dict[str, tuple[nn.Module, Callable[[], None] | None]], inputs: dict, rounds: int
) -> dict[str, tuple[float, float | None]]:
    """Median forward and dequantization times, interleaved: each round runs every method once, in an
    order rotated from the previous round's, so that machine noise hits every method alike."""
    names = list(models)
    forward: dict[str, list[float]] = {n: [] for n in names}
    dequant: dict[str, list[float]] = {n: [] for n in names}
    with torch.inference_mode():
        for model, _ in models.values():  # warm-up
            model(**inputs)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                model, dequantize_all = models[name]
                forward[name].append(timed(lambda model=model: model(**inputs)))
                if dequantize_all is not None:
                    dequant[name].append(timed(dequantize_all))
    return {n: (statistics.median(forward[n]), statistics.median(dequant[n]) if dequant[n] else None) for n in names}


# -- the exclusion ablation ----------------------------------------------------------------------------------


def layer_group(path: str, blocks: list[str]) -> str:
    from memmode_core.quantization.selection import _inside

    if _inside(path, blocks):
        return "all blocks"
    if path == "proj_out" or path.startswith("norm_out"):
        return "head (proj_out)"
    if "time" in path:
        return "time projection"
    if "text" in path:
        return "text embedder"
    return "other stem"


def ablation(reference_model: nn.Module, inputs: list[dict], reference: list[torch.Tensor]) -> list[dict]:
    """Quantize one group of layers at a time; report its share of the bytes and the noise it adds."""
    from memmode_core.discovery.plugins import current
    from memmode_core.quantization import quantize_component, select_layers
    from memmode_core.quantization.selection import _block_paths

    total = state_bytes(reference_model)
    blocks = _block_paths(reference_model)
    plan = select_layers(current().get("quantizer", "qfloat8").obj, reference_model, options={"default_exclude": ()})
    groups: dict[str, list[str]] = {}
    for layer in plan.to_pack:
        groups.setdefault(layer_group(layer.path, blocks), []).append(layer.path)
    signal = sum(r.double().pow(2).sum() for r in reference)
    rows = []
    for group, paths in groups.items():
        weight_bytes = sum(reference_model.get_submodule(p).weight.numel() * 2 for p in paths)
        row = {"group": group, "layers": len(paths), "bytes_share": weight_bytes / total}
        for quantizer in ("qfloat8", "qfloat4"):
            model = copy.deepcopy(reference_model)
            others = [p.path for p in plan.to_pack if p.path not in paths]
            quantize_component(
                current().get("quantizer", quantizer).obj,
                model,
                weight_dtype=torch.bfloat16,
                exclude=others,
                options={"default_exclude": ()},
            )
            got = outputs(model, inputs)
            noise = sum((r.double() - a.double()).pow(2).sum() for r, a in zip(reference, got))
            row[f"{quantizer}_noise"] = float(noise / signal)
        rows.append(row)
    return rows


def predicted_at_full_size() -> dict[str, float]:
    """memmode's bytes ratio on Wan 2.1 14B (40 heads of 128, 40 blocks), from shapes alone."""
    from diffusers import WanTransformer3DModel

    from memmode_core.discovery.plugins import current
    from memmode_core.quantization import select_layers

    with torch.device("meta"):
        model = WanTransformer3DModel(**released_wan_config(heads=40, layers=40, ffn_dim=13824))
    keep = set(model._keep_in_fp32_modules)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and keep.isdisjoint(name.split(".")):
            tensor.data = tensor.data.to(torch.bfloat16)
    bf16 = state_bytes(model)
    return {
        q: select_layers(current().get("quantizer", q).obj, model).total_bytes() / bf16 for q in ("qfloat8", "qfloat4")
    }


# -- report --------------------------------------------------------------------------------------------------


def table(rows: list[Row], reference_row: Row) -> str:
    lines = [
        "| method | SQNR vs bf16 (dB) | state bytes | x bf16 | forward (s) | dequant / forward (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in [reference_row, *rows]:
        if row.note and row.sqnr_db is None:
            lines.append(f"| {row.method} | {row.note} | | | | |")
            continue
        db = "exact" if row.sqnr_db == float("inf") else f"{row.sqnr_db:.2f}"
        dequant = "-" if row.dequant_s is None else f"{row.dequant_s:.3f}"
        lines.append(
            f"| {row.method} | {db} | {row.bytes / 2**20:.1f} MiB | {row.ratio:.3f} | {row.forward_s:.2f} | {dequant} |"
        )
    return "\n".join(lines)


def verdicts(rows: dict[str, Row], full_size: dict[str, float]) -> list[str]:
    lines = []
    quanto = rows.get("optimum-quanto qfloat8")
    q8, q4 = rows["memmode qfloat8"], rows["memmode qfloat4"]
    if quanto is not None and quanto.sqnr_db is not None:
        ok = q8.sqnr_db >= quanto.sqnr_db and q8.ratio <= TARGETS["qfloat8"][1]
        lines.append(
            f"qfloat8: {q8.sqnr_db:.2f} dB vs quanto {quanto.sqnr_db:.2f} dB, {q8.ratio:.3f}x bf16 "
            f"(target >= quanto, <= 0.55x): {'met' if ok else 'MISSED'}"
        )
    else:
        lines.append(
            f"qfloat8: quanto unavailable ({quanto.note if quanto else 'not run'}); "
            f"{q8.sqnr_db:.2f} dB, {q8.ratio:.3f}x bf16"
        )
    ok = q4.sqnr_db >= TARGETS["qfloat4"][0] and q4.ratio <= TARGETS["qfloat4"][1]
    lines.append(
        f"qfloat4: {q4.sqnr_db:.2f} dB, {q4.ratio:.3f}x bf16 (target >= 18 dB, <= 0.30x): {'met' if ok else 'MISSED'}"
    )
    lines.append(
        f"predicted at Wan 2.1 14B size: qfloat8 {full_size['qfloat8']:.3f}x, qfloat4 {full_size['qfloat4']:.3f}x bf16"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=6, help="attention heads of 128 (hidden size = 128 x heads)")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds (the median is reported)")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS), metavar="METHOD")
    parser.add_argument("--ablation", action="store_true", help="also print the default-exclusion ablation")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)

    model = build(args.heads, args.layers)
    inputs = make_inputs(model)
    reference = outputs(model, inputs)
    reference_bytes = state_bytes(model)
    print(
        f"Wan-shaped transformer: hidden {128 * args.heads}, {args.layers} blocks, "
        f"{reference_bytes / 2**20:.1f} MiB in bf16; torch {torch.__version__}, {torch.get_num_threads()} threads",
        flush=True,
    )
    reference_row = Row("bf16 (reference)", float("inf"), reference_bytes, 1.0)
    rows: dict[str, Row] = {}
    timing: dict[str, tuple[nn.Module, Callable[[], None] | None]] = {reference_row.method: (model, None)}
    for name in args.methods:
        rows[name], quantized, dequantize_all = prepare(name, model, inputs, reference, reference_bytes)
        if quantized is not None:
            timing[name] = (quantized, dequantize_all)
        print(f"  {name}: {rows[name].note or f'{rows[name].sqnr_db:.2f} dB'}", flush=True)
    for name, (forward_s, dequant_s) in time_all(timing, inputs[0], args.repeat).items():
        row = rows.get(name, reference_row)
        row.forward_s, row.dequant_s = forward_s, dequant_s
    del timing
    full_size = predicted_at_full_size()
    print()
    print(table(list(rows.values()), reference_row))
    print()
    if "memmode qfloat8" in rows and "memmode qfloat4" in rows:
        for line in verdicts(rows, full_size):
            print(line)
    result = {
        "model": {"hidden": 128 * args.heads, "layers": args.layers, "bf16_bytes": reference_bytes},
        "rows": [asdict(reference_row), *map(asdict, rows.values())],
        "predicted_full_size": full_size,
    }
    if args.ablation:
        ablated = ablation(model, inputs, reference)
        print()
        print("| group (alone quantized) | layers | bytes share | qfloat8 noise | qfloat4 noise |")
        print("|---|---:|---:|---:|---:|")
        for row in ablated:
            print(
                f"| {row['group']} | {row['layers']} | {100 * row['bytes_share']:.2f}% | "
                f"{row['qfloat8_noise']:.2e} | {row['qfloat4_noise']:.2e} |"
            )
        result["ablation"] = ablated
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
