"""Tiny image pipelines whose denoiser is a UNet, on latents or on pixels, as ``Family`` tables (see
``tiny_components``).

* ``sd15`` (CLIP, UNet, VAE with ``quant_conv``; PNDM as shipped), ``sdxl`` (CLIP + CLIP-with-projection, hidden
  states concatenated to 64, micro-conditioned UNet) and ``controlnet`` (SD 1.5 with a ControlNet: its
  conditioning image at full resolution, down-scaled to the latents; a fresh ControlNet's "zero convolutions"
  filled, as trained ones are): UNets with skip connections and a ControlNet feeding them residuals;
* ``ldm_text2img`` (CompVis ldm-text2im-large-256): components named otherwise than ``text_encoder`` / ``vae``
  (``bert``, ``vqvae``); the pipeline makes its latents ``height // 8`` and pads to 77 tokens, so a factor-8 VAE
  and 32 px images;
* ``lcm`` (LCM Dreamshaper layout): a guidance-distilled UNet, the guidance scale embedded through its
  ``time_cond_proj_dim``;
* ``sd_upscale`` (the x4 upscaler): a UNet that takes the noised low-resolution image and its noise level (as class
  labels) besides the latents, a pipeline that reads its VAE's ``post_quant_conv`` parameters for their dtype
  before decoding; its low-resolution image is a fixed random image derived from the call seed;
* pixel space: ``deepfloyd_if`` (IF stage I: T5 + UNet with learned variance, no VAE at all, no safety checker,
  watermarker nor feature extractor), ``ddpm`` (google/ddpm-cifar10 layout, unconditional) and
  ``consistency_models`` (openai cd_imagenet64 layout, class-conditional): pipelines without any text encoder.
"""

from __future__ import annotations

from functools import partial

from diffusers import (
    CMStochasticIterativeScheduler,
    ConsistencyModelPipeline,
    ControlNetModel,
    DDIMScheduler,
    DDPMPipeline,
    DDPMScheduler,
    EulerDiscreteScheduler,
    IFPipeline,
    LatentConsistencyModelPipeline,
    LCMScheduler,
    LDMTextToImagePipeline,
    PNDMScheduler,
    StableDiffusionControlNetPipeline,
    StableDiffusionPipeline,
    StableDiffusionUpscalePipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
    UNet2DModel,
    UniPCMultistepScheduler,
)
from diffusers.pipelines.latent_diffusion.pipeline_latent_diffusion import LDMBertConfig, LDMBertModel
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from tiny_components import (
    BERT_MAX_LENGTH,
    IMAGE_CALL,
    NEGATIVE,
    NEGATIVE_PROMPT,
    NO_SAFETY_CHECKER,
    PROMPT,
    SD_UNET,
    SD_VAE,
    T5,
    UNET_DOWN,
    Family,
    Text,
    bert_tokenizer,
    blocks,
    clip,
    factor8_vae,
    kl_vae,
    model,
    random_image,
    sd_scheduler,
    unet_levels,
    vocabulary,
)

#: sd_upscale's low-resolution input: 8 x 8 pixels, upscaled to 32 x 32.
LOW_RES_SIZE = 8


#: LDM-BERT: two layers, 32 wide, its positions as long as the padded prompt.
_LDM_BERT = {
    "max_position_embeddings": BERT_MAX_LENGTH,
    "encoder_layers": 2,
    "encoder_ffn_dim": 64,
    "encoder_attention_heads": 4,
    "head_dim": 8,
    "d_model": 32,
    "dropout": 0.0,
}


def _ldm_bert(tokenizer):
    config = LDMBertConfig(**vocabulary(tokenizer, "pad"), **_LDM_BERT)
    return lambda: LDMBertModel(config)


#: The SD 1.5 text-to-image components (the ControlNet and LCM pipelines' too).
SD15 = {
    "vae": SD_VAE,
    "text_encoder": clip(CLIPTextModel),
    "unet": model(UNet2DConditionModel, SD_UNET),
    **NO_SAFETY_CHECKER,
}

