"""Small models for ``test_diffusers_offload_port``: the shapes diffusers' group-offloading tests
exercise, rebuilt here so that nothing is downloaded and every build with one seed is bit-identical.

- :class:`BlockModel` — a stem, a ``ModuleList`` of MLP blocks, a head (diffusers' ``DummyModel``);
- :class:`ReorderedBlockModel` — two block lists created in one order and called in the other;
- :class:`NormTailModel` — a ``LayerNorm`` after the blocks: a module with parameters that belongs to
  no block, called between the last block and the head;
- :class:`StandaloneLayersModel` — no block list at all;
- :class:`NestedContainerModel` — the only block list sits two containers deep, next to a norm and
  projections that belong to no block;
- :class:`SinglePipeline` — a ``DiffusionPipeline`` with one component, called twice per run;
- :func:`tiny_autoencoder`, :func:`tiny_flux_transformer`, :func:`tiny_wan_transformer` — real
  diffusers models at test sizes (built with ``tiny_components.seeded``), with :func:`model_inputs` to call them.

Sizes are chosen so that every forward runs in about a millisecond on one CPU thread.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, DiffusionPipeline, FluxTransformer2DModel, WanTransformer3DModel
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from tiny_components import FLUX_BLOCKS, WAN_TRANSFORMER, blocks, configured

FEATURES = 16


class MLPBlock(nn.Module):
    def __init__(self, features: int = FEATURES) -> None:
        super().__init__()
        self.proj_in = nn.Linear(features, 2 * features)
        self.act = nn.ReLU()
        self.proj_out = nn.Linear(2 * features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(self.act(self.proj_in(x)))


class BlockModel(ModelMixin):
    def __init__(self, features: int = FEATURES, num_blocks: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(features, features)
        self.blocks = nn.ModuleList(MLPBlock(features) for _ in range(num_blocks))
        self.head = nn.Linear(features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ReorderedBlockModel(ModelMixin):
    """``single_blocks`` are created first and run last: execution order is not creation order."""

    def __init__(self, features: int = FEATURES, num_double: int = 3, num_single: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(features, features)
        self.single_blocks = nn.ModuleList(MLPBlock(features) for _ in range(num_single))
        self.double_blocks = nn.ModuleList(MLPBlock(features) for _ in range(num_double))
        self.head = nn.Linear(features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        for block in [*self.double_blocks, *self.single_blocks]:
            x = block(x)
        return self.head(x)


class NormTailModel(BlockModel):
    def __init__(self, features: int = FEATURES, num_blocks: int = 2) -> None:
        super().__init__(features, num_blocks)
        self.norm = nn.LayerNorm(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class StandaloneLayersModel(ModelMixin):
    def __init__(self, features: int = FEATURES) -> None:
        super().__init__()
        self.layer1 = nn.Linear(features, 2 * features)
        self.layer2 = nn.Linear(2 * features, 2 * features)
        self.layer3 = nn.Linear(2 * features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer3(self.layer2(torch.relu(self.layer1(x))))


class _InnerContainer(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(features, features) for _ in range(2))
        self.norm = nn.LayerNorm(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class _Between:
    """A module between two ``Linear`` layers, called in turn; ``NAMES`` are the three attributes."""

    NAMES: tuple[str, str, str]

    def _build(self, features: int, middle) -> None:
        """The three in order (``middle()`` makes the middle module): the weights follow the creation order."""
        first, inner, last = self.NAMES
        setattr(self, first, nn.Linear(features, features))
        setattr(self, inner, middle())
        setattr(self, last, nn.Linear(features, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, inner, last = (getattr(self, name) for name in self.NAMES)
        return last(inner(first(x)))


class _OuterContainer(_Between, nn.Module):
    NAMES = ("proj_in", "inner", "proj_out")

    def __init__(self, features: int) -> None:
        super().__init__()
        self._build(features, lambda: _InnerContainer(features))


class NestedContainerModel(_Between, ModelMixin):
    NAMES = ("input_layer", "container", "output_layer")

    def __init__(self, features: int = FEATURES) -> None:
        super().__init__()
        self._build(features, lambda: _OuterContainer(features))


class SinglePipeline(DiffusionPipeline):
    model_cpu_offload_seq = "model"

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.register_modules(model=model)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = x + 0.1 * self.model(x)
        return x


def tiny_autoencoder(use_quant_conv: bool = True) -> AutoencoderKL:
    return configured(
        AutoencoderKL,
        {
            "block_out_channels": (4, 8),
            "in_channels": 3,
            "out_channels": 3,
            "latent_channels": 4,
            "norm_num_groups": 2,
            "layers_per_block": 1,
            **blocks(*["DownEncoderBlock2D"] * 2),
            "use_quant_conv": use_quant_conv,
            "use_post_quant_conv": use_quant_conv,
        },
    )()


def tiny_flux_transformer() -> FluxTransformer2DModel:
    config = {"in_channels": 4, "attention_head_dim": 8, "joint_attention_dim": 16, "pooled_projection_dim": 16}
    return configured(FluxTransformer2DModel, FLUX_BLOCKS, config, {"axes_dims_rope": (2, 2, 4)})()


def tiny_wan_transformer() -> WanTransformer3DModel:
    """Wan keeps RoPE tables in buffers and modulation tables in loose parameters."""
    config = {
        "attention_head_dim": 8,
        "in_channels": 4,
        "out_channels": 4,
        "text_dim": 16,
        "freq_dim": 16,
        "ffn_dim": 16,
    }
    return configured(WanTransformer3DModel, WAN_TRANSFORMER, config)()


def model_inputs(model: nn.Module, seed: int = 1) -> dict:
    """Keyword arguments for one call of a model built here (fixed random values)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    if isinstance(model, AutoencoderKL):
        return {"sample": randn(1, 3, 16, 16)}
    if isinstance(model, FluxTransformer2DModel):
        image_tokens, text_tokens = 16, 4
        return {
            "hidden_states": randn(1, image_tokens, 4),
            "encoder_hidden_states": randn(1, text_tokens, 16),
            "pooled_projections": randn(1, 16),
            "timestep": torch.tensor([0.5]),
            "img_ids": torch.zeros(image_tokens, 3),
            "txt_ids": torch.zeros(text_tokens, 3),
            "return_dict": False,
        }
    if isinstance(model, WanTransformer3DModel):
        return {
            "hidden_states": randn(1, 4, 2, 8, 8),
            "encoder_hidden_states": randn(1, 4, 16),
            "timestep": torch.tensor([500]),
            "return_dict": False,
        }
    return {"x": randn(3, FEATURES)}


def forward(model: nn.Module, seed: int = 1, device: str | torch.device = "cpu") -> torch.Tensor:
    """The model's main output for :func:`model_inputs` (moved to ``device``), under ``no_grad``, on the CPU."""
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in model_inputs(model, seed).items()}
    with torch.no_grad():
        out = model(**inputs)
    if isinstance(out, tuple):
        out = out[0]
    return getattr(out, "sample", out).cpu()
