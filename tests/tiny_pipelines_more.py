"""More tiny, deterministic, *real* diffusers pipelines: twelve further families for the equivalence tests.

``tiny_pipelines`` covers the families memmode was written for (Wan 2.2, Flux, SD3, Qwen-Image, LTX).
Users put every other diffusers pipeline into a memory mode too, and each brings module shapes the engine
has to get right: UNets with skip connections and a ControlNet feeding them residuals, VAEs without
``quant_conv`` (Flux-style, as the real Chroma and Lumina 2 checkpoints ship them), causal 3D VAEs,
a DC-AE, an audio VAE, text encoders whose last layers are computed but never used (HunyuanVideo and
Lumina 2 read an inner hidden state), extra components such as StableAudio's ``projection_model``.

The conventions are ``tiny_pipelines``' own, and so are its helpers: each ``nn.Module`` is built under a
seed derived from ``(seed, component name)`` (``_component``), so two builds are bit-identical and the
global RNG is left alone; tokenizers are the classes the pipelines expect, built in code from a small
vocabulary (nothing is downloaded); dimensions follow the ``get_dummy_components()`` of diffusers' own
tests, with the text-encoder widths matched to our tokenizers.  Everything is float32, on CPU, in eval mode.
Its component helpers (VAEs, UNet and DiT configurations, language-model and CLIP vision encoders, filling
zero-initialised weights, schedulers, seeded random call inputs) serve the later builder modules too.

Families (pipeline class):

* UNet: ``sd15`` (StableDiffusionPipeline), ``sdxl`` (StableDiffusionXLPipeline), ``controlnet``
  (StableDiffusionControlNetPipeline);
* video DiT: ``hunyuanvideo`` (HunyuanVideoPipeline), ``cogvideox`` (CogVideoXPipeline), ``mochi``
  (MochiPipeline);
* image DiT: ``sana`` (SanaPipeline), ``pixart_sigma`` (PixArtSigmaPipeline), ``auraflow``
  (AuraFlowPipeline), ``lumina2`` (Lumina2Pipeline), ``chroma`` (ChromaPipeline);
* audio: ``stable_audio`` (StableAudioPipeline).  Its real scheduler, ``CosineDPMSolverMultistepScheduler``,
  needs ``torchsde``, which the suite does not install; it runs with the deterministic
  ``EDMDPMSolverMultistepScheduler`` (the class the pipeline's signature names) configured alike.

API: ``MORE_FAMILIES`` (name -> builder), ``make_more(family, seed)``, ``more_call_kwargs(family)`` and
``run_more(pipe, family, seed)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache, partial

import torch
from diffusers import (
    AuraFlowPipeline,
    AuraFlowTransformer2DModel,
    AutoencoderDC,
    AutoencoderKLCogVideoX,
    AutoencoderKLHunyuanVideo,
    AutoencoderKLMochi,
    AutoencoderOobleck,
    ChromaPipeline,
    ChromaTransformer2DModel,
    CogVideoXDDIMScheduler,
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
    ControlNetModel,
    DiffusionPipeline,
    DPMSolverMultistepScheduler,
    EDMDPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideoPipeline,
    HunyuanVideoTransformer3DModel,
    Lumina2Pipeline,
    Lumina2Transformer2DModel,
    MochiPipeline,
    MochiTransformer3DModel,
    PixArtSigmaPipeline,
    PixArtTransformer2DModel,
    PNDMScheduler,
    SanaPipeline,
    SanaTransformer2DModel,
    StableAudioDiTModel,
    StableAudioPipeline,
    StableAudioProjectionModel,
    StableDiffusionControlNetPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
    UniPCMultistepScheduler,
)
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE as HUNYUAN_TEMPLATE
from tiny_pipelines import (
    _CHARS,
    MAX_SEQUENCE_LENGTH,
    NEGATIVE_PROMPT,
    PROMPT,
    _clip_encoder,
    _clip_tokenizer,
    _component,
    _component_seed,
    _kl_vae,
    _t5_encoder,
    _t5_tokenizer,
)
from tokenizers import Tokenizer, models, trainers
from transformers import (
    CLIPImageProcessor,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPVisionConfig,
    Gemma2Config,
    Gemma2Model,
    GemmaTokenizer,
    LlamaConfig,
    LlamaModel,
    LlamaTokenizer,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

__all__ = ["MORE_FAMILIES", "make_more", "more_call_kwargs", "run_more"]

# Lumina 2 prepends this system prompt (the pipeline's default) to every prompt; HunyuanVideo wraps the
# prompt in its default Llama chat template.  The sentencepiece-style tokenizers below get whole-word
# tokens for both, so the encoders see prompts of about the real token count.
LUMINA2_SYSTEM_PROMPT = (
    "You are an assistant designed to generate superior images with the superior degree of image-text "
    "alignment based on textual prompts or user prompts. <Prompt Start> "
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
_GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]


# --------------------------------------------------------------------------- tokenizers


def _sentencepiece_bpe(tokenizer_cls, specials: list[str], text: str, **kwargs):
    """A byte-fallback BPE tokenizer of ``tokenizer_cls`` (the Gemma / Llama layout), trained on ``text``.

    The vocabulary is ``specials``, the 256 ``<0xNN>`` byte tokens, then what ``tokenizers``' BPE trainer
    learns from the words of ``text``, with and without the ``▁`` word-start marker (a word right after a
    special token or a newline carries none).  Encoding a trained word replays its training merges, so
    every word of ``text`` is one token, as with a real vocabulary; anything else falls back to
    characters or bytes.
    """
    for special in specials:
        text = text.replace(special, " ")
    words = sorted(set(text.split()))
    trainer = trainers.BpeTrainer(vocab_size=1 << 16, initial_alphabet=[*_CHARS, "\u2581"], show_progress=False)
    bpe = Tokenizer(models.BPE())
    bpe.train_from_iterator(["\u2581" + word for word in words] + words, trainer)
    model = json.loads(bpe.to_str())["model"]
    learned = sorted(model["vocab"], key=model["vocab"].get)
    tokens = dict.fromkeys([*specials, *(f"<0x{byte:02X}>" for byte in range(256)), *learned])
    vocab = {token: index for index, token in enumerate(tokens)}
    return tokenizer_cls(vocab=vocab, merges=[tuple(merge) for merge in model["merges"]], **kwargs)


def _gemma_tokenizer() -> GemmaTokenizer:
    """Gemma's layout (pad=0, eos=1, bos=2, unk=3), padding on the right as SANA and Lumina 2 set it."""
    text = "\n".join([PROMPT, NEGATIVE_PROMPT, LUMINA2_SYSTEM_PROMPT])
    return _sentencepiece_bpe(GemmaTokenizer, _GEMMA_SPECIALS, text, padding_side="right")


