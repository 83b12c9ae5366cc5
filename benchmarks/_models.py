"""Wan-shaped transformers with random weights, for benchmarks (nothing downloaded)."""

from __future__ import annotations

import torch


def _config(heads: int, head_dim: int, layers: int) -> dict:
    dim = heads * head_dim
    return dict(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=16,
        out_channels=16,
        text_dim=dim,
        freq_dim=256,
        ffn_dim=max(64, int(dim * 2.7) // 64 * 64),
        num_layers=layers,
        rope_max_seq_len=1024,
    )


def released_wan_config(*, heads: int, layers: int, ffn_dim: int, text_dim: int = 4096, **extra) -> dict:
    """A ``WanTransformer3DModel`` config in the released Wan 2.x layout (head size 128 unless ``extra`` says
    otherwise): Wan 2.1 1.3B is 12 heads, ffn 8960; the 14B models are 40 heads, 40 layers, ffn 13824."""
    return dict(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=extra.pop("attention_head_dim", 128),
        in_channels=16,
        out_channels=16,
        text_dim=text_dim,
        freq_dim=256,
        ffn_dim=ffn_dim,
        num_layers=layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        **extra,
    )


def flags(args, *names: str) -> list[str]:
    """``["--name", "<value>", ...]`` for the ``args`` attributes ``names``: what a benchmark hands its children."""
    return [item for name in names for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def wan_transformer(*, heads: int, head_dim: int, layers: int, seed: int = 0, dtype=torch.float32):
    """A diffusers ``WanTransformer3DModel`` with Wan 2.x 14B proportions (feed-forward 2.7x the hidden
    size), sized by ``heads * head_dim`` and ``layers``.

    Large models are built on the meta device and filled in place in ``dtype`` (a default
    initialisation of billions of float32 parameters takes minutes); buffers computed at
    construction (the RoPE tables) are taken from a one-block instance built normally.
    """
    from diffusers import WanTransformer3DModel
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # casting a whole model to bf16 is what a benchmark wants
    config = _config(heads, head_dim, layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if heads * head_dim * layers <= 8192:
            model = WanTransformer3DModel(**config)
            return (model.to(dtype) if dtype != torch.float32 else model).eval()
        with torch.device("meta"):
            model = WanTransformer3DModel(**config)
        model = model.to_empty(device="cpu").to(dtype)
        for name, param in model.named_parameters():
            with torch.no_grad():
                if name.endswith("bias"):
                    param.zero_()
                elif param.ndim >= 2:
                    param.normal_(0.0, param.shape[-1] ** -0.5)
                else:
                    param.fill_(1.0) if "norm" in name else param.normal_(0.0, 0.02)
        small = WanTransformer3DModel(**{**config, "num_layers": 1})
        buffers = dict(small.named_buffers())
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    return model.eval()


def wan_inputs(model, *, frames: int = 1, height: int = 16, width: int = 16, text_tokens: int = 16, seed: int = 0):
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    return dict(
        hidden_states=torch.randn(1, config.in_channels, frames, height, width, generator=generator).to(dtype),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, text_tokens, config.text_dim, generator=generator).to(dtype),
        return_dict=False,
    )


def parameter_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def fill_like_initialised(name: str, tensor) -> None:
    """Random values in place, scaled as an initialised model's (biases small, matrices by their fan-in, norms
    at one): the checkpoints the benchmarks write, whose outputs stay finite through many blocks."""
    if name.endswith("bias"):
        tensor.normal_(0.0, 0.02)
    elif tensor.ndim >= 2:
        tensor.normal_(0.0, tensor.shape[-1] ** -0.5)
    else:
        tensor.fill_(1.0) if "norm" in name else tensor.normal_(0.0, 0.02)
