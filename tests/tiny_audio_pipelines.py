"""Tiny audio pipelines, as ``Family`` tables (see ``tiny_components``).

* ``stable_audio`` (Stable Audio Open: T5, a projection model of the text and the start/end seconds, DiT, Oobleck
  audio VAE). Its real scheduler, ``CosineDPMSolverMultistepScheduler``, needs ``torchsde``, which the suite does not
  install; it runs with the deterministic ``EDMDPMSolverMultistepScheduler`` (the class the pipeline's signature
  names) configured alike.
* ``audioldm``: a CLAP text projection as the UNet's class embedding (no cross-attention context), a mel-spectrogram
  VAE, a HiFi-GAN vocoder (initialised wider than its default, which gives a waveform of about 1e-6).
* ``audioldm2``: CLAP (``get_text_features``: components used through other methods than ``forward``; its audio
  branch is only used to rank several waveforms), T5, a projection model, GPT-2 generating 8 hidden states token by
  token (a ``GPT2LMHeadModel``, as the pipeline's signature says: it calls ``GenerationMixin`` helpers on it, which
  a bare ``GPT2Model`` lacks in transformers 5), a UNet with two cross-attention streams, the mel VAE and vocoder.
* ``ace_step`` (ACE-Step 1.5, base layout, guidance on): a Qwen3 text encoder (the lyrics go through
  ``get_input_embeddings()`` only), a condition encoder whose ``silence_latent`` buffer and, with guidance,
  ``null_condition_emb`` parameter are read outside its ``forward``, a 1D DiT, an Oobleck audio VAE (which declares
  ``_supports_group_offloading = False``); flow-matching Euler on the pipeline's own shifted sigmas.
* ``dance_diffusion``: a raw-waveform ``UNet1DModel`` (Fourier time features), no VAE, no text; IPNDM.
"""

from __future__ import annotations

from functools import partial

from diffusers import (
    AceStepPipeline,
    AudioLDM2Pipeline,
    AudioLDM2ProjectionModel,
    AudioLDM2UNet2DConditionModel,
    AudioLDMPipeline,
    DanceDiffusionPipeline,
    DDIMScheduler,
    EDMDPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    IPNDMScheduler,
    StableAudioDiTModel,
    StableAudioPipeline,
    StableAudioProjectionModel,
    UNet1DModel,
    UNet2DConditionModel,
)
from diffusers.models.transformers.ace_step_transformer import AceStepTransformer1DModel
from diffusers.pipelines.ace_step import AceStepConditionEncoder
from diffusers.pipelines.ace_step.pipeline_ace_step import DEFAULT_DIT_INSTRUCTION, SFT_GEN_PROMPT
from transformers import (
    ClapAudioConfig,
    ClapConfig,
    ClapFeatureExtractor,
    ClapModel,
    ClapTextConfig,
    ClapTextModelWithProjection,
    GPT2Config,
    GPT2LMHeadModel,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3Model,
    SpeechT5HifiGan,
    SpeechT5HifiGanConfig,
)

from tiny_components import (
    NEGATIVE,
    PROMPT,
    T5,
    Family,
    Model,
    Text,
    blocks,
    byte_level_bpe,
    configured,
    kl_vae,
    lm_encoder,
    model,
    oobleck_vae,
    roberta_tokenizer,
    unet_levels,
    vocabulary,
)

#: ACE-Step's lyrics (the pipeline prepends a language header and appends ``<|endoftext|>``).
LYRICS = "[verse]\nsoft notes in the morning light"
#: ACE-Step's clip length: 16 latent frames at the tiny VAE's 2 latents per second.
ACE_AUDIO_DURATION = 8.0


def _ace_step_text() -> str:
    """The text ACE-Step's text encoder sees: its SFT prompt template around the prompt and metadata, and the lyrics
    block (a tokenizer trained on it gives prompts of about the real token count)."""
    metas = AceStepPipeline._build_metadata_string(audio_duration=ACE_AUDIO_DURATION)
    return "\n".join(
        [SFT_GEN_PROMPT.format(DEFAULT_DIT_INSTRUCTION, PROMPT, metas), f"# Languages\nen\n\n# Lyric\n{LYRICS}"]
    )


def _qwen3_tokenizer() -> Qwen2Tokenizer:
    """Qwen3-Embedding's tokenizer class (``Qwen2Tokenizer``); ``<|endoftext|>`` is pad and eos."""
    return byte_level_bpe(Qwen2Tokenizer, ["<|endoftext|>"], _ace_step_text())


