"""Tiny video pipelines, as ``Family`` tables (see ``tiny_components``).

* DiTs: ``wan22`` (Wan 2.2 A14B layout: a high-noise ``transformer`` and a low-noise ``transformer_2``, the Wan VAE's
  feature cache) and ``ltx`` (LTX-Video: causal video VAE, spatial x4, temporal x4), two of the five families
  memmode was written for; ``hunyuanvideo`` (Llama read at its third-last layer, so its last two compute for
  nothing, + pooled CLIP; dual/single-stream DiT with a token refiner; causal 3D VAE, spatial x8, temporal x4),
  ``cogvideox`` (2B layout: sinusoidal 3D positions, no RoPE; expert-adaLN DiT), ``mochi`` (asymmetric DiT, its
  text stream narrower than the visual one; causal 3D VAE x8, x6), ``latte`` (T5 with 120 tokens, masked; a DiT
  alternating spatial and temporal blocks; frames decoded one image at a time by a 2D VAE) and ``allegro`` (3D DiT;
  ``AutoencoderKLAllegro``, which decodes *only* tiled: the tile geometry is instance state, set to one 8-frame
  16x16 tile here, the shipped one is sized for 720p);
* image-conditioned video, where an image encoder and a VAE *encode* run before the denoising loop: ``svd``
  (CLIP image embeddings and the image's VAE latents, spatio-temporal UNet, temporal-decoder VAE; the pipeline
  passes ``num_frames`` to ``vae.decode`` only if ``inspect.signature(vae.forward)`` names it, so a wrapper hiding
  that signature makes ``decode`` fail; three frames decoded in chunks of two, so the decoder sees both
  ``num_frames=2`` and ``num_frames=1``) and ``wan21_i2v`` (Wan 2.1 layout: UMT5, a CLIP vision encoder read at its
  second-last hidden state, image cross-attention; its prompt cleaning calls ``ftfy`` even when it is not
  installed: an identity stands in for it then) and ``framepack`` (HunyuanVideo's text encoders, VAE and DiT with
  FramePack's history embedder and image projection; a ``SiglipVisionModel`` image encoder with its attention-pooling
  head, whose ``nn.MultiheadAttention`` reads its child ``out_proj``'s weight and bias in its own ``forward``
  (``F.multi_head_attention_forward``) without calling ``out_proj``: the head runs in every encoder forward, though
  the pipeline keeps only ``last_hidden_state``). Their input image is a fixed random image derived from the call
  seed: SVD takes it as a tensor (its processor then skips the resize to CLIP's 224 pixels), Wan and FramePack as a
  PIL image (the CLIP / SigLIP processor resizes it to the vision encoder's 32 / 16 pixels);
* UNets with temporal layers: ``animatediff`` (an SD 1.5 UNet merged with a ``MotionAdapter`` into a
  ``UNetMotionModel``, what the pipeline's ``__init__`` does; done here inside the ``unet`` component, so no idle
  ``motion_adapter`` copy of the motion weights is left in the pipeline) and ``text_to_video_sd`` (ModelScope:
  ``UNet3DConditionModel``, whose temporal convolutions end in zero-initialised layers, filled as trained ones
  are).

SVD and the Wan image-to-video pipeline return the bare frames for ``return_dict=False``: their output object's
``frames`` are read instead, as for every family here but the first two.
"""

from __future__ import annotations

from functools import cache, partial
from types import SimpleNamespace

