"""Planning a real-size model before loading it: ``memmode plan --model DIR --height --width --num-frames``.

A Wan 2.2 A14B-shaped pipeline folder is written as ``save_pretrained`` would lay it out — two 14B transformer
experts (40 blocks, hidden 5120, ffn 13824), the UMT5-XXL text encoder (24 layers, d_model 4096) and the Wan
VAE, in bfloat16, 2 x 28.6 + 11.4 GB — but every safetensors file is sparse: its header is the real one and
its data a hole, so the folder takes no disk and no weight can be read (the planner reads headers only). The
tokenizer and scheduler are the built-in demo pipeline's (the hub is not reachable here).

Each call plans in a fresh process (``memmode plan --model ... --json``) while a thread samples its
``RssAnon`` from ``/proc``; reported: the wall time, the peak anonymous memory, and the predicted activation
peak per shape, and then each component's activation peak and FLOPs per forward. The plan is for the CPU (no
GPU here), so the workspace of the bfloat16 convolutions and attention, which is not modelled there, is named
rather than counted. The folder is deleted afterwards.

    python benchmarks/plan_real_size.py [--shapes 480x832x81,720x1280x81] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _models import released_wan_config

SAMPLE_S = 0.02
#: the UMT5-XXL encoder Wan ships (google/umt5-xxl's encoder)
UMT5_XXL = dict(
    d_model=4096,
    d_ff=10240,
    d_kv=64,
    num_heads=64,
    num_layers=24,
    num_decoder_layers=24,
    feed_forward_proj="gated-gelu",
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    is_gated_act=True,
    dense_act_fn="gelu_new",
)


def sparse_safetensors(path: Path, model) -> int:
    """Write ``model``'s state dict (on meta) as a safetensors file whose data is a hole; its size in bytes."""
    names = {"torch.bfloat16": "BF16", "torch.float32": "F32", "torch.float16": "F16", "torch.int64": "I64"}
    header, offset = {}, 0
    seen: set[int] = set()
    for key, tensor in model.state_dict().items():
        if id(tensor) in seen:  # a tied weight is written once
            continue
        seen.add(id(tensor))
        size = tensor.numel() * tensor.element_size()
        header[key] = {
            "dtype": names[str(tensor.dtype)],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(text)) + text)
        file.truncate(8 + len(text) + offset)
    return offset


def build(folder: Path) -> int:
    """The demo pipeline saved to ``folder``, then each model's config and weights replaced by real-size ones."""
    import torch
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from memmode_core.demo import make_demo_pipeline

    make_demo_pipeline("small").save_pretrained(folder)
    total = 0
    expert = released_wan_config(heads=40, layers=40, ffn_dim=13824, eps=1e-6, rope_max_seq_len=1024)
    for name in ("transformer", "transformer_2"):
        with torch.device("meta"):
            model = WanTransformer3DModel(**expert).to(torch.bfloat16)
        model.save_config(folder / name)
        total += _replace_weights(folder / name, "diffusion_pytorch_model.safetensors", model)
    with torch.device("meta"):
        vae = AutoencoderKLWan().to(torch.float32)
    vae.save_config(folder / "vae")
    total += _replace_weights(folder / "vae", "diffusion_pytorch_model.safetensors", vae)
    tokenizer_vocab = json.loads((folder / "text_encoder" / "config.json").read_text())["vocab_size"]
    config = UMT5Config(vocab_size=max(tokenizer_vocab, 256384), **UMT5_XXL, torch_dtype="bfloat16")
    with torch.device("meta"):
        encoder = UMT5EncoderModel(config).to(torch.bfloat16)
    encoder.config.save_pretrained(folder / "text_encoder")
    total += _replace_weights(folder / "text_encoder", "model.safetensors", encoder)
    return total


def _replace_weights(component: Path, name: str, model) -> int:
    for old in list(component.glob("*.safetensors")) + list(component.glob("*.index.json")):
        old.unlink()
    return sparse_safetensors(component / name, model)


def measure(folder: Path, shape: str) -> dict:
    height, width, frames = (int(v) for v in shape.split("x"))
    argv = [sys.executable, "-m", "memmode_core", "plan", "--model", str(folder), "--device", "cpu", "--json"]
    argv += ["--height", str(height), "--width", str(width), "--num-frames", str(frames), "--steps", "2"]
    began = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def sample():
        while child.poll() is None:
            try:
                with open(f"/proc/{child.pid}/status") as status:
                    for line in status:
                        if line.startswith("RssAnon:"):
                            peak[0] = max(peak[0], int(line.split()[1]) * 1024)
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = child.communicate()
    seconds = time.perf_counter() - began
    sampler.join()
    if child.returncode != 0:
        raise RuntimeError(f"plan failed ({child.returncode}):\n{err[-3000:]}")
    entries = json.loads(out)["entries"]
    full = next(e for e in entries if e["mode"] == "model_full_load")
    return {
        "shape": shape,
        "seconds": seconds,
        "peak_anon": peak[0],
        "activation_bytes": full["activation_bytes"],
        "weights": full["peak_device_bytes"],
        "unmodelled": full["unmodelled_workspace"],
        "lowest": min(e["peak_device_bytes"] + e["activation_bytes"] for e in entries),
    }


BREAKDOWN = """
import json, sys
from memmode_core.loading.load import skeleton
from memmode_core.planning.trace import trace_pipeline_call
h, w, f = (int(v) for v in sys.argv[2].split("x"))
traces = trace_pipeline_call(skeleton(sys.argv[1]), height=h, width=w, num_frames=f)
rows = {name: [t.calls, t.activation_peak, t.flops_per_call().get("", 0)] for name, t in traces.items() if t.calls}
print(json.dumps(rows))
"""


def breakdown(folder: Path, shape: str) -> dict:
    """Each component's calls, activation peak and FLOPs per call (of its forward), from the same trace."""
    done = subprocess.run(
        [sys.executable, "-c", BREAKDOWN, str(folder), shape], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="480x832x81,720x1280x81", help="HEIGHTxWIDTHxFRAMES, comma-separated")
    parser.add_argument("--keep", help="build the folder here and keep it (default: a temporary one, deleted)")
    args = parser.parse_args()
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="wan22-a14b-sparse-"))
    try:
        if not (folder / "model_index.json").is_file():
            began = time.perf_counter()
            total = build(folder)
            print(f"built {folder}: {total / 1e9:.1f} GB of weights, sparse, in {time.perf_counter() - began:.1f} s")
        gib = 2**30
        print("| shape (h x w x frames) | plan s | peak RssAnon GiB | activations GiB | full load GiB | least GiB |")
        print("|---|---:|---:|---:|---:|---:|")
        unmodelled = set()
        for shape in args.shapes.split(","):
            r = measure(folder, shape)
            unmodelled |= set(r["unmodelled"])
            print(
                f"| {shape} | {r['seconds']:.1f} | {r['peak_anon'] / gib:.2f} | {r['activation_bytes'] / gib:.2f} "
                f"| {(r['weights'] + r['activation_bytes']) / gib:.1f} | {r['lowest'] / gib:.2f} |"
            )
        if unmodelled:
            print(f"kernel workspace not modelled (named, not counted): {', '.join(sorted(unmodelled))}")
        print("\n| shape | component | calls | activation peak GiB | TFLOP per forward |\n|---|---|---:|---:|---:|")
        for shape in args.shapes.split(","):
            for name, (calls, peak, flops) in breakdown(folder, shape).items():
                tflop = f"{flops / 1e12:.1f}" if flops else "—"
                print(f"| {shape} | {name} | {calls} | {peak / gib:.3f} | {tflop} |")
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
