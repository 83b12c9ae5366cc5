"""The built-in pipeline ``memmode run`` uses when no ``--model`` is given.

Public API as ``memmode_core.demo`` (``make_demo_pipeline``, ``demo_call``, ``SIZES``): plugin
authors test their plugin on it (see docs/getting-started.md).

A Wan 2.2-shaped text-to-video pipeline (two transformer experts, a UMT5 text encoder, the Wan VAE
with its feature cache) built from configs in code with random weights: nothing is downloaded,
and the same seed always builds the same weights. Its outputs are noise; what it is good for is
showing what a mode costs — the components have the structure of the real model at a size a
laptop runs in seconds.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import torch

PROMPT = "a red fox running through fresh snow at dawn"
NEGATIVE_PROMPT = "blurry, low quality, distorted"


@dataclass(frozen=True)
class DemoSize:
    heads: int
    head_dim: int
    layers: int
    text_dim: int
    text_layers: int
    vae_base_dim: int
    height: int
    width: int
    frames: int


SIZES = {
    # 0.05 M parameters per transformer (0.34 M in all): the whole run takes well under a second
    "tiny": DemoSize(
        heads=2, head_dim=16, layers=2, text_dim=32, text_layers=2, vae_base_dim=8, height=32, width=32, frames=5
    ),
    # 0.036 B parameters per transformer (0.075 B in all): timings and memory figures worth reading
    "small": DemoSize(
        heads=8, head_dim=64, layers=8, text_dim=256, text_layers=4, vae_base_dim=16, height=64, width=64, frames=9
    ),
}


def _tokenizer():
    """A unigram T5 tokenizer over the demo's words, with single characters as fallback."""
    from transformers import T5Tokenizer

    words = sorted({w.strip(string.punctuation) for w in f"{PROMPT} {NEGATIVE_PROMPT}".split()})
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + w, -1.0) for w in words] + [(c, -5.0) for c in string.printable.strip()]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=32)


def _seeded(seed: int, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


def make_demo_pipeline(size: str = "small", seed: int = 0, dtype: torch.dtype = torch.float32):
    """A fresh Wan 2.2-shaped ``diffusers.WanPipeline`` of ``size`` (a key of ``SIZES``) on the CPU.

    The same ``seed`` always builds the same weights; the progress bar is off.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(sorted(SIZES))}, not {size!r}")
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    dims = SIZES[size]
    tokenizer = _tokenizer()
    text_config = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=dims.text_dim,
        d_kv=dims.text_dim // 4,
        d_ff=2 * dims.text_dim,
        num_layers=dims.text_layers,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )

    def transformer():
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=dims.heads,
            attention_head_dim=dims.head_dim,
            in_channels=16,
            out_channels=16,
            text_dim=dims.text_dim,
            freq_dim=64,
            ffn_dim=4 * dims.heads * dims.head_dim,
            num_layers=dims.layers,
            rope_max_seq_len=64,
        )

    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=_seeded(seed + 1, lambda: UMT5EncoderModel(text_config)),
        vae=_seeded(
            seed + 2,
            lambda: AutoencoderKLWan(
                base_dim=dims.vae_base_dim,
                z_dim=16,
                dim_mult=[1, 2, 2, 2],
                num_res_blocks=1,
                temperal_downsample=[False, True, True],
            ),
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=_seeded(seed + 3, transformer),
        transformer_2=_seeded(seed + 4, transformer),
        boundary_ratio=0.875,
    )
    if dtype != torch.float32:
        for component in (pipe.transformer, pipe.transformer_2, pipe.text_encoder, pipe.vae):
            component.to(dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def demo_size(pipe) -> str:
    """The key of ``SIZES`` a pipeline from ``make_demo_pipeline`` was built with."""
    config = getattr(getattr(pipe, "transformer", None), "config", None)
    for name, dims in SIZES.items():
        if config is not None and (config.num_attention_heads, config.attention_head_dim, config.num_layers) == (
            dims.heads,
            dims.head_dim,
            dims.layers,
        ):
            return name
    raise ValueError("not a pipeline from make_demo_pipeline: pass size=")


def demo_call_kwargs(size: str = "small", steps: int = 4) -> dict:
    """The keyword arguments of one demo call (prompt, frames, resolution, steps, ``output_type='pt'``)."""
    dims = SIZES[size]
    return dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE_PROMPT,
        height=dims.height,
        width=dims.width,
        num_frames=dims.frames,
        num_inference_steps=steps,
        guidance_scale=4.0,
        guidance_scale_2=3.0,
        max_sequence_length=32,
        output_type="pt",
    )


def demo_call(pipe, *, size: str | None = None, steps: int = 4, seed: int = 0, callback=None) -> torch.Tensor:
    """One call of the demo pipeline; returns the frames as a float32 CPU tensor.

    ``size`` defaults to the size ``pipe`` was built with. The same ``seed`` gives the same output,
    so a lossless mode's output equals the full-load output exactly. ``callback`` is diffusers'
    ``callback_on_step_end``.
    """
    if size is None:
        size = demo_size(pipe)
    extra = {}
    if callback is not None:
        extra["callback_on_step_end"] = callback
    generator = torch.Generator(device="cpu").manual_seed(seed)
    frames = pipe(**demo_call_kwargs(size, steps), generator=generator, return_dict=False, **extra)[0]
    return frames.detach().to("cpu", torch.float32)
