"""Every mode on every tiny real diffusers pipeline of the suite (``tiny_pipelines.ALL_FAMILIES``, 51 families:
UNet, DiT, video, audio, prior, cascade, pixel-space and 3D pipelines built from diffusers'
``get_dummy_components()``): no refusal where a user expects it to run, and no silent wrong number.

Each lossless case checks what "lossless" promises: two calls (call seeds 0 and 1) equal, bit for bit and
finite, those of a fresh pipeline without memmode (built the same way: ``test_tiny_pipelines`` checks that the
builds are deterministic and that every component counts); after the call nothing the placement streams is left
on the device (diffusers frees its models at the end of a call); what core adjusted is said
(``report().placement_notes``: a component whose model declares ``_supports_group_offloading = False`` moved
whole, one the pipeline lists in ``_exclude_from_cpu_offload`` kept on the device); after ``handle.remove()``
every parameter and buffer is bit-equal, in its dtype and on the CPU, to a fresh build's; and no file is left
behind. Under the ``poison`` storage the calls run inside the placeholder trap: any offloaded placeholder that
reaches any torch function fails the case, naming the tensor, even where NaN would not reach the output.

A pipeline loaded from community files (``COMMUNITY``: the GGUF Wan 2.2 of ``community_pipelines``) takes the same
lossless checks over the same placements x storages and slices, in a test of its own: what it must equal is its
own files' ``model_full_load`` (outputs, and the tensors ``remove()`` restores, packed layers included).

Quantized cases (``model_group_offload_and_qfloat8``, ``model_cpu_offload_and_qfloat4``) quantize the
pipeline's denoisers by default, whatever they are called, must stay finite, and must be close to full
precision; and every quantizer stays finite over several build seeds of every family.

The sweep is large (about 1100 cases), so a CI run takes one slice of it (``helpers.in_slice``: the slice
follows the commit, and every family runs in every slice); ``MEMMODE_TEST_FULL_MATRIX=1`` runs
all of it, and ``MEMMODE_TEST_ROTATION=k`` a given slice.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

import community_pipelines
import helpers
import memmode_core as memmode
from helpers import (
    OFFLOADING_PLACEMENTS,
    SLICES,
    STORAGES,
    assert_bit_equal,
    assert_same_tensors,
    files_under,
    full_matrix,
    in_slice,
    module_components,
    placement_id,
    rotation,
    sqnr_db,
    tensors_of,
)
from memmode_core.contracts.group_specs import Policy
from memmode_core.contracts.targets import takes_timestep
from memmode_core.engine.standins.placeholders import PlaceholderTrap
from tiny_pipelines import ALL_FAMILIES as FAMILIES
from tiny_pipelines import full_load_outputs, two_calls

NAMES = sorted(FAMILIES)
#: placements that cut a component into several groups
SPLITTING = ("model_group_offload", "sequential_cpu_offload")
QUANTIZED = [("model_group_offload_and_qfloat8", "ram"), ("model_cpu_offload_and_qfloat4", "mmap")]
#: (family, quantizer) refused with "nothing to quantize": the tiny Sana transformer's in-block layers are all
#: narrower than NVFP4's 16-input blocks (real checkpoints' are not). Any other refusal fails its case.
TOO_NARROW = {("sana", "qfloat4")}
SEEDS = range(6)


def _has_text_encoder(family: str) -> bool:
    return any(name.startswith("text_encoder") for name in module_components(_fresh(family)[0]))


def _lossless_cases() -> list:
    cases = []
    for index, family in enumerate(NAMES):
        combinations = [(mode, options, storage) for mode, options in OFFLOADING_PLACEMENTS for storage in STORAGES]
        for position, (mode, options, storage) in enumerate(combinations):
            if in_slice(index, position):
                cases.append(
                    pytest.param(
                        family, mode, options, storage, id=f"{family}-{placement_id((mode, options))}-{storage}"
                    )
                )
    return cases


#: pipelines loaded with components given as community files (``community_pipelines``), by family name: the
#: family's pipeline (its ``folder`` and ``files_kwargs()``) and the tiny family it runs as
COMMUNITY = {"wan22-gguf": (community_pipelines.gguf_pipeline, community_pipelines.FAMILY)}


def _community_cases() -> list:
    """The lossless cases of the community families: sliced as if they followed ``NAMES`` in the sweep."""
    combinations = [(mode, options, storage) for mode, options in OFFLOADING_PLACEMENTS for storage in STORAGES]
    return [
        pytest.param(family, mode, options, storage, id=f"{family}-{placement_id((mode, options))}-{storage}")
        for index, family in enumerate(sorted(COMMUNITY), start=len(NAMES))
        for position, (mode, options, storage) in enumerate(combinations)
        if in_slice(index, position)
    ]


def _quantized_cases() -> list:
    return [
        pytest.param(family, mode, storage, id=f"{family}-{mode}-{storage}")
        for index, family in enumerate(NAMES)
        for position, (mode, storage) in enumerate(QUANTIZED)
        if in_slice(index, 2 * position)
    ]


pytestmark = pytest.mark.usefixtures("poison_storage")


_FRESH: dict[str, tuple[object, dict[str, torch.Tensor]]] = {}


def _fresh(family: str):
    """A fresh build never run nor placed, and its tensors: what ``remove()`` must restore."""
    if family not in _FRESH:
        pipe = FAMILIES[family].make(0)
        _FRESH[family] = (pipe, tensors_of(pipe))
    return _FRESH[family]


def _two_calls(pipe, family: str, trap: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``two_calls``, inside the placeholder trap with ``trap``."""
    with PlaceholderTrap() if trap else contextlib.nullcontext():
        return two_calls(pipe, family)


