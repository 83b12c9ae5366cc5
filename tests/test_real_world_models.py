"""Regressions from real checkpoints and real usage that the first release got wrong (issue 11).

Each case is built from a tiny model of the *shape* that broke, and checked under the storages where
storage matters: ``ram`` (zero-copy on a CPU device), ``poison`` (NaN placeholders at rest: a weight
used without being onloaded turns the output into NaN), ``disk`` (placeholders at rest, files) and
``mmap`` (a read-only mapping at rest). Lossless modes are compared bit for bit with the same model
without memmode, and ``remove()`` must hand back exactly the weights the model had.

1. A VAE without ``quant_conv`` (Flux-family VAEs, ``use_quant_conv=False``) under block level.
2. Tied weights read by a second module; blocks nested two containers deep.
3. Models that read weights outside their own forward: ``_supports_group_offloading = False``
   (DiT, VQModel) is honoured; the undeclared case becomes a clear error on a device mismatch.
4. Hooks installed after ``apply`` (diffusers' ``enable_layerwise_casting``) compose.
5. Foreign (accelerate) offloading on a bare module is refused before anything changes.
6. TorchScript targets are refused before anything changes.
7. A re-apply that fails half-way leaves the previous mode active.
8. ``exclude_components`` leaves named components where the user put them.
"""

from __future__ import annotations

import tempfile
from itertools import chain

import pytest
import torch
from conftest import requires_cuda
from diffusers import AutoencoderKL, DiTTransformer2DModel, FluxPipeline, FluxTransformer2DModel, VQModel
from fakes import Int8Plugin, PoisonPlugin, PoisonSession
from odd_models import TIED_MODELS, ReadsOutsideForward, make_tied, token_ids
from test_core_apply import hook_count, snapshot
from tiny_pipelines import make_pipeline, run
from torch import nn

import memmode_core as memmode
from memmode_core import (
    IncompatibleModeError,
    InvalidOptionError,
    OffloadedWeightReadError,
    Storage,
    StorageUnavailableError,
    hookimpl,
)

STORAGES = ["ram", "poison", "disk", "mmap"]
SPLITTING = [
    ("model_group_offload", {"offload_type": "block_level"}),
    ("model_group_offload", {"offload_type": "leaf_level"}),
    ("model_group_offload", {"num_blocks_per_group": 2}),
    ("sequential_cpu_offload", {}),
]
WHOLE = [("model_cpu_offload", {})]


def mode_id(placement) -> str:
    mode, options = placement
    return "-".join([mode, *(f"{k}={v}" for k, v in options.items())])


@pytest.fixture(autouse=True)
def test_plugins(monkeypatch, tmp_path):
    """The poison storage, and the file storages' private folders under this test's tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with memmode.temporary_plugin(PoisonPlugin(), name="poison", distribution="tests"):
        yield


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: t.detach().clone()
        for name, t in chain(
            module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)
        )
    }


def assert_same_state(module: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = state_of(module)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), f"{name} changed"


def assert_bit_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.isfinite(got).all(), "non-finite output: a placeholder reached a computation"
    assert torch.equal(got, expected)


# -- 1. a VAE without quant_conv (every Flux-family VAE) -------------------------------------------------


def flux_with_real_vae(seed: int = 0) -> FluxPipeline:
    """The suite's tiny Flux pipeline with its VAE built as the real FLUX.1 VAE is: no quant convs."""
    pipe = make_pipeline("flux", seed)
    torch.manual_seed(seed + 7)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
        shift_factor=0.0609,
        scaling_factor=1.5035,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()
    assert vae.quant_conv is None and vae.post_quant_conv is None
    return FluxPipeline(**{**pipe.components, "vae": vae})


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("quantized", [False, True], ids=["lossless", "qint8"])
def test_block_level_accepts_a_vae_without_quant_conv(storage, quantized):
    mode = "model_group_offload_and_qint8" if quantized else "model_group_offload"
    with memmode.temporary_plugin(Int8Plugin(), name="qint8", distribution="tests"):
        reference = flux_with_real_vae()
        if quantized:
            memmode.apply(reference, "model_full_load_and_qint8", device="cpu")
        expected = run(reference, "flux", 0)
        pipe = flux_with_real_vae()
        before = state_of(pipe.vae)
        handle = memmode.apply(pipe, mode, device="cpu", storage=storage)
        assert any(g.key.startswith("vae/decoder") for g in handle._runtime.groups)
        assert_bit_equal(run(pipe, "flux", 0), expected)
        handle.remove()
    assert_same_state(pipe.vae, before)


