"""Tiny, deterministic, *real* diffusers pipelines: class-conditional and older DiTs, UNets and pixel-space models.

``tiny_pipelines`` and ``tiny_pipelines_more`` cover the current text-to-image and text-to-video families.
Users put the older and the odd ones into memory modes too, and each brings something of its own the
engine has to get right:

* a pipeline without any text encoder (DiT: class labels; DDPM and consistency models: unconditional or
  class-conditional pixel-space UNets), so a placement must not assume a ``text_encoder*`` component;
* components named otherwise than ``text_encoder`` / ``vae`` (LDM's ``bert`` and ``vqvae``);
* long skip connections between transformer blocks (HunyuanDiT: a block's output feeds a block further
  down), a top-level parameter read in the model's own ``forward`` (HunyuanDiT's ``text_embedding_padding``,
  Lumina-Next's ``pad_token``), a model that declares ``_supports_group_offloading = False`` (HunyuanDiT);
* text encoders read at an inner layer (Lumina-Next and CogView4 use the second-last hidden state, so
  their last layer and final norm compute for nothing), two text encoders of different kinds (HunyuanDiT:
  BERT + T5), a cache context the pipeline opens on the transformer (CogView4's ``cache_context``);
* pixel-space generation (DeepFloyd IF: T5 + UNet with learned variance, no VAE at all), a guidance-
  distilled UNet (LCM: the guidance scale enters through ``time_cond_proj_dim``), and an upscaler whose
  UNet takes the noised low-resolution image and its noise level (as class labels) besides the latents,
  and whose pipeline reads its VAE's ``post_quant_conv`` parameters for their dtype before decoding.

The conventions and helpers are ``tiny_pipelines``' own: each ``nn.Module`` is built under a seed derived
from ``(seed, component name)`` (``_component``), so two builds are bit-identical and the global RNG is
left alone; parameters a model leaves uninitialized (``torch.empty``) get seeded values; tokenizers are the
classes the pipelines expect, built in code from a small vocabulary (BERT's WordPiece, a GLM-4-style
byte-level BPE for CogView4, T5, CLIP and Gemma as in the other modules); dimensions follow the
``get_dummy_components()`` of diffusers' own tests, with the text-encoder widths matched to our
tokenizers.  Everything is float32, on CPU, in eval mode.

Families (pipeline class; ``KINDS`` says which):

* image DiTs: ``dit`` (DiTPipeline: class-conditional, no text encoder), ``hunyuandit``
  (HunyuanDiTPipeline), ``lumina_next`` (LuminaPipeline, Lumina-Next-SFT's layout), ``pixart_alpha``
  (PixArtAlphaPipeline), ``cogview3plus`` (CogView3PlusPipeline), ``cogview4`` (CogView4Pipeline);
* latent UNets: ``ldm_text2img`` (LDMTextToImagePipeline), ``lcm`` (LatentConsistencyModelPipeline),
  ``sd_upscale`` (StableDiffusionUpscalePipeline, the x4 upscaler: its low-resolution image is a fixed
  random image derived from the call seed);
* pixel space: ``deepfloyd_if`` (IFPipeline, stage I), ``ddpm`` (DDPMPipeline), ``consistency_models``
  (ConsistencyModelPipeline, class-conditional).

Some pipelines hard-code sizes the real checkpoints have, and the tiny models follow them: HunyuanDiT pads
the BERT prompt to 77 tokens and the T5 prompt to 256 (its transformer's ``text_len`` / ``text_len_t5``),
and computes its rotary grid with a VAE factor of 8; Lumina-Next assumes a VAE factor of 8; LDM makes its
latents ``height // 8`` and pads to 77 tokens.  Those families get a four-level VAE (factor 8) and 32 px
images.

A freshly initialised model whose output projection is zero would not depend on the rest of its weights;
where diffusers initialises such layers to zero, the builders fill every all-zero parameter with small
random values (``_with_trained_zero_convs``), as training would.

API: ``FAMILIES`` (name -> builder), ``KINDS`` (name -> kind), ``make(family, seed)``,
``call_kwargs(family, seed)`` and ``run(pipe, family, seed)``.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from functools import partial

import torch
from diffusers import (
    CMStochasticIterativeScheduler,
    CogView3PlusPipeline,
    CogView3PlusTransformer2DModel,
    CogView4Pipeline,
    CogView4Transformer2DModel,
    ConsistencyModelPipeline,
    DDIMScheduler,
    DDPMPipeline,
    DDPMScheduler,
    DiffusionPipeline,
    DiTPipeline,
    DiTTransformer2DModel,
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    HunyuanDiT2DModel,
    HunyuanDiTPipeline,
    IFPipeline,
    LatentConsistencyModelPipeline,
    LCMScheduler,
    LDMTextToImagePipeline,
    LuminaNextDiT2DModel,
    LuminaPipeline,
    PixArtAlphaPipeline,
    PixArtTransformer2DModel,
    StableDiffusionUpscalePipeline,
    UNet2DConditionModel,
    UNet2DModel,
)
from diffusers.pipelines.latent_diffusion.pipeline_latent_diffusion import LDMBertConfig, LDMBertModel
from tiny_pipelines import (
    NEGATIVE_PROMPT,
    PROMPT,
    _clip_encoder,
    _clip_tokenizer,
    _component,
    _kl_vae,
    _t5_encoder,
    _t5_tokenizer,
)
from tiny_pipelines_more import (
    _IMAGE,
    _NO_SAFETY_CHECKER,
    _PIXART_DIT,
    _T5,
    _cogvideox_scheduler,
    _gemma_tokenizer,
    _lm_encoder,
    _random_image,
    _sd_components,
    _sd_scheduler,
    _sd_vae,
    _unet,
    _with_trained_zero_convs,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertModel,
    BertTokenizer,
    CLIPTextModel,
    GemmaConfig,
    GemmaModel,
    GlmConfig,
    GlmModel,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
)

__all__ = ["FAMILIES", "KINDS", "call_kwargs", "make", "run"]

#: BERT's and LDM-BERT's padded prompt length (both pipelines hard-code 77).
BERT_MAX_LENGTH = 77

#: A few ImageNet labels for DiT's ``id2label`` (the pipeline maps names to class ids with it).
DIT_ID2LABEL = {0: "tench, Tinca tinca", 1: "goldfish, Carassius auratus", 2: "great white shark, white shark"}


# --------------------------------------------------------------------------- tokenizers


def _bert_tokenizer() -> BertTokenizer:
    """Lower-cased WordPiece: the prompts' whole words, single characters and ``##`` continuations as
    fallback; ``[PAD]`` = 0 as in BERT's vocabularies."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted(set(re.findall(r"\w+|[^\w\s]", f"{PROMPT} {NEGATIVE_PROMPT}".lower())))
    chars = sorted(set(string.ascii_lowercase + string.digits + string.punctuation))
    pieces = [*specials, *words, *chars, *("##" + char for char in string.ascii_lowercase + string.digits)]
    vocab = {piece: index for index, piece in enumerate(dict.fromkeys(pieces))}
    return BertTokenizer(vocab=vocab, model_max_length=BERT_MAX_LENGTH)