def assert_weights_restored(pipe, family: str) -> None:
    """Every parameter and buffer as a fresh build holds it, but those the pipeline itself rewrites."""
    assert_same_tensors(tensors_of(pipe), _fresh(family)[1], skip=FAMILIES[family].rewritten)


def _frees_at_the_end(pipe) -> bool:
    """Whether the pipeline's ``__call__`` ends with diffusers' ``maybe_free_model_hooks`` (a few old ones do not,
    and diffusers' own offloading leaves their last model on the device too)."""
    try:
        return "maybe_free_model_hooks" in inspect.getsource(type(pipe).__call__)
    except (OSError, TypeError):
        return False


def _expected_notes(pipe, mode: str, options: dict, handle) -> dict[str, str]:
    """Which components core must have adjusted, and the word each note must contain."""
    modules = module_components(pipe)
    placed = {g.component for g in handle.runtime.groups}
    expected = {}
    if mode != "model_full_load":
        for name in getattr(type(pipe), "_exclude_from_cpu_offload", None) or ():
            if name in placed and not (mode == "text_encoder_offload" and not name.startswith("text_encoder")):
                expected[name] = "kept on the device"
    if mode in SPLITTING:
        for name, module in modules.items():
            if getattr(module, "_supports_group_offloading", True) is False and name not in expected:
                expected[name] = "moved whole"
    return expected


