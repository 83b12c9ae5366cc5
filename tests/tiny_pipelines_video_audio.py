"""Tiny, deterministic, *real* diffusers pipelines: video and audio families for the equivalence tests.

``tiny_pipelines`` and ``tiny_pipelines_more`` cover the text-to-image and text-to-video DiTs; the video
and audio pipelines here bring what those do not: image-conditioned video (an image encoder and a VAE
*encode* before the denoising loop), UNets with temporal layers (spatio-temporal, motion modules, 3D
convolutions), a tiled-only VAE, mel-spectrogram VAEs followed by a vocoder, an autoregressive language
model called once per generated token, a raw-waveform UNet without any VAE, and components that the
pipelines use through other methods than ``forward`` (``get_text_features``, ``get_input_embeddings``,
a buffer and a parameter read straight off a module).

The conventions are ``tiny_pipelines``' own, and so are its helpers: each ``nn.Module`` is built under a
seed derived from ``(seed, component name)`` (``_component``), so two builds are bit-identical and the
global RNG is left alone; tokenizers are the classes the pipelines expect, built in code from a small
vocabulary (nothing is downloaded); dimensions follow the ``get_dummy_components()`` of diffusers' own
tests, with the text-encoder widths matched to our tokenizers and a few sizes cut for speed.  Everything
is float32, on CPU, in eval mode.  Input images are fixed random images derived from the call seed.

Families (pipeline class) and what is particular to each:

* video, UNet:

  * ``svd`` (StableVideoDiffusionPipeline): CLIP vision encoder (image embeddings), VAE *encode* of the
    conditioning image, spatio-temporal UNet, temporal-decoder VAE.  The pipeline passes ``num_frames`` to
    ``vae.decode`` only if ``inspect.signature(vae.forward)`` names it (a wrapper hiding that signature
    makes ``decode`` fail: its ``num_frames`` is required); three frames decoded in chunks of two, so the
    decoder sees both ``num_frames=2`` and ``num_frames=1``.  It returns the bare frames for
    ``return_dict=False``, so ``run`` reads the output object's first field instead.
  * ``animatediff`` (AnimateDiffPipeline): an SD 1.5 UNet merged with a ``MotionAdapter`` into a
    ``UNetMotionModel`` (what the pipeline's ``__init__`` does; done here inside the ``unet`` component, so
    no idle ``motion_adapter`` copy of the motion weights is left in the pipeline).
  * ``text_to_video_sd`` (TextToVideoSDPipeline): ``UNet3DConditionModel``, whose temporal convolutions end
    in zero-initialised layers (filled with small values, as trained ones are).

* video, DiT:

  * ``latte`` (LattePipeline): T5 (120 tokens, masked), spatial/temporal-alternating DiT, frames decoded
    one image at a time by a 2D VAE.
  * ``allegro`` (AllegroPipeline): T5, 3D DiT, ``AutoencoderKLAllegro``, which decodes *only* tiled (the
    tile geometry is instance state, set to one 8-frame 16x16 tile here; the shipped one is sized for
    720p).
  * ``wan21_i2v`` (WanImageToVideoPipeline, Wan 2.1 layout): UMT5, CLIP vision encoder (second-last hidden
    state), image cross-attention (``added_kv_proj_dim``), the Wan VAE encoding the first frame.  Its
    prompt cleaning calls ``ftfy`` even when it is not installed: an identity stands in for it then.

* audio:

  * ``audioldm`` (AudioLDMPipeline): CLAP text projection as the UNet's class embedding, mel VAE,
    HiFi-GAN vocoder (initialised wider than its default, which gives a waveform of about 1e-6).
  * ``audioldm2`` (AudioLDM2Pipeline): CLAP (``get_text_features``; its audio branch is only used to rank
    several waveforms), T5, projection model, GPT-2 generating 8 hidden states token by token (a
    ``GPT2LMHeadModel``, as the pipeline's signature says: it calls ``GenerationMixin`` helpers on it, which
    a bare ``GPT2Model`` lacks in transformers 5), UNet with two cross-attention streams, mel VAE, vocoder.
  * ``ace_step`` (AceStepPipeline): Qwen3 text encoder (lyrics go through ``get_input_embeddings()`` only),
    condition encoder (its ``silence_latent`` buffer and, with guidance, its ``null_condition_emb``
    parameter are read outside its ``forward``), 1D DiT, Oobleck audio VAE (which declares
    ``_supports_group_offloading = False``).
  * ``dance_diffusion`` (DanceDiffusionPipeline): a raw-waveform ``UNet1DModel``, no VAE, no text.

API: ``FAMILIES`` (name -> builder), ``KINDS`` (name -> "video" / "audio"), ``make(family, seed)``,
``call_kwargs(family, seed)`` and ``run(pipe, family, seed)``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import SimpleNamespace

import numpy as np
import PIL.Image
import torch
from diffusers import (
    AceStepPipeline,
    AllegroPipeline,
    AllegroTransformer3DModel,
    AnimateDiffPipeline,
    AudioLDM2Pipeline,
    AudioLDM2ProjectionModel,
    AudioLDM2UNet2DConditionModel,
    AudioLDMPipeline,
    AutoencoderKLAllegro,
    AutoencoderKLTemporalDecoder,
    DanceDiffusionPipeline,
    DDIMScheduler,
    DiffusionPipeline,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    IPNDMScheduler,
    LattePipeline,
    LatteTransformer3DModel,
    MotionAdapter,
    StableVideoDiffusionPipeline,
    TextToVideoSDPipeline,
    UNet1DModel,
    UNet2DConditionModel,
    UNet3DConditionModel,
    UNetMotionModel,
    UNetSpatioTemporalConditionModel,
    WanImageToVideoPipeline,
)
from diffusers.models.transformers.ace_step_transformer import AceStepTransformer1DModel
from diffusers.pipelines.ace_step import AceStepConditionEncoder
from diffusers.pipelines.ace_step.pipeline_ace_step import DEFAULT_DIT_INSTRUCTION, SFT_GEN_PROMPT
from diffusers.pipelines.wan import pipeline_wan_i2v
from tiny_pipelines import (
    _CORPUS,
    MAX_SEQUENCE_LENGTH,
    NEGATIVE_PROMPT,
    PROMPT,
    _byte_level_bpe,
    _clip_encoder,
    _clip_tokenizer,
    _component,
    _kl_vae,
    _t5_encoder,
    _t5_tokenizer,
    _wan_transformer,
    _wan_vae,
)
from tiny_pipelines_more import (
    _PIXART_DIT,
    _clip_image_processor,
    _clip_vision_encoder,
    _lm_encoder,
    _oobleck_vae,
    _random_image,
    _sd_scheduler,
    _sd_vae,
    _with_trained_zero_convs,
)
from transformers import (
    ClapAudioConfig,
    ClapConfig,
    ClapFeatureExtractor,
    ClapModel,
    ClapTextConfig,
    ClapTextModelWithProjection,
    CLIPTextModel,
    CLIPVisionModel,
    CLIPVisionModelWithProjection,
    GPT2Config,
    GPT2LMHeadModel,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3Model,
    RobertaTokenizer,
    SpeechT5HifiGan,
    SpeechT5HifiGanConfig,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

__all__ = ["FAMILIES", "KINDS", "call_kwargs", "make", "run"]

#: ACE-Step's lyrics (the pipeline prepends a language header and appends ``<|endoftext|>``).
LYRICS = "[verse]\nsoft notes in the morning light"
#: ACE-Step's clip length: 16 latent frames at the tiny VAE's 2 latents per second.
ACE_AUDIO_DURATION = 8.0
#: Text length of the RoBERTa tokenizers (CLAP); the CLAP position table holds it plus RoBERTa's offset.
ROBERTA_MAX_LENGTH = 16
_ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # bos=0, pad=1, eos=2, unk=3 as RoBERTa's


# --------------------------------------------------------------------------- tokenizers


def _roberta_tokenizer() -> RobertaTokenizer:
    """CLAP's tokenizer class; AudioLDM pads every prompt to ``model_max_length``."""
    return _byte_level_bpe(RobertaTokenizer, _ROBERTA_SPECIALS, _CORPUS, model_max_length=ROBERTA_MAX_LENGTH)


