"""VideoX-Fun as a client: a tiny Wan 2.1 pipeline, a tiny LoRA, and VideoX-Fun's own code re-implemented.

VideoX-Fun (aigc-apps/VideoX-Fun) is not a dependency. What its predict scripts do is re-implemented here
from its code, behaviour for behaviour, so the tests can run it beside the drop-in:

* :func:`videox_fun_chain`: the inline if/elif chain over the six ``GPU_memory_mode`` values each predict
  script carries (its qfloat8 is ``convert_model_weight_to_float8``: every parameter of every module whose
  name does not contain an ``exclude_module_name`` fragment cast to ``float8_e4m3fn`` with no scale, plus
  ``convert_weight_dtype_wrapper``: each module with a ``weight`` casts itself back to the compute dtype
  around its forward and to its stored dtype after).
* :func:`merge_lora` / :func:`unmerge_lora` (``videox_fun/utils/lora_utils.py``): kohya/peft key
  normalisation, the attribute search that turns ``lora_unet__blocks_0_attn1_to_q`` into a module, and per
  layer ``layer.to(device, dtype)``, ``layer.weight.data += multiplier * alpha * up @ down`` (``-=`` to
  unmerge), ``layer.to(origin_device, origin_dtype)``; a pipeline under sequential CPU offload (transformer on
  the meta device) has its hooks removed first and re-enabled after.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import torch
from diffusers import WanPipeline

from tiny_pipelines import ALL_FAMILIES, call_kwargs, make_pipeline

FAMILIES = ("wan21", "wan22")

#: Wan 2.1 text-to-video: Wan 2.2 without ``transformer_2`` (and so without the boundary between the experts).
WAN21 = replace(
    ALL_FAMILIES["wan22"],
    parts={k: v for k, v in ALL_FAMILIES["wan22"].parts.items() if k not in ("transformer_2", "boundary_ratio")},
)


def make_wan21(seed: int = 0, dtype: torch.dtype = torch.float32) -> WanPipeline:
    """Wan 2.1 text-to-video: one transformer (``make_pipeline("wan22")`` without ``transformer_2``)."""
    return WAN21.make(seed, dtype)


def make(family: str, seed: int = 0) -> WanPipeline:
    return make_wan21(seed) if family == "wan21" else make_pipeline("wan22", seed)


def run(pipe: WanPipeline, seed: int = 0) -> torch.Tensor:
    kwargs = call_kwargs("wan22")
    if pipe.transformer_2 is None:
        kwargs.pop("guidance_scale_2")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return pipe(**kwargs, generator=generator, return_dict=False)[0].detach().float().cpu()


def forward(pipe: WanPipeline) -> torch.Tensor:
    """One call of each transformer (``transformer``, then ``transformer_2``) on fixed inputs, flattened.

    What a LoRA merged into a quantized layer is measured on: through a pipeline call (denoising steps, the
    VAE, a clamp to [0, 1]) the same kind of weight error gives an output SQNR that moves by more than 10 dB
    with the seed of the model or of the LoRA; one forward follows the weights' error closely."""
    generator = torch.Generator().manual_seed(5)
    latents = torch.randn(1, 16, 2, 8, 8, generator=generator)
    text = torch.randn(1, 12, 32, generator=generator)
    outputs = []
    for transformer in (pipe.transformer, pipe.transformer_2):
        if transformer is not None:
            with torch.no_grad():
                outputs.append(
                    transformer(latents, timestep=torch.tensor([500]), encoder_hidden_states=text, return_dict=False)[0]
                    .flatten()
                    .float()
                )
    return torch.cat(outputs)


def lora_layers(pipe: WanPipeline) -> dict[str, torch.nn.Module]:
    """The layers :func:`loras_for`'s LoRAs target, by ``<component>.blocks.<i>.<target>``."""
    return {
        f"{name}.blocks.{index}.{target}": block.get_submodule(target)
        for name in ("transformer", "transformer_2")
        if getattr(pipe, name, None) is not None
        for index, block in enumerate(getattr(pipe, name).blocks)
        for target in LORA_TARGETS
    }


