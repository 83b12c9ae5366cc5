"""Tiny image pipelines whose denoiser is a transformer (DiT), as ``Family`` tables (see ``tiny_components``).

Each brings module shapes the engine has to get right:

* ``flux`` (Flux.1-dev layout: CLIP pooled + T5, guidance-embedding transformer), ``sd3`` (two CLIP-with-projection
  encoders + T5, MMDiT), ``qwenimage`` (Qwen2.5-VL text encoder, MMDiT, Wan-style causal 3D VAE): three of the five
  families memmode was written for;
* ``sana`` (Gemma 2, linear-attention DiT, deep-compression autoencoder DC-AE), ``pixart_sigma`` and
  ``pixart_alpha`` (T5, adaLN-single DiT with cross-attention, learned sigma), ``auraflow`` (UMT5, MMDiT +
  single-stream DiT with a learned position table), ``lumina2`` (Gemma 2 read at its second-last hidden state, so
  its last layer computes for nothing; unified next-DiT with refiners), ``chroma`` (T5 only, Flux-shaped
  transformer with a distilled modulation approximator): VAEs without ``quant_conv`` (Flux-style, as the real
  Chroma and Lumina 2 checkpoints ship them);
* ``dit`` (class-conditional, no text encoder at all: a placement must not assume a ``text_encoder*``);
* ``hunyuandit``: two text encoders of different kinds (BERT + T5), long skip connections between transformer
  blocks (a block's output feeds a block further down), a top-level parameter read in the model's own ``forward``
  (``text_embedding_padding``), ``_supports_group_offloading = False``;
* ``hunyuandit_controlnet``: the same with a ``HunyuanDiT2DControlNetModel``, which declares group offloading
  supported, so the placements that split a model split it; its time embedding's ``HunyuanDiTAttentionPool`` (the
  transformer has one too) hands its child layers' weights (``q_proj.weight``, ``k_proj.weight``, ...,
  ``torch.cat`` of their biases) to ``F.multi_head_attention_forward`` without calling those layers: a parent
  reading its children's parameters outside their ``forward``. The control image is VAE-encoded with a latent
  sample the pipeline draws from the global RNG, which the call's inputs seed;
* ``lumina_next``: Gemma read at an inner layer, a top-level parameter left uninitialized (``pad_token``, seeded
  here) and zero-initialised gates and output (filled);
* ``cogview3plus`` (T5, size/crop conditioning, CogVideoX's DDIM) and ``cogview4`` (GLM read at its second-last
  hidden state, prompt left-padded to a multiple of 16, a cache context the pipeline opens on the transformer).

Some pipelines hard-code sizes the real checkpoints have, and the tiny models follow them: HunyuanDiT pads the BERT
prompt to 77 tokens and the T5 prompt to 256 (its transformer's ``text_len`` / ``text_len_t5``), and computes its
rotary grid with a VAE factor of 8; Lumina-Next assumes a VAE factor of 8. Those families get a four-level VAE
(factor 8) and 32 px images.
"""

from __future__ import annotations

from functools import partial