def test_a_block_module_the_user_names_must_exist():
    pipe = flux_with_real_vae()
    with pytest.raises(InvalidOptionError, match="quant_conv"):
        memmode.apply(pipe, "model_group_offload", device="cpu", block_modules=["encoder", "quant_conv"])
    assert hook_count(pipe) == 0


# -- 2. tied weights, blocks two containers deep -----------------------------------------------------------


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("placement", SPLITTING + WHOLE, ids=mode_id)
@pytest.mark.parametrize("model", sorted(TIED_MODELS))
def test_tied_weights_are_onloaded_for_every_module_that_reads_them(model, placement, storage):
    mode, options = placement
    expected = make_tied(model)(token_ids())
    target = make_tied(model)
    before = state_of(target)
    handle = memmode.apply(target, mode, device="cpu", storage=storage, **options)
    with torch.no_grad():
        for _ in range(2):
            assert_bit_equal(target(token_ids()), expected.detach())
    handle.remove()
    assert target.tied(), "the tie must survive apply and remove"
    assert_same_state(target, before)


def test_blocks_nested_two_containers_deep_are_the_called_modules():
    target = make_tied("nested_tied")
    handle = memmode.apply(target, "model_group_offload", device="cpu", storage="poison")
    keys = [g.key for g in handle._runtime.groups]
    assert keys == ["module/<rest>", "module/stages.0.0", "module/stages.0.1", "module/stages.1.0", "module/stages.1.1"]
    handle.remove()


# -- 3. weights read outside their module's forward ----------------------------------------------------


def tiny_dit() -> DiTTransformer2DModel:
    torch.manual_seed(0)
    return DiTTransformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        norm_num_groups=4,
        num_embeds_ada_norm=10,
    ).eval()


def dit_inputs():
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(1, 4, 8, 8, generator=g),
        timestep=torch.tensor([3]),
        class_labels=torch.tensor([1]),
        return_dict=False,
    )


def tiny_vq() -> VQModel:
    torch.manual_seed(0)
    return VQModel(
        block_out_channels=(8, 16),
        norm_num_groups=4,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=3,
        num_vq_embeddings=16,
        vq_embed_dim=3,
    ).eval()


def vq_inputs():
    return (torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0)),)


UNSPLITTABLE = {"dit": (tiny_dit, lambda m: m(**dit_inputs())[0]), "vq": (tiny_vq, lambda m: m(*vq_inputs()).sample)}


@pytest.mark.parametrize("placement", SPLITTING, ids=mode_id)
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
    assert_same_state(target, state_of(make()))
    planned = {e.mode: e for e in memmode.plan(target, device="cpu")}
    assert planned[mode].peak_device_bytes == planned["model_cpu_offload"].peak_device_bytes


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("model", sorted(UNSPLITTABLE))
def test_models_that_do_not_support_group_offloading_move_whole(model, storage):
    make, call = UNSPLITTABLE[model]
    with torch.no_grad():
        expected = call(make())
        target = make()
        before = state_of(target)
        handle = memmode.apply(target, "model_cpu_offload", device="cpu", storage=storage)
        assert_bit_equal(call(target), expected)
        handle.remove()
    assert_same_state(target, before)


def test_a_pipeline_with_such_a_component_streams_the_rest_around_it():
    """The other components stream as asked; strict=True refuses, and exclude_components leaves it out."""
    pipe = make_pipeline("flux")
    pipe.vae._supports_group_offloading = False  # as Stable Audio's Oobleck VAE declares
    with pytest.raises(IncompatibleModeError, match="exclude_components=\\['vae'\\]"):
        memmode.apply(pipe, "model_group_offload", device="cpu", strict=True)
    expected = run(make_pipeline("flux"), "flux", 0)
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="poison")
    assert list(handle.report().placement_notes) == ["vae"]
    assert len([g for g in handle._runtime.groups if g.component == "transformer"]) > 1, "the rest still streams"
    assert_bit_equal(run(pipe, "flux", 0), expected)
    handle.remove()
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="poison", exclude_components=["vae"])
    assert_bit_equal(run(pipe, "flux", 0), expected)
    handle.remove()


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
    before = state_of(target)
    handle = memmode.apply(target, "model_group_offload", device="cpu", storage="poison")
    with pytest.raises(OffloadedWeightReadError, match=r"module \(MismatchOnRead\).*blocks\.1") as info:
        target(torch.randn(1, 4))
    assert isinstance(info.value, RuntimeError) and "found at least two devices" in str(info.value)
    assert handle._runtime.ledger.resident == 0, "a failed call leaves nothing onloaded"
    handle.remove()
    assert_same_state(target, before)