def _ace_step_text() -> str:
    """The text ACE-Step's text encoder sees: its SFT prompt template around the prompt and metadata, and
    the lyrics block (a tokenizer trained on it gives prompts of about the real token count)."""
    metas = AceStepPipeline._build_metadata_string(audio_duration=ACE_AUDIO_DURATION)
    return "\n".join(
        [SFT_GEN_PROMPT.format(DEFAULT_DIT_INSTRUCTION, PROMPT, metas), f"# Languages\nen\n\n# Lyric\n{LYRICS}"]
    )


def _qwen3_tokenizer() -> Qwen2Tokenizer:
    """Qwen3-Embedding's tokenizer class (``Qwen2Tokenizer``); ``<|endoftext|>`` is pad and eos."""
    return _byte_level_bpe(Qwen2Tokenizer, ["<|endoftext|>"], _ace_step_text())


# --------------------------------------------------------------------------- components


def _hifigan_vocoder():
    """SpeechT5's HiFi-GAN: 8 mel bins in, x4 upsampling (16 kHz)."""
    config = SpeechT5HifiGanConfig(
        model_in_dim=8,
        sampling_rate=16000,
        upsample_initial_channel=16,
        upsample_rates=[2, 2],
        upsample_kernel_sizes=[4, 4],
        resblock_kernel_sizes=[3, 7],
        resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]],
        normalize_before=False,
        # Its convolutions start at std 0.01, which leaves a waveform of about 1e-6 from a random network;
        # 0.2 gives one of about 0.1, as a trained vocoder's.
        initializer_range=0.2,
    )
    return lambda: SpeechT5HifiGan(config)