import numpy as np
import PIL.Image
import torch
from diffusers import (
    AllegroPipeline,
    AllegroTransformer3DModel,
    AnimateDiffPipeline,
    AutoencoderKLAllegro,
    AutoencoderKLCogVideoX,
    AutoencoderKLHunyuanVideo,
    AutoencoderKLLTXVideo,
    AutoencoderKLMochi,
    AutoencoderKLTemporalDecoder,
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
    DDIMScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideoFramepackPipeline,
    HunyuanVideoFramepackTransformer3DModel,
    HunyuanVideoPipeline,
    HunyuanVideoTransformer3DModel,
    LattePipeline,
    LatteTransformer3DModel,
    LTXPipeline,
    LTXVideoTransformer3DModel,
    MochiPipeline,
    MochiTransformer3DModel,
    MotionAdapter,
    StableVideoDiffusionPipeline,
    TextToVideoSDPipeline,
    UNet2DConditionModel,
    UNet3DConditionModel,
    UNetMotionModel,
    UNetSpatioTemporalConditionModel,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE as HUNYUAN_TEMPLATE
from diffusers.pipelines.wan import pipeline_wan_i2v
from transformers import (
    CLIPTextModel,
    CLIPVisionModel,
    CLIPVisionModelWithProjection,
    LlamaConfig,
    LlamaModel,
    LlamaTokenizer,
    SiglipImageProcessor,
    SiglipVisionConfig,
    SiglipVisionModel,
    T5Config,
    T5EncoderModel,
)

from tiny_components import (
    IMAGE_CALL,
    MAX_SEQUENCE_LENGTH,
    NEGATIVE,
    NEGATIVE_PROMPT,
    PIXART_DIT,
    PROMPT,
    SD_VAE,
    T5,
    TEXT_LENGTH,
    UMT5,
    WAN_TRANSFORMER,
    WAN_VAE,
    Family,
    Model,
    Text,
    blocks,
    clip,
    clip_encoder,
    clip_image_processor,
    clip_tokenizer,
    clip_vision_encoder,
    cogvideox_scheduler,
    configured,
    lm_encoder,
    model,
    random_image,
    sd_scheduler,
    sentencepiece_bpe,
    t5_encoder,
    t5_tokenizer,
    unet_levels,
)

_LLAMA_SPECIALS = [
    "<unk>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<pad>",
]


def _llama_tokenizer() -> LlamaTokenizer:
    """Llama 3 special tokens (the chat-template headers are single tokens), padding on the right: HunyuanVideo
    crops the template off the front of the encoder output. Whole-word tokens for its default chat template, so the
    encoder sees prompts of about the real token count."""
    text = "\n".join([PROMPT, NEGATIVE_PROMPT, HUNYUAN_TEMPLATE["template"]])
    return sentencepiece_bpe(
        LlamaTokenizer,
        _LLAMA_SPECIALS,
        text,
        unk_token="<unk>",
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<pad>",
        additional_special_tokens=_LLAMA_SPECIALS[3:6],
        padding_side="right",
        add_bos_token=True,
    )


def _clip_tokenizer_77():
    """The pipeline pads the CLIP prompt to 77 tokens, whatever the tokenizer says."""
    tokenizer = clip_tokenizer()
    tokenizer.model_max_length = 77
    return tokenizer


@cache
def _hunyuan_prompt_template() -> dict:
    """The pipeline's default Llama chat template, with ``crop_start`` (the token count of the part before the
    prompt, 95 with the real tokenizer) counted with ours, so that exactly the prompt is kept."""
    prefix = HUNYUAN_TEMPLATE["template"].split("{}")[0]
    return {"template": HUNYUAN_TEMPLATE["template"], "crop_start": len(_llama_tokenizer()(prefix).input_ids)}


def _video_vae(cls, prefix: str, config: dict) -> Model:
    """A four-level causal 3D VAE of ``cls`` (its ``<prefix>DownBlock3D`` / ``UpBlock3D``), 8 channels wide, four
    latent channels."""
    return model(
        cls,
        {
            "in_channels": 3,
            "out_channels": 3,
            "latent_channels": 4,
            **blocks(*[f"{prefix}DownBlock3D"] * 4),
            "block_out_channels": (8, 8, 8, 8),
            "layers_per_block": 1,
        },
        config,
    )


def _allegro_vae() -> AutoencoderKLAllegro:
    vae = _video_vae(AutoencoderKLAllegro, "Allegro", {"norm_num_groups": 2, "temporal_compression_ratio": 4}).factory()
    # It decodes only tiled.  The tile (frames, height, width) and its stride are instance state, sized in __init__
    # for 720p; one tile of 8 frames at 16x16 here (2 latent frames of 2x2).
    vae.enable_tiling()
    vae.kernel = vae.stride = (8, 16, 16)
    return vae


def _video_unet(dims: str, widths: tuple[int, int], cross_attention_dim: int) -> dict:
    """A two-level UNet of ``<...>Block<dims>`` blocks, cross-attention (to CLIP states ``cross_attention_dim`` wide)
    at the upper level."""
    return {
        **unet_levels(8, 4, widths, f"CrossAttnDownBlock{dims}", f"DownBlock{dims}"),
        "norm_num_groups": 2,
        "attention_head_dim": 4,
        "cross_attention_dim": cross_attention_dim,
    }


def _motion_unet() -> UNetMotionModel:
    """An SD 1.5-style UNet merged with a ``MotionAdapter``."""
    unet_2d = configured(UNet2DConditionModel, _video_unet("2D", (16, 32), cross_attention_dim=32))()
    adapter = configured(
        MotionAdapter,
        {
            "block_out_channels": (16, 32),
            "motion_layers_per_block": 1,
            "motion_norm_num_groups": 2,
            "motion_num_attention_heads": 4,
        },
    )()
    return UNetMotionModel.from_unet2d(unet_2d, adapter)


def _wan_i2v_pipeline(**parts) -> WanImageToVideoPipeline:
    """The Wan image-to-video pipeline, able to clean prompts without ``ftfy`` (not a dependency of the suite).

    Its ``basic_clean`` calls ``ftfy.fix_text`` unconditionally, though it imports ``ftfy`` only if it is installed
    (the text-to-video pipeline checks ``is_ftfy_available()`` first).  ``fix_text`` leaves our plain-ASCII prompts
    unchanged, so an identity stands in for it when ``ftfy`` is missing.
    """
    if not hasattr(pipeline_wan_i2v, "ftfy"):
        pipeline_wan_i2v.ftfy = SimpleNamespace(fix_text=lambda text: text)
    return WanImageToVideoPipeline(**parts)


def _prompt_template(seed: int, call: dict) -> dict:
    return {"prompt_template": dict(_hunyuan_prompt_template())}


def _image_tensor(seed: int, call: dict) -> dict:
    return {"image": random_image(seed, "image", call["height"])}


def _image_pil(seed: int, call: dict) -> dict:
    pixels = (random_image(seed, "image", call["height"])[0] * 255).round().to(torch.uint8)
    return {"image": PIL.Image.fromarray(np.ascontiguousarray(pixels.permute(1, 2, 0).numpy()))}


#: The HunyuanVideo DiT (dual/single-stream blocks, token refiner), HunyuanVideo's and FramePack's.
_HUNYUANVIDEO_DIT = {
    "in_channels": 4,
    "out_channels": 4,
    "num_attention_heads": 2,
    "attention_head_dim": 10,
    "num_layers": 2,
    "num_single_layers": 2,
    "num_refiner_layers": 2,
    "patch_size": 1,
    "patch_size_t": 1,
    "guidance_embeds": True,
    "text_embed_dim": 16,  # Llama hidden size
    "pooled_projection_dim": 8,  # CLIP hidden size
    "rope_axes_dim": (2, 4, 4),
}
#: What the HunyuanVideo pipelines hold besides their transformer: Llama (three layers: the pipelines read
#: hidden_states[-3], so the last two never count) + pooled CLIP, the causal 3D VAE, flow matching shifted by 7.
_HUNYUANVIDEO_PARTS = {
    "text_encoder": Text(_llama_tokenizer, partial(lm_encoder, LlamaModel, LlamaConfig, layers=3, max_positions=256)),
    "text_encoder_2": Text(_clip_tokenizer_77, partial(clip_encoder, CLIPTextModel, hidden_size=8)),
    "vae": _video_vae(
        AutoencoderKLHunyuanVideo,
        "HunyuanVideo",
        {
            "norm_num_groups": 4,
            "scaling_factor": 0.476986,
            "spatial_compression_ratio": 8,
            "temporal_compression_ratio": 4,
            "mid_block_add_attention": True,
        },
    ),
    "scheduler": partial(FlowMatchEulerDiscreteScheduler, shift=7.0),
}
#: FramePack's SigLIP vision tower: two layers, 16 px images in 4x4 patches.
_SIGLIP = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 16,
    "patch_size": 4,
}