def _hifigan_vocoder() -> SpeechT5HifiGan:
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
        # Its convolutions start at std 0.01, which leaves a waveform of about 1e-6 from a random network; 0.2 gives
        # one of about 0.1, as a trained vocoder's.
        initializer_range=0.2,
    )
    return SpeechT5HifiGan(config)


def _clap_text_config(tokenizer, hidden_size: int) -> ClapTextConfig:
    return ClapTextConfig(
        **vocabulary(tokenizer, "bos", "eos", "pad"),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_attention_heads=2,
        num_hidden_layers=2,
        projection_dim=hidden_size,
        # RoBERTa positions start after the padding index
        max_position_embeddings=tokenizer.model_max_length + tokenizer.pad_token_id + 1,
    )


def _clap_text(tokenizer):
    """AudioLDM's text encoder: the text half of CLAP, with its projection."""
    config = _clap_text_config(tokenizer, hidden_size=32)
    return lambda: ClapTextModelWithProjection(config)


#: CLAP's audio branch (a two-stage Swin transformer over a 64-bin spectrogram), projected to 16.
_CLAP_AUDIO = {
    "spec_size": 64,
    "window_size": 4,
    "num_mel_bins": 64,
    "intermediate_size": 37,
    "depths": [2, 2],
    "num_attention_heads": [2, 2],
    "num_hidden_layers": 2,
    "hidden_size": 192,
    "projection_dim": 16,
    "patch_size": 2,
    "patch_stride": 2,
    "patch_embed_input_channels": 4,
}


def _clap(tokenizer):
    """AudioLDM 2's first text encoder: the whole of CLAP (its audio branch ranks waveforms)."""
    config = ClapConfig(
        text_config=_clap_text_config(tokenizer, hidden_size=16).to_dict(),
        audio_config=ClapAudioConfig(**_CLAP_AUDIO).to_dict(),
        projection_dim=16,
    )
    return lambda: ClapModel(config)


def _gpt2() -> GPT2LMHeadModel:
    """AudioLDM 2's language model: GPT-2 generating 8 hidden states."""
    config = GPT2Config(n_embd=16, n_head=2, n_layer=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    language_model = GPT2LMHeadModel(config)
    language_model.config.max_new_tokens = 8
    return language_model


#: ACE-Step's attention layout, its transformer's and its condition encoder's.
_ACE_ATTENTION = {
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rope_theta": 10000.0,
    "sliding_window": 16,
}


def _condition_encoder() -> AceStepConditionEncoder:
    encoder = configured(
        AceStepConditionEncoder,
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "text_hidden_dim": 32,  # Qwen3 hidden size
            "timbre_hidden_dim": 8,  # = the VAE's latent channels
            "num_lyric_encoder_hidden_layers": 2,
            "num_timbre_encoder_hidden_layers": 2,
        },
        _ACE_ATTENTION,
    )()
    # A placeholder of zeros until a checkpoint fills it with the VAE latents of silence.
    encoder.silence_latent.normal_()
    return encoder


#: The AudioLDM VAE layout: a one-channel mel spectrogram, two levels (scale factor 2).
MEL_VAE = kl_vae(4, scaling_factor=0.9227, channels=1)
#: The AudioLDM / AudioLDM 2 UNet layout on the mel VAE's latents (the two add their text conditioning).
_MEL_UNET = unet_levels(8, 4, (32, 64), "DownBlock2D", "CrossAttnDownBlock2D")
_MEL_PARTS = {
    "vae": MEL_VAE,
    "vocoder": Model(_hifigan_vocoder),
    "scheduler": partial(
        DDIMScheduler,
        beta_start=0.0015,
        beta_end=0.0195,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
    ),
}
_AUDIOS = ("audios",)
#: 64 samples at 16 kHz: 16 mel frames, 8 latent rows
_MEL_CALL = {
    "prompt": PROMPT,
    **NEGATIVE,
    "num_inference_steps": 2,
    "audio_length_in_s": 0.004,
    "output_type": "pt",
}