@requires_cuda
def test_an_undeclared_read_outside_forward_names_the_module_on_cuda():
    torch.manual_seed(0)
    target = ReadsOutsideForward()
    handle = memmode.apply(target, "model_group_offload", device="cuda", storage="ram")
    with pytest.raises(OffloadedWeightReadError, match="ReadsOutsideForward"):
        target(torch.randn(2, 16, device="cuda"))
    handle.remove()


@pytest.mark.parametrize("storage", ["poison", "disk"])
def test_an_undeclared_read_outside_forward_is_a_typed_error_on_cpu(storage):
    """On a CPU the placeholder turns such a read into NaN; memmode sees the non-finite result, runs the call
    again under its placeholder trap and names the weight that was read, instead of returning NaN."""
    torch.manual_seed(0)
    target = ReadsOutsideForward()
    before = state_of(target)
    handle = memmode.apply(target, "model_group_offload", device="cpu", storage=storage)
    with pytest.raises(OffloadedWeightReadError, match=r"blocks\.0\.scale\.weight \(group module/blocks\.0\)"):
        target(torch.randn(2, 16))
    handle.remove()
    assert_same_state(target, before)


# -- 4. hooks installed after apply ------------------------------------------------------------------------


def tiny_flux_transformer() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    ).eval()


def flux_inputs():
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(1, 16, 4, generator=g),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g),
        timestep=torch.tensor([1.0]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(8, 3),
        return_dict=False,
    )


def layerwise_cast(model: nn.Module) -> None:
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)


@pytest.mark.parametrize("order", ["after_apply", "before_apply"])
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("placement", SPLITTING[:2] + SPLITTING[3:] + WHOLE, ids=mode_id)
def test_layerwise_casting_composes_with_every_mode(placement, storage, order):
    mode, options = placement
    reference = tiny_flux_transformer()
    layerwise_cast(reference)
    with torch.no_grad():
        expected = reference(**flux_inputs())[0]
        target = tiny_flux_transformer()
        if order == "before_apply":
            layerwise_cast(target)
        handle = memmode.apply(target, mode, device="cpu", storage=storage, **options)
        if order == "after_apply":
            layerwise_cast(target)  # diffusers' documented order: hooks on top of memmode's
        for _ in range(2):
            assert_bit_equal(target(**flux_inputs())[0], expected)
        handle.remove()
        assert_same_state(target, state_of(reference))  # float8 weights, not NaN, not the uncast ones
        assert_bit_equal(target(**flux_inputs())[0], expected)  # diffusers' hooks still work without memmode


def test_another_offloading_scheme_installed_after_apply_is_refused_at_the_next_call():
    target = tiny_flux_transformer()
    with torch.no_grad():
        expected = target(**flux_inputs())[0]
    before = state_of(target)
    handle = memmode.apply(target, "model_group_offload", device="cpu", storage="disk")
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module

    add_hook_to_module(target, AlignDevicesHook(execution_device="cpu"))
    with pytest.raises(IncompatibleModeError, match="accelerate"):
        target(**flux_inputs())
    handle.remove()
    assert_same_state(target, before)
    remove_hook_from_module(target)
    with torch.no_grad():
        assert_bit_equal(target(**flux_inputs())[0], expected)


# -- 5. foreign offloading on a bare module ------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["cpu_offload", "sequential_hooks"])
def test_accelerate_offloading_on_a_bare_module_is_refused_untouched(scheme):
    from accelerate import cpu_offload
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    target = tiny_flux_transformer()
    if scheme == "cpu_offload":
        cpu_offload(target, execution_device="cpu")
    else:  # one hook per leaf, as enable_sequential_cpu_offload leaves them
        add_hook_to_module(target.proj_out, AlignDevicesHook(execution_device="cpu"))
    before = snapshot(target)
    with pytest.raises(IncompatibleModeError, match="accelerate"):
        memmode.apply(target, "model_group_offload", device="cpu", storage="disk")
    assert snapshot(target) == before