def _glm_tokenizer() -> PreTrainedTokenizerFast:
    """GLM-4's layout: byte-level BPE (trained here on the prompts, so each of their words is one token), the
    ``[gMASK]<sop>`` prefix on every encoding, ``<|endoftext|>`` as pad, padding on the left."""
    specials = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1 << 16,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([PROMPT, NEGATIVE_PROMPT], trainer)
    bpe.post_processor = processors.TemplateProcessing(
        single="[gMASK] <sop> $A",
        pair="[gMASK] <sop> $A $B",
        special_tokens=[(token, bpe.token_to_id(token)) for token in ("[gMASK]", "<sop>")],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        padding_side="left",
        additional_special_tokens=specials[1:],
    )


# --------------------------------------------------------------------------- components


def _bert_encoder(tokenizer, hidden_size: int = 32):
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=BERT_MAX_LENGTH,
        pad_token_id=tokenizer.pad_token_id,
    )
    return lambda: BertModel(config)


def _t5(build, d_model: int = 32):
    """A T5 tokenizer and a two-layer encoder of width ``d_model``."""
    tokenizer = _t5_tokenizer()
    return tokenizer, build("text_encoder", _t5_encoder(T5EncoderModel, T5Config, tokenizer, d_model=d_model))


def _factor8_vae(latent_channels: int = 4, scaling_factor: float = 0.13025):
    """A four-level ``AutoencoderKL`` (spatial factor 8), for the pipelines that assume one."""
    return _kl_vae(latent_channels, scaling_factor=scaling_factor, levels=4)