def _mel_vae():
    """The AudioLDM VAE layout: a one-channel mel spectrogram, two levels (scale factor 2)."""
    return _kl_vae(4, scaling_factor=0.9227, channels=1)


#: The AudioLDM / AudioLDM 2 UNet layout on the mel VAE's latents (the two add their text conditioning).
_MEL_UNET = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
)


def _clap_text_config(tokenizer, hidden_size: int) -> ClapTextConfig:
    return ClapTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_attention_heads=2,
        num_hidden_layers=2,
        projection_dim=hidden_size,
        # RoBERTa positions start after the padding index
        max_position_embeddings=tokenizer.model_max_length + tokenizer.pad_token_id + 1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _audioldm_scheduler() -> DDIMScheduler:
    return DDIMScheduler(
        beta_start=0.0015, beta_end=0.0195, beta_schedule="scaled_linear", clip_sample=False, set_alpha_to_one=False
    )


# --------------------------------------------------------------------------- families: video, UNet


def make_svd(seed: int = 0) -> StableVideoDiffusionPipeline:
    """Stable Video Diffusion: CLIP image embedding + VAE latents of the image, spatio-temporal UNet,
    temporal-decoder VAE; Euler (v-prediction, Karras sigmas) as shipped."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    addition_time_embed_dim = 8
    return StableVideoDiffusionPipeline(
        vae=build(
            "vae",
            lambda: AutoencoderKLTemporalDecoder(
                in_channels=3,
                out_channels=3,
                down_block_types=("DownEncoderBlock2D",) * 2,
                block_out_channels=(32, 64),  # its group norms have 32 groups
                layers_per_block=1,
                latent_channels=4,
            ),
        ),
        image_encoder=build(
            "image_encoder", _clip_vision_encoder(CLIPVisionModelWithProjection, 32, image_size=16, patch_size=2)
        ),
        unet=build(
            "unet",
            lambda: UNetSpatioTemporalConditionModel(
                sample_size=8,
                in_channels=8,  # noisy latents + the image's latents
                out_channels=4,
                down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
                up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
                block_out_channels=(32, 64),  # 32 groups in its norms
                layers_per_block=1,
                cross_attention_dim=32,  # CLIP projection
                num_attention_heads=(2, 4),
                addition_time_embed_dim=addition_time_embed_dim,
                projection_class_embeddings_input_dim=3 * addition_time_embed_dim,  # fps, motion bucket, noise aug
            ),
        ),
        scheduler=_sd_scheduler(
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
        feature_extractor=_clip_image_processor(16),
    )


def make_animatediff(seed: int = 0) -> AnimateDiffPipeline:
    """AnimateDiff: SD 1.5 (CLIP, UNet, VAE) with motion modules; DDIM as AnimateDiff ships it."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _clip_tokenizer()

    def unet():
        unet_2d = UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            block_out_channels=(16, 32),
            layers_per_block=1,
            norm_num_groups=2,
            attention_head_dim=4,
            cross_attention_dim=32,  # CLIP hidden size
        )
        adapter = MotionAdapter(
            block_out_channels=(16, 32),
            motion_layers_per_block=1,
            motion_norm_num_groups=2,
            motion_num_attention_heads=4,
        )
        return UNetMotionModel.from_unet2d(unet_2d, adapter)

    return AnimateDiffPipeline(
        vae=build("vae", _sd_vae()),
        text_encoder=build("text_encoder", _clip_encoder(CLIPTextModel, tokenizer)),
        tokenizer=tokenizer,
        unet=build("unet", unet),
        motion_adapter=None,
        scheduler=DDIMScheduler(
            beta_start=0.00085, beta_end=0.012, beta_schedule="linear", clip_sample=False, steps_offset=1
        ),
    )