# -- 6. TorchScript -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["whole", "submodule"])
def test_torchscript_targets_are_refused_untouched(where, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    if where == "whole":
        target = torch.jit.script(model)
    else:
        target = nn.Sequential(torch.jit.script(model), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    expected = target(x)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(IncompatibleModeError, match="TorchScript"):
        memmode.apply(target, "model_group_offload", device="cpu", storage="disk", offload_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert torch.equal(target(x), expected)


# -- 7. a re-apply that fails half-way --------------------------------------------------------------------------


class FailingSession(PoisonSession):
    """Accepts the reservation, then fails on the third group it is asked to store (disk full, I/O error)."""

    def put(self, key, tensors, readable=frozenset()):
        if len(self.groups) == 2:
            raise StorageUnavailableError(f"test storage: no room left for {key}")
        return super().put(key, tensors, readable)


class FailingStorage(Storage):
    name = "failing"
    description = "test storage: fails half-way through storing"

    def open(self, *, device, offload_dir, options):
        return FailingSession()


class FailingPlugin:
    @hookimpl
    def memmode_register_storages(self, register):
        register(FailingStorage())


@pytest.mark.parametrize("first", ["disk", "poison", "mmap"])
def test_a_failed_re_apply_leaves_the_previous_mode_active(first):
    expected = run(make_pipeline("flux"), "flux", 0)
    pipe = make_pipeline("flux")
    before = {name: state_of(m) for name, m in pipe.components.items() if isinstance(m, nn.Module)}
    old = memmode.apply(pipe, "model_group_offload", device="cpu", storage=first)
    with memmode.temporary_plugin(FailingPlugin(), name="failing", distribution="tests"):
        with pytest.raises(StorageUnavailableError, match="no room left"):
            memmode.apply(pipe, "sequential_cpu_offload", device="cpu", storage="failing")
    assert old.active and pipe._memmode_handle is old and pipe.transformer._memmode_handle is old
    assert old.mode == "model_group_offload" and old.storage == first
    assert_bit_equal(run(pipe, "flux", 0), expected)
    assert old.report().onloads > 0
    old.remove()
    assert hook_count(pipe) == 0
    for name, state in before.items():
        assert_same_state(pipe.components[name], state)


# -- 8. leaving components out of a placement ----------------------------------------------------------------------


@pytest.mark.parametrize("storage", ["poison", "disk"])
def test_excluded_components_are_left_where_they_are(storage):
    expected = run(make_pipeline("flux"), "flux", 0)
    pipe = make_pipeline("flux")
    vae_before = snapshot(pipe)
    handle = memmode.apply(
        pipe, "model_group_offload", device="cpu", storage=storage, exclude_components=["vae", "text_encoder"]
    )
    assert {g.component for g in handle._runtime.groups} == {"transformer", "text_encoder_2"}
    after = snapshot(pipe)
    for key, value in vae_before.items():
        if isinstance(key, tuple) and key[0] in ("vae", "text_encoder"):
            assert after[key] == value, key  # same tensors, same memory, no hooks, no handle
    assert_bit_equal(run(pipe, "flux", 0), expected)
    handle.remove()


def test_excluded_components_with_a_quantizer_and_with_auto():
    with memmode.temporary_plugin(Int8Plugin(), name="qint8", distribution="tests"):
        pipe = make_pipeline("flux")
        with pytest.raises(InvalidOptionError, match="no denoiser"):  # left out: not a default target either
            memmode.apply(pipe, "model_cpu_offload_and_qint8", device="cpu", exclude_components=["transformer"])
        handle = memmode.apply(
            pipe,
            "model_cpu_offload_and_qint8",
            device="cpu",
            exclude_components=["transformer"],
            components=["transformer"],
        )
        assert set(handle.quantized) == {"transformer"}  # named explicitly: quantized, but not placed
        assert "transformer" not in {g.component for g in handle._runtime.groups}
        handle.remove()
    pipe = make_pipeline("flux")
    handle = memmode.apply(pipe, "auto", device="cpu", exclude_components=["vae"])
    assert "vae" not in {g.component for g in handle._runtime.groups}
    handle.remove()
    assert all(e.peak_device_bytes > 0 for e in memmode.plan(pipe, device="cpu", exclude_components=["vae"]))


@pytest.mark.parametrize(
    "names, match",
    [
        (["nope"], "no module component named 'nope'"),
        (["vae", "transformer", "text_encoder", "text_encoder_2"], "leaves no component"),
        ([3], "string"),
    ],
)
def test_exclude_components_refusals_are_typed_and_touch_nothing(names, match):
    pipe = make_pipeline("flux")
    before = snapshot(pipe)
    with pytest.raises(InvalidOptionError, match=match):
        memmode.apply(pipe, "model_group_offload", device="cpu", exclude_components=names)
    assert snapshot(pipe) == before


def test_exclude_components_on_a_bare_module_is_refused():
    target = make_tied("nested_tied")
    with pytest.raises(InvalidOptionError, match="bare module"):
        memmode.apply(target, "model_group_offload", device="cpu", exclude_components=["module"])
    assert hook_count(target) == 0