# --------------------------------------------------------------------------- families: image DiTs


def make_dit(seed: int = 0) -> DiTPipeline:
    """DiT-XL/2 layout: class-conditional adaLN-zero DiT (learned sigma), SD VAE, DDIM; no text encoder."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    return DiTPipeline(
        transformer=build(
            "transformer",
            lambda: DiTTransformer2DModel(
                sample_size=8,  # latent size: 16 px with the factor-2 VAE
                num_layers=2,
                patch_size=2,
                attention_head_dim=8,
                num_attention_heads=2,
                in_channels=4,
                out_channels=8,  # learned sigma: the pipeline keeps the first four channels
                num_embeds_ada_norm=1000,  # ImageNet classes; id 1000 is the unconditional one
            ),
        ),
        vae=build("vae", _sd_vae()),
        scheduler=DDIMScheduler(beta_schedule="linear", beta_start=0.0001, beta_end=0.02, clip_sample=False),
        id2label=DIT_ID2LABEL,
    )


def make_hunyuandit(seed: int = 0) -> HunyuanDiTPipeline:
    """HunyuanDiT: BERT (77 tokens) + T5 (256 tokens) text encoders, DiT with long skip connections, factor-8
    VAE; DDPM as shipped."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer, tokenizer_2 = _bert_tokenizer(), _t5_tokenizer()
    return HunyuanDiTPipeline(
        vae=build("vae", _factor8_vae()),
        text_encoder=build("text_encoder", _bert_encoder(tokenizer)),
        tokenizer=tokenizer,
        text_encoder_2=build("text_encoder_2", _t5_encoder(T5EncoderModel, T5Config, tokenizer_2)),
        tokenizer_2=tokenizer_2,
        transformer=build(
            "transformer",
            lambda: HunyuanDiT2DModel(
                sample_size=4,
                num_layers=4,  # block 0's output skips to block 3: the smallest depth with a long skip
                patch_size=2,
                attention_head_dim=8,
                num_attention_heads=3,
                in_channels=4,
                hidden_size=24,
                cross_attention_dim=32,  # BERT hidden size
                cross_attention_dim_t5=32,  # T5 d_model
                pooled_projection_dim=16,
                text_len=BERT_MAX_LENGTH,  # the pipeline pads BERT to 77 tokens, T5 to 256
                text_len_t5=256,
            ),
        ),
        scheduler=DDPMScheduler(
            beta_schedule="scaled_linear",
            beta_start=0.00085,
            beta_end=0.03,
            clip_sample=False,
            steps_offset=1,
            prediction_type="v_prediction",
        ),
        **_NO_SAFETY_CHECKER,
    )


def make_lumina_next(seed: int = 0) -> LuminaPipeline:
    """Lumina-Next: Gemma (second-last hidden state), next-DiT with zero-initialised gates and output
    (filled here) and an uninitialized ``pad_token``, factor-8 SDXL-style VAE."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _gemma_tokenizer()
    return LuminaPipeline(
        transformer=build(
            "transformer",
            _with_trained_zero_convs(
                lambda: LuminaNextDiT2DModel(
                    sample_size=4,  # latent size: the pipeline's default 32 px image
                    patch_size=2,
                    in_channels=4,
                    hidden_size=16,
                    num_layers=2,
                    num_attention_heads=2,
                    num_kv_heads=1,
                    multiple_of=16,
                    norm_eps=1e-5,
                    learn_sigma=True,
                    qk_norm=True,
                    cross_attention_dim=16,  # Gemma hidden size
                    scaling_factor=1.0,
                )
            ),
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=build("vae", _factor8_vae()),
        text_encoder=build("text_encoder", _lm_encoder(GemmaModel, GemmaConfig, tokenizer)),  # Gemma 1 (2B's layout)
        tokenizer=tokenizer,
    )


def make_pixart_alpha(seed: int = 0) -> PixArtAlphaPipeline:
    """PixArt-Alpha: T5, adaLN-single DiT with cross-attention (learned sigma), SD VAE; DPM-Solver++."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer, text_encoder = _t5(build)
    return PixArtAlphaPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=build("transformer", lambda: PixArtTransformer2DModel(**_PIXART_DIT)),
        vae=build("vae", _sd_vae()),
        scheduler=DPMSolverMultistepScheduler(),
    )