def make_text_to_video_sd(seed: int = 0) -> TextToVideoSDPipeline:
    """ModelScope text-to-video: CLIP, 3D-convolution UNet with temporal attention, SD VAE per frame."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _clip_tokenizer()
    return TextToVideoSDPipeline(
        vae=build("vae", _sd_vae()),
        text_encoder=build("text_encoder", _clip_encoder(CLIPTextModel, tokenizer, hidden_size=16)),
        tokenizer=tokenizer,
        unet=build(
            "unet",
            # the temporal convolutions' last layers start at zero (identity): trained ones do not
            _with_trained_zero_convs(
                lambda: UNet3DConditionModel(
                    sample_size=8,
                    in_channels=4,
                    out_channels=4,
                    down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
                    up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"),
                    block_out_channels=(8, 16),
                    layers_per_block=1,
                    norm_num_groups=2,
                    attention_head_dim=4,
                    cross_attention_dim=16,  # CLIP hidden size
                )
            ),
        ),
        scheduler=DDIMScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            clip_sample=False,
            set_alpha_to_one=False,
        ),
    )


# --------------------------------------------------------------------------- families: video, DiT


def make_latte(seed: int = 0) -> LattePipeline:
    """Latte: T5, DiT alternating spatial and temporal blocks (adaLN-single, learned sigma), 2D VAE."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _t5_tokenizer()
    return LattePipeline(
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _t5_encoder(T5EncoderModel, T5Config, tokenizer)),
        transformer=build(
            "transformer",
            # video_length: the temporal position table, as many frames as the call's latents
            lambda: LatteTransformer3DModel(**_PIXART_DIT, video_length=2),
        ),
        vae=build("vae", _sd_vae()),
        scheduler=DDIMScheduler(beta_schedule="linear", clip_sample=False, timestep_spacing="linspace"),
    )


