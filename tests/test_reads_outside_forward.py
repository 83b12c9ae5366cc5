"""Every read of an offloaded tensor sees real weights, whichever method reads it, and nothing computed from a
placeholder ever becomes a weight.

The models here are the shapes diffusers' prior, unCLIP and ACE-Step pipelines have, written small: a prior
whose ``post_process_latents`` reads latent statistics after the denoising loop (kept in a submodule that is
never called, so no forward of its own onloads them), and whose null embedding the pipeline reads itself
(ACE-Step's ``condition_encoder.null_condition_emb``); and an image normalizer with no forward at all, whose
``scale``/``unscale`` read ``mean``/``std`` and whose ``to()`` override builds new parameters from the values it
holds at that moment (``StableUnCLIPImageNormalizer``). The pipeline declares no ``_exclude_from_cpu_offload``,
so what makes them work is memmode's general rules, under every placement and storage: every method of a
component's own classes enters it (``memmode_core.engine.forwards.entry_methods``); a module that is never
called rests with the group of the nearest module that is; a component's own loose parameters, like its
buffers, keep real values at rest. ``poison`` runs inside the placeholder trap, so any placeholder reaching any
computation fails.
Then: what happens without the rule (a typed error, never NaN, never a lost weight), ``_apply`` making new
parameters from placeholders (``module.to(dtype)`` with PyTorch's swap and overwrite conversions), the
placeholder trap itself, and the pipeline's ``_exclude_from_cpu_offload`` honoured.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import DiffusionPipeline, ModelMixin
from diffusers.configuration_utils import ConfigMixin, register_to_config
from torch import nn

import memmode_core as memmode
from helpers import (
    ACCELERATOR,
    OFFLOADING_PLACEMENTS,
    STORAGES,
    assert_same_tensors,
    nbytes,
    on_accelerator,
    placement_id,
    state_of,
    tensors_of,
)
from memmode_core import OffloadedWeightReadError, StandInReadError
from memmode_core.engine import forwards
from memmode_core.engine.standins.placeholders import PlaceholderTrap
from tiny_models import ReadsOutsideForward

WIDTH = 8
PLACEMENTS = [p for p in OFFLOADING_PLACEMENTS if p[0] != "text_encoder_offload"]


class LatentStats(nn.Module):
    """Statistics a parent reads: a module that holds tensors and is never called."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.clip_mean = nn.Parameter(torch.randn(1, width))
        self.clip_std = nn.Parameter(torch.rand(1, width) + 0.5)


class StatsPrior(ModelMixin, ConfigMixin):
    """A prior: blocks that denoise, statistics that only ``post_process_latents`` reads, and a null embedding
    the pipeline reads itself."""

    @register_to_config
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.proj_in = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.stats = LatentStats(width)
        self.null_embedding = nn.Parameter(torch.randn(1, width))

    def forward(self, hidden_states: torch.Tensor, timestep: int) -> torch.Tensor:
        x = self.proj_in(hidden_states) + 0.1 * timestep
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x

    def post_process_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return latents * self.stats.clip_std + self.stats.clip_mean


class Normalizer(ModelMixin, ConfigMixin):
    """``StableUnCLIPImageNormalizer``'s shape: no forward, and a ``to()`` that makes new parameters."""

    @register_to_config
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.mean = nn.Parameter(torch.randn(1, width))
        self.std = nn.Parameter(torch.rand(1, width) + 0.5)

    def to(self, torch_device=None, torch_dtype=None):
        self.mean = nn.Parameter(self.mean.to(torch_device).to(torch_dtype))
        self.std = nn.Parameter(self.std.to(torch_device).to(torch_dtype))
        return self

    def scale(self, embeds: torch.Tensor) -> torch.Tensor:
        return (embeds - self.mean) / self.std

    def unscale(self, embeds: torch.Tensor) -> torch.Tensor:
        return embeds * self.std + self.mean


class PriorPipeline(DiffusionPipeline):
    model_cpu_offload_seq = "prior"

    def __init__(self, prior: StatsPrior, normalizer: Normalizer) -> None:
        super().__init__()
        self.register_modules(prior=prior, normalizer=normalizer)

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        for step in range(2):
            guide = self.prior.null_embedding.to(latents.dtype)  # read by the pipeline, as ACE-Step does
            latents = latents + self.prior(latents, step) - 0.1 * guide
        latents = self.prior.post_process_latents(latents)
        self.normalizer.to(latents.device, latents.dtype)  # as StableUnCLIP's noise_image_embeddings does
        latents = self.normalizer.unscale(self.normalizer.scale(latents) * 1.5)
        self.maybe_free_model_hooks()
        return latents