def make_cogview3plus(seed: int = 0) -> CogView3PlusPipeline:
    """CogView3-Plus: T5, MMDiT-style transformer with size/crop conditioning, VAE; CogVideoX DDIM
    (v-prediction, zero-SNR) as shipped."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer, text_encoder = _t5(build)
    return CogView3PlusPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=build(
            "transformer",
            lambda: CogView3PlusTransformer2DModel(
                patch_size=2,
                in_channels=4,
                num_layers=2,
                attention_head_dim=4,
                num_attention_heads=2,
                out_channels=4,
                text_embed_dim=32,  # T5 d_model
                time_embed_dim=8,
                condition_dim=2,
                pos_embed_max_size=8,
                sample_size=8,
            ),
        ),
        vae=build("vae", _kl_vae(4, scaling_factor=1.0)),
        scheduler=_cogvideox_scheduler(snr_shift_scale=4.0),
    )


def make_cogview4(seed: int = 0) -> CogView4Pipeline:
    """CogView4: GLM text encoder (second-last hidden state, prompt left-padded to a multiple of 16),
    RoPE DiT with size/crop conditioning, VAE; flow matching with a linear dynamic shift."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _glm_tokenizer()
    return CogView4Pipeline(
        tokenizer=tokenizer,
        text_encoder=build(
            "text_encoder", _lm_encoder(GlmModel, GlmConfig, tokenizer, hidden_size=32, heads=4, kv_heads=2)
        ),
        transformer=build(
            "transformer",
            lambda: CogView4Transformer2DModel(
                patch_size=2,
                in_channels=4,
                num_layers=2,
                attention_head_dim=4,
                num_attention_heads=4,
                out_channels=4,
                text_embed_dim=32,  # GLM hidden size
                time_embed_dim=8,
                condition_dim=4,
            ),
        ),
        vae=build("vae", _kl_vae(4, scaling_factor=1.0)),
        scheduler=FlowMatchEulerDiscreteScheduler(
            base_shift=0.25,
            max_shift=0.75,
            base_image_seq_len=256,
            use_dynamic_shifting=True,
            time_shift_type="linear",
        ),
    )


# --------------------------------------------------------------------------- families: latent UNets


def make_ldm_text2img(seed: int = 0) -> LDMTextToImagePipeline:
    """LDM text-to-image (CompVis ldm-text2im-large-256): LDM-BERT (77 tokens), UNet, factor-8 KL VAE as
    ``vqvae``; DDIM."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _bert_tokenizer()
    bert_config = LDMBertConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=BERT_MAX_LENGTH,
        encoder_layers=2,
        encoder_ffn_dim=64,
        encoder_attention_heads=4,
        head_dim=8,
        d_model=32,
        dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LDMTextToImagePipeline(
        vqvae=build("vqvae", _factor8_vae(scaling_factor=0.18215)),
        bert=build("bert", lambda: LDMBertModel(bert_config)),
        tokenizer=tokenizer,
        unet=build("unet", _unet()),
        scheduler=_sd_scheduler(DDIMScheduler, clip_sample=False, set_alpha_to_one=False),
    )


def make_lcm(seed: int = 0) -> LatentConsistencyModelPipeline:
    """Latent consistency model (LCM Dreamshaper layout): SD 1.5 components, the guidance scale embedded
    through the UNet's ``time_cond_proj_dim``; LCM scheduler."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    return LatentConsistencyModelPipeline(
        **_sd_components(build, time_cond_proj_dim=32),
        scheduler=_sd_scheduler(LCMScheduler, clip_sample=False, set_alpha_to_one=False),
    )


