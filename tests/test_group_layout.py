"""How a model is cut into groups (``memmode_core.contracts.group_specs``), and what the cut must get right on the
shapes real checkpoints have: block lists wherever they are (two containers deep, in the encoder and decoder of a
VAE without ``quant_conv``, as every Flux-family VAE is), block modules the user names, weights tied between
modules of different groups, and models that declare ``_supports_group_offloading = False`` (DiT, VQModel),
which move whole.

Each case is built from a tiny model of that shape and checked under the storages where storage matters: ``ram``
(zero-copy on a CPU device), ``poison`` (NaN placeholders at rest: a weight used without being onloaded turns the
output into NaN), ``disk`` (placeholders at rest, files) and ``mmap`` (a read-only mapping at rest). Lossless modes
are compared bit for bit with the same model without memmode, and ``remove()`` must hand back exactly the weights
the model had.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import DiTTransformer2DModel, FluxPipeline, VQModel

import memmode_core as memmode
from helpers import (
    STORAGES,
    assert_bit_equal,
    assert_same_tensors,
    hook_count,
    placement_id,
    snapshot,
    tensors_of,
)
from memmode_core import IncompatibleModeError, InvalidOptionError
from memmode_core.contracts.group_specs import block_groups
from tiny_components import blocks, configured, kl_vae, seeded
from tiny_dit_pipelines import DIT_TRANSFORMER
from tiny_models import TIED_MODELS, make_tied, token_ids
from tiny_pipelines import make_pipeline, run

#: the placements that cut a model into several groups
SPLITTING = [
    ("model_group_offload", {"offload_type": "block_level"}),
    ("model_group_offload", {"offload_type": "leaf_level"}),
    ("model_group_offload", {"num_blocks_per_group": 2}),
    ("sequential_cpu_offload", {}),
]
WHOLE = [("model_cpu_offload", {})]

pytestmark = pytest.mark.usefixtures("poison_storage", "private_tmp")


# -- block lists and block modules ------------------------------------------------------------------------


def test_block_groups_find_nested_block_lists_and_block_modules():
    pipe = make_pipeline("flux")
    keys = [g.key for g in block_groups("text_encoder", pipe.text_encoder)]
    assert keys[0] == "text_encoder/<rest>"
    assert "text_encoder/encoder.layers.0" in keys and "text_encoder/encoder.layers.1" in keys
    vae_keys = [g.key for g in block_groups("vae", pipe.vae, block_modules=["encoder", "decoder"])]
    assert "vae/decoder" in vae_keys and "vae/decoder.up_blocks.0" in vae_keys and "vae/encoder" in vae_keys
    chunked = [g.key for g in block_groups("transformer", pipe.transformer, num_blocks_per_group=2)]
    assert "transformer/transformer_blocks.0-1" in chunked and "transformer/single_transformer_blocks.0-1" in chunked


def flux_with_real_vae(seed: int = 0) -> FluxPipeline:
    """The suite's tiny Flux pipeline with its VAE built as the real FLUX.1 VAE is: no quant convs."""
    pipe = make_pipeline("flux", seed)
    vae_without_quant_conv = kl_vae(4, scaling_factor=1.5035, shift_factor=0.0609, quant_conv=False, sample_size=16)
    vae = seeded(vae_without_quant_conv.factory, seed + 7)
    assert vae.quant_conv is None and vae.post_quant_conv is None
    return FluxPipeline(**{**pipe.components, "vae": vae})


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("quantized", [False, True], ids=["lossless", "qint8"])
def test_block_level_accepts_a_vae_without_quant_conv(storage, quantized, qint8):
    mode = "model_group_offload_and_qint8" if quantized else "model_group_offload"
    reference = flux_with_real_vae()
    if quantized:
        memmode.apply(reference, "model_full_load_and_qint8", device="cpu")
    expected = run(reference, "flux", 0)
    pipe = flux_with_real_vae()
    before = tensors_of(pipe.vae)
    handle = memmode.apply(pipe, mode, device="cpu", storage=storage)
    assert any(g.key.startswith("vae/decoder") for g in handle.runtime.groups)
    assert_bit_equal(run(pipe, "flux", 0), expected)
    handle.remove()
    assert_same_tensors(tensors_of(pipe.vae), before)


def test_a_block_module_the_user_names_must_exist():
    pipe = flux_with_real_vae()
    with pytest.raises(InvalidOptionError, match="quant_conv"):
        memmode.apply(pipe, "model_group_offload", device="cpu", block_modules=["encoder", "quant_conv"])
    assert hook_count(pipe) == 0