class DeclaringPriorPipeline(PriorPipeline):
    _exclude_from_cpu_offload = ["prior", "normalizer"]


def build(cls=PriorPipeline):
    torch.manual_seed(0)
    return cls(StatsPrior().eval(), Normalizer().eval())


def latents() -> torch.Tensor:
    return torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(1))


pytestmark = pytest.mark.usefixtures("poison_storage", "private_tmp")


def reference() -> torch.Tensor:
    with torch.no_grad():
        return build()(latents())


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("placement", PLACEMENTS, ids=placement_id)
def test_methods_other_than_forward_see_real_weights(placement, storage):
    mode, options = placement
    expected = reference()
    pipe = build()
    before = state_of(pipe)
    handle = memmode.apply(pipe, mode, device="cpu", storage=storage, **options)
    assert handle.report().placement_notes == {}, "nothing declared: the general rule does it"
    with torch.no_grad(), PlaceholderTrap():
        for _ in range(2):  # the second call runs on the parameters the first call's to() made
            got = pipe(latents())
            assert torch.isfinite(got).all() and torch.equal(got, expected)
    assert handle.report().resident_device_bytes == 0
    handle.remove()
    assert_same_tensors(state_of(pipe), before)


def test_a_module_that_is_never_called_rests_with_its_caller_and_own_parameters_stay_readable():
    pipe = build()
    handle = memmode.apply(pipe, "sequential_cpu_offload", device="cpu", storage="disk")
    groups = {g.key: g for g in handle.runtime.groups}
    root = groups["prior/<root>"]
    assert {s.name for s in root.slots} == {"prior.null_embedding", "prior.stats.clip_mean", "prior.stats.clip_std"}
    assert root.readable == {"prior.null_embedding"}, "the root's own parameter; the statistics wait on disk"
    assert "prior/stats" not in groups
    assert groups["normalizer/<root>"].readable == frozenset(), "a component without submodules is entered whole"
    handle.remove()


def test_entry_methods_are_the_model_classes_own_methods():
    assert forwards.entry_methods(StatsPrior()) == ["post_process_latents"]
    assert forwards.entry_methods(Normalizer()) == ["to", "scale", "unscale"]
    from diffusers import AutoencoderKL

    methods = forwards.entry_methods(AutoencoderKL(block_out_channels=(4,), norm_num_groups=2))
    assert {"encode", "decode", "tiled_decode"} <= set(methods)
    assert not {"save_pretrained", "enable_group_offload", "state_dict", "fuse_qkv_projections"} & set(methods)