#: A two-level pixel-space ``UNet2DModel`` (3 channels, self-attention at the lower level).
_PIXEL_UNET = {
    **unet_levels(16, 3, (8, 16), "DownBlock2D", "AttnDownBlock2D"),
    "norm_num_groups": 4,
    "attention_head_dim": 4,
}
_ADDITION_TIME_EMBED_DIM = 8
_SD_CALL = {**IMAGE_CALL, **NEGATIVE}
#: the unconditional and class-conditional pixel-space calls
_BATCH = {"batch_size": 1, "num_inference_steps": 2, "output_type": "pt"}


def _control_image(seed: int, call: dict) -> dict:
    """The ControlNet's conditioning image: a fixed random image, derived from the call seed like the call's
    generator, so each call seed conditions on a different image."""
    return {"image": random_image(seed, "control_image", call["height"], call["width"])}


def _low_res_image(seed: int, call: dict) -> dict:
    """The upscaler's low-resolution image, derived from the call seed: each call seed upscales another image."""
    return {"image": random_image(seed, "low_res_image", LOW_RES_SIZE)}


FAMILIES: dict[str, Family] = {
    "sd15": Family(
        "unet",
        StableDiffusionPipeline,
        {**SD15, "scheduler": sd_scheduler(PNDMScheduler, skip_prk_steps=True, set_alpha_to_one=False)},
        {**_SD_CALL, "guidance_scale": 7.5},
    ),
    "sdxl": Family(
        "unet",
        StableDiffusionXLPipeline,
        {
            "vae": SD_VAE,
            "text_encoder": clip(CLIPTextModel),
            "text_encoder_2": clip(CLIPTextModelWithProjection),
            "unet": model(
                UNet2DConditionModel,
                SD_UNET,
                {
                    "cross_attention_dim": 64,  # the two CLIP hidden sizes, concatenated
                    "transformer_layers_per_block": (1, 2),
                    "use_linear_projection": True,
                    "addition_embed_type": "text_time",
                    "addition_time_embed_dim": _ADDITION_TIME_EMBED_DIM,
                    # six micro-conditioning numbers, plus the pooled text_encoder_2 projection (32)
                    "projection_class_embeddings_input_dim": 6 * _ADDITION_TIME_EMBED_DIM + 32,
                },
            ),
            "scheduler": sd_scheduler(EulerDiscreteScheduler, timestep_spacing="leading"),
            "add_watermarker": False,
        },
        {**_SD_CALL, "guidance_scale": 5.0},
    ),
    "controlnet": Family(
        "unet",
        StableDiffusionControlNetPipeline,
        {
            **SD15,
            # conditioning embedding: one stride-2 step, the VAE's scale factor
            "controlnet": model(
                ControlNetModel, UNET_DOWN, {"conditioning_embedding_out_channels": (8, 16)}, zeros_filled=True
            ),
            "scheduler": sd_scheduler(UniPCMultistepScheduler),
        },
        {**_SD_CALL, "guidance_scale": 7.5},
        inputs=_control_image,
    ),
    "ldm_text2img": Family(
        "unet",
        LDMTextToImagePipeline,
        {
            "vqvae": factor8_vae(scaling_factor=0.18215),
            "bert": Text(bert_tokenizer, _ldm_bert),
            "unet": model(UNet2DConditionModel, SD_UNET),
            "scheduler": sd_scheduler(DDIMScheduler, clip_sample=False, set_alpha_to_one=False),
        },
        {**IMAGE_CALL, "height": 32, "width": 32, "guidance_scale": 6.0},
    ),
    "lcm": Family(
        "unet",
        LatentConsistencyModelPipeline,
        {
            **SD15,
            "unet": model(UNet2DConditionModel, SD_UNET, {"time_cond_proj_dim": 32}),
            "scheduler": sd_scheduler(LCMScheduler, clip_sample=False, set_alpha_to_one=False),
        },
        {**IMAGE_CALL, "guidance_scale": 8.5},
    ),
    # factor-4 VAE; DDIM v-prediction, DDPM to noise the low-resolution image
    "sd_upscale": Family(
        "unet",
        StableDiffusionUpscalePipeline,
        {
            "vae": kl_vae(4, scaling_factor=0.08333, levels=3),
            "text_encoder": clip(CLIPTextModel),
            "unet": model(
                UNet2DConditionModel,
                {
                    "sample_size": 8,
                    "in_channels": 7,  # 4 latent channels + the 3 image channels
                    "out_channels": 4,
                    "block_out_channels": (8, 16, 16),
                    "layers_per_block": 1,
                    **blocks("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                    "norm_num_groups": 4,
                    "cross_attention_dim": 32,
                    "attention_head_dim": 2,
                    "use_linear_projection": True,
                    "only_cross_attention": (True, True, False),
                    "num_class_embeds": 1000,  # noise levels
                },
            ),
            "low_res_scheduler": partial(
                DDPMScheduler, beta_schedule="scaled_linear", beta_start=0.0001, beta_end=0.02
            ),
            "scheduler": partial(
                DDIMScheduler,
                beta_schedule="scaled_linear",
                beta_start=0.0001,
                beta_end=0.02,
                prediction_type="v_prediction",
                clip_sample=False,
                set_alpha_to_one=False,
                steps_offset=1,
            ),
            "max_noise_level": 350,
        },
        {
            "prompt": PROMPT,
            "negative_prompt": NEGATIVE_PROMPT,
            "num_inference_steps": 2,
            "guidance_scale": 6.0,
            "noise_level": 20,
            "output_type": "pt",
        },
        inputs=_low_res_image,
    ),
    # text-pooled time embedding, added-KV cross-attention; DDPM with dynamic thresholding
    "deepfloyd_if": Family(
        "pixel",
        IFPipeline,
        {
            "text_encoder": T5,
            "unet": model(
                UNet2DConditionModel,
                {
                    "sample_size": 16,
                    "layers_per_block": 1,
                    "block_out_channels": (16, 32),
                    **blocks("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
                    "mid_block_type": "UNetMidBlock2DSimpleCrossAttn",
                    "in_channels": 3,
                    "out_channels": 6,  # noise and variance
                    "norm_num_groups": 8,
                    "cross_attention_dim": 32,
                    "encoder_hid_dim": 32,  # T5 d_model
                    "attention_head_dim": 8,
                    "addition_embed_type": "text",
                    "addition_embed_type_num_heads": 2,
                    "cross_attention_norm": "group_norm",
                    "resnet_time_scale_shift": "scale_shift",
                    "act_fn": "gelu",
                },
            ),
            "scheduler": partial(
                DDPMScheduler,
                beta_schedule="squaredcos_cap_v2",
                thresholding=True,
                dynamic_thresholding_ratio=0.95,
                sample_max_value=1.0,
                prediction_type="epsilon",
                variance_type="learned_range",
            ),
            **NO_SAFETY_CHECKER,
            "watermarker": None,
        },
        {**_SD_CALL, "guidance_scale": 7.0, "clean_caption": False},
    ),
    "ddpm": Family(
        "pixel",
        DDPMPipeline,
        {"unet": model(UNet2DModel, _PIXEL_UNET), "scheduler": DDPMScheduler},
        _BATCH,
    ),
    # scale-shift time conditioning and resnet down/up-sampling; multistep consistency sampling
    "consistency_models": Family(
        "pixel",
        ConsistencyModelPipeline,
        {
            "unet": model(
                UNet2DModel,
                _PIXEL_UNET,
                {
                    "resnet_time_scale_shift": "scale_shift",
                    "downsample_type": "resnet",
                    "upsample_type": "resnet",
                    "num_class_embeds": 10,
                },
            ),
            "scheduler": partial(
                CMStochasticIterativeScheduler, num_train_timesteps=40, sigma_min=0.002, sigma_max=80.0
            ),
        },
        {**_BATCH, "class_labels": 1},
    ),
}
