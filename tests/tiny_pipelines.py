"""Tiny, deterministic, *real* diffusers pipelines for the test suite: every family, and the functions the tests
build and call them with.

The memory-mode tests need to run actual diffusers pipelines (their real ``__call__``, text encoders, transformers,
schedulers and VAEs, including quirks such as the Wan VAE's feature cache or Wan 2.2's two transformer experts) and
compare the output under an offloading mode with the output of a fresh pipeline built the same way. Nothing is
downloaded: every component is built in code (``tiny_components`` says how), deterministic per seed, finite, and
each of a family's components influences its output.

``FAMILIES``: the five families memmode was written for, which most tests sweep: ``wan22`` (Wan 2.2 A14B layout,
two experts), ``flux``, ``sd3``, ``qwenimage`` and ``ltx`` (LTX-Video). ``ALL_FAMILIES``: name -> ``Family``, those
five and every other the suite builds (UNet, DiT, video, audio, prior, cascade, pixel-space and 3D pipelines), from
``tiny_dit_pipelines``, ``tiny_unet_pipelines``, ``tiny_video_pipelines``, ``tiny_audio_pipelines`` and
``tiny_prior_pipelines``; what the pipeline sweep runs.

API: ``make_pipeline(family, seed, dtype)``, ``call_kwargs(family, seed)``, ``run(pipe, family, seed)``,
``two_calls(pipe, family)`` and ``full_load_outputs(family, seed)``.
"""

from __future__ import annotations

import torch
from diffusers import DiffusionPipeline

import tiny_audio_pipelines
import tiny_dit_pipelines
import tiny_prior_pipelines
import tiny_unet_pipelines
import tiny_video_pipelines
from tiny_components import NEGATIVE_PROMPT, PROMPT, Family

__all__ = [
    "ALL_FAMILIES",
    "FAMILIES",
    "NEGATIVE_PROMPT",
    "PROMPT",
    "call_kwargs",
    "full_load_outputs",
    "make_pipeline",
    "run",
    "two_calls",
]

ALL_FAMILIES: dict[str, Family] = {
    **tiny_dit_pipelines.FAMILIES,
    **tiny_unet_pipelines.FAMILIES,
    **tiny_video_pipelines.FAMILIES,
    **tiny_audio_pipelines.FAMILIES,
    **tiny_prior_pipelines.FAMILIES,
}
FAMILIES: tuple[str, ...] = ("wan22", "flux", "sd3", "qwenimage", "ltx")


def make_pipeline(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> DiffusionPipeline:
    """A fresh pipeline of ``family``; all components in eval mode, on CPU, in ``dtype``."""
    return ALL_FAMILIES[family].make(seed, dtype)


def call_kwargs(family: str, seed: int = 0) -> dict:
    """Keyword arguments (a fresh dict, without ``generator``) for one small, fast call of ``family`` with call seed
    ``seed``."""
    return ALL_FAMILIES[family].call_kwargs(seed)


def run(pipe: DiffusionPipeline, family: str, seed: int = 0) -> torch.Tensor:
    """Call ``pipe`` once with a CPU generator seeded with ``seed``; its output, float32 on CPU."""
    return ALL_FAMILIES[family].run(pipe, seed)


def two_calls(pipe: DiffusionPipeline, family: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Calls with call seeds 0 and 1."""
    return run(pipe, family, 0), run(pipe, family, 1)


_FULL_LOAD: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def full_load_outputs(family: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Calls 1 and 2 (call seeds 0 and 1) of a fresh, untouched pipeline (build seed ``seed``), computed once:
    what every lossless mode must give."""
    key = (family, seed)
    if key not in _FULL_LOAD:
        _FULL_LOAD[key] = two_calls(make_pipeline(family, seed), family)
    return _FULL_LOAD[key]
