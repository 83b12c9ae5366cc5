"""LoRA adapters, built in code, for the tiny pipelines of ``tiny_pipelines``.

Why this file exists: the suite must check that LoRA operations (loading
adapters, switching and weighting them, fusing, unfusing, deleting, unloading)
still work -- and give the same outputs -- when a pipeline runs under a memory
mode.  Nothing may be downloaded, so the adapters are random LoRA state dicts
made here, deterministic from a seed, in the exact format that diffusers'
``pipe.load_lora_weights(state_dict, adapter_name=...)`` takes.
``tests/test_tiny_loras.py`` proves that they work on plain pipelines.

Format
------
Every family uses diffusers' own (PEFT) layout -- what
``save_lora_weights`` writes and what ``load_lora_weights`` consumes without
any conversion step::

    transformer.<module path>.lora_A.weight   (rank, in_features)
    transformer.<module path>.lora_B.weight   (out_features, rank)
    text_encoder.<module path>.lora_A.weight  (text-encoder LoRAs; likewise text_encoder_2)

No ``.alpha`` keys and no metadata: diffusers then sets ``lora_alpha = rank``,
i.e. the effective weight is exactly ``W + lora_B @ lora_A`` (scale 1).  Text
encoder keys use the ``text_model.`` prefix that every published CLIP LoRA
has; for the "flattened" ``CLIPTextModel`` of transformers 5 (Flux's CLIP,
which has no ``text_model`` attribute) diffusers strips that prefix itself.

What each family's LoRA covers (``_DENOISER_TARGETS`` / ``_TEXT_ENCODER_TARGETS``,
matched against the real modules of a ``tiny_pipelines`` build, so every key
names a module that exists):

* ``wan22``: ``blocks.N.attn1.*`` / ``blocks.N.attn2.*`` (``to_q``, ``to_k``, ``to_v``,
  ``to_out.0``) and the FFN (``ffn.net.0.proj``, ``ffn.net.2``) of **both**
  experts -- see "Wan 2.2" below.  No text-encoder LoRA (``WanLoraLoaderMixin``
  loads into ``transformer`` / ``transformer_2`` only).
* ``flux``: double blocks (``attn.to_q/k/v``, ``attn.to_out.0``,
  ``attn.add_q/k/v_proj``, ``attn.to_add_out``, ``ff.*``, ``ff_context.*``) and
  single blocks (``attn.to_q/k/v``, ``proj_mlp``, ``proj_out``); with
  ``text_encoder=True`` also the CLIP ``text_encoder`` (``q/k/v/out_proj``,
  ``fc1``, ``fc2``).  The T5 ``text_encoder_2`` cannot take a LoRA
  (``FluxLoraLoaderMixin`` only knows ``transformer`` and ``text_encoder``).
* ``sd3``: joint blocks (attention incl. the ``add_*`` context projections and
  ``to_add_out``, ``ff.*``, ``ff_context.*``; the last block is
  ``context_pre_only`` and has no ``to_add_out`` / ``ff_context``); with
  ``text_encoder=True`` both CLIP encoders ``text_encoder`` and
  ``text_encoder_2`` (T5 ``text_encoder_3``: not supported by diffusers).
* ``qwenimage``: attention (``to_*``, ``add_*``, ``to_add_out``) and both MLPs
  (``img_mlp.*``, ``txt_mlp.*``).  No text-encoder LoRA
  (``QwenImageLoraLoaderMixin`` loads into ``transformer`` only).
* ``ltx``: ``attn1.*``, ``attn2.*`` and ``ff.*``.  No text-encoder LoRA
  (``LTXVideoLoraLoaderMixin`` loads into ``transformer`` only).

``make_lora(..., text_encoder=True)`` raises ``ValueError`` for a family whose
loader has no text-encoder support (the loaders would silently drop such keys).

Wan 2.2 (two experts)
---------------------
``WanLoraLoaderMixin.load_lora_weights`` loads one state dict into **one**
transformer per call: into ``transformer`` by default, into ``transformer_2``
with ``load_into_transformer_2=True``.  Either way the keys must start with
``transformer.`` (the loader always strips that prefix; ``transformer_2.`` keys
would be ignored).  A LoRA for both experts therefore takes two calls with the
same ``adapter_name``::

    for denoiser in DENOISERS["wan22"]:          # ("transformer", "transformer_2")
        pipe.load_lora_weights(make_lora("wan22", seed, denoiser=denoiser),
                               adapter_name="a", **load_kwargs("wan22", denoiser))

which is what ``load_lora(pipe, family, adapter_name, seed)`` does (for every
family).  ``make_lora("wan22", seed, denoiser="transformer_2")`` has the same keys
as the ``transformer`` one but other weights (the low-noise expert's LoRA).

Surprises (diffusers 0.42.1, peft 0.21)
-------------------------------------
* ``fuse_lora()`` / ``unfuse_lora()`` default to ``components=["transformer"]``
  for Wan (so ``transformer_2`` is *not* fused) and for Flux (its CLIP LoRA is
  not fused; Flux's ``unfuse_lora`` default does include ``text_encoder``).  SD3
  defaults to all three of its LoRA components.  Pass
  ``components=lora_components(family, text_encoder)`` to fuse everything that
  holds a LoRA.
* ``set_adapters`` / ``delete_adapters`` / ``unload_lora_weights`` walk every
  LoRA-loadable component, so on Wan they act on both experts at once.
* Loading a second adapter named ``"b"`` logs a bogus "Loading adapter weights
  from state_dict led to missing keys in the model: ...lora_A.a.weight, ..."
  warning: diffusers filters the missing keys with ``adapter_name in key``, a
  substring test that ``"b"`` passes for every key containing "blocks".  The
  adapter loads fine (``"first"`` / ``"second"`` give no warning).  Text-encoder
  LoRAs also make transformers 5 print a "LOAD REPORT" listing the encoder's
  base weights as MISSING; harmless as well (only the adapter is loaded).
* Loading an adapter makes it the only active one (``load "a"; load "b"`` runs
  with ``"b"`` alone), as does ``set_adapters("b")``.
* ``load_lora_weights`` uses ``low_cpu_mem_usage=True`` by default, which may
  make the pipeline's LoRA parameters *share storage* with the tensors of the
  passed state dict (they are not copied).  ``make_lora`` returns fresh tensors
  on every call, so a state dict is never shared by two pipelines unless the
  caller reuses it.

API: ``LORA_FAMILIES``, ``DENOISERS``, ``TEXT_ENCODER_LORA_COMPONENTS``,
``DEFAULT_SCALE``, ``make_lora``, ``load_kwargs``, ``lora_loads``, ``load_lora``,
``lora_components``.
"""

