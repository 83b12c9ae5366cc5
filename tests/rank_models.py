"""The Wan-shaped transformer the tests on several ranks run (FSDP2, context parallelism), its inputs and
forward: one place, so that each rank and the single-process reference build exactly the same model."""

from __future__ import annotations

import torch

from tiny_components import WAN_TRANSFORMER, cast, configured

#: four heads, so that Ulysses can split them over up to four ranks (the tiny pipelines' Wan has two)
WAN_FOUR_HEADS = {**WAN_TRANSFORMER, "num_attention_heads": 4, "attention_head_dim": 8}


def wan_transformer(dtype: torch.dtype = torch.float32, *, heads: int = 2) -> torch.nn.Module:
    """A Wan transformer built under seed 0, in ``dtype`` (its time embedder kept in float32, as from_pretrained
    keeps it), frozen for inference (FSDP2 refuses trainable parameters of mixed dtypes in one group)."""
    from diffusers import WanTransformer3DModel

    config = WAN_FOUR_HEADS if heads == 4 else WAN_TRANSFORMER
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = configured(WanTransformer3DModel, config)()
    if dtype != torch.float32:
        cast(model, dtype)
    return model.eval().requires_grad_(False)


def transformer_inputs(dtype: torch.dtype = torch.float32) -> dict:
    """One call's inputs: 32 latent tokens and 8 text tokens, which two or four ranks split evenly."""
    generator = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(1, 16, 2, 8, 8, generator=generator).to(dtype),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=generator).to(dtype),
        return_dict=False,
    )


def forward(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The model's output for :func:`transformer_inputs` (in the dtype of its patch embedding), as float32."""
    if dtype is None:
        dtype = model.patch_embedding.weight.dtype
    with torch.no_grad():
        return model(**transformer_inputs(dtype))[0].float()


def shard(model: torch.nn.Module, mesh) -> None:
    """FSDP2 over ``mesh``: each block, then the rest."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
