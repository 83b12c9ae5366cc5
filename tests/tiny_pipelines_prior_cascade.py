"""Tiny, deterministic, *real* diffusers pipelines with a prior, a cascade of stages, or a renderer.

``tiny_pipelines`` and ``tiny_pipelines_more`` cover text-to-image and text-to-video pipelines whose components
compute in their ``forward`` (or a VAE's ``encode`` / ``decode``).  The pipelines here are where that breaks down,
and where an offloading mode has to be careful:

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

The conventions are ``tiny_pipelines``' own, and so are its helpers: each ``nn.Module`` is built under a seed
derived from ``(seed, component name)`` (``_component``), so two builds are bit-identical and the global RNG is left
alone; tokenizers are the classes the pipelines expect, built in code (nothing is downloaded); dimensions follow
the ``get_dummy_components()`` of diffusers' own tests, with the text-encoder widths matched to our tokenizers.
Parameters a fresh model initialises to zero and a checkpoint fills (output convolutions, timestep mappers,
positional embeddings, CLIP statistics, the Paella VQ's residual ``gammas``, and the residual blocks' output layers
that ``WuerstchenDiffNeXt`` scales down to about 1e-15) get small random values, or the component, or the input
that goes through them, would have no influence on the output.  Everything is float32, on CPU, in eval mode.

Families (pipeline class; what the output tensor is):

* ``kandinsky22_prior`` (KandinskyV22PriorPipeline): the image embeddings, followed by the negative ones, which
  without a negative prompt are the ``image_encoder``'s embedding of a blank image (the encoder's only use);
* ``kandinsky22`` (KandinskyV22Pipeline): images; the call's ``image_embeds`` / ``negative_image_embeds`` are fixed
  random tensors derived from the call seed;
* ``kandinsky3`` (Kandinsky3Pipeline): images;
* ``stable_unclip`` (StableUnCLIPPipeline): images (prior, image normalizer with ``noise_level`` > 0, UNet, VAE);
* ``stable_unclip_img2img`` (StableUnCLIPImg2ImgPipeline): images; the input image is a fixed random PIL image
  derived from the call seed, read by the CLIP image processor and vision encoder;
* ``wuerstchen_prior`` (WuerstchenPriorPipeline) and ``stable_cascade_prior`` (StableCascadePriorPipeline): the
  stage C image embeddings;
* ``wuerstchen_decoder`` (WuerstchenDecoderPipeline) and ``stable_cascade_decoder`` (StableCascadeDecoderPipeline):
  images; the ``image_embeddings`` are fixed random tensors derived from the call seed, with the 16 channels of
  the real stage C (the decoders inject them, as the real checkpoints do; diffusers' tests leave that out);
* ``shap_e`` (ShapEPipeline): the rendered frames (20 views of 16 x 16), so the renderer runs.  Its renderer is
  ``ShapERenderer`` with fewer rays per batch and samples per ray (``_ShapERenderer``: the defaults take seconds).
  A call *changes* the renderer's weights: ``mlp.mlp.0``-``3.weight`` (the ``param_names``) hold the last call's
  projected latents afterwards, so they differ from a fresh build's.

The cascade decoders' images are mostly saturated (clamped to 0 or 1, as in diffusers' tests): the first
``DDPMWuerstchenScheduler`` step divides by ``sqrt(alpha)`` ~ 1/70, and an untrained denoiser's error is amplified
as much; a tenth to a fifth of the pixels stay in between, enough for every component to show.  For the same
reason ``wuerstchen_prior``'s embeddings run to 1e5.

API: ``FAMILIES`` (name -> builder), ``KINDS`` (name -> kind), ``make(family, seed)``, ``call_kwargs(family, seed)``
and ``run(pipe, family, seed)``.
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
    DiffusionPipeline,
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
from tiny_pipelines import (
    CLIP_MAX_LENGTH,
    NEGATIVE_PROMPT,
    PROMPT,
    _clip_encoder,
    _clip_tokenizer,
    _component,
    _t5_encoder,
    _t5_tokenizer,
)
from tiny_pipelines_more import (
    _call_generator,
    _clip_image_processor,
    _clip_vision_encoder,
    _sd_scheduler,
    _sd_vae,
    _unet,
    _with_trained_zero_convs,
)
from transformers import (
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPVisionModelWithProjection,
    T5Config,
    T5EncoderModel,
)

__all__ = ["FAMILIES", "KINDS", "call_kwargs", "make", "run"]

EMBED_DIM = 32  # CLIP hidden size and projection: the image-embedding width of the unCLIP-style families
IMAGE_SIZE = 32  # CLIP vision encoders' input size
STAGE_C_CHANNELS = 16  # channels of Würstchen / Stable Cascade stage C latents, the decoders' image embeddings


# --------------------------------------------------------------------------- components


def _with_embedding_stats(factory: Callable[[], torch.nn.Module], mean: str, std: str):
    """``factory`` with its zero-initialised parameters filled (``_with_trained_zero_convs``), and the embedding
    statistics ``mean`` / ``std`` (zeros, and zeros or ones, when fresh) set to plausible values.

    ``PriorTransformer.post_process_latents`` returns ``latents * clip_std + clip_mean``: a fresh prior's zero
    ``clip_std`` would make every output zero.  ``StableUnCLIPImageNormalizer`` would be an identity.
    """

    def build():
        module = _with_trained_zero_convs(factory)()
        with torch.no_grad():
            getattr(module, mean).normal_(std=0.5)
            getattr(module, std).uniform_(0.5, 1.5)
        return module

    return build


def _prior_transformer(**config):
    """A ``PriorTransformer`` as a checkpoint leaves it: positional and ``prd`` embeddings, CLIP statistics set."""
    return _with_embedding_stats(lambda: PriorTransformer(**config), "clip_mean", "clip_std")


def _unclip_prior():
    """The Kandinsky 2.2 / Stable unCLIP prior: one block over the CLIP text states (one position per token)."""
    return _prior_transformer(
        num_attention_heads=2,
        attention_head_dim=12,
        embedding_dim=EMBED_DIM,
        num_layers=1,
        num_embeddings=CLIP_MAX_LENGTH,
    )


def _image_normalizer():
    return _with_embedding_stats(lambda: StableUnCLIPImageNormalizer(embedding_dim=EMBED_DIM), "mean", "std")


def _image_encoder():
    """The CLIP vision encoder of Kandinsky 2.2's prior and Stable unCLIP image variation: ``EMBED_DIM`` wide."""
    return _clip_vision_encoder(CLIPVisionModelWithProjection, EMBED_DIM, image_size=IMAGE_SIZE, patch_size=4, heads=4)