def make_sd_upscale(seed: int = 0) -> StableDiffusionUpscalePipeline:
    """SD x4 upscaler: CLIP, UNet on latents + the noised low-resolution image (noise level as class
    labels), factor-4 VAE; DDIM v-prediction, DDPM to noise the low-resolution image."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _clip_tokenizer()
    return StableDiffusionUpscalePipeline(
        vae=build("vae", _kl_vae(4, scaling_factor=0.08333, levels=3)),
        text_encoder=build("text_encoder", _clip_encoder(CLIPTextModel, tokenizer)),
        tokenizer=tokenizer,
        unet=build(
            "unet",
            lambda: UNet2DConditionModel(
                sample_size=8,
                in_channels=7,  # 4 latent channels + the 3 image channels
                out_channels=4,
                block_out_channels=(8, 16, 16),
                layers_per_block=1,
                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                norm_num_groups=4,
                cross_attention_dim=32,
                attention_head_dim=2,
                use_linear_projection=True,
                only_cross_attention=(True, True, False),
                num_class_embeds=1000,  # noise levels
            ),
        ),
        low_res_scheduler=DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.0001, beta_end=0.02),
        scheduler=DDIMScheduler(
            beta_schedule="scaled_linear",
            beta_start=0.0001,
            beta_end=0.02,
            prediction_type="v_prediction",
            clip_sample=False,
            set_alpha_to_one=False,
            steps_offset=1,
        ),
        max_noise_level=350,
    )


# --------------------------------------------------------------------------- families: pixel space


def make_deepfloyd_if(seed: int = 0) -> IFPipeline:
    """DeepFloyd IF stage I: T5, pixel-space UNet (learned variance, text-pooled time embedding, added-KV
    cross-attention); DDPM with dynamic thresholding.  No safety checker, watermarker nor feature extractor."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer, text_encoder = _t5(build)
    return IFPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        unet=build(
            "unet",
            lambda: UNet2DConditionModel(
                sample_size=16,
                layers_per_block=1,
                block_out_channels=(16, 32),
                down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
                mid_block_type="UNetMidBlock2DSimpleCrossAttn",
                up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
                in_channels=3,
                out_channels=6,  # noise and variance
                norm_num_groups=8,
                cross_attention_dim=32,
                encoder_hid_dim=32,  # T5 d_model
                attention_head_dim=8,
                addition_embed_type="text",
                addition_embed_type_num_heads=2,
                cross_attention_norm="group_norm",
                resnet_time_scale_shift="scale_shift",
                act_fn="gelu",
            ),
        ),
        scheduler=DDPMScheduler(
            beta_schedule="squaredcos_cap_v2",
            thresholding=True,
            dynamic_thresholding_ratio=0.95,
            sample_max_value=1.0,
            prediction_type="epsilon",
            variance_type="learned_range",
        ),
        **_NO_SAFETY_CHECKER,
        watermarker=None,
    )


def _pixel_unet(**overrides):
    """A two-level pixel-space ``UNet2DModel`` (3 channels, self-attention at the lower level)."""
    config = dict(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
        attention_head_dim=4,
    )
    return lambda: UNet2DModel(**{**config, **overrides})


def make_ddpm(seed: int = 0) -> DDPMPipeline:
    """DDPM (google/ddpm-cifar10 layout): unconditional pixel-space UNet; DDPM."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    return DDPMPipeline(unet=build("unet", _pixel_unet()), scheduler=DDPMScheduler())


def make_consistency_models(seed: int = 0) -> ConsistencyModelPipeline:
    """Consistency model (openai cd_imagenet64 layout): class-conditional pixel-space UNet with scale-shift
    time conditioning and resnet down/up-sampling; multistep consistency sampling."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    unet = _pixel_unet(
        resnet_time_scale_shift="scale_shift", downsample_type="resnet", upsample_type="resnet", num_class_embeds=10
    )
    return ConsistencyModelPipeline(
        unet=build("unet", unet),
        scheduler=CMStochasticIterativeScheduler(num_train_timesteps=40, sigma_min=0.002, sigma_max=80.0),
    )


