"""Why memmode refuses to fuse a LoRA into quantized weights: accuracy and time, measured.

On a Wan-shaped transformer (bf16, random weights) with a rank-16 LoRA on every attention and
feed-forward projection of the blocks, four ways to run the adapted model are compared with the
bf16 model whose LoRA is fused in bf16 (the exact adapted model):

- **unfused** — memmode's way: the quantized base, the adapter on top at ``weight_dtype``
  (real ``apply`` + diffusers' ``load_lora_adapter``);
- **fused, re-quantized** — what fusing into a quantized weight would have to do: dequantize, add the
  LoRA delta, quantize again (the quantization error is paid a second time, on new weights);
- **fused before quantizing** — fuse in bf16 first, then quantize (what memmode recommends when a
  fused model is needed);
- **no adapter** — the quantized base alone, for the time an unfused adapter costs.

    python benchmarks/lora_on_quantized.py [--heads 4] [--layers 12] [--rank 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _models import wan_inputs, wan_transformer  # noqa: E402
from quant_accuracy import sqnr  # noqa: E402

TARGETS = (
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out.0",
    "attn2.to_q",
    "attn2.to_k",
    "attn2.to_v",
    "attn2.to_out.0",
    "ffn.net.0.proj",
    "ffn.net.2",
)


def lora_state_dict(model, rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A LoRA whose delta is about a third of each targeted weight (diffusers' peft key format)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for path, module in model.named_modules():
        if path.startswith("blocks.") and path.count(".") >= 2 and path.split(".", 2)[2] in TARGETS:
            out_features, in_features = module.weight.shape
            a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            b = torch.randn(out_features, rank, generator=generator) * 0.3 * module.weight.float().std() / rank**0.5
            state[f"transformer.{path}.lora_A.weight"] = a.to(torch.bfloat16)
            state[f"transformer.{path}.lora_B.weight"] = (b * rank**0.5).to(torch.bfloat16)
    return state


def fused(model, lora: dict[str, torch.Tensor]):
    """A copy of ``model`` with the LoRA added into its weights (alpha = rank: scale 1)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for key, a in lora.items():
            if not key.endswith("lora_A.weight"):
                continue
            path = key[len("transformer.") : -len(".lora_A.weight")]
            layer = model.get_submodule(path)
            b = lora[key.replace("lora_A", "lora_B")]
            layer.weight += (b.float() @ a.float()).to(layer.weight.dtype)
    return model


def requantized_fuse(model, lora, quantizer):
    """The quantized model, then for every adapted layer: dequantize, add the delta, quantize again."""
    from memmode_core.quantization import packed_record

    with torch.no_grad():
        for key, a in lora.items():
            if not key.endswith("lora_A.weight"):
                continue
            layer = model.get_submodule(key[len("transformer.") : -len(".lora_A.weight")])
            record = packed_record(layer)
            packed = {name: getattr(layer, name) for name in record.names}
            weight = quantizer.unpack(packed, record.shape, torch.float32)
            weight += lora[key.replace("lora_A", "lora_B")].float() @ a.float()
            for name, tensor in quantizer.pack(weight).items():
                getattr(layer, name).data.copy_(tensor.to(getattr(layer, name).dtype))
    return model


def median_time(model, inputs, rounds: int) -> float:
    times = []
    with torch.inference_mode():
        for _ in range(rounds):
            start = time.perf_counter()
            model(**inputs)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import memmode_core as memmode
    from memmode_core.discovery.plugins import current

    def make():  # a fresh model each time: a placed or quantized model is not deep-copied
        return wan_transformer(heads=args.heads, head_dim=128, layers=args.layers, dtype=torch.bfloat16, seed=0)

    base = make()
    inputs = wan_inputs(base, frames=2, height=16, width=16, text_tokens=32)
    lora = lora_state_dict(base, args.rank)
    with torch.inference_mode():
        exact = [fused(base, lora)(**inputs)[0]]
    with torch.inference_mode():
        without_lora = sqnr(exact, [base(**inputs)[0]])
    print(
        f"Wan-shaped transformer, hidden {args.heads * 128}, {args.layers} blocks, bf16; rank-{args.rank} LoRA on "
        f"{len(lora) // 2} projections; SQNR against the LoRA fused in bf16 (the bf16 base alone: "
        f"{without_lora:.1f} dB)"
    )
    print(
        f"{'quantizer':<10}{'unfused (memmode)':>19}{'fused, re-quantized':>21}{'fused, then quantized':>23}"
        f"{'adapter time':>14}"
    )
    for name in ("qfloat8", "qfloat4"):
        quantizer = current().get("quantizer", name).obj
        unfused, plain, requantized = make(), make(), make()
        for model in (unfused, plain, requantized):
            memmode.apply(model, f"model_full_load_and_{name}", device="cpu")
        unfused.load_lora_adapter(dict(lora), prefix="transformer", adapter_name="lora")
        requantized_fuse(requantized, lora, quantizer)
        fused_first = fused(base, lora)
        memmode.apply(fused_first, f"model_full_load_and_{name}", device="cpu")
        with torch.inference_mode():
            results = {
                label: sqnr(exact, [model(**inputs)[0]])
                for label, model in (("unfused", unfused), ("requantized", requantized), ("fused_first", fused_first))
            }
        with_adapter = median_time(unfused, inputs, args.rounds)
        without = median_time(plain, inputs, args.rounds)
        print(
            f"{name:<10}{results['unfused']:>16.2f} dB{results['requantized']:>18.2f} dB"
            f"{results['fused_first']:>20.2f} dB{(with_adapter / without - 1) * 100:>12.1f} %"
        )


if __name__ == "__main__":
    main()