def _siglip_vision_encoder() -> SiglipVisionModel:
    """SigLIP with its attention-pooling head (``vision_use_head``, on by default): the head's
    ``nn.MultiheadAttention`` hands ``out_proj.weight`` / ``out_proj.bias`` (and its own ``in_proj_weight``) to
    ``F.multi_head_attention_forward`` without calling ``out_proj``. It runs in every forward, though the pipeline
    takes only ``last_hidden_state`` (its ``pooler_output`` is dropped)."""
    return SiglipVisionModel(SiglipVisionConfig(**_SIGLIP, vision_use_head=True))


def _framepack_inputs(seed: int, call: dict) -> dict:
    return {**_prompt_template(seed, call), **_image_pil(seed, call)}


_CALL = {**IMAGE_CALL, **TEXT_LENGTH, **NEGATIVE}
_VIDEO = {**IMAGE_CALL, **NEGATIVE}
_SVD_TIME_EMBED_DIM = 8
_FRAMES = ("frames",)
_32PX = {"height": 32, "width": 32}
#: three frames decoded in chunks of two; guidance ramps from 1 to 2.5 over the frames
_SVD_CALL = {
    "num_inference_steps": 2,
    "height": 16,
    "width": 16,
    "num_frames": 3,
    "decode_chunk_size": 2,
    "min_guidance_scale": 1.0,
    "max_guidance_scale": 2.5,
    "output_type": "pt",
}