def _llama_tokenizer() -> LlamaTokenizer:
    """Llama 3 special tokens (the chat-template headers are single tokens), padding on the right:
    HunyuanVideo crops the template off the front of the encoder output."""
    text = "\n".join([PROMPT, NEGATIVE_PROMPT, HUNYUAN_TEMPLATE["template"]])
    return _sentencepiece_bpe(
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


# --------------------------------------------------------------------------- components


def _lm_encoder(
    model_cls,
    config_cls,
    tokenizer,
    *,
    hidden_size: int = 16,
    heads: int = 2,
    kv_heads: int = 1,
    layers: int = 2,
    max_positions: int = 512,
    **config,
):
    """A decoder-only language model of ``model_cls`` as a text encoder (Gemma, Llama, GLM, Qwen3): ``layers``
    layers, grouped-query attention (``heads`` query and ``kv_heads`` key/value heads, 8 wide), the tokenizer's
    vocabulary and special tokens; ``config``, what else ``config_cls`` is given."""
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=8,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **config,
    )
    return lambda: model_cls(config)


def _gemma2_encoder(tokenizer):
    """SANA's and Lumina 2's text encoder: a ``Gemma2Model`` (GQA, soft-capping, sliding window: the real
    encoder's architecture)."""
    return _lm_encoder(Gemma2Model, Gemma2Config, tokenizer, sliding_window=8)