@pytest.mark.parametrize("storage", ["poison", "disk"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=placement_id)
def test_without_the_rule_a_read_is_served_and_counted_or_refused_under_strict(placement, storage, monkeypatch):
    """What the rule saves, shown by taking it away (only encode/decode enter a component, as before): the
    prior's statistics rest as placeholders during post-processing, and the normalizer's ``to()`` builds new
    parameters from what its parameters hold. Both still get the real values (served from the storage,
    counted in the report) and the pipeline computes what it computes unplaced; ``strict=True`` refuses the
    same read with a typed error naming the tensor and the line that read it; ``remove()`` gives every weight
    back."""
    mode, options = placement
    monkeypatch.setattr(
        forwards,
        "entry_methods",
        lambda module: [m for m in forwards.COMPONENT_METHODS if callable(getattr(type(module), m, None))],
    )
    expected = reference()
    for strict in (False, True):
        pipe = build()
        before = state_of(pipe)
        handle = memmode.apply(pipe, mode, device="cpu", storage=storage, strict=strict, **options)
        with torch.no_grad():
            x = latents()
            for step in range(2):
                x = x + pipe.prior(x, step) - 0.1 * pipe.prior.null_embedding
            if strict and mode != "model_cpu_offload":  # model_cpu_offload keeps the prior on the device
                with pytest.raises(
                    StandInReadError, match=r"prior\.stats\.clip_(std|mean).*test_reads_outside_forward"
                ):
                    pipe.prior.post_process_latents(x)
            elif not strict:
                served = handle.report().reads_served
                x = pipe.prior.post_process_latents(x)
                pipe.normalizer.to("cpu", torch.float32)
                x = pipe.normalizer.unscale(pipe.normalizer.scale(x) * 1.5)
                assert torch.equal(x, expected)
                if mode != "model_cpu_offload":
                    assert handle.report().reads_served > served, "served reads are counted"
                    assert set(handle.report().served) >= {"prior.stats.clip_std", "prior.stats.clip_mean"}
        handle.remove()
        assert_same_tensors(state_of(pipe), before)


class LeafReader(nn.Module):
    """Reads a leaf's weight from the root's forward: at leaf level that leaf's group is not onloaded then."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.second(self.first(x)) * self.second.weight.sum()


@pytest.mark.parametrize("storage", ["poison", "disk"])
def test_a_parent_reading_a_resting_leaf_onloads_it_and_enters_it_from_then_on(storage):
    """The root reads ``second.weight`` before ``second`` runs: the read onloads ``second``'s group into the call
    (counted once), the root is learned as an entry of that group, and from the second call on the group is
    onloaded before the root's forward, so nothing is served any more. The outputs are the unplaced model's."""
    torch.manual_seed(0)
    model = LeafReader()
    with torch.no_grad():
        expected = model(latents())
    handle = memmode.apply(model, "sequential_cpu_offload", device="cpu", storage=storage)
    with torch.no_grad():
        assert torch.equal(model(latents()), expected)
        assert handle.report().served == {"module.second.weight": 1}
        assert torch.equal(model(latents()), expected)
    assert handle.report().served == {"module.second.weight": 1}, "learned: the second call serves nothing"
    group = next(g for g in handle.runtime.groups if g.key == "module/second")
    assert model in group.entries and model in group.exits
    assert handle.report().resident_device_bytes == 0
    handle.remove()
    strict = memmode.apply(model, "sequential_cpu_offload", device="cpu", storage=storage, strict=True)
    with pytest.raises(
        StandInReadError, match=r"module\.second\.weight .*test_reads_outside_forward\.py:\d+ in forward"
    ):
        model(latents())
    strict.remove()


class Overflows(nn.Module):
    """Non-finite for its own reasons (no placeholder involved): returned as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.layer(x) * float("inf")


def test_a_model_that_is_non_finite_by_itself_is_returned_unchanged():
    model = Overflows()
    handle = memmode.apply(model, "sequential_cpu_offload", device="cpu", storage="disk")
    assert not torch.isfinite(model(latents())).any()
    handle.remove()


def test_metadata_is_free_a_value_read_is_served_and_the_trap_names_a_raw_placeholder():
    """Shape, dtype and ``zeros_like`` of a resting weight read nothing; its values are the real ones, counted;
    what the placeholder trap still catches is a raw placeholder (one taken out of a stand-in's machinery)."""
    unplaced = build()
    pipe = build()
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="disk", offload_type="leaf_level")
    weight = pipe.prior.proj_in.weight
    with PlaceholderTrap():
        assert weight.shape == (WIDTH, WIDTH) and weight.dtype == torch.float32
        torch.zeros_like(weight)
        assert handle.report().reads_served == 0, "metadata reads nothing"
        assert torch.equal(weight * 2, unplaced.prior.proj_in.weight * 2)
        assert handle.report().served == {"prior.proj_in.weight": 1}
        assert torch.isfinite(pipe.prior.null_embedding * 2).all(), "a component's own parameters stay readable"
        torch.ones(3).expand(2, 3) * 2  # a broadcast of the model's own is not a placeholder
        held = memmode.placeholder(torch.zeros(4, 4))
        with pytest.raises(OffloadedWeightReadError, match=r"\(4, 4\) float32 tensor"):
            held * 2
    handle.remove()


@pytest.mark.parametrize("conversion", ["swap", "overwrite"])
@pytest.mark.parametrize("storage", ["poison", "disk"])
def test_a_cast_that_makes_new_parameters_from_placeholders_keeps_the_weights(storage, conversion):
    """``module.to(dtype)`` while placed: PyTorch computes the new tensors from what the parameters hold (the
    placeholders), and with its swap or overwrite conversion registers new tensors. Neither the next call nor
    ``remove()`` lets those NaN values stand in for the weights."""
    future = torch.__future__
    setter = {
        "swap": future.set_swap_module_params_on_conversion,
        "overwrite": future.set_overwrite_module_params_on_conversion,
    }[conversion]
    getter = {
        "swap": future.get_swap_module_params_on_conversion,
        "overwrite": future.get_overwrite_module_params_on_conversion,
    }[conversion]
    was = getter()
    setter(True)
    try:
        expected_pipe = build()
        expected_pipe.prior.to(torch.float64)
        with torch.no_grad():
            expected = expected_pipe.prior(latents().double(), 1)
        for call_first in (True, False):
            pipe = build()
            handle = memmode.apply(
                pipe, "model_group_offload", device="cpu", storage=storage, offload_type="leaf_level"
            )
            pipe.prior.to(torch.float64)
            if call_first:
                with torch.no_grad():
                    assert torch.equal(pipe.prior(latents().double(), 1), expected)
            handle.remove()
            after = {n: t for n, t in state_of(pipe).items() if n.startswith("prior.")}
            assert_same_tensors(after, {n: t for n, t in state_of(expected_pipe).items() if n.startswith("prior.")})
    finally:
        setter(was)


