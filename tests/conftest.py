"""Shared fixtures: plugin isolation, and pipelines to compare against full load."""

from __future__ import annotations

import pytest
import torch

from memmode_core import plugins
from tiny_pipelines import FAMILIES, make_pipeline, run

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# The suite's pipelines are tiny: one thread runs them fastest, and two threads fighting over two
# busy cores make each call tens of times slower.
torch.set_num_threads(1)


#: every offloading placement, with the variants that lay groups out differently
OFFLOADING_PLACEMENTS = [
    ("model_cpu_offload", {}),
    ("model_group_offload", {"offload_type": "block_level"}),
    ("model_group_offload", {"offload_type": "leaf_level"}),
    ("sequential_cpu_offload", {}),
    ("text_encoder_offload", {}),
]


def placement_id(placement) -> str:
    mode, options = placement
    return "-".join([mode, *(f"{k}={v}" for k, v in options.items())])


@pytest.fixture(autouse=True)
def isolated_plugins(monkeypatch):
    """Every test starts from a fresh discovery with the environment variables unset."""
    monkeypatch.delenv(plugins.AUTOLOAD_ENV, raising=False)
    monkeypatch.delenv(plugins.DISABLE_ENV, raising=False)
    plugins.reset()
    yield
    plugins.reset()


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


_REFERENCE_CACHE: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def full_load_outputs(family: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Calls 1 and 2 (call seeds 0 and 1) of a fresh, untouched pipeline: what every lossless mode must give."""
    key = (family, seed)
    if key not in _REFERENCE_CACHE:
        pipe = make_pipeline(family, seed)
        _REFERENCE_CACHE[key] = (run(pipe, family, 0), run(pipe, family, 1))
    return _REFERENCE_CACHE[key]


def two_calls(pipe, family: str) -> tuple[torch.Tensor, torch.Tensor]:
    return run(pipe, family, 0), run(pipe, family, 1)


def assert_same_outputs(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], atol: float = 1e-5) -> None:
    for index, (g, e) in enumerate(zip(got, expected), start=1):
        assert torch.isfinite(g).all(), f"call {index} produced non-finite values"
        torch.testing.assert_close(g, e, atol=atol, rtol=0, msg=lambda m: f"call {index}: {m}")