from __future__ import annotations

import re
import zlib
from functools import cache

import torch
from diffusers import DiffusionPipeline

from tiny_pipelines import FAMILIES, make_pipeline

__all__ = [
    "DEFAULT_SCALE",
    "DENOISERS",
    "LORA_FAMILIES",
    "TEXT_ENCODER_LORA_COMPONENTS",
    "load_kwargs",
    "load_lora",
    "lora_components",
    "lora_loads",
    "make_lora",
]

# Size of the LoRA update relative to the layer's own weights: ``lora_B @ lora_A``
# has entries of standard deviation ``scale / sqrt(in_features)``, i.e. about
# ``scale * sqrt(3)`` times that of the (uniform) default init of the base weight.
# The defaults move every family's ``run`` output by ~0.03-0.4 (max abs) and keep
# it finite.  Qwen-Image needs a larger update: its tiny transformer's blocks
# (modulation gates, true-CFG norm rescaling) have little effect on the output,
# and at 0.5 the change can be as small as 0.01.
DEFAULT_SCALE: dict[str, float] = {"flux": 0.5, "ltx": 0.5, "qwenimage": 2.0, "sd3": 0.5, "wan22": 0.5}

# Module-path patterns (full match) of the LoRA targets in each denoiser.
_ATTN = r"(to_q|to_k|to_v|to_out\.0)"
_JOINT_ATTN = r"(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
_FF = r"net\.(0\.proj|2)"
_DENOISER_TARGETS: dict[str, str] = {
    "wan22": rf"blocks\.\d+\.(attn[12]\.{_ATTN}|ffn\.{_FF})",
    "flux": (
        rf"transformer_blocks\.\d+\.(attn\.{_JOINT_ATTN}|ff\.{_FF}|ff_context\.{_FF})"
        rf"|single_transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v)|proj_mlp|proj_out)"
    ),
    "sd3": rf"transformer_blocks\.\d+\.(attn\.{_JOINT_ATTN}|ff\.{_FF}|ff_context\.{_FF})",
    "qwenimage": rf"transformer_blocks\.\d+\.(attn\.{_JOINT_ATTN}|img_mlp\.{_FF}|txt_mlp\.{_FF})",
    "ltx": rf"transformer_blocks\.\d+\.(attn[12]\.{_ATTN}|ff\.{_FF})",
}