def test_the_sweep_covers_every_kind_and_every_family_runs_in_every_slice(monkeypatch):
    kinds = {spec.kind for spec in FAMILIES.values()}
    assert len(FAMILIES) >= 40
    assert {"unet", "dit", "video", "audio", "prior", "cascade"} <= kinds
    monkeypatch.delenv("MEMMODE_TEST_FULL_MATRIX", raising=False)
    taken: dict[str, set[int]] = {}
    for slice_ in range(SLICES):
        monkeypatch.setattr(helpers, "rotation", lambda slice_=slice_: slice_)
        families = {param.values[0] for param in _lossless_cases()}
        assert families == set(NAMES), f"slice {slice_} leaves out {sorted(set(NAMES) - families)}"
        for param in _lossless_cases():
            taken.setdefault(param.id, set()).add(slice_)
    combinations = len(OFFLOADING_PLACEMENTS) * len(STORAGES)
    assert len(taken) == len(NAMES) * combinations, "every case runs in some slice"
    assert all(len(slices) == 1 for slices in taken.values()), "each case in one slice only"
    # the community-file families (their own test, below) too
    community: dict[str, set[int]] = {}
    for slice_ in range(SLICES):
        monkeypatch.setattr(helpers, "rotation", lambda slice_=slice_: slice_)
        assert {param.values[0] for param in _community_cases()} == set(COMMUNITY), f"slice {slice_}"
        for param in _community_cases():
            community.setdefault(param.id, set()).add(slice_)
    assert len(community) == len(COMMUNITY) * combinations and not set(community) & set(taken)
    assert all(len(slices) == 1 for slices in community.values()), "each case in one slice only"


# -- the sweep ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family, mode, options, storage", _lossless_cases())
def test_lossless_mode_is_bit_exact_frees_the_device_and_restores_the_weights(
    family, mode, options, storage, private_tmp
):
    expected = full_load_outputs(family)
    pipe = FAMILIES[family].make(0)
    if mode == "text_encoder_offload" and not _has_text_encoder(family):
        with pytest.raises(memmode.IncompatibleModeError, match="text_encoder"):
            memmode.apply(pipe, mode, device="cpu", storage=storage, **options)
        return
    handle = memmode.apply(pipe, mode, device="cpu", storage=storage, **options)
    for index, (got, want) in enumerate(zip(_two_calls(pipe, family, trap=storage == "poison"), expected, strict=True)):
        assert_bit_equal(got, want, f"call {index + 1}")
    report = handle.report()
    notes = _expected_notes(pipe, mode, options, handle)
    assert set(report.placement_notes) == set(notes), report.placement_notes
    for name, words in notes.items():
        assert words in report.placement_notes[name]
    if _frees_at_the_end(pipe):
        kept = sum(g.nbytes for g in handle.runtime.groups if g.policy is Policy.RESIDENT)
        assert report.resident_device_bytes == kept, "the pipeline call left streamed weights on the device"
    handle.remove()
    assert_weights_restored(pipe, family)
    assert files_under(private_tmp) == [], "remove() leaves no file behind"


@pytest.fixture(scope="module")
def file_loaded() -> dict[str, tuple]:
    """Each community family's pipeline loaded under ``model_full_load``: its two calls (what every lossless mode
    on the same files must give), its tensors right after the load (what ``remove()`` must restore: the files'
    packed layers' parts, the rest as loaded) and its packed layers by component. A module fixture, so made
    before any test's ``private_tmp``: the folders and files the pipelines are made of lie outside it."""
    loaded = {}
    for family, (made, tiny) in COMMUNITY.items():
        pipe = community_pipelines.load(made(), "model_full_load").target
        pipe.set_progress_bar_config(disable=True)
        packed = {name: community_pipelines.packed_layers(module) for name, module in module_components(pipe).items()}
        loaded[family] = (two_calls(pipe, tiny), tensors_of(pipe), packed)
    return loaded