def _movq():
    """Kandinsky's MoVQ (a ``VQModel`` with spatial norms, whose group norms have 32 groups): spatial factor 2."""
    return lambda: VQModel(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "AttnDownEncoderBlock2D"),
        up_block_types=("AttnUpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        norm_type="spatial",
        num_vq_embeddings=12,
        vq_embed_dim=4,
    )


def _paella_vq():
    """Würstchen's / Stable Cascade's stage A: spatial factor 4 (pixel unshuffle, one strided level)."""
    # The mixing residual blocks scale their branches by `gammas`, zeros when fresh.
    return _with_trained_zero_convs(lambda: PaellaVQModel(embed_dim=32, bottleneck_blocks=1, num_vq_embeddings=2))


class _ShapERenderer(ShapERenderer):
    """``ShapERenderer``, ray-marching 1024 rays at a time with 8 + 16 samples per ray (not 4096 with 64 + 128).

    ``ShapEPipeline`` passes ``decode_to_image`` nothing but the frame size, and at the defaults the renderer
    evaluates its NeRF MLP at five million points for the smallest frames it can render (20 views of 32 x 32:
    ``20 * size**2`` must be a multiple of the ray batch), ten seconds on one core.  With these defaults 20 views
    of 16 x 16 take five ray batches of 1024 and a few hundredths of a second; the rendering itself (the latents
    projected and *copied into* ``mlp``'s parameters, coarse then importance-sampled fine rays) is the real one.
    """

    def decode_to_image(
        self,
        latents,
        device,
        size: int = 64,
        ray_batch_size: int = 1024,
        n_coarse_samples: int = 8,
        n_fine_samples: int = 16,
    ):
        return super().decode_to_image(latents, device, size, ray_batch_size, n_coarse_samples, n_fine_samples)


# --------------------------------------------------------------------------- families: priors


