"""Small torch models (no pipeline) that several test modules build. Imported by the child processes some
tests start too, so it imports nothing heavier than torch.

- ``Blocks`` (``make_blocks``, ``make_inputs``): a stack of small blocks, one group and one group file per block
  under block-level group offload, with deterministic weights per seed.

The others have the shapes that broke memmode on real checkpoints. None of them is tuned to one pipeline: each
reproduces a *kind* of structure that real models have.

- ``NestedTied``: an embedding and an output head sharing one weight, blocks kept two containers
  deep (stages of blocks, a ``ModuleList`` of ``ModuleList``s: no forward of their own).
- ``TiedAcrossBlocks``: the embedding inside the first block, the tied head inside the last one,
  and one ``Linear`` instance used by two blocks.
- ``DeepTiedHead``: the tied head two modules below the root (``decoder.head``), the embedding in
  another subtree.
- ``ReadsOutsideForward``: a model that reads a submodule's weight from its own forward, the way
  DiT calls ``transformer_blocks[0].norm1.emb`` — without declaring anything.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, WIDTH = 50, 16
BLOCK_WIDTH = 64
BLOCKS = 6
#: how the group keys of :class:`Blocks` under block-level ``model_group_offload`` read
BLOCK_KEY = "module/blocks.{}"


class Blocks(nn.Module):
    """A stack of small blocks (Linear + Tanh): block-level group offload makes one group, and one
    group file, per block (``module/blocks.0`` ...)."""

    def __init__(self, n: int = BLOCKS, width: int = BLOCK_WIDTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def make_blocks(seed: int = 0, n: int = BLOCKS, width: int = BLOCK_WIDTH) -> Blocks:
    """Deterministic weights for a seed; different seeds give different group files."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Blocks(n, width)


def make_inputs(seed: int, count: int = 1, batch: int = 2, width: int = BLOCK_WIDTH) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + seed)
    return [torch.randn(batch, width, generator=g) for _ in range(count)]


class NestedTied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.stages = nn.ModuleList(nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2)) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for stage in self.stages:
            for block in stage:
                h = torch.relu(block(h))
        return self.head(h)

    def tied(self) -> bool:
        return self.head.weight is self.embed.weight


class TiedAcrossBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(nn.Embedding(VOCAB, WIDTH)),
                nn.Sequential(shared, nn.ReLU()),
                nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
                nn.Sequential(shared),
                nn.Linear(WIDTH, VOCAB),
            ]
        )
        self.blocks[4].weight = self.blocks[0][0].weight

    def forward(self, ids):
        h = ids
        for block in self.blocks:
            h = block(h)
        return h

    def tied(self) -> bool:
        return self.blocks[4].weight is self.blocks[0][0].weight and self.blocks[1][0] is self.blocks[3][0]


class DeepTiedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.embed = nn.Embedding(VOCAB, WIDTH)
        self.encoder.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.decoder = nn.Module()
        self.decoder.norm = nn.LayerNorm(WIDTH)
        self.decoder.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.decoder.head.weight = self.encoder.embed.weight

    def forward(self, ids):
        h = self.encoder.embed(ids)
        for layer in self.encoder.layers:
            h = torch.relu(layer(h))
        return self.decoder.head(self.decoder.norm(h))

    def tied(self) -> bool:
        return self.decoder.head.weight is self.encoder.embed.weight


TIED_MODELS = {"nested_tied": NestedTied, "tied_across_blocks": TiedAcrossBlocks, "deep_tied_head": DeepTiedHead}


def make_tied(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TIED_MODELS[name]().eval()


def token_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(seed))


class ReadsOutsideForward(nn.Module):
    """Reads ``blocks[0].scale.weight`` from its own forward: a weight of block 0's group used
    while block 0 is not running (undeclared, unlike diffusers' ``_supports_group_offloading``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(3))
        self.blocks[0].scale = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        x = x * self.blocks[0].scale.weight.sum(dim=0)
        for block in self.blocks:
            x = block(x)
        return x