import torch
from diffusers import (
    AuraFlowPipeline,
    AuraFlowTransformer2DModel,
    AutoencoderDC,
    AutoencoderKLQwenImage,
    ChromaPipeline,
    ChromaTransformer2DModel,
    CogView3PlusPipeline,
    CogView3PlusTransformer2DModel,
    CogView4Pipeline,
    CogView4Transformer2DModel,
    DDIMScheduler,
    DDPMScheduler,
    DiTPipeline,
    DiTTransformer2DModel,
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    HunyuanDiT2DControlNetModel,
    HunyuanDiT2DModel,
    HunyuanDiTControlNetPipeline,
    HunyuanDiTPipeline,
    Lumina2Pipeline,
    Lumina2Transformer2DModel,
    LuminaNextDiT2DModel,
    LuminaPipeline,
    PixArtAlphaPipeline,
    PixArtSigmaPipeline,
    PixArtTransformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SanaPipeline,
    SanaTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import (
    CLIPTextModel,
    CLIPTextModelWithProjection,
    GemmaConfig,
    GemmaModel,
    GlmConfig,
    GlmModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    T5Config,
    T5EncoderModel,
)

from tiny_components import (
    BERT_MAX_LENGTH,
    FLUX_BLOCKS,
    FLUX_VAE,
    GEMMA2,
    IMAGE_CALL,
    IMAGE_VAE,
    NEGATIVE,
    NO_SAFETY_CHECKER,
    PIXART_DIT,
    SD_VAE,
    T5,
    TEXT_LENGTH,
    UMT5,
    Family,
    Text,
    bert_encoder,
    bert_tokenizer,
    clip,
    cogvideox_scheduler,
    component_seed,
    factor8_vae,
    gemma_tokenizer,
    glm_tokenizer,
    kl_vae,
    lm_encoder,
    model,
    qwen_tokenizer,
    random_image,
    t5_encoder,
    t5_tokenizer,
)

#: DiT-XL/2's layout: a class-conditional adaLN-zero DiT (learned sigma).
DIT_TRANSFORMER = {
    "sample_size": 8,  # latent size: 16 px with the factor-2 VAE
    "num_layers": 2,
    "patch_size": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "in_channels": 4,
    "out_channels": 8,  # learned sigma: the pipeline keeps the first four channels
    "num_embeds_ada_norm": 1000,  # ImageNet classes; id 1000 is the unconditional one
}
#: A few ImageNet labels for DiT's ``id2label`` (the pipeline maps names to class ids with it).
DIT_ID2LABEL = {0: "tench, Tinca tinca", 1: "goldfish, Carassius auratus", 2: "great white shark, white shark"}


def _qwen_vl_encoder(tokenizer):
    """Qwen-Image's text encoder: a two-layer Qwen2.5-VL for ``tokenizer``'s vocabulary, its vision placeholder ids
    beyond the vocabulary (the tokenizer never produces them)."""
    vocab_size = len(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 2, 4]},
            "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 32},
        vision_start_token_id=vocab_size,
        vision_end_token_id=vocab_size + 1,
        image_token_id=vocab_size + 2,
        video_token_id=vocab_size + 3,
    )
    return lambda: Qwen2_5_VLForConditionalGeneration(config)


def _both_sides(config: dict) -> dict:
    """``config`` for an autoencoder's encoder and decoder alike (as ``encoder_<key>`` and ``decoder_<key>``)."""
    return {f"{side}_{key}": value for side in ("encoder", "decoder") for key, value in config.items()}


#: What the calls of the first three families share: their text encoders' length too.
_CALL = {**IMAGE_CALL, **TEXT_LENGTH}
#: The calls of the T5-conditioned image DiTs.
_T5_CALL = {**IMAGE_CALL, **TEXT_LENGTH, **NEGATIVE}
_32PX = {"height": 32, "width": 32}
#: The latent channels of Qwen-Image's VAE.
_Z = 4

#: HunyuanDiT's DiT, its transformer's and its ControlNet's alike but for the depth. The pipelines pad BERT to 77
#: tokens and T5 to 256; the time embedding pools the T5 states with a ``HunyuanDiTAttentionPool``.
_HUNYUANDIT_DIT = {
    "sample_size": 4,
    "patch_size": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 3,
    "in_channels": 4,
    "hidden_size": 24,
    "cross_attention_dim": 32,  # BERT hidden size
    "cross_attention_dim_t5": 32,  # T5 d_model
    "pooled_projection_dim": 16,
    "text_len": BERT_MAX_LENGTH,
    "text_len_t5": 256,
}
#: What the HunyuanDiT pipelines hold besides their denoisers: factor-8 VAE, BERT + T5, DDPM as shipped.
_HUNYUANDIT_PARTS = {
    "vae": factor8_vae(),
    "text_encoder": Text(bert_tokenizer, bert_encoder),
    "text_encoder_2": T5,
    "scheduler": partial(
        DDPMScheduler,
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.03,
        clip_sample=False,
        steps_offset=1,
        prediction_type="v_prediction",
    ),
    **NO_SAFETY_CHECKER,
}
_HUNYUANDIT_CALL = {**IMAGE_CALL, **NEGATIVE, **_32PX, "guidance_scale": 5.0, "use_resolution_binning": False}


def _hunyuandit_control(seed: int, call: dict) -> dict:
    """The ControlNet's conditioning image: a fixed random image in [-1, 1] (the VAE's range; a tensor reaches the
    VAE as it is), derived from the call seed.

    The pipeline samples the image's VAE latents with the *global* RNG (``latent_dist.sample()``, not with the
    call's generator), so that RNG is seeded from the call seed here, right before the call: else no two calls
    would give the same output.
    """
    torch.manual_seed(component_seed(seed, "control_latents"))
    return {"control_image": random_image(seed, "control_image", call["height"], call["width"]) * 2 - 1}