def _allegro_vae() -> AutoencoderKLAllegro:
    vae = AutoencoderKLAllegro(
        in_channels=3,
        out_channels=3,
        down_block_types=("AllegroDownBlock3D",) * 4,
        up_block_types=("AllegroUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    )
    # It decodes only tiled.  The tile (frames, height, width) and its stride are instance state, sized in
    # __init__ for 720p; one tile of 8 frames at 16x16 here (2 latent frames of 2x2).
    vae.enable_tiling()
    vae.kernel = vae.stride = (8, 16, 16)
    return vae


def make_allegro(seed: int = 0) -> AllegroPipeline:
    """Allegro: T5, 3D DiT (adaLN-single), 3D VAE that decodes in tiles only."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _t5_tokenizer()
    return AllegroPipeline(
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _t5_encoder(T5EncoderModel, T5Config, tokenizer, d_model=24)),
        transformer=build(
            "transformer",
            lambda: AllegroTransformer3DModel(
                num_attention_heads=2,
                attention_head_dim=12,
                in_channels=4,
                out_channels=4,
                num_layers=2,
                cross_attention_dim=24,
                sample_width=8,
                sample_height=8,
                sample_frames=8,
                caption_channels=24,  # T5 d_model
            ),
        ),
        vae=build("vae", _allegro_vae),
        scheduler=DDIMScheduler(),
    )


def _ftfy_stand_in() -> None:
    """Let the Wan image-to-video pipeline clean prompts without ``ftfy`` (not a dependency of the suite).

    Its ``basic_clean`` calls ``ftfy.fix_text`` unconditionally, though it imports ``ftfy`` only if it is
    installed (the text-to-video pipeline checks ``is_ftfy_available()`` first).  ``fix_text`` leaves our
    plain-ASCII prompts unchanged, so an identity stands in for it when ``ftfy`` is missing.
    """
    if not hasattr(pipeline_wan_i2v, "ftfy"):
        pipeline_wan_i2v.ftfy = SimpleNamespace(fix_text=lambda text: text)


def make_wan21_i2v(seed: int = 0) -> WanImageToVideoPipeline:
    """Wan 2.1 image-to-video: UMT5, CLIP vision encoder, one transformer with image cross-attention (the
    first frame's VAE latents and a mask concatenated to the noise: 16 + 4 + 16 input channels)."""
    _ftfy_stand_in()
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _t5_tokenizer()
    image_dim = 16
    return WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _t5_encoder(UMT5EncoderModel, UMT5Config, tokenizer)),
        vae=build("vae", _wan_vae()),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        image_processor=_clip_image_processor(32),
        image_encoder=build(
            "image_encoder", _clip_vision_encoder(CLIPVisionModel, image_dim, image_size=32, patch_size=4)
        ),
        transformer=build(
            "transformer",
            _wan_transformer(
                in_channels=36,
                cross_attn_norm=True,
                qk_norm="rms_norm_across_heads",
                image_dim=image_dim,  # CLIP hidden size
                added_kv_proj_dim=32,  # = num_attention_heads * attention_head_dim
            ),
        ),
    )


# --------------------------------------------------------------------------- families: audio


def make_audioldm(seed: int = 0) -> AudioLDMPipeline:
    """AudioLDM: CLAP text projection (the UNet's class embedding, no cross-attention context), mel VAE,
    HiFi-GAN vocoder."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _roberta_tokenizer()
    clap = _clap_text_config(tokenizer, hidden_size=32)
    return AudioLDMPipeline(
        vae=build("vae", _mel_vae()),
        text_encoder=build("text_encoder", lambda: ClapTextModelWithProjection(clap)),
        tokenizer=tokenizer,
        unet=build(
            "unet",
            lambda: UNet2DConditionModel(
                **_MEL_UNET,
                cross_attention_dim=(32, 64),  # self-attention: the channel counts
                class_embed_type="simple_projection",
                projection_class_embeddings_input_dim=32,  # CLAP projection
                class_embeddings_concat=True,
            ),
        ),
        vocoder=build("vocoder", _hifigan_vocoder()),
        scheduler=_audioldm_scheduler(),
    )


def make_audioldm2(seed: int = 0) -> AudioLDM2Pipeline:
    """AudioLDM 2: CLAP + T5 -> projection model -> GPT-2 (8 generated hidden states), UNet attending to
    GPT-2 (16) and T5 (32), mel VAE, HiFi-GAN vocoder."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer, tokenizer_2 = _roberta_tokenizer(), _t5_tokenizer()
    clap = ClapConfig(
        text_config=_clap_text_config(tokenizer, hidden_size=16).to_dict(),
        audio_config=ClapAudioConfig(
            spec_size=64,
            window_size=4,
            num_mel_bins=64,
            intermediate_size=37,
            depths=[2, 2],
            num_attention_heads=[2, 2],
            num_hidden_layers=2,
            hidden_size=192,
            projection_dim=16,
            patch_size=2,
            patch_stride=2,
            patch_embed_input_channels=4,
        ).to_dict(),
        projection_dim=16,
    )
    gpt2 = GPT2Config(n_embd=16, n_head=2, n_layer=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)

    def language_model():
        model = GPT2LMHeadModel(gpt2)
        model.config.max_new_tokens = 8
        return model

    return AudioLDM2Pipeline(
        vae=build("vae", _mel_vae()),
        text_encoder=build("text_encoder", lambda: ClapModel(clap)),
        text_encoder_2=build("text_encoder_2", _t5_encoder(T5EncoderModel, T5Config, tokenizer_2)),
        projection_model=build(
            "projection_model",
            lambda: AudioLDM2ProjectionModel(text_encoder_dim=16, text_encoder_1_dim=32, langauge_model_dim=16),
        ),
        language_model=build("language_model", language_model),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        feature_extractor=ClapFeatureExtractor(hop_length=7900),
        unet=build(
            "unet",
            lambda: AudioLDM2UNet2DConditionModel(
                **_MEL_UNET,
                # per block: self-attention, GPT-2 states, T5 states
                cross_attention_dim=([None, 16, 32], [None, 16, 32]),
            ),
        ),
        vocoder=build("vocoder", _hifigan_vocoder()),
        scheduler=_audioldm_scheduler(),
    )


def make_ace_step(seed: int = 0) -> AceStepPipeline:
    """ACE-Step 1.5 (base layout, guidance on): Qwen3 text encoder, lyric/timbre condition encoder, 1D DiT,
    Oobleck audio VAE; flow-matching Euler on the pipeline's own shifted sigmas."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _qwen3_tokenizer()
    qwen3 = _lm_encoder(Qwen3Model, Qwen3Config, tokenizer, hidden_size=32, heads=4, kv_heads=2, max_positions=256)
    attention = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0, sliding_window=16)

    def condition_encoder():
        encoder = AceStepConditionEncoder(
            hidden_size=32,
            intermediate_size=64,
            text_hidden_dim=32,  # Qwen3 hidden size
            timbre_hidden_dim=8,  # = the VAE's latent channels
            num_lyric_encoder_hidden_layers=2,
            num_timbre_encoder_hidden_layers=2,
            **attention,
        )
        # A placeholder of zeros until a checkpoint fills it with the VAE latents of silence.
        encoder.silence_latent.normal_()
        return encoder

    return AceStepPipeline(
        vae=build("vae", _oobleck_vae(latent_channels=8)),
        text_encoder=build("text_encoder", qwen3),
        tokenizer=tokenizer,
        transformer=build(
            "transformer",
            lambda: AceStepTransformer1DModel(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                in_channels=24,  # noise (8) + source latents (8) + chunk mask (8)
                audio_acoustic_hidden_dim=8,
                patch_size=2,
                **attention,
            ),
        ),
        condition_encoder=build("condition_encoder", condition_encoder),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1, shift=1.0),
    )


def make_dance_diffusion(seed: int = 0) -> DanceDiffusionPipeline:
    """Dance Diffusion: an unconditional stereo-waveform UNet1D (Fourier time features), IPNDM."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    return DanceDiffusionPipeline(
        unet=build(
            "unet",
            lambda: UNet1DModel(
                sample_size=256,
                sample_rate=16000,
                in_channels=2,
                out_channels=2,
                extra_in_channels=16,
                time_embedding_dim=16,  # Fourier features, concatenated to the waveform: extra_in_channels
                block_out_channels=(32, 32, 64),
                flip_sin_to_cos=True,
                use_timestep_embedding=False,
                time_embedding_type="fourier",
                mid_block_type="UNetMidBlock1D",
                down_block_types=("DownBlock1DNoSkip", "DownBlock1D", "AttnDownBlock1D"),
                up_block_types=("AttnUpBlock1D", "UpBlock1D", "UpBlock1DNoSkip"),
            ),
        ),
        scheduler=IPNDMScheduler(),
    )