FAMILIES: dict[str, Family] = {
    # 8 s: the longest the tiny DiT makes (16 latent samples x hop length 2 at 4 Hz), i.e. the whole window.
    "stable_audio": Family(
        "audio",
        StableAudioPipeline,
        {
            "text_encoder": T5,
            "projection_model": model(
                StableAudioProjectionModel,
                {"text_encoder_dim": 32, "conditioning_dim": 4, "min_value": 0, "max_value": 32},
            ),
            "transformer": model(
                StableAudioDiTModel,
                {
                    "sample_size": 16,
                    "in_channels": 3,
                    "num_layers": 2,
                    "attention_head_dim": 4,
                    "num_key_value_attention_heads": 2,
                    "out_channels": 3,
                    "cross_attention_dim": 4,
                    "time_proj_dim": 8,
                    "global_states_input_dim": 8,
                    "cross_attention_input_dim": 4,
                },
            ),
            "vae": oobleck_vae(latent_channels=3),
            "scheduler": partial(
                EDMDPMSolverMultistepScheduler,
                sigma_min=0.3,
                sigma_max=500.0,
                sigma_data=1.0,
                sigma_schedule="exponential",
                prediction_type="v_prediction",
                solver_order=2,
            ),
        },
        {"prompt": PROMPT, **NEGATIVE, "num_inference_steps": 2, "guidance_scale": 7.0, "audio_end_in_s": 8.0},
    ),
    "audioldm": Family(
        "audio",
        AudioLDMPipeline,
        {
            **_MEL_PARTS,
            "text_encoder": Text(roberta_tokenizer, _clap_text),
            "unet": model(
                UNet2DConditionModel,
                _MEL_UNET,
                {
                    "cross_attention_dim": (32, 64),  # self-attention: the channel counts
                    "class_embed_type": "simple_projection",
                    "projection_class_embeddings_input_dim": 32,  # CLAP projection
                    "class_embeddings_concat": True,
                },
            ),
        },
        {**_MEL_CALL, "guidance_scale": 2.5},
        _AUDIOS,
    ),
    # the UNet attends to GPT-2's states (16 wide) and T5's (32)
    "audioldm2": Family(
        "audio",
        AudioLDM2Pipeline,
        {
            **_MEL_PARTS,
            "text_encoder": Text(roberta_tokenizer, _clap),
            "text_encoder_2": T5,
            "projection_model": model(
                AudioLDM2ProjectionModel, {"text_encoder_dim": 16, "text_encoder_1_dim": 32, "langauge_model_dim": 16}
            ),
            "language_model": Model(_gpt2),
            "feature_extractor": partial(ClapFeatureExtractor, hop_length=7900),
            # per block: self-attention, GPT-2 states, T5 states
            "unet": model(
                AudioLDM2UNet2DConditionModel, _MEL_UNET, {"cross_attention_dim": ([None, 16, 32], [None, 16, 32])}
            ),
        },
        {**_MEL_CALL, "guidance_scale": 3.5},
        _AUDIOS,
    ),
    # room for the whole prompt template (61 tokens with our tokenizer; the pipeline's default is 256)
    "ace_step": Family(
        "audio",
        AceStepPipeline,
        {
            "vae": oobleck_vae(latent_channels=8),
            "text_encoder": Text(
                _qwen3_tokenizer,
                partial(lm_encoder, Qwen3Model, Qwen3Config, hidden_size=32, heads=4, kv_heads=2, max_positions=256),
            ),
            "transformer": model(
                AceStepTransformer1DModel,
                {
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 2,
                    "in_channels": 24,  # noise (8) + source latents (8) + chunk mask (8)
                    "audio_acoustic_hidden_dim": 8,
                    "patch_size": 2,
                },
                _ACE_ATTENTION,
            ),
            "condition_encoder": Model(_condition_encoder),
            "scheduler": partial(FlowMatchEulerDiscreteScheduler, num_train_timesteps=1, shift=1.0),
        },
        {
            "prompt": PROMPT,
            "lyrics": LYRICS,
            "audio_duration": ACE_AUDIO_DURATION,
            "num_inference_steps": 2,
            "guidance_scale": 7.0,
            "max_text_length": 64,
            "output_type": "pt",
        },
        _AUDIOS,
    ),
    # the UNet's whole window (256 samples)
    "dance_diffusion": Family(
        "audio",
        DanceDiffusionPipeline,
        {
            "unet": model(
                UNet1DModel,
                {
                    "sample_size": 256,
                    "sample_rate": 16000,
                    "in_channels": 2,
                    "out_channels": 2,
                    "extra_in_channels": 16,
                    "time_embedding_dim": 16,  # Fourier features, concatenated to the waveform: extra_in_channels
                    "block_out_channels": (32, 32, 64),
                    "flip_sin_to_cos": True,
                    "use_timestep_embedding": False,
                    "time_embedding_type": "fourier",
                    "mid_block_type": "UNetMidBlock1D",
                    **blocks("DownBlock1DNoSkip", "DownBlock1D", "AttnDownBlock1D"),
                },
            ),
            "scheduler": IPNDMScheduler,
        },
        {"num_inference_steps": 2, "audio_length_in_s": 256 / 16000},
        _AUDIOS,
    ),
}
