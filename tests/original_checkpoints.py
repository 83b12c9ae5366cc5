"""State dicts under the original checkpoints' names, made from small diffusers models with random weights.

Each :class:`Architecture` holds a small config and the inverse of diffusers' single-file conversion for its class
(``SINGLE_FILE_LOADABLE_CLASSES[...]["checkpoint_mapping_fn"]``): the model's state dict renamed to the original
names, what diffusers splits fused again (Flux's and HunyuanVideo's qkv, the single blocks' ``linear1``), what it
reorders put back (``swap_scale_shift``), under the ``model.diffusion_model.`` prefix ComfyUI files have.

Flux's and HunyuanVideo's converters hard-code the real width (``inner_dim = 3072``, ``hidden_size = 3072``), so
those two are built at that width on the meta device (names and shapes only, with one block of each kind), and
their values are *thin*: random tensors with the model's dim 0 and every other dim 1, which is all a conversion
that only renames and picks rows along dim 0 looks at.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import diffusers
import torch
from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

PREFIX = "model.diffusion_model."

#: what to put together: an original name, the diffusers names whose tensors it concatenates, and whether its two
#: halves are swapped (``swap_scale_shift``)
Plan = list[tuple[str, list[str], bool]]


@dataclass(frozen=True)
class Architecture:
    name: str
    class_name: str
    config: dict[str, Any]
    #: the model's names -> what the original checkpoint fuses, renames, swaps
    plan: Callable[[list[str]], Plan]
    #: the converter hard-codes the real width: built on meta, values thin
    full_size: bool = False
    #: tensors ComfyUI files carry beside the model's (a VAE's), which the converter drops
    extra: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def model_class(self) -> type:
        return getattr(diffusers, self.class_name)

    def build(self) -> torch.nn.Module:
        if self.full_size:
            with torch.device("meta"):
                return self.model_class(**self.config)
        torch.manual_seed(0)
        return self.model_class(**self.config)

    def checkpoints(self, seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The model, its state dict with random values (thin for full-size ones), and that state dict under the
        original names with ``model.diffusion_model.``."""
        model = self.build()
        generator = torch.Generator().manual_seed(seed)
        values = {}
        for key, tensor in model.state_dict().items():
            shape = tensor.shape if not self.full_size else (tensor.shape[:1] + (1,) * (tensor.dim() - 1))
            values[key] = torch.randn(shape, generator=generator)
        original = to_original(self.plan(list(values)), values)
        for key, shape in self.extra.items():
            original[key] = torch.randn(shape, generator=generator)
        return model, values, original

    def meta_original(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The original checkpoint at its full shapes, on the meta device."""
        meta = {key: torch.empty(tensor.shape, device="meta") for key, tensor in model.state_dict().items()}
        original = to_original(self.plan(list(meta)), meta)
        return original | {key: torch.empty(shape, device="meta") for key, shape in self.extra.items()}

    def original_shapes(self, model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
        """The original checkpoint's names and full shapes, as a file's header gives them."""
        return {key: tuple(tensor.shape) for key, tensor in self.meta_original(model).items()}


def to_original(plan: Plan, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    original = {}
    for name, keys, swap in plan:
        tensor = torch.cat([values[key] for key in keys]) if len(keys) > 1 else values[keys[0]].clone()
        if swap:
            first, second = tensor.chunk(2, dim=0)
            tensor = torch.cat([second, first])
        original[PREFIX + name] = tensor
    return original


def convert_with_diffusers(arch: Architecture, original: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' own conversion of ``original`` (on a copy, without the prefix some of its converters keep)."""
    converter = SINGLE_FILE_LOADABLE_CLASSES[arch.class_name]["checkpoint_mapping_fn"]
    checkpoint = {key.removeprefix(PREFIX): value for key, value in original.items()}
    return dict(converter(checkpoint=checkpoint, config=dict(arch.config)))


def _renamed(keys: list[str], rename: Callable[[str], str]) -> Plan:
    return [(rename(key), [key], False) for key in keys]


def _replace(key: str, pairs: list[tuple[str, str]]) -> str:
    for old, new in pairs:
        key = key.replace(old, new)
    return key


# -- Wan: renames only (and diffusers' norm2 is the original norm3) --

_WAN = [
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn1", "self_attn"),
    ("attn2", "cross_attn"),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    ("scale_shift_table", "modulation"),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("norm2", "norm3"),
]


def _wan_name(key: str) -> str:
    if key == "scale_shift_table":
        return "head.modulation"
    if key.startswith("proj_out."):
        return "head.head." + key.removeprefix("proj_out.")
    return _replace(key, _WAN)


def wan_plan(keys: list[str]) -> Plan:
    return _renamed(keys, _wan_name)


# -- Flux: fused qkv, fused q/k/v/mlp in the single blocks, the final modulation's halves swapped --


def _blocks(keys: list[str], prefix: str) -> list[int]:
    return sorted({int(m.group(1)) for key in keys if (m := re.match(rf"{prefix}\.(\d+)\.", key))})


def flux_plan(keys: list[str]) -> Plan:
    plan: Plan = []
    top = {
        "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
        "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
        "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "context_embedder": "txt_in",
        "x_embedder": "img_in",
        "proj_out": "final_layer.linear",
    }
    for new, old in top.items():
        for p in ("weight", "bias"):
            if f"{new}.{p}" in keys:
                plan.append((f"{old}.{p}", [f"{new}.{p}"], False))
    for p in ("weight", "bias"):
        plan.append((f"final_layer.adaLN_modulation.1.{p}", [f"norm_out.linear.{p}"], True))
    for i in _blocks(keys, "transformer_blocks"):
        b, o = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        one = {
            "norm1.linear": "img_mod.lin",
            "norm1_context.linear": "txt_mod.lin",
            "ff.net.0.proj": "img_mlp.0",
            "ff.net.2": "img_mlp.2",
            "ff_context.net.0.proj": "txt_mlp.0",
            "ff_context.net.2": "txt_mlp.2",
            "attn.to_out.0": "img_attn.proj",
            "attn.to_add_out": "txt_attn.proj",
        }
        for p in ("weight", "bias"):
            plan += [(f"{o}{old}.{p}", [f"{b}{new}.{p}"], False) for new, old in one.items()]
            plan.append((f"{o}img_attn.qkv.{p}", [f"{b}attn.to_{x}.{p}" for x in "qkv"], False))
            plan.append((f"{o}txt_attn.qkv.{p}", [f"{b}attn.add_{x}_proj.{p}" for x in "qkv"], False))
        norms = {"norm_q": "img_attn.norm.query_norm", "norm_k": "img_attn.norm.key_norm"}
        norms |= {"norm_added_q": "txt_attn.norm.query_norm", "norm_added_k": "txt_attn.norm.key_norm"}
        plan += [(f"{o}{old}.scale", [f"{b}attn.{new}.weight"], False) for new, old in norms.items()]
    for i in _blocks(keys, "single_transformer_blocks"):
        b, o = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for p in ("weight", "bias"):
            plan.append((f"{o}modulation.lin.{p}", [f"{b}norm.linear.{p}"], False))
            plan.append((f"{o}linear1.{p}", [f"{b}attn.to_{x}.{p}" for x in "qkv"] + [f"{b}proj_mlp.{p}"], False))
            plan.append((f"{o}linear2.{p}", [f"{b}proj_out.{p}"], False))
        plan.append((f"{o}norm.query_norm.scale", [f"{b}attn.norm_q.weight"], False))
        plan.append((f"{o}norm.key_norm.scale", [f"{b}attn.norm_k.weight"], False))
    return plan


# -- Qwen-Image: the original names are diffusers' (its converter is the identity) --


def qwen_plan(keys: list[str]) -> Plan:
    return _renamed(keys, lambda key: key)


# -- HunyuanVideo: fused qkv (double blocks, token refiner), fused linear1, final modulation swapped --

_HUNYUAN = {
    "context_embedder.time_text_embed.timestep_embedder.linear_1": "txt_in.t_embedder.mlp.0",
    "context_embedder.time_text_embed.timestep_embedder.linear_2": "txt_in.t_embedder.mlp.2",
    "context_embedder.time_text_embed.text_embedder.linear_1": "txt_in.c_embedder.linear_1",
    "context_embedder.time_text_embed.text_embedder.linear_2": "txt_in.c_embedder.linear_2",
    "context_embedder.token_refiner.refiner_blocks": "txt_in.individual_token_refiner.blocks",
    "context_embedder.proj_in": "txt_in.input_embedder",
    "time_text_embed.timestep_embedder.linear_1": "time_in.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "time_in.mlp.2",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.mlp.0",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.mlp.2",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "x_embedder": "img_in",
}


def _hunyuan_name(key: str) -> str:
    for new, old in _HUNYUAN.items():
        if key.startswith(new + "."):
            key = old + key[len(new) :]
            break
    if key.startswith("txt_in.individual_token_refiner"):
        key = _replace(key, [("attn.to_out.0", "self_attn_proj"), ("norm_out.linear", "adaLN_modulation.1")])
        return _replace(key, [("ff.net.0.proj", "mlp.fc1"), ("ff.net.2", "mlp.fc2")])
    if key.startswith("transformer_blocks."):
        key = "double_blocks." + key.removeprefix("transformer_blocks.")
        pairs = [
            ("norm1.linear", "img_mod.linear"),
            ("norm1_context.linear", "txt_mod.linear"),
            ("attn.norm_q", "img_attn_q_norm"),
            ("attn.norm_k", "img_attn_k_norm"),
            ("attn.norm_added_q", "txt_attn_q_norm"),
            ("attn.norm_added_k", "txt_attn_k_norm"),
            ("attn.to_out.0", "img_attn_proj"),
            ("attn.to_add_out", "txt_attn_proj"),
            ("ff_context.net.0.proj", "txt_mlp.fc1"),
            ("ff_context.net.2", "txt_mlp.fc2"),
            ("ff.net.0.proj", "img_mlp.fc1"),
            ("ff.net.2", "img_mlp.fc2"),
        ]
        return _replace(key, pairs)
    if key.startswith("single_transformer_blocks."):
        key = "single_blocks." + key.removeprefix("single_transformer_blocks.")
        pairs = [("proj_out", "linear2"), ("attn.norm_q", "q_norm"), ("attn.norm_k", "k_norm")]
        return _replace(key, pairs + [("norm.linear", "modulation.linear")])
    if key.startswith("proj_out."):
        return "final_layer.linear." + key.removeprefix("proj_out.")
    return key


def hunyuan_plan(keys: list[str]) -> Plan:
    fused: dict[str, list[str]] = {}
    for key in keys:
        if m := re.match(r"(.*refiner_blocks\.\d+\.)attn\.to_[qkv]\.(\w+)$", key):
            block, p = m.groups()
            name = _hunyuan_name(block + "x").removesuffix("x") + f"self_attn_qkv.{p}"
            fused[name] = [f"{block}attn.to_{x}.{p}" for x in "qkv"]
        elif m := re.match(r"transformer_blocks\.(\d+)\.attn\.(to_[qkv]|add_[qkv]_proj)\.(\w+)$", key):
            i, which, p = m.groups()
            if which.startswith("to"):
                fused[f"double_blocks.{i}.img_attn_qkv.{p}"] = [
                    f"transformer_blocks.{i}.attn.to_{x}.{p}" for x in "qkv"
                ]
            else:
                parts = [f"transformer_blocks.{i}.attn.add_{x}_proj.{p}" for x in "qkv"]
                fused[f"double_blocks.{i}.txt_attn_qkv.{p}"] = parts
        elif m := re.match(r"single_transformer_blocks\.(\d+)\.(attn\.to_[qkv]|proj_mlp)\.(\w+)$", key):
            i, _, p = m.groups()
            b = f"single_transformer_blocks.{i}."
            fused[f"single_blocks.{i}.linear1.{p}"] = [f"{b}attn.to_{x}.{p}" for x in "qkv"] + [f"{b}proj_mlp.{p}"]
    in_fused = {part for parts in fused.values() for part in parts}
    swapped = {f"norm_out.linear.{p}": f"final_layer.adaLN_modulation.1.{p}" for p in ("weight", "bias")}
    plan: Plan = [(name, parts, False) for name, parts in fused.items()]
    plan += [(swapped[key], [key], True) for key in keys if key in swapped]
    plan += [(_hunyuan_name(key), [key], False) for key in keys if key not in in_fused and key not in swapped]
    return plan


# -- LTX-Video: renames only; ComfyUI files carry the VAE beside the transformer --

_LTX = [("proj_in", "patchify_proj"), ("time_embed", "adaln_single"), ("norm_q", "q_norm"), ("norm_k", "k_norm")]


def ltx_plan(keys: list[str]) -> Plan:
    return _renamed(keys, lambda key: _replace(key, _LTX))


WAN = Architecture(
    "wan",
    "WanTransformer3DModel",
    dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ),
    wan_plan,
)
FLUX = Architecture(
    "flux",
    "FluxTransformer2DModel",
    dict(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
    ),
    flux_plan,
    full_size=True,
)
QWEN_IMAGE = Architecture(
    "qwen-image",
    "QwenImageTransformer2DModel",
    dict(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=16,
        axes_dims_rope=(8, 4, 4),
    ),
    qwen_plan,
)
HUNYUAN_VIDEO = Architecture(
    "hunyuan-video",
    "HunyuanVideoTransformer3DModel",
    dict(
        in_channels=4,
        out_channels=4,
        num_attention_heads=24,
        attention_head_dim=128,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        text_embed_dim=32,
        pooled_projection_dim=32,
    ),
    hunyuan_plan,
    full_size=True,
)
LTX_VIDEO = Architecture(
    "ltx-video",
    "LTXVideoTransformer3DModel",
    dict(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=2,
        caption_channels=16,
    ),
    ltx_plan,
    extra={"vae.decoder.conv_in.conv.weight": (8, 4, 3, 3, 3), "vae.per_channel_statistics.mean-of-means": (4,)},
)
ARCHITECTURES = [WAN, FLUX, QWEN_IMAGE, HUNYUAN_VIDEO, LTX_VIDEO]