# CLIP text encoders: the projections diffusers' text-encoder LoRA loader knows.
_CLIP_TARGETS = r"(text_model\.)?encoder\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.(fc1|fc2))"

LORA_FAMILIES: tuple[str, ...] = tuple(sorted(_DENOISER_TARGETS))

# The pipeline components that get a LoRA, per family; each denoiser takes its own load_lora_weights call.
DENOISERS: dict[str, tuple[str, ...]] = {family: ("transformer",) for family in LORA_FAMILIES}
DENOISERS["wan22"] = ("transformer", "transformer_2")

# Text encoders the family's LoRA loader can put a LoRA into (empty: none).
TEXT_ENCODER_LORA_COMPONENTS: dict[str, tuple[str, ...]] = {family: () for family in LORA_FAMILIES}
TEXT_ENCODER_LORA_COMPONENTS["flux"] = ("text_encoder",)
TEXT_ENCODER_LORA_COMPONENTS["sd3"] = ("text_encoder", "text_encoder_2")

assert set(LORA_FAMILIES) <= set(FAMILIES) and set(DEFAULT_SCALE) == set(LORA_FAMILIES)


@cache
def _targets(family: str, component: str) -> tuple[tuple[str, int, int], ...]:
    """``(module path, in_features, out_features)`` of every LoRA target of ``component`` in ``family``.

    Read from a real ``tiny_pipelines`` build (shapes do not depend on its seed), so the
    keys always match the modules that exist.
    """
    module = getattr(make_pipeline(family), component)
    pattern = re.compile(_CLIP_TARGETS if component.startswith("text_encoder") else _DENOISER_TARGETS[family])
    targets = []
    for name, submodule in module.named_modules():
        if isinstance(submodule, torch.nn.Linear) and pattern.fullmatch(name):
            if component.startswith("text_encoder") and not name.startswith("text_model."):
                name = "text_model." + name  # the key layout of published CLIP LoRAs
            targets.append((name, submodule.in_features, submodule.out_features))
    if not targets:
        raise AssertionError(f"no LoRA targets found in {family}.{component}")
    return tuple(targets)


def _lora_weights(
    family: str, component: str, key_prefix: str, seed: int, rank: int, scale: float, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    # A generator of its own per (family, seed, component): the weights of one component do not
    # depend on which other components are included.
    generator = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"lora/{family}/{seed}/{component}".encode()))
    state_dict = {}
    for name, in_features, out_features in _targets(family, component):
        lora_a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
        lora_b = torch.randn(out_features, rank, generator=generator) * (scale / rank**0.5)
        state_dict[f"{key_prefix}.{name}.lora_A.weight"] = lora_a.to(dtype)
        state_dict[f"{key_prefix}.{name}.lora_B.weight"] = lora_b.to(dtype)
    return state_dict