FAMILIES: dict[str, Callable[..., DiffusionPipeline]] = {
    "dit": make_dit,
    "hunyuandit": make_hunyuandit,
    "lumina_next": make_lumina_next,
    "pixart_alpha": make_pixart_alpha,
    "cogview3plus": make_cogview3plus,
    "cogview4": make_cogview4,
    "deepfloyd_if": make_deepfloyd_if,
    "ldm_text2img": make_ldm_text2img,
    "lcm": make_lcm,
    "ddpm": make_ddpm,
    "consistency_models": make_consistency_models,
    "sd_upscale": make_sd_upscale,
}

KINDS: dict[str, str] = {
    "dit": "dit",
    "hunyuandit": "dit",
    "lumina_next": "dit",
    "pixart_alpha": "dit",
    "cogview3plus": "dit",
    "cogview4": "dit",
    "deepfloyd_if": "pixel",
    "ldm_text2img": "unet",
    "lcm": "unet",
    "ddpm": "pixel",
    "consistency_models": "pixel",
    "sd_upscale": "unet",
}

_CALL_KWARGS: dict[str, dict] = {
    "dit": dict(class_labels=[1], num_inference_steps=2, guidance_scale=4.0, output_type="pt"),
    "hunyuandit": dict(
        _IMAGE, height=32, width=32, negative_prompt=NEGATIVE_PROMPT, guidance_scale=5.0, use_resolution_binning=False
    ),
    "lumina_next": dict(
        _IMAGE, height=32, width=32, negative_prompt=NEGATIVE_PROMPT, guidance_scale=4.0, clean_caption=False
    ),
    "pixart_alpha": dict(
        _IMAGE,
        **_T5,
        negative_prompt=NEGATIVE_PROMPT,
        guidance_scale=4.5,
        use_resolution_binning=False,
        clean_caption=False,
    ),
    "cogview3plus": dict(_IMAGE, **_T5, negative_prompt=NEGATIVE_PROMPT, guidance_scale=7.0),
    "cogview4": dict(_IMAGE, **_T5, negative_prompt=NEGATIVE_PROMPT, guidance_scale=5.0),
    "deepfloyd_if": dict(_IMAGE, negative_prompt=NEGATIVE_PROMPT, guidance_scale=7.0, clean_caption=False),
    "ldm_text2img": dict(_IMAGE, height=32, width=32, guidance_scale=6.0),
    "lcm": dict(_IMAGE, guidance_scale=8.5),
    "ddpm": dict(batch_size=1, num_inference_steps=2, output_type="pt"),
    "consistency_models": dict(batch_size=1, num_inference_steps=2, class_labels=1, output_type="pt"),
    "sd_upscale": dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE_PROMPT,
        num_inference_steps=2,
        guidance_scale=6.0,
        noise_level=20,
        output_type="pt",
    ),
}

#: sd_upscale's low-resolution input: 8 x 8 pixels, upscaled to 32 x 32.
LOW_RES_SIZE = 8


# --------------------------------------------------------------------------- API


def make(family: str, seed: int = 0) -> DiffusionPipeline:
    """A fresh pipeline of ``family``; all components in eval mode, on CPU, in float32."""
    pipe = FAMILIES[family](seed=seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_kwargs(family: str, seed: int = 0) -> dict:
    """Keyword arguments (a fresh dict, without ``generator``) for one small, fast call of ``family``.

    The upscaler's low-resolution image is a fixed random image, derived from ``seed`` like the call's
    generator, so each call seed upscales a different image.
    """
    kwargs = dict(_CALL_KWARGS[family])
    if family == "sd_upscale":
        kwargs["image"] = _random_image(seed, "low_res_image", LOW_RES_SIZE)
    return kwargs


def run(pipe: DiffusionPipeline, family: str, seed: int = 0) -> torch.Tensor:
    """Call ``pipe`` once with a CPU generator seeded with ``seed``: the images, as a float32 tensor on CPU."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    output = pipe(**call_kwargs(family, seed), generator=generator, return_dict=False)[0]
    return torch.as_tensor(output).detach().to(device="cpu", dtype=torch.float32)
