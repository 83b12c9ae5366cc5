"""Tiny pipelines with a prior, a cascade of stages, or a renderer, as ``Family`` tables (see ``tiny_components``).

The other families' components compute in their ``forward`` (or a VAE's ``encode`` / ``decode``). These are where
that breaks down, and where an offloading mode has to be careful:

* the pipeline calls other methods of a component, which read its weights outside ``forward``:
  ``PriorTransformer.post_process_latents`` (``clip_mean`` / ``clip_std``), ``StableUnCLIPImageNormalizer.scale`` /
  ``unscale`` (``mean`` / ``std``) and its ``.to()`` override, which *replaces* both parameters by new
  ``nn.Parameter`` objects on every call, and ``ShapERenderer.decode_to_image``, which projects the latents into
  NeRF weights and *copies them into* its own ``mlp`` parameters before rendering;
* pipelines list components in ``_exclude_from_cpu_offload`` (the priors, the image normalizer, the Shap-E
  renderer), and Kandinsky's MoVQ (``VQModel``) declares ``_supports_group_offloading = False``;
* UNets of other families than SD's: Kandinsky 3's, Würstchen's and Stable Cascade's (the latter runs its up blocks
  several times per call: ``up_blocks_repeat_mappers``), two ``PriorTransformer`` layouts, and the ``PaellaVQModel``
  and MoVQ decoders.

Parameters a fresh model initialises to zero and a checkpoint fills (output convolutions, timestep mappers,
positional embeddings, CLIP statistics, the Paella VQ's residual ``gammas``, and the residual blocks' output layers
that ``WuerstchenDiffNeXt`` scales down to about 1e-15) get small random values, or the component, or the input that
goes through them, would have no influence on the output.

Families (what ``run`` returns: the output object's fields by name, since with ``return_dict=False`` the cascade
decoders return the images themselves, not a tuple):

* ``kandinsky22_prior``: the image embeddings, followed by the negative ones, which without a negative prompt are
  the ``image_encoder``'s embedding of a blank image (the encoder's only use);
* ``kandinsky22``: images; the call's ``image_embeds`` / ``negative_image_embeds`` are fixed random tensors derived
  from the call seed;
* ``kandinsky3``: images;
* ``stable_unclip``: images (prior, image normalizer with ``noise_level`` > 0, UNet, VAE);
* ``stable_unclip_img2img``: images; the input image is a fixed random PIL image derived from the call seed, read by
  the CLIP image processor and vision encoder;
* ``wuerstchen_prior`` and ``stable_cascade_prior``: the stage C image embeddings;
* ``wuerstchen_decoder`` and ``stable_cascade_decoder``: images; the ``image_embeddings`` are fixed random tensors
  derived from the call seed, with the 16 channels of the real stage C (the decoders inject them, as the real
  checkpoints do; diffusers' tests leave that out);
* ``shap_e``: the rendered frames (20 views of 16 x 16), so the renderer runs.  Its renderer is ``ShapERenderer``
  with fewer rays per batch and samples per ray (``_ShapERenderer``: the defaults take seconds).  A call *changes*
  the renderer's weights: ``mlp.mlp.0``-``3.weight`` (the ``param_names``) hold the last call's projected latents
  afterwards, so they differ from a fresh build's.

The cascade decoders' images are mostly saturated (clamped to 0 or 1, as in diffusers' tests): the first
``DDPMWuerstchenScheduler`` step divides by ``sqrt(alpha)`` ~ 1/70, and an untrained denoiser's error is amplified as
much; a tenth to a fifth of the pixels stay in between, enough for every component to show.  For the same reason
``wuerstchen_prior``'s embeddings run to 1e5.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import PIL.Image
import torch
from diffusers import (
    DDIMScheduler,
    DDPMScheduler,
    DDPMWuerstchenScheduler,
    HeunDiscreteScheduler,
    Kandinsky3Pipeline,
    Kandinsky3UNet,
    KandinskyV22Pipeline,
    KandinskyV22PriorPipeline,
    PriorTransformer,
    ShapEPipeline,
    StableCascadeDecoderPipeline,
    StableCascadePriorPipeline,
    StableCascadeUNet,
    StableUnCLIPImg2ImgPipeline,
    StableUnCLIPPipeline,
    UnCLIPScheduler,
    UNet2DConditionModel,
    VQModel,
    WuerstchenDecoderPipeline,
    WuerstchenPriorPipeline,
)
from diffusers.pipelines.deprecated.wuerstchen import PaellaVQModel, WuerstchenDiffNeXt, WuerstchenPrior
from diffusers.pipelines.shap_e import ShapERenderer
from diffusers.pipelines.stable_diffusion.stable_unclip_image_normalizer import StableUnCLIPImageNormalizer
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPVisionModelWithProjection

from tiny_components import (
    CLIP_MAX_LENGTH,
    IMAGE_CALL,
    NEGATIVE,
    PROMPT,
    SD_UNET,
    SD_VAE,
    T5,
    Family,
    Model,
    blocks,
    call_generator,
    clip,
    clip_image_processor,
    clip_vision_encoder,
    configured,
    model,
    sd_scheduler,
    with_trained_zero_convs,
)

EMBED_DIM = 32  # CLIP hidden size and projection: the image-embedding width of the unCLIP-style families
IMAGE_SIZE = 32  # CLIP vision encoders' input size
STAGE_C_CHANNELS = 16  # channels of Würstchen / Stable Cascade stage C latents, the decoders' image embeddings


def _with_embedding_stats(factory: Callable[[], torch.nn.Module], mean: str, std: str) -> Model:
    """``factory`` with its zero-initialised parameters filled (``with_trained_zero_convs``), and the embedding
    statistics ``mean`` / ``std`` (zeros, and zeros or ones, when fresh) set to plausible values.

    ``PriorTransformer.post_process_latents`` returns ``latents * clip_std + clip_mean``: a fresh prior's zero
    ``clip_std`` would make every output zero.  ``StableUnCLIPImageNormalizer`` would be an identity.
    """

    def build():
        module = with_trained_zero_convs(factory)()
        with torch.no_grad():
            getattr(module, mean).normal_(std=0.5)
            getattr(module, std).uniform_(0.5, 1.5)
        return module

    return Model(build)


def _prior_transformer(config: dict) -> Model:
    """A ``PriorTransformer`` as a checkpoint leaves it: positional and ``prd`` embeddings, CLIP statistics set."""
    return _with_embedding_stats(configured(PriorTransformer, config), "clip_mean", "clip_std")


#: The Kandinsky 2.2 / Stable unCLIP prior: one block over the CLIP text states (one position per token).
UNCLIP_PRIOR = _prior_transformer(
    {
        "num_attention_heads": 2,
        "attention_head_dim": 12,
        "embedding_dim": EMBED_DIM,
        "num_layers": 1,
        "num_embeddings": CLIP_MAX_LENGTH,
    }
)
#: The CLIP vision encoder of Kandinsky 2.2's prior and Stable unCLIP image variation: ``EMBED_DIM`` wide.
IMAGE_ENCODER = clip_vision_encoder(
    CLIPVisionModelWithProjection, EMBED_DIM, image_size=IMAGE_SIZE, patch_size=4, heads=4
)
#: Kandinsky's MoVQ (a ``VQModel`` with spatial norms, whose group norms have 32 groups): spatial factor 2.
MOVQ = model(
    VQModel,
    {
        "in_channels": 3,
        "out_channels": 3,
        **blocks("DownEncoderBlock2D", "AttnDownEncoderBlock2D"),
        "block_out_channels": (32, 64),
        "layers_per_block": 1,
        "latent_channels": 4,
        "norm_num_groups": 8,
        "norm_type": "spatial",
        "num_vq_embeddings": 12,
        "vq_embed_dim": 4,
    },
)
#: Würstchen's / Stable Cascade's stage A: spatial factor 4 (pixel unshuffle, one strided level). The mixing residual
#: blocks scale their branches by ``gammas``, zeros when fresh.
PAELLA_VQ = model(PaellaVQModel, {"embed_dim": 32, "bottleneck_blocks": 1, "num_vq_embeddings": 2}, zeros_filled=True)


class _ShapERenderer(ShapERenderer):
    """``ShapERenderer``, ray-marching 1024 rays at a time with 8 + 16 samples per ray (not 4096 with 64 + 128).

    ``ShapEPipeline`` passes ``decode_to_image`` nothing but the frame size, and at the defaults the renderer
    evaluates its NeRF MLP at five million points for the smallest frames it can render (20 views of 32 x 32:
    ``20 * size**2`` must be a multiple of the ray batch), ten seconds on one core.  With these defaults 20 views
    of 16 x 16 take five ray batches of 1024 and a few hundredths of a second; the rendering itself (the latents
    projected and *copied into* ``mlp``'s parameters, coarse then importance-sampled fine rays) is the real one.
    """

    def decode_to_image(self, latents, device, size=64, ray_batch_size=1024, n_coarse_samples=8, n_fine_samples=16):
        return super().decode_to_image(latents, device, size, ray_batch_size, n_coarse_samples, n_fine_samples)


#: The components the two Stable unCLIP pipelines share: noised image embeddings as the UNet's class labels.
STABLE_UNCLIP_DENOISER = {
    "image_normalizer": _with_embedding_stats(
        configured(StableUnCLIPImageNormalizer, {"embedding_dim": EMBED_DIM}), "mean", "std"
    ),
    "image_noising_scheduler": partial(DDPMScheduler, beta_schedule="squaredcos_cap_v2"),
    "text_encoder": clip(CLIPTextModel),
    "unet": model(
        UNet2DConditionModel,
        SD_UNET,
        {
            "class_embed_type": "projection",
            "projection_class_embeddings_input_dim": 2 * EMBED_DIM,  # the embedding and its noise level's
            "upcast_attention": True,
            "use_linear_projection": True,
        },
    ),
    "scheduler": sd_scheduler(DDIMScheduler, prediction_type="v_prediction", set_alpha_to_one=False),
    "vae": SD_VAE,
}


def _image_embeds(seed: int, call: dict) -> dict:
    generator = call_generator(seed, "image_embeds")
    return {
        "image_embeds": torch.randn(1, EMBED_DIM, generator=generator),
        "negative_image_embeds": torch.randn(1, EMBED_DIM, generator=generator),
    }


def _stage_c_embeddings(seed: int, call: dict) -> dict:
    # 2 x 2 stage C -> 8 x 8 stage B latents (latent_dim_scale 4) -> 32 x 32 images
    generator = call_generator(seed, "image_embeddings")
    return {"image_embeddings": torch.randn(1, STAGE_C_CHANNELS, 2, 2, generator=generator)}


def _input_image(seed: int, call: dict) -> dict:
    generator = call_generator(seed, "image")
    pixels = torch.randint(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=torch.uint8, generator=generator)
    return {"image": PIL.Image.fromarray(pixels.numpy())}


def _stage_b(pipeline, parts: dict) -> Family:
    """A cascade decoder: stage B (``parts``) and the Paella VQ stage A, on the call's stage C embeddings."""
    stage_a = {"scheduler": DDPMWuerstchenScheduler, "vqgan": PAELLA_VQ, "latent_dim_scale": 4.0}
    return Family(
        "cascade",
        pipeline,
        {**parts, **stage_a},
        {**_PROMPTS, "guidance_scale": 2.0, "output_type": "pt"},
        _IMAGES,
        _stage_c_embeddings,
    )


_STEPS = {"num_inference_steps": 2}
_PROMPTS = {**_STEPS, "prompt": PROMPT, **NEGATIVE}
#: 256 px: a 6 x 6 stage C latent (resolution_multiple 42.67).
_STAGE_C_CALL = {**_PROMPTS, "height": 256, "width": 256, "guidance_scale": 4.0, "output_type": "pt"}
_IMAGES = ("images",)
_STAGE_C = ("image_embeddings",)

FAMILIES: dict[str, Family] = {
    # CLIP text encoder (projection + hidden states) -> PriorTransformer -> CLIP image embedding. No negative prompt:
    # the negative embedding then is the image encoder's (see the module docstring).
    "kandinsky22_prior": Family(
        "prior",
        KandinskyV22PriorPipeline,
        {
            "prior": UNCLIP_PRIOR,
            "image_encoder": IMAGE_ENCODER,
            "text_encoder": clip(CLIPTextModelWithProjection),
            "scheduler": partial(
                UnCLIPScheduler,
                variance_type="fixed_small_log",
                prediction_type="sample",
                num_train_timesteps=1000,
                clip_sample=True,
                clip_sample_range=10.0,
            ),
            "image_processor": partial(clip_image_processor, IMAGE_SIZE),
        },
        {**_STEPS, "prompt": PROMPT, "guidance_scale": 4.0, "output_type": "pt"},
        ("image_embeds", "negative_image_embeds"),
    ),
    # image-embedding-conditioned UNet (learned variance), MoVQ decoder
    "kandinsky22": Family(
        "unet",
        KandinskyV22Pipeline,
        {
            "unet": model(
                UNet2DConditionModel,
                {
                    "in_channels": 4,
                    "out_channels": 8,  # mean and variance
                    "addition_embed_type": "image",
                    **blocks("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
                    "mid_block_type": "UNetMidBlock2DSimpleCrossAttn",
                    "block_out_channels": (32, 64),
                    "layers_per_block": 1,
                    "encoder_hid_dim": EMBED_DIM,
                    "encoder_hid_dim_type": "image_proj",
                    "cross_attention_dim": EMBED_DIM,
                    "attention_head_dim": 4,
                    "resnet_time_scale_shift": "scale_shift",
                    "class_embed_type": None,
                },
            ),
            "scheduler": partial(
                DDIMScheduler,
                num_train_timesteps=1000,
                beta_schedule="linear",
                beta_start=0.00085,
                beta_end=0.012,
                clip_sample=False,
                set_alpha_to_one=False,
                steps_offset=1,
                prediction_type="epsilon",
                thresholding=False,
            ),
            "movq": MOVQ,
        },
        {**_STEPS, "height": 16, "width": 16, "output_type": "pt", "guidance_scale": 4.0},
        _IMAGES,
        _image_embeds,
    ),
    # T5 encoder (context cut to the prompt), Kandinsky3UNet with attention pooling (its output layer starts at
    # zero), MoVQ
    "kandinsky3": Family(
        "unet",
        Kandinsky3Pipeline,
        {
            "text_encoder": T5,
            "unet": model(
                Kandinsky3UNet,
                {
                    "in_channels": 4,
                    "time_embedding_dim": 4,
                    "groups": 2,
                    "attention_head_dim": 4,
                    "layers_per_block": 3,
                    "block_out_channels": (32, 64),
                    "cross_attention_dim": 4,
                    "encoder_hid_dim": 32,  # T5 d_model
                },
                zeros_filled=True,
            ),
            "scheduler": partial(
                DDPMScheduler,
                beta_start=0.00085,
                beta_end=0.012,
                steps_offset=1,
                beta_schedule="squaredcos_cap_v2",
                clip_sample=True,
                thresholding=False,
            ),
            "movq": MOVQ,
        },
        {**IMAGE_CALL, **NEGATIVE, "guidance_scale": 3.0},
        _IMAGES,
    ),
    # A CLIP-with-projection text encoder and a prior make the image embedding, which is normalised, noised and fed
    # to an SD 2.1-style UNet as class embedding; noise_level > 0, or the normalizer's statistics would cancel out
    # (scale, no noise, unscale).
    "stable_unclip": Family(
        "prior",
        StableUnCLIPPipeline,
        {
            "prior_text_encoder": clip(CLIPTextModelWithProjection),
            "prior": UNCLIP_PRIOR,
            "prior_scheduler": partial(
                DDPMScheduler,
                variance_type="fixed_small_log",
                prediction_type="sample",
                num_train_timesteps=1000,
                clip_sample=True,
                clip_sample_range=5.0,
                beta_schedule="squaredcos_cap_v2",
            ),
            **STABLE_UNCLIP_DENOISER,
        },
        {
            **IMAGE_CALL,
            **NEGATIVE,
            "guidance_scale": 10.0,
            "prior_num_inference_steps": 2,
            "prior_guidance_scale": 4.0,
            "noise_level": 100,
        },
        _IMAGES,
    ),
    # the CLIP vision encoder embeds the input image, the rest as stable_unclip
    "stable_unclip_img2img": Family(
        "unet",
        StableUnCLIPImg2ImgPipeline,
        {
            "feature_extractor": partial(clip_image_processor, IMAGE_SIZE),
            "image_encoder": IMAGE_ENCODER,
            **STABLE_UNCLIP_DENOISER,
        },
        {**IMAGE_CALL, **NEGATIVE, "guidance_scale": 10.0, "noise_level": 100},
        _IMAGES,
        _input_image,
    ),
    # Würstchen stage C: CLIP text hidden states -> WuerstchenPrior -> 16-channel image embeddings
    "wuerstchen_prior": Family(
        "prior",
        WuerstchenPriorPipeline,
        {
            "text_encoder": clip(CLIPTextModel),
            "prior": model(
                WuerstchenPrior,
                {"c_in": STAGE_C_CHANNELS, "c": 8, "depth": 2, "c_cond": EMBED_DIM, "c_r": 8, "nhead": 2},
                zeros_filled=True,
            ),
            "scheduler": DDPMWuerstchenScheduler,
        },
        _STAGE_C_CALL,
        _STAGE_C,
        # measured: e4m3 rounding of any single one of its 18 linear layers (weight error ~3% of the row maximum)
        # moves the untrained prior's output by 1 to 78 (output max 188); the pipeline then amplifies it further
        chaotic="an untrained Würstchen prior amplifies a 3% change of any one layer's weights 10-400x",
    ),
    # Stable Cascade stage C: CLIP text (hidden states and pooled projection) -> StableCascadeUNet; no image
    # conditioning (image_encoder / feature_extractor are optional and left out, as in diffusers' test)
    "stable_cascade_prior": Family(
        "prior",
        StableCascadePriorPipeline,
        {
            "text_encoder": clip(CLIPTextModelWithProjection),
            "prior": model(
                StableCascadeUNet,
                {
                    "in_channels": STAGE_C_CHANNELS,
                    "out_channels": STAGE_C_CHANNELS,
                    "conditioning_dim": 32,
                    "block_out_channels": (32, 32),
                    "num_attention_heads": (2, 2),
                    "down_num_layers_per_block": (1, 1),
                    "up_num_layers_per_block": (1, 1),
                    "switch_level": (False,),
                    "clip_image_in_channels": EMBED_DIM,
                    "clip_text_in_channels": EMBED_DIM,
                    "clip_text_pooled_in_channels": EMBED_DIM,
                    "dropout": (0.1, 0.1),
                },
                zeros_filled=True,
            ),
            "scheduler": DDPMWuerstchenScheduler,
            "feature_extractor": None,
            "image_encoder": None,
        },
        _STAGE_C_CALL,
        _STAGE_C,
    ),
    # Würstchen stage B: WuerstchenDiffNeXt conditioned on the CLIP text and the stage C embeddings (injected at its
    # second level, as the real model does from its second level on), Paella VQ stage A
    "wuerstchen_decoder": _stage_b(
        WuerstchenDecoderPipeline,
        {
            "text_encoder": clip(CLIPTextModel),
            # ``WuerstchenDiffNeXt._init_weights`` runs once per submodule (``self.apply``) and scales every
            # ``ResBlockStageB``'s last ``channelwise`` layer by ``sqrt(1 / sum(blocks))`` each time: a fresh model's
            # are about 1e-15, so its residual blocks -- and the stage C embeddings they inject -- would have no
            # influence.  Those are filled like the zero-initialised parameters.
            "decoder": Model(
                with_trained_zero_convs(
                    configured(
                        WuerstchenDiffNeXt,
                        {
                            "c_in": 4,
                            "c_out": 4,
                            "c_cond": EMBED_DIM,
                            "c_hidden": [16, 32],
                            "nhead": [-1, 2],
                            "blocks": [1, 1],
                            "level_config": ["CT", "CTA"],
                            "inject_effnet": [False, True],
                            "effnet_embd": STAGE_C_CHANNELS,
                            "clip_embd": EMBED_DIM,
                        },
                    ),
                    below=1e-6,
                )
            ),
        },
    ),
    # Stable Cascade stage B: StableCascadeUNet with effnet (stage C) and pixel mappers, up blocks run twice per call
    # (repeat mappers), pooled CLIP text conditioning; Paella VQ stage A
    "stable_cascade_decoder": _stage_b(
        StableCascadeDecoderPipeline,
        {
            "decoder": model(
                StableCascadeUNet,
                {
                    "in_channels": 4,
                    "out_channels": 4,
                    "conditioning_dim": 32,
                    "block_out_channels": (16, 32),
                    "num_attention_heads": (-1, 2),
                    "down_num_layers_per_block": (1, 1),
                    "up_num_layers_per_block": (1, 1),
                    "down_blocks_repeat_mappers": (1, 1),
                    "up_blocks_repeat_mappers": (2, 2),
                    "block_types_per_layer": (
                        ("SDCascadeResBlock", "SDCascadeTimestepBlock"),
                        ("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"),
                    ),
                    "switch_level": None,
                    "clip_text_pooled_in_channels": EMBED_DIM,
                    "effnet_in_channels": STAGE_C_CHANNELS,
                    "pixel_mapper_in_channels": 3,
                    "dropout": (0.1, 0.1),
                },
                zeros_filled=True,
            ),
            "text_encoder": clip(CLIPTextModelWithProjection),
        },
    ),
    # Shap-E text-to-3D: CLIP projection -> PriorTransformer over 32 latent tokens -> NeRF renderer (the latents are
    # projected into the renderer's MLP weights, then 20 views are ray-marched); 16 wide, the renderer 8 wide
    "shap_e": Family(
        "3d",
        ShapEPipeline,
        {
            "prior": _prior_transformer(
                {
                    "num_attention_heads": 2,
                    "attention_head_dim": 16,
                    "embedding_dim": 16,
                    "num_embeddings": 32,
                    "embedding_proj_dim": 16,  # CLIP projection
                    "time_embed_dim": 4 * 16,
                    "num_layers": 1,
                    "clip_embed_dim": 2 * 16,  # mean and variance
                    "additional_embeddings": 0,
                    "time_embed_act_fn": "gelu",
                    "norm_in_type": "layer",
                    "encoder_hid_proj_type": None,
                    "added_emb_type": None,
                }
            ),
            "text_encoder": clip(CLIPTextModelWithProjection, hidden_size=16),
            "shap_e_renderer": model(
                _ShapERenderer,
                {
                    "param_shapes": ((8, 93), *((8, 8),) * 3),
                    "d_latent": 16,
                    "d_hidden": 8,
                    "n_output": 12,
                    "background": (0.1, 0.1, 0.1),
                },
            ),
            "scheduler": partial(
                HeunDiscreteScheduler,
                beta_schedule="exp",
                num_train_timesteps=1024,
                prediction_type="sample",
                use_karras_sigmas=True,
                clip_sample=True,
                clip_sample_range=1.0,
            ),
        },
        {**_STEPS, "prompt": PROMPT, "guidance_scale": 4.0, "frame_size": 16, "output_type": "np"},
        _IMAGES,
        rewritten=("shap_e_renderer.mlp.",),
    ),
}