def make_lora(
    family: str,
    seed: int = 0,
    *,
    rank: int = 4,
    scale: float | None = None,
    text_encoder: bool = False,
    dtype: torch.dtype = torch.float32,
    denoiser: str = "transformer",
) -> dict[str, torch.Tensor]:
    """A random LoRA state dict for one ``load_lora_weights`` call on a ``family`` pipeline.

    It targets ``denoiser``'s attention projections and feed-forward layers (``DENOISERS[family]``;
    for ``wan22`` also ``"transformer_2"``, whose dict has the same ``transformer.``-prefixed keys but
    other weights and must be loaded with ``**load_kwargs("wan22", "transformer_2")``), and with
    ``text_encoder=True`` also the family's ``TEXT_ENCODER_LORA_COMPONENTS`` (in the first denoiser's
    dict only; ``ValueError`` for a family without text-encoder LoRA support).

    Deterministic from ``(family, seed, component)``; does not touch the global RNG; fresh tensors on
    every call.  ``scale`` sets the size of the update (default: ``DEFAULT_SCALE[family]``, which
    changes the output of ``tiny_pipelines.run`` visibly).
    """
    if family not in LORA_FAMILIES:
        raise ValueError(f"no LoRA for family {family!r}; LORA_FAMILIES = {LORA_FAMILIES}")
    if denoiser not in DENOISERS[family]:
        raise ValueError(f"{family} has no LoRA-loadable denoiser {denoiser!r}; DENOISERS = {DENOISERS[family]}")
    if text_encoder and not TEXT_ENCODER_LORA_COMPONENTS[family]:
        raise ValueError(f"diffusers' LoRA loader for {family} cannot load text-encoder LoRAs")
    if scale is None:
        scale = DEFAULT_SCALE[family]
    # The Wan loader strips "transformer." whichever expert it loads into.
    state_dict = _lora_weights(family, denoiser, "transformer", seed, rank, scale, dtype)
    if text_encoder and denoiser == DENOISERS[family][0]:
        for component in TEXT_ENCODER_LORA_COMPONENTS[family]:
            state_dict.update(_lora_weights(family, component, component, seed, rank, scale, dtype))
    return state_dict


def load_kwargs(family: str, denoiser: str = "transformer") -> dict:
    """Extra keyword arguments for ``load_lora_weights`` to load ``make_lora(family, denoiser=denoiser)``.

    ``{}`` except ``{"load_into_transformer_2": True}`` for Wan 2.2's ``transformer_2``.
    """
    if denoiser not in DENOISERS[family]:
        raise ValueError(f"{family} has no LoRA-loadable denoiser {denoiser!r}; DENOISERS = {DENOISERS[family]}")
    return {"load_into_transformer_2": True} if denoiser == "transformer_2" else {}


def lora_loads(family: str, seed: int = 0, **make_kwargs) -> list[tuple[dict[str, torch.Tensor], dict]]:
    """``(state_dict, load_kwargs)`` for each ``load_lora_weights`` call that puts a LoRA into every denoiser."""
    return [
        (make_lora(family, seed, denoiser=denoiser, **make_kwargs), load_kwargs(family, denoiser))
        for denoiser in DENOISERS[family]
    ]


def load_lora(pipe: DiffusionPipeline, family: str, adapter_name: str, seed: int = 0, **make_kwargs) -> None:
    """Load a ``make_lora`` adapter named ``adapter_name`` into all of ``pipe``'s denoisers (and text encoders
    with ``text_encoder=True``)."""
    for state_dict, kwargs in lora_loads(family, seed, **make_kwargs):
        pipe.load_lora_weights(state_dict, adapter_name=adapter_name, **kwargs)


def lora_components(family: str, text_encoder: bool = False) -> list[str]:
    """Components that hold a ``load_lora`` adapter: pass as ``components=`` to ``fuse_lora`` / ``unfuse_lora``
    (their defaults miss ``transformer_2`` on Wan and the CLIP encoder on Flux)."""
    return [*DENOISERS[family], *(TEXT_ENCODER_LORA_COMPONENTS[family] if text_encoder else ())]