FAMILIES: dict[str, Callable[..., DiffusionPipeline]] = {
    "svd": make_svd,
    "animatediff": make_animatediff,
    "text_to_video_sd": make_text_to_video_sd,
    "latte": make_latte,
    "allegro": make_allegro,
    "wan21_i2v": make_wan21_i2v,
    "audioldm": make_audioldm,
    "audioldm2": make_audioldm2,
    "ace_step": make_ace_step,
    "dance_diffusion": make_dance_diffusion,
}

KINDS: dict[str, str] = {
    "svd": "video",
    "animatediff": "video",
    "text_to_video_sd": "video",
    "latte": "video",
    "allegro": "video",
    "wan21_i2v": "video",
    "audioldm": "audio",
    "audioldm2": "audio",
    "ace_step": "audio",
    "dance_diffusion": "audio",
}

_VIDEO = dict(
    prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, num_inference_steps=2, height=16, width=16, output_type="pt"
)
#: 64 samples at 16 kHz: 16 mel frames, 8 latent rows
_MEL = dict(
    prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, num_inference_steps=2, audio_length_in_s=0.004, output_type="pt"
)

_CALL_KWARGS: dict[str, dict] = {
    # three frames decoded in chunks of two; guidance ramps from 1 to 2.5 over the frames
    "svd": dict(
        num_inference_steps=2,
        height=16,
        width=16,
        num_frames=3,
        decode_chunk_size=2,
        min_guidance_scale=1.0,
        max_guidance_scale=2.5,
        output_type="pt",
    ),
    "animatediff": dict(_VIDEO, num_frames=4, guidance_scale=7.5),
    "text_to_video_sd": dict(_VIDEO, num_frames=4, guidance_scale=9.0),
    # two frames, decoded one at a time; no T5 caption cleaning (it needs bs4 / ftfy)
    "latte": dict(_VIDEO, video_length=2, guidance_scale=5.0, clean_caption=False, decode_chunk_size=1),
    "allegro": dict(
        _VIDEO, num_frames=8, guidance_scale=6.0, max_sequence_length=MAX_SEQUENCE_LENGTH, clean_caption=False
    ),
    "wan21_i2v": dict(_VIDEO, num_frames=5, guidance_scale=5.0, max_sequence_length=MAX_SEQUENCE_LENGTH),
    "audioldm": dict(_MEL, guidance_scale=2.5),
    "audioldm2": dict(_MEL, guidance_scale=3.5),
    # room for the whole prompt template (61 tokens with our tokenizer; the pipeline's default is 256)
    "ace_step": dict(
        prompt=PROMPT,
        lyrics=LYRICS,
        audio_duration=ACE_AUDIO_DURATION,
        num_inference_steps=2,
        guidance_scale=7.0,
        max_text_length=64,
        output_type="pt",
    ),
    # the UNet's whole window (256 samples)
    "dance_diffusion": dict(num_inference_steps=2, audio_length_in_s=256 / 16000),
}


