"""Every tiny real diffusers pipeline of the suite, in one registry: what the pipeline sweep runs.

The builders live in five modules, grouped by who they serve (each module's docstring says what is particular
to each family): ``tiny_pipelines`` (the five families memmode was written for), ``tiny_pipelines_more``
(twelve UNet, video, image-DiT and audio families), ``tiny_pipelines_prior_cascade`` (Kandinsky, unCLIP,
Würstchen, Stable Cascade, Shap-E), ``tiny_pipelines_video_audio`` (SVD, AnimateDiff, Latte, Allegro, Wan 2.1
I2V, AudioLDM 1/2, ACE-Step, Dance Diffusion) and ``tiny_pipelines_dit_pixel`` (DiT, HunyuanDiT, Lumina-Next,
PixArt-α, CogView 3/4, DeepFloyd IF, LDM, LCM, DDPM, consistency models, the SD upscaler). Their dimensions
follow diffusers' own ``get_dummy_components()``; tokenizers and encoders are built in code, nothing is
downloaded; every family is deterministic per seed, finite, and each of its components influences its output.

``FAMILIES``: name -> :class:`Family`. ``rotation()`` and ``in_rotation()``: which part of a sweep a CI run
runs (see :func:`in_rotation`).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import tiny_pipelines
import tiny_pipelines_dit_pixel
import tiny_pipelines_more
import tiny_pipelines_prior_cascade
import tiny_pipelines_video_audio
import torch


@dataclass(frozen=True)
class Family:
    name: str
    #: "unet", "dit", "video", "audio", "prior", "cascade", "pixel" or "3d"
    kind: str
    make: Callable[[int], object]
    run: Callable[[object, int], torch.Tensor]
    #: tensors the pipeline itself rewrites at every call (Shap-E's renderer copies each call's latents into
    #: its MLP's weights): ``remove()`` is not expected to give them back as a fresh build holds them
    rewritten: tuple[str, ...] = field(default_factory=tuple)
    #: why a quantized output is only checked for finiteness, not for closeness to full precision
    chaotic: str | None = None


_FIRST_KINDS = {"wan22": "video", "flux": "dit", "sd3": "dit", "qwenimage": "dit", "ltx": "video"}
_MORE_KINDS = {
    "sd15": "unet",
    "sdxl": "unet",
    "controlnet": "unet",
    "hunyuanvideo": "video",
    "cogvideox": "video",
    "mochi": "video",
    "sana": "dit",
    "pixart_sigma": "dit",
    "auraflow": "dit",
    "lumina2": "dit",
    "chroma": "dit",
    "stable_audio": "audio",
}
_REWRITTEN = {"shap_e": ("shap_e_renderer.mlp.",)}
_CHAOTIC = {
    # measured: e4m3 rounding of any single one of its 18 linear layers (weight error ~3% of the row maximum)
    # moves the untrained prior's output by 1 to 78 (output max 188); the pipeline then amplifies it further
    "wuerstchen_prior": "an untrained Würstchen prior amplifies a 3% change of any one layer's weights 10-400x",
}


def _families() -> dict[str, Family]:
    families: dict[str, Family] = {}
    for name, kind in _FIRST_KINDS.items():
        families[name] = Family(
            name,
            kind,
            lambda seed, n=name: tiny_pipelines.make_pipeline(n, seed),
            lambda pipe, seed, n=name: tiny_pipelines.run(pipe, n, seed),
        )
    for name, kind in _MORE_KINDS.items():
        families[name] = Family(
            name,
            kind,
            lambda seed, n=name: tiny_pipelines_more.make_more(n, seed),
            lambda pipe, seed, n=name: tiny_pipelines_more.run_more(pipe, n, seed),
        )
    for module in (tiny_pipelines_prior_cascade, tiny_pipelines_video_audio, tiny_pipelines_dit_pixel):
        for name in module.FAMILIES:
            families[name] = Family(
                name,
                module.KINDS[name],
                lambda seed, n=name, m=module: m.make(n, seed),
                lambda pipe, seed, n=name, m=module: m.run(pipe, n, seed),
                _REWRITTEN.get(name, ()),
                _CHAOTIC.get(name),
            )
    return families


FAMILIES: dict[str, Family] = _families()

FULL_MATRIX_ENV = "MEMMODE_TEST_FULL_MATRIX"
ROTATION_ENV = "MEMMODE_TEST_ROTATION"
#: a sweep is cut into this many slices; a CI run runs one (a full run, all)
SLICES = 5


def full_matrix() -> bool:
    return os.environ.get(FULL_MATRIX_ENV) == "1"


def rotation() -> int:
    """Which slice of the sweeps this run takes: ``MEMMODE_TEST_ROTATION`` if set, else derived from the commit
    checked out (so a failure reproduces on the same commit, and consecutive commits cover every slice)."""
    if os.environ.get(ROTATION_ENV, "").strip():
        return int(os.environ[ROTATION_ENV]) % SLICES
    return zlib.crc32(_head_commit().encode()) % SLICES


def _head_commit() -> str:
    git = Path(__file__).resolve().parent.parent / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            path = git / ref
            if path.exists():
                return path.read_text().strip()
            packed = (git / "packed-refs").read_text().splitlines()
            return next((line.split()[0] for line in packed if line.endswith(" " + ref)), ref)
        return head
    except OSError:
        return ""


def in_rotation(*key: object) -> bool:
    """Whether this run takes the sweep case ``key`` (a full run takes every case). Cases are spread over
    the slices by a hash of their key, so each slice holds about a fifth of every sweep, of every family and
    of every mode."""
    if full_matrix():
        return True
    return zlib.crc32("/".join(map(str, key)).encode()) % SLICES == rotation()