def make_kandinsky22_prior(seed: int = 0) -> KandinskyV22PriorPipeline:
    """Kandinsky 2.2 prior: CLIP text encoder (projection + hidden states) -> PriorTransformer -> CLIP image
    embedding; the CLIP vision encoder embeds a blank image as the negative embedding."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _clip_tokenizer()
    return KandinskyV22PriorPipeline(
        prior=build("prior", _unclip_prior()),
        image_encoder=build("image_encoder", _image_encoder()),
        text_encoder=build("text_encoder", _clip_encoder(CLIPTextModelWithProjection, tokenizer)),
        tokenizer=tokenizer,
        scheduler=UnCLIPScheduler(
            variance_type="fixed_small_log",
            prediction_type="sample",
            num_train_timesteps=1000,
            clip_sample=True,
            clip_sample_range=10.0,
        ),
        image_processor=_clip_image_processor(IMAGE_SIZE),
    )


def make_wuerstchen_prior(seed: int = 0) -> WuerstchenPriorPipeline:
    """Würstchen stage C: CLIP text hidden states -> ``WuerstchenPrior`` -> 16-channel image embeddings."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _clip_tokenizer()
    return WuerstchenPriorPipeline(
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _clip_encoder(CLIPTextModel, tokenizer)),
        prior=build(
            "prior",
            _with_trained_zero_convs(
                lambda: WuerstchenPrior(c_in=STAGE_C_CHANNELS, c=8, depth=2, c_cond=EMBED_DIM, c_r=8, nhead=2)
            ),
        ),
        scheduler=DDPMWuerstchenScheduler(),
    )


def make_stable_cascade_prior(seed: int = 0) -> StableCascadePriorPipeline:
    """Stable Cascade stage C: CLIP text (hidden states and pooled projection) -> ``StableCascadeUNet``; no image
    conditioning (``image_encoder`` / ``feature_extractor`` are optional and left out, as in diffusers' test)."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _clip_tokenizer()
    prior = partial(
        StableCascadeUNet,
        in_channels=STAGE_C_CHANNELS,
        out_channels=STAGE_C_CHANNELS,
        conditioning_dim=32,
        block_out_channels=(32, 32),
        num_attention_heads=(2, 2),
        down_num_layers_per_block=(1, 1),
        up_num_layers_per_block=(1, 1),
        switch_level=(False,),
        clip_image_in_channels=EMBED_DIM,
        clip_text_in_channels=EMBED_DIM,
        clip_text_pooled_in_channels=EMBED_DIM,
        dropout=(0.1, 0.1),
    )
    return StableCascadePriorPipeline(
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _clip_encoder(CLIPTextModelWithProjection, tokenizer)),
        prior=build("prior", _with_trained_zero_convs(prior)),
        scheduler=DDPMWuerstchenScheduler(),
        feature_extractor=None,
        image_encoder=None,
    )


# --------------------------------------------------------------------------- families: UNet decoders


def make_kandinsky22(seed: int = 0) -> KandinskyV22Pipeline:
    """Kandinsky 2.2 decoder: image-embedding-conditioned UNet (learned variance), MoVQ decoder."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    unet = partial(
        UNet2DConditionModel,
        in_channels=4,
        out_channels=8,  # mean and variance
        addition_embed_type="image",
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn",
        block_out_channels=(32, 64),
        layers_per_block=1,
        encoder_hid_dim=EMBED_DIM,
        encoder_hid_dim_type="image_proj",
        cross_attention_dim=EMBED_DIM,
        attention_head_dim=4,
        resnet_time_scale_shift="scale_shift",
        class_embed_type=None,
    )
    return KandinskyV22Pipeline(
        unet=build("unet", unet),
        scheduler=DDIMScheduler(
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
        movq=build("movq", _movq()),
    )


def make_kandinsky3(seed: int = 0) -> Kandinsky3Pipeline:
    """Kandinsky 3: T5 encoder (context cut to the prompt), ``Kandinsky3UNet`` with attention pooling, MoVQ."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _t5_tokenizer()
    unet = partial(
        Kandinsky3UNet,
        in_channels=4,
        time_embedding_dim=4,
        groups=2,
        attention_head_dim=4,
        layers_per_block=3,
        block_out_channels=(32, 64),
        cross_attention_dim=4,
        encoder_hid_dim=32,  # T5 d_model
    )
    return Kandinsky3Pipeline(
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _t5_encoder(T5EncoderModel, T5Config, tokenizer)),
        unet=build("unet", _with_trained_zero_convs(unet)),  # the attention pooling's output layer starts at zero
        scheduler=DDPMScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            steps_offset=1,
            beta_schedule="squaredcos_cap_v2",
            clip_sample=True,
            thresholding=False,
        ),
        movq=build("movq", _movq()),
    )


def _stable_unclip_denoiser(build) -> dict:
    """Components shared by the two Stable unCLIP pipelines: noised image embeddings as the UNet's class labels."""
    tokenizer = _clip_tokenizer()
    return dict(
        image_normalizer=build("image_normalizer", _image_normalizer()),
        image_noising_scheduler=DDPMScheduler(beta_schedule="squaredcos_cap_v2"),
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _clip_encoder(CLIPTextModel, tokenizer)),
        unet=build(
            "unet",
            _unet(
                class_embed_type="projection",
                projection_class_embeddings_input_dim=2 * EMBED_DIM,  # the embedding and its noise level's
                upcast_attention=True,
                use_linear_projection=True,
            ),
        ),
        scheduler=_sd_scheduler(DDIMScheduler, prediction_type="v_prediction", set_alpha_to_one=False),
        vae=build("vae", _sd_vae()),
    )