@pytest.mark.slow
@pytest.mark.parametrize("family, mode, options, storage", _community_cases())
def test_a_pipeline_loaded_from_community_files_is_bit_exact_frees_the_device_and_restores_the_weights(
    family, mode, options, storage, file_loaded, private_tmp
):
    """The lossless checks of the sweep on a pipeline whose denoisers are given as community files (a GGUF
    Wan 2.2), over the same placements x storages and slices.

    A test of its own rather than a family of the sweep's: such a pipeline is not built by ``make(seed)`` and
    placed by ``apply``, it is loaded from its files by ``load`` (``load(..., mode)`` is the only road that keeps
    the files' layers packed), so what its calls and its restored weights must equal is the files' own: the two
    calls of the same files under ``model_full_load``, and the tensors right after that load (the packed layers'
    parts, bit for bit, still packed) rather than a fresh build's."""
    expected, loaded, packed = file_loaded[family]
    made, tiny = COMMUNITY[family]
    handle = community_pipelines.load(made(), mode, storage=storage, **options)
    pipe = handle.target
    pipe.set_progress_bar_config(disable=True)
    for index, (got, want) in enumerate(zip(_two_calls(pipe, tiny, trap=storage == "poison"), expected, strict=True)):
        assert_bit_equal(got, want, f"call {index + 1}")
    report = handle.report()
    notes = _expected_notes(pipe, mode, options, handle)
    assert set(report.placement_notes) == set(notes), report.placement_notes
    for name, words in notes.items():
        assert words in report.placement_notes[name]
    if _frees_at_the_end(pipe):
        kept = sum(g.nbytes for g in handle.runtime.groups if g.policy is Policy.RESIDENT)
        assert report.resident_device_bytes == kept, "the pipeline call left streamed weights on the device"
    handle.remove()
    assert_same_tensors(tensors_of(pipe), loaded)
    assert {n: community_pipelines.packed_layers(m) for n, m in module_components(pipe).items()} == packed
    assert files_under(private_tmp) == [], "remove() leaves no file behind"


@pytest.mark.slow
@pytest.mark.parametrize("family, mode, storage", _quantized_cases())
def test_quantized_mode_quantizes_the_denoisers_and_stays_close(family, mode, storage, private_tmp):
    expected = full_load_outputs(family)
    pipe = FAMILIES[family].make(0)
    denoisers = sorted(name for name, module in module_components(pipe).items() if takes_timestep(module))
    assert denoisers, f"{family} has no component taking a timestep"
    try:
        handle = memmode.apply(pipe, mode, device="cpu", storage=storage)
    except memmode.IncompatibleModeError as refusal:
        assert (family, mode.rsplit("_and_", 1)[1]) in TOO_NARROW, f"refused: {refusal}"
        assert "has nothing to quantize" in str(refusal)
        assert_weights_restored(pipe, family)
        return
    assert (family, mode.rsplit("_and_", 1)[1]) not in TOO_NARROW, "quantizes now: update TOO_NARROW"
    assert sorted(handle.quantized) == denoisers
    assert sorted(handle.report().quantization) == denoisers
    got = _two_calls(pipe, family, trap=False)
    for index, (g, e) in enumerate(zip(got, expected), start=1):
        assert torch.isfinite(g).all(), f"call {index}: non-finite under {mode}"
        if FAMILIES[family].chaotic is None:
            # tiny random models amplify quantization error far more than trained ones (a saturated cascade
            # decoder turns it into whole flipped pixels): what this guards is "close", not a quality figure
            assert sqnr_db(e, g) > 3.0, f"call {index}: {sqnr_db(e, g):.1f} dB from full precision"
    handle.remove()


@pytest.mark.slow
@pytest.mark.parametrize("quantizer", ["qfloat8", "qfloat4"])
@pytest.mark.parametrize("family", NAMES)
def test_every_quantizer_stays_finite_over_build_seeds(family, quantizer):
    """Several builds (different random weights) of every family, each quantized and called once: finite
    wherever full precision is. A run takes two of the seeds; a full run all of them."""
    spec = FAMILIES[family]
    index = NAMES.index(family)
    seeds = list(SEEDS) if full_matrix() else [s for s in SEEDS if (index + s) % 3 == rotation() % 3][:2]
    for seed in seeds:
        pipe = spec.make(seed)
        try:
            memmode.apply(pipe, f"model_full_load_and_{quantizer}", device="cpu")
        except memmode.IncompatibleModeError as refusal:
            assert (family, quantizer) in TOO_NARROW and "has nothing to quantize" in str(refusal), str(refusal)
            continue
        output = spec.run(pipe, 0)
        assert torch.isfinite(output).all(), f"build seed {seed}: non-finite output under {quantizer}"