@pytest.mark.parametrize("storage", ["poison", "disk"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=placement_id)
def test_the_pipelines_exclusions_are_kept_on_the_device_and_said(placement, storage):
    mode, options = placement
    expected = reference()
    pipe = build(DeclaringPriorPipeline)
    handle = memmode.apply(pipe, mode, device="cpu", storage=storage, **options)
    notes = handle.report().placement_notes
    assert set(notes) == {"prior", "normalizer"} and all("_exclude_from_cpu_offload" in n for n in notes.values())
    with torch.no_grad():
        assert torch.equal(pipe(latents()), expected)
    resident = handle.report().resident_device_bytes
    assert resident == nbytes(t for m in (pipe.prior, pipe.normalizer) for t in m.parameters())
    handle.remove()
    with pytest.raises(memmode.IncompatibleModeError, match="_exclude_from_cpu_offload"):
        memmode.apply(pipe, mode, device="cpu", storage=storage, strict=True, **options)


class Encoder(nn.Module):
    """A text encoder whose last norm a pipeline also calls itself (diffusers' clip_skip path)."""

    def __init__(self) -> None:
        super().__init__()
        self.text_model = nn.Sequential(nn.Linear(WIDTH, WIDTH))
        self.text_model.final_layer_norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.head(self.text_model.final_layer_norm(self.text_model(x)))


class SkippingPipeline(DiffusionPipeline):
    def __init__(self, text_encoder: Encoder) -> None:
        super().__init__()
        self.register_modules(text_encoder=text_encoder)

    def __call__(self, x):
        hidden = self.text_encoder(x)
        return self.text_encoder.text_model.final_layer_norm(hidden)  # a submodule called by the pipeline


@pytest.mark.parametrize("storage", ["poison", "disk"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=placement_id)
def test_a_submodule_the_pipeline_calls_itself_is_onloaded_for_that_call(placement, storage):
    mode, options = placement
    torch.manual_seed(0)
    pipe = SkippingPipeline(Encoder().eval())
    with torch.no_grad():
        expected = pipe(latents())
        handle = memmode.apply(pipe, mode, device="cpu", storage=storage, **options)
        with PlaceholderTrap():
            assert torch.equal(pipe(latents()), expected)
    assert handle.report().resident_device_bytes == 0
    handle.remove()


# -- reads nothing declares, on models the rules above do not reach ------------------------------------


class MismatchOnRead(nn.Module):
    """Raises what torch raises on CUDA when a CPU-resident (offloaded) weight meets device inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        x = self.blocks[0](x)
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"
        )


def test_a_device_mismatch_inside_a_placed_forward_is_a_clear_error():
    target = MismatchOnRead()
    before = tensors_of(target)
    handle = memmode.apply(target, "model_group_offload", device="cpu", storage="poison")
    with pytest.raises(OffloadedWeightReadError, match=r"module \(MismatchOnRead\).*blocks\.1") as info:
        target(torch.randn(1, 4))
    assert isinstance(info.value, RuntimeError) and "found at least two devices" in str(info.value)
    assert handle.runtime.ledger.resident == 0, "a failed call leaves nothing onloaded"
    handle.remove()
    assert_same_tensors(tensors_of(target), before)


@on_accelerator
@pytest.mark.parametrize("storage", STORAGES)
def test_an_undeclared_read_outside_forward_is_onloaded_on_the_accelerator(storage):
    """The model reads block 0's weight before block 0 runs. On the accelerator its resting copy is a host copy
    (or a placeholder), which the device cannot compute with: the read onloads block 0's group into the call
    instead of meeting a device mismatch, and the output is the unplaced model's."""
    torch.manual_seed(0)
    target = ReadsOutsideForward()
    before = tensors_of(target)
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = target(x)
    handle = memmode.apply(target, "model_group_offload", device=ACCELERATOR, storage=storage)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(target(x.to(ACCELERATOR)).cpu(), expected)
    assert handle.report().served == {"module.blocks.0.scale.weight": 1}
    handle.remove()
    assert_same_tensors(tensors_of(target), before)


@pytest.mark.parametrize("storage", ["poison", "disk"])
def test_an_undeclared_read_outside_forward_gets_the_weight_on_cpu(storage):
    """On a CPU the read of a resting placeholder is served: the output is the unplaced model's, never NaN."""
    torch.manual_seed(0)
    target = ReadsOutsideForward()
    before = tensors_of(target)
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = target(x)
    handle = memmode.apply(target, "model_group_offload", device="cpu", storage=storage)
    with torch.no_grad():
        assert torch.equal(target(x), expected)
    handle.remove()
    assert_same_tensors(tensors_of(target), before)