def make_stable_unclip(seed: int = 0) -> StableUnCLIPPipeline:
    """Stable unCLIP (text-to-image): a CLIP-with-projection text encoder and a prior make the image embedding,
    which is normalised, noised and fed to an SD 2.1-style UNet as class embedding."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    prior_tokenizer = _clip_tokenizer()
    return StableUnCLIPPipeline(
        prior_tokenizer=prior_tokenizer,
        prior_text_encoder=build("prior_text_encoder", _clip_encoder(CLIPTextModelWithProjection, prior_tokenizer)),
        prior=build("prior", _unclip_prior()),
        prior_scheduler=DDPMScheduler(
            variance_type="fixed_small_log",
            prediction_type="sample",
            num_train_timesteps=1000,
            clip_sample=True,
            clip_sample_range=5.0,
            beta_schedule="squaredcos_cap_v2",
        ),
        **_stable_unclip_denoiser(build),
    )


def make_stable_unclip_img2img(seed: int = 0) -> StableUnCLIPImg2ImgPipeline:
    """Stable unCLIP image variation: the CLIP vision encoder embeds the input image, the rest as ``stable_unclip``."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    return StableUnCLIPImg2ImgPipeline(
        feature_extractor=_clip_image_processor(IMAGE_SIZE),
        image_encoder=build("image_encoder", _image_encoder()),
        **_stable_unclip_denoiser(build),
    )


# --------------------------------------------------------------------------- families: cascade decoders


def make_wuerstchen_decoder(seed: int = 0) -> WuerstchenDecoderPipeline:
    """Würstchen stage B: ``WuerstchenDiffNeXt`` conditioned on the CLIP text and the stage C embeddings
    (injected at its second level, as the real model does from its second level on), Paella VQ stage A."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _clip_tokenizer()
    decoder = partial(
        WuerstchenDiffNeXt,
        c_in=4,
        c_out=4,
        c_cond=EMBED_DIM,
        c_hidden=[16, 32],
        nhead=[-1, 2],
        blocks=[1, 1],
        level_config=["CT", "CTA"],
        inject_effnet=[False, True],
        effnet_embd=STAGE_C_CHANNELS,
        clip_embd=EMBED_DIM,
    )
    return WuerstchenDecoderPipeline(
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _clip_encoder(CLIPTextModel, tokenizer)),
        # ``WuerstchenDiffNeXt._init_weights`` runs once per submodule (``self.apply``) and scales every
        # ``ResBlockStageB``'s last ``channelwise`` layer by ``sqrt(1 / sum(blocks))`` each time: a fresh model's
        # are about 1e-15, so its residual blocks -- and the stage C embeddings they inject -- would have no
        # influence.  Those are filled like the zero-initialised parameters.
        decoder=build("decoder", _with_trained_zero_convs(decoder, below=1e-6)),
        scheduler=DDPMWuerstchenScheduler(),
        vqgan=build("vqgan", _paella_vq()),
        latent_dim_scale=4.0,
    )


def make_stable_cascade_decoder(seed: int = 0) -> StableCascadeDecoderPipeline:
    """Stable Cascade stage B: ``StableCascadeUNet`` with effnet (stage C) and pixel mappers, up blocks run
    twice per call (repeat mappers), pooled CLIP text conditioning; Paella VQ stage A."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _clip_tokenizer()
    decoder = partial(
        StableCascadeUNet,
        in_channels=4,
        out_channels=4,
        conditioning_dim=32,
        block_out_channels=(16, 32),
        num_attention_heads=(-1, 2),
        down_num_layers_per_block=(1, 1),
        up_num_layers_per_block=(1, 1),
        down_blocks_repeat_mappers=(1, 1),
        up_blocks_repeat_mappers=(2, 2),
        block_types_per_layer=(
            ("SDCascadeResBlock", "SDCascadeTimestepBlock"),
            ("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"),
        ),
        switch_level=None,
        clip_text_pooled_in_channels=EMBED_DIM,
        effnet_in_channels=STAGE_C_CHANNELS,
        pixel_mapper_in_channels=3,
        dropout=(0.1, 0.1),
    )
    return StableCascadeDecoderPipeline(
        decoder=build("decoder", _with_trained_zero_convs(decoder)),
        tokenizer=tokenizer,
        text_encoder=build("text_encoder", _clip_encoder(CLIPTextModelWithProjection, tokenizer)),
        scheduler=DDPMWuerstchenScheduler(),
        vqgan=build("vqgan", _paella_vq()),
        latent_dim_scale=4.0,
    )