FAMILIES: dict[str, Family] = {
    "flux": Family(
        "dit",
        FluxPipeline,
        {
            "scheduler": FlowMatchEulerDiscreteScheduler,
            "vae": IMAGE_VAE,
            "text_encoder": clip(CLIPTextModel),
            "text_encoder_2": T5,
            # 4 latent channels packed in 2x2 patches; CLIP hidden size as the pooled projection
            "transformer": model(
                FluxTransformer2DModel,
                FLUX_BLOCKS,
                {"in_channels": 16, "pooled_projection_dim": 32, "guidance_embeds": True},
            ),
        },
        {**_CALL, "guidance_scale": 3.5},
    ),
    "sd3": Family(
        "dit",
        StableDiffusion3Pipeline,
        {
            "scheduler": partial(FlowMatchEulerDiscreteScheduler, shift=3.0),
            "vae": IMAGE_VAE,
            "text_encoder": clip(CLIPTextModelWithProjection),
            "text_encoder_2": clip(CLIPTextModelWithProjection),
            # The pipeline pads the concatenated CLIP states (2 x 32) to the T5 width: make it 64.
            "text_encoder_3": Text(t5_tokenizer, partial(t5_encoder, T5EncoderModel, T5Config, d_model=64)),
            "transformer": model(
                SD3Transformer2DModel,
                {
                    "sample_size": 8,
                    "patch_size": 2,
                    "in_channels": 4,
                    "out_channels": 4,
                    "num_layers": 2,
                    "attention_head_dim": 8,
                    "num_attention_heads": 4,
                    "joint_attention_dim": 64,  # T5 d_model
                    "caption_projection_dim": 32,  # = num_attention_heads * attention_head_dim
                    "pooled_projection_dim": 64,  # two CLIP projections of 32
                    "pos_embed_max_size": 16,
                },
            ),
        },
        {**_CALL, **NEGATIVE, "guidance_scale": 5.0},
    ),
    "qwenimage": Family(
        "dit",
        QwenImagePipeline,
        {
            "scheduler": FlowMatchEulerDiscreteScheduler,
            "vae": model(
                AutoencoderKLQwenImage,
                {
                    "base_dim": 4,
                    "z_dim": _Z,
                    "dim_mult": [1, 2, 2],
                    "num_res_blocks": 1,
                    "temperal_downsample": [False, True],
                    "latents_mean": [0.1] * _Z,
                    "latents_std": [1.5] * _Z,
                },
            ),
            "text_encoder": Text(qwen_tokenizer, _qwen_vl_encoder),
            "transformer": model(
                QwenImageTransformer2DModel,
                {
                    "patch_size": 2,
                    "in_channels": 4 * _Z,  # latents packed in 2x2 patches
                    "out_channels": _Z,
                    "num_layers": 2,
                    "attention_head_dim": 16,
                    "num_attention_heads": 2,
                    "joint_attention_dim": 32,  # text encoder hidden size
                    "axes_dims_rope": (8, 4, 4),
                },
            ),
        },
        {**_CALL, **NEGATIVE, "true_cfg_scale": 4.0},
    ),
    # DPM-Solver++ on flow sigmas as shipped. SANA's default "complex human instruction" would prepend a long chat
    # prompt: off, as in diffusers' tests.
    "sana": Family(
        "dit",
        SanaPipeline,
        {
            "text_encoder": GEMMA2,
            "transformer": model(
                SanaTransformer2DModel,
                {
                    "patch_size": 1,
                    "in_channels": 4,
                    "out_channels": 4,
                    "num_layers": 2,
                    "num_attention_heads": 2,
                    "attention_head_dim": 4,
                    "num_cross_attention_heads": 2,
                    "cross_attention_head_dim": 4,
                    "cross_attention_dim": 8,
                    "caption_channels": 16,  # Gemma hidden size
                    "sample_size": 16,
                },
            ),
            "vae": model(
                AutoencoderDC,
                {
                    "in_channels": 3,
                    "latent_channels": 4,
                    "attention_head_dim": 2,
                    "downsample_block_type": "conv",
                    "upsample_block_type": "interpolate",
                    "decoder_norm_types": "rms_norm",
                    "decoder_act_fns": "silu",
                    "scaling_factor": 0.41407,
                },
                _both_sides(
                    {
                        "block_types": ("ResBlock", "EfficientViTBlock"),
                        "block_out_channels": (8, 8),
                        "qkv_multiscales": ((), (5,)),
                        "layers_per_block": (1, 1),
                    }
                ),
            ),
            "scheduler": partial(
                DPMSolverMultistepScheduler, use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction"
            ),
        },
        {
            **_T5_CALL,
            **_32PX,
            "guidance_scale": 4.5,
            "use_resolution_binning": False,
            "complex_human_instruction": None,
        },
    ),
    # PixArt-Sigma: SDXL-style VAE; DPM-Solver++.
    "pixart_sigma": Family(
        "dit",
        PixArtSigmaPipeline,
        {
            "text_encoder": T5,
            "transformer": model(PixArtTransformer2DModel, PIXART_DIT),
            "vae": SD_VAE,
            "scheduler": DPMSolverMultistepScheduler,
        },
        {**_T5_CALL, "guidance_scale": 4.5, "use_resolution_binning": False, "clean_caption": False},
    ),
    "auraflow": Family(
        "dit",
        AuraFlowPipeline,
        {
            "text_encoder": UMT5,
            "transformer": model(
                AuraFlowTransformer2DModel,
                {
                    "sample_size": 8,
                    "patch_size": 2,
                    "in_channels": 4,
                    "num_mmdit_layers": 2,
                    "num_single_dit_layers": 2,
                    "attention_head_dim": 8,
                    "num_attention_heads": 4,
                    "caption_projection_dim": 32,
                    "joint_attention_dim": 32,  # UMT5 d_model
                    "out_channels": 4,
                    "pos_embed_max_size": 64,
                },
            ),
            "vae": SD_VAE,
            "scheduler": FlowMatchEulerDiscreteScheduler,
        },
        {**_T5_CALL, "guidance_scale": 3.5},
    ),
    # Room in the text length for the default system prompt that the pipeline puts in front of the prompt.
    "lumina2": Family(
        "dit",
        Lumina2Pipeline,
        {
            "text_encoder": GEMMA2,
            "transformer": model(
                Lumina2Transformer2DModel,
                {
                    "sample_size": 8,
                    "patch_size": 2,
                    "in_channels": 16,
                    "hidden_size": 16,
                    "num_layers": 2,
                    "num_refiner_layers": 2,
                    "num_attention_heads": 2,
                    "num_kv_heads": 1,
                    "multiple_of": 16,
                    "norm_eps": 1e-5,
                    "axes_dim_rope": (4, 2, 2),
                    "axes_lens": (64, 16, 16),
                    "cap_feat_dim": 16,  # Gemma hidden size
                },
            ),
            "vae": FLUX_VAE,
            "scheduler": FlowMatchEulerDiscreteScheduler,
        },
        {**IMAGE_CALL, **NEGATIVE, **_32PX, "guidance_scale": 4.0, "max_sequence_length": 48},
    ),
    "chroma": Family(
        "dit",
        ChromaPipeline,
        {
            "text_encoder": T5,
            # 16 latent channels packed in 2x2 patches
            "transformer": model(
                ChromaTransformer2DModel,
                FLUX_BLOCKS,
                {
                    "in_channels": 64,
                    "approximator_hidden_dim": 32,
                    "approximator_layers": 1,
                    "approximator_num_channels": 16,
                },
            ),
            "vae": FLUX_VAE,
            "scheduler": FlowMatchEulerDiscreteScheduler,
        },
        {**_T5_CALL, **_32PX, "guidance_scale": 5.0},
    ),
    # SD VAE, DDIM
    "dit": Family(
        "dit",
        DiTPipeline,
        {
            "transformer": model(DiTTransformer2DModel, DIT_TRANSFORMER),
            "vae": SD_VAE,
            "scheduler": partial(
                DDIMScheduler, beta_schedule="linear", beta_start=0.0001, beta_end=0.02, clip_sample=False
            ),
            "id2label": DIT_ID2LABEL,
        },
        {"class_labels": [1], "num_inference_steps": 2, "guidance_scale": 4.0, "output_type": "pt"},
    ),
    # HunyuanDiT: BERT (77 tokens) + T5 (256 tokens), factor-8 VAE; DDPM as shipped.
    "hunyuandit": Family(
        "dit",
        HunyuanDiTPipeline,
        {
            **_HUNYUANDIT_PARTS,
            # block 0's output skips to block 3: the smallest depth with a long skip
            "transformer": model(HunyuanDiT2DModel, _HUNYUANDIT_DIT, {"num_layers": 4}),
        },
        _HUNYUANDIT_CALL,
    ),
    # HunyuanDiT with a ControlNet (the layout of Tencent's v1.1 ControlNets): a copy of the first half of the
    # transformer run on the control image's VAE latents, one residual per long skip. Six transformer blocks: two
    # long skips, so the ControlNet has two blocks.
    "hunyuandit_controlnet": Family(
        "dit",
        HunyuanDiTControlNetPipeline,
        {
            **_HUNYUANDIT_PARTS,
            "transformer": model(HunyuanDiT2DModel, _HUNYUANDIT_DIT, {"num_layers": 6}),
            "controlnet": model(
                HunyuanDiT2DControlNetModel, _HUNYUANDIT_DIT, {"transformer_num_layers": 6}, zeros_filled=True
            ),
        },
        _HUNYUANDIT_CALL,
        inputs=_hunyuandit_control,
    ),
    # Lumina-Next: Gemma 1 (2B's layout), factor-8 SDXL-style VAE.
    "lumina_next": Family(
        "dit",
        LuminaPipeline,
        {
            "transformer": model(
                LuminaNextDiT2DModel,
                {
                    "sample_size": 4,  # latent size: the pipeline's default 32 px image
                    "patch_size": 2,
                    "in_channels": 4,
                    "hidden_size": 16,
                    "num_layers": 2,
                    "num_attention_heads": 2,
                    "num_kv_heads": 1,
                    "multiple_of": 16,
                    "norm_eps": 1e-5,
                    "learn_sigma": True,
                    "qk_norm": True,
                    "cross_attention_dim": 16,  # Gemma hidden size
                    "scaling_factor": 1.0,
                },
                zeros_filled=True,
            ),
            "scheduler": FlowMatchEulerDiscreteScheduler,
            "vae": factor8_vae(),
            "text_encoder": Text(gemma_tokenizer, partial(lm_encoder, GemmaModel, GemmaConfig)),
        },
        {**IMAGE_CALL, **NEGATIVE, **_32PX, "guidance_scale": 4.0, "clean_caption": False},
    ),
    # PixArt-Alpha: SD VAE; DPM-Solver++.
    "pixart_alpha": Family(
        "dit",
        PixArtAlphaPipeline,
        {
            "text_encoder": T5,
            "transformer": model(PixArtTransformer2DModel, PIXART_DIT),
            "vae": SD_VAE,
            "scheduler": DPMSolverMultistepScheduler,
        },
        {**_T5_CALL, "guidance_scale": 4.5, "use_resolution_binning": False, "clean_caption": False},
    ),
    "cogview3plus": Family(
        "dit",
        CogView3PlusPipeline,
        {
            "text_encoder": T5,
            "transformer": model(
                CogView3PlusTransformer2DModel,
                {
                    "patch_size": 2,
                    "in_channels": 4,
                    "num_layers": 2,
                    "attention_head_dim": 4,
                    "num_attention_heads": 2,
                    "out_channels": 4,
                    "text_embed_dim": 32,  # T5 d_model
                    "time_embed_dim": 8,
                    "condition_dim": 2,
                    "pos_embed_max_size": 8,
                    "sample_size": 8,
                },
            ),
            "vae": kl_vae(4, scaling_factor=1.0),
            "scheduler": cogvideox_scheduler(snr_shift_scale=4.0),
        },
        {**_T5_CALL, "guidance_scale": 7.0},
    ),
    # CogView4: RoPE DiT with size/crop conditioning; flow matching with a linear dynamic shift.
    "cogview4": Family(
        "dit",
        CogView4Pipeline,
        {
            "text_encoder": Text(
                glm_tokenizer, partial(lm_encoder, GlmModel, GlmConfig, hidden_size=32, heads=4, kv_heads=2)
            ),
            "transformer": model(
                CogView4Transformer2DModel,
                {
                    "patch_size": 2,
                    "in_channels": 4,
                    "num_layers": 2,
                    "attention_head_dim": 4,
                    "num_attention_heads": 4,
                    "out_channels": 4,
                    "text_embed_dim": 32,  # GLM hidden size
                    "time_embed_dim": 8,
                    "condition_dim": 4,
                },
            ),
            "vae": kl_vae(4, scaling_factor=1.0),
            "scheduler": partial(
                FlowMatchEulerDiscreteScheduler,
                base_shift=0.25,
                max_shift=0.75,
                base_image_seq_len=256,
                use_dynamic_shifting=True,
                time_shift_type="linear",
            ),
        },
        {**_T5_CALL, "guidance_scale": 5.0},
    ),
}