# --------------------------------------------------------------------------- API


def make(family: str, seed: int = 0) -> DiffusionPipeline:
    """A fresh pipeline of ``family``; all components in eval mode, on CPU, in float32."""
    pipe = FAMILIES[family](seed=seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_kwargs(family: str, seed: int = 0) -> dict:
    """Keyword arguments (a fresh dict, without ``generator``) for one small, fast call of ``family``.

    The image-to-video families condition on a fixed random image derived from ``seed`` like the call's
    generator, so each call seed conditions on a different image: SVD takes it as a tensor (its
    processor then skips the resize to CLIP's 224 pixels), Wan as a PIL image (the CLIP processor resizes
    it to the vision encoder's 32 pixels).
    """
    kwargs = dict(_CALL_KWARGS[family])
    if family == "svd":
        kwargs["image"] = _random_image(seed, "image", kwargs["height"])
    if family == "wan21_i2v":
        pixels = (_random_image(seed, "image", kwargs["height"])[0] * 255).round().to(torch.uint8)
        kwargs["image"] = PIL.Image.fromarray(np.ascontiguousarray(pixels.permute(1, 2, 0).numpy()))
    return kwargs


def run(pipe: DiffusionPipeline, family: str, seed: int = 0) -> torch.Tensor:
    """Call ``pipe`` once with a CPU generator seeded with ``seed``: the decoded frames or waveforms, as a
    float32 tensor on CPU."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    # The output object's first field (``frames`` / ``audios``): with ``return_dict=False`` SVD returns the
    # frames themselves rather than a tuple, so ``[0]`` would pick its first video instead.
    output = pipe(**call_kwargs(family, seed), generator=generator)[0]
    return torch.as_tensor(output).detach().to(device="cpu", dtype=torch.float32)