FAMILIES: dict[str, Family] = {
    "wan22": Family(
        "video",
        WanPipeline,
        {
            "text_encoder": UMT5,
            "vae": WAN_VAE,
            "scheduler": partial(FlowMatchEulerDiscreteScheduler, shift=3.0),
            "transformer": model(WanTransformer3DModel, WAN_TRANSFORMER),
            "transformer_2": model(WanTransformer3DModel, WAN_TRANSFORMER),
            # The first step (t = 1000) runs on `transformer`, the following ones on `transformer_2`.
            "boundary_ratio": 0.875,
        },
        # t = 1000 on `transformer`, then two steps on `transformer_2`
        {**_CALL, "num_inference_steps": 3, "num_frames": 5, "guidance_scale": 4.0, "guidance_scale_2": 3.0},
    ),
    "ltx": Family(
        "video",
        LTXPipeline,
        {
            "scheduler": FlowMatchEulerDiscreteScheduler,
            "vae": model(
                AutoencoderKLLTXVideo,
                {
                    "latent_channels": 8,
                    "patch_size": 1,
                    "patch_size_t": 1,
                    "block_out_channels": (8, 8, 8, 8),
                    "decoder_block_out_channels": (8, 8, 8, 8),
                    "layers_per_block": (1, 1, 1, 1, 1),
                    "decoder_layers_per_block": (1, 1, 1, 1, 1),
                    "spatio_temporal_scaling": (True, True, False, False),
                    "decoder_spatio_temporal_scaling": (True, True, False, False),
                },
            ),
            "text_encoder": T5,
            "transformer": model(
                LTXVideoTransformer3DModel,
                {
                    "in_channels": 8,
                    "out_channels": 8,
                    "patch_size": 1,
                    "patch_size_t": 1,
                    "num_attention_heads": 2,
                    "attention_head_dim": 16,
                    "cross_attention_dim": 32,
                    "num_layers": 2,
                    "caption_channels": 32,  # T5 d_model
                },
            ),
        },
        # LTX wants multiples of 32
        {**_CALL, "height": 32, "width": 32, "num_frames": 9, "guidance_scale": 3.0},
    ),
    "hunyuanvideo": Family(
        "video",
        HunyuanVideoPipeline,
        {**_HUNYUANVIDEO_PARTS, "transformer": model(HunyuanVideoTransformer3DModel, _HUNYUANVIDEO_DIT)},
        {**IMAGE_CALL, **TEXT_LENGTH, "num_frames": 5, "guidance_scale": 6.0},
        inputs=_prompt_template,
    ),
    "cogvideox": Family(
        "video",
        CogVideoXPipeline,
        {
            "text_encoder": T5,
            "transformer": model(
                CogVideoXTransformer3DModel,
                {
                    "num_attention_heads": 4,
                    "attention_head_dim": 8,  # 3D sin-cos positions need heads x dim divisible by 16
                    "in_channels": 4,
                    "out_channels": 4,
                    "time_embed_dim": 2,
                    "text_embed_dim": 32,  # T5 d_model
                    "num_layers": 2,
                    "sample_width": 2,  # latent 2x2 -> 16x16 pixels
                    "sample_height": 2,
                    "sample_frames": 9,  # latent frames (9 - 1) / 4 + 1 = 3
                    "patch_size": 2,
                    "temporal_compression_ratio": 4,
                    "max_text_seq_length": MAX_SEQUENCE_LENGTH,
                },
            ),
            "vae": _video_vae(
                AutoencoderKLCogVideoX, "CogVideoX", {"norm_num_groups": 2, "temporal_compression_ratio": 4}
            ),
            "scheduler": cogvideox_scheduler(snr_shift_scale=3.0),
        },
        {**_CALL, "num_frames": 9, "guidance_scale": 6.0},
    ),
    "mochi": Family(
        "video",
        MochiPipeline,
        {
            "text_encoder": T5,
            "transformer": model(
                MochiTransformer3DModel,
                {
                    "patch_size": 2,
                    "num_attention_heads": 2,
                    "attention_head_dim": 8,
                    "num_layers": 2,
                    "pooled_projection_dim": 16,
                    "in_channels": 12,
                    "qk_norm": "rms_norm",
                    "text_embed_dim": 32,  # T5 d_model
                    "time_embed_dim": 4,
                    "activation_fn": "swiglu",
                    "max_sequence_length": MAX_SEQUENCE_LENGTH,
                },
            ),
            "vae": model(
                AutoencoderKLMochi,
                {
                    "latent_channels": 12,
                    "out_channels": 3,
                    "encoder_block_out_channels": (32, 32, 32, 32),  # its group norms have 32 groups
                    "decoder_block_out_channels": (32, 32, 32, 32),
                    "layers_per_block": (1, 1, 1, 1, 1),
                },
            ),
            "scheduler": FlowMatchEulerDiscreteScheduler,
        },
        {**_CALL, "num_frames": 7, "guidance_scale": 4.5},
    ),
    # Euler (v-prediction, Karras sigmas) as shipped
    "svd": Family(
        "video",
        StableVideoDiffusionPipeline,
        {
            "vae": model(
                AutoencoderKLTemporalDecoder,
                {
                    "in_channels": 3,
                    "out_channels": 3,
                    "down_block_types": ("DownEncoderBlock2D",) * 2,
                    "block_out_channels": (32, 64),  # its group norms have 32 groups
                    "layers_per_block": 1,
                    "latent_channels": 4,
                },
            ),
            "image_encoder": clip_vision_encoder(CLIPVisionModelWithProjection, 32, image_size=16, patch_size=2),
            "unet": model(
                UNetSpatioTemporalConditionModel,
                {
                    "sample_size": 8,
                    "in_channels": 8,  # noisy latents + the image's latents
                    "out_channels": 4,
                    **blocks("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
                    "block_out_channels": (32, 64),  # 32 groups in its norms
                    "layers_per_block": 1,
                    "cross_attention_dim": 32,  # CLIP projection
                    "num_attention_heads": (2, 4),
                    "addition_time_embed_dim": _SVD_TIME_EMBED_DIM,
                    # fps, motion bucket, noise augmentation
                    "projection_class_embeddings_input_dim": 3 * _SVD_TIME_EMBED_DIM,
                },
            ),
            "scheduler": sd_scheduler(
                EulerDiscreteScheduler,
                interpolation_type="linear",
                prediction_type="v_prediction",
                sigma_max=700.0,
                sigma_min=0.002,
                timestep_spacing="leading",
                timestep_type="continuous",
                use_karras_sigmas=True,
            ),
            # The pipeline only normalises with it (no resize, no crop), and resizes only PIL images (to 224
            # pixels): the tensor image of the call reaches the vision encoder at 16 pixels.
            "feature_extractor": partial(clip_image_processor, 16),
        },
        _SVD_CALL,
        _FRAMES,
        _image_tensor,
    ),
    # DDIM as AnimateDiff ships it
    "animatediff": Family(
        "video",
        AnimateDiffPipeline,
        {
            "vae": SD_VAE,
            "text_encoder": clip(CLIPTextModel),
            "unet": Model(_motion_unet),
            "motion_adapter": None,
            "scheduler": partial(
                DDIMScheduler,
                beta_start=0.00085,
                beta_end=0.012,
                beta_schedule="linear",
                clip_sample=False,
                steps_offset=1,
            ),
        },
        {**_VIDEO, "num_frames": 4, "guidance_scale": 7.5},
        _FRAMES,
    ),
    "text_to_video_sd": Family(
        "video",
        TextToVideoSDPipeline,
        {
            "vae": SD_VAE,
            "text_encoder": clip(CLIPTextModel, hidden_size=16),
            # the temporal convolutions' last layers start at zero (identity): trained ones do not
            "unet": model(UNet3DConditionModel, _video_unet("3D", (8, 16), cross_attention_dim=16), zeros_filled=True),
            "scheduler": partial(
                DDIMScheduler,
                beta_start=0.00085,
                beta_end=0.012,
                beta_schedule="scaled_linear",
                clip_sample=False,
                set_alpha_to_one=False,
            ),
        },
        {**_VIDEO, "num_frames": 4, "guidance_scale": 9.0},
        _FRAMES,
    ),
    # two frames, decoded one at a time; no T5 caption cleaning (it needs bs4 / ftfy)
    "latte": Family(
        "video",
        LattePipeline,
        {
            "text_encoder": T5,
            # video_length: the temporal position table, as many frames as the call's latents
            "transformer": model(LatteTransformer3DModel, PIXART_DIT, {"video_length": 2}),
            "vae": SD_VAE,
            "scheduler": partial(DDIMScheduler, beta_schedule="linear", clip_sample=False, timestep_spacing="linspace"),
        },
        {**_VIDEO, "video_length": 2, "guidance_scale": 5.0, "clean_caption": False, "decode_chunk_size": 1},
        _FRAMES,
    ),
    "allegro": Family(
        "video",
        AllegroPipeline,
        {
            "text_encoder": Text(t5_tokenizer, partial(t5_encoder, T5EncoderModel, T5Config, d_model=24)),
            "transformer": model(
                AllegroTransformer3DModel,
                {
                    "num_attention_heads": 2,
                    "attention_head_dim": 12,
                    "in_channels": 4,
                    "out_channels": 4,
                    "num_layers": 2,
                    "cross_attention_dim": 24,
                    "sample_width": 8,
                    "sample_height": 8,
                    "sample_frames": 8,
                    "caption_channels": 24,  # T5 d_model
                },
            ),
            "vae": Model(_allegro_vae),
            "scheduler": DDIMScheduler,
        },
        {**_VIDEO, **TEXT_LENGTH, "num_frames": 8, "guidance_scale": 6.0, "clean_caption": False},
        _FRAMES,
    ),
    # the first frame's VAE latents and a mask concatenated to the noise: 16 + 4 + 16 input channels
    "wan21_i2v": Family(
        "video",
        _wan_i2v_pipeline,
        {
            "text_encoder": UMT5,
            "vae": WAN_VAE,
            "scheduler": partial(FlowMatchEulerDiscreteScheduler, shift=5.0),
            "image_processor": partial(clip_image_processor, 32),
            "image_encoder": clip_vision_encoder(CLIPVisionModel, 16, image_size=32, patch_size=4),
            "transformer": model(
                WanTransformer3DModel,
                WAN_TRANSFORMER,
                {
                    "in_channels": 36,
                    "cross_attn_norm": True,
                    "qk_norm": "rms_norm_across_heads",
                    "image_dim": 16,  # CLIP hidden size
                    "added_kv_proj_dim": 32,  # = num_attention_heads * attention_head_dim
                },
            ),
        },
        {**_VIDEO, **TEXT_LENGTH, "num_frames": 5, "guidance_scale": 5.0},
        _FRAMES,
        _image_pil,
    ),
    # One section of three latent frames (nine frames) after the image's: 1 + 3 latent frames, 13 frames decoded.
    # Guidance-distilled: no negative prompt at true_cfg_scale 1.
    "framepack": Family(
        "video",
        HunyuanVideoFramepackPipeline,
        {
            **_HUNYUANVIDEO_PARTS,
            "transformer": model(
                HunyuanVideoFramepackTransformer3DModel,
                _HUNYUANVIDEO_DIT,
                {
                    "patch_size": 2,  # the history embedder's clean latents come in 2x2 patches
                    "has_image_proj": True,
                    "image_proj_dim": _SIGLIP["hidden_size"],
                    "has_clean_x_embedder": True,
                },
            ),
            "image_encoder": Model(_siglip_vision_encoder),
            "feature_extractor": partial(
                SiglipImageProcessor, size={"height": _SIGLIP["image_size"], "width": _SIGLIP["image_size"]}
            ),
        },
        {**IMAGE_CALL, **TEXT_LENGTH, **_32PX, "num_frames": 9, "latent_window_size": 3, "guidance_scale": 4.5},
        _FRAMES,
        _framepack_inputs,
    ),
}