def _clip_vision_encoder(model_cls, hidden_size: int, *, image_size: int, patch_size: int, heads: int = 2):
    """A two-layer CLIP vision encoder of ``model_cls`` (with projection: as wide as the hidden states)."""
    config = CLIPVisionConfig(
        hidden_size=hidden_size,
        projection_dim=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=heads,
        image_size=image_size,
        patch_size=patch_size,
    )
    return lambda: model_cls(config)


def _clip_image_processor(size: int) -> CLIPImageProcessor:
    """A CLIP image processor that resizes and crops to ``size`` pixels (the vision encoder's input)."""
    return CLIPImageProcessor(crop_size=size, size=size)


def _sd_vae():
    """The Stable Diffusion 1.x / SDXL VAE layout: four latent channels, ``quant_conv`` kept."""
    return _kl_vae(4, scaling_factor=0.18215)


def _flux_vae():
    """The Flux-family VAE: 16 latent channels, shift and scale, no ``quant_conv`` / ``post_quant_conv``,
    spatial scale factor 8 (Lumina 2 assumes it rather than reading the config)."""
    return _kl_vae(16, scaling_factor=0.3611, shift_factor=0.1159, quant_conv=False, levels=4)


#: The down path shared by the UNets and the ControlNet: one plain level and one cross-attention level
#: (as diffusers' dummy UNets); 4 latent channels, CLIP-width (32) cross-attention unless said otherwise.
_UNET_DOWN = dict(
    in_channels=4,
    block_out_channels=(8, 16),
    layers_per_block=1,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    norm_num_groups=4,
    attention_head_dim=2,
    cross_attention_dim=32,
)