# -- tied weights, blocks two containers deep -----------------------------------------------------------


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("placement", SPLITTING + WHOLE, ids=placement_id)
@pytest.mark.parametrize("model", sorted(TIED_MODELS))
def test_tied_weights_are_onloaded_for_every_module_that_reads_them(model, placement, storage):
    mode, options = placement
    expected = make_tied(model)(token_ids())
    target = make_tied(model)
    before = tensors_of(target)
    handle = memmode.apply(target, mode, device="cpu", storage=storage, **options)
    with torch.no_grad():
        for _ in range(2):
            assert_bit_equal(target(token_ids()), expected.detach())
    handle.remove()
    assert target.tied(), "the tie must survive apply and remove"
    assert_same_tensors(tensors_of(target), before)


def test_blocks_nested_two_containers_deep_are_the_called_modules():
    target = make_tied("nested_tied")
    handle = memmode.apply(target, "model_group_offload", device="cpu", storage="poison")
    keys = [g.key for g in handle.runtime.groups]
    assert keys == ["module/<rest>", "module/stages.0.0", "module/stages.0.1", "module/stages.1.0", "module/stages.1.1"]
    handle.remove()


# -- models that declare _supports_group_offloading = False --------------------------------------------


def tiny_dit() -> DiTTransformer2DModel:
    return seeded(configured(DiTTransformer2DModel, DIT_TRANSFORMER, {"norm_num_groups": 4, "num_embeds_ada_norm": 10}))


def dit_inputs():
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(1, 4, 8, 8, generator=g),
        timestep=torch.tensor([3]),
        class_labels=torch.tensor([1]),
        return_dict=False,
    )


def tiny_vq() -> VQModel:
    config = {
        "block_out_channels": (8, 16),
        "norm_num_groups": 4,
        "in_channels": 3,
        "out_channels": 3,
        **blocks(*["DownEncoderBlock2D"] * 2),
        "latent_channels": 3,
        "num_vq_embeddings": 16,
        "vq_embed_dim": 3,
    }
    return seeded(configured(VQModel, config))


def vq_inputs():
    return (torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0)),)


UNSPLITTABLE = {"dit": (tiny_dit, lambda m: m(**dit_inputs())[0]), "vq": (tiny_vq, lambda m: m(*vq_inputs()).sample)}


@pytest.mark.parametrize("placement", SPLITTING, ids=placement_id)
@pytest.mark.parametrize("model", sorted(UNSPLITTABLE))
def test_models_that_do_not_support_group_offloading_move_whole_under_splitting_placements(model, placement):
    """Refused untouched with ``strict=True``; otherwise one group for the whole model, onloaded for its call
    and offloaded after, with the same output and a note saying why."""
    make, call = UNSPLITTABLE[model]
    target = make()
    assert type(target)._supports_group_offloading is False
    before = snapshot(target)
    mode, options = placement
    with pytest.raises(IncompatibleModeError, match="_supports_group_offloading = False"):
        memmode.apply(target, mode, device="cpu", storage="disk", strict=True, **options)
    assert snapshot(target) == before
    with torch.no_grad():
        expected = call(make())
        handle = memmode.apply(target, mode, device="cpu", storage="disk", **options)
        assert_bit_equal(call(target), expected)
    report = handle.report()
    assert "moved whole" in report.placement_notes["module"] and report.resident_device_bytes == 0
    assert report.onloads == 1, "one group, onloaded once for the call"
    handle.remove()
    assert_same_tensors(tensors_of(target), tensors_of(make()))
    planned = {e.mode: e for e in memmode.plan(target, device="cpu")}
    assert planned[mode].peak_device_bytes == planned["model_cpu_offload"].peak_device_bytes


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("model", sorted(UNSPLITTABLE))
def test_models_that_do_not_support_group_offloading_move_whole(model, storage):
    make, call = UNSPLITTABLE[model]
    with torch.no_grad():
        expected = call(make())
        target = make()
        before = tensors_of(target)
        handle = memmode.apply(target, "model_cpu_offload", device="cpu", storage=storage)
        assert_bit_equal(call(target), expected)
        handle.remove()
    assert_same_tensors(tensors_of(target), before)


def test_a_pipeline_with_such_a_component_streams_the_rest_around_it():
    """The other components stream as asked; strict=True refuses, and unplaced leaves it out."""
    pipe = make_pipeline("flux")
    pipe.vae._supports_group_offloading = False  # as Stable Audio's Oobleck VAE declares
    with pytest.raises(IncompatibleModeError, match="unplaced=\\['vae'\\]"):
        memmode.apply(pipe, "model_group_offload", device="cpu", strict=True)
    expected = run(make_pipeline("flux"), "flux", 0)
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="poison")
    assert list(handle.report().placement_notes) == ["vae"]
    assert len([g for g in handle.runtime.groups if g.component == "transformer"]) > 1, "the rest still streams"
    assert_bit_equal(run(pipe, "flux", 0), expected)
    handle.remove()
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="poison", unplaced=["vae"])
    assert_bit_equal(run(pipe, "flux", 0), expected)
    handle.remove()