# --------------------------------------------------------------------------- families: 3D


def make_shap_e(seed: int = 0) -> ShapEPipeline:
    """Shap-E text-to-3D: CLIP projection -> PriorTransformer over 32 latent tokens -> NeRF renderer (the latents
    are projected into the renderer's MLP weights, then 20 views are ray-marched)."""
    build = partial(_component, seed=seed, dtype=torch.float32)
    tokenizer = _clip_tokenizer()
    width, renderer_width = 16, 8
    return ShapEPipeline(
        prior=build(
            "prior",
            _prior_transformer(
                num_attention_heads=2,
                attention_head_dim=16,
                embedding_dim=width,
                num_embeddings=32,
                embedding_proj_dim=width,  # CLIP projection
                time_embed_dim=4 * width,
                num_layers=1,
                clip_embed_dim=2 * width,  # mean and variance
                additional_embeddings=0,
                time_embed_act_fn="gelu",
                norm_in_type="layer",
                encoder_hid_proj_type=None,
                added_emb_type=None,
            ),
        ),
        text_encoder=build("text_encoder", _clip_encoder(CLIPTextModelWithProjection, tokenizer, hidden_size=width)),
        tokenizer=tokenizer,
        shap_e_renderer=build(
            "shap_e_renderer",
            lambda: _ShapERenderer(
                param_shapes=((renderer_width, 93), *((renderer_width, renderer_width),) * 3),
                d_latent=width,
                d_hidden=renderer_width,
                n_output=12,
                background=(0.1, 0.1, 0.1),
            ),
        ),
        scheduler=HeunDiscreteScheduler(
            beta_schedule="exp",
            num_train_timesteps=1024,
            prediction_type="sample",
            use_karras_sigmas=True,
            clip_sample=True,
            clip_sample_range=1.0,
        ),
    )


FAMILIES: dict[str, Callable[..., DiffusionPipeline]] = {
    "kandinsky22_prior": make_kandinsky22_prior,
    "kandinsky22": make_kandinsky22,
    "kandinsky3": make_kandinsky3,
    "stable_unclip": make_stable_unclip,
    "stable_unclip_img2img": make_stable_unclip_img2img,
    "wuerstchen_prior": make_wuerstchen_prior,
    "wuerstchen_decoder": make_wuerstchen_decoder,
    "stable_cascade_prior": make_stable_cascade_prior,
    "stable_cascade_decoder": make_stable_cascade_decoder,
    "shap_e": make_shap_e,
}

KINDS: dict[str, str] = {
    "kandinsky22_prior": "prior",
    "kandinsky22": "unet",
    "kandinsky3": "unet",
    "stable_unclip": "prior",
    "stable_unclip_img2img": "unet",
    "wuerstchen_prior": "prior",
    "wuerstchen_decoder": "cascade",
    "stable_cascade_prior": "prior",
    "stable_cascade_decoder": "cascade",
    "shap_e": "3d",
}

_STEPS = dict(num_inference_steps=2)
_IMAGE = dict(_STEPS, height=16, width=16, output_type="pt")