def _unet(**overrides):
    """A two-level ``UNet2DConditionModel`` (the SD 1.5 layout; ``overrides`` make it SDXL's)."""
    config = dict(_UNET_DOWN, sample_size=8, out_channels=4, up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"))
    return lambda: UNet2DConditionModel(**{**config, **overrides})


#: The PixArt DiT (adaLN-single, cross-attention to T5, learned sigma) of PixArt-Alpha / Sigma, on which
#: Latte's spatial/temporal blocks are built.
_PIXART_DIT = dict(
    sample_size=8,
    num_layers=2,
    patch_size=2,
    attention_head_dim=8,
    num_attention_heads=3,
    caption_channels=32,  # T5 d_model
    in_channels=4,
    cross_attention_dim=24,
    out_channels=8,  # learned sigma: the pipeline keeps the first four channels
    attention_bias=True,
    activation_fn="gelu-approximate",
    num_embeds_ada_norm=1000,
    norm_type="ada_norm_single",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
)


def _oobleck_vae(latent_channels: int):
    """The Stable Audio Open VAE layout (``AutoencoderOobleck``: stereo waveform, hop length 2)."""
    return lambda: AutoencoderOobleck(
        encoder_hidden_size=6,
        downsampling_ratios=[1, 2],
        decoder_channels=3,
        decoder_input_channels=latent_channels,
        audio_channels=2,
        channel_multiples=[2, 4],
        sampling_rate=4,
    )


def _with_trained_zero_convs(
    factory: Callable[[], torch.nn.Module], *, below: float | None = None
) -> Callable[[], torch.nn.Module]:
    """``factory``, with the parameters it initialises to zero (with ``below``: to values all smaller than it
    in magnitude) filled with small random values.

    A fresh ControlNet's "zero convolutions" make its residuals exactly zero, so the control image and
    most of its weights would have no influence on the output; a trained ControlNet's do.
    """

    def untrained(parameter: torch.Tensor) -> bool:
        return not parameter.any() if below is None else bool(parameter.abs().max() < below)

    def build():
        module = factory()
        with torch.no_grad():
            for parameter in module.parameters():
                if untrained(parameter):
                    parameter.normal_(std=0.05)
        return module

    return build


def _sd_scheduler(cls, **extra):
    """The Stable Diffusion 1.x / SDXL training schedule, for the sampler class a checkpoint ships."""
    return cls(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1, **extra)


def _cogvideox_scheduler(snr_shift_scale: float) -> CogVideoXDDIMScheduler:
    """CogVideoX's DDIM (v-prediction, zero terminal SNR, trailing timesteps), as CogVideoX and CogView3-Plus
    ship it (with their own SNR shift)."""
    return CogVideoXDDIMScheduler(
        beta_schedule="scaled_linear",
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        set_alpha_to_one=True,
        timestep_spacing="trailing",
        snr_shift_scale=snr_shift_scale,
    )


#: What the SD-family pipelines are given for their safety checker: none.
_NO_SAFETY_CHECKER = dict(safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def _sd_components(build, **unet_overrides) -> dict:
    """Components shared by the SD 1.5 text-to-image, ControlNet and LCM pipelines (``unet_overrides``: see
    ``_unet``)."""
    tokenizer = _clip_tokenizer()
    return dict(
        vae=build("vae", _sd_vae()),
        text_encoder=build("text_encoder", _clip_encoder(CLIPTextModel, tokenizer)),
        tokenizer=tokenizer,
        unet=build("unet", _unet(**unet_overrides)),
        **_NO_SAFETY_CHECKER,
    )


# --------------------------------------------------------------------------- families: UNet


def make_sd15(seed: int = 0) -> StableDiffusionPipeline:
    """Stable Diffusion 1.5: CLIP text encoder, UNet, VAE with ``quant_conv``; PNDM as shipped."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    return StableDiffusionPipeline(
        **_sd_components(build),
        scheduler=_sd_scheduler(PNDMScheduler, skip_prk_steps=True, set_alpha_to_one=False),
    )


def make_sdxl(seed: int = 0) -> StableDiffusionXLPipeline:
    """SDXL: CLIP + CLIP-with-projection (hidden states concatenated to 64), micro-conditioned UNet."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer, tokenizer_2 = _clip_tokenizer(), _clip_tokenizer()
    addition_time_embed_dim = 8
    return StableDiffusionXLPipeline(
        vae=build("vae", _sd_vae()),
        text_encoder=build("text_encoder", _clip_encoder(CLIPTextModel, tokenizer)),
        text_encoder_2=build("text_encoder_2", _clip_encoder(CLIPTextModelWithProjection, tokenizer_2)),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=build(
            "unet",
            _unet(
                cross_attention_dim=64,  # the two CLIP hidden sizes, concatenated
                transformer_layers_per_block=(1, 2),
                use_linear_projection=True,
                addition_embed_type="text_time",
                addition_time_embed_dim=addition_time_embed_dim,
                # six micro-conditioning numbers, plus the pooled text_encoder_2 projection (32)
                projection_class_embeddings_input_dim=6 * addition_time_embed_dim + 32,
            ),
        ),
        scheduler=_sd_scheduler(EulerDiscreteScheduler, timestep_spacing="leading"),
        add_watermarker=False,
    )


def make_controlnet(seed: int = 0) -> StableDiffusionControlNetPipeline:
    """SD 1.5 with a ControlNet (conditioning image at full resolution, down-scaled to the latents)."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    controlnet = _with_trained_zero_convs(
        # conditioning embedding: one stride-2 step, the VAE's scale factor
        lambda: ControlNetModel(conditioning_embedding_out_channels=(8, 16), **_UNET_DOWN)
    )
    return StableDiffusionControlNetPipeline(
        **_sd_components(build),
        controlnet=build("controlnet", controlnet),
        scheduler=_sd_scheduler(UniPCMultistepScheduler),
    )


# --------------------------------------------------------------------------- families: video DiTs


def make_hunyuanvideo(seed: int = 0) -> HunyuanVideoPipeline:
    """HunyuanVideo: Llama (hidden state of the third-last layer) + CLIP (pooled), dual/single-stream DiT
    with a token refiner, causal 3D VAE (spatial x8, temporal x4)."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer, tokenizer_2 = _llama_tokenizer(), _clip_tokenizer()
    tokenizer_2.model_max_length = 77  # the pipeline pads the CLIP prompt to 77 tokens, whatever the tokenizer says
    return HunyuanVideoPipeline(
        # three layers: the pipeline reads hidden_states[-3], so the last two never count
        text_encoder=build(
            "text_encoder", _lm_encoder(LlamaModel, LlamaConfig, tokenizer, layers=3, max_positions=256)
        ),
        tokenizer=tokenizer,
        text_encoder_2=build("text_encoder_2", _clip_encoder(CLIPTextModel, tokenizer_2, hidden_size=8)),
        tokenizer_2=tokenizer_2,
        transformer=build(
            "transformer",
            lambda: HunyuanVideoTransformer3DModel(
                in_channels=4,
                out_channels=4,
                num_attention_heads=2,
                attention_head_dim=10,
                num_layers=2,
                num_single_layers=2,
                num_refiner_layers=2,
                patch_size=1,
                patch_size_t=1,
                guidance_embeds=True,
                text_embed_dim=16,  # Llama hidden size
                pooled_projection_dim=8,  # CLIP hidden size
                rope_axes_dim=(2, 4, 4),
            ),
        ),
        vae=build(
            "vae",
            lambda: AutoencoderKLHunyuanVideo(
                in_channels=3,
                out_channels=3,
                latent_channels=4,
                down_block_types=("HunyuanVideoDownBlock3D",) * 4,
                up_block_types=("HunyuanVideoUpBlock3D",) * 4,
                block_out_channels=(8, 8, 8, 8),
                layers_per_block=1,
                norm_num_groups=4,
                scaling_factor=0.476986,
                spatial_compression_ratio=8,
                temporal_compression_ratio=4,
                mid_block_add_attention=True,
            ),
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
    )


def make_cogvideox(seed: int = 0) -> CogVideoXPipeline:
    """CogVideoX (2B layout: sinusoidal 3D positions, no RoPE): T5, expert-adaLN DiT, causal 3D VAE."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _t5_tokenizer()
    return CogVideoXPipeline(
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _t5_encoder(T5EncoderModel, T5Config, tokenizer)),
        transformer=build(
            "transformer",
            lambda: CogVideoXTransformer3DModel(
                num_attention_heads=4,
                attention_head_dim=8,  # 3D sin-cos positions need heads x dim divisible by 16
                in_channels=4,
                out_channels=4,
                time_embed_dim=2,
                text_embed_dim=32,  # T5 d_model
                num_layers=2,
                sample_width=2,  # latent 2x2 -> 16x16 pixels
                sample_height=2,
                sample_frames=9,  # latent frames (9 - 1) / 4 + 1 = 3
                patch_size=2,
                temporal_compression_ratio=4,
                max_text_seq_length=MAX_SEQUENCE_LENGTH,
            ),
        ),
        vae=build(
            "vae",
            lambda: AutoencoderKLCogVideoX(
                in_channels=3,
                out_channels=3,
                down_block_types=("CogVideoXDownBlock3D",) * 4,
                up_block_types=("CogVideoXUpBlock3D",) * 4,
                block_out_channels=(8, 8, 8, 8),
                latent_channels=4,
                layers_per_block=1,
                norm_num_groups=2,
                temporal_compression_ratio=4,
            ),
        ),
        scheduler=_cogvideox_scheduler(snr_shift_scale=3.0),
    )


def make_mochi(seed: int = 0) -> MochiPipeline:
    """Mochi 1: T5, asymmetric DiT (text stream narrower than the visual one), causal 3D VAE (x8, x6)."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _t5_tokenizer()
    return MochiPipeline(
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _t5_encoder(T5EncoderModel, T5Config, tokenizer)),
        transformer=build(
            "transformer",
            lambda: MochiTransformer3DModel(
                patch_size=2,
                num_attention_heads=2,
                attention_head_dim=8,
                num_layers=2,
                pooled_projection_dim=16,
                in_channels=12,
                qk_norm="rms_norm",
                text_embed_dim=32,  # T5 d_model
                time_embed_dim=4,
                activation_fn="swiglu",
                max_sequence_length=MAX_SEQUENCE_LENGTH,
            ),
        ),
        vae=build(
            "vae",
            lambda: AutoencoderKLMochi(
                latent_channels=12,
                out_channels=3,
                encoder_block_out_channels=(32, 32, 32, 32),  # its group norms have 32 groups
                decoder_block_out_channels=(32, 32, 32, 32),
                layers_per_block=(1, 1, 1, 1, 1),
            ),
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


# --------------------------------------------------------------------------- families: image DiTs


def make_sana(seed: int = 0) -> SanaPipeline:
    """SANA: Gemma 2 text encoder, linear-attention DiT, deep-compression autoencoder (DC-AE);
    DPM-Solver++ on flow sigmas as shipped."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _gemma_tokenizer()
    return SanaPipeline(
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _gemma2_encoder(tokenizer)),
        transformer=build(
            "transformer",
            lambda: SanaTransformer2DModel(
                patch_size=1,
                in_channels=4,
                out_channels=4,
                num_layers=2,
                num_attention_heads=2,
                attention_head_dim=4,
                num_cross_attention_heads=2,
                cross_attention_head_dim=4,
                cross_attention_dim=8,
                caption_channels=16,  # Gemma hidden size
                sample_size=16,
            ),
        ),
        vae=build(
            "vae",
            lambda: AutoencoderDC(
                in_channels=3,
                latent_channels=4,
                attention_head_dim=2,
                encoder_block_types=("ResBlock", "EfficientViTBlock"),
                decoder_block_types=("ResBlock", "EfficientViTBlock"),
                encoder_block_out_channels=(8, 8),
                decoder_block_out_channels=(8, 8),
                encoder_qkv_multiscales=((), (5,)),
                decoder_qkv_multiscales=((), (5,)),
                encoder_layers_per_block=(1, 1),
                decoder_layers_per_block=(1, 1),
                downsample_block_type="conv",
                upsample_block_type="interpolate",
                decoder_norm_types="rms_norm",
                decoder_act_fns="silu",
                scaling_factor=0.41407,
            ),
        ),
        scheduler=DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction"),
    )


def make_pixart_sigma(seed: int = 0) -> PixArtSigmaPipeline:
    """PixArt-Sigma: T5, adaLN-single DiT with cross-attention, SDXL-style VAE; DPM-Solver++."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _t5_tokenizer()
    return PixArtSigmaPipeline(
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _t5_encoder(T5EncoderModel, T5Config, tokenizer)),
        transformer=build("transformer", lambda: PixArtTransformer2DModel(**_PIXART_DIT)),
        vae=build("vae", _sd_vae()),
        scheduler=DPMSolverMultistepScheduler(),
    )


def make_auraflow(seed: int = 0) -> AuraFlowPipeline:
    """AuraFlow: UMT5, MMDiT + single-stream DiT with a learned position table, SDXL-style VAE."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _t5_tokenizer()
    return AuraFlowPipeline(
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _t5_encoder(UMT5EncoderModel, UMT5Config, tokenizer)),
        transformer=build(
            "transformer",
            lambda: AuraFlowTransformer2DModel(
                sample_size=8,
                patch_size=2,
                in_channels=4,
                num_mmdit_layers=2,
                num_single_dit_layers=2,
                attention_head_dim=8,
                num_attention_heads=4,
                caption_projection_dim=32,
                joint_attention_dim=32,  # UMT5 d_model
                out_channels=4,
                pos_embed_max_size=64,
            ),
        ),
        vae=build("vae", _sd_vae()),
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


def make_lumina2(seed: int = 0) -> Lumina2Pipeline:
    """Lumina Image 2.0: Gemma 2 (second-last hidden state), unified next-DiT with caption and noise
    refiners, Flux-family VAE without ``quant_conv``."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _gemma_tokenizer()
    return Lumina2Pipeline(
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _gemma2_encoder(tokenizer)),
        transformer=build(
            "transformer",
            lambda: Lumina2Transformer2DModel(
                sample_size=8,
                patch_size=2,
                in_channels=16,
                hidden_size=16,
                num_layers=2,
                num_refiner_layers=2,
                num_attention_heads=2,
                num_kv_heads=1,
                multiple_of=16,
                norm_eps=1e-5,
                axes_dim_rope=(4, 2, 2),
                axes_lens=(64, 16, 16),
                cap_feat_dim=16,  # Gemma hidden size
            ),
        ),
        vae=build("vae", _flux_vae()),
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


def make_chroma(seed: int = 0) -> ChromaPipeline:
    """Chroma: T5 only, Flux-shaped transformer with a distilled modulation approximator, Flux VAE."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _t5_tokenizer()
    return ChromaPipeline(
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _t5_encoder(T5EncoderModel, T5Config, tokenizer)),
        transformer=build(
            "transformer",
            lambda: ChromaTransformer2DModel(
                patch_size=1,
                in_channels=64,  # 16 latent channels packed in 2x2 patches
                num_layers=2,
                num_single_layers=2,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=32,  # T5 d_model
                axes_dims_rope=(4, 4, 8),
                approximator_hidden_dim=32,
                approximator_layers=1,
                approximator_num_channels=16,
            ),
        ),
        vae=build("vae", _flux_vae()),
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


# --------------------------------------------------------------------------- families: audio


def make_stable_audio(seed: int = 0) -> StableAudioPipeline:
    """Stable Audio Open: T5, projection model (text + start/end seconds), DiT, Oobleck audio VAE."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _t5_tokenizer()
    return StableAudioPipeline(
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _t5_encoder(T5EncoderModel, T5Config, tokenizer)),
        projection_model=build(
            "projection_model",
            lambda: StableAudioProjectionModel(text_encoder_dim=32, conditioning_dim=4, min_value=0, max_value=32),
        ),
        transformer=build(
            "transformer",
            lambda: StableAudioDiTModel(
                sample_size=16,
                in_channels=3,
                num_layers=2,
                attention_head_dim=4,
                num_key_value_attention_heads=2,
                out_channels=3,
                cross_attention_dim=4,
                time_proj_dim=8,
                global_states_input_dim=8,
                cross_attention_input_dim=4,
            ),
        ),
        vae=build("vae", _oobleck_vae(latent_channels=3)),
        scheduler=EDMDPMSolverMultistepScheduler(
            sigma_min=0.3,
            sigma_max=500.0,
            sigma_data=1.0,
            sigma_schedule="exponential",
            prediction_type="v_prediction",
            solver_order=2,
        ),
    )


MORE_FAMILIES: dict[str, Callable[..., DiffusionPipeline]] = {
    "sd15": make_sd15,
    "sdxl": make_sdxl,
    "controlnet": make_controlnet,
    "hunyuanvideo": make_hunyuanvideo,
    "cogvideox": make_cogvideox,
    "mochi": make_mochi,
    "sana": make_sana,
    "pixart_sigma": make_pixart_sigma,
    "auraflow": make_auraflow,
    "lumina2": make_lumina2,
    "chroma": make_chroma,
    "stable_audio": make_stable_audio,
}

_IMAGE = dict(prompt=PROMPT, num_inference_steps=2, height=16, width=16, output_type="pt")
_T5 = dict(max_sequence_length=MAX_SEQUENCE_LENGTH)

_MORE_CALL_KWARGS: dict[str, dict] = {
    "sd15": dict(_IMAGE, negative_prompt=NEGATIVE_PROMPT, guidance_scale=7.5),
    "sdxl": dict(_IMAGE, negative_prompt=NEGATIVE_PROMPT, guidance_scale=5.0),
    "controlnet": dict(_IMAGE, negative_prompt=NEGATIVE_PROMPT, guidance_scale=7.5),
    "hunyuanvideo": dict(_IMAGE, **_T5, num_frames=5, guidance_scale=6.0),
    "cogvideox": dict(_IMAGE, **_T5, negative_prompt=NEGATIVE_PROMPT, num_frames=9, guidance_scale=6.0),
    "mochi": dict(_IMAGE, **_T5, negative_prompt=NEGATIVE_PROMPT, num_frames=7, guidance_scale=4.5),
    # SANA's default "complex human instruction" would prepend a long chat prompt: off, as in diffusers' tests.
    "sana": dict(
        _IMAGE,
        **_T5,
        height=32,
        width=32,
        negative_prompt=NEGATIVE_PROMPT,
        guidance_scale=4.5,
        use_resolution_binning=False,
        complex_human_instruction=None,
    ),
    "pixart_sigma": dict(
        _IMAGE,
        **_T5,
        negative_prompt=NEGATIVE_PROMPT,
        guidance_scale=4.5,
        use_resolution_binning=False,
        clean_caption=False,
    ),
    "auraflow": dict(_IMAGE, **_T5, negative_prompt=NEGATIVE_PROMPT, guidance_scale=3.5),
    # Room for the default system prompt that the pipeline puts in front of the prompt.
    "lumina2": dict(
        _IMAGE, height=32, width=32, negative_prompt=NEGATIVE_PROMPT, guidance_scale=4.0, max_sequence_length=48
    ),
    "chroma": dict(_IMAGE, **_T5, height=32, width=32, negative_prompt=NEGATIVE_PROMPT, guidance_scale=5.0),
    # 8 s: the longest the tiny DiT makes (16 latent samples x hop length 2 at 4 Hz), i.e. the whole window.
    "stable_audio": dict(
        prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, num_inference_steps=2, guidance_scale=7.0, audio_end_in_s=8.0
    ),
}


# --------------------------------------------------------------------------- API


@cache
def _hunyuan_prompt_template() -> dict:
    """The pipeline's default Llama chat template, with ``crop_start`` (the token count of the part before
    the prompt, 95 with the real tokenizer) counted with ours, so that exactly the prompt is kept."""
    prefix = HUNYUAN_TEMPLATE["template"].split("{}")[0]
    return {"template": HUNYUAN_TEMPLATE["template"], "crop_start": len(_llama_tokenizer()(prefix).input_ids)}


def make_more(family: str, seed: int = 0) -> DiffusionPipeline:
    """A fresh pipeline of ``family``; all components in eval mode, on CPU, in float32."""
    pipe = MORE_FAMILIES[family](seed=seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call_generator(seed: int, name: str) -> torch.Generator:
    """A generator for the call input ``name`` (a control image, image embeddings), derived from the call seed
    as a component's seed is from the build seed: each call seed gets other inputs."""
    return torch.Generator().manual_seed(_component_seed(seed, name))


def _random_image(seed: int, name: str, height: int, width: int | None = None) -> torch.Tensor:
    """A fixed random RGB image in [0, 1], ``(1, 3, height, width)`` (square by default), for the call input
    ``name``: see ``_call_generator``."""
    return torch.rand(1, 3, height, width or height, generator=_call_generator(seed, name))


def more_call_kwargs(family: str, seed: int = 0) -> dict:
    """Keyword arguments (a fresh dict, without ``generator``) for one small, fast call of ``family``.

    The ControlNet's conditioning image is a fixed random image, derived from ``seed`` like the call's
    generator, so each call seed conditions on a different image.
    """
    kwargs = dict(_MORE_CALL_KWARGS[family])
    if family == "hunyuanvideo":
        kwargs["prompt_template"] = dict(_hunyuan_prompt_template())
    if family == "controlnet":
        kwargs["image"] = _random_image(seed, "control_image", kwargs["height"], kwargs["width"])
    return kwargs


def run_more(pipe: DiffusionPipeline, family: str, seed: int = 0) -> torch.Tensor:
    """Call ``pipe`` once with a CPU generator seeded with ``seed``: the decoded images, frames or
    waveforms, as a float32 tensor on CPU."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    output = pipe(**more_call_kwargs(family, seed), generator=generator, return_dict=False)[0]
    return torch.as_tensor(output).detach().to(device="cpu", dtype=torch.float32)