# -- a LoRA in the format VideoX-Fun loads (ComfyUI / peft keys, an alpha per layer) ---------------------------

LORA_TARGETS = ("attn1.to_q", "attn1.to_v", "attn2.to_k", "ffn.net.0.proj")


def make_lora(transformer: torch.nn.Module, seed: int, rank: int = 4, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """``diffusion_model.blocks.<i>.<target>.lora_A/lora_B.weight`` and ``.alpha`` for every block."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for index in range(len(transformer.blocks)):
        for target in LORA_TARGETS:
            layer = transformer.blocks[index].get_submodule(target)
            out_features, in_features = layer.weight.shape
            key = f"diffusion_model.blocks.{index}.{target}"
            state[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * scale
            state[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * scale
            state[f"{key}.alpha"] = torch.tensor(float(rank * 2))
    return state


# -- VideoX-Fun's merge_lora / unmerge_lora -------------------------------------------------------------------


def _normalised(state_dict: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """VideoX-Fun's key normalisation: ``lora_unet__<path with underscores>`` -> {lora_up/lora_down/alpha}."""
    updates: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, value in state_dict.items():
        key = key.replace("diffusion_model.", "")
        if "lora_unet__" not in key:
            key = "lora_unet__" + key
        key = key.replace(".", "_")
        for suffix, replacement in (
            ("_lora_up_weight", ".lora_up.weight"),
            ("_lora_down_weight", ".lora_down.weight"),
            ("_lora_A_default_weight", ".lora_A.weight"),
            ("_lora_B_default_weight", ".lora_B.weight"),
            ("_lora_A_weight", ".lora_A.weight"),
            ("_lora_B_weight", ".lora_B.weight"),
            ("_alpha", ".alpha"),
        ):
            if key.endswith(suffix):
                key = key[: -len(suffix)] + replacement
        key = key.replace(".lora_A.", ".lora_down.").replace(".lora_B.", ".lora_up.")
        layer, element = key.split(".", 1)
        updates[layer][element] = value
    return updates


def _find_layer(root: torch.nn.Module, layer: str) -> torch.nn.Module:
    """VideoX-Fun's front search: walk ``_``-separated pieces, taking the rest whole where it names a child,
    else the shortest piece run that does."""
    pieces = layer.split("lora_unet_")[-1].split("_")
    current = root
    try:
        return current.__getattr__("_".join(pieces[1:]))
    except AttributeError:
        pass
    name = pieces.pop(0)
    while True:
        try:
            return current.__getattr__(name + "_" + "_".join(pieces))
        except AttributeError:
            try:
                current = current.__getattr__(name)
                if not pieces:
                    return current
                name = pieces.pop(0)
            except AttributeError:
                name = (name + "_" + pieces.pop(0)) if name else pieces.pop(0)


def _apply_lora(pipeline, state_dict, multiplier, device, dtype, sub_transformer_name, sign):
    updates = _normalised(state_dict)
    sequential = pipeline.transformer.device == torch.device("meta")
    if sequential:
        pipeline.remove_all_hooks()
        offload_device = pipeline._offload_device
    for layer, elements in updates.items():
        module = _find_layer(getattr(pipeline, sub_transformer_name), layer)
        origin_dtype = module.weight.data.dtype
        origin_device = module.weight.data.device
        module = module.to(device, dtype)
        up = elements["lora_up.weight"].to(device, dtype)
        down = elements["lora_down.weight"].to(device, dtype)
        alpha = elements["alpha"].item() / up.shape[1] if "alpha" in elements else 1.0
        if sign > 0:
            module.weight.data += multiplier * alpha * torch.mm(up, down)
        else:
            module.weight.data -= multiplier * alpha * torch.mm(up, down)
        module = module.to(origin_device, origin_dtype)
    if sequential:
        pipeline.enable_sequential_cpu_offload(device=offload_device if sign > 0 else device)
    return pipeline


def merge_lora(pipeline, state_dict, multiplier, device="cpu", dtype=torch.float32, sub_transformer_name="transformer"):
    return _apply_lora(pipeline, state_dict, multiplier, device, dtype, sub_transformer_name, +1)


def unmerge_lora(
    pipeline, state_dict, multiplier=1, device="cpu", dtype=torch.float32, sub_transformer_name="transformer"
):
    return _apply_lora(pipeline, state_dict, multiplier, device, dtype, sub_transformer_name, -1)


def merge_loras(pipeline, loras, *, device="cpu", dtype=torch.float32, unmerge=False):
    """What the Wan 2.2 scripts do: one LoRA per expert (``lora_path`` / ``lora_high_path``)."""
    for name, state_dict in loras.items():
        (unmerge_lora if unmerge else merge_lora)(
            pipeline, state_dict, 0.8, device=device, dtype=dtype, sub_transformer_name=name
        )


def loras_for(pipe) -> dict[str, dict[str, torch.Tensor]]:
    names = ["transformer"] + (["transformer_2"] if pipe.transformer_2 is not None else [])
    return {name: make_lora(getattr(pipe, name), seed=index + 10) for index, name in enumerate(names)}


# -- VideoX-Fun's GPU_memory_mode chain ----------------------------------------------------------------------


def convert_model_weight_to_float8(model, exclude_module_name=("embed_tokens",)):
    for name, module in model.named_modules():
        if any(fragment in name for fragment in exclude_module_name):
            continue
        for param_name, param in module.named_parameters():
            if any(fragment in param_name for fragment in exclude_module_name):
                continue
            param.data = param.data.to(torch.float8_e4m3fn)


def _autocast_forward(module, origin_dtype, *inputs, **kwargs):
    weight_dtype = module.weight.dtype
    module.to(origin_dtype)
    inputs = [x.to(origin_dtype) for x in inputs]
    out = module.original_forward(*inputs, **kwargs)
    module.to(weight_dtype)
    return out


def convert_weight_dtype_wrapper(model, origin_dtype):
    for name, module in model.named_modules():
        if name == "" or "embed_tokens" in name:
            continue
        if getattr(module, "weight", None) is not None:
            module.original_forward = module.forward
            module.forward = lambda *inputs, m=module, **kwargs: _autocast_forward(m, origin_dtype, *inputs, **kwargs)


def videox_fun_chain(
    pipeline, mode: str, device="cpu", weight_dtype=torch.float32, exclude_module_name=("modulation",)
) -> None:
    """The chain of a Wan 2.x predict script (``transformer`` and, on Wan 2.2, ``transformer_2``)."""
    transformers = [m for m in (pipeline.transformer, getattr(pipeline, "transformer_2", None)) if m is not None]
    if mode == "sequential_cpu_offload":
        # VideoX-Fun first pins the ``modulation`` parameters and the ``freqs`` table of its own Wan model on the
        # device (replace_parameters_by_name, ``transformer.freqs.to(device)``): diffusers' Wan has neither name
        pipeline.enable_sequential_cpu_offload(device=device)
    elif mode == "model_group_offload":
        # safe_enable_group_offload(pipeline, onload_device=device, offload_device="cpu",
        # offload_type="leaf_level", use_stream=True): diffusers' own group offload, which drives CUDA streams
        # itself and knows nothing of memmode's streams layer (nor of the strict model that makes the CPU an
        # accelerator in tests), so streams only on a real CUDA device
        for component in pipeline.components.values():
            if hasattr(component, "enable_group_offload"):
                component.enable_group_offload(
                    onload_device=torch.device(device),
                    offload_device=torch.device("cpu"),
                    offload_type="leaf_level",
                    use_stream=torch.device(device).type == "cuda",
                )
            elif isinstance(component, torch.nn.Module):
                component.to(device)
    elif mode in ("model_cpu_offload_and_qfloat8", "model_full_load_and_qfloat8"):
        for transformer in transformers:
            convert_model_weight_to_float8(transformer, exclude_module_name=list(exclude_module_name))
            convert_weight_dtype_wrapper(transformer, weight_dtype)
        if mode == "model_cpu_offload_and_qfloat8":
            pipeline.enable_model_cpu_offload(device=device)
        else:
            pipeline.to(device=device)
    elif mode == "model_cpu_offload":
        pipeline.enable_model_cpu_offload(device=device)
    else:
        pipeline.to(device=device)