_CALL_KWARGS: dict[str, dict] = {
    # No negative prompt: the negative embedding then is the image encoder's (see the module docstring).
    "kandinsky22_prior": dict(_STEPS, prompt=PROMPT, guidance_scale=4.0, output_type="pt"),
    "kandinsky22": dict(_IMAGE, guidance_scale=4.0),
    "kandinsky3": dict(_IMAGE, prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, guidance_scale=3.0),
    # noise_level > 0, or the normalizer's statistics would cancel out (scale, no noise, unscale).
    "stable_unclip": dict(
        _IMAGE,
        prompt=PROMPT,
        negative_prompt=NEGATIVE_PROMPT,
        guidance_scale=10.0,
        prior_num_inference_steps=2,
        prior_guidance_scale=4.0,
        noise_level=100,
    ),
    "stable_unclip_img2img": dict(
        _IMAGE, prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, guidance_scale=10.0, noise_level=100
    ),
    # 256 px: a 6 x 6 stage C latent (resolution_multiple 42.67).
    "wuerstchen_prior": dict(
        _STEPS,
        prompt=PROMPT,
        negative_prompt=NEGATIVE_PROMPT,
        height=256,
        width=256,
        guidance_scale=4.0,
        output_type="pt",
    ),
    "wuerstchen_decoder": dict(
        _STEPS, prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, guidance_scale=2.0, output_type="pt"
    ),
    "stable_cascade_prior": dict(
        _STEPS,
        prompt=PROMPT,
        negative_prompt=NEGATIVE_PROMPT,
        height=256,
        width=256,
        guidance_scale=4.0,
        output_type="pt",
    ),
    "stable_cascade_decoder": dict(
        _STEPS, prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, guidance_scale=2.0, output_type="pt"
    ),
    "shap_e": dict(_STEPS, prompt=PROMPT, guidance_scale=4.0, frame_size=16, output_type="np"),
}


# --------------------------------------------------------------------------- API


def make(family: str, seed: int = 0) -> DiffusionPipeline:
    """A fresh pipeline of ``family``; all components in eval mode, on CPU, in float32."""
    pipe = FAMILIES[family](seed=seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_kwargs(family: str, seed: int = 0) -> dict:
    """Keyword arguments (a fresh dict, without ``generator``) for one small, fast call of ``family``.

    Inputs that stand for an earlier stage's output (Kandinsky's image embeddings, the cascades' stage C
    embeddings) and Stable unCLIP's input image are fixed random values derived from ``seed``, like the call's
    generator, so each call seed gets different ones.
    """
    kwargs = dict(_CALL_KWARGS[family])
    if family == "kandinsky22":
        generator = _call_generator(seed, "image_embeds")
        kwargs["image_embeds"] = torch.randn(1, EMBED_DIM, generator=generator)
        kwargs["negative_image_embeds"] = torch.randn(1, EMBED_DIM, generator=generator)
    elif family in ("wuerstchen_decoder", "stable_cascade_decoder"):
        generator = _call_generator(seed, "image_embeddings")
        # 2 x 2 stage C -> 8 x 8 stage B latents (latent_dim_scale 4) -> 32 x 32 images
        kwargs["image_embeddings"] = torch.randn(1, STAGE_C_CHANNELS, 2, 2, generator=generator)
    elif family == "stable_unclip_img2img":
        generator = _call_generator(seed, "image")
        pixels = torch.randint(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=torch.uint8, generator=generator)
        kwargs["image"] = PIL.Image.fromarray(pixels.numpy())
    return kwargs


#: The output fields ``run`` returns (concatenated), by family: images unless said otherwise.
_OUTPUTS: dict[str, tuple[str, ...]] = {
    "kandinsky22_prior": ("image_embeds", "negative_image_embeds"),
    "wuerstchen_prior": ("image_embeddings",),
    "stable_cascade_prior": ("image_embeddings",),
}


def run(pipe: DiffusionPipeline, family: str, seed: int = 0) -> torch.Tensor:
    """Call ``pipe`` once with a CPU generator seeded with ``seed``: the images, rendered frames or image
    embeddings (``kandinsky22_prior``: positive then negative embeddings), as a float32 tensor on CPU.

    (The output object's fields are read by name: with ``return_dict=False`` the cascade decoders return the
    images themselves, not a tuple.)
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    output = pipe(**call_kwargs(family, seed), generator=generator)
    tensors = [torch.as_tensor(getattr(output, name)) for name in _OUTPUTS.get(family, ("images",))]
    return torch.cat(tensors).detach().to(device="cpu", dtype=torch.float32)
